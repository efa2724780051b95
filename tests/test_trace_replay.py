"""Trace record and replay: a replay equals a live greedy run round for round for
time-independent policies; traces round-trip through files; oracle bounds dominate fixed
drafters; model-free drafters are prefix-consistent; rules decide alike on q and on its
recorded statistics."""

from __future__ import annotations

import copy
import dataclasses
import json
import random

import numpy as np
import pytest
import torch
from conftest import make_tiny_model

from adaspec import SpeculativeEngine
from adaspec.config import SamplingConfig
from adaspec.drafters import Decision, DraftStep, ModelDrafter, PromptLookupDrafter, SuffixDrafter
from adaspec.errors import ConfigError, ModelLoadError
from adaspec.length import LengthPolicy
from adaspec.length.rules import (AdaEDL, LogitMargin, MaxConfidence, SVIPDifference, SVIPEntropy,
                                  stats_of, step_confidence)
from adaspec.models import as_loaded
from adaspec.selection.auto import AutoController, AutoSelector
from adaspec.bench.replay import oracle_bounds, replay, replay_command
from adaspec.bench.trace import Trace, TraceRecorder, record, record_trace

V = 48
N = 40
L = 12  # recorded max_draft: the rules below use max_len=12
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3, 4, 5],
           [11, 12, 13, 14, 11, 12, 13, 14, 11, 12],
           [20, 21, 22, 23, 24, 25, 20, 21, 22]]
GREEDY = SamplingConfig()


def _noisy_copy(model, scale: float, seed: int = 1):
    out = copy.deepcopy(model)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for p in out.parameters():
            p.add_(scale * torch.randn_like(p))
    return out


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ADASPEC_CACHE", str(tmp_path_factory.mktemp("cache")))
        target = make_tiny_model(seed=0, vocab=V, init_std=0.3, lm_head_scale=2.0)
        md = ModelDrafter(as_loaded(_noisy_copy(target, 0.01)), V, name="noisy")  # acceptance 30-70%
        trace = record_trace(target, [md, "prompt-lookup", "suffix"], PROMPTS, N, max_draft=L)
        yield target, md, trace


def _pool(md, names):
    objs = {"noisy": md, "prompt-lookup": "prompt-lookup", "suffix": "suffix", "none": "none"}
    return [objs[n] for n in names]


def live_keys(target, drafters, selector, length, k, prompts=PROMPTS, n=N):
    """Per prompt, the live engine's (drafter, k_cap, drafted, accepted, emitted) per round."""
    engine = SpeculativeEngine(target, drafters, selector=selector, length=length, k=k)
    out = []
    for ids in prompts:
        res = engine.generate(ids, max_new_tokens=n)
        out.append([(r.drafter, r.k_cap, r.drafted, r.accepted, r.emitted) for r in res.stats.rounds])
    return out


ALL = ["noisy", "prompt-lookup", "suffix"]
COMBOS = {
    "static-k3": ("static", None, 3, ALL),
    "static-pld-k3": (None, None, 3, ["prompt-lookup"]),
    "static-suffix-k6": (None, None, 6, ["suffix"]),
    "ucbspec": ("ucbspec", None, 4, ALL),
    "exp3spec": ("exp3spec:seed=3", None, 5, ALL),
    "metasd-ucb-bd": ("metasd-ucb:reward=bd", None, 5, ALL),
    "metasd-exp3": ("metasd-exp3:seed=4", None, 3, ALL),
    "thompson-global": ("thompson:scope=global,seed=2", None, 5, ALL),
    "sw-ucb": ("sw-ucb:window=5", None, 5, ALL),
    "hedgespec": ("hedgespec", None, 5, ALL),
    "hedgespec-corrected-global": ("hedgespec:estimator=corrected,scope=global,seed=5", None, 3, ALL),
    "hedgespec-chunk-none": ("hedgespec:game=chunk", None, 4, ["suffix", "none", "noisy"]),
    "round-robin-none": ("round-robin", None, 4, ["suffix", "none", "noisy"]),
    "max-confidence": (None, "max-confidence:max_len=12", 5, ["noisy"]),
    "svip": (None, "svip:max_len=12", 5, ["noisy"]),
    "svip-diff": (None, "svip-diff:threshold=0.05,max_len=12", 5, ["noisy"]),
    "logit-margin": (None, "logit-margin:threshold=0.5,max_len=12", 5, ["noisy"]),
    "adaedl": (None, "adaedl:max_len=12", 5, ["noisy"]),
    "tapout-seq": (None, "tapout:max_len=12", 5, ["noisy"]),
    "tapout-model-free": (None, "tapout:max_len=12", 5, ["prompt-lookup"]),
    "joint-ucbspec-tapout-token": ("ucbspec", "tapout:max_len=12,level=token,algo=thompson,seed=1", 5, ALL),
    "joint-metasd-hf-global": ("metasd-ucb:scope=global", "hf-heuristic", 5, ALL),
}


@pytest.mark.parametrize("combo", list(COMBOS))
def test_replay_equals_live_round_for_round(env, combo):
    target, md, trace = env
    selector, length, k, names = COMBOS[combo]
    want = live_keys(target, _pool(md, names), selector, length, k)
    got = replay(trace, selector, length, k=k, drafters=names)
    assert got.exact and not got.time_dependent and got.clipped_rounds == 0
    for i in range(len(PROMPTS)):
        assert got.keys(i) == want[i], f"prompt {i}"
    assert got.tokens == len(PROMPTS) * N
    assert got.n_rounds == sum(len(w) for w in want)
    if "noisy" in names and selector is None and length:
        assert len({r.drafted for r in got.rounds}) > 2  # the rule stopped at varied places


def test_the_trace_has_signal(env):
    """The tiny setup exercises what exactness needs: accepted runs, off-path gammas, stats."""
    _, _, trace = env
    accepted = [int(tr.accepted.max()) for p in trace.prompts for tr in p.tracks]
    assert max(accepted) >= 5
    noisy = trace.prompts[0].tracks[0]
    assert noisy.stats is not None and np.isfinite(noisy.stats).all() and (noisy.lengths == L).all()
    off_path = noisy.gammas[:, 5:]  # beyond the first rejection for most positions
    assert np.isfinite(off_path).all() and ((off_path > 0) & (off_path < 1)).all()
    assert trace.info["argmax_mismatches"] == 0
    assert trace.surface is not None and trace.drafter_costs[0].draft(5, 100) > 0
    assert trace.overheads.verify_scale > 0 and trace.overheads.verify_scale_per_width >= 0
    o = trace.overheads  # the calibration's caps cycle over the grid: a ratio for several widths
    assert len(o.verify_widths) >= 2 and o.verify_widths[0] == 1 and all(r > 0 for r in o.verify_ratios)


def test_tree_attention_scoring_equals_one_by_one(env):
    """Off-path probabilities from one masked forward equal branch-by-branch forwards."""
    target, md, trace = env
    rec = TraceRecorder(target, [md, "prompt-lookup", "suffix"], N, max_draft=L, tree=False)
    for ids in PROMPTS[:2]:
        rec.add(ids)
    assert rec._tree is False
    for a, b in zip(trace.prompts, rec.prompts):
        for ta, tb in zip(a.tracks, b.tracks):
            assert np.array_equal(ta.chains, tb.chains) and np.array_equal(ta.accepted, tb.accepted)
            np.testing.assert_allclose(ta.gammas, tb.gammas, atol=2e-5)
    assert trace.info["tree_attention"] is True


def test_eos_and_drafts_past_it_match_live(env, tmp_path, monkeypatch):
    monkeypatch.setenv("ADASPEC_CACHE", str(tmp_path))
    target, md, _ = env
    with_eos = copy.deepcopy(target)
    with_eos.generation_config.eos_token_id = 8  # appears inside two of the greedy outputs
    trace = record_trace(with_eos, [md, "prompt-lookup"], PROMPTS, N, max_draft=8, calibrate=False)
    reasons = [p.stop_reason for p in trace.prompts]
    assert "eos" in reasons and "max_new_tokens" in reasons
    for p in trace.prompts:
        if p.stop_reason == "eos":
            assert p.output[-1] == 8 and len(p.path) > p.n_prompt + p.n_out  # continuation recorded
    for selector, length, k in [("static", None, 6), ("ucbspec", None, 4), ("hedgespec", None, 5)]:
        want = live_keys(with_eos, [md, "prompt-lookup"], selector, length, k)
        got = replay(trace, selector, length, k=k)
        assert [got.keys(i) for i in range(len(PROMPTS))] == want
        assert [p.stop_reason for p in got.prompts] == reasons
    assert got.seconds == 0.0 and got.speedup is None  # calibrate=False: no times


def test_lower_budget_matches_live(env):
    target, md, trace = env
    want = live_keys(target, [md, "prompt-lookup", "suffix"], "ucbspec", None, 5, n=17)
    got = replay(trace, "ucbspec", k=5, max_new_tokens=17)
    assert [got.keys(i) for i in range(len(PROMPTS))] == want
    with pytest.raises(ConfigError, match="recorded budget"):
        replay(trace, max_new_tokens=N + 1)


def test_save_load_round_trip(env, tmp_path):
    _, _, trace = env
    path = trace.save(tmp_path / "t.npz")
    assert path.stat().st_size < 60_000
    back = Trace.load(path)
    assert back.header() == trace.header()
    for a, b in zip(trace.prompts, back.prompts):
        assert (a.prompt, a.path, a.n_out) == (b.prompt, b.path, b.n_out)
        for ta, tb in zip(a.tracks, b.tracks):
            assert np.array_equal(ta.chains, tb.chains) and np.array_equal(ta.accepted, tb.accepted)
            assert np.array_equal(ta.gammas, tb.gammas, equal_nan=True)
            assert (ta.stats is None) == (tb.stats is None)
    for sel, ln in [("metasd-ucb", None), ("cost-ucb", "cost-model")]:
        r1, r2 = replay(trace, sel, ln), replay(back, sel, ln)
        assert [r.key() for r in r1.rounds] == [r.key() for r in r2.rounds]
        assert r1.seconds == pytest.approx(r2.seconds)
    (tmp_path / "bad.npz").write_bytes(b"not a trace")
    with pytest.raises(ConfigError, match="not an adaspec trace"):
        Trace.load(tmp_path / "bad.npz")
    with pytest.raises(ConfigError, match="not found"):
        Trace.load(tmp_path / "missing.npz")


def test_fingerprint_mismatch_is_an_error(env):
    target, _, trace = env
    trace.check_target(target)
    trace.check_target(as_loaded(copy.deepcopy(target), name="renamed"))  # the name may differ
    with pytest.raises(ModelLoadError, match="differs in"):
        trace.check_target(make_tiny_model(seed=3, vocab=V, init_std=0.3, lm_head_scale=2.0))


class _FixedCosts:
    """Costs that no observation changes: a live run and a replay price alike."""

    round_overhead_s = 0.001

    def verify_cost(self, width: int, ctx=None) -> float:
        return 0.01 * (1.0 + 0.08 * (width - 1))

    def draft_cost(self, drafter: int, n_tokens: float, ctx=None) -> float:
        return 0.0002 * n_tokens


class _FixedCostController(AutoController):
    costs = property(lambda self: _FixedCosts(), lambda self, value: None)


def _auto_with_fixed_costs(peek: int) -> AutoSelector:
    sel = AutoSelector(max_k=L, peek=peek)
    sel.controller = _FixedCostController(max_k=L)
    return sel


@pytest.mark.parametrize("peek", [1, 0])
def test_auto_replays_like_live_when_costs_are_fixed(env, peek):
    """auto reads costs, so its replay is not a live run in general (the live cost model learns
    measured seconds); with costs that nothing changes, replay equals live round for round, the
    peeked blocks (from the trace's recorded chains) included."""
    target, md, trace = env
    names = ["prompt-lookup", "suffix", "none"]
    want = live_keys(target, _pool(md, names), _auto_with_fixed_costs(peek), None, 5)
    got = replay(trace, _auto_with_fixed_costs(peek), None, k=5, drafters=names)
    assert got.clipped_rounds == 0
    for i in range(len(PROMPTS)):
        assert got.keys(i) == want[i], f"prompt {i}"
    assert len({r.drafter for r in got.rounds}) >= 2 and len({r.k_cap for r in got.rounds}) > 2


def test_auto_with_a_model_drafter_replays_its_confidence_stops_like_live(env):
    """A model drafter in auto's pool stops its blocks token by token on q (AutoLength with
    BlockRate): replay reads q's recorded statistics where the live engine reads its logits, and
    with fixed costs the rounds are the same, the stopped blocks included."""
    target, md, trace = env
    names = ["noisy", "prompt-lookup", "suffix", "none"]
    want = live_keys(target, _pool(md, names), _auto_with_fixed_costs(1), None, 5)
    got = replay(trace, _auto_with_fixed_costs(1), None, k=5, drafters=names)
    assert got.clipped_rounds == 0
    for i in range(len(PROMPTS)):
        assert got.keys(i) == want[i], f"prompt {i}"
    model = [r for r in got.rounds if r.name == "noisy" and r.k_cap > 0]
    assert model and max(r.k_cap for r in model) == L  # the cap is max_k (or the budget): q decides
    assert len({r.drafted for r in model}) > 2 and min(r.drafted for r in model) < L  # stopped on q


def test_time_dependent_policies_replay_deterministically(env):
    _, _, trace = env
    for sel, ln in [("cost-ucb", None), ("cost-exp3:seed=1", None), ("cost-hedgespec", None),
                    (None, "ucbspec-length"), ("ucbspec", "cost-model")]:
        a, b = replay(trace, sel, ln), replay(trace, sel, ln)
        assert [r.key() for r in a.rounds] == [r.key() for r in b.rounds]
        assert a.time_dependent and not a.exact
        assert a.seconds > 0 and a.speedup is not None and a.tokens == len(PROMPTS) * N


def test_clipping_past_the_recorded_length(env):
    _, _, trace = env
    got = replay(trace, None, None, k=20, drafters=["noisy"])  # the model drafter never runs out
    assert got.clipped_rounds > 0 and not got.exact
    assert max(r.drafted for r in got.rounds) == trace.max_draft
    with pytest.raises(ConfigError, match=f"max_draft={L}"):
        replay(trace, None, None, k=20, drafters=["noisy"], strict=True)
    short = replay(trace, None, None, k=20, drafters=["prompt-lookup"])  # ran out before max_draft: not clipped
    assert not any(r.clipped for r in short.rounds if r.drafted < trace.max_draft)


def test_bad_inputs_name_the_fix(env):
    target, _, trace = env
    with pytest.raises(ConfigError, match="not in this trace"):
        replay(trace, drafters=["model:elsewhere"])
    with pytest.raises(ConfigError, match="twice"):
        replay(trace, drafters=["suffix", "suffix"])

    class NeedsHidden(LengthPolicy):
        name = "needs-hidden"
        needs_hidden = True

        def begin_round(self, drafter: int) -> int:
            return 3

    with pytest.raises(ConfigError, match="hidden states"):
        replay(trace, length=NeedsHidden())
    assert replay(trace, length=NeedsHidden(), drafters=["suffix"]).tokens == len(PROMPTS) * N  # model-free
    with pytest.raises(ConfigError, match="max_draft"):
        record_trace(target, ["prompt-lookup"], PROMPTS, 8, max_draft=0)
    with pytest.raises(ConfigError, match="'none'"):
        record_trace(target, ["prompt-lookup", "none"], PROMPTS, 8)


def test_oracle_bounds_dominate_fixed_drafters(env):
    _, _, trace = env
    for k in (3, 5):
        b = oracle_bounds(trace, k)
        fixed = b["fixed"]
        assert set(fixed) == {"noisy", "prompt-lookup", "suffix"}
        best_mat = max(m["mat"] for m in fixed.values())
        assert b["best_fixed"]["by_mat"]["mat"] >= best_mat
        assert b["best_fixed"]["by_time"]["seconds"] <= min(m["seconds"] for m in fixed.values()) + 1e-12
        for lab, m in fixed.items():  # SpecDec++ Thm 4.1 beats the same drafter at static k
            assert b["oracle_length"][lab]["mat"] >= m["mat"]
        assert b["dp_rounds"]["mat"] >= max(b["greedy_oracle"]["mat"], b["greedy_oracle_k"]["mat"],
                                           b["best_fixed"]["by_mat"]["mat"])
        assert b["greedy_oracle"]["mat"] >= b["greedy_oracle_k"]["mat"] >= best_mat
        assert b["dp_time"]["seconds"] <= min(m["seconds"] for m in fixed.values())
        assert b["dp_time"]["seconds"] <= b["best_fixed"]["by_time"]["seconds"]
        for policy in ("ucbspec", "hedgespec", "metasd-ucb"):  # no policy beats the bound
            assert replay(trace, policy, k=k).mat <= b["dp_rounds"]["mat"]
        assert b["dp_rounds"]["tokens"] == len(PROMPTS) * N


@pytest.mark.parametrize("make,track", [(PromptLookupDrafter, 1), (SuffixDrafter, 2),
                                        (lambda: SuffixDrafter(min_match=1), None)],
                         ids=["prompt-lookup", "suffix", "suffix-min1"])
def test_model_free_drafters_are_prefix_consistent(env, make, track):
    """A capped, stopped or discarded draft is a prefix of the full chain, and the chain at a
    position does not depend on where the drafter drafted before (rolled-back drafts)."""
    _, _, trace = env
    for p in trace.prompts:
        path, n0 = p.path, p.n_prompt
        positions = list(range(n0, n0 + p.n_out))
        fresh = make()
        fresh.begin_request(p.prompt)
        full = {t: fresh.draft(path[:t], L, GREEDY, None, lambda s: Decision.CONTINUE).tokens for t in positions}
        if track is not None:  # what the recording stored
            assert [p.tracks[track].chain(t - n0) for t in positions] == [full[t] for t in positions]
        rng = random.Random(0)
        d = make()
        d.begin_request(p.prompt)
        for t in rng.sample(positions, len(positions)):  # any order, any earlier drafts
            cap = rng.randint(1, L)
            got = d.draft(path[:t], cap, GREEDY, None, lambda s: Decision.CONTINUE).tokens
            assert got == full[t][:cap]
            stop_at, drop_at = rng.randint(0, L - 1), rng.randint(0, L - 1)
            stopped = d.draft(path[:t], L, GREEDY, None,
                              lambda s, j=stop_at: Decision.STOP if s.index == j else Decision.CONTINUE).tokens
            assert stopped == full[t][: stop_at + 1]
            dropped = d.draft(path[:t], L, GREEDY, None,
                              lambda s, j=drop_at: Decision.DISCARD if s.index == j else Decision.CONTINUE).tokens
            assert dropped == full[t][:drop_at]
    assert any(full.values())  # some proposals at all


def test_model_drafter_is_prefix_consistent(env):
    _, md, trace = env
    p = trace.prompts[1]
    track = p.tracks[0]
    md.begin_request(p.prompt)
    for t in (p.n_prompt + 30, p.n_prompt + 3, p.n_prompt + 17):
        for cap in (1, 4, L):
            got = md.draft(p.path[:t], cap, GREEDY, None, lambda s: Decision.CONTINUE).tokens
            assert got == track.chain(t - p.n_prompt)[:cap]


def test_rules_decide_alike_on_q_and_on_its_statistics():
    gen = torch.Generator().manual_seed(0)
    rules = [MaxConfidence(0.5), MaxConfidence(0.9), SVIPEntropy(0.8), SVIPEntropy(1.5),
             LogitMargin(0.1), LogitMargin(0.4), AdaEDL(0.3)]
    seen = set()
    for trial in range(200):
        row = torch.randn(V, generator=gen) * (0.5 + 6.0 * trial / 200)
        live = DraftStep(trial % 4, int(row.argmax()), logits=row)
        q = torch.softmax(row.float(), dim=-1)
        rec = DraftStep(trial % 4, int(row.argmax()), stats=stats_of(q))
        assert step_confidence(live) == step_confidence(rec) == float(q.max())
        for rule in rules:
            rule.begin_round(0)
            a, b = rule.decide(live), rule.decide(rec)
            assert a == b
            seen.add((rule.name, a))
    diff_live, diff_rec = SVIPDifference(0.1), SVIPDifference(0.1)
    diff_live.begin_round(0)
    diff_rec.begin_round(0)
    for j in range(30):
        row = torch.randn(V, generator=gen) * (1 + j % 5)
        q = torch.softmax(row, dim=-1)
        assert diff_live.decide(DraftStep(j, 0, logits=row)) == diff_rec.decide(DraftStep(j, 0, stats=stats_of(q)))
    assert {v for _, v in seen} == {Decision.STOP, Decision.CONTINUE}
    model_free = DraftStep(0, 3)
    assert MaxConfidence().decide(model_free) is Decision.CONTINUE and step_confidence(model_free) is None


def test_replay_command_prints_and_writes_json(env, tmp_path, capsys):
    _, _, trace = env
    path = trace.save(tmp_path / "t.npz")
    out = tmp_path / "r.json"
    replay_command(str(path), selector=["ucbspec", "hedgespec"], length=[], k=[3, 5], drafter=[],
                   oracle=True, json_out=str(out))
    text = capsys.readouterr().out
    assert "ucbspec" in text and "hindsight bounds" in text and "rounds/s" in text
    doc = json.loads(out.read_text())
    assert len(doc["results"]) == 4 and doc["oracle"]["k"] == 3
    assert all(r["exact"] for r in doc["results"])
    replay_command(str(path), selector=[], length=["cost-model"], k=[5], drafter=["suffix", "none"],
                   oracle=False, json_out=None)
    assert "time-dep." in capsys.readouterr().out


def test_record_helper_saves_a_trace(env, tmp_path):
    target, _, _ = env
    path = tmp_path / "sub" / "rec.npz"
    trace = record(target, ["prompt-lookup"], PROMPTS[:2], 12, path, max_draft=4)
    back = Trace.load(path)
    assert back.specs == ["prompt-lookup"] and len(back.prompts) == 2 and back.max_draft == 4
    assert [p.output for p in back.prompts] == [p.output for p in trace.prompts]
    assert all(len(p.output) == 12 for p in back.prompts)


@pytest.mark.slow
def test_smollm2_replay_equals_live():
    from adaspec.models import load_model

    target = load_model("smollm2")
    prompts = ["Repeat exactly: the red fox jumps over the red fox.", "List the days of the week."]
    engine = SpeculativeEngine(target, ["prompt-lookup", "suffix"])
    ids = [engine.encode_prompt(p) for p in prompts]
    trace = record_trace(target, ["prompt-lookup", "suffix"], ids, 24, calibrate=False)
    for selector, k in [("static", 5), ("ucbspec", 5), ("hedgespec", 3)]:
        want = live_keys(target, ["prompt-lookup", "suffix"], selector, None, k, prompts=ids, n=24)
        got = replay(trace, selector, k=k)
        assert [got.keys(i) for i in range(len(ids))] == want


def test_replay_on_another_cost_surface(env, tmp_path):
    """``costs=``: the same rounds priced on another backend's surface, used as measured (no
    verify_scale, prefills from it): a static policy's rounds are unchanged, AR costs what the
    surface says, and a surface whose wide blocks are steep turns k=5's speed-up below 1."""
    from adaspec.bench.replay import load_surface
    from adaspec.costs import VerifyCostSurface

    _, _, trace = env
    ks = [1, 2, 4, 8, 16]
    flat = VerifyCostSurface([64], ks, [[0.01] * 5], [0.05])
    steep = VerifyCostSurface([64], ks, [[0.01 * k for k in ks]], [0.05])
    on_flat = replay(trace, None, None, k=5, drafters=["suffix"], costs=flat)
    on_steep = replay(trace, None, None, k=5, drafters=["suffix"], costs=steep)
    assert [r.key() for r in on_flat.rounds] == [r.key() for r in on_steep.rounds]
    assert on_flat.speedup > 1.0 > on_steep.speedup
    ar = replay(trace, None, None, drafters=["none"], costs=flat)
    over = trace.overheads
    want = sum(flat.prefill(trace.prompts[p.index].n_prompt - 1) + over.request_s
               + p.new_tokens * (0.01 + over.round_s) for p in ar.prompts)
    assert ar.seconds == pytest.approx(want)
    path = tmp_path / "surface.json"
    path.write_text(json.dumps(steep.to_dict()))
    assert load_surface(str(path)).cost(3, 64) == pytest.approx(steep.cost(3, 64))
    with pytest.raises(ConfigError, match="cannot read a verify-cost surface"):
        load_surface(str(tmp_path / "missing.json"))


@pytest.mark.parametrize("names", [["prompt-lookup"], ["suffix"], ["prompt-lookup", "suffix", "none"]])
def test_tree_replay_equals_a_live_tree_run_round_for_round(env, names, monkeypatch):
    """Replay grows the model-free drafters' trees on the recorded greedy path and accepts them
    along it (``_oracle``): on a flat, free verify curve every node pays, so no decision reads a
    time, and a live ``tree=True`` run's rounds are the replay's, round for round."""
    from adaspec.costs import VerifyCostCurve, VerifyCostSurface

    target, _, trace = env
    free = VerifyCostCurve(list(range(1, 17)), [0.0] * 16, 0)
    monkeypatch.setattr("adaspec.engine.load_or_measure", lambda *a, **k: VerifyCostSurface.of(free))
    selector = "round-robin" if len(names) > 1 else None
    engine = SpeculativeEngine(target, names, selector=selector, k=4, tree=True, tree_nodes=6)
    engine.cost_model.observe_overhead(0.0)
    want = []
    for ids in PROMPTS:
        res = engine.generate(ids, max_new_tokens=N)
        want.append([(r.drafter, r.k_cap, r.drafted, r.accepted, r.emitted) for r in res.stats.rounds])
    flat = dataclasses.replace(trace, surface=None, policy_surface=None, cache={})
    got = replay(flat, selector, None, k=4, drafters=names, tree=True, tree_nodes=6)
    assert any(r.drafted > r.k_cap for p in range(len(PROMPTS)) for r in got.prompts[p].rounds)  # trees grew
    for i in range(len(PROMPTS)):
        assert got.keys(i) == want[i], f"prompt {i}"
