"""The verify-cost surface V(k, L) and the cost functions of drafters: interpolation, cliffs per
context, fits, the cost-model rule at long contexts, and replay's pricing of a trace with
known costs. Synthetic numbers only (no timing)."""

from __future__ import annotations

import dataclasses

import pytest
from conftest import make_tiny_model

from adaspec.bench.replay import oracle_bounds, replay
from adaspec.bench.trace import record_trace
from adaspec.costs import (CostModel, DrafterCosts, EngineOverheads, LinearCost, VerifyCostCurve,
                           VerifyCostSurface, nonneg_lstsq)
from adaspec.drafters import Decision, DraftStep
from adaspec.errors import ConfigError
from adaspec.length.cost_rule import CostModelRule


def surface() -> VerifyCostSurface:
    """Short cache: flat in k with a cliff at k=2-3; long cache: dearer and steep in k."""
    return VerifyCostSurface(
        contexts=[100, 1000], ks=[1, 2, 3, 4, 8],
        seconds=[[1.0, 1.6, 1.6, 1.2, 1.4],
                 [2.0, 2.5, 3.0, 3.5, 5.5]],
        prefill_seconds=[10.0, 100.0])


def test_interpolation_along_k_and_context():
    s = surface()
    assert s.cost(0, 500) == 0.0 and s.cost(-1, 500) == 0.0
    assert s.cost(2, 100) == 1.6 and s.cost(2, 1000) == 2.5  # grid points
    assert s.cost(6, 100) == pytest.approx(1.3)  # along k: halfway between k=4 and k=8
    assert s.cost(1, 550) == pytest.approx(1.5)  # along L: halfway between the rows
    assert s.cost(6, 550) == pytest.approx((1.3 + 4.5) / 2)  # both
    assert s.cost(4, 10) == 1.2  # below the first context: the first row
    assert s.cost(1, 1900) == pytest.approx(3.0)  # past the last: the rows' slope, extrapolated
    assert s.cost(4, 5000) >= s.cost(4, 1000)
    assert s.cost(10, 1000) == pytest.approx(6.5)  # past the last k: the last segment's slope
    assert s.curve(1000).seconds == [2.0, 2.5, 3.0, 3.5, 5.5]
    assert s.curve(550).context == 550 and s.curve(550).cost(1) == pytest.approx(1.5)


def test_prefill_is_interpolated_from_the_measured_points():
    s = surface()
    assert s.prefill(0) == 0.0
    assert s.prefill(100) == 10.0 and s.prefill(1000) == 100.0
    assert s.prefill(550) == pytest.approx(55.0)
    assert s.prefill(1) == pytest.approx(1.0)  # V(1) of a one-token forward
    assert s.prefill(1900) == pytest.approx(190.0)  # extrapolated
    no_points = VerifyCostSurface([0], [1, 2], [[1.0, 1.5]])
    assert no_points.prefill(2) == 1.5  # without prefill points: a forward over n tokens


def test_cliffs_are_found_per_context():
    s = surface()
    assert s.cliffs_by_context() == {100: [2, 3], 1000: []}
    assert s.cliffs(100) == [2, 3] and s.cliffs(1000) == []
    assert s.to_dict()["cliffs"] == {"100": [2, 3], "1000": []}
    text = s.table()
    assert "1600.0*" in text and "cost cliff" in text and "100000.0" in text  # ms, cliff marks, prefill
    back = VerifyCostSurface.from_dict(s.to_dict())
    assert back.seconds == s.seconds and back.cost(6, 550) == s.cost(6, 550)


def test_a_curve_is_a_surface_of_one_context():
    curve = VerifyCostCurve(ks=[1, 2, 4], seconds=[1.0, 1.5, 1.2], context=200)
    s = VerifyCostSurface.of(curve)
    assert [s.cost(k, c) for k in (1, 2, 3, 4) for c in (0, 200, 5000)] == \
        [curve.cost(k) for k in (1, 2, 3, 4) for _ in range(3)]
    assert CostModel(curve=curve).surface.seconds == [[1.0, 1.5, 1.2]]
    assert VerifyCostSurface.of(None) is None and VerifyCostSurface.of(s) is s


@pytest.mark.parametrize("bad", [
    dict(contexts=[], ks=[1], seconds=[]),
    dict(contexts=[200, 100], ks=[1], seconds=[[1.0], [1.0]]),
    dict(contexts=[100], ks=[1, 2], seconds=[[1.0]]),
    dict(contexts=[100], ks=[1], seconds=[[1.0]], prefill_seconds=[1.0, 2.0]),
])
def test_malformed_surfaces_are_refused(bad):
    with pytest.raises(ConfigError, match="surface"):
        VerifyCostSurface(**bad)


def test_cost_model_prices_at_the_rounds_context():
    cm = CostModel(surface())
    cm.context = 100
    assert cm.verify_cost(3) == 1.6
    cm.context = 1000
    assert cm.verify_cost(3) == 3.0
    assert cm.verify_cost(3, context=100) == 1.6  # an explicit context wins


def test_linear_cost_fit_recovers_the_drivers():
    truth = LinearCost(fixed=2e-5, per_token=1e-5, per_context=3e-8)
    samples = [(n, c, truth(n, c)) for n in (0, 1, 3, 5) for c in (100, 400, 900)]
    fit = LinearCost.fit(samples)
    assert fit.fixed == pytest.approx(truth.fixed) and fit.per_token == pytest.approx(truth.per_token)
    assert fit.per_context == pytest.approx(truth.per_context)
    assert fit(0, 100) == pytest.approx(truth.fixed + 100 * truth.per_context)  # an empty attempt costs
    flat = LinearCost.fit([(n, 50, 1e-3 * n) for n in (1, 2, 4)])  # no spread in context: no coefficient
    assert flat.per_context == 0.0 and flat.per_token == pytest.approx(1e-3)
    assert LinearCost.fit([]) == LinearCost()
    # a driver that would get a negative coefficient is dropped, the others refitted
    assert all(v >= 0 for v in nonneg_lstsq([[1, 1], [1, 2], [1, 3]], [3.0, 2.0, 1.0]))


def _rule_block(surface_: VerifyCostSurface, context: int, acceptance: float = 0.8) -> int:
    """Tokens the cost-model rule drafts at this cache length with a steady acceptance."""
    rule = CostModelRule(max_len=8, prior_acceptance=acceptance, prior_weight=1e9)
    cm = CostModel(surface_)
    cm.draft_token_s[0] = 0.01
    cm.context = context
    rule.costs = cm
    rule.begin_request()
    rule.begin_round(0)
    for j in range(8):
        if rule.decide(DraftStep(j, 1)) is not Decision.CONTINUE:
            return j + 1
    return 8


def test_cost_model_rule_drafts_shorter_blocks_at_long_contexts():
    steep = VerifyCostSurface(contexts=[100, 2000], ks=[1, 2, 4, 8, 16],
                              seconds=[[1.0, 1.02, 1.05, 1.1, 1.2],  # short cache: k is nearly free
                                       [2.0, 3.0, 5.0, 9.0, 17.0]])  # long cache: each token costs 0.5 V(1)
    assert _rule_block(steep, 100) == 8
    assert _rule_block(steep, 2000) < _rule_block(steep, 100)
    assert _rule_block(steep, 2000) <= 2


# -- replay's pricing on a trace with known costs ---------------------------------------------
V = 48
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3, 4, 5], [11, 12, 13, 14, 11, 12, 13, 14, 11, 12]]


@pytest.fixture(scope="module")
def priced(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ADASPEC_CACHE", str(tmp_path_factory.mktemp("cache")))
        target = make_tiny_model(seed=0, vocab=V, init_std=0.3, lm_head_scale=2.0)
        trace = record_trace(target, ["prompt-lookup", "suffix"], PROMPTS, 24, max_draft=8, calibrate=False)
    known = VerifyCostSurface(contexts=[8, 40], ks=[1, 2, 4, 8], seconds=[[1.0, 1.1, 1.2, 1.6],
                                                                          [2.0, 2.4, 3.2, 4.8]],
                              prefill_seconds=[5.0, 20.0])
    costs = [DrafterCosts(draft=LinearCost(0.01, 0.02, 0.001), catch_up=LinearCost(0.0, 0.03, 0.0),
                          prefill=LinearCost(0.0, 0.004, 0.0), evaluate=LinearCost(0.005, 0.01, 0.0)),
             DrafterCosts(draft=LinearCost(0.02, 0.01, 0.0), catch_up=LinearCost(0.0, 0.05, 0.0),
                          prefill=LinearCost(0.0, 0.002, 0.0), evaluate=LinearCost(0.0, 0.02, 0.0))]
    over = EngineOverheads(round_s=0.1, request_s=0.5, verify_scale=1.25, verify_scale_per_width=0.01, none_evaluate=LinearCost(0.001, 0.0, 0.0))
    return dataclasses.replace(trace, surface=known, drafter_costs=costs, overheads=over, cache={})


def _expected(trace, res, full_information: bool = False) -> tuple[float, float]:
    """Seconds and AR seconds of a replay, priced by hand from its rounds (full information:
    the evaluation brings every drafter up to date, so only the first round's drafter pays a
    prompt prefill, as in the engine)."""
    costs, o = trace.drafter_costs, trace.overheads
    s = trace.surface.scaled(o.verify_scale, o.verify_scale_per_width)  # live verify step / surface
    assert s.cost(2, 40) == pytest.approx(1.26 * trace.surface.cost(2, 40))
    assert s.cost(8, 8) == pytest.approx(1.32 * trace.surface.cost(8, 8))
    total = ar = 0.0
    src = [None if d == "none" else trace.specs.index(d) for d in res.drafters]
    for p in res.prompts:
        n, prefill = trace.prompts[p.index].n_prompt, trace.prompts[p.index].prefill_s
        total += prefill + o.request_s
        ar += prefill + o.request_s + sum(s.cost(1, n + x - 1) + o.round_s for x in range(p.new_tokens))
        t, used = n, set()
        for r in p.rounds:
            c = costs[src[r.drafter]] if src[r.drafter] is not None else None
            total += o.round_s + s.cost(r.drafted + 1, t - 1)
            if c is not None:
                total += c.draft(r.drafted, t) if r.k_cap > 0 else 0.0
                total += c.catch_up(r.catch_up_tokens, t) if r.catch_up_tokens else 0.0
                total += c.prefill(n) if r.drafter not in used else 0.0
            used |= set(range(len(src))) if full_information else {r.drafter}
            t += r.emitted
    return total, ar


@pytest.mark.parametrize("drafters,selector", [(["prompt-lookup"], None), (["suffix"], None),
                                               (["none"], None), (["prompt-lookup", "suffix", "none"], "round-robin")])
def test_replay_prices_every_round_at_its_context(priced, drafters, selector):
    res = replay(priced, selector, None, k=4, drafters=drafters)
    seconds, ar = _expected(priced, res)
    assert res.seconds == pytest.approx(seconds) and res.ar_seconds == pytest.approx(ar)
    assert res.predicted_s == pytest.approx(res.seconds + res.policy_s)
    assert res.speedup == pytest.approx(res.ar_seconds / res.predicted_s)
    if drafters == ["none"]:  # plain decoding replayed is exactly the AR prediction
        assert res.seconds == pytest.approx(res.ar_seconds)


def test_full_information_replay_prices_the_evaluation(priced):
    """HedgeSpec evaluates every other drafter on the verified tokens each round."""
    res = replay(priced, "hedgespec", None, k=4, drafters=["prompt-lookup", "suffix", "none"])
    costs, o = priced.drafter_costs, priced.overheads
    src = {0: costs[0], 1: costs[1], 2: None}
    plain, _ = _expected(priced, res, full_information=True)
    n0 = priced.prompts[0].n_prompt
    evaluation = 0.0
    for p in res.prompts:
        t = priced.prompts[p.index].n_prompt
        for r in p.rounds:
            evaluation += sum((src[j].evaluate(r.emitted, t) if src[j] is not None else o.none_evaluate(r.emitted))
                              for j in range(3) if j != r.drafter)
            t += r.emitted
    assert n0 > 0 and evaluation > 0
    assert res.seconds == pytest.approx(plain + evaluation, rel=1e-9)


def test_oracle_bounds_use_the_surface(priced):
    bounds = oracle_bounds(priced, k=4)
    fixed = replay(priced, None, None, k=4, drafters=["prompt-lookup"])
    assert bounds["ar_seconds"] == pytest.approx(fixed.ar_seconds)
    assert bounds["dp_time"]["seconds"] <= bounds["greedy_oracle"]["seconds"] + 1e-9


def test_cost_model_drafter_functions_take_precedence_over_running_means():
    cm = CostModel(surface(), drafters={0: DrafterCosts(draft=LinearCost(0.001, 0.002, 1e-6),
                                                        catch_up=LinearCost(0.0, 0.003, 0.0))})
    cm.observe(0, 4, draft_s=1.0, verify_s=1.0, catch_up_tokens=2, catch_up_s=1.0)
    cm.observe(1, 4, draft_s=0.4, verify_s=1.0, catch_up_tokens=2, catch_up_s=0.2)
    cm.context = 1000
    assert cm.draft_cost(0, 3) == pytest.approx(0.001 + 0.006 + 0.001)
    assert cm.draft_cost(0, 3, context=0) == pytest.approx(0.007)
    assert cm.catch_up_cost(0, 2) == pytest.approx(0.006) and cm.catch_up_cost(0, 0) == 0.0
    assert cm.draft_cost(1, 3) == pytest.approx(0.3) and cm.catch_up_cost(1, 1) == pytest.approx(0.1)
