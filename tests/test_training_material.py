"""Hand-written drafter training material (data/training/*.json): schema, minimum sizes, no duplicates,
and no 8-word overlap with the benchmark prompt suites (so drafters are never trained on benchmark text)."""

from __future__ import annotations

import json
import re
from importlib.resources import files
from typing import Any

import pytest

from adaspec.bench.workloads import CATEGORIES, EXTRA_SUITES

SHINGLE = 8
TRAINING = files("adaspec") / "data" / "training"
PROMPTS = files("adaspec") / "data" / "prompts"


def _load(name: str) -> dict[str, Any]:
    return json.loads((TRAINING / name).read_text(encoding="utf-8"))


def _shingles(text: str) -> set[tuple[str, ...]]:
    words = re.findall(r"[a-z0-9']+", text.lower())
    return {tuple(words[i:i + SHINGLE]) for i in range(len(words) - SHINGLE + 1)}


@pytest.fixture(scope="module")
def benchmark_shingles() -> set[tuple[str, ...]]:
    out: set[tuple[str, ...]] = set()
    suites = [p for p in PROMPTS.iterdir() if p.name.endswith(".jsonl")]
    assert {p.name for p in suites} == {f"{c}.jsonl" for c in (*CATEGORIES, *EXTRA_SUITES)}  # long-context too
    for suite in suites:
        for line in suite.read_text(encoding="utf-8").splitlines():
            if line.strip():
                for turn in json.loads(line)["turns"]:
                    out |= _shingles(turn)
    assert out
    return out


def _assert_unique(items: list[Any], what: str) -> None:
    keys = [json.dumps(x, sort_keys=True) for x in items]
    dupes = {k for k in keys if keys.count(k) > 1}
    assert not dupes, f"duplicate {what}: {sorted(dupes)[:3]}"


def _assert_strings(items: list[Any], what: str, minimum: int) -> None:
    assert isinstance(items, list) and len(items) >= minimum, f"{what}: {len(items)} < {minimum}"
    assert all(isinstance(x, str) and x.strip() for x in items), what
    _assert_unique(items, what)


def _chat_texts(chat: dict[str, Any]) -> list[str]:
    texts = [g["template"].format(x=s) for g in chat["groups"] for s in g["slots"]]
    return texts + chat["questions"] + chat["texts_to_edit"]


def test_chat_schema_and_counts() -> None:
    chat = _load("chat.json")
    groups = chat["groups"]
    assert len(groups) >= 30
    _assert_unique([g["template"] for g in groups], "chat template")
    for g in groups:
        t = g["template"]
        assert t.count("{x}") == 1 and t.count("{") == 1 and t.count("}") == 1, t
        assert 15 <= len(g["slots"]) <= 30, t
        _assert_strings(g["slots"], f"slots of {t!r}", 15)
    assert sum(len(g["slots"]) for g in groups) >= 600
    _assert_strings(chat["questions"], "chat questions", 250)
    _assert_strings(chat["texts_to_edit"], "texts_to_edit", 40)
    for text in chat["texts_to_edit"]:
        assert 40 <= len(text.split()) <= 90, text[:60]


def test_translation_schema_and_counts() -> None:
    tr = _load("translation.json")
    _assert_strings(tr["sentences"], "sentences", 300)
    _assert_strings(tr["paragraphs"], "paragraphs", 40)
    for s in tr["sentences"]:
        assert 6 <= len(s.split()) <= 30, s
    structured = tr["structured"]
    assert len(structured) >= 80
    _assert_unique([x["text"] for x in structured], "structured translation text")
    for x in structured:
        assert set(x) == {"instruction", "text"}, x
        ins = x["instruction"]
        rest = ins.replace("{lang}", "")  # {lang} (each target language) is the only placeholder
        assert ins.count("{lang}") <= 1 and "{" not in rest and "}" not in rest, ins
        assert 5 <= len(x["text"].split()) <= 150, x["text"][:60]
    into_english = [x for x in structured if "{lang}" not in x["instruction"]]
    assert 15 <= len(into_english) <= len(structured) // 2
    assert all("English" in x["instruction"] for x in into_english)


def test_summarization_schema_and_counts() -> None:
    summ = _load("summarization.json")
    passages = summ["passages"]
    assert len(passages) >= 70
    _assert_unique([p["text"] for p in passages], "passage")
    for p in passages:
        assert 90 <= len(p["text"].split()) <= 220, p["text"][:60]
        assert 2 <= len(p["questions"]) <= 3, p["text"][:60]
        _assert_strings(p["questions"], "passage questions", 2)
    documents = summ["documents"]
    assert len(documents) >= 120
    assert len({d["kind"] for d in documents}) >= 12  # many genres, not one template
    _assert_unique([d["text"] for d in documents], "document")
    for d in documents:
        assert set(d) == {"kind", "text", "tasks", "questions"}, sorted(d)
        assert 80 <= len(d["text"].split()) <= 220, d["text"][:60]
        _assert_strings(d["tasks"], "document tasks", 2)
        _assert_strings(d["questions"], "document questions", 2)
        assert len(d["tasks"]) <= 4 and len(d["questions"]) <= 3, d["text"][:60]
    rag = summ["rag"]
    assert len(rag) >= 100
    _assert_unique([[r["passages"], r["question"]] for r in rag], "rag item")
    for r in rag:
        assert set(r) == {"instruction", "passages", "question"}, sorted(r)
        _assert_strings(r["passages"], "rag passages", 1)
        assert len(r["passages"]) <= 3 and 40 <= sum(len(t.split()) for t in r["passages"]) <= 180, r["question"]
        assert r["instruction"].strip() and r["question"].strip()


def test_code_schema_and_counts() -> None:
    code = _load("code.json")
    tasks = code["tasks"]
    assert len(tasks) >= 200
    _assert_unique([t["name"] for t in tasks], "task name")
    _assert_unique([t["desc"] for t in tasks], "task desc")
    for t in tasks:
        assert set(t) == {"name", "args", "desc"}, t
        assert re.fullmatch(r"[a-z][a-z0-9_]*", t["name"]), t["name"]
        assert t["desc"] and t["desc"][0].islower() and not t["desc"].endswith("."), t["desc"]
    snippets = code["snippets"]
    assert len(snippets) >= 60
    _assert_unique(snippets, "snippet")
    for s in snippets:
        assert s["lang"] in {"python", "javascript"} and "```" not in s["code"]
        assert 5 <= s["code"].count("\n") <= 25, s["code"][:40]
        if s["lang"] == "python":
            compile(s["code"], "<snippet>", "exec")  # clumsy or buggy, but valid syntax
    assert any(s["lang"] == "javascript" for s in snippets)
    _assert_strings(code["edit_instructions"], "edit_instructions", 25)
    _assert_strings(code["questions"], "code questions", 60)


def test_math_schema_and_counts() -> None:
    problems = _load("math.json")["problems"]
    _assert_strings(problems, "math problems", 300)
    for p in problems:
        assert 8 <= len(p.split()) <= 80, p[:60]


def _all_texts() -> list[tuple[str, str]]:
    chat, tr, summ, code = (_load(n) for n in ("chat.json", "translation.json", "summarization.json", "code.json"))
    out = [("chat", t) for t in _chat_texts(chat)]
    out += [("translation", t) for t in tr["sentences"] + tr["paragraphs"]]
    out += [("translation", t) for x in tr["structured"] for t in (x["instruction"], x["text"])]
    out += [("summarization", t) for p in summ["passages"] for t in [p["text"], *p["questions"]]]
    out += [("summarization", t) for d in summ["documents"] for t in [d["text"], *d["tasks"], *d["questions"]]]
    out += [("summarization", t) for r in summ["rag"] for t in [r["instruction"], *r["passages"], r["question"]]]
    out += [("code", f"Write a Python function `{t['name']}({t['args']})` that {t['desc']}.") for t in code["tasks"]]
    out += [("code", t) for t in [s["code"] for s in code["snippets"]] + code["edit_instructions"] + code["questions"]]
    out += [("math", t) for t in _load("math.json")["problems"]]
    return out


def test_no_eight_word_overlap_with_benchmark(benchmark_shingles: set[tuple[str, ...]]) -> None:
    texts = _all_texts()
    assert len(texts) > 2200
    hits = [(kind, text[:70], " ".join(sorted(_shingles(text) & benchmark_shingles)[0]))
            for kind, text in texts if _shingles(text) & benchmark_shingles]
    assert not hits, f"{len(hits)} entries share 8 words with a benchmark prompt, e.g. {hits[:3]}"


def test_overlap_check_catches_a_copied_prompt(benchmark_shingles: set[tuple[str, ...]]) -> None:
    first = json.loads((PROMPTS / "qa.jsonl").read_text(encoding="utf-8").splitlines()[0])["turns"][0]
    assert _shingles("Please answer: " + first) & benchmark_shingles


def test_translation_sources_schema_counts_and_no_benchmark_text(benchmark_shingles) -> None:
    sources = _load("translation_sources.json")
    assert set(sources) >= {"French", "Spanish", "German", "Italian", "Portuguese"}
    texts: list[str] = []
    for lang, block in sources.items():
        _assert_strings(block["sentences"], f"{lang} sentences", 60)
        _assert_strings(block["paragraphs"], f"{lang} paragraphs", 20)
        texts += block["sentences"] + block["paragraphs"]
    _assert_unique(texts, "translation sources")
    for text in texts:
        assert not (_shingles(text) & benchmark_shingles), text
