"""``auto`` (selection/auto.py): the time objective, the chain estimator under censoring, the
joint cap with cost cliffs, warm start, within-request adaptation, and exactness in the engine.

Synthetic environments are model-free: a drafter is a two-state Markov chain of acceptances
(proposal probability h, first-token acceptance a, continuation c) with a drafting cost.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import numpy as np
import pytest

from conftest import chisquare_gof, make_tiny_model, word_tokenizer

from adaspec import SpeculativeEngine
from adaspec.config import SamplingConfig
from adaspec.drafters.base import Decision, Draft, DraftStep, StepStats
from adaspec.errors import ConfigError
from adaspec.feedback import RoundFeedback
from adaspec.models import as_loaded
from adaspec.selection import build_policies
from adaspec.drafters.base import Peek
from adaspec.drafters import drafter_family
from adaspec.selection.auto import (AutoController, AutoLength, AutoSelector, ChainCounts, Plan, expected_tokens,
                                    lower_bound, peek_chain, peek_context, verify_floor)

GREEDY = SamplingConfig()
WORDS = [f"w{i:02d}" for i in range(32)]


class FixedCosts:
    """A cost model with a given verify curve and per-drafter drafting seconds per token."""

    def __init__(self, verify: dict[int, float], draft_token_s: dict[int, float] | None = None,
                 overhead: float = 0.0):
        self.verify, self.draft_token_s, self.round_overhead_s = verify, draft_token_s or {}, overhead

    def verify_cost(self, width: int, ctx=None) -> float:
        return self.verify.get(width, self.verify[max(self.verify)])

    def draft_cost(self, drafter: int, n: int, ctx=None) -> float:
        return self.draft_token_s.get(drafter, 0.0) * n


def flat(v: float = 1.0, slope: float = 0.0, top: int = 20) -> dict[int, float]:
    return {w: v + slope * (w - 1) for w in range(1, top + 1)}


class MarkovArm:
    def __init__(self, h: float, a: float, c: float):
        self.h, self.a, self.c = h, a, c

    def chain(self, rng: random.Random, m: int) -> tuple[bool, list[float]]:
        """(proposed, 0/1 acceptance at each of m positions): the teacher-forced observation."""
        proposed = rng.random() < self.h
        out, alive = [], proposed
        for j in range(m):
            p = self.a if j == 0 else self.c
            ok = alive and rng.random() < p
            out.append(1.0 if ok else 0.0)
            alive = ok
        return proposed, out


def round_feedback(arms: list[MarkovArm], chosen: int, k: int, rng: random.Random, r: int) -> RoundFeedback:
    """One greedy round: the chosen arm drafts up to k, the others are scored on what was emitted."""
    proposed, acc = arms[chosen].chain(rng, k)
    n = 0
    while proposed and n < k and acc[n] == 1.0:
        n += 1
    drafted = k if proposed else 0
    emitted = [0] * (n + 1)
    fb = RoundFeedback(round=r, drafter=chosen, draft=Draft(tokens=[0] * drafted), n_accepted=n, emitted=emitted,
                       k_cap=k, target_logits=None, sampling=GREEDY)
    cf, props = {}, {}
    if k == 0:  # the engine scores a zero-cap chosen drafter like the others
        cf[chosen], props[chosen] = None, None
    for d, arm in enumerate(arms):
        if d == chosen and k != 0:
            continue
        p, g = arm.chain(rng, len(emitted))
        cf[d], props[d] = g, [p] * len(emitted)
    fb.counterfactual = {d: g for d, g in cf.items() if g is not None}
    fb.counterfactual_alpha = {d: list(g) for d, g in fb.counterfactual.items()}
    fb.counterfactual_proposed = {d: p for d, p in props.items() if p is not None}
    return fb


def run_requests(sel: AutoSelector, envs: list[list[MarkovArm]], names: list[str], rounds: int,
                 seed: int = 0) -> list[list[tuple[int, int]]]:
    """Run one request per environment; returns the (drafter, cap) of every round."""
    rng = random.Random(seed)
    length = sel.paired_length()
    out = []
    for arms in envs:
        sel.begin_request(names)
        length.begin_request()
        plays = []
        for r in range(rounds):
            d = sel.select()
            k = length.begin_round(d)
            sel.update(round_feedback(arms, d, k, rng, r))
            plays.append((d, k))
        out.append(plays)
    return out


# -- the estimator --------------------------------------------------------------------------
def test_chain_estimator_is_consistent_under_censoring():
    """Runs are observed only up to a random window (the round's emitted tokens): the
    transition counts recover (h, a, c); the naive run-length estimate is biased low. Fixed
    seed; 20,000 chains give a standard error under 0.005, the tolerance is 0.015."""
    rng = random.Random(7)
    arm = MarkovArm(0.6, 0.5, 0.8)
    counts = ChainCounts()
    naive_runs, naive_n = 0.0, 0
    for _ in range(20_000):
        m = rng.randint(1, 6)
        proposed, g = arm.chain(rng, m)
        counts.observe(g, g, proposed)
        if proposed and g[0] == 1.0:
            run = 1
            while run < m and g[run] == 1.0:
                run += 1
            naive_runs += run - 1  # continuations seen before the (possibly censored) end
            naive_n += 1
    h, a, c = counts.estimate((0.5, 0.5, 0.5), weight=1e-9)
    assert h == pytest.approx(0.6, abs=0.015) and a == pytest.approx(0.5, abs=0.015)
    assert c == pytest.approx(0.8, abs=0.015)
    # naive: treat every observed run as ended -> geometric mean run r gives c = r / (1 + r)
    r = naive_runs / naive_n
    assert r / (1 + r) < 0.8 - 0.1


def test_expected_tokens_matches_simulation():
    rng = random.Random(1)
    arm = MarkovArm(0.7, 0.6, 0.9)
    k, n = 5, 40_000
    total = 0
    for _ in range(n):
        proposed, g = arm.chain(rng, k)
        acc = 0
        while proposed and acc < k and g[acc] == 1.0:
            acc += 1
        total += acc + 1
    assert total / n == pytest.approx(expected_tokens(0.7, 0.6, 0.9, k), rel=0.01)
    assert expected_tokens(0.7, 0.6, 0.9, 0) == 1.0


# -- choices ----------------------------------------------------------------------------------
def controller_with(estimates: dict[int, tuple[float, float, float]], costs: FixedCosts,
                    names: list[str]) -> AutoController:
    c = AutoController(prior_weight=1e-9, shrink=0.0)  # plans on exactly these estimates
    c.costs = costs
    c.begin_request(names)
    for d, (h, a, cc) in estimates.items():  # counts that estimate exactly (h, a, c)
        c.request_counts[d].s = [h * 1e6, a * 1e6, cc * 1e6]
        c.request_counts[d].t = [1e6, 1e6, 1e6]
    return c


def test_time_objective_beats_accepted_length():
    """A accepts more but drafts slowly; B accepts less and drafts for free: auto must follow
    time, not accepted length."""
    est = {0: (1.0, 0.8, 0.85), 1: (1.0, 0.6, 0.7)}
    costs = FixedCosts(flat(1.0, 0.02), draft_token_s={0: 0.4, 1: 0.0})
    c = controller_with(est, costs, ["slow-model", "lookup"])
    plan = c.choose()
    assert plan.drafter == 1
    a, b = c.best_k(0), c.best_k(1)
    assert expected_tokens(*est[0], a.k) > expected_tokens(*est[1], 1)  # A would accept more per round
    assert b.rate > a.rate
    # with free drafting for both, A wins: it is the accepted length that differs
    c.costs = FixedCosts(flat(1.0, 0.02))
    assert c.choose().drafter == 0


def test_cap_never_stops_inside_a_cost_cliff():
    """V(3) costs more than V(5) (a GEMM cliff): with decent acceptance, k=2 (width 3) is never
    the cap; k=4 (width 5) or longer is."""
    curve = {1: 1.0, 2: 1.5, 3: 2.0, 4: 1.3, 5: 1.2, 6: 1.25, 7: 1.3, 8: 1.3}
    curve.update({w: 1.3 + 0.05 * (w - 8) for w in range(9, 20)})
    c = controller_with({0: (1.0, 0.7, 0.6)}, FixedCosts(curve), ["lookup"])
    plan = c.best_k(0)
    assert plan.k >= 4 and plan.k != 2
    # a plain verify-cost-free curve and a poor drafter: the cap is short but not zero
    c2 = controller_with({0: (1.0, 0.3, 0.3)}, FixedCosts(flat(1.0, 0.1)), ["lookup"])
    assert c2.best_k(0).k == 1


def test_pruned_cap_search_equals_the_full_search():
    """``best_k`` with the verify floor stops early but must pick what pricing every cap picks,
    on random curves with cliffs, random drafting costs and estimates (peeked or not)."""
    rng = random.Random(7)
    for trial in range(300):
        curve = {w: rng.uniform(0.5, 2.5) for w in range(1, 20)}
        est = (rng.choice([0.0, 0.3, 1.0, rng.random()]), rng.random(), rng.choice([0.0, 0.99, rng.random()]))
        costs = FixedCosts(curve, {0: rng.choice([0.0, 0.01, 0.2])}, overhead=rng.uniform(0.0, 0.5))
        c = controller_with({0: est}, costs, ["suffix"])
        if trial % 2:  # a looked-at block of random length (drafting paid, h = 1)
            c.observe_proposals({0: Peek(list(range(rng.randint(1, 20))), 3)})
        verify, draft, overhead = c._cost_fns()
        widths = [0.0] + [verify(w) for w in range(1, c.max_k + 2)]
        full = c.best_k(0, widths.__getitem__, draft, overhead)
        pruned = c.best_k(0, widths.__getitem__, draft, overhead, verify_floor(widths))
        assert (pruned.k, pruned.rate) == (full.k, full.rate), trial


def test_plain_decoding_when_drafting_does_not_pay():
    c = controller_with({0: (1.0, 0.02, 0.1), 1: (1.0, 0.01, 0.1)}, FixedCosts(flat(1.0, 0.3), {0: 0.05}),
                        ["lookup", "suffix", "none"])
    plan = c.choose()
    assert plan.k == 0 and plan.drafter == 2  # the none arm takes the plain step
    c3 = controller_with({0: (1.0, 0.02, 0.1)}, FixedCosts(flat(1.0, 0.3)), ["lookup"])
    assert c3.choose() .k == 0  # no none arm: cap 0 on the drafter itself


def test_peeked_proposals_decide_among_model_free_drafters():
    """Looking first: a drafter known to have no proposal this round is not chosen however good
    its record, and the cap never exceeds the proposal's length."""
    c = controller_with({0: (0.9, 0.9, 0.9), 1: (0.6, 0.6, 0.6)}, FixedCosts(flat(1.0, 0.02)),
                        ["suffix", "lookup", "none"])
    assert c.choose().drafter == 0
    c.observe_proposals({0: [], 1: [7, 8, 9]})
    plan = c.choose()
    assert plan.drafter == 1 and 1 <= plan.k <= 3
    c.observe_proposals({0: [], 1: []})
    assert c.choose().k == 0
    c.observe_proposals({0: [1, 2], 1: [3] * 16})  # 0's short block still beats 1's long one here
    assert (c.choose().drafter, c.choose().k) == (0, 2)


def test_peek_option_is_validated_and_off_means_no_looking():
    assert AutoSelector(peek=1).peek_tokens == 3 == AutoSelector().peek_tokens  # on by default
    assert AutoSelector(peek=0).peek_tokens == 0 and AutoSelector(peek_depth=16).peek_tokens == 16
    with pytest.raises(ConfigError, match="peek_depth must be"):
        AutoSelector(peek_depth=0)
    with pytest.raises(ConfigError, match="shrink must be"):
        AutoSelector(shrink=-1)
    with pytest.raises(ConfigError, match="peek must be 0 or 1"):
        AutoSelector(peek=2)
    with pytest.raises(ConfigError, match="objective must be 'time' or 'length'"):
        AutoSelector(objective="speed")
    with pytest.raises(ConfigError, match="feedback must be 'full' or 'bandit'"):
        AutoSelector(feedback="partial")
    assert not AutoSelector(feedback="bandit").full_information


def test_length_objective_ignores_costs():
    """objective=length (ablation): the longest cap always, whatever the verify curve says."""
    est = {0: (1.0, 0.6, 0.7)}
    steep = FixedCosts({w: 1.0 + 0.5 * (w - 1) for w in range(1, 21)})
    assert controller_with(est, steep, ["a"]).choose().k < 4
    c = AutoController(prior_weight=1e-9, objective="length")
    c.costs = steep
    c.begin_request(["a"])
    c.request_counts[0].s, c.request_counts[0].t = [1e6, 0.6e6, 0.7e6], [1e6, 1e6, 1e6]
    assert c.choose().k == c.max_k


# -- learning ---------------------------------------------------------------------------------
def test_follows_the_drafter_that_pays_per_prompt_family():
    """Family X: drafter 0 copies long runs, 1 is poor; family Y the reverse. One request per
    family, global scope: the controller picks the right drafter in each request after a few
    rounds, and the second request starts from what the first learnt."""
    good, poor = MarkovArm(0.9, 0.8, 0.9), MarkovArm(0.5, 0.3, 0.4)
    costs = FixedCosts(flat(1.0, 0.03))
    sel = AutoSelector()
    sel.costs = costs
    x, y = [good, poor], [poor, good]
    plays = run_requests(sel, [x, y, x], ["a", "b"], rounds=60)
    for req, best in zip(plays, [0, 1, 0]):
        late = [d for d, _ in req[20:]]
        assert late.count(best) / len(late) > 0.9
    # within-request adaptation: in request 2 (family Y after X) it switches within 15 rounds
    switch = next(i for i, (d, _) in enumerate(plays[1]) if d == 1)
    assert switch < 15


def test_warm_start_keeps_the_global_prior_and_scope_request_forgets():
    arms = [MarkovArm(0.95, 0.9, 0.95), MarkovArm(0.2, 0.2, 0.2)]
    for scope, expect_learnt in (("global", True), ("request", False)):
        sel = AutoSelector(scope=scope)
        sel.costs = FixedCosts(flat(1.0, 0.03))
        run_requests(sel, [arms], ["a", "b"], rounds=40)
        sel.begin_request(["a", "b"])
        sel.controller.shrink = 0.0  # the posterior mean (plans use a lower bound)
        h, a, c = sel.controller.estimate(0)
        assert (a > 0.7) is expect_learnt


def test_bad_options_are_clear():
    with pytest.raises(ConfigError, match="max_k"):
        AutoSelector(max_k=0)
    with pytest.raises(ConfigError, match="request_decay"):
        AutoSelector(request_decay=1.5)
    with pytest.raises(ConfigError, match="scope"):
        AutoSelector(scope="forever")


def test_build_policies_pairs_the_length_unless_given():
    sel, ln = build_policies("auto", None)
    assert isinstance(ln, AutoLength) and ln.controller is sel.controller
    sel, ln = build_policies("auto:max_k=8", "static:k=3")
    assert ln.name == "static" and sel.controller.max_k == 8
    _, ln = build_policies(None, "auto")
    assert isinstance(ln, AutoLength) and not ln.shared


# -- in the engine ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sharp_model():
    """Context-sensitive tiny model (init std 0.3) with a word tokenizer."""
    return as_loaded(make_tiny_model(seed=3, init_std=0.3, lm_head_scale=3.0), word_tokenizer(WORDS), "tiny")


@pytest.mark.parametrize("selector", ["auto", "auto:peek=0", "auto:peek_depth=2,shrink=0"])
@pytest.mark.parametrize("drafters", [["prompt-lookup", "suffix", "none"], ["suffix"], ["prompt-lookup", "self"]])
def test_greedy_output_identical_to_plain_decoding(sharp_model, drafters, selector):
    engine = SpeculativeEngine(sharp_model, drafters, selector=selector)
    plain = SpeculativeEngine(sharp_model, [], k=1)
    rng = random.Random(0)
    drafted = accepted = 0
    for _ in range(4):
        motif = [rng.randrange(32) for _ in range(4)]
        ids = (motif * 4)[: rng.randint(6, 16)] + [rng.randrange(32)]
        got = engine.generate(ids, max_new_tokens=24)
        want = plain.generate(ids, max_new_tokens=24)
        assert got.token_ids == want.token_ids
        drafted, accepted = drafted + got.stats.drafted, accepted + got.stats.accepted
    assert isinstance(engine.length, AutoLength)
    assert drafted > 0 and accepted > 0  # auto drafted: the comparison is not plain against plain


def test_auto_is_the_default_over_several_drafters(sharp_model):
    """No drafters: auto over prompt-lookup, suffix, recycle and none; several drafters and no
    selector: auto; one drafter: that drafter at static k (what -d X -k K has always meant)."""
    engine = SpeculativeEngine(sharp_model)
    assert engine.drafter_names == ["prompt-lookup", "suffix", "recycle", "none"]
    assert isinstance(engine.selector, AutoSelector) and isinstance(engine.length, AutoLength)
    assert isinstance(SpeculativeEngine(sharp_model, ["prompt-lookup", "suffix"]).selector, AutoSelector)
    one = SpeculativeEngine(sharp_model, ["suffix"], k=3)
    assert one.selector.name == "static" and one.length.name == "static"
    assert one.with_policies(None).selector.name == "static"
    assert isinstance(engine.with_policies([0, 2]).selector, AutoSelector)


def test_agreement_counts_only_across_drafter_families():
    """A suffix drafter over a datastore proposes what plain suffix matching does whenever the
    request holds the longest match: their agreement is no evidence, so a block agreeing only
    with its own family is ``alone``; agreeing with prompt lookup is ``agree``."""
    fams = ["prompt-lookup", "suffix", "suffix", "none"]
    blocks = {0: [], 1: [7, 8], 2: [7, 8], 3: []}
    assert peek_context(1, blocks) == "agree"  # without families: any other drafter counts
    assert peek_context(1, blocks, families=fams) == "alone"
    assert peek_context(1, {0: [9], 1: [7], 2: [7], 3: []}, families=fams) == "disagree"
    assert peek_context(1, {0: [7], 1: [7], 2: [5], 3: []}, match=6, families=fams) == "agree:6"
    assert [drafter_family(s) for s in ("pld", "prompt-lookup:max_ngram=2", "suffix:datastore=x.jsonl",
                                        "self", "feature-head:path=h.pt", "none")] == [
        "prompt-lookup", "prompt-lookup", "suffix", "model", "feature-head", "none"]


def test_the_engine_tells_auto_the_drafter_families(sharp_model):
    """The engine binds families from the drafter instances, whatever their names; the peek
    contexts then ignore same-family agreement."""
    engine = SpeculativeEngine(sharp_model, ["prompt-lookup", "suffix", "suffix:min_match=3", "none"])
    assert engine.selector.controller.families == ["prompt-lookup", "suffix", "suffix", "none"]
    ids = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3]
    out = engine.generate(ids, max_new_tokens=12)
    assert out.token_ids == SpeculativeEngine(sharp_model, [], k=1).generate(ids, max_new_tokens=12).token_ids
    assert out.stats.drafted > 0 and out.stats.accepted > 0


def test_peeked_block_is_the_drafted_block(sharp_model):
    """With looking on, the engine drafts the peeked block (no second proposal) and the rounds
    are the same as with looking off whenever the choices agree: same drafter, same block."""
    ids = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3]
    on = SpeculativeEngine(sharp_model, ["prompt-lookup"], selector="auto:peek=1").generate(ids, max_new_tokens=20)
    off = SpeculativeEngine(sharp_model, ["prompt-lookup"], selector="auto:peek=0").generate(ids, max_new_tokens=20)
    assert on.token_ids == off.token_ids
    assert sum(r.drafted for r in on.stats.rounds) > 0 and on.stats.accepted > 0


def test_a_look_cut_at_the_depth_is_drafted_again(sharp_model):
    """peek_depth=2: a block as long as the look may go on, so the controller may plan a longer
    cap, and the engine then drafts the full cap (the output stays plain decoding's)."""
    ids = [1, 2, 3, 4, 5, 6] * 4 + [1]
    engine = SpeculativeEngine(sharp_model, ["prompt-lookup", "none"], selector="auto:peek_depth=2,shrink=0")
    plain = SpeculativeEngine(sharp_model, [], k=1)
    out = engine.generate(ids, max_new_tokens=24)
    assert out.token_ids == plain.generate(ids, max_new_tokens=24).token_ids
    assert max(r.drafted for r in out.stats.rounds) > 2 and out.stats.accepted > 0


def _first_three_tokens(engine, prompt, vocab: int, runs: int = 2000) -> tuple[np.ndarray, dict[str, int]]:
    """Counts of the first 3 sampled tokens (T=1, seeds 0..runs-1), flattened, and the rounds
    each drafter drafted in; every test also checks that some drafts were accepted and some
    rejected (both branches of the rule ran)."""
    counts = np.zeros(vocab ** 3)
    used: dict[str, int] = {}
    drafted = accepted = 0
    for s in range(runs):
        out = engine.generate(prompt, max_new_tokens=3, temperature=1.0, seed=s)
        a, b, c = out.token_ids
        counts[(a * vocab + b) * vocab + c] += 1
        drafted, accepted = drafted + out.stats.drafted, accepted + out.stats.accepted
        for r in out.stats.rounds:
            if r.drafted:
                used[r.drafter] = used.get(r.drafter, 0) + 1
    assert 0 < accepted < drafted, (accepted, drafted)
    return counts, used


def test_sampling_distribution_is_exact():
    """Sampling (T=1) with auto over [prompt-lookup, a confidently wrong model drafter]: drafter
    switching, zero caps and full-information scoring; the distribution of the first 3 tokens
    equals the target's exact one (chi-square, level ALPHA = 0.001, as test_distribution.py)."""
    from test_distribution import ALPHA, PLD_PROMPT, V, exact_distribution

    from adaspec.drafters import ModelDrafter, PromptLookupDrafter

    target = make_tiny_model(seed=0, vocab=V, init_std=0.2, lm_head_scale=1.5)
    wrong = as_loaded(make_tiny_model(seed=123, vocab=V, init_std=0.2, lm_head_scale=5.0))
    cfg = SamplingConfig(temperature=1.0)
    want = exact_distribution(target, PLD_PROMPT, cfg, 3).reshape(-1)
    engine = SpeculativeEngine(as_loaded(target), [PromptLookupDrafter(), ModelDrafter(wrong, V)], selector="auto")
    counts, used = _first_three_tokens(engine, PLD_PROMPT, V)
    assert len(used) == 2  # both drafters drafted: the controller switched
    _, p, _ = chisquare_gof(counts, want)
    assert p > ALPHA


def test_sampling_over_the_default_arms_is_exact():
    """Sampling (T=1) with auto over its default arms (prompt lookup, suffix, recycle, none):
    the recycle table changes from run to run (earlier runs' verified rows only); the first 3
    tokens follow the target's exact distribution (chi-square at ALPHA = 0.001, 2000 fixed
    seeds), and recycle drafted in some rounds."""
    from test_distribution import ALPHA, PLD_PROMPT, V, exact_distribution

    from adaspec.engine import DEFAULT_DRAFTERS

    target = make_tiny_model(seed=0, vocab=V, init_std=0.2, lm_head_scale=1.5)
    cfg = SamplingConfig(temperature=1.0)
    want = exact_distribution(target, PLD_PROMPT, cfg, 3).reshape(-1)
    engine = SpeculativeEngine(as_loaded(target), list(DEFAULT_DRAFTERS), selector="auto")
    assert "recycle" in engine.drafter_names
    counts, used = _first_three_tokens(engine, PLD_PROMPT, V)
    assert used.get("recycle", 0) > 0 and len(used) >= 2
    _, p, _ = chisquare_gof(counts, want)
    assert p > ALPHA


# -- looking first: blocks as feedback, contexts, lower bounds ---------------------------------
def test_peek_chain_is_unbiased_for_one_hot_acceptance_under_sampling():
    """A looked-at block scored on sampled output (``peek_chain``): the emitted token at a
    position is distributed as the target's p, so 1[emitted = block token] has mean p(block
    token) and the chain counts recover a = p_1(b_1) and c = p_2(b_2). Fixed seed, 40,000 rounds:
    standard errors <= 0.0025 (a) and 0.004 (c); tolerance 0.015 (> 3.5 sigma). A variant that
    scores positions after a mismatch as well (no break) is biased on c and fails."""
    rng = random.Random(11)
    p1, p2 = [0.6, 0.3, 0.1], [0.45, 0.45, 0.1]  # target distributions over 3 tokens
    block = [0, 1]  # the drafter proposes token 0, then token 1
    counts, broken = ChainCounts(), ChainCounts()
    for _ in range(40_000):
        e1 = rng.choices(range(3), p1)[0]
        e2 = rng.choices(range(3), p2)[0]  # (off the block's prefix when e1 != 0: not its chain)
        counts.observe(peek_chain(block, [e1, e2]), peek_chain(block, [e1, e2]), True)
        g = [1.0 if b == e else 0.0 for b, e in zip(block, [e1, e2])]
        broken.t[1] += 1
        broken.s[1] += g[0]
        broken.t[2] += 1  # counts the second position whatever happened at the first
        broken.s[2] += g[1]
    _, a, c = counts.estimate((0.5, 0.5, 0.5), 1e-9)
    assert a == pytest.approx(0.6, abs=0.015) and c == pytest.approx(0.45, abs=0.015)
    assert peek_chain([5, 6, 7], [5, 9, 7]) == [1.0, 0.0] and peek_chain([], [1]) == []
    _, _, c_broken = broken.estimate((0.5, 0.5, 0.5), 1e-9)
    assert c_broken == pytest.approx(0.45, abs=0.015)  # here position 2 is independent of 1 ...
    # ... but with a chain that only continues on its own path, counting after a mismatch
    # mixes in the off-path rate: simulate e2 matching only if e1 did (a copy run)
    counts, broken = ChainCounts(), ChainCounts()
    for _ in range(40_000):
        on = rng.random() < 0.6
        cont = on and rng.random() < 0.9
        off_match = (not on) and rng.random() < 0.3  # off the path, a chance match
        emitted = [0 if on else 2, 1 if (cont or off_match) else 2]
        g = peek_chain(block, emitted)
        counts.observe(g, g, True)
        broken.t[2] += 1.0
        broken.s[2] += 1.0 if emitted[1] == 1 else 0.0
    assert counts.estimate((0.5, 0.5, 0.5), 1e-9)[2] == pytest.approx(0.9, abs=0.015)
    assert broken.s[2] / broken.t[2] < 0.9 - 0.1


def test_lower_bound_shrinks_with_evidence():
    assert lower_bound(0.8, 1e9, 2.0) == pytest.approx(0.8, abs=1e-3)
    assert lower_bound(0.8, 8.0, 2.0) == pytest.approx(0.8 - 2.0 * (0.16 / 9) ** 0.5)
    assert lower_bound(0.8, 8.0, 0.0) == 0.8 and lower_bound(0.01, 1.0, 5.0) == 0.0


#: llama.cpp-shaped verify curve (SmolLM2 Q4_1, 2 threads, docs/llamacpp.md): V(w) / V(1)
STEEP = {1: 1.0, 2: 1.83, 3: 2.18, 4: 2.70, 5: 3.35, 6: 3.74, 7: 4.13, 8: 4.57, 9: 4.88, 10: 5.19,
         11: 5.51, 12: 5.82, 13: 6.13, 14: 6.45, 15: 6.76, 16: 7.07, 17: 7.12}


def peeked_requests(sel: AutoSelector, contexts: list[tuple[int, float, float]], requests: int, rounds: int,
                    seed: int) -> tuple[float, float]:
    """Requests over [suffix, none] where the suffix block (4 tokens) is looked at every round:
    each round draws a context (match length, a, c) at random; returns (seconds, seconds of
    plain decoding of the same tokens) on ``sel.costs``."""
    rng = random.Random(seed)
    length = sel.paired_length()
    sel.bind_drafters([False, False])
    spent = tokens = 0.0
    for _ in range(requests):
        sel.begin_request(["suffix", "none"])
        length.begin_request()
        for r in range(rounds):
            match, a, c = rng.choice(contexts)
            block = [1, 2, 3, 4]
            sel.observe_proposals({0: Peek(block, match)})
            d = sel.select()
            k = length.begin_round(d)
            ok = [rng.random() < a]
            while len(ok) < 5:
                ok.append(ok[-1] and rng.random() < c)
            n = 0
            while d == 0 and n < k and ok[n]:
                n += 1
            nxt = block[n] if n < 4 and ok[n] else 9  # the target's token after the accepted ones
            emitted = block[:n] + [nxt]
            drafted = k if d == 0 else 0
            fb = RoundFeedback(round=r, drafter=d, draft=Draft(tokens=block[:drafted]), n_accepted=n,
                               emitted=emitted, k_cap=k, target_logits=None, sampling=GREEDY)
            sel.update(fb)
            spent += sel.costs.verify_cost(drafted + 1)
            tokens += len(emitted)
    return spent, tokens * sel.costs.verify_cost(1)


def test_steep_curve_plain_decoding_unless_acceptance_is_very_high():
    """llama.cpp's steep curve: a draft of one token pays only if a > 0.83. Nine contexts (match
    buckets) at a = 0.7 never pay; planning on posterior means (shrink=0) drafts wherever a few
    lucky trials look good (the optimizer's curse) and loses against plain decoding; the lower
    bound (shrink=1, the default) stays level with it. Where acceptance is very high
    (a = c = 0.97) the lower bound still drafts and wins, learning from scratch in every
    request (scope=request). Fixed seed 3; over seeds 0-9 the ratios to plain decoding were:
    a = 0.7, means 1.012-1.036, lower bound 0.992-1.009 (lower by 0.013-0.029 on every seed);
    a = 0.97, lower bound 0.72-0.76, means 0.71-0.74."""
    bad = [(m, 0.7, 0.6) for m in (1, 2, 3, 4, 6, 8, 12, 16, 24)]
    good = [(m, 0.97, 0.97) for m in (8, 12, 16, 24)]
    out = {}
    for shrink in (0.0, 1.0):
        sel = AutoSelector(scope="request", shrink=shrink, peek_depth=8)  # 4-token blocks: k <= 4
        sel.costs = FixedCosts(STEEP)
        out[shrink] = peeked_requests(sel, bad, requests=20, rounds=40, seed=3)
    lb, plain = out[1.0]
    assert lb <= 1.01 * plain
    mean, plain0 = out[0.0]
    assert mean / plain0 > lb / plain + 0.01
    sel = AutoSelector(scope="request", peek_depth=8)
    sel.costs = FixedCosts(STEEP)
    spent, plain = peeked_requests(sel, good, requests=5, rounds=40, seed=3)
    assert spent < 0.8 * plain


def test_full_information_only_for_what_cannot_be_looked_at():
    """Looking first, every model-free drafter is scored on its block: the engine's evaluation
    is off unless a model drafter needs it; 'none' is never evaluated, looked-at drafters not."""
    sel = AutoSelector()
    assert sel.full_information  # unbound: the caller may not look, so it is asked to score
    sel.bind_drafters([False, False, False])
    assert not sel.full_information
    sel.bind_drafters([False, True])
    assert sel.full_information
    assert AutoSelector(peek=0).full_information and not AutoSelector(peek=0, feedback="bandit").full_information
    c = sel.controller
    c.begin_request(["prompt-lookup", "none", "model"], [False, False, True])
    c.observe_proposals({0: Peek([1, 2], 3)})
    assert not c.evaluate(0) and not c.evaluate(1) and c.evaluate(2)  # round 0: the model is due


def test_peeked_drafters_learn_from_their_blocks_without_evaluation():
    """A round in which 'none' was chosen: the looked-at drafter's block is scored on the
    emitted token (no counterfactual from the engine), in its context."""
    c = AutoController(prior_weight=1.0, shrink=0.0)
    c.begin_request(["suffix", "none"])
    c.observe_proposals({0: Peek([5, 6, 7], 24)})
    ctx = c.contexts[0]
    assert ctx == "alone:24"
    fb = RoundFeedback(round=0, drafter=1, draft=Draft(), n_accepted=0, emitted=[5], k_cap=0,
                       target_logits=None, sampling=GREEDY)
    c.observe(fb)
    assert c.request_ctx[0][ctx].t[1] == 1.0 and c.request_ctx[0][ctx].s[1] == 1.0
    c.observe_proposals({0: Peek([5, 6, 7], 24)})
    c.observe(RoundFeedback(round=1, drafter=1, draft=Draft(), n_accepted=0, emitted=[8], k_cap=0,
                            target_logits=None, sampling=GREEDY))
    counts = c.request_ctx[0][ctx]  # decayed once by request_decay = 0.98
    assert counts.t[1] == pytest.approx(1.98) and counts.s[1] == pytest.approx(0.98)


def test_cold_start_plans_on_the_prior_mean_and_the_bound_comes_with_trials():
    """A fresh controller (no trials) plans exactly as with shrink=0: the lower bound is for
    estimates picked for being lucky, and before any data nothing was picked (a full bound on
    the prior made a fresh engine decode plainly on SmolLM2 prompts that copy)."""
    def plan(shrink: float, trials: int) -> tuple[tuple[float, float, float], int]:
        c = AutoController(shrink=shrink)
        c.costs = FixedCosts(flat(1.0, 0.05))
        c.begin_request(["suffix", "none"])
        for _ in range(trials):  # evidence at the prior's own rates: the mean stays, the bound tightens
            c.global_counts[0].s = [s + p for s, p in zip(c.global_counts[0].s, (0.5, 0.5, 0.7))]
            c.global_counts[0].t = [t + 1.0 for t in c.global_counts[0].t]
        return c.estimate(0), c.choose().k

    cold, cold_k = plan(1.0, 0)
    mean, mean_k = plan(0.0, 0)
    assert cold == pytest.approx(mean) and cold_k == mean_k > 0
    warm = plan(1.0, 1000)[0]
    assert all(w < m - 0.05 for w, m in zip(warm[1:], mean[1:]))  # with evidence, the full bound


# -- per-token stopping for drafters that report q (model drafters) ---------------------------
def q_step(j: int, conf: float) -> DraftStep:
    """A drafted token whose q has top probability ``conf`` (as a trace's statistics)."""
    return DraftStep(j, 0, stats=StepStats(conf, 1.0 - conf, 0.0))


def q_requests(sel: AutoSelector, rounds: int, chain: Callable[[random.Random], tuple[list[float], int]],
               seed: int = 0) -> list[tuple[int, int, int, int]]:
    """One request over [model, none] with a synthetic model drafter: ``chain(rng)`` gives each
    round's block, the max q of each token it would draft and how many of them the target
    accepts. The engine's loop and its full-information scoring of the model (every
    ``model_eval_every`` rounds) as in ``round_feedback``. Returns (drafter, cap, drafted,
    accepted run) of every round; ``sel.spent`` the seconds on ``sel.costs``, ``sel.emitted``
    the tokens, ``sel.length`` the paired length policy."""
    rng = random.Random(seed)
    length = sel.length = sel.paired_length()
    for p in (sel, length):
        p.bind_drafters([True, False])
    out = []
    sel.spent = sel.emitted = 0.0
    sel.begin_request(["model", "none"])
    length.begin_request()
    for r in range(rounds):
        confs, run = chain(rng)
        d = sel.select()
        cap = length.begin_round(d)
        drafted = 0
        for j in range(cap if d == 0 else 0):
            v = length.decide(q_step(j, confs[j]))
            if v is Decision.DISCARD:
                break
            drafted += 1
            if v is Decision.STOP:
                break
        n = min(drafted, run)
        emitted = [0] * (n + 1)
        fb = RoundFeedback(round=r, drafter=d, draft=Draft(tokens=[0] * drafted), n_accepted=n,
                           emitted=emitted, k_cap=cap, target_logits=None, sampling=GREEDY)
        if (d != 0 or cap == 0) and sel.evaluate(0):
            g = [1.0 if y < run else 0.0 for y in range(min(len(emitted), run + 1))]
            fb.counterfactual, fb.counterfactual_alpha = {0: g}, {0: list(g)}
            fb.counterfactual_proposed = {0: [True] * len(emitted)}
        sel.update(fb)
        length.update(fb)
        sel.spent += sel.costs.round_overhead_s + sel.costs.draft_cost(0, drafted) + \
            sel.costs.verify_cost(drafted + 1)
        sel.emitted += len(emitted)
        out.append((d, cap, drafted, run))
    return out


def sure_then_unsure(hi: float, lo: float) -> Callable[[random.Random], tuple[list[float], int]]:
    """1-6 tokens at max q = ``hi``, all accepted, then one at ``lo``, rejected, then ``hi``."""
    def chain(rng: random.Random) -> tuple[list[float], int]:
        run = rng.randint(1, 6)
        return [hi] * run + [lo] + [hi] * 64, run
    return chain


def test_model_drafter_blocks_stop_at_the_low_confidence_token():
    """q is high on the accepted tokens and low on the rejected one: with per-token stopping
    (the default) every model block ends at the low-q token (kept or dropped), never past it,
    and the cap is max_k; planning the cap up front (confidence_stop=0, the rule before) drafts
    past the rejection and is slower on the same costs."""
    costs = FixedCosts(flat(1.0, 0.05), {0: 0.1})
    sel = AutoSelector()
    sel.costs = costs
    plays = q_requests(sel, 80, sure_then_unsure(0.97, 0.3))
    model = [(cap, drafted, run) for d, cap, drafted, run in plays if d == 0 and cap > 0]
    assert len(model) > 60
    assert all(cap == sel.controller.max_k for cap, _, _ in model)
    assert all(drafted in (run, run + 1) for _, drafted, run in model)
    before = AutoSelector(confidence_stop=0)
    before.costs = costs
    old = q_requests(before, 80, sure_then_unsure(0.97, 0.3))
    assert sum(drafted > run + 1 for d, _, drafted, run in old if d == 0) > 20
    assert sel.spent / sel.emitted < 0.95 * before.spent / before.emitted  # 0.371 vs 0.400 s a token


def test_auto_learns_the_confidence_to_acceptance_map_online():
    """An overconfident drafter (max q 0.9 on every token, each accepted with probability 0.5):
    before any feedback (f = 1) its blocks run long; the calibration learnt from the verified
    blocks (ConfidenceCalibration, the cost-model rule's: f = observed / predicted acceptance)
    falls towards 0.5 / 0.9 and the blocks get short. A calibrated drafter (q = 0.5 on the
    same chains) is not corrected. The factor is one number per drafter: it fixes over- or
    under-confidence on average, not per confidence level."""
    def chain(q: float) -> Callable[[random.Random], tuple[list[float], int]]:
        def draw(rng: random.Random) -> tuple[list[float], int]:
            run = 0
            while rng.random() < 0.5:
                run += 1
            return [q] * 64, run
        return draw

    costs = FixedCosts(flat(1.0, 0.02), {0: 0.05})
    sel = AutoSelector()
    sel.costs = costs
    plays = q_requests(sel, 80, chain(0.9))
    blocks = [drafted for d, cap, drafted, _ in plays if d == 0 and cap > 0]
    assert blocks[0] >= 10 and sum(blocks[-30:]) / 30 <= 3
    assert 0.5 / 0.9 - 0.1 < sel.length.confidence.factor(0) < 0.75
    calibrated = AutoSelector()
    calibrated.costs = costs
    plays = q_requests(calibrated, 80, chain(0.5))
    late = [drafted for d, cap, drafted, _ in plays[-30:] if d == 0 and cap > 0]
    assert late and abs(sum(late) / len(late) - sum(blocks[-30:]) / 30) <= 1.0
    assert 0.85 < calibrated.length.confidence.factor(0) < 1.15


def test_model_free_drafters_keep_the_planned_cap():
    """Per-token stopping applies to drafters that report q: model-free pools play the same
    (drafter, cap) rounds with it on or off, decide never stops a model-free block, and a
    model drafter that drafts trees (bind_trees) keeps the plan's cap too."""
    good, poor = MarkovArm(0.9, 0.8, 0.9), MarkovArm(0.5, 0.3, 0.4)
    plays = {}
    for on in (1, 0):
        sel = AutoSelector(confidence_stop=on)
        sel.costs = FixedCosts(flat(1.0, 0.03))
        sel.bind_drafters([False, False])
        plays[on] = run_requests(sel, [[good, poor], [poor, good]], ["a", "b"], rounds=40)
    assert plays[1] == plays[0]
    sel = AutoSelector()
    sel.costs = FixedCosts(flat(1.0, 0.03))
    length = sel.paired_length()
    length.bind_drafters([False, True])
    sel.begin_request(["lookup", "model"])
    length.begin_request()
    c = sel.controller
    for d in (0, 1):
        c.request_counts[d].s, c.request_counts[d].t = [1e6, 0.8e6, 0.8e6], [1e6, 1e6, 1e6]
    assert length.begin_round(0) == c.best_k(0).k < c.max_k
    assert all(length.decide(DraftStep(j, 5)) is Decision.CONTINUE for j in range(20))
    assert length.begin_round(1) == c.max_k  # a model drafter's chain: q decides
    length.bind_trees([False, True])
    assert length.begin_round(1) == c.best_k(1).k  # its tree: the plan's depth
    assert length.decide(q_step(0, 0.01)) is Decision.CONTINUE
    with pytest.raises(ConfigError, match="confidence_stop must be 0 or 1"):
        AutoSelector(confidence_stop=2)


def test_model_drafters_whose_plan_keeps_losing_are_scored_ever_more_rarely():
    """Skipped evaluation with a growing interval: a model drafter whose best plan loses to
    the round's choice is scored at rounds 0, 8, 16, 32, 64, 128, 256 (not every 4th: each
    score is a forward of the model); once its plan would win, every 4th round again."""
    def none_round(r: int) -> RoundFeedback:
        return RoundFeedback(round=r, drafter=1, draft=Draft(), n_accepted=0, emitted=[5], k_cap=0,
                             target_logits=None, sampling=GREEDY)

    c = AutoController(shrink=0.0)
    c.costs = FixedCosts(flat(1.0, 0.05), {0: 0.2})
    c.begin_request(["head", "none"], is_model=[True, False])
    c.global_counts[0].s, c.global_counts[0].t = [1.0, 1.0, 1.0], [1e4, 1e4, 1e4]  # never proposes
    scored = []
    for r in range(300):
        assert c.choose().drafter == 1
        if c.evaluate(0):
            scored.append(r)
        c.observe(none_round(r))
    assert scored == [0, 8, 16, 32, 64, 128, 256]
    c.global_counts[0].s = [1e4, 0.99e4, 0.99e4]  # now it pays: the next score resets the interval
    c.plan = Plan(1, 0, 1.0 / 1.0)  # the round played a plain step
    c.rounds = 512
    assert c.evaluate(0) and c.eval_losses[0] == 0
    c.rounds = 516
    assert c.evaluate(0)


def test_model_drafters_whose_plan_keeps_losing_rest_from_planning():
    """A model drafter whose plan loses is priced ever more rarely (after j losses in a row,
    it rests min(2^(j-1), MAX_PLAN_REST + 1) - 1 rounds), until new evidence about it comes
    (scored or played): then it is priced the next round; a looked-at drafter and a winning
    one are priced every round."""
    from adaspec.selection.auto import MAX_PLAN_REST

    def round_fb(r: int, scored: bool = False) -> RoundFeedback:
        fb = RoundFeedback(round=r, drafter=2, draft=Draft(), n_accepted=0, emitted=[5], k_cap=0,
                           target_logits=None, sampling=GREEDY)
        if scored:
            fb.counterfactual, fb.counterfactual_alpha = {0: [0.0]}, {0: [0.0]}
            fb.counterfactual_proposed = {0: [True]}
        return fb

    c = AutoController(shrink=0.0)
    c.costs = FixedCosts(flat(1.0, 0.05), {0: 0.2, 1: 0.0})
    c.begin_request(["head", "lookup", "none"], is_model=[True, False, False])
    c.global_counts[0].s, c.global_counts[0].t = [1.0, 1.0, 1.0], [1e4, 1e4, 1e4]  # never pays
    priced: list[list[int]] = []
    best_k = c.best_k
    c.best_k = lambda d, *a, **k: (priced[-1].append(d), best_k(d, *a, **k))[1]  # type: ignore[method-assign]
    for r in range(40):
        priced.append([])
        c.observe_proposals({1: Peek([], 0)})  # the lookup is looked at (and has nothing)
        assert c.choose() == (2, 0, 1.0)  # a plain step at rate 1 / V(1)
        assert 1 not in c.rest_until and 2 not in c.rest_until  # looked-at and `none`: never rested
        c.observe(round_fb(r, scored=r == 26))
    head = [r for r, ds in enumerate(priced) if 0 in ds]
    assert head == [0, 1, 3, 7, 15, 23, 27, 35], head  # the score at round 26 ends a rest
    # while the head rests nothing can draft (the lookup has nothing): a plain step, unpriced
    assert all(ds == ([0, 1, 2] if r in head else []) for r, ds in enumerate(priced)), priced
    assert MAX_PLAN_REST == 7
    c.begin_request(["head", "lookup", "none"], is_model=[True, False, False])
    assert not c.rest_until and not c.plan_losses  # a request starts with everyone priced
    heads = AutoController(shrink=0.0)  # only model drafters, none pays: the best still plays
    heads.costs = FixedCosts(flat(1.0, 0.05), {0: 0.2, 1: 0.2})
    heads.begin_request(["h1", "h2"], is_model=[True, True])
    for d in (0, 1):
        heads.global_counts[d].s, heads.global_counts[d].t = [1.0, 1.0, 1.0], [1e4, 1e4, 1e4]
        heads.first_scored[d] = 99
    for r in range(20):
        plan = heads.choose()
        assert plan.k == 0 and plan.drafter in (0, 1)
        heads.observe(RoundFeedback(round=r, drafter=plan.drafter, draft=Draft(), n_accepted=0, emitted=[5],
                                    k_cap=0, target_logits=None, sampling=GREEDY))


def test_a_model_drafter_is_scored_before_it_is_played():
    """Full feedback: a model drafter is scored every round and planned as a plain step until
    MODEL_WARMUP first tokens are scored, however good the prior looks; then its estimates
    decide. Bandit feedback cannot score it, so there it is played on the prior at once."""
    from adaspec.selection.auto import MODEL_WARMUP

    def scored_round(r: int, hit: float) -> RoundFeedback:
        fb = RoundFeedback(round=r, drafter=1, draft=Draft(), n_accepted=0, emitted=[5, 6], k_cap=0,
                           target_logits=None, sampling=GREEDY)
        fb.counterfactual = {0: [hit, hit]}
        fb.counterfactual_alpha = {0: [hit, hit]}
        fb.counterfactual_proposed = {0: [True, True]}
        return fb

    sel = AutoSelector(prior_weight=1.0)
    sel.bind_drafters([True, False])
    sel.begin_request(["head", "none"])
    c = sel.controller
    c.costs = FixedCosts(flat(1.0, 0.01), {0: 0.01})
    assert c.best_k(0).k == 0 and c.choose().drafter == 1  # the prior alone would draft
    for r in range(MODEL_WARMUP):
        assert c.evaluate(0) and c.best_k(0).k == 0
        c.observe(scored_round(r, 1.0))
    assert c.trusted(0) and c.best_k(0).k > 0 and c.choose().drafter == 0
    bandit = AutoSelector(prior_weight=1.0, feedback="bandit")
    bandit.bind_drafters([True, False])
    bandit.begin_request(["head", "none"])
    bandit.controller.costs = c.costs
    assert bandit.controller.trusted(0) and bandit.controller.best_k(0).k > 0


def test_scoring_model_drafters_keeps_to_its_share_of_the_wall_time():
    """Trusted model drafters are scored on their own staggered rounds, and not at all while
    scoring has cost more than ``eval_share`` of the wall time (``CostModel.eval_share``)."""
    from adaspec.costs import CostModel

    sel = AutoSelector(eval_share=0.05)
    sel.bind_drafters([True, True, False])
    sel.begin_request(["h1", "h2", "none"])
    c = sel.controller
    c.costs = CostModel()
    c.first_scored = {0: 99, 1: 99}  # trusted
    c.plan = Plan(2, 0, 1.0)
    due = [(r, d) for r in range(8) for d in (0, 1) if (c.__setattr__("rounds", r) or c.evaluate(d))]
    assert due == [(0, 0), (3, 1), (4, 0), (7, 1)]  # every 4th round, each head on its own
    c.eval_losses = {}
    c.costs.observe_eval(0.0, 1.0)
    assert c.costs.eval_share == 0.0
    c.rounds = 4
    assert c.evaluate(0)
    c.costs.observe_eval(1.0, 1.0)  # scoring now costs ~half the wall time: over the budget
    assert c.costs.eval_share > 0.05
    assert not c.evaluate(0) and c.eval_losses.get(0, 0) == 0  # skipped, not counted as a loss
    c.eval_share = 1.0  # no budget
    assert c.evaluate(0)
    with pytest.raises(ConfigError, match="eval_share must be a number in"):
        AutoSelector(eval_share=2)


def test_a_model_drafter_that_drafts_is_scored_every_few_rounds_again():
    c = AutoController(shrink=0.0)
    c.begin_request(["head", "none"], is_model=[True, False])
    c.eval_losses[0] = 4
    c.observe(RoundFeedback(round=0, drafter=0, draft=Draft(tokens=[1, 2]), n_accepted=1, emitted=[1, 7],
                            k_cap=2, target_logits=None, sampling=GREEDY))
    assert 0 not in c.eval_losses
    c.rounds = 4
    assert c.evaluate(0)


# -- skipping looks that do not pay ---------------------------------------------------------------
def _look_pattern(c: AutoController, blocks_at: dict[int, dict[int, list[int]]], rounds: int) -> str:
    """Play ``rounds`` rounds: 'L' a look planning a plain step, 'D' a look that drafts, '.' a
    round taken without looking (``looks()`` False); ``blocks_at[r]`` the blocks of round r's
    look (default: nobody proposes)."""
    out = []
    for r in range(rounds):
        looked = c.looks()
        if looked:
            c.observe_proposals(blocks_at.get(r, {0: [], 1: []}))
        plan = c.choose()
        out.append(("D" if plan.k else "L") if looked else ".")
        if not looked:
            assert plan.k == 0 and c.names[plan.drafter] == "none" and c.skipping
            assert not c.evaluate(0) and not c.evaluate(1)  # not looked at: seen at the next look
        c.observe(RoundFeedback(round=r, drafter=plan.drafter, draft=Draft(tokens=[5] * plan.k),
                                n_accepted=plan.k, emitted=[5] * (plan.k + 1), k_cap=plan.k,
                                target_logits=None, sampling=GREEDY))
    return "".join(out)


def test_looks_are_skipped_while_they_do_not_pay_and_resume_when_one_drafts():
    """After j looks in a row planned a plain step, min(2^(j-1) - 1, s) rounds go without
    looking, s = the fewest skips that bring the look's seconds to ``look_share`` of a plain
    round on average (here 0.005, look = 4 x 0.5% of the plain round: s = 3; off by default).
    A look that drafts resets it."""
    costs = FixedCosts(flat(1.0, 0.02))
    costs.look_s = 4 * 0.005 * 1.0
    c = controller_with({0: (0.9, 0.9, 0.9), 1: (0.9, 0.9, 0.9)}, costs, ["suffix", "lookup", "none"])
    assert c._max_skip() == 0  # off by default
    c.look_share = 0.005
    assert c._max_skip() == 3
    pattern = _look_pattern(c, {15: {0: [7, 8, 9], 1: []}}, 20)
    assert pattern == "LL.L...L...L" + "...D" + "LL.L"
    costs.look_s = 0.9 * 0.005 * 1.0  # a look cheaper than its share (PyTorch): never skipped
    c.begin_request(["suffix", "lookup", "none"])
    assert _look_pattern(c, {}, 12) == "L" * 12
    del costs.look_s  # a cost model that does not time looks: never skipped
    c.begin_request(["suffix", "lookup", "none"])
    assert _look_pattern(c, {}, 6) == "L" * 6
    costs.look_s = 100.0  # at most MAX_LOOK_SKIP in a row
    c.begin_request(["suffix", "lookup", "none"])
    from adaspec.selection.auto import MAX_LOOK_SKIP
    assert _look_pattern(c, {}, 40).count("." * (MAX_LOOK_SKIP + 1)) == 0


def test_skipped_looks_keep_greedy_output_and_save_peeks(sharp_model, monkeypatch):
    """In the engine: with looks priced far above a plain round every few rounds go without
    peeking (fewer ``Round._peek`` calls than rounds), and the output is still plain decoding's."""
    from adaspec.costs import CostModel

    monkeypatch.setattr(CostModel, "observe_look", lambda self, s: setattr(self, "look_s", 1.0))
    engine = SpeculativeEngine(sharp_model, ["prompt-lookup", "suffix", "none"], selector="auto:look_share=0.005")
    plain = SpeculativeEngine(sharp_model, [], k=1)
    from adaspec.round import Round

    calls = []
    real = Round._peek
    monkeypatch.setattr(Round, "_peek", lambda *a: calls.append(1) or real(*a))
    rng = random.Random(1)
    rounds = accepted = 0
    for _ in range(4):
        ids = [rng.randrange(32) for _ in range(12)]
        got = engine.generate(ids, max_new_tokens=32)
        assert got.token_ids == plain.generate(ids, max_new_tokens=32).token_ids
        rounds, accepted = rounds + len(got.stats.rounds), accepted + got.stats.accepted
    assert 0 < len(calls) < rounds and accepted > 0


def test_a_requests_first_look_is_not_a_looks_price(sharp_model, monkeypatch):
    """The first look of a request also ingests the prompt into every drafter (milliseconds):
    the engine feeds ``observe_look`` from the second round on, so it cannot set off skipping."""
    from adaspec.costs import CostModel

    seen = []
    monkeypatch.setattr(CostModel, "observe_look", lambda self, s: seen.append(s))
    engine = SpeculativeEngine(sharp_model, ["prompt-lookup", "suffix", "none"], selector="auto:look_share=0.005")
    out = engine.generate([3, 4, 5, 6, 3, 4, 5, 6, 3], max_new_tokens=12)
    assert len(seen) == len(out.stats.rounds) - 1  # every round looked (no look price: no skipping)


def test_to_score_is_evaluate_over_every_drafter_in_one_call():
    """``to_score`` (the engine's gate, one call a round) admits exactly the drafters a call
    of ``evaluate`` per drafter does, in index order, with the same bookkeeping (evaluation
    back-off), over random rounds: looks, skipped looks, model drafters losing and winning."""
    import copy
    rng = random.Random(0)
    names = ["prompt-lookup", "none", "head-a", "suffix", "head-b", "head-c"]
    is_model = [False, False, True, False, True, True]
    a = AutoController(shrink=0.0)
    a.model_warmup = 2
    a.begin_request(names, is_model)
    admitted = 0
    for r in range(400):
        a.peeked = {d: [7] for d in (0, 3) if rng.random() < 0.7}
        a.skipping = rng.random() < 0.2
        a.rounds = r
        a.plan = Plan(rng.randrange(6), rng.randrange(3), rng.random())
        for d in (2, 4, 5):
            a.first_scored[d] = rng.randrange(4)
            if rng.random() < 0.3:
                a.eval_losses[d] = rng.randrange(8)
        chosen, score_chosen = rng.randrange(6), rng.random() < 0.3
        b = copy.deepcopy(a)
        got = a.to_score(chosen, score_chosen)
        want = [d for d in range(6) if (d != chosen or score_chosen) and b.evaluate(d)]
        assert got == want and a.eval_losses == b.eval_losses, r
        admitted += len(got)
    assert admitted > 200


def test_choose_reads_the_verify_row_only_as_wide_as_a_plan_can_go():
    """``choose`` prices widths up to the longest block (``_plan_width``), and takes a plain
    step unpriced when nothing can draft: the same plans as pricing every width up to max_k,
    over random counts, blocks (empty, short, cut at the look's depth, unlooked) and
    verify curves (steep, flat, with dips)."""
    rng = random.Random(7)
    names = ["lookup", "suffix", "head", "none"]
    for trial in range(300):
        c = AutoController(shrink=rng.choice([0.0, 1.0]), max_k=rng.choice([4, 8, 16]))
        curve = {w: 1.0 + rng.uniform(0.0, 0.6) * (w - 1) ** rng.uniform(0.5, 1.2) + rng.uniform(-0.1, 0.1) * (w > 1)
                 for w in range(1, c.max_k + 2)}
        c.costs = FixedCosts(curve, {0: 0.0, 1: 0.0, 2: rng.uniform(0.0, 0.2)})
        with_head = rng.random() < 0.3
        c.begin_request(names, is_model=[False, False, True, False])
        c.first_scored[2] = 99
        for d in range(4):
            s = [rng.uniform(0, 50) for _ in range(3)]
            c.global_counts[d].s, c.global_counts[d].t = s, [x + rng.uniform(0, 50) for x in s]
        if not with_head:
            c.rest_until[2] = 10  # resting: only the looked-at blocks are priced
        blocks = {d: [1] * rng.choice([0, 0, 1, 2, 3, c.max_k]) for d in (0, 1)}
        c.observe_proposals({d: Peek(b, rng.randint(0, 9)) for d, b in blocks.items()})
        want = max((c.best_k(d) for d in range(4) if with_head or d != 2), key=lambda p: (p.rate, p.k))
        if want.k == 0:
            want = Plan(3, 0, want.rate)
        assert c._plan_width() == (c.max_k if with_head or c.max_k in map(len, blocks.values())
                                   else max(map(len, blocks.values()))), trial
        got = c.choose()
        assert (got.drafter, got.k) == (want.drafter, want.k) and got.rate == pytest.approx(want.rate), trial
