"""BanditSpec drafter selection (Hou et al., "BanditSpec: Adaptive Speculative Decoding via
Bandit Algorithms"): UCBSpec (stochastic rewards, Alg. 4 / 8) and EXP3Spec (adversarial
rewards, Alg. 5 / 9).

Each round is one arm pull; the reward is the accepted length ``y`` including the bonus /
correction token (``feedback.n_accepted + 1``, in ``[1, L+1]``), and the objective is the
stopping-time regret of eq. (1): rounds needed to produce the output compared with always
using the best drafter. ``y`` is taken before stop truncation (EOS, stop strings, budget), as
the paper's ``len(x_{I_t,t})`` is the subroutine's accepted length.

``L`` is the maximum speculation length. By default it is read from the rounds seen so far
(the largest ``feedback.k_cap``; 5 before any round, or when every cap was 0), so it follows
the length policy's cap; pass ``L=...`` to fix it.
"""

from __future__ import annotations

import math

from ..errors import ConfigError
from ..feedback import RoundFeedback
from ..length.bandit import DEFAULT_DELTA, confidence_radius  # noqa: F401 (shared with LengthUCB)
from .base import DrafterPolicy, SelectorCaps, argmax, sample_index

#: maximum speculation length assumed before any round has been seen (NOTES: N_max = 5)
DEFAULT_L = 5


def check_L(L: int | float | None) -> int | None:
    """None (read from the feedback) or an integer >= 1."""
    if L is None:
        return None
    if isinstance(L, bool) or not isinstance(L, (int, float)) or L != int(L) or L < 1:
        raise ConfigError(f"L (maximum speculation length) must be an integer >= 1, got {L!r}: "
                          "pass e.g. L=5, or leave it unset to read it from the length cap")
    return int(L)


def check_unit(value: float, what: str, example: str, upper_inclusive: bool = True) -> float:
    """A float in (0, 1] (or (0, 1))."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0 and (
        value <= 1 if upper_inclusive else value < 1)
    if not ok:
        bound = "(0, 1]" if upper_inclusive else "(0, 1)"
        raise ConfigError(f"{what} must be a number in {bound}, got {value!r}: pass e.g. {example}")
    return float(value)


def check_positive(value: float, what: str, example: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 \
            or math.isinf(value):
        raise ConfigError(f"{what} must be a positive number, got {value!r}: pass e.g. {example}")
    return float(value)


def need_arms(policy: DrafterPolicy) -> int:
    if policy.n_arms <= 0:
        raise ConfigError(f"selector {policy.name!r} has no drafters: call begin_request(names) "
                          "with at least one drafter name first")
    return policy.n_arms


class _SpecLength:
    """Tracks the maximum speculation length L (fixed, or the largest k_cap seen)."""

    L: int | None
    _max_cap: int

    def spec_length(self) -> int:
        """L used in the radius / loss: the fixed ``L`` or the largest cap seen (default 5)."""
        if self.L is not None:
            return self.L
        return self._max_cap if self._max_cap > 0 else DEFAULT_L

    def _see_cap(self, feedback: RoundFeedback) -> None:
        if feedback.k_cap > self._max_cap:
            self._max_cap = feedback.k_cap


def round_robin_then_ucb(policy) -> int:
    """BanditSpec Alg. 8 lines 4-7: round-robin over the first K rounds (and any arm never
    pulled), then the arm with the largest ``policy.ucb()`` index."""
    k = need_arms(policy)
    if policy.t < k:
        return policy.t
    if 0 in policy.counts:
        return policy.counts.index(0)
    return argmax(policy.ucb())


class UCBSpec(_SpecLength, DrafterPolicy):
    """UCBSpec, BanditSpec Alg. 4 / Alg. 8: round-robin over the K drafters for the first K
    rounds, then argmax of mean accepted length + cr (Alg. 8 line 11); stopping-time regret
    O(H L^2 log E[len]) (Thm 4.3).

    Args: ``L`` max speculation length (default: from ``feedback.k_cap``); ``delta`` confidence
    parameter (default 1/2, the value of the proof of Thm 4.3); ``explore`` multiplies cr
    (1.0 = the paper; smaller explores less, outside the guarantee).
    """

    name = "ucbspec"
    caps = SelectorCaps(shares_interleaved=True)

    def __init__(self, L: int | None = None, delta: float = DEFAULT_DELTA, explore: float = 1.0,
                 **kwargs):
        super().__init__(**kwargs)
        self.L = check_L(L)
        self.delta = check_unit(delta, "delta", "delta=0.5")
        self.explore = check_positive(explore, "explore", "explore=1.0")
        self._max_cap = 0
        self.t = 0
        self.counts: list[int] = []
        self.sums: list[float] = []

    def reset(self) -> None:
        self.t = 0
        self._max_cap = 0
        self.counts = [0] * self.n_arms
        self.sums = [0.0] * self.n_arms

    def radius(self, arm: int) -> float:
        """cr_{i,t} of ``arm`` after the ``self.t`` rounds seen so far."""
        return self.explore * confidence_radius(self.spec_length(), self.counts[arm], self.t,
                                                self.n_arms, self.delta)

    def ucb(self) -> list[float]:
        """UCB_{i,t} = mean_i + cr_i for every arm (inf for arms never pulled)."""
        return [(self.sums[i] / self.counts[i] if self.counts[i] else 0.0) + self.radius(i)
                for i in range(self.n_arms)]

    def select(self) -> int:
        return round_robin_then_ucb(self)

    def update(self, feedback: RoundFeedback) -> None:
        i = feedback.drafter
        if not 0 <= i < self.n_arms:
            return
        self._see_cap(feedback)
        self.counts[i] += 1
        self.sums[i] += feedback.n_accepted + 1
        self.t += 1


class EXP3Spec(_SpecLength, DrafterPolicy):
    """EXP3Spec, BanditSpec Alg. 5 / Alg. 9: anytime EXP3 with eta_t = sqrt(log K / (t K)),
    p_t ∝ exp(-eta_t * cumulative importance-weighted loss), loss Z = (L+1-y)/(L p_{t,I_t})
    (eq. (6)); regret O(L sqrt(len K log K)) against adversarial lengths (Thm 5.3).

    Args: ``L`` max speculation length (default: from ``feedback.k_cap``; lengths above
    L+1 count as loss 0).
    """

    name = "exp3spec"

    def __init__(self, L: int | None = None, **kwargs):
        super().__init__(**kwargs)
        self.L = check_L(L)
        self._max_cap = 0
        self.t = 0
        self.losses: list[float] = []
        self._p: list[float] | None = None

    def reset(self) -> None:
        self.t = 0
        self._max_cap = 0
        self.losses = [0.0] * self.n_arms
        self._p = None

    def eta(self, t: int) -> float:
        """Anytime learning rate eta_t = sqrt(log K / (t K)) (Alg. 9 inputs)."""
        k = self.n_arms
        return math.sqrt(math.log(k) / (t * k))

    def probabilities(self) -> list[float]:
        """p_t of Alg. 9 line 4 for the next round t = self.t + 1 (shifted by the smallest
        cumulative loss for numerical stability; the ratio is unchanged)."""
        k = need_arms(self)
        eta = self.eta(self.t + 1)
        low = min(self.losses)
        w = [math.exp(-eta * (x - low)) for x in self.losses]
        s = sum(w)
        return [x / s for x in w] if k > 1 else [1.0]

    def select(self) -> int:
        p = self.probabilities()
        self._p = p
        return sample_index(self.rng, p)

    def update(self, feedback: RoundFeedback) -> None:
        i = feedback.drafter
        if not 0 <= i < self.n_arms:
            return
        self._see_cap(feedback)
        p = (self._p if self._p is not None else self.probabilities())[i]
        self._p = None
        self.t += 1
        if p <= 0.0:  # a drafter this policy did not choose: no unbiased estimate
            return
        big_l = self.spec_length()
        y = feedback.n_accepted + 1
        self.losses[i] += max(0.0, (big_l + 1 - y) / big_l) / p
