"""BanditSpec drafter selection (UCBSpec, EXP3Spec), the random / round-robin baselines and
the cost-aware learners, on synthetic environments (no models, a few seconds).

Stopping-time regret (BanditSpec eq. (1)) is measured against the exact expected stopping
time of the best single arm: under eq. (4) (i.i.d. per-token acceptance) the accepted length
is truncated-geometric, and E[rounds to produce N tokens] follows from a renewal recursion.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import pytest

from adaspec.config import SamplingConfig
from adaspec.drafters.base import Draft
from adaspec.errors import ConfigError
from adaspec.feedback import RoundFeedback
from adaspec.selection import parse_number
from adaspec.selection.banditspec import EXP3Spec, UCBSpec, confidence_radius
from adaspec.selection.baselines import RoundRobinPolicy, UniformRandomPolicy
from adaspec.selection.cost_aware import CostAwareEXP3, CostAwareUCB
from adaspec.bench.simulation import GeometricArm, SimResult, SyntheticEnv, TVArm

L = 5
LENGTHS = [250, 500, 1000, 2000, 4000]
LEARNERS = [UCBSpec, EXP3Spec, CostAwareUCB, CostAwareEXP3]
ALL = LEARNERS + [UniformRandomPolicy, RoundRobinPolicy]


# -- helpers ----------------------------------------------------------------------------------
def fb(arm: int, n_accepted: int, k_cap: int = L, emitted: Sequence[int] | None = None,
       draft_s: float = 0.0, verify_s: float = 1.0) -> RoundFeedback:
    """A synthetic round: ``n_accepted`` of ``k_cap`` drafts accepted."""
    return RoundFeedback(
        round=0, drafter=arm, draft=Draft(tokens=[0] * k_cap), n_accepted=n_accepted,
        emitted=list(emitted) if emitted is not None else [0] * (n_accepted + 1), k_cap=k_cap,
        target_logits=None, sampling=SamplingConfig(temperature=1.0), gammas=[0.5] * k_cap,
        draft_s=draft_s, verify_s=verify_s)


def expected_static_rounds(p: float, n_tokens: int, big_l: int = L) -> float:
    """E[stopping time] of one arm with per-token acceptance p: f(n) = 1 + sum_y P(y) f(n-y),
    P = truncated geometric of BanditSpec eq. (4) on [1, L+1]."""
    probs = [p ** (y - 1) * (1 - p) for y in range(1, big_l + 1)] + [p ** big_l]
    f = [0.0] * (n_tokens + 1)
    for n in range(1, n_tokens + 1):
        f[n] = 1.0 + sum(probs[y - 1] * f[max(0, n - y)] for y in range(1, big_l + 2))
    return f[n_tokens]


class NoneArmEnv(SyntheticEnv):
    """SyntheticEnv where the arms in ``none`` draft nothing (k = 0: a plain decoding step, one
    token, verify cost of width 1), like the engine's ``none`` drafter."""

    def __init__(self, arms, none: Sequence[int] = (), **kwargs):
        super().__init__(arms, **kwargs)
        self.none = set(none)

    def run(self, policy, n_tokens: int, names: Sequence[str] | None = None) -> SimResult:
        policy.begin_request(list(names) if names else [f"arm{i}" for i in range(len(self.arms))])
        out, produced = SimResult(), 0
        while produced < n_tokens:
            i = policy.select()
            feedback = self.step(i, k=0 if i in self.none else None)
            policy.update(feedback)
            out.choices.append(i)
            out.accepted_lengths.append(len(feedback.emitted))
            produced += len(feedback.emitted)
        return out


def mean_regret(cls, arms, n_tokens: int, seeds: range) -> float:
    """Average stopping time over seeds minus the best single arm's expected stopping time."""
    best = max(a.mean_gamma for a in arms)
    rounds = [SyntheticEnv(arms, L=L, seed=s).run(cls(seed=s), n_tokens).rounds for s in seeds]
    return float(np.mean(rounds)) - expected_static_rounds(best, n_tokens)


def linear_fit(x: Sequence[float], y: Sequence[float]) -> tuple[float, float]:
    """(slope, R^2) of a least-squares line."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    slope, icpt = np.polyfit(x, y, 1)
    resid = y - (slope * x + icpt)
    return float(slope), float(1 - resid @ resid / ((y - y.mean()) @ (y - y.mean())))


GEO_ARMS = [GeometricArm(0.6), GeometricArm(0.9), GeometricArm(0.3)]  # best: index 1
TV_ARMS = [TVArm(3, 2), TVArm(9, 1), TVArm(1, 2)]  # mean gamma 0.6, 0.9, 1/3: best index 1


# -- baselines --------------------------------------------------------------------------------
def test_round_robin_cycles_and_global_scope_continues():
    rr = RoundRobinPolicy()
    rr.begin_request(["a", "b", "c"])
    seq = []
    for _ in range(7):
        i = rr.select()
        rr.update(fb(i, 1))
        seq.append(i)
    assert seq == [0, 1, 2, 0, 1, 2, 0]
    rr.begin_request(["a", "b", "c"])  # per-request scope: starts over
    assert rr.select() == 0
    g = RoundRobinPolicy(scope="global")
    g.begin_request(["a", "b", "c"])
    for _ in range(2):
        g.update(fb(g.select(), 1))
    g.begin_request(["a", "b", "c"])
    assert g.select() == 2


def test_uniform_random_is_uniform_and_seeded():
    res = SyntheticEnv(GEO_ARMS, seed=0).run(UniformRandomPolicy(seed=3), 6000)
    freq = np.bincount(res.choices, minlength=3) / res.rounds
    assert np.all(np.abs(freq - 1 / 3) < 0.03), freq
    again = SyntheticEnv(GEO_ARMS, seed=0).run(UniformRandomPolicy(seed=3), 6000)
    assert again.choices == res.choices


def test_select_before_begin_request_raises():
    for cls in ALL:
        with pytest.raises(ConfigError, match="begin_request"):
            cls().select()


# -- finding the best arm -------------------------------------------------------------------
@pytest.mark.parametrize("cls", LEARNERS, ids=lambda c: c.name)
@pytest.mark.parametrize("arms", [GEO_ARMS, TV_ARMS], ids=["geometric", "tv"])
def test_learners_find_the_best_arm(cls, arms):
    """With equal round costs, throughput ranks arms like MAT, so all four learners agree."""
    env_best = SyntheticEnv(arms).best_arm()
    assert env_best == 1
    ratios = [SyntheticEnv(arms, seed=s).run(cls(seed=s), 4000).best_arm_ratio(1) for s in range(4)]
    assert min(ratios) > 0.8, ratios
    # the random baseline does not learn
    rnd = SyntheticEnv(arms, seed=0).run(UniformRandomPolicy(seed=0), 4000).best_arm_ratio(1)
    assert rnd < 0.4


# -- stopping-time regret -------------------------------------------------------------------
def test_expected_static_rounds_matches_simulation():
    from adaspec.selection import StaticPolicy

    sims = [SyntheticEnv(GEO_ARMS, seed=s).run(StaticPolicy(arm=1), 1000).rounds for s in range(200)]
    exact = expected_static_rounds(0.9, 1000)
    assert abs(np.mean(sims) - exact) < 4 * np.std(sims) / math.sqrt(200) + 0.5


@pytest.mark.parametrize("arms", [GEO_ARMS, TV_ARMS], ids=["geometric", "tv"])
def test_ucbspec_regret_grows_logarithmically(arms):
    """Thm 4.3: Reg = O(H L^2 log E[len]). Fit Reg against log(length) over 250..4000 tokens
    (40 seeds each): a good fit, positive slope below the theorem's coefficient, much slower
    than sqrt growth, and Reg/length decreasing."""
    regrets = [mean_regret(UCBSpec, arms, n, range(40)) for n in LENGTHS]
    slope, r2 = linear_fit(np.log(LENGTHS), regrets)
    mu = [sum(a.mean_gamma ** j for j in range(L + 1)) for a in arms]
    best = max(mu)
    # coefficient of log(len) in the proof of Thm 4.3 (App. D.2): sum_i 8 L^2 / (mu* Delta_i)
    bound = sum(8 * L * L / (best * (best - m)) for m in mu if m < best)
    assert r2 > 0.9, (regrets, r2)
    assert 1.0 < slope < bound, (regrets, slope, bound)
    loglog, _ = linear_fit(np.log(LENGTHS), np.log(regrets))
    assert loglog < 0.5, (regrets, loglog)
    per_token = np.asarray(regrets) / np.asarray(LENGTHS)
    assert np.all(np.diff(per_token) < 0), per_token
    assert linear_fit(np.log(LENGTHS), per_token)[0] < 0


def test_exp3spec_regret_is_sublinear():
    """Thm 5.3: Reg <= 2L sqrt(len K log K); check the bound, a log-log slope well below 1 and
    a decreasing regret per token."""
    regrets = [mean_regret(EXP3Spec, GEO_ARMS, n, range(40)) for n in LENGTHS]
    k = len(GEO_ARMS)
    for n, reg in zip(LENGTHS, regrets):
        assert 0 < reg <= 2 * L * math.sqrt(n * k * math.log(k)), (n, reg)
    loglog, _ = linear_fit(np.log(LENGTHS), np.log(regrets))
    assert loglog < 0.7, (regrets, loglog)
    per_token = np.asarray(regrets) / np.asarray(LENGTHS)
    assert np.all(np.diff(per_token) < 0), per_token


# -- exact formulas -------------------------------------------------------------------------
def test_ucbspec_confidence_radius_hand_computed():
    # K=3, L=5, delta=0.5, t=10.
    # n=4: (1+n)/n^2 = 0.3125; log(3*10^2*sqrt(5)/0.5) = log(1341.6408) = 7.2016486;
    #      1 + 2*7.2016486 = 15.4032972; 2.5*sqrt(0.3125*15.4032972) = 5.4849398
    # n=3: (1+n)/n^2 = 4/9; log(3*10^2*2/0.5) = log(1200) = 7.0900768;
    #      2.5*sqrt(4/9*15.1801537) = 6.4936194
    assert confidence_radius(5, 4, 10, 3, 0.5) == pytest.approx(5.4849398, abs=1e-6)
    assert confidence_radius(5, 3, 10, 3, 0.5) == pytest.approx(6.4936194, abs=1e-6)
    assert confidence_radius(5, 0, 10, 3, 0.5) == math.inf

    pol = UCBSpec(L=5, delta=0.5)
    pol.begin_request(["a", "b", "c"])
    assert [pol.select() for _ in range(1)] == [0]
    # rounds 1-3 round-robin (Alg. 8 line 5), then 7 more rounds: arm 0 n=4 sum 20, arm 1 n=3
    # sum 10, arm 2 n=3 sum 6. The reward is n_accepted + 1, even when the emitted tokens were
    # cut by a stop (here: 4 accepted, only 1 emitted -> reward 5).
    rounds = [(0, 4), (1, 5), (2, 1), (0, 4), (1, 2), (2, 1), (0, 4), (1, 0), (2, 1)]
    for t, (arm, n) in enumerate(rounds):
        if t < 3:
            assert pol.select() == t
        pol.update(fb(arm, n))
    pol.update(fb(0, 4, emitted=[7]))
    assert pol.t == 10 and pol.counts == [4, 3, 3] and pol.sums == [20.0, 10.0, 6.0]
    assert pol.radius(0) == pytest.approx(5.4849398, abs=1e-6)
    assert pol.ucb() == pytest.approx([5.0 + 5.4849398, 10 / 3 + 6.4936194, 2.0 + 6.4936194],
                                      abs=1e-6)
    assert pol.select() == 0  # 10.485 > 9.827 > 8.494
    assert UCBSpec(L=5, delta=0.5, explore=0.5).explore == 0.5


def test_ucbspec_reads_L_from_the_length_cap():
    pol = UCBSpec()
    pol.begin_request(["a", "b"])
    assert pol.spec_length() == 5  # nothing seen yet
    pol.update(fb(0, 0, k_cap=0))  # a round with speculation off does not set L
    assert pol.spec_length() == 5
    pol.update(fb(1, 3, k_cap=8))
    pol.update(fb(1, 3, k_cap=4))
    assert pol.spec_length() == 8
    assert UCBSpec(L=3).spec_length() == 3


def test_exp3spec_probabilities_hand_computed():
    pol = EXP3Spec(L=5, seed=0)
    pol.begin_request(["a", "b", "c"])
    assert pol.probabilities() == pytest.approx([1 / 3] * 3)
    i = pol.select()
    pol.update(fb(i, 1))  # y = 2: Z = (5+1-2) / (5 * 1/3) = 2.4 (eq. (6))
    assert pol.losses[i] == pytest.approx(2.4)
    assert sum(pol.losses) == pytest.approx(2.4)
    # eta_2 = sqrt(log 3 / (2*3)) = 0.4279043; exp(-0.4279043*2.4) = 0.3581...;
    # p_i = 0.3581/(0.3581+2) = 0.1518560, the others 1/(0.3581+2) = 0.4240720
    p = pol.probabilities()
    assert sum(p) == pytest.approx(1.0, abs=1e-12)
    assert p[i] == pytest.approx(0.1518560, abs=1e-6)
    assert [p[j] for j in range(3) if j != i] == pytest.approx([0.4240720] * 2, abs=1e-6)
    j = pol.select()
    pol.update(fb(j, 0))  # y = 1: Z = 5/(5 p_j) = 1/p_j
    expected = [0.0, 0.0, 0.0]
    expected[i] += 2.4
    expected[j] += 1 / p[j]
    assert pol.losses == pytest.approx(expected)
    eta3 = math.sqrt(math.log(3) / 9)
    w = [math.exp(-eta3 * x) for x in expected]
    assert pol.probabilities() == pytest.approx([x / sum(w) for x in w])
    pol.update(fb(pol.select(), 5))  # y = L+1: zero loss
    assert pol.losses == pytest.approx(expected)
    # many rounds later the distribution is still a distribution
    SyntheticEnv(GEO_ARMS, seed=0).run(pol, 2000)
    p = pol.probabilities()
    assert sum(p) == pytest.approx(1.0, abs=1e-12) and min(p) >= 0.0


def test_exp3spec_samples_from_its_probabilities():
    """Frozen state (no updates): the empirical choice frequencies match p_t."""
    pol = EXP3Spec(L=5, seed=1)
    pol.begin_request(["a", "b", "c"])
    pol.losses = [0.0, 1.5, 4.0]
    p = pol.probabilities()
    picks = np.bincount([pol.select() for _ in range(20000)], minlength=3) / 20000
    assert np.all(np.abs(picks - np.asarray(p)) < 0.015), (picks, p)


# -- scope and seeds ------------------------------------------------------------------------
@pytest.mark.parametrize("cls", LEARNERS, ids=lambda c: c.name)
def test_request_scope_resets_and_global_scope_warm_starts(cls):
    names = ["arm0", "arm1", "arm2"]
    env = SyntheticEnv(GEO_ARMS, seed=0)
    per_req = cls(seed=0)
    env.run(per_req, 2000, names)
    per_req.begin_request(names)
    assert per_req.t == 0
    glob = cls(seed=0, scope="global")
    env.run(glob, 2000, names)
    t_before = glob.t
    second = SyntheticEnv(GEO_ARMS, seed=1).run(glob, 500, names)
    assert glob.t == t_before + second.rounds  # state kept across begin_request
    # the warm learner starts on the best arm; the fresh one starts exploring again
    fresh = SyntheticEnv(GEO_ARMS, seed=1).run(per_req, 500, names)
    assert second.choices[:30].count(1) > fresh.choices[:30].count(1)
    if cls in (UCBSpec, CostAwareUCB):
        assert fresh.choices[:3] == [0, 1, 2]  # round-robin again (Alg. 8 line 5)
        assert second.choices[:3] == [1, 1, 1]
    # a different drafter list resets even a global learner
    glob.begin_request(["x", "y"])
    assert glob.t == 0 and glob.n_arms == 2


@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.name)
def test_seeded_runs_are_reproducible(cls):
    a = SyntheticEnv(TV_ARMS, seed=5).run(cls(seed=7), 1500)
    b = SyntheticEnv(TV_ARMS, seed=5).run(cls(seed=7), 1500)
    assert a.choices == b.choices
    if cls in (EXP3Spec, CostAwareEXP3, UniformRandomPolicy):
        c = SyntheticEnv(TV_ARMS, seed=5).run(cls(seed=8), 1500)
        assert c.choices != a.choices


# -- parameters -----------------------------------------------------------------------------
def test_parameters_from_strings_and_bad_values():
    pol = UCBSpec(**{k: parse_number(v) for k, v in {"L": "4", "delta": "0.1", "seed": "3"}.items()})
    assert (pol.L, pol.delta, pol.seed) == (4, 0.1, 3)
    assert UCBSpec(L=6.0).L == 6
    for bad in [dict(delta=0), dict(delta=1.5), dict(delta="x"), dict(L=0), dict(L=2.5),
                dict(L="five"), dict(explore=0), dict(explore=-1)]:
        with pytest.raises(ConfigError):
            UCBSpec(**bad)
    for bad in [dict(L=0), dict(L=-3)]:
        with pytest.raises(ConfigError):
            EXP3Spec(**bad)
    for bad in [dict(delta=0), dict(explore=float("inf"))]:
        with pytest.raises(ConfigError):
            CostAwareUCB(**bad)
    with pytest.raises(ConfigError, match="no L"):
        CostAwareEXP3(L=5)
    with pytest.raises(ConfigError):
        UCBSpec(scope="forever")


# -- the "none" drafter as an arm and cost-aware selection ----------------------------------
@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.name)
def test_none_drafter_works_as_an_arm(cls):
    """Rounds that draft nothing (k_cap 0, one token) are ordinary pulls for every policy."""
    env = NoneArmEnv([GeometricArm(0.0), GeometricArm(0.8)], none=[0], seed=0)
    res = env.run(cls(seed=0), 1500, names=["none", "model"])
    assert sum(res.accepted_lengths) >= 1500
    assert all(n == 1 for i, n in zip(res.choices, res.accepted_lengths) if i == 0)
    if cls in (UCBSpec, EXP3Spec):  # MAT: any drafter accepting something beats no drafter
        assert res.best_arm_ratio(1) > 0.8


def _freqs(cls, env_factory, n_tokens: int, seeds: range) -> np.ndarray:
    out = []
    for s in seeds:
        env = env_factory(s)
        res = env.run(cls(seed=s), n_tokens)
        out.append(np.bincount(res.choices, minlength=len(env.arms)) / res.rounds)
    return np.mean(out, axis=0)


def test_cost_aware_prefers_cheap_drafter_over_accurate_expensive_one():
    """Arm 0: MAT 4.04 (alpha 0.85) but 0.2 s per drafted token -> 2.0 s rounds, 2.0 tok/s.
    Arm 1: MAT 3.29 (alpha 0.75), 0.01 s per token -> 1.05 s rounds, 3.1 tok/s."""
    def env(s):
        return SyntheticEnv([GeometricArm(0.85, draft_token_s=0.2),
                             GeometricArm(0.75, draft_token_s=0.01)], seed=s)
    for cls in (UCBSpec, EXP3Spec):
        assert _freqs(cls, env, 3000, range(5))[0] > 0.75
    for cls in (CostAwareUCB, CostAwareEXP3):
        assert _freqs(cls, env, 3000, range(5))[1] > 0.75
    # and it is right: fewer seconds for the same tokens
    def seconds(cls, s):
        e = env(s)
        pol = cls(seed=s)
        pol.begin_request(["a", "b"])
        total, produced = 0.0, 0
        while produced < 3000:
            f = e.step(pol.select())
            pol.update(f)
            total += f.round_s
            produced += len(f.emitted)
        return total
    assert np.mean([seconds(CostAwareUCB, s) for s in range(3)]) < \
        0.8 * np.mean([seconds(UCBSpec, s) for s in range(3)])


def test_cost_aware_falls_back_to_no_drafter_when_nothing_pays():
    """Drafters with low acceptance and real drafting cost vs the none arm (k = 0, one plain
    step of width 1 at 1.0 s): speculation runs at 0.45 tok/s or less, plain decoding at 1."""
    def env(s):
        return NoneArmEnv([GeometricArm(0.2, draft_token_s=0.3), GeometricArm(0.0),
                           GeometricArm(0.1, draft_token_s=0.5)], none=[1], seed=s,
                          verify_s=[1.0, 1.1, 1.15, 1.2, 1.25, 1.3, 1.35])
    for cls in (CostAwareUCB, CostAwareEXP3):
        assert _freqs(cls, env, 1000, range(5))[1] > 0.9
    mat = _freqs(UCBSpec, env, 1000, range(5))  # MAT prefers arm 0 (1.25 tokens per round)
    assert int(np.argmax(mat)) == 0 and mat[1] < 0.34, mat


def test_cost_ucb_hand_computed_state():
    pol = CostAwareUCB(delta=0.5)
    pol.begin_request(["a", "b"])
    pol.update(fb(0, 3, draft_s=1.0, verify_s=1.0))  # 4 tokens / 2 s
    pol.update(fb(1, 0, k_cap=0, verify_s=0.5))  # 1 token / 0.5 s
    pol.update(fb(0, 5, draft_s=0.5, verify_s=1.0))  # 6 tokens / 1.5 s -> M = 4 tok/s
    assert pol.scale == pytest.approx(4.0)
    # ratio of sums 10 / 3.5 s, not the mean of per-round ratios (2 + 4) / 2 = 3
    assert pol.throughput(0) == pytest.approx(10 / 3.5)
    assert pol.throughput(1) == pytest.approx(2.0)
    r0 = confidence_radius(1.0, 2, 3, 2, 0.5)
    r1 = confidence_radius(1.0, 1, 3, 2, 0.5)
    assert pol.ucb() == pytest.approx([10 / 3.5 / 4 + r0, 2.0 / 4 + r1])
    assert pol.select() == int(np.argmax(pol.ucb()))
