"""MetaSD drafter selection (Kim et al., "MetaSD: multi-drafter speculative decoding with
alignment feedback"): MetaSD-UCB (Alg. 2), EXP3 (Alg. 7), sequential halving (Alg. 5) and
pure exploration-then-commit (Alg. 4) for switching costs (H.1), discounted UCB (Alg. 6) and
sliding-window UCB (Alg. 8) for non-stationary text (H.2), and Thompson sampling.

Every round is one arm pull and every policy learns from the same bounded reward in [0, 1]
(:func:`block_reward`):

- block divergence, eq. (4): ``r_BD = 1/N_max * sum_{j<N_max} (1 - TV(p_j, q_j))``, read
  from ``feedback.acceptance_probs`` (1 - TV for dense q, p(y) for one-hot drafts);
- block efficiency (2.3): ``r_BE = N_acc / N_max``.

Lemma 2 / eq. (5): ``E[r_BE] = (1 - alpha^N_max) / (N_max (1 - alpha)) * E[r_BD]``, so both
rank drafters alike, but r_BD has variance <= 1/(4 N_max) (Lemma 6) and is the default.

Decisions where the paper is silent (documented here once):

- ``N_max`` is the parameter ``n_max`` when > 0, else the round's length cap
  ``feedback.k_cap`` (the paper drafts exactly N_max tokens per round, so the cap is the
  N_max of that round), else 5 (F.4 / 4.1). Positions beyond N_max are ignored.
- Rounds with fewer than N_max drafted tokens (a model-free drafter ran out of proposals, or
  a length policy stopped early): ``missing="zero"`` (default) keeps the paper's division by
  N_max in eq. (4) and in r_BE, i.e. undrafted positions count as gamma = 0 - a drafter that
  proposes nothing gives no speed-up, and this keeps Lemma 2's normalisation;
  ``missing="mean"`` divides by the number of drafted positions instead (use it with length
  policies whose early stops should not be charged to the drafter). A round with nothing
  drafted scores 0 under both.
- Rounds with ``k_cap == 0`` and nothing drafted (the length policy chose not to speculate,
  e.g. the last token of a request) carry no information about the drafter: policies skip
  them (no update, the round counter does not move).
- Ties in an argmax go to the lowest drafter index (deterministic).
"""

from __future__ import annotations

import math
from collections import deque

from ..errors import ConfigError
from ..feedback import RoundFeedback
from .base import DrafterPolicy, argmax, sample_index

#: N_max of the paper's experiments (4.1), used when neither ``n_max`` nor the cap is set
DEFAULT_N_MAX = 5
#: MetaSD F.4: UCB exploration strength beta and EXP3 gamma, SH period
DEFAULT_BETA = 0.01
DEFAULT_EXP3_GAMMA = 0.4
DEFAULT_SH_PERIOD = 1
#: not given by the paper (H.2): memory of ~20 rounds (D-UCB) / 50 rounds (SW-UCB), a few
#: hundred tokens at 2-5 tokens per round, i.e. shorter than a typical request.
DEFAULT_DISCOUNT = 0.95
DEFAULT_WINDOW = 50
#: PETC (Alg. 4, Thm 8) explores for B0 = c ln B rounds; the paper gives neither c nor B.
DEFAULT_PETC_C = 4.0
DEFAULT_PETC_HORIZON = 1024

REWARDS = ("bd", "be")
MISSING = ("zero", "mean")


# -- parameter checks ------------------------------------------------------------------------
def _check_choice(value: object, what: str, choices: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value.strip().lower() not in choices:
        opts = " or ".join(f"{what}={c}" for c in choices)
        raise ConfigError(f"{what} must be one of {list(choices)}, got {value!r}: pass {opts}")
    return value.strip().lower()


def _check_int(value: object, what: str, low: int, example: str) -> int:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) \
        and math.isfinite(value) and value == int(value) and value >= low
    if not ok:
        raise ConfigError(f"{what} must be an integer >= {low}, got {value!r}: pass e.g. {example}")
    return int(value)


def _check_float(value: object, what: str, low: float, high: float, example: str,
                 low_open: bool = False, high_open: bool = False) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)
    if ok:
        ok = (value > low if low_open else value >= low) and (value < high if high_open else value <= high)
    if not ok:
        lo, hi = "(" if low_open else "[", ")" if high_open else "]"
        raise ConfigError(f"{what} must be a number in {lo}{low}, {high}{hi}, got {value!r}: "
                          f"pass e.g. {example}")
    return float(value)


# -- rewards ---------------------------------------------------------------------------------
def resolve_n_max(feedback: RoundFeedback, n_max: int = 0) -> int:
    """N_max of eq. (4) for this round: ``n_max`` if > 0, else the round's cap, else 5."""
    if n_max > 0:
        return n_max
    return feedback.k_cap if feedback.k_cap > 0 else DEFAULT_N_MAX


def block_reward(feedback: RoundFeedback, kind: str = "bd", n_max: int = 0,
                 missing: str = "zero") -> float:
    """MetaSD reward of one round, in [0, 1].

    ``kind="bd"``: block divergence, eq. (4): mean of gamma_j = 1 - TV(p_j, q_j) over the
    first N_max positions (``feedback.acceptance_probs``: p(y) for one-hot drafts).
    ``kind="be"``: block efficiency (2.3): N_acc / N_max.
    ``n_max``: N_max (0 = the round's cap ``feedback.k_cap``, or 5 if the cap is 0).
    ``missing="zero"`` divides by N_max (undrafted positions count 0, the paper's
    normalisation); ``"mean"`` divides by the number of drafted positions (<= N_max).
    """
    if kind not in REWARDS:
        raise ConfigError(f"reward kind must be one of {list(REWARDS)}, got {kind!r}: pass "
                          "reward=bd (block divergence, eq. 4) or reward=be (block efficiency)")
    if missing not in MISSING:
        raise ConfigError(f"missing must be one of {list(MISSING)}, got {missing!r}: pass "
                          "missing=zero (divide by N_max) or missing=mean (by drafted tokens)")
    n = resolve_n_max(feedback, n_max)
    drafted = min(feedback.n_drafted, n)
    denom = n if missing == "zero" else drafted
    if denom <= 0:
        return 0.0
    if kind == "be":
        return min(feedback.n_accepted, drafted) / denom
    gammas = feedback.acceptance_probs[:drafted]
    return min(1.0, max(0.0, math.fsum(gammas) / denom))


def is_informative(feedback: RoundFeedback) -> bool:
    """False for rounds where the length policy did not let the drafter speculate."""
    return feedback.k_cap > 0 or feedback.n_drafted > 0


# -- shared base -----------------------------------------------------------------------------
class _MetaSDPolicy(DrafterPolicy):
    """Reward plumbing shared by every MetaSD policy (Alg. 1 lines 5-7).

    Args: ``reward`` "bd" (eq. 4, default) or "be"; ``n_max`` N_max (0 = the round's cap);
    ``missing`` "zero" / "mean" (see :func:`block_reward`); ``seed``, ``scope`` as in
    :class:`DrafterPolicy` (default scope "request": re-initialised per query, MetaSD 4.1).
    """

    def __init__(self, reward: str = "bd", n_max: int = 0, missing: str = "zero", **kwargs):
        super().__init__(**kwargs)
        self.reward = _check_choice(reward, "reward", REWARDS)
        self.n_max = _check_int(n_max, "n_max", 0, "n_max=5 (or 0 to use the length cap)")
        self.missing = _check_choice(missing, "missing", MISSING)
        self.t = 0  # informative rounds learnt from since the last reset

    def reward_of(self, feedback: RoundFeedback) -> float:
        return block_reward(feedback, self.reward, self.n_max, self.missing)

    def _need_arms(self) -> int:
        if self.n_arms <= 0:
            raise ConfigError(f"selector {self.name!r} has no drafters: call "
                              "begin_request(names) with at least one drafter name first")
        return self.n_arms

    def reset(self) -> None:
        self.t = 0

    def update(self, feedback: RoundFeedback) -> None:
        a = feedback.drafter
        if not 0 <= a < self.n_arms or not is_informative(feedback):
            return
        self.t += 1
        self._learn(a, feedback)

    def _learn(self, arm: int, feedback: RoundFeedback) -> None:
        raise NotImplementedError


class _UCBIndex(_MetaSDPolicy):
    """UCB skeleton of MetaSD Alg. 2 / 6 / 8: play every drafter once (lines 2-5), then the
    argmax of ``mean_i + beta * sqrt(2 ln t / n_i)`` (line 7). Subclasses define the
    statistics behind ``mean_i`` and ``n_i`` (plain, discounted or windowed); an arm with
    ``n_i == 0`` has an infinite index."""

    def __init__(self, beta: float = DEFAULT_BETA, **kwargs):
        super().__init__(**kwargs)
        self.beta = _check_float(beta, "beta", 0.0, math.inf, "beta=0.01", high_open=True)
        self.pulls: list[int] = []

    def reset(self) -> None:
        super().reset()
        self.pulls = [0] * self.n_arms
        self._reset_stats()

    def _reset_stats(self) -> None:
        raise NotImplementedError

    def stats(self, arm: int) -> tuple[float, float]:
        """(reward sum, count) behind the mean and the bonus of ``arm``."""
        raise NotImplementedError

    def _observe(self, arm: int, r: float) -> None:
        raise NotImplementedError

    def _learn(self, arm: int, feedback: RoundFeedback) -> None:
        self.pulls[arm] += 1
        self._observe(arm, self.reward_of(feedback))

    def indices(self) -> list[float]:
        """The UCB index of every drafter after the ``self.t`` rounds seen (Alg. 2 line 7)."""
        log_t = math.log(self.t) if self.t > 1 else 0.0
        out = []
        for i in range(self.n_arms):
            s, n = self.stats(i)
            out.append(s / n + self.beta * math.sqrt(2.0 * log_t / n) if n > 0 else math.inf)
        return out

    def select(self) -> int:
        k = self._need_arms()
        for i in range(k):  # lines 2-5: one round with every drafter first
            if self.pulls[i] == 0:
                return i
        return argmax(self.indices())


# -- UCB family ------------------------------------------------------------------------------
class MetaSDUCB(_UCBIndex):
    """MetaSD-UCB, Alg. 2: UCB1 on the block-divergence reward eq. (4) with exploration
    ``beta`` (0.01, F.4); regret O(sum 8/(N_max Delta^2) ln B) (Thm 2).

    Args: ``beta``; ``reward`` "bd" / "be"; ``n_max``; ``missing`` (see module doc).
    """

    name = "metasd-ucb"

    def _reset_stats(self) -> None:
        self.sums = [0.0] * self.n_arms
        self.counts = [0] * self.n_arms

    def stats(self, arm: int) -> tuple[float, float]:
        return self.sums[arm], float(self.counts[arm])

    def _observe(self, arm: int, r: float) -> None:  # Alg. 2 line 9
        self.sums[arm] += r
        self.counts[arm] += 1


class DiscountedUCB(_UCBIndex):
    """Discounted UCB, MetaSD Alg. 6 (Kocsis & Szepesvari 2006): past rewards weigh
    ``discount^age`` so the estimate follows a best drafter that changes mid-generation (H.2).

    Alg. 6 line 9 divides the discounted sum by the *undiscounted* count, which drives the
    mean of any often-played arm towards 0; we divide by the discounted count and use it in
    the bonus too, as in the cited D-UCB (Garivier & Moulines 2011, eq. of D-UCB), so stale
    drafters regain exploration. Args: ``discount`` in (0, 1) (default 0.95, paper: none),
    ``beta`` (0.01) and the reward options.
    """

    name = "d-ucb"

    def __init__(self, discount: float = DEFAULT_DISCOUNT, **kwargs):
        super().__init__(**kwargs)
        self.discount = _check_float(discount, "discount", 0.0, 1.0, "discount=0.95",
                                     low_open=True, high_open=True)

    def _reset_stats(self) -> None:
        self.dsums = [0.0] * self.n_arms
        self.dcounts = [0.0] * self.n_arms

    def stats(self, arm: int) -> tuple[float, float]:
        return self.dsums[arm], self.dcounts[arm]

    def _observe(self, arm: int, r: float) -> None:
        g = self.discount
        for i in range(self.n_arms):
            self.dsums[i] *= g
            self.dcounts[i] *= g
        self.dsums[arm] += r
        self.dcounts[arm] += 1.0


class SlidingWindowUCB(_UCBIndex):
    """Sliding-window UCB, MetaSD Alg. 8 (Garivier & Moulines 2011): means and counts over the
    last ``window`` rounds only (lines 9-10); a drafter absent from the window has an
    infinite index, so it is retried at least once per window (H.2).

    Args: ``window`` rounds (>= number of drafters; default 50, paper: none), ``beta`` (0.01)
    and the reward options. The bonus keeps Alg. 8's ``ln t`` (t = all rounds).
    """

    name = "sw-ucb"

    def __init__(self, window: int = DEFAULT_WINDOW, **kwargs):
        super().__init__(**kwargs)
        self.window = _check_int(window, "window", 1, "window=50")

    def reset(self) -> None:
        if self.n_arms > self.window:
            raise ConfigError(f"sw-ucb window={self.window} is smaller than the number of "
                              f"drafters ({self.n_arms}): pass window >= {self.n_arms}")
        super().reset()

    def _reset_stats(self) -> None:
        self.wsums = [0.0] * self.n_arms
        self.wcounts = [0] * self.n_arms
        self.recent: deque[tuple[int, float]] = deque()

    def stats(self, arm: int) -> tuple[float, float]:
        n = self.wcounts[arm]
        return (self.wsums[arm] if n else 0.0), float(n)

    def _observe(self, arm: int, r: float) -> None:
        if len(self.recent) == self.window:
            old, r_old = self.recent.popleft()
            self.wcounts[old] -= 1
            self.wsums[old] = self.wsums[old] - r_old if self.wcounts[old] else 0.0
        self.recent.append((arm, r))
        self.wsums[arm] += r
        self.wcounts[arm] += 1


# -- adversarial -----------------------------------------------------------------------------
class MetaSDEXP3(_MetaSDPolicy):
    """MetaSD-EXP3, Alg. 7 (Auer et al. 2002): p_i = (1-gamma) w_i / sum w + gamma/K, reward
    estimate r/p_i for the drafter played, w_i <- w_i exp(gamma r_hat / K); gamma = 0.4 (F.4).
    Weights are kept as logarithms (shifted by their max) so they never overflow.

    Args: ``gamma`` in (0, 1]; reward options.
    """

    name = "metasd-exp3"

    def __init__(self, gamma: float = DEFAULT_EXP3_GAMMA, **kwargs):
        super().__init__(**kwargs)
        self.gamma = _check_float(gamma, "gamma", 0.0, 1.0, "gamma=0.4", low_open=True)
        self.log_w: list[float] = []

    def reset(self) -> None:
        super().reset()
        self.log_w = [0.0] * self.n_arms

    def probabilities(self) -> list[float]:
        """p_t of Alg. 7 line 3."""
        k = self._need_arms()
        top = max(self.log_w)
        w = [math.exp(x - top) for x in self.log_w]
        s = sum(w)
        g = self.gamma
        return [(1.0 - g) * x / s + g / k for x in w]

    def select(self) -> int:
        p = self.probabilities()
        return sample_index(self.rng, p)

    def _learn(self, arm: int, feedback: RoundFeedback) -> None:  # lines 6-9
        p = self.probabilities()[arm]  # weights unchanged since select(): same p_t
        self.log_w[arm] += self.gamma * (self.reward_of(feedback) / p) / self.n_arms


# -- Bayesian --------------------------------------------------------------------------------
class ThompsonSampling(_MetaSDPolicy):
    """Beta-Bernoulli Thompson sampling on the MetaSD rewards (MetaSD E.3 mentions Thompson
    sampling, used by Liu et al. 2024 for N_max; MetaSD itself gives no TS algorithm), with
    the Bernoulli trick for [0, 1] rewards (Agrawal & Goyal 2012, Alg. 2).

    ``reward="bd"``: every position j < N_max gives one trial Bernoulli(gamma_j) (undrafted
    positions: failures under ``missing="zero"``). Under MetaSD Assumption 1 (gamma_j i.i.d.
    with mean alpha) these trials are i.i.d. Bernoulli(alpha), so Beta(1+S, 1+F) is the exact
    posterior of alpha and the posterior narrows N_max times faster than with one trial per
    round (the variance reduction of Lemma 6). ``reward="be"``: one trial Bernoulli(r_BE) per
    round. Args: reward options; prior Beta(1, 1).
    """

    name = "thompson"

    def reset(self) -> None:
        super().reset()
        self.post_a = [1.0] * self.n_arms  # 1 + successes
        self.post_b = [1.0] * self.n_arms  # 1 + failures

    def posterior_means(self) -> list[float]:
        return [a / (a + b) for a, b in zip(self.post_a, self.post_b)]

    def select(self) -> int:
        self._need_arms()
        return argmax(self.rng.beta(self.post_a, self.post_b).tolist())

    def _learn(self, arm: int, feedback: RoundFeedback) -> None:
        if self.reward == "be":
            trials = [self.reward_of(feedback)]
        else:
            n = resolve_n_max(feedback, self.n_max)
            drafted = min(feedback.n_drafted, n)
            trials = feedback.acceptance_probs[:drafted]
            if self.missing == "zero":
                trials = trials + [0.0] * (n - drafted)
        if not trials:
            return
        u = self.rng.random(len(trials))
        s = int(sum(1 for x, g in zip(u, trials) if x < g))
        self.post_a[arm] += s
        self.post_b[arm] += len(trials) - s


# -- elimination (switching costs) -----------------------------------------------------------
class _Halving(_MetaSDPolicy):
    """Sequential halving, MetaSD Alg. 5 (Karnin et al. 2013): each phase plays every
    surviving drafter ``n_t`` times (back to back, to keep switches and their KV catch-up
    cost, H.1, low), then keeps the ceil(|S|/2) drafters with the largest phase reward sums
    (Alg. 5 line 6 as printed keeps the *lower* half - a typo); phases repeat until one
    drafter is left (ceil(log2 K) phases; Alg. 5's floor(log2 K) leaves 2 of K = 3), which is
    then used for the rest of the request. Only the phase's own rewards are compared (line 4).
    """

    def reset(self) -> None:
        super().reset()
        self.survivors = list(range(self.n_arms))
        self.eliminated: list[int] = []
        self.phase = 0
        self._start_phase()

    @property
    def committed(self) -> bool:
        return len(self.survivors) <= 1

    def _phase_pulls(self, n_survivors: int) -> int:
        raise NotImplementedError

    def _start_phase(self) -> None:
        self._sums = {a: 0.0 for a in self.survivors}
        self._pos = 0
        if self.committed:
            self._plan: list[int] = []
            return
        n = self._phase_pulls(len(self.survivors))
        self._plan = [a for a in self.survivors for _ in range(n)]

    def select(self) -> int:
        self._need_arms()
        if self.committed:
            return self.survivors[0]
        return self._plan[self._pos]

    def _learn(self, arm: int, feedback: RoundFeedback) -> None:
        if self.committed or arm != self._plan[self._pos]:
            return
        self._sums[arm] += self.reward_of(feedback)
        self._pos += 1
        if self._pos == len(self._plan):
            ranked = sorted(self.survivors, key=lambda a: (-self._sums[a], a))
            keep = (len(ranked) + 1) // 2
            self.eliminated.extend(ranked[keep:])
            self.survivors = sorted(ranked[:keep])
            self.phase += 1
            self._start_phase()


def _n_phases(k: int) -> int:
    return max(1, math.ceil(math.log2(k))) if k > 1 else 0


class SequentialHalving(_Halving):
    """Sequential halving for switching costs, MetaSD Alg. 5 / H.1 with the experiments'
    "period 1" (F.4): every phase plays each survivor ``period`` times, then halves - the
    anytime form, since the round budget T of Alg. 5 is unknown in advance.

    Args: ``period`` (>= 1, default 1); reward options.
    """

    name = "sh"

    def __init__(self, period: int = DEFAULT_SH_PERIOD, **kwargs):
        super().__init__(**kwargs)
        self.period = _check_int(period, "period", 1, "period=1")

    def _phase_pulls(self, n_survivors: int) -> int:
        return self.period


class PETC(_Halving):
    """Pure exploration-then-commit, MetaSD Alg. 4 / Thm 8: sequential halving (Alg. 5) with
    a total budget of B0 = c ln B rounds, n_t = floor(B0 / (|S_t| ceil(log2 K))) (>= 1), then
    the survivor for the rest of the request; switching regret O(ln B).

    Args: ``budget`` B0 in rounds (0 = ceil(c ln horizon)); ``c`` (default 4) and ``horizon``
    B in tokens (default 1024) - the paper gives neither; reward options.
    """

    name = "petc"

    def __init__(self, budget: int = 0, c: float = DEFAULT_PETC_C,
                 horizon: int = DEFAULT_PETC_HORIZON, **kwargs):
        super().__init__(**kwargs)
        self.budget = _check_int(budget, "budget", 0, "budget=30 (or 0 for c*ln(horizon))")
        self.c = _check_float(c, "c", 0.0, math.inf, "c=4", low_open=True, high_open=True)
        self.horizon = _check_int(horizon, "horizon", 2, "horizon=1024")

    @property
    def exploration_budget(self) -> int:
        """B0 of Alg. 4 in rounds."""
        return self.budget if self.budget > 0 else math.ceil(self.c * math.log(self.horizon))

    def _phase_pulls(self, n_survivors: int) -> int:
        return max(1, self.exploration_budget // (n_survivors * _n_phases(self.n_arms)))


__all__ = ["PETC", "DiscountedUCB", "MetaSDEXP3", "MetaSDUCB", "SequentialHalving",
           "SlidingWindowUCB", "ThompsonSampling", "block_reward", "is_informative",
           "resolve_n_max"]
