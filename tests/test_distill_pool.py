"""Self-distillation data, domain training prompts, domain datastores and the pool builder.

Tiny random Llamas (``conftest.make_tiny_model``), token-id prompts or a word-level tokenizer
without a chat template; the pool builder runs with a stub trainer (and, when the trainable
drafters are installed, once with the real one for a couple of steps).
"""

from __future__ import annotations

import json
import re
import shutil
from importlib import resources
from pathlib import Path

import numpy as np
import pytest
import torch
import typer
from typer.testing import CliRunner

from conftest import make_tiny_model, word_tokenizer

from adaspec.training.distill import (DISTILL_FORMAT, DOMAINS, build_datastore, datastore_command, distill,
                             distill_command, distill_run, domain_prompts, load_distilled, read_prompt_file)
from adaspec.training.drafters import evaluate_drafters
from adaspec.drafters import SuffixDrafter, build_drafter
from adaspec.training import pool as pool_module
from adaspec.errors import AdaspecError, ConfigError, ModelLoadError, PromptError, PromptSetChangedError
from adaspec.models import as_loaded, target_fingerprint
from adaspec.training.pool import (DEFAULT_POOL_PROMPTS, DEFAULT_POOL_TRAIN_OPTS, GENERALIST, SPECIALIST_TRAIN_OPTS,
                          PoolManifest, build_pool, heldout_table, load_manifest, parse_prompt_counts, pool_command,
                          pool_specs, prompt_counts, specialist_margins)
from adaspec.bench.workloads import BUILTIN_PROMPTS
from adaspec.training.prompts import material

VOCAB = 32
WORDS = ["<unk>", "the", "a", "cat", "dog", "sat", "on", "mat", "and", "ran", "to", "house", "big", "small",
         "red", "blue", "saw", "bird", "tree", "under", "over", "it", "was", "is", "green", "old", "new", "sun",
         "moon", "day", "night", "<eos>"]
PROMPTS = [(f"p{i}", [(3 * i + j) % (VOCAB - 2) + 1 for j in range(2 + i % 4)]) for i in range(7)]


def _target(seed: int = 0, tokenizer=None, name: str | None = None, eos: int | None = None):
    model = make_tiny_model(seed, VOCAB, init_std=0.3, lm_head_scale=2.0)
    if eos is not None:
        model.generation_config.eos_token_id = eos
    return as_loaded(model, tokenizer=tokenizer, name=name or f"tiny{seed}")


@torch.no_grad()
def _greedy(target, prompt: list[int], n: int, eos: int | None = None) -> list[int]:
    """Unbatched greedy decoding without a cache: the independent reference."""
    seq, out = list(prompt), []
    for _ in range(n):
        tok = int(target.model(input_ids=torch.tensor([seq])).logits[0, -1].argmax())
        out.append(tok)
        seq.append(tok)
        if tok == eos:
            break
    return out


def _lines(path: Path) -> list[dict]:
    return [json.loads(ln) for ln in (path / "samples.jsonl").read_text().splitlines() if ln.strip()]


# -- domain prompts --------------------------------------------------------------------------------
def test_domain_prompts_deterministic_distinct_and_extendable():
    seen: dict[str, str] = {}
    for domain in DOMAINS:
        a = domain_prompts(domain, 120)
        assert a == domain_prompts(domain, 120)
        assert len(a) == 120 and len({t for _, t in a}) == 120 and len({i for i, _ in a}) == 120
        assert all(i.startswith(f"{domain}-s0-") for i, _ in a)
        assert domain_prompts(domain, 125)[:120] == a  # a larger set extends a smaller one
        assert domain_prompts(domain, 120, seed=1) != a
        for _, text in a:
            assert text not in seen, (domain, seen.get(text))
            seen[text] = domain
    with pytest.raises(ConfigError, match="distinct training prompts"):
        domain_prompts("chat", 10_000)
    with pytest.raises(ConfigError, match="unknown training domain"):
        domain_prompts("poetry", 5)


def _shingles(text: str, k: int = 8) -> set[tuple[str, ...]]:
    words = re.findall(r"[a-z0-9']+", text.lower())
    return {tuple(words[i: i + k]) for i in range(len(words) - k + 1)}


def test_domain_prompts_share_no_8_word_run_with_the_bench_suites():
    bench = [p.text for p in BUILTIN_PROMPTS]
    folder = resources.files("adaspec") / "data" / "prompts"
    if folder.is_dir():
        for f in folder.iterdir():
            if f.name.endswith(".jsonl"):
                bench += [t for ln in f.read_text(encoding="utf-8").splitlines() if ln.strip()
                          for t in json.loads(ln)["turns"]]
    bench_shingles = set().union(*map(_shingles, bench))
    assert len(bench_shingles) > 100
    for domain in DOMAINS:
        for pid, text in domain_prompts(domain, 400):
            assert not (_shingles(text) & bench_shingles), (pid, text)


def test_domain_prompts_mix_their_sources_in_proportion():
    """Any prefix keeps the mix: e.g. a quarter of translation prompts are structured requests."""
    structured = [x["text"] for x in material("translation")["structured"]]
    for n in (100, 400):
        texts = [t for _, t in domain_prompts("translation", n)]
        share = sum(any(t.endswith("\n\n" + x) for x in structured) for t in texts) / n
        assert 0.12 < share < 0.4, share
    code = [t for _, t in domain_prompts("code", 400)]
    edits = sum("\n" in t for t in code) / len(code)  # only code to edit spans several lines
    assert 0.2 < edits < 0.5, edits
    written = set(material("math")["problems"])
    math = [t for _, t in domain_prompts("math", 400)]
    share = sum(t in written for t in math) / len(math)  # hand-written half, seeded arithmetic half
    assert 0.4 < share < 0.6, share
    summ = [t for _, t in domain_prompts("summarization", 400)]
    rag = sum("Passage: " in t or "Passage 1: " in t for t in summ) / len(summ)
    assert 0.15 < rag < 0.4, rag  # multi-passage retrieval questions, a quarter


def test_read_prompt_file_formats(tmp_path):
    jl = tmp_path / "p.jsonl"
    jl.write_text('{"id": "a", "text": "hello"}\n{"question_id": "b", "turns": ["first", "second"]}\n')
    assert read_prompt_file(jl) == [("a", "hello"), ("b", "first")]
    txt = tmp_path / "p.txt"
    txt.write_text("one\n\ntwo\n")
    assert read_prompt_file(txt) == [("p-0001", "one"), ("p-0003", "two")]
    (tmp_path / "bad.jsonl").write_text('{"id": "a"}\n')
    with pytest.raises(PromptError, match="needs a non-empty"):
        read_prompt_file(tmp_path / "bad.jsonl")


# -- distillation --------------------------------------------------------------------------------
def test_distill_writes_the_format_and_greedy_matches_unbatched_decoding(tmp_path):
    probe = _target(0)
    eos = _greedy(probe, PROMPTS[0][1], 3)[2]  # a token greedy decoding emits early: some rows stop
    target = _target(0, eos=eos)
    out = distill(target, PROMPTS, tmp_path / "set", domain="toy", temperatures=(0.0, 0.7),
                  max_new_tokens=10, batch_size=3)
    meta = json.loads((out / "meta.json").read_text())
    assert set(meta) == {"format", "target", "domain", "temperatures", "max_new_tokens", "created", "n_samples"}
    assert meta["format"] == DISTILL_FORMAT and meta["target"] == target_fingerprint(target)
    assert meta["domain"] == "toy" and meta["temperatures"] == [0.0, 0.7] and meta["max_new_tokens"] == 10
    rows = _lines(out)
    assert meta["n_samples"] == len(rows) == 2 * len(PROMPTS)
    assert all(set(r) == {"prompt_id", "temperature", "seed", "prompt_ids", "output_ids"} for r in rows)
    stopped = 0
    for r in rows:
        o = r["output_ids"]
        assert 1 <= len(o) <= 10 and (len(o) == 10 or o[-1] == eos) and eos not in o[:-1]  # cut after EOS
        stopped += o[-1] == eos
        if r["temperature"] == 0.0:
            assert o == _greedy(target, r["prompt_ids"], 10, eos), r["prompt_id"]
    assert stopped >= 1
    ds = load_distilled(out, target)
    assert [s.prompt_id for s in ds.samples] == [r["prompt_id"] for r in rows]
    assert {s.prompt_ids == dict(PROMPTS)[s.prompt_id] for s in ds.samples} == {True}


def test_distill_text_prompts_without_chat_template(tmp_path):
    tok = word_tokenizer(WORDS)
    target = _target(1, tokenizer=tok)
    out = distill(target, [("a", "the cat sat on the mat"), ("b", "a big dog ran")], tmp_path / "s",
                  domain="toy", temperatures=(0.0,), max_new_tokens=4)
    ds = load_distilled(out)
    by_id = {s.prompt_id: s for s in ds.samples}
    assert by_id["a"].prompt_ids == tok("the cat sat on the mat")["input_ids"] == [1, 3, 5, 6, 1, 7]
    assert len(ds.samples) == 2 and all(len(s.output_ids) == 4 for s in ds.samples)


def test_distill_resumes_after_a_crash_and_skips_done_work(tmp_path):
    target = _target(0)
    kw = dict(domain="toy", temperatures=(0.0, 0.7), max_new_tokens=6, batch_size=2)
    out = tmp_path / "set"
    first = distill_run(target, PROMPTS[:4], out, **kw)
    assert first.new_samples == 8 and first.skipped == 0
    again = distill_run(target, PROMPTS[:4], out, **kw)
    assert again.new_samples == 0 and again.skipped == 8
    # crash: keep 3 whole lines and a torn fourth; meta.json still counts all 8
    text = (out / "samples.jsonl").read_text()
    lines = text.splitlines(keepends=True)
    (out / "samples.jsonl").write_text("".join(lines[:3]) + lines[3][:15])
    with pytest.raises(AdaspecError, match="incomplete"):
        load_distilled(out)
    resumed = distill_run(target, PROMPTS, out, **kw)  # and 3 more prompts
    assert resumed.new_samples == 2 * len(PROMPTS) - 3 and resumed.skipped == 3
    after = (out / "samples.jsonl").read_text()
    assert after.startswith("".join(lines[:3]))  # appended, earlier lines untouched
    ds = load_distilled(out)
    assert len(ds.samples) == ds.meta["n_samples"] == 2 * len(PROMPTS)
    assert len({s.key for s in ds.samples}) == len(ds.samples)
    greedy_before = {json.loads(ln)["prompt_id"]: json.loads(ln)["output_ids"] for ln in lines
                     if json.loads(ln)["temperature"] == 0.0}
    for s in ds.samples:  # greedy data do not depend on the run
        if s.temperature == 0.0 and s.prompt_id in greedy_before:
            assert s.output_ids == greedy_before[s.prompt_id]


def test_distill_and_load_refuse_another_target_or_setting(tmp_path):
    a, b = _target(0), _target(5)
    out = distill(a, PROMPTS[:2], tmp_path / "s", domain="toy", temperatures=(0.0,), max_new_tokens=4)
    with pytest.raises(ModelLoadError, match="weights"):
        distill(b, PROMPTS[:2], out, domain="toy", temperatures=(0.0,), max_new_tokens=4)
    with pytest.raises(ModelLoadError, match="built for target 'tiny0'"):
        load_distilled(out, b)
    load_distilled(out, a)
    with pytest.raises(ConfigError, match="max_new_tokens=4"):
        distill(a, PROMPTS[:2], out, domain="toy", temperatures=(0.0,), max_new_tokens=5)
    with pytest.raises(ConfigError, match="domain 'toy'"):
        distill(a, PROMPTS[:2], out, domain="math", temperatures=(0.0,), max_new_tokens=4)
    changed = [("p0", [5, 6, 7])]
    with pytest.raises(ConfigError, match="encodes differently"):
        distill(a, changed, out, domain="toy", temperatures=(0.0,), max_new_tokens=4)
    with pytest.raises(PromptError, match="duplicate prompt ids"):
        distill(a, [("x", [1]), ("x", [2])], tmp_path / "t", domain="toy")


def test_load_distilled_validates(tmp_path):
    out = distill(_target(0), PROMPTS[:2], tmp_path / "s", domain="toy", temperatures=(0.0,), max_new_tokens=3)
    meta = json.loads((out / "meta.json").read_text())
    (out / "meta.json").write_text(json.dumps({**meta, "format": "other/9"}))
    with pytest.raises(AdaspecError, match="expected 'adaspec.distill/1'"):
        load_distilled(out)
    (out / "meta.json").write_text(json.dumps(meta))
    with open(out / "samples.jsonl", "a") as fh:
        fh.write('{"prompt_id": "z", "temperature": 0, "seed": 0, "prompt_ids": [], "output_ids": [1]}\n')
    with pytest.raises(AdaspecError, match="line 3: bad sample"):
        load_distilled(out)
    with pytest.raises(AdaspecError, match="not a distilled set"):
        load_distilled(tmp_path)


# -- datastores ----------------------------------------------------------------------------------
def test_datastore_from_distilled_responses_loads_as_suffix_drafter(tmp_path):
    target = _target(0)
    out = distill(target, PROMPTS, tmp_path / "s", domain="toy", temperatures=(0.0, 0.7), max_new_tokens=8)
    ds = load_distilled(out)
    path = build_datastore([out], tmp_path / "ds.jsonl")
    header = json.loads(path.read_text().splitlines()[0])
    assert header["target"] == target_fingerprint(target) and header["documents"] == len(ds.samples)
    drafter = build_drafter(f"suffix:datastore={path}", target)
    assert isinstance(drafter, SuffixDrafter)
    assert drafter.datastore.docs == [s.output_ids for s in ds.samples]  # responses only, in order
    assert len(drafter.datastore) == ds.n_output_tokens
    with pytest.raises(ConfigError, match="more than max_tokens"):
        build_datastore([out], tmp_path / "small.jsonl", max_tokens=10)
    other = distill(_target(5), PROMPTS[:2], tmp_path / "o", domain="toy", temperatures=(0.0,), max_new_tokens=4)
    with pytest.raises(ModelLoadError, match="different targets"):
        build_datastore([out, other], tmp_path / "mixed.jsonl")


# -- the pool ------------------------------------------------------------------------------------
class StubTrainer:
    """Stands in for ``train_drafter``: writes a file or directory and a report, counts calls."""

    def __init__(self):
        self.calls: list[tuple[str, tuple[str, ...], Path, dict]] = []

    def __call__(self, kind, target, data, out, **opts):
        out = Path(out)
        self.calls.append((kind, tuple(Path(d).name for d in data), out, opts))
        if kind == "tiny-lm":
            out.mkdir(parents=True, exist_ok=True)
            (out / "weights").write_text("stub")
        else:
            out.write_text("stub")
        n = sum(len(load_distilled(d).samples) for d in data)
        return {"kind": kind, "train_sequences": n, "epochs": opts.get("epochs")}


class StubEvaluator:
    """Stands in for ``evaluate_drafters``: one row per drafter, MAT = 1 + its index."""

    def __call__(self, kind, target, paths, data, **kw):
        return [{Path(d).name: {"mat_k5": 1.0 + i, "top1": 0.5, "sequences": 2, "per_sequence": [[i, 1], [i, 1]]}
                 for d in data} for i in range(len(paths))]


def _pool(tmp_path, trainer, **kw):
    target = _target(0, tokenizer=word_tokenizer(WORDS))
    args = dict(domains=("code", "math"), n_prompts=3, kinds=("feature-head", "tiny-lm"), temperatures=(0.0, 0.7),
                max_new_tokens=5, batch_size=4, train_opts={"epochs": 3, "tiny-lm": {"layers": 1}}, trainer=trainer,
                evaluator=StubEvaluator() if isinstance(trainer, StubTrainer) else None)
    args.update(kw)
    return target, build_pool(target, tmp_path / "pool", **args)


def test_build_pool_with_stub_trainer_writes_a_manifest_whose_specs_build(tmp_path):
    stub = StubTrainer()
    target, manifest = _pool(tmp_path, stub)
    root = (tmp_path / "pool").resolve()
    assert list(manifest.entries) == ["code", "math", GENERALIST]
    # per kind: the generalist on the union first, then each domain fine-tuned from it
    assert [(k, d) for k, d, _, _ in stub.calls] == [
        ("feature-head", ("code", "math")), ("feature-head", ("code",)), ("feature-head", ("math",)),
        ("tiny-lm", ("code", "math")), ("tiny-lm", ("code",)), ("tiny-lm", ("math",))]
    assert stub.calls[0][3]["epochs"] == 3 and "layers" not in stub.calls[0][3] and "init_from" not in stub.calls[0][3]
    assert stub.calls[3][3] == DEFAULT_POOL_TRAIN_OPTS | {"epochs": 3, "layers": 1, "progress": None}
    assert stub.calls[1][3] == DEFAULT_POOL_TRAIN_OPTS | SPECIALIST_TRAIN_OPTS | {
        "init_from": str(root / "drafters" / GENERALIST / "feature-head.pt"), "progress": None}
    assert stub.calls[5][3]["init_from"] == str(root / "drafters" / GENERALIST / "tiny-lm")
    # training stops on epochs, not on a clock, so a pool's weights do not depend on the machine's speed
    assert not any("max_minutes" in opts for _, _, _, opts in stub.calls)
    code = manifest.entries["code"]
    assert code.n_samples == 6 and code.specs == {
        "suffix": f"suffix:datastore={root / 'datastores' / 'code.jsonl'}",
        "feature-head": f"feature-head:path={root / 'drafters' / 'code' / 'feature-head.pt'}",
        "tiny-lm": f"tiny-lm:path={root / 'drafters' / 'code' / 'tiny-lm'}"}
    assert manifest.entries[GENERALIST].n_samples == 12
    assert {"distill_s", "datastore_s", "train_feature-head_s", "train_tiny-lm_s"} <= set(code.times)
    assert set(manifest.times) == {"distill_s", "datastore_s", "train_s", "heldout_s", "total_s"}
    # the held-out matrix: every drafter of a kind on every domain's data (not the generalist's union)
    assert set(manifest.heldout) == {"feature-head", "tiny-lm"}
    rows = manifest.heldout["feature-head"]["rows"]
    assert list(rows) == ["code", "math", GENERALIST] and rows["math"]["code"]["mat_k5"] == 2.0
    table = heldout_table(manifest, "feature-head")
    assert table.splitlines()[0] == "| drafter | code | math |"
    assert "| code/feature-head | **1.00 (0.50)** | 1.00 (0.50) |" in table
    assert "| generalist/feature-head | 3.00 (0.50) | 3.00 (0.50) |" in table
    assert "code -2.00 [-2.00, -2.00], math -1.00 [-1.00, -1.00]" in table  # specialist minus generalist
    assert heldout_table(manifest, "suffix") is None

    loaded = load_manifest(root / "pool.json")
    assert loaded.target == target_fingerprint(target)
    specs = pool_specs(root, kinds=("suffix", "feature-head"))
    assert len(specs) == 6 and specs[0].startswith("suffix:datastore=") and specs == loaded.specs(
        ("suffix", "feature-head"))
    assert [d.label for d in loaded.drafters(("suffix",))] == ["code/suffix", "math/suffix", "generalist/suffix"]
    for spec in pool_specs(loaded, kinds=("suffix",)):
        drafter = build_drafter(spec, target)
        assert isinstance(drafter, SuffixDrafter) and len(drafter.datastore) > 0
    assert len(build_drafter(loaded.specs(("suffix",), (GENERALIST,))[0], target).datastore) == sum(
        len(build_drafter(s, target).datastore) for s in loaded.specs(("suffix",), ("code", "math")))

    # a second build reuses everything; --retrain trains again; a moved pool still resolves
    stub2 = StubTrainer()
    _, again = _pool(tmp_path, stub2)
    assert stub2.calls == [] and again.entries["code"].reports["feature-head"]["reused"] is True
    assert again.heldout == manifest.heldout  # unchanged drafters keep their matrix
    stub3 = StubTrainer()
    _pool(tmp_path, stub3, retrain=True)
    assert len(stub3.calls) == 6
    # a changed generalist retrains the specialists built on it; specialist options alone do not touch it
    stub4 = StubTrainer()
    _, changed = _pool(tmp_path, stub4, train_opts={"epochs": 2, "tiny-lm": {"layers": 1}}, kinds=("feature-head",))
    assert [d for _, d, _, _ in stub4.calls] == [("code", "math"), ("code",), ("math",)]
    assert changed.heldout["feature-head"]["key"] != manifest.heldout["feature-head"]["key"]
    stub5 = StubTrainer()
    _pool(tmp_path, stub5, train_opts={"epochs": 2, "tiny-lm": {"layers": 1}}, kinds=("feature-head",),
          specialist_opts={"epochs": 5})
    assert [(d, o["epochs"]) for _, d, _, o in stub5.calls] == [(("code",), 5), (("math",), 5)]
    stub6 = StubTrainer()
    _pool(tmp_path, stub6, train_opts={"epochs": 2}, kinds=("feature-head",), specialise=False)
    assert all("init_from" not in o for *_, o in stub6.calls) and len(stub6.calls) == 2
    moved = tmp_path / "moved"
    shutil.copytree(root, moved)
    spec = pool_specs(moved, kinds=("suffix",), domains=("math",))[0]
    assert spec == f"suffix:datastore={moved.resolve() / 'datastores' / 'math.jsonl'}"
    assert isinstance(build_drafter(spec, target), SuffixDrafter)


def test_specialist_margins_pair_the_bootstrap_over_held_out_sequences():
    """Paired percentile bootstrap at 95%, fixed seed: a specialist that accepts one more token on
    every sequence wins with an interval above 0; noise without a shift gives an interval around 0."""
    rng = np.random.default_rng(1)
    base = np.stack([rng.integers(0, 40, 40), rng.integers(20, 30, 40)], axis=1)

    def row(per):
        per = np.asarray(per)
        return {"mat_k5": 1.0 + per[:, 0].sum() / per[:, 1].sum(), "top1": 0.5, "sequences": len(per),
                "per_sequence": per.tolist()}

    better = base + np.array([10, 0])
    noisy = np.stack([np.clip(base[:, 0] + rng.integers(-3, 4, 40), 0, None), base[:, 1]], axis=1)
    manifest = PoolManifest(root=Path("."), target={}, settings={}, heldout={"feature-head": {"rows": {
        "code": {"code": row(better), "math": row(base)},
        "math": {"code": row(base), "math": row(noisy)},
        GENERALIST: {"code": row(base), "math": row(base)}}}})
    margins = specialist_margins(manifest, "feature-head")
    code, math = margins["code"], margins["math"]
    assert code["diff"] == pytest.approx(code["specialist"] - code["generalist"]) and code["lo"] > 0.2
    assert code["lo"] <= code["diff"] <= code["hi"]
    assert math["lo"] < 0 < math["hi"] and abs(math["diff"]) < 0.05
    assert specialist_margins(manifest, "feature-head") == margins  # deterministic given the seed
    assert specialist_margins(manifest, "tiny-lm") == {}


def test_prompt_counts_take_one_count_or_one_per_domain():
    assert prompt_counts(3, ["code", "math"]) == {"code": 3, "math": 3}
    assert prompt_counts({"code": 2, "math": 5, "chat": 9}, ["code", "math"]) == {"code": 2, "math": 5}
    with pytest.raises(ConfigError, match="no prompt count for domain.*math"):
        prompt_counts({"code": 2}, ["code", "math"])
    with pytest.raises(ConfigError, match="integers >= 1"):
        prompt_counts({"code": 0}, ["code"])
    assert parse_prompt_counts("300", DEFAULT_POOL_PROMPTS) == 300
    assert parse_prompt_counts("translation=900", DEFAULT_POOL_PROMPTS) == DEFAULT_POOL_PROMPTS | {"translation": 900}
    assert parse_prompt_counts("100, chat=7", DEFAULT_POOL_PROMPTS) == dict.fromkeys(DEFAULT_POOL_PROMPTS, 100) | {
        "chat": 7}
    with pytest.raises(ConfigError, match="not a count.*DOMAIN=N"):
        parse_prompt_counts("chat=many", 4)
    with pytest.raises(ConfigError, match="unknown domain 'poetry'"):
        parse_prompt_counts("poetry=3", 4)


def test_build_pool_takes_a_prompt_count_per_domain(tmp_path):
    _, manifest = _pool(tmp_path, StubTrainer(), kinds=(), n_prompts={"code": 2, "math": 3})
    assert manifest.settings["n_prompts"] == {"code": 2, "math": 3}
    assert [manifest.entries[d].n_samples for d in ("code", "math", GENERALIST)] == [4, 6, 10]  # two temperatures


def test_build_pool_refuses_another_target_a_shrunk_or_changed_prompt_set(tmp_path, monkeypatch):
    _pool(tmp_path, StubTrainer(), kinds=())
    other = _target(7, tokenizer=word_tokenizer(WORDS))
    with pytest.raises(ModelLoadError, match="was built for target"):
        build_pool(other, tmp_path / "pool", domains=("code",), n_prompts=3, kinds=(), max_new_tokens=5)
    target = _target(0, tokenizer=word_tokenizer(WORDS))
    with pytest.raises(ConfigError, match="outside this run's prompt set"):
        build_pool(target, tmp_path / "pool", domains=("code",), n_prompts=2, kinds=(), max_new_tokens=5,
                   temperatures=(0.0, 0.7))
    changed = [(pid, text + " Answer in French.") for pid, text in domain_prompts("code", 3)]
    monkeypatch.setattr(pool_module, "domain_prompts", lambda domain, n, seed: changed)
    with pytest.raises(PromptSetChangedError, match=r"code training prompts changed .* delete .*data/code"):
        build_pool(target, tmp_path / "pool", domains=("code",), n_prompts=3, kinds=(), max_new_tokens=5,
                   temperatures=(0.0, 0.7))
    monkeypatch.undo()
    with pytest.raises(ConfigError, match="distinct names among"):
        build_pool(target, tmp_path / "p2", domains=("poetry",))
    with pytest.raises(ConfigError, match="drafter kinds"):
        build_pool(target, tmp_path / "p2", kinds=("eagle",))


def test_build_pool_with_the_real_trainer(tmp_path):
    target, manifest = _pool(tmp_path, None, domains=("code",), n_prompts=4, kinds=("feature-head",),
                             generalist=False, max_new_tokens=6,
                             train_opts={"epochs": 1, "vocab_size": VOCAB, "heldout_fraction": 0.25})
    specs = manifest.specs()
    assert [s.split(":")[0] for s in specs] == ["feature-head", "suffix"]
    assert manifest.entries["code"].reports["feature-head"]["kind"] == "feature-head"
    for spec in specs:
        build_drafter(spec, target)


def test_build_pool_fine_tunes_real_specialists_from_the_generalist(tmp_path):
    target, manifest = _pool(tmp_path, None, n_prompts=3, max_new_tokens=6, temperatures=(0.0,),
                             train_opts={"epochs": 1, "vocab_size": VOCAB, "heldout_fraction": 0.34,
                                         "tiny-lm": {"layers": 1}}, specialist_opts={"epochs": 1})
    root = (tmp_path / "pool").resolve()
    for kind, leaf in (("feature-head", "feature-head.pt"), ("tiny-lm", "tiny-lm")):
        general = manifest.entries[GENERALIST].reports[kind]["settings"]
        assert general["init_from"] is None
        for domain in ("code", "math"):
            settings = manifest.entries[domain].reports[kind]["settings"]
            assert settings["init_from"] == str(root / "drafters" / GENERALIST / leaf)
            assert settings["epochs"] == 1 and settings["lr"] == SPECIALIST_TRAIN_OPTS["lr"]
    for spec in manifest.specs():
        build_drafter(spec, target)
    # the held-out matrix scores a specialist on its own domain exactly as its training did
    for kind in ("feature-head", "tiny-lm"):
        rows = manifest.heldout[kind]["rows"]
        assert list(rows) == ["code", "math", GENERALIST] and all(set(r) == {"code", "math"} for r in rows.values())
        for domain in ("code", "math"):
            final = manifest.entries[domain].reports[kind]["epochs"][-1]
            assert rows[domain][domain]["mat_k5"] == pytest.approx(final["val_mat_k5"], abs=1e-6)
            assert rows[domain][domain]["top1"] == pytest.approx(final["val_top1"], abs=1e-6)
            assert rows[domain][domain]["mat_k5"] >= 1.0 and rows[domain][domain]["sequences"] >= 1
            per = np.asarray(rows[domain][domain]["per_sequence"])
            assert len(per) == rows[domain][domain]["sequences"]
            assert 1 + per[:, 0].sum() / per[:, 1].sum() == pytest.approx(rows[domain][domain]["mat_k5"])
    # heldout_fraction=None scores every sample of a set (a suite no drafter trained on), keyed by its folder
    head = root / "drafters" / "code" / "feature-head.pt"
    every = evaluate_drafters("feature-head", target, [head], [root / "data" / "math"], heldout_fraction=None)
    assert list(every[0]) == ["math"] and every[0]["math"]["sequences"] == manifest.entries["math"].n_samples == 3
    held = manifest.heldout["feature-head"]["rows"]["code"]["math"]["per_sequence"]
    assert all(list(h) in every[0]["math"]["per_sequence"] for h in held)


# -- commands ------------------------------------------------------------------------------------
def _saved_model(tmp_path) -> Path:
    folder = tmp_path / "model"
    target = _target(0, tokenizer=word_tokenizer(WORDS, eos_token="<eos>"))
    target.model.save_pretrained(folder)
    target.tokenizer.save_pretrained(folder)
    return folder


def test_commands(tmp_path):
    model = _saved_model(tmp_path)
    app = typer.Typer()
    app.command("distill")(distill_command)
    app.command("build-datastore")(datastore_command)
    app.command("build-pool")(pool_command)
    runner = CliRunner()
    prompts = tmp_path / "p.txt"
    prompts.write_text("the cat sat\na dog ran to the house\n")
    res = runner.invoke(app, ["distill", "--domain", "toy", "--prompts", str(prompts), "--model", str(model),
                              "--out", str(tmp_path / "d"), "-t", "0", "--max-new-tokens", "4"])
    assert res.exit_code == 0, res.output
    assert "2 samples (2 new, 0 already there)" in res.output
    res = runner.invoke(app, ["build-datastore", str(tmp_path / "d"), "--out", str(tmp_path / "ds.jsonl")])
    assert res.exit_code == 0 and "2 documents" in res.output, res.output
    res = runner.invoke(app, ["build-pool", "--domains", "code,math", "--n-prompts", "2,math=3", "--kinds", "none",
                              "--model", str(model), "--out", str(tmp_path / "pool"), "--max-new-tokens", "3",
                              "-t", "0"])
    assert res.exit_code == 0, res.output
    assert len(pool_specs(tmp_path / "pool")) == 3  # suffix for code, math, generalist
    manifest = load_manifest(tmp_path / "pool")
    assert manifest.settings["n_prompts"] == {"code": 2, "math": 3}
    assert [manifest.entries[d].n_samples for d in ("code", "math")] == [2, 3]
    res = runner.invoke(app, ["build-pool", "--n-prompts", "poetry=3", "--model", str(model)])
    assert res.exit_code == 2 and "unknown domain 'poetry'" in res.output
    res = runner.invoke(app, ["distill", "--domain", "poetry", "--model", str(model)])
    assert res.exit_code == 2 and "unknown training domain" in res.output


def test_bench_runs_the_pool(tmp_path):
    """``adaspec bench --pool DIR`` adds the pool's drafters; every output still equals AR."""
    import json

    from typer.testing import CliRunner

    from adaspec.cli import app

    _, manifest = _pool(tmp_path, None, domains=("code",), n_prompts=4, kinds=("feature-head",), generalist=False,
                        max_new_tokens=6, train_opts={"epochs": 1, "vocab_size": VOCAB, "heldout_fraction": 0.25})
    folder = _saved_model(tmp_path)
    suite = tmp_path / "work.jsonl"
    suite.write_text(json.dumps({"question_id": "q1", "category": "code", "turns": [" ".join(WORDS[3:9])]}))
    out = tmp_path / "bench"
    res = CliRunner().invoke(app, ["bench", "-m", str(folder), "--pool", str(tmp_path / "pool"), "-d", "prompt-lookup",
                                   "-s", "hedgespec", "--peer", "none", "--suite", str(suite), "-n", "6",
                                   "--no-costs", "--no-plots", "-o", str(out)])
    assert res.exit_code == 0, res.output
    rows = json.loads((out / "summary.json").read_text())["overall"]
    names = [r["config"] for r in rows]
    assert "feature-head:code/feature-head k=5" in names and "suffix:datastore=code k=5" in names
    assert all(r["identical"] == r["prompts"] == 1 for r in rows)
