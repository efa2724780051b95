"""The cost model's live/grid ratio per width (``LiveVerifyRatio`` on ``CostModel.live``): what
it learns from the rounds' verify steps, how far noise moves it, and that the cost caches'
keys name the machine. Synthetic numbers, except one engine run on a tiny model."""

from __future__ import annotations

import math
import random

import pytest
import torch
from conftest import make_tiny_model

from adaspec.costs import CostModel, LiveVerifyRatio, VerifyCostSurface, _surface_key, machine_identity
from adaspec.feedback import RoundContext
from adaspec.errors import ConfigError


def flat_surface(step: float = 0.01, per_token: float = 0.001) -> VerifyCostSurface:
    ks = [1, 2, 4, 8, 16, 32]
    return VerifyCostSurface(contexts=[100], ks=ks, seconds=[[step + per_token * (k - 1) for k in ks]])


#: the surfaces here are measured at one cache length (100 tokens): every round is priced there
AT_100 = RoundContext(cache_len=100)


def feed(cm: CostModel, width: int, ratio: float, n: int = 1, ctx: RoundContext = AT_100) -> None:
    for _ in range(n):
        cm.observe(0, width - 1, 0.0, ratio * cm.surface.cost(width, ctx.cache_len), 0, 0.0, ctx)


def test_before_any_round_the_surface_is_priced_as_measured():
    cm = CostModel(flat_surface())
    assert not cm.live.seen
    assert cm.verify_cost(5) == cm.surface.cost(5, 100)
    assert cm.verify_row(8) == cm.surface.row(100, 8)


def test_a_uniform_ratio_scales_every_width():
    cm = CostModel(flat_surface())
    for w in (1, 3, 6):
        feed(cm, w, 1.2, n=30)
    for w in (1, 2, 3, 6, 12, 40):  # observed, between, past the widest
        assert cm.verify_cost(w) == pytest.approx(1.2 * cm.surface.cost(w, 100), rel=1e-9)
    assert cm.verify_row(12) == pytest.approx([1.2 * v for v in cm.surface.row(100, 12)])


def test_ratios_per_width_interpolate_between_and_stay_flat_past_the_ends():
    cm = CostModel(flat_surface())
    feed(cm, 1, 1.0, n=300)
    feed(cm, 9, 1.3, n=300)
    f = cm.live.factors(20)
    assert f[1] == pytest.approx(1.0, abs=0.01) and f[9] == pytest.approx(1.3, abs=0.01)
    assert f[1] < f[3] < f[5] < f[7] < f[9]
    assert f[5] == pytest.approx(math.exp((math.log(f[1]) + math.log(f[9])) / 2), rel=1e-9)
    assert f[16] == f[9]


def test_a_width_seen_once_reads_mostly_the_trend():
    """One round at a new width moves its price by at most 1 / (1 + prior) of the clipped
    deviation from the line the other widths draw."""
    cm = CostModel(flat_surface())
    feed(cm, 1, 1.0, n=200)
    feed(cm, 9, 1.2, n=200)
    line = cm.live.trend(5)
    feed(cm, 5, 3.0)  # one slow forward: log 3 is clipped to the line + 0.5
    got, moved = math.log(cm.live.factor(5)), cm.live.trend(5)
    assert abs(moved - line) < 0.01  # one round among ~400 barely tilts the line
    assert got - moved <= 0.5 / (1 + cm.live.prior) + 1e-9
    assert got > moved


def test_one_slow_forward_barely_moves_a_well_seen_width():
    cm = CostModel(flat_surface())
    feed(cm, 1, 1.0, n=100)
    before = cm.verify_cost(1)
    feed(cm, 1, 20.0)  # a preempted forward
    assert cm.verify_cost(1) / before < math.exp(0.5 / 50)


def test_noisy_rounds_give_the_median_ratio():
    """Rounds within +-25% of 1.1 (log-normal, sd 0.15), seeded: the learned factor is within
    3% of 1.1 (its standard error at ~200 rounds' memory is ~1%: a 3-sigma band)."""
    rng = random.Random(0)
    cm = CostModel(flat_surface())
    for _ in range(2000):
        w = rng.choice((1, 1, 1, 6))
        feed(cm, w, 1.1 * math.exp(rng.gauss(0.0, 0.15)))
    for w in (1, 6):
        assert cm.live.factor(w) == pytest.approx(1.1, rel=0.03)


def test_a_drifting_machine_is_followed():
    cm = CostModel(flat_surface())
    feed(cm, 1, 1.0, n=500)
    feed(cm, 1, 1.5, n=1000)  # the machine got slower: ~5 memories later
    assert cm.live.factor(1) == pytest.approx(1.5, rel=0.02)


def test_batched_rows_and_surfaceless_models_do_not_feed_it():
    cm = CostModel(flat_surface())
    feed(cm, 2, 3.0, n=20, ctx=RoundContext(cache_len=100, rows=4))  # a row's share of a batched forward is not V
    assert not cm.live.seen
    bare = CostModel()
    bare.observe(0, 3, 0.0, 0.05, 0, 0.0)
    assert not bare.live.seen and bare.verify_cost(4) == 0.05  # observed widths as before


def test_it_can_be_turned_off_and_refuses_bad_parameters():
    cm = CostModel(flat_surface(), live_verify=False)
    cm.observe(0, 3, 0.0, 1.0, 0, 0.0)
    assert cm.live is None and cm.verify_cost(4) == cm.surface.cost(4, 100)
    for bad in ({"decay": 0.0}, {"decay": 1.5}, {"prior": 0.0}, {"clip": -1.0}):
        with pytest.raises(ConfigError, match="LiveVerifyRatio needs"):
            LiveVerifyRatio(**bad)


def test_the_engine_learns_its_own_verify_steps():
    """A tiny model's forwards take about a millisecond; a surface that says a second is
    corrected toward what the rounds measured."""
    from adaspec import SpeculativeEngine

    model = make_tiny_model(seed=0, vocab=64)
    eng = SpeculativeEngine(model, ["prompt-lookup"], k=3)
    eng.cost_model.curve = flat_surface(step=1.0, per_token=0.1)
    res = eng.generate(list(range(2, 30)) * 2, max_new_tokens=40)
    live = sorted(r.verify_s for r in res.stats.rounds if r.drafted == 3)
    assert len(live) >= 5 and eng.cost_model.live.seen
    median = live[len(live) // 2]
    # from the surface's 1.3 s to about what width 4 took: a lower bound near the median step, an
    # upper one far below the surface (a decayed mean follows a slow step on a loaded machine)
    assert median / 3 < eng.cost_model.verify_cost(4) < 0.05


def test_cost_caches_are_keyed_by_the_machine(monkeypatch):
    from adaspec.models import as_loaded

    loaded = as_loaded(make_tiny_model(seed=0, vocab=64))
    here = _surface_key(loaded, [32], [1, 2])
    assert machine_identity(torch.device("cpu")).startswith("cpu:")
    monkeypatch.setattr("adaspec.costs.machine_identity", lambda device: "cpu:another|AVX512|cores=2")
    assert _surface_key(loaded, [32], [1, 2]) != here
