"""The verify-cost surface V(k, L) and the cost functions of drafters: interpolation, cliffs per
context, fits, the cost-model rule at long contexts, and replay's pricing of a trace with
known costs. Synthetic numbers only (no timing)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import make_tiny_model, word_tokenizer

from adaspec.bench.replay import oracle_bounds, replay
from adaspec.bench.trace import record_trace
from adaspec.bench.trace import Trace, _CyclingLength, _trimmed_mean, calibration_ratios
from adaspec.costs import (CostModel, DrafterCosts, EngineOverheads, LinearCost, VerifyCostCurve,
                           VerifyCostSurface, cached_surface, load_or_measure, nonneg_lstsq)
from adaspec.feedback import RoundContext
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
    assert cm.verify_cost(3, RoundContext(cache_len=100)) == 1.6
    assert cm.verify_cost(3, RoundContext(cache_len=1000)) == 3.0
    assert cm.verify_row(3, RoundContext(cache_len=100))[3] == 1.6


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
    rule.costs = cm
    rule.begin_request()
    rule.begin_round(0, RoundContext(cache_len=context))
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
    every drafter is scored in the first round, so each pays its prompt prefill there, as in
    the engine, and the evaluation brings it up to date)."""
    costs, o = trace.drafter_costs, trace.overheads
    s = trace.surface.scaled(o.verify_factor)  # live verify step / surface, per width
    if not o.verify_widths:  # the line of older traces
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
            if full_information and not used:  # the first round scores (and so prefills) the others
                total += sum(costs[sj].prefill(n) for j, sj in enumerate(src) if j != r.drafter and sj is not None)
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
    assert cm.draft_cost(0, 3, RoundContext(cache_len=1000)) == pytest.approx(0.001 + 0.006 + 0.001)
    assert cm.draft_cost(0, 3) == pytest.approx(0.007)
    assert cm.catch_up_cost(0, 2) == pytest.approx(0.006) and cm.catch_up_cost(0, 0) == 0.0
    assert cm.draft_cost(1, 3) == pytest.approx(0.3) and cm.catch_up_cost(1, 1) == pytest.approx(0.1)


# -- the live verify step per width, and the surface the live policies read ------------------
def test_verify_factor_is_a_table_per_width():
    """Live/surface verify ratios per observed width, linear between them, flat past the ends
    (it is not monotone in the width); traces without the table keep the line."""
    o = EngineOverheads(verify_widths=[1, 5, 8], verify_ratios=[0.95, 0.85, 0.9])
    assert o.verify_factor(1) == pytest.approx(0.95) and o.verify_factor(5) == pytest.approx(0.85)
    assert o.verify_factor(3) == pytest.approx(0.90)  # halfway between 1 and 5
    assert o.verify_factor(6) == pytest.approx(0.85 + 0.05 / 3)
    assert o.verify_factor(17) == pytest.approx(0.9)  # past the last width: flat
    line = EngineOverheads(verify_scale=0.9, verify_scale_per_width=0.01)
    assert line.verify_factor(1) == pytest.approx(0.9) and line.verify_factor(6) == pytest.approx(0.95)
    assert EngineOverheads.from_dict(dataclasses.asdict(o)) == o
    assert EngineOverheads.from_dict({}).verify_factor(4) == 1.0  # no calibration: the surface as measured


def test_a_surface_scaled_per_width():
    """Grid widths are scaled by the function, widths between them interpolate the scaled
    values, prefills take the ratio at width 1."""
    s = surface()
    f = {1: 0.5, 2: 1.0, 3: 1.0, 4: 2.0, 8: 1.0}.__getitem__
    t = s.scaled(f)
    assert t.cost(1, 100) == pytest.approx(0.5) and t.cost(4, 1000) == pytest.approx(7.0)
    assert t.cost(6, 100) == pytest.approx((2.4 + 1.4) / 2)  # between the scaled k=4 and k=8
    assert t.prefill_seconds == [5.0, 50.0]
    assert s.scaled(1.0, 0.1).cost(3, 100) == pytest.approx(1.2 * 1.6)  # the line, as before


def test_trimmed_mean_and_cycling_caps():
    """Calibration: one burst does not set a width's ratio; caps visit every grid width."""
    assert _trimmed_mean([1.0] * 9 + [10.0]) == pytest.approx(1.0)
    assert _trimmed_mean([2.0]) == 2.0
    cyc = _CyclingLength([1, 4, 7])
    assert [cyc.begin_round(0) for _ in range(5)] == [1, 4, 7, 1, 4]


def test_calibration_ratios_cancel_drift():
    """The calibration runs' widths are read over their own width-1 rounds: a machine 10%
    faster during calibration than during the recording moves no width's relative price."""
    slow_w1, slow_w6 = 1.0, 1.1  # live / surface as the bench will see it
    rows = [(1, 0.9 * slow_w1)] * 20 + [(6, 0.9 * slow_w6)] * 10 + [(6, 50.0)] + [(3, 1.0)] * 2
    rel = dict(calibration_ratios(rows))
    assert rel[6] == pytest.approx(slow_w6 / slow_w1) and 3 not in rel  # 2 rows: too few
    assert dict(calibration_ratios(rows, relative=False))[6] == pytest.approx(0.9 * slow_w6)
    assert calibration_ratios([(6, 1.0)] * 5) == []  # no width-1 rounds: nothing to be relative to


def test_probe_rows_set_the_wider_widths_prices(tmp_path, monkeypatch):
    """``TraceRecorder.probe_rows`` (verify probes timed between the live requests) price the
    widths they sampled, over their own width-1 rows, times the AR rounds' ratio; widths they
    lack keep the calibration's relative price. Raw ratios land in ``info["probe_verify"]``."""
    from adaspec.bench.trace import TraceRecorder

    monkeypatch.setenv("ADASPEC_CACHE", str(tmp_path))
    target = make_tiny_model(seed=0, vocab=V, init_std=0.3, lm_head_scale=2.0)
    rec = TraceRecorder(target, ["prompt-lookup"], 12, max_draft=8)
    rec.add(PROMPTS[0])
    surf = VerifyCostSurface([8, 40], [1, 2, 4, 8], [[1.0, 1.1, 1.2, 1.6], [2.0, 2.4, 3.2, 4.8]])
    ar = _trimmed_mean([r.verify_s / surf.cost(1, c) for r, c in _ar_rows(rec)])
    calibration = [(1, 2.0)] * 5 + [(4, 2.4)] * 5 + [(8, 3.0)] * 5  # relative: 4 -> 1.2, 8 -> 1.5
    rec.probe_rows = ([(1, 30, 0.9 * surf.cost(1, 30))] * 6 + [(8, 30, 0.9 * 0.8 * surf.cost(8, 30))] * 6
                      + [(8, 30, 50.0)])  # one burst: trimmed
    over = rec._overheads(surf, LinearCost(), calibration)
    table = dict(zip(over.verify_widths, over.verify_ratios))
    assert table[1] == pytest.approx(ar)
    assert table[8] == pytest.approx(0.8 * ar)  # the probes' price, not the calibration's 1.5
    assert table[4] == pytest.approx(1.2 * ar)  # no probe at 4: the calibration's
    assert rec._probe_verify[8] == pytest.approx(0.72) and rec._calibration_verify[8] == pytest.approx(3.0)
    rec.probe_rows = []
    assert dict(zip(*(lambda o: (o.verify_widths, o.verify_ratios))(rec._overheads(surf, LinearCost(), calibration))))[
        8] == pytest.approx(1.5 * ar)


def test_live_rows_price_every_width_they_cover(tmp_path, monkeypatch):
    """``TraceRecorder.live_rows`` (a bench's own verify steps over every pass) price each width
    they saw at least 3 times, width 1 included, by their mean over the surface; a width
    they lack keeps the probes'/calibration's price over its width 1, times the live width 1.
    The table before them is kept (``_verify_base``, the leave-one-out fallback)."""
    from adaspec.bench.trace import TraceRecorder, live_verify_table

    monkeypatch.setenv("ADASPEC_CACHE", str(tmp_path))
    target = make_tiny_model(seed=0, vocab=V, init_std=0.3, lm_head_scale=2.0)
    rec = TraceRecorder(target, ["prompt-lookup"], 12, max_draft=8)
    rec.add(PROMPTS[0])
    surf = VerifyCostSurface([8, 40], [1, 2, 4, 8], [[1.0, 1.1, 1.2, 1.6], [2.0, 2.4, 3.2, 4.8]])
    calibration = [(1, 2.0)] * 5 + [(4, 2.4)] * 5 + [(8, 3.0)] * 5  # relative: 4 -> 1.2, 8 -> 1.5
    slow = [(8, 20, 1.1 * surf.cost(8, 20))] * 4 + [(8, 30, 0.8 * surf.cost(8, 30))] * 6  # a slow regime's share
    rec.live_rows = [(1, c, 0.95 * surf.cost(1, c)) for c in (10, 20, 30)] * 3 + slow + [(2, 10, 9.0)] * 2
    over = rec._overheads(surf, LinearCost(), calibration)
    table = dict(zip(over.verify_widths, over.verify_ratios))
    assert table[1] == pytest.approx(0.95)
    assert table[8] == pytest.approx((1.1 * 4 + 0.8 * 6) / 10)  # a plain mean: slow steps are paid live
    trimmed = dict(zip(*live_verify_table(surf, rec.live_rows, rec._verify_base, trim=0.1)))
    assert trimmed[8] == pytest.approx((1.1 * 3 + 0.8 * 6) / 9)  # trim=0.1: the largest of 10 dropped
    assert table[4] == pytest.approx(1.2 * 0.95)  # not live: the calibration's relative price
    assert 2 not in table  # 2 rows: too few
    assert dict(rec._verify_base)[8] == pytest.approx(1.5 * dict(rec._verify_base)[1])
    assert live_verify_table(surf, [], [(1, 0.9), (6, 0.8)]) == ([1, 6], [0.9, 0.8])  # nothing live


def _ar_rows(rec):
    """(round, cache length) of the recorder's AR runs, as ``_overheads`` reads them."""
    out = []
    for pt, st in zip(rec.prompts, rec._ar_stats):
        ctx = pt.n_prompt - 1
        for r in st.rounds:
            out.append((r, ctx))
            ctx += r.emitted
    return out


def test_replay_prices_with_the_width_table(priced):
    """A trace whose overheads hold the table: every verify is priced at its width's ratio."""
    over = dataclasses.replace(priced.overheads, verify_widths=[1, 3, 5], verify_ratios=[1.0, 0.5, 2.0])
    trace = dataclasses.replace(priced, overheads=over, cache={})
    for drafters in (["prompt-lookup"], ["none"]):
        res = replay(trace, None, None, k=4, drafters=drafters)
        seconds, ar = _expected(trace, res)
        assert res.seconds == pytest.approx(seconds) and res.ar_seconds == pytest.approx(ar)
    wide = replay(trace, None, None, k=4, drafters=["prompt-lookup"])
    assert wide.seconds != pytest.approx(replay(priced, None, None, k=4, drafters=["prompt-lookup"]).seconds)


def test_replay_policies_decide_on_the_surface_live_engines_read(priced):
    """``policy_surface`` (the cached surface the live run's engines loaded) drives the
    cost-aware policies' decisions; prices stay on the recorded surface. A policy surface
    whose wide forwards are dear makes the cost-model rule draft shorter blocks."""
    ks = [1, 2, 4, 8]
    flat = VerifyCostSurface([8, 40], ks, [[1.0] * 4, [1.0] * 4])
    steep = VerifyCostSurface([8, 40], ks, [[float(k) for k in ks]] * 2)
    on_flat = replay(dataclasses.replace(priced, policy_surface=flat, cache={}), None, "cost-model",
                     drafters=["prompt-lookup"])
    on_steep = replay(dataclasses.replace(priced, policy_surface=steep, cache={}), None, "cost-model",
                      drafters=["prompt-lookup"])
    assert on_steep.drafted < on_flat.drafted
    for res in (on_flat, on_steep):  # priced on the recorded surface
        assert res.seconds == pytest.approx(_expected(priced, res)[0])


def test_policy_surface_and_width_table_survive_save_and_load(priced, tmp_path):
    over = dataclasses.replace(priced.overheads, verify_widths=[1, 6], verify_ratios=[0.95, 0.82])
    trace = dataclasses.replace(priced, overheads=over, policy_surface=surface(), cache={})
    back = Trace.load(trace.save(tmp_path / "t.npz"))
    assert back.overheads == over
    assert back.policy_surface is not None and back.policy_surface.seconds == surface().seconds
    assert Trace.load(priced.save(tmp_path / "u.npz")).policy_surface is None


def test_cached_surface_reads_without_measuring(tmp_path, monkeypatch):
    """What an engine would load now, or None: never a measurement."""
    monkeypatch.setenv("ADASPEC_CACHE", str(tmp_path))
    from adaspec.models import as_loaded

    target = as_loaded(make_tiny_model(seed=0, vocab=V))
    grid = {"ks": (1, 2), "contexts": (8, 16)}
    assert cached_surface(target, **grid) is None
    measured = load_or_measure(target, repeats=1, **grid)
    found = cached_surface(target, **grid)
    assert found is not None and found.seconds == measured.seconds and found.key == measured.key


def test_a_measurement_another_process_holds_is_waited_for_and_read(tmp_path, caplog):
    """While another process holds a measurement's lock (two servers started together), a
    second caller waits, says so, and reads what the first wrote instead of timing forwards on
    the cores the first is timing on; with no lock held it measures at once (the control)."""
    import json
    import threading

    from filelock import FileLock

    from adaspec.artifacts import cached_measurement

    @dataclasses.dataclass
    class Found:
        value: int
        key: str = ""

        def to_dict(self):
            return {"value": self.value}

    parse = lambda d: Found(d["value"])  # noqa: E731
    measured = []
    path = tmp_path / "costs" / "grid.json"
    path.parent.mkdir()
    held = FileLock(f"{path}.lock")
    held.acquire()  # the first process, measuring
    out = []
    waiter = threading.Thread(target=lambda: out.append(cached_measurement(
        path, "k", parse, lambda: measured.append(1) or Found(2), "grid", shown=True)))
    with caplog.at_level("WARNING", logger="adaspec.artifacts"):
        waiter.start()
        waiter.join(0.5)
        assert waiter.is_alive() and not measured  # waiting, not timing
        path.write_text(json.dumps({"value": 1}))
        held.release()
        waiter.join(10)
    assert out[0].value == 1 and out[0].key == "k" and not measured
    assert "waiting for another process" in caplog.text
    other = tmp_path / "costs" / "other.json"  # control: nobody holds its lock
    assert cached_measurement(other, "k", parse, lambda: Found(3), "grid", shown=True).value == 3
    assert json.loads(other.read_text()) == {"value": 3}


def test_surface_row_equals_cost_at_every_width_and_context():
    """``row`` (every width at once, for the policies' per-round pricing) is ``cost`` exactly."""
    s = VerifyCostSurface([32, 256, 1024], [1, 2, 4, 8], [[1.0, 1.5, 1.3, 2.0], [1.2, 1.9, 1.6, 2.4],
                                                          [1.5, 2.5, 2.0, 3.0]])
    for ctx in (0, 32, 100, 256, 700, 1024, 5000):
        for max_k in (1, 5, 8, 12, 17, 65, 70):
            assert s.row(ctx, max_k) == [0.0] + [s.cost(k, ctx) for k in range(1, max_k + 1)]


def test_surface_rows_past_the_grid_are_precomputed(monkeypatch):
    """auto prices up to max_k + 1 = 65 widths every round: a grid measured up to k=16 still
    answers ``row`` from its precomputed widths, not one interpolation per width."""
    s = VerifyCostSurface([32, 256], [1, 2, 4, 16], [[1.0, 1.5, 1.3, 2.0], [1.2, 1.9, 1.6, 2.4]])
    monkeypatch.setattr(s, "cost", lambda *a: pytest.fail("row fell back to cost per width"))
    assert len(s.row(100, 65)) == 66 and s.row(100, 17)[17] > s.row(100, 16)[16]


def test_a_views_drafters_keep_their_own_seconds_in_the_shared_cost_model():
    """An engine view drafting with a subset of the drafters (a server request, a batch row)
    shares the cost model through ``for_drafters``: its drafter i is the engine's drafter
    keys[i], so suffix's seconds are never written under prompt lookup's index; the scalars
    (overheads, the surface) are the shared model's, and a copy keeps the mapping."""
    import copy

    base = CostModel(surface(), live_verify=False)  # the surface as given: verify_s below is made up
    view = base.for_drafters([2, 0])
    view.observe(0, 4, 0.4, 1.0, 0, 0.0)  # view drafter 0 = engine drafter 2
    assert set(base.draft_token_s) == {2} and base.draft_token_s[2] == pytest.approx(0.1)
    assert view.draft_cost(0, 3) == pytest.approx(base.draft_cost(2, 3)) == pytest.approx(0.3)
    assert view.draft_cost(1, 3) == base.draft_cost(0, 3) == 0.0
    assert view.knows(0) and not view.knows(1) and base.knows(2) and not base.knows(0)
    view.round_overhead_s = 0.5  # written through
    at = RoundContext(cache_len=1000)
    assert base.round_overhead_s == 0.5 and view.verify_cost(1, at) == base.verify_cost(1, at) == 2.0
    nested = view.for_drafters([1])  # a view of a view maps through both
    nested.observe(0, 2, 0.1, 1.0, 0, 0.0)
    assert base.draft_token_s[0] == pytest.approx(0.05)
    twin = copy.copy(view)  # BatchEngine's copy: its own scalars, the same mapping and tables
    twin.round_overhead_s = 0.1
    assert base.round_overhead_s == 0.5 and twin.keys == view.keys
    assert twin.draft_cost(0, 1) == pytest.approx(0.1)


def test_engine_views_and_batch_rows_price_each_drafter_by_its_own_seconds():
    """Drafting through ``with_policies([1])`` (suffix alone) and through a batch row with the
    same subset records suffix's drafting seconds under the engine's index 1, never under 0."""
    from adaspec import SpeculativeEngine
    from adaspec.batch import BatchEngine

    eng = SpeculativeEngine(make_tiny_model(seed=3), ["prompt-lookup", "suffix"], selector="static",
                            length="cost-model")
    eng.cost_model.surface = surface()
    prompt = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3]
    eng.with_policies([1], length="cost-model").generate(prompt, max_new_tokens=12)
    assert 0 not in eng.cost_model.draft_token_s and 1 in eng.cost_model.draft_token_s
    batch = BatchEngine(eng, max_batch=2)
    batch.add(prompt, max_new_tokens=12, drafters=[1], length="cost-model")
    batch.run()
    assert 0 not in batch.cost_model.draft_token_s and 0 not in eng.cost_model.draft_token_s


# -- backends that rebuild their compute graph for a new shape (llama.cpp) -------------------------
def test_a_run_of_blocks_pays_one_rebuild_going_in_and_one_coming_out():
    """``CostModel.switch_cost``: after a plain step a block is charged 2 s (in, and the plain
    step after it), a block of another width s, a plain step or the same width nothing; the
    surface's other prices are unchanged, and a surface without ``switch_s`` adds nothing."""
    base = surface()
    s = dataclasses.replace(base, switch_s=0.25)
    cm = CostModel(s)
    at = RoundContext(cache_len=100)  # last_width 0: nothing verified yet, as after the prefill
    v = [base.cost(w, 100) for w in range(7)]
    assert cm.verify_cost(1, at) == v[1] and cm.verify_cost(3, at) == v[3] + 0.5
    assert [cm.switch_cost(w, 1) for w in range(1, 7)] == [0.0, 0.5, 0.5, 0.5, 0.5, 0.5]
    assert [cm.switch_cost(w, 4) for w in range(1, 7)] == [0.0, 0.25, 0.25, 0.0, 0.25, 0.25]
    at = RoundContext(cache_len=100, last_width=4)
    assert cm.verify_cost(4, at) == v[4] and cm.verify_cost(5, at) == v[5] + 0.25 and cm.verify_cost(1, at) == v[1]
    assert cm.verify_row(6, at) == [0.0] + [cm.verify_cost(w, at) for w in range(1, 7)]
    plain = CostModel(base)
    assert plain.verify_row(6, RoundContext(cache_len=100, last_width=1)) == v and plain.switch_cost(3) == 0.0
    # kept through serialisation and the live/measured scaling replay applies
    assert VerifyCostSurface.from_dict(s.to_dict()).switch_s == 0.25
    assert s.scaled(1.1).switch_s == 0.25 and "+250.00 ms" in s.table()
    assert VerifyCostSurface.from_dict(base.to_dict()).switch_s == 0.0


class _GraphReusingBackend:
    """A fake backend on a fake clock: a forward of w tokens takes V(w) = w ms, plus 0.4 ms
    when its width differs from the previous forward's (a rebuilt graph)."""

    device = torch.device("cpu")
    vocab_size = 50
    context_window = None
    reuses_graphs = True

    def __init__(self):
        self.now, self.last = 0.0, None

    def clock(self) -> float:
        return self.now

    def free_states(self):
        return None

    def new_state(self):
        return [0]

    def release(self, state):
        pass

    def truncate(self, state, length):
        state[0] = length

    def forward(self, state, ids, keep=1):
        w = len(ids)
        self.now += w * 1e-3 + (4e-4 if w != self.last else 0.0)
        self.last = w
        state[0] += w


@pytest.mark.parametrize("reuses", [True, False])
def test_steady_forwards_and_the_switch_are_measured_apart(monkeypatch, reuses):
    """On a backend that reuses graphs every width is timed twice in a row: the grid holds the
    steady V and ``switch_s`` the rebuild; elsewhere one forward per width, no switch."""
    import adaspec.costs as costs_mod

    fake = _GraphReusingBackend()
    fake.reuses_graphs = reuses
    monkeypatch.setattr(costs_mod.time, "perf_counter", fake.clock)
    s = costs_mod.measure_verify_surface(fake, contexts=(8, 16), ks=(1, 2, 4), repeats=2)
    flat = [v for row in s.seconds for v in row]
    if reuses:
        assert flat == pytest.approx([1e-3, 2e-3, 4e-3] * 2) and s.switch_s == pytest.approx(4e-4)
    else:  # every width follows another: the rebuild is in every price
        assert flat == pytest.approx([1.4e-3, 2.4e-3, 4.4e-3] * 2) and s.switch_s == 0.0


@pytest.mark.parametrize("budget, timed", [(None, 2), (0.1, 2), (0.25, 5), (10.0, 8)])
def test_a_quick_grid_gets_more_timed_passes_within_the_budget(monkeypatch, budget, timed):
    """With ``budget_s`` the first pass's time sets the timed passes: as many as fit in the
    budget with the warm-up, ``repeats`` at least and ``MAX_GRID_REPEATS`` at most."""
    import adaspec.costs as costs_mod

    fake = _GraphReusingBackend()
    fake.reuses_graphs = False
    passes = []
    monkeypatch.setattr(costs_mod.time, "perf_counter", fake.clock)
    # a pass: 41.2 ms (widths 1, 2, 4 on 2 contexts, 8.2 ms each, and their 8.4 + 16.4 ms prefills)
    costs_mod.measure_verify_surface(fake, contexts=(8, 16), ks=(1, 2, 4), repeats=2,
                                     progress=lambda done, total: passes.append((done, total)),
                                     budget_s=budget)
    assert costs_mod.MAX_GRID_REPEATS == 8
    assert passes[-1] == (1 + timed, 1 + timed) and len(passes) == 1 + timed


def test_the_grid_is_timed_inside_the_backends_request_scope(monkeypatch):
    """Every timed forward runs inside ``request_scope``, as a request's do: the llama.cpp
    backend releases the caller's idle OpenMP workers there, and a grid timed outside it had
    noise cliffs (V(1) at 32 cached tokens 56 ms against ~10)."""
    import contextlib

    import adaspec.costs as costs_mod

    fake = _GraphReusingBackend()
    fake.reuses_graphs = False
    inside, outside = [], []
    fake.scopes = 0

    @contextlib.contextmanager
    def scope():
        fake.scopes += 1
        try:
            yield
        finally:
            fake.scopes -= 1

    forward = fake.forward
    fake.request_scope = scope
    fake.forward = lambda state, ids, keep=1: ((inside if fake.scopes else outside).append(len(ids)),
                                               forward(state, ids, keep))
    monkeypatch.setattr(costs_mod.time, "perf_counter", fake.clock)
    costs_mod.measure_verify_surface(fake, contexts=(8, 16), ks=(1, 2), repeats=1)
    assert inside and not outside and fake.scopes == 0


def test_engine_tells_the_cost_model_the_last_width():
    """The engine's rounds price at the last verify width (``RoundContext.last_width``: 0 at a
    request's start, then the previous round's width)."""
    from adaspec import SpeculativeEngine
    from adaspec.config import GenerationConfig

    model = make_tiny_model(seed=0, vocab=V)
    eng = SpeculativeEngine(model, ["prompt-lookup"], k=3)
    eng.cost_model.surface = dataclasses.replace(surface(), switch_s=1e-3)
    widths = []
    observe = eng.cost_model.observe
    eng.cost_model.observe = lambda *args: widths.append(args[6].last_width) or observe(*args)
    out = eng.generate([1, 2, 3, 4, 1, 2, 3, 4, 1, 2], GenerationConfig(max_new_tokens=12))
    assert widths[0] == 0  # the first round follows the prefill
    assert widths[1:] == [r.drafted + 1 for r in out.stats.rounds][:-1]


def test_replay_tells_the_cost_model_the_last_width(priced, monkeypatch):
    """Replay passes ``RoundContext.last_width`` as the engine does, so replayed policies price
    the same switches as live ones."""
    import adaspec.bench.replay as replay_mod

    seen: list[int] = []

    class Recording(CostModel):
        def observe(self, *args):
            seen.append(args[6].last_width)
            super().observe(*args)

    monkeypatch.setattr(replay_mod, "CostModel", Recording)
    res = replay(priced, None, None, k=4, drafters=["prompt-lookup"])
    expected: list[int] = []
    for p in res.prompts:
        expected += [0] + [r.drafted + 1 for r in p.rounds][:-1]
    assert seen == expected and len(seen) > 3


def test_timing_noise_is_pooled_and_cost_cliffs_are_kept():
    """``monotone_within_noise``: a wider forward measured cheaper by at most ``tol`` of the
    narrower is pooled with it (the non-decreasing least-squares fit over such dips); a larger
    drop stays a cliff; a non-decreasing row is unchanged."""
    from adaspec.costs import monotone_within_noise

    assert monotone_within_noise([1.0, 1.1, 1.3]) == [1.0, 1.1, 1.3]
    # SmolLM2's grid row: 25.2 24.8 23.5 24.4 27.2 24.8 28.1 (ms): every dip under 15%
    fit = monotone_within_noise([25.2, 24.8, 23.5, 24.4, 27.2, 24.8, 28.1])
    assert fit == sorted(fit) and fit[-1] == 28.1
    assert fit[:4] == pytest.approx([24.475] * 4) and fit[4:6] == pytest.approx([26.0, 26.0])
    assert sum(fit) == pytest.approx(sum([25.2, 24.8, 23.5, 24.4, 27.2, 24.8, 28.1]))  # pooled means
    # a real cliff (2.0x a step at 3 tokens, 1.3x at 4) is kept, its noise around it pooled
    assert monotone_within_noise([1.0, 1.5, 2.0, 1.3, 1.28, 1.4]) == pytest.approx([1.0, 1.5, 2.0, 1.29, 1.29, 1.4])
    assert monotone_within_noise([1.0, 0.95], tol=0.01) == [1.0, 0.95]  # tol bounds what is noise


def test_engine_policies_price_the_denoised_surface(tmp_path, monkeypatch):
    """Cost-aware policies read the measured surface with its noise pooled; ``verify_costs``
    (reports, cliff warnings) keeps the measured one."""
    import adaspec.costs
    from adaspec import SpeculativeEngine

    monkeypatch.setenv("ADASPEC_CACHE", str(tmp_path))
    noisy = VerifyCostSurface([32, 256], [1, 2, 3, 4], [[1.0, 0.95, 1.2, 0.6], [1.0, 1.05, 0.98, 1.1]])
    monkeypatch.setattr(adaspec.costs, "measure_verify_surface", lambda *a, **k: noisy)
    monkeypatch.setattr("adaspec.engine.load_or_measure", adaspec.costs.load_or_measure)
    eng = SpeculativeEngine(make_tiny_model(), ["prompt-lookup"], length="cost-model")
    assert eng.verify_costs().seconds == noisy.seconds
    fitted = eng.cost_model.surface.seconds
    assert fitted[0] == pytest.approx([0.975, 0.975, 1.2, 0.6]) and fitted[1] == pytest.approx([1.0, 1.015, 1.015, 1.1])
    assert eng.cost_model.surface.cliffs(32) == [1, 2, 3]  # the 50% drop to 4 tokens stays a cliff
    assert fitted[1] == sorted(fitted[1])  # the 7% dip at 256 is pooled as noise
    view = eng.with_policies([0], length="cost-model")  # a server's request: the same fit, not made again
    assert view.cost_model.surface is eng.cost_model.surface
    assert noisy.denoised() is noisy.denoised() and noisy.denoised(0.5) is not noisy.denoised()


@pytest.mark.parametrize("repeats", [2, 3])
def test_one_slow_forward_leaves_its_cell_at_the_quiet_time(monkeypatch, repeats):
    """A cell is the low median of its timed passes (of two, the faster): machine noise only
    adds time, and one slow forward in a 2-pass grid (llama.cpp's usual count within the
    budget) moved the cell's mean by half its delay."""
    import adaspec.costs as costs_mod

    fake = _GraphReusingBackend()
    fake.reuses_graphs = False
    forward, calls = fake.forward, []

    def slow_once(state, ids, keep=1):
        calls.append((state[0], len(ids)))
        forward(state, ids, keep)
        if (state[0] - len(ids), len(ids)) == (16, 1) and calls.count((16, 1)) == 2:  # 1st timed pass
            fake.now += 5e-3

    fake.forward = slow_once
    monkeypatch.setattr(costs_mod.time, "perf_counter", fake.clock)
    s = costs_mod.measure_verify_surface(fake, contexts=(8, 16), ks=(1, 2, 4), repeats=repeats)
    assert calls.count((16, 1)) == 1 + repeats  # the warm-up and the timed passes
    assert [v for row in s.seconds for v in row] == pytest.approx([1.4e-3, 2.4e-3, 4.4e-3] * 2)


def test_the_suite_caches_cost_grids_in_a_cache_of_its_own(_private_cost_cache):
    """A grid measured and a kernel plan timed in a test land in the suite's private cache
    (``conftest``), never in the user's ``$ADASPEC_CACHE/costs`` or ``kernels``, where later runs
    would read a tiny model's grid or a plan timed on a busy worker."""
    from pathlib import Path

    from adaspec.artifacts import cache_dir
    from adaspec.costs import load_or_measure
    from adaspec.kernels import use_small_batch_linear
    from adaspec.models import as_loaded, small_rows_plan

    assert cache_dir() == _private_cost_cache
    surface = load_or_measure(as_loaded(make_tiny_model(seed=7)), ks=[1, 2], contexts=[8], repeats=1,
                              budget_s=0)
    written = Path(_private_cost_cache) / "costs" / f"{surface.key}.json"
    assert written.is_file() and not written.is_symlink()
    assert not (Path(_private_cost_cache) / "costs").is_symlink()
    model = make_tiny_model(seed=7)
    if use_small_batch_linear(model, packed=True) and small_rows_plan(model) is not None:  # oneDNN here
        plans = list((Path(_private_cost_cache) / "kernels").glob("*.json"))
        assert plans and not any(p.is_symlink() for p in plans)
        assert not (Path(_private_cost_cache) / "kernels").is_symlink()


def _small_grids(monkeypatch):
    """Grids of 2 cache lengths x 2 widths, two passes: the measurement, not its values, is tested."""
    import adaspec.costs as costs_mod

    real = costs_mod.measure_verify_surface
    monkeypatch.setattr(costs_mod, "measure_verify_surface",
                        lambda loaded, contexts, ks, repeats=2, progress=None, budget_s=None:
                        real(loaded, (8, 16), (1, 2), repeats, progress=progress, budget_s=0.0))


def test_an_engine_shows_the_grid_it_measures_and_the_cli_draws_it(monkeypatch, tmp_path, caplog):
    """``costs_progress``: the engine reports the surface's passes while it measures one (the
    commands draw them as a progress stage) and logs nothing; a cached surface reports nothing.
    Without it the measurement is announced in the log."""
    from adaspec import SpeculativeEngine
    from adaspec.models import as_loaded

    monkeypatch.setenv("ADASPEC_CACHE", str(tmp_path))
    _small_grids(monkeypatch)
    target = as_loaded(make_tiny_model(seed=8))
    calls = []
    with caplog.at_level("WARNING", logger="adaspec.costs"):
        SpeculativeEngine(target, ["prompt-lookup"], length="cost-model",
                          costs_progress=lambda done, total: calls.append((done, total)))
        assert calls and calls[-1][0] == calls[-1][1] and "measuring" not in caplog.text
        calls.clear()
        SpeculativeEngine(target, ["prompt-lookup"], length="cost-model",
                          costs_progress=lambda done, total: calls.append((done, total)))
        assert calls == []  # cached
        SpeculativeEngine(as_loaded(make_tiny_model(seed=8, hidden=48)), ["prompt-lookup"], length="cost-model")
    assert "measuring the verify-cost surface of this model on this machine, once" in caplog.text


def test_generate_draws_the_verify_grid_it_measures(tmp_path, monkeypatch):
    """``adaspec generate`` on a machine without a cached grid shows its measurement as a
    progress stage before the answer."""
    from typer.testing import CliRunner

    from adaspec.cli import app

    monkeypatch.setenv("ADASPEC_CACHE", str(tmp_path / "cache"))
    _small_grids(monkeypatch)
    path = tmp_path / "tiny"
    make_tiny_model(seed=0).save_pretrained(path)
    word_tokenizer([f"w{i:02d}" for i in range(32)]).save_pretrained(path)
    res = CliRunner().invoke(app, ["generate", "w01 w02 w03", "-m", str(path), "-d", "prompt-lookup",
                                   "-l", "cost-model", "-n", "4"])
    assert res.exit_code == 0, res.output
    assert "measuring the verify-cost grid (once)" in res.output
    res = CliRunner().invoke(app, ["generate", "w01 w02 w03", "-m", str(path), "-d", "prompt-lookup",
                                   "-l", "cost-model", "-n", "4"])
    assert res.exit_code == 0 and "measuring the verify-cost grid" not in res.output  # cached
