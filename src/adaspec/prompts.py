"""A small built-in prompt set for ``adaspec bench`` (written for adaspec, not copied).

It mixes copy-heavy work (editing, extraction, summarising a given passage), where lookup
drafters shine, with open-ended writing, code and math, where they do not.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BenchPrompt:
    category: str
    text: str


_PASSAGE = (
    "The Larkfield community library opened in 1962 in a converted railway depot. For its first "
    "decade it lent books only on weekends, staffed by volunteers from the local school. In 1975 the "
    "town council funded two full-time librarians and extended opening hours to six days a week. A "
    "reading room for children was added in 1988, and in 2004 the library installed twelve public "
    "computers. Today it holds about forty thousand volumes and runs a weekly storytelling hour."
)

_CODE = '''def load_users(path):
    users = []
    with open(path) as f:
        for line in f:
            name, age, email = line.strip().split(",")
            users.append({"name": name, "age": int(age), "email": email})
    return users
'''

BUILTIN_PROMPTS: tuple[BenchPrompt, ...] = (
    BenchPrompt("editing", "Fix the spelling mistakes in this text and return the corrected text "
                "only:\n\nThe comittee will meet on tuesday to discus the new budjet. Every "
                "departement must send there report before the meeting, and late reports will not "
                "be acepted."),
    BenchPrompt("code-editing", "Rewrite this Python function so that it skips blank lines and "
                f"strips spaces around each field. Return the full function.\n\n{_CODE}"),
    BenchPrompt("summarization", f"Summarize the following passage in three sentences.\n\n{_PASSAGE}"),
    BenchPrompt("rag-qa", f"Answer using only the passage. When did the library get public "
                f"computers, and how many?\n\nPassage: {_PASSAGE}"),
    BenchPrompt("code", "Write a Python function `is_palindrome(s)` that ignores case and "
                "punctuation, with a docstring and three example calls."),
    BenchPrompt("math", "A train travels 180 km in 2 hours and then 120 km in 1.5 hours. What is "
                "its average speed for the whole trip? Explain step by step."),
    BenchPrompt("writing", "Write a short story of about 120 words about a lighthouse keeper who "
                "finds a message in a bottle."),
    BenchPrompt("translation", "Translate into French: 'The weather was cold, so we stayed inside, "
                "drank hot tea and played cards until midnight.'"),
)
