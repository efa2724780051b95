"""The ``router`` baseline (selection/router.py, training/router.py): features, training on a
recorded trace, routing in the engine and in replay, and the refusal to score a training prompt."""

from __future__ import annotations

import random

import numpy as np
import pytest
from conftest import make_tiny_model

from adaspec import SpeculativeEngine
from adaspec.errors import AdaspecError, ConfigError
from adaspec.models import as_loaded
from adaspec.bench.replay import replay
from adaspec.bench.trace import record_trace
from adaspec.selection.router import RouterModel, RouterPolicy, prompt_features
from adaspec.training.router import fit_softmax, label_prompts, train_router

V = 48


def repetitive(rng: random.Random, n: int) -> list[int]:
    motif = [rng.randrange(V) for _ in range(rng.randint(3, 6))]
    return (motif * 20)[:n]


def varied(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(V) for _ in range(n)]


def test_features_tell_copyable_prompts_from_varied_ones():
    rng = random.Random(0)
    rep, var = prompt_features(repetitive(rng, 40)), prompt_features(varied(rng, 40))
    assert rep[2] > 0.8 and var[2] < 0.3  # repeated bigram rate
    assert rep[4] > var[4]  # longest repeat
    assert prompt_features([5])[0] > 0 and len(prompt_features([])) == 5


def test_softmax_fit_separates_separable_classes():
    rng = np.random.default_rng(0)
    x = np.vstack([rng.normal(-2, 0.5, (30, 2)), rng.normal(2, 0.5, (30, 2))])
    y = [0] * 30 + [1] * 30
    w = fit_softmax(x, y, 2)
    pred = (np.hstack([x, np.ones((60, 1))]) @ w.T).argmax(axis=1)
    assert (pred == np.array(y)).mean() == 1.0


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ADASPEC_CACHE", str(tmp_path_factory.mktemp("cache")))
        target = make_tiny_model(seed=0, vocab=V, init_std=0.3, lm_head_scale=2.0)
        rng = random.Random(1)
        train = [repetitive(rng, 16) for _ in range(4)] + [varied(rng, 16) for _ in range(4)]
        trace = record_trace(target, ["prompt-lookup", "suffix"], train, 24, max_draft=8)
        model = train_router(trace, ks=(2, 4, 8))
        path = tmp_path_factory.mktemp("router") / "router.json"
        model.save(path)
        yield target, trace, model, path


def test_labels_are_the_fastest_static_configuration_by_replay(trained):
    _, trace, model, _ = trained
    classes, labels = label_prompts(trace, ks=(2, 4, 8))
    assert classes[0] == ("none", 0) and len(classes) == 1 + 2 * 3
    for p, lab in enumerate(labels):
        name, k = classes[lab]
        best = replay(trace, None, None, k=k or 2, drafters=[name] if k else ["none"]).prompts[p].seconds
        for other_name, other_k in classes[1:]:
            other = replay(trace, None, None, k=other_k, drafters=[other_name]).prompts[p].seconds
            assert best <= other + 1e-12
    assert model.meta["trace_prompts"] == 8


def test_router_refuses_its_training_prompts_and_routes_new_ones(trained):
    target, trace, model, path = trained
    engine = SpeculativeEngine(as_loaded(target), ["prompt-lookup", "suffix", "none"], selector=f"router:path={path}")
    with pytest.raises(ConfigError, match="trained on this prompt"):
        engine.generate(trace.prompts[0].prompt, max_new_tokens=8)
    rng = random.Random(99)
    plain = SpeculativeEngine(as_loaded(target), [], k=1)
    for prompt in (repetitive(rng, 16), varied(rng, 16)):
        got = engine.generate(prompt, max_new_tokens=16)
        assert got.token_ids == plain.generate(prompt, max_new_tokens=16).token_ids
        name, k = model.predict(prompt)
        used = {r.drafter for r in got.stats.rounds}
        assert used == ({name} if k else {"none"})
        assert all(r.k_cap <= k for r in got.stats.rounds)


def test_router_file_errors_are_clear(tmp_path):
    with pytest.raises(ConfigError, match="path=FILE"):
        RouterPolicy()
    with pytest.raises(AdaspecError, match="not found"):
        RouterModel.load(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text('{"format": "other"}')
    with pytest.raises(AdaspecError, match="train it again"):
        RouterModel.load(tmp_path / "bad.json")


def test_train_router_command(trained, tmp_path):
    from typer.testing import CliRunner

    from adaspec.cli import app

    _, trace, _, _ = trained
    trace_path = tmp_path / "t.npz"
    trace.save(trace_path)
    out = tmp_path / "r.json"
    res = CliRunner().invoke(app, ["train-router", str(trace_path), "-o", str(out), "--ks", "2,4"])
    assert res.exit_code == 0, res.output
    assert RouterModel.load(out).classes[0] == ("none", 0)
    assert "replaying static configurations: 4/4" in res.output
    bad = CliRunner().invoke(app, ["train-router", str(trace_path), "-o", str(out), "--ks", "two"])
    assert bad.exit_code == 2 and "--ks must be comma-separated integers" in bad.output
