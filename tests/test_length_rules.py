"""Training-free draft-length rules (TapOut arms, HF heuristic), the cost-model rule and the
SpecDec++ oracle: decisions on hand-made distributions, then greedy exactness in the engine."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from conftest import flat_cost_curve, make_tiny_model

from adaspec import SpeculativeEngine
from adaspec.config import SamplingConfig
from adaspec.costs import CostModel, VerifyCostCurve
from adaspec.drafters import Decision, Draft, DraftStep, ModelDrafter
from adaspec.errors import ConfigError
from adaspec.feedback import RoundFeedback
from adaspec.length.cost_rule import CostModelRule, _linear_fit
from adaspec.length.oracle import oracle_for_drafter, oracle_greedy_lengths
from adaspec.length.rules import (
    AdaEDL,
    HFHeuristic,
    LogitMargin,
    MaxConfidence,
    SVIPDifference,
    SVIPEntropy,
    entropy,
)
from adaspec.models import as_loaded

C, S, D = Decision.CONTINUE, Decision.STOP, Decision.DISCARD


def q(*probs: float) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float64)


def uniform(n: int, vocab: int = 8) -> torch.Tensor:
    out = torch.zeros(vocab, dtype=torch.float64)
    out[:n] = 1.0 / n
    return out


def step(dist: torch.Tensor | None, index: int = 0, greedy: bool = False) -> DraftStep:
    """A drafted token with q given as probs (sampling) or as logits (greedy)."""
    if dist is None:
        return DraftStep(index, 1)
    if greedy:
        return DraftStep(index, 0, probs=None, logits=dist.float().log())
    return DraftStep(index, 0, probs=dist)


def decide(policy, dist, index=0, drafter=0, greedy=False) -> Decision:
    policy.begin_request()
    policy.begin_round(drafter)
    return policy.decide(step(dist, index, greedy))


def run_round(policy, dists, drafter=0) -> tuple[int, Decision]:
    """Feed drafted tokens until the policy ends the block: (tokens kept, last verdict)."""
    cap = policy.begin_round(drafter)
    for j in range(cap):
        v = policy.decide(step(dists(j) if callable(dists) else dists, j))
        if v is not Decision.CONTINUE:
            return (j if v is D else j + 1), v
    return cap, Decision.CONTINUE


def feedback(n_drafted: int, n_accepted: int, drafter: int = 0, gammas=None, greedy=False) -> RoundFeedback:
    sampling = SamplingConfig() if greedy else SamplingConfig(temperature=1.0)
    if gammas is None and not greedy:
        gammas = [1.0] * n_accepted + [0.0] * (n_drafted - n_accepted)
    return RoundFeedback(round=0, drafter=drafter, draft=Draft(tokens=[3] * n_drafted),
                         n_accepted=n_accepted, emitted=[3] * (n_accepted + 1), k_cap=n_drafted,
                         target_logits=None, sampling=sampling, gammas=gammas)


def binary_entropy_p(h: float) -> float:
    """p in (0.5, 1) whose two-point distribution (p, 1-p) has entropy h nats (bisection)."""
    lo, hi = 0.5, 1.0 - 1e-12
    for _ in range(200):
        mid = (lo + hi) / 2
        hm = -mid * math.log(mid) - (1 - mid) * math.log(1 - mid)
        lo, hi = (mid, hi) if hm > h else (lo, mid)
    return (lo + hi) / 2


# -- threshold rules at their boundaries -------------------------------------------------------
@pytest.mark.parametrize("greedy", [False, True])
def test_max_confidence_boundary(greedy):
    rule = MaxConfidence()  # h = 0.8: stop when max q < 0.8
    assert rule.threshold == 0.8 and rule.max_len == 128
    assert decide(rule, q(0.81, 0.19), greedy=greedy) is C
    assert decide(rule, q(0.79, 0.21), greedy=greedy) is S
    assert decide(rule, q(0.8, 0.2)) is C  # exactly at h: not below it


@pytest.mark.parametrize("greedy", [False, True])
def test_svip_boundary(greedy):
    rule = SVIPEntropy()  # stop when sqrt(H) > 0.6, i.e. H > 0.36 nats
    p = binary_entropy_p(0.36)
    below, above = q(p + 0.01, 1 - p - 0.01), q(p - 0.01, 1 - p + 0.01)
    assert math.sqrt(entropy(below)) < 0.6 < math.sqrt(entropy(above))
    assert decide(rule, below, greedy=greedy) is C
    assert decide(rule, above, greedy=greedy) is S


def test_svip_difference_needs_a_spike():
    rule = SVIPDifference()  # stop when sqrt(H_t) - sqrt(H_{t-1}) > 0.2
    rule.begin_request()
    # sqrt(ln 2) - 0 = 0.83: a spike, but the first token of a block has no predecessor
    assert run_round(rule, lambda j: uniform(2)) == (128, C)
    # ln 3 after ln 2: +0.2155 > 0.2 -> stop; ln 4 after ln 3: +0.129 -> continue
    assert math.sqrt(math.log(3)) - math.sqrt(math.log(2)) > 0.2 > math.sqrt(math.log(4)) - math.sqrt(math.log(3))
    assert run_round(rule, lambda j: uniform(2 if j < 3 else 3)) == (4, S)
    assert run_round(rule, lambda j: uniform(3 if j < 3 else 4)) == (128, C)
    # a new round forgets the previous token: a high-entropy first token does not stop
    assert run_round(rule, lambda j: uniform(1 if j == 0 else 2)) == (2, S)


@pytest.mark.parametrize("greedy", [False, True])
def test_logit_margin_boundary(greedy):
    rule = LogitMargin()  # stop when q1 - q2 < 0.2
    assert decide(rule, q(0.62, 0.38), greedy=greedy) is C
    assert decide(rule, q(0.58, 0.42), greedy=greedy) is S
    assert decide(rule, q(0.5, 0.1, 0.4), greedy=greedy) is S  # top-2 are 0.5 and 0.4
    assert decide(rule, q(0.7, 0.15, 0.15), greedy=greedy) is C


def test_adaedl_boundary():
    rule = AdaEDL()  # stop when 1 - sqrt(0.2 H) < 0.5, i.e. H > 1.25 nats
    assert math.log(3) < 1.25 < math.log(4)
    assert decide(rule, uniform(3)) is C
    assert decide(rule, uniform(4)) is S
    assert decide(rule, uniform(4), greedy=True) is S


def test_adaedl_lambda_update_by_hand():
    def play(rule, rounds):
        out = []
        for drafted, accepted in rounds:
            run_round(rule, uniform(1))
            rule.update(feedback(drafted, accepted))
            out.append(rule.lambda_of(0))
        return out

    rounds = [(4, 2), (4, 4), (4, 4)]
    smooth = AdaEDL()
    smooth.begin_request()
    # AR: 0.5*0.9 + 0.5*0.5 = 0.7 (<0.9: +) -> 0.85 (+) -> 0.925 (-)
    # lambda += (1 - 0.9) * 0.01 * sign: 0.501, 0.502, 0.501
    assert play(smooth, rounds) == pytest.approx([0.501, 0.502, 0.501], abs=1e-12)
    assert smooth.accept_rate[0] == pytest.approx(0.925)
    raw = AdaEDL(signal="raw")  # TapOut A.1 literally: sign(alpha - r_t): r = 0.5, 1, 1
    raw.begin_request()
    assert play(raw, rounds) == pytest.approx([0.501, 0.500, 0.499], abs=1e-12)
    assert raw.lambda_of(1) == 0.5  # per drafter
    # clamped to [0, 1]
    top = AdaEDL(lambda0=1.0)
    top.begin_request()
    assert play(top, [(4, 0)]) == [1.0]
    # a model-free round measures no entropy and leaves lambda alone
    mf = AdaEDL()
    mf.begin_request()
    run_round(mf, None)
    mf.update(feedback(16, 0))
    assert mf.lambda_of(0) == 0.5 and mf.accept_rate == {}
    # scope=request forgets lambda at the next request
    smooth.begin_request()
    assert smooth.lambda_of(0) == 0.5


@pytest.mark.parametrize("cls", [MaxConfidence, SVIPEntropy, SVIPDifference, LogitMargin, AdaEDL])
def test_model_free_drafters_run_to_their_own_cap(cls):
    rule = cls()
    rule.begin_request()
    assert run_round(rule, None) == (16, S)
    rule = cls(max_len_model_free=3, max_len=40)
    rule.begin_request()
    assert rule.begin_round(0) == 40
    assert run_round(rule, None) == (3, S)


def test_bad_parameters_name_the_fix():
    for make in (lambda: MaxConfidence(threshold=1.5), lambda: LogitMargin(threshold=-0.1),
                 lambda: SVIPEntropy(max_len=0), lambda: AdaEDL(signal="mean"),
                 lambda: AdaEDL(lambda0=2.0), lambda: HFHeuristic(initial=0),
                 lambda: CostModelRule(decay=1.5), lambda: MaxConfidence(threshold="x"),
                 lambda: SVIPEntropy(scope="forever")):
        with pytest.raises(ConfigError):
            make()
    with pytest.raises(ConfigError, match="lambda0"):
        AdaEDL(lambda0=-1)
    assert MaxConfidence(threshold=1).threshold == 1.0  # ints from "threshold=1" are fine


# -- HF heuristic ----------------------------------------------------------------------------
def test_hf_heuristic_schedule():
    hf = HFHeuristic()  # initial 5, +2 if all accepted, else -1, min 1
    hf.begin_request()
    ks = []
    for accepted_all in (True, True, False, False):
        k = hf.begin_round(0)
        hf.update(feedback(k, k if accepted_all else 1))
        ks.append(hf.begin_round(0))
    assert ks == [7, 9, 8, 7]
    hf.update(feedback(3, 3))  # the engine capped the round: all 3 drafted accepted -> +2
    assert hf.begin_round(0) == 9
    hf.update(feedback(0, 0))  # no proposal: no evidence
    assert hf.begin_round(0) == 9
    assert hf.begin_round(1) == 5  # one counter per drafter
    low = HFHeuristic(initial=1)
    low.update(feedback(1, 0))
    assert low.begin_round(0) == 1  # never below 1
    capped = HFHeuristic(initial=4, max_len=5)
    capped.update(feedback(4, 4))
    assert capped.begin_round(0) == 5
    # "heuristic" persists across requests (scope=global); "heuristic_transient" = scope=request
    hf.begin_request()
    assert hf.begin_round(0) == 9
    transient = HFHeuristic(scope="request")
    transient.begin_request()
    transient.update(feedback(5, 5))
    transient.begin_request()
    assert transient.begin_round(0) == 5


# -- cost-model rule -------------------------------------------------------------------------
def curve(*seconds: float) -> VerifyCostCurve:
    return flat_cost_curve(seconds)


def cost_rule(seconds, draft_s, **kw) -> CostModelRule:
    rule = CostModelRule(**kw)
    rule.costs = CostModel(curve(*seconds))
    rule.costs.draft_token_s[0] = draft_s
    rule.begin_request()
    return rule


def test_cost_rule_drafts_longer_when_drafting_is_cheap():
    flat = [1.0] * 16
    cheap = run_round(cost_rule(flat, 0.01), q(0.9, 0.1))
    dear = run_round(cost_rule(flat, 0.5), q(0.9, 0.1))
    # d = 0.5, a = 0.9: rates E/T = 1.267, 1.355, 1.376, then 1.365 and falling -> 3 tokens
    assert dear == (3, S)
    assert cheap[0] > 10 and cheap[1] is S


def test_cost_rule_passes_a_verify_cost_cliff():
    cliff = [1.0, 1.8, 1.85, 1.2, 1.25, 1.3, 1.35, 1.4]
    # a = 0.5, d = 0.3. Flat verify: E/T = 1.5/1.3 beats every longer block -> 1 token.
    assert run_round(cost_rule([1.0] * 8, 0.3), q(0.5, 0.3, 0.2)) == (1, S)
    # Cliff: 1 token (width 2) = 0.714 tok/s, 2 tokens 0.714, 3 tokens (width 4) 0.893
    # -> draft through the cliff and stop at width 4.
    assert run_round(cost_rule(cliff, 0.3), q(0.5, 0.3, 0.2)) == (3, S)
    # a one-token lookahead sees only the next, dearer width and drops the token instead
    assert run_round(cost_rule(cliff, 0.3, horizon=1), q(0.5, 0.3, 0.2)) == (0, D)
    # high acceptance: never stops inside the cliff (widths 2-3)
    n, _ = run_round(cost_rule(cliff, 0.05), q(0.95, 0.05))
    assert n >= 3


def test_cost_rule_learns_acceptance():
    rule = cost_rule([1.0] * 16, 0.1)
    rule.begin_round(0)
    for j in range(4):  # four drafted tokens predicted at 0.9 each
        rule.decide(step(q(0.9, 0.1), j))
    rule.update(feedback(4, 1, greedy=True))  # realised: [1, 0] on the first two tokens
    assert rule.calibration(0) == pytest.approx((1.0 + 4.0) / (1.8 + 4.0))
    # model-free drafter: discounted mean of the gammas with a 0.6 x 4 prior
    run_round(rule, None, drafter=1)
    rule.update(feedback(3, 2, drafter=1, gammas=[0.9, 0.8, 0.1]))
    assert rule.acceptance(1) == pytest.approx((1.8 + 0.6 * 4) / (3 + 4))
    rule.begin_request()  # scope=request
    assert rule.acceptance(1) == pytest.approx(0.6) and rule.calibration(0) == 1.0


def test_cost_rule_without_a_curve():
    fit = _linear_fit({1: 1.0, 3: 1.2, 6: 1.5})  # exactly 0.9 + 0.1 w
    assert [fit(w) for w in (1, 3, 6, 10)] == pytest.approx([1.0, 1.2, 1.5, 1.9])
    assert _linear_fit({4: 2.0})(9) == 2.0
    observed = CostModelRule()
    observed.costs = CostModel()  # no curve: observed verify times only
    observed.costs.observe(0, 2, 0.2, 1.2, 0, 0.0)
    observed.costs.observe(0, 0, 0.0, 1.0, 0, 0.0)
    observed.begin_request()
    n, v = run_round(observed, q(0.9, 0.1))
    assert 1 <= n < 128 and v is S
    bare = CostModelRule()  # no engine at all: unit verify cost, draft_prior per token
    bare.begin_request()
    n, v = run_round(bare, None)
    assert 1 <= n < 128 and v in (S, D)


# -- oracle (SpecDec++ Theorem 4.1) ------------------------------------------------------------
def test_oracle_lengths_by_hand():
    r = oracle_greedy_lengths([5, 6, 7, 8], [5, 6, 9, 8])
    assert (r.lengths, r.emitted, r.rounds, r.mat) == ([2, 0], [3, 1], 2, 2.0)
    r = oracle_greedy_lengths([1, 2, 3], [1, 2, 3])  # no disagreement: one round, bonus last
    assert (r.lengths, r.emitted) == ([2], [3])
    r = oracle_greedy_lengths([-1, 2, 3], [1, 2, 3])  # no proposal counts as disagreement
    assert (r.lengths, r.emitted) == ([0, 1], [1, 2])
    r = oracle_greedy_lengths([1, 2, 4], [1, 2, 3])  # disagreement at the last token: free
    assert (r.lengths, r.emitted, r.verification_rate) == ([2], [3], pytest.approx(1 / 3))
    r = oracle_greedy_lengths([9, 9, 9, 9], [1, 2, 3, 4])
    assert r.lengths == [0, 0, 0, 0] and r.mat == 1.0
    with pytest.raises(ValueError):
        oracle_greedy_lengths([1], [1, 2])


# -- engine integration -------------------------------------------------------------------------
PROMPT = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3]


@pytest.fixture(scope="module")
def models():
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    target = make_tiny_model(seed=0, init_std=0.3, lm_head_scale=3.0)  # peaky: varied lengths
    noisy = copy.deepcopy(target)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        for p in noisy.parameters():
            p.add_(0.1 * torch.randn_like(p))
    yield target, noisy
    torch.set_num_threads(prev)


def _greedy(model, n) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([PROMPT]), do_sample=False, max_new_tokens=n)
    return out[0, len(PROMPT):].tolist()


POLICIES = [HFHeuristic, MaxConfidence, SVIPEntropy, SVIPDifference, LogitMargin, AdaEDL, CostModelRule]


@pytest.mark.parametrize("drafter", ["self", "noisy", "prompt-lookup"])
def test_greedy_output_unchanged_by_every_length_rule(models, drafter, tmp_path, monkeypatch):
    monkeypatch.setenv("ADASPEC_CACHE", str(tmp_path))
    target, noisy = models
    want = _greedy(target, 30)
    spec = ModelDrafter(as_loaded(noisy), 32, name="noisy") if drafter == "noisy" else drafter
    drafted = []
    for cls in POLICIES:
        engine = SpeculativeEngine(target, [spec], length=cls())
        for _ in range(2):  # a second request exercises learnt / reset state
            res = engine.generate(PROMPT, max_new_tokens=30)
            assert res.token_ids == want, cls.name
        drafted.append(max(r.drafted for r in res.stats.rounds))
        if cls is CostModelRule:
            assert engine.length.costs is engine.cost_model and engine.cost_model.curve is not None
    assert max(drafted) > 1  # the rules did draft multi-token blocks


def test_sampling_runs_with_every_rule(models, tmp_path, monkeypatch):
    monkeypatch.setenv("ADASPEC_CACHE", str(tmp_path))
    target, noisy = models
    for cls in POLICIES:
        engine = SpeculativeEngine(target, [ModelDrafter(as_loaded(noisy), 32), "prompt-lookup"],
                                   length=cls())
        res = engine.generate(PROMPT, max_new_tokens=20, temperature=1.0, seed=0)
        assert len(res.token_ids) == 20
        assert all(r.drafted <= 19 for r in res.stats.rounds)


def test_oracle_bounds_the_engine(models):
    target, noisy = models
    want = _greedy(target, 30)
    self_oracle = oracle_for_drafter(ModelDrafter(as_loaded(target), 32), PROMPT, want)
    assert self_oracle.lengths == [29] and self_oracle.mat == 30.0
    drafter = ModelDrafter(as_loaded(noisy), 32)
    oracle = oracle_for_drafter(drafter, PROMPT, want)
    assert sum(oracle.emitted) == 30
    for k in (1, 3, 6):
        res = SpeculativeEngine(target, [drafter], k=k).generate(PROMPT, max_new_tokens=30)
        assert res.token_ids == want
        assert len(res.stats.rounds) >= oracle.rounds


def test_cost_rule_plans_a_plain_step_for_a_model_free_drafter_that_cannot_pay():
    """begin_round returns 0 (no lookups at all) exactly when decide would drop the first
    token of a model-free drafter; model drafters (acceptance from q) always get the cap."""
    steep = [1.0 + 0.8 * j for j in range(16)]  # llama.cpp-like: every token costs 0.8 steps
    for seconds, a, drops in ((steep, 0.6, True), ([1.0] * 16, 0.6, False), (steep, 0.95, False)):
        rule = cost_rule(seconds, 0.01, prior_acceptance=a)
        rule.bind_drafters([False, True])
        unbound = cost_rule(seconds, 0.01, prior_acceptance=a)  # the old path: decide the first token
        n, verdict = run_round(unbound, None)
        assert (verdict is D and n == 0) == drops
        assert rule.begin_round(0) == (0 if drops else rule.max_len)
        assert rule.begin_round(1) == rule.max_len  # a model drafter: q decides per token
        if not drops:  # the cap path still drafts as before
            assert run_round(rule, None) == run_round(cost_rule(seconds, 0.01, prior_acceptance=a), None)


def test_cost_rule_plans_plain_steps_for_a_model_drafter_that_cannot_pay():
    """A model drafter whose tokens cost nearly a target step (a 0.5B draft model of a 1.5B
    target on llama.cpp) and whose first tokens are unsure: after it has drafted once, the
    rule plans plain steps (cap 0: its first token's forward is not paid), drafting one token
    anyway after 1, 4, 16, 64 plain steps in a row so that its estimates can change; a cheap
    drafter, or one whose first tokens are sure, drafts every round."""
    from adaspec.length.cost_rule import MAX_PROBE_GAP

    def rounds(draft_s: float, top_q: float, n: int = 200) -> list[tuple[int, int]]:
        rule = cost_rule([1.0] * 16, draft_s)
        rule.bind_drafters([True])
        drafted = []
        for r in range(n):
            cap = rule.begin_round(0)
            if cap:
                drafted.append((r, min(cap, 2)))
                rule.decide(step(q(top_q, 1 - top_q), 0))
        return drafted

    # probes of one token after 1, 4, 16, 64, 64 plain steps
    assert rounds(0.9, 0.3) == [(0, 2), (2, 1), (7, 1), (24, 1), (89, 1), (154, 1)]
    assert rounds(0.9, 0.99) == [(r, 2) for r in range(200)]  # sure first tokens: drafting pays
    assert rounds(0.05, 0.3) == [(r, 2) for r in range(200)]  # cheap drafting pays
    assert MAX_PROBE_GAP == 64
    fresh = cost_rule([1.0] * 16, 0.9)
    fresh.bind_drafters([True])
    assert fresh.begin_round(0) == fresh.max_len  # before it has drafted: no estimate yet


def test_statistics_of_a_drafter_over_a_vocabulary_subset_are_computed_on_it():
    """A feature head drafts over a subset of the vocabulary (q is 0 elsewhere) and gives q on
    it too (``support_logits`` / ``support_probs``): q's statistics are computed there, the
    same top-1, top-2 and entropy as on the full-width q, which is never softmaxed."""
    from adaspec.length.rules import stats_of, stats_probs, step_stats

    g = torch.Generator().manual_seed(0)
    vocab = torch.randperm(1000, generator=g)[:100]
    sub = torch.randn(100, generator=g) * 3
    full = torch.full((1000,), float("-inf")).index_put_((vocab,), sub)
    want = stats_of(torch.softmax(full, -1))
    greedy = DraftStep(0, 7, logits=full, support_logits=sub)
    sampled = DraftStep(0, 7, probs=torch.softmax(full, -1), support_probs=torch.softmax(sub, -1))
    for step in (greedy, sampled):
        assert stats_probs(step).shape == (100,)
        s = step_stats(step)
        for name in ("top1", "top2", "entropy"):
            assert getattr(s, name) == pytest.approx(getattr(want, name), rel=1e-5, abs=1e-7)
    assert stats_probs(DraftStep(0, 7, logits=full)).shape == (1000,)  # no subset: the full q
