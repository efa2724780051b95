"""Cost-aware drafter selection (ours, beyond the papers).

Mean accepted length (MAT), the reward of UCBSpec / EXP3Spec, ignores that drafters cost
different amounts of time: a model drafter may accept one more token per round than prompt
lookup yet lose on wall time, and when nothing is accepted the ``none`` drafter (plain
decoding, one token per target step, no drafting or catch-up) is fastest. Here the reward
is the round's throughput, tokens over model time,

    y / s,  y = feedback.n_accepted + 1,  s = feedback.round_s = draft_s + verify_s + catch_up_s,

as in BanditSpec 6.2, which used throughput as UCBSpec's reward to pick speculation lengths
(gamma = 0 being plain decoding); here the arms are drafters.

Normalisation (our choice): the radius formulas need rewards in a known interval, and
throughput has no a-priori bound, so the learners divide by the largest per-round
throughput observed so far, ``M = max_rounds y/s``. This needs no cost model and no
calibration (no ``caps.prices_rounds``), and ``y/(s M)`` is in [0, 1]. UCB keeps raw sums and
divides at selection time, so a new maximum rescales all arms alike and never changes their
order. When every round costs the same, ``M = (L+1)/s`` once a fully accepted round was seen
and CostAwareUCB reduces to UCBSpec up to the reward interval ([0, 1] vs [1, L+1]).

Estimator (our choice): an arm's value is its long-run throughput ``sum y / sum s`` (ratio of
sums: the time to produce N tokens is about N E[s]/E[y]), not the mean of per-round ratios,
which is biased when round times vary within an arm. Catch-up time is part of ``s``, so
switching away from a drafter and back is charged to it (MetaSD H.1 switching cost).

No regret guarantee is claimed: the normaliser M is learnt online, round times are noisy,
and the ratio estimator is not an average of bounded i.i.d. rewards.
"""

from __future__ import annotations


from ..errors import ConfigError
from ..feedback import RoundFeedback
from .banditspec import (DEFAULT_DELTA, EXP3Spec, check_positive, check_unit,
                         confidence_radius, round_robin_then_ucb)
from .base import DrafterPolicy, SelectorCaps

#: a round time below this (seconds) is treated as this (guards a zero-cost synthetic round)
MIN_ROUND_S = 1e-9


class CostAwareUCB(DrafterPolicy):
    """UCBSpec (BanditSpec Alg. 8: round-robin for K rounds, then argmax mean + cr) with the
    reward tokens per second of model time (BanditSpec 6.2) instead of accepted length: the
    mean is sum y / sum s over the arm's rounds divided by the largest per-round throughput
    seen, and cr is Alg. 8's radius for rewards in [0, 1] (width 1).

    Args: ``delta`` (default 1/2 as UCBSpec), ``explore`` multiplies cr (1.0 = the paper's).
    """

    name = "cost-ucb"
    caps = SelectorCaps(reads_time=True)

    def __init__(self, delta: float = DEFAULT_DELTA, explore: float = 1.0, **kwargs):
        super().__init__(**kwargs)
        self.delta = check_unit(delta, "delta", "delta=0.5")
        self.explore = check_positive(explore, "explore", "explore=1.0")
        self.t = 0
        self.counts: list[int] = []
        self.tokens: list[float] = []
        self.seconds: list[float] = []
        self.scale = 0.0  # M: largest per-round throughput seen (tokens / s)

    def reset(self) -> None:
        self.t = 0
        self.counts = [0] * self.n_arms
        self.tokens = [0.0] * self.n_arms
        self.seconds = [0.0] * self.n_arms
        self.scale = 0.0

    def throughput(self, arm: int) -> float:
        """Estimated tokens per second of ``arm`` (0 if never pulled)."""
        s = self.seconds[arm]
        return self.tokens[arm] / s if s > 0 else 0.0

    def ucb(self) -> list[float]:
        """Normalised mean throughput + radius of every arm (inf for arms never pulled)."""
        m = self.scale if self.scale > 0 else 1.0
        return [self.throughput(i) / m + self.explore * confidence_radius(
            1.0, self.counts[i], self.t, self.n_arms, self.delta) for i in range(self.n_arms)]

    def select(self) -> int:
        return round_robin_then_ucb(self)

    def update(self, feedback: RoundFeedback) -> None:
        i = feedback.drafter
        if not 0 <= i < self.n_arms:
            return
        y = feedback.n_accepted + 1
        s = max(feedback.round_s, MIN_ROUND_S)
        self.counts[i] += 1
        self.tokens[i] += y
        self.seconds[i] += s
        if y / s > self.scale:
            self.scale = y / s
        self.t += 1


class CostAwareEXP3(EXP3Spec):
    """EXP3Spec (BanditSpec Alg. 9: anytime eta_t = sqrt(log K / (t K)), p_t ∝ exp(-eta_t *
    cumulative importance-weighted loss)) with the loss 1 - y/(s M): the round's throughput
    normalised by the largest per-round throughput M seen so far (this round included), so
    losses stay in [0, 1] as the adversarial analysis allows; Z = loss / p_{t,I_t}.
    """

    name = "cost-exp3"
    caps = SelectorCaps(reads_time=True)

    def __init__(self, **kwargs):
        if "L" in kwargs:
            raise ConfigError("cost-exp3 takes no L: its loss is the round's normalised throughput; "
                              "remove L=... (only seed and scope are accepted)")
        super().__init__(L=None, **kwargs)
        self.scale = 0.0  # M: largest per-round throughput seen (tokens / s)

    def reset(self) -> None:
        super().reset()
        self.scale = 0.0

    def update(self, feedback: RoundFeedback) -> None:
        i = feedback.drafter
        if not 0 <= i < self.n_arms:
            return
        p = (self._p if self._p is not None else self.probabilities())[i]
        self._p = None
        self.t += 1
        rate = (feedback.n_accepted + 1) / max(feedback.round_s, MIN_ROUND_S)
        if rate > self.scale:
            self.scale = rate
        if p > 0.0:
            self.losses[i] += (1.0 - rate / self.scale) / p
