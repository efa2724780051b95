"""The trained pool in the cache joins the engine's default drafters (issue 16, item 5).

Tiny random Llamas with a word tokenizer; the pools hold suffix datastores only (no training),
built by ``build_pool`` under a temporary ``ADASPEC_CACHE``.
"""

from __future__ import annotations

import json
import logging

import pytest
from typer.testing import CliRunner

from conftest import make_tiny_model, word_tokenizer

from adaspec import pools
from adaspec.bench.runner import BenchConfig, default_configs, with_pool_rows
from adaspec.engine import DEFAULT_DRAFTERS, SpeculativeEngine
from adaspec.errors import AdaspecError, ConfigError
from adaspec.models import as_loaded
from adaspec.selection.auto import AutoSelector
from adaspec.training.pool import build_pool

pytestmark = pytest.mark.cached_pool

WORDS = ["<unk>", "the", "a", "cat", "dog", "sat", "on", "mat", "and", "ran", "to", "house", "big", "small",
         "red", "blue", "saw", "bird", "tree", "under", "over", "it", "was", "is", "green", "old", "new", "sun",
         "moon", "day", "night", "<eos>"]


def _target(seed: int = 0, name: str = "tinypool"):
    model = make_tiny_model(seed, len(WORDS), init_std=0.3, lm_head_scale=2.0)
    return as_loaded(model, tokenizer=word_tokenizer(WORDS), name=name)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ADASPEC_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _build(target, root=None):
    return build_pool(target, root, domains=("code", "math"), n_prompts=2, kinds=(), max_new_tokens=3,
                      batch_size=2, heldout=False)


def test_the_engine_adds_the_pool_built_for_its_target(cache):
    target = _target()
    assert pools.find_pool(target) is None
    assert SpeculativeEngine(target).drafter_names == list(DEFAULT_DRAFTERS)  # nothing built yet
    manifest = _build(target)
    assert manifest.root == (cache / "pool" / "tinypool").resolve()
    found = pools.find_pool(target)
    assert found is not None and found.specs() == manifest.specs() and len(found.specs()) == 3
    engine = SpeculativeEngine(target)  # of the datastores, the generalist's (a superset of the domains')
    assert found.default_specs() == found.specs()[2:]
    assert engine.drafter_names == [*DEFAULT_DRAFTERS, "suffix:generalist"]
    assert isinstance(engine.selector, AutoSelector)
    assert engine.generate([3, 5, 6, 7, 3, 5], max_new_tokens=8).token_ids == SpeculativeEngine(
        target, []).generate([3, 5, 6, 7, 3, 5], max_new_tokens=8).token_ids
    # pool=False: without it; explicit drafters: without it unless pool= asks for it
    assert SpeculativeEngine(target, pool=False).drafter_names == list(DEFAULT_DRAFTERS)
    assert SpeculativeEngine(target, ["suffix"]).drafter_names == ["suffix"]
    assert SpeculativeEngine(target, ["suffix"], pool="auto").drafter_names == ["suffix", "suffix:generalist"]
    assert SpeculativeEngine(target, [], pool=manifest.root).drafter_names[-1] == "suffix:generalist"


def test_a_pool_built_for_another_model_is_skipped_not_used(cache, caplog):
    _build(_target(seed=1))  # same name, other weights
    target = _target(seed=0)
    with caplog.at_level(logging.WARNING, logger="adaspec.pools"):
        assert pools.find_pool(target) is None
    assert "built for another model" in caplog.text
    assert SpeculativeEngine(target).drafter_names == list(DEFAULT_DRAFTERS)
    with pytest.raises(AdaspecError, match="no pool built for 'tinypool'.*adaspec build-pool"):
        SpeculativeEngine(target, pool="auto")
    with pytest.raises(ConfigError, match="pool must be None, False, 'auto' or a pool directory"):
        SpeculativeEngine(target, pool=3)


def test_an_unreadable_pool_is_skipped_with_a_warning(cache, caplog):
    target = _target()
    root = pools.default_pool_root(target)
    root.mkdir(parents=True)
    (root / "pool.json").write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="adaspec.pools"):
        assert pools.find_pool(target) is None
    assert "not valid JSON" in caplog.text and SpeculativeEngine(target).drafter_names == list(DEFAULT_DRAFTERS)


def test_bench_rows_get_a_pool_twin():
    configs = default_configs(["prompt-lookup", "suffix"], [5], ["auto"], ["cost-model"], tree=True)
    out = with_pool_rows(configs, ["suffix:datastore=/p/code.jsonl"], ["auto"])
    names = [c.name for c in out]
    i = names.index("auto over [prompt-lookup, suffix]")
    assert names[i + 1] == "auto over [prompt-lookup, suffix] + pool"
    assert out[i + 1].drafters == ["prompt-lookup", "suffix", "suffix:datastore=/p/code.jsonl"]
    assert len(out) == len(configs) + 1  # tree twins and single-drafter rows get none
    assert with_pool_rows([BenchConfig("AR", [])], ["x"], ["auto"])[0].name == "AR"


def test_bench_and_generate_use_the_cached_pool(cache, tmp_path, monkeypatch):
    from adaspec.cli import app

    folder = tmp_path / "tinypool"  # the model's name is its folder's
    target = _target()
    target.model.save_pretrained(folder)
    target.tokenizer.save_pretrained(folder)
    _build(as_loaded(target.model, tokenizer=target.tokenizer, name=str(folder)))
    suite = tmp_path / "work.jsonl"
    suite.write_text(json.dumps({"question_id": "q1", "category": "code", "turns": [" ".join(WORDS[3:9])]}))
    runner = CliRunner()
    out = tmp_path / "bench"
    args = ["bench", "-m", str(folder), "-d", "prompt-lookup", "-d", "suffix", "-s", "auto", "-l", "none", "--no-static",
            "--peer", "none", "--suite", str(suite), "-n", "6", "--no-costs", "--no-plots", "--no-record"]
    res = runner.invoke(app, [*args, "-o", str(out)])
    assert res.exit_code == 0, res.output
    rows = json.loads((out / "summary.json").read_text())["overall"]
    assert [r["config"] for r in rows] == ["AR (no drafter)", "auto over [prompt-lookup, suffix]",
                                           "auto over [prompt-lookup, suffix] + pool"]
    assert all(r["identical"] == r["prompts"] == 1 for r in rows)
    res = runner.invoke(app, [*args, "--pool", "none", "-o", str(tmp_path / "bench2")])
    assert res.exit_code == 0, res.output
    rows = json.loads((tmp_path / "bench2" / "summary.json").read_text())["overall"]
    assert [r["config"] for r in rows] == ["AR (no drafter)", "auto over [prompt-lookup, suffix]"]
    for kinds, n in ((["--pool-kinds", "suffix"], 5), ([], 3)):  # every datastore, or the engine's share
        bench3 = tmp_path / f"bench3{n}"
        res = runner.invoke(app, [*args, "--pool", str(cache / "pool" / "tinypool"), *kinds, "-o", str(bench3)])
        assert res.exit_code == 0, res.output
        rows = json.loads((bench3 / "summary.json").read_text())["overall"]
        assert rows[1]["config"] == ("auto over [5 drafters]" if n == 5
                                     else "auto over [prompt-lookup, suffix, suffix:datastore=generalist]")
    built: list[list[str]] = []
    real = SpeculativeEngine.__init__

    def spy(self, *a, **kw):
        real(self, *a, **kw)
        built.append(self.drafter_names)

    monkeypatch.setattr(SpeculativeEngine, "__init__", spy)
    gen = ["generate", "the cat sat", "-m", str(folder), "-n", "4", "--no-chat-template", "--json"]
    for extra, names in (([], [*DEFAULT_DRAFTERS, "suffix:generalist"]),
                         (["--pool", "none"], list(DEFAULT_DRAFTERS)), (["-d", "suffix"], ["suffix"]),
                         (["-d", "suffix", "--pool", "auto"], ["suffix", "suffix:generalist"])):
        res = runner.invoke(app, [*gen, *extra])
        assert res.exit_code == 0, res.output
        assert built[-1] == names
    res = runner.invoke(app, [*gen, "--pool", str(tmp_path / "nowhere")])
    assert res.exit_code == 2 and "no pool manifest" in res.output


def test_generate_batch_leaves_out_the_default_pools_heads(cache):
    """Feature heads are not batched: a default engine's batch drafts with the rest of its
    drafters (the pool's heads were not asked for); a BatchEngine over it, or heads asked for
    explicitly, get an error that names the fix."""
    from adaspec.batch import BatchEngine

    target = _target()
    build_pool(target, None, domains=("code",), n_prompts=4, kinds=("feature-head",), generalist=False,
               max_new_tokens=6, batch_size=2, heldout=False,
               train_opts={"epochs": 1, "vocab_size": len(WORDS), "heldout_fraction": 0.25})
    engine = SpeculativeEngine(target)
    n = len(DEFAULT_DRAFTERS)
    assert engine.drafter_names[n].startswith("feature-head") and engine.drafter_names[n + 1] == "suffix:code"
    assert engine.default_pool == [n, n + 1]
    prompts = [[3, 5, 6, 7, 3, 5], [1, 2, 1, 2, 1]]
    plain = SpeculativeEngine(target, [])
    got = engine.generate_batch(prompts, max_new_tokens=6)
    assert [r.token_ids for r in got] == [plain.generate(p, max_new_tokens=6).token_ids for p in prompts]
    with pytest.raises(ConfigError, match=r"several requests at once.*pool=False\)\)$"):
        BatchEngine(engine).add(prompts[0])
    with pytest.raises(ConfigError, match=r"several requests at once: batch with the model-free drafters \(none, "
                                          r"prompt-lookup, suffix, recycle\) or model drafters$"):  # asked for: no pool hint
        SpeculativeEngine(target, pool="auto").generate_batch(prompts, max_new_tokens=6)
