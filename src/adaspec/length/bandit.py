"""BanditSpec over the speculation length (Hou et al., "BanditSpec", section 6.2).

The arms are the speculation lengths gamma in {0, ..., L} (gamma = 0 is plain decoding,
BanditSpec Alg. 1; the paper uses L = 4) and the reward of a round is its throughput, the
tokens it produced per second. The arm is chosen by UCBSpec (Alg. 4 / Alg. 8): round-robin
over the K = L + 1 lengths for the first K rounds, then the largest mean + confidence radius.

Reward and normalisation (the paper does not say how throughput is scaled for the radius):
a round's raw throughput is ``(feedback.n_accepted + 1) / feedback.round_s`` (accepted drafts
plus the bonus / correction token, before stop truncation, over drafting + verification +
catch-up time). UCBSpec's radius assumes rewards in a bounded interval, so rewards are
divided by the largest per-round throughput seen so far: at selection time each arm's mean
raw throughput is divided by this running maximum (the same factor for every arm, so the
ranking of the means is unchanged and every normalised reward is in [0, 1]) and the radius
is taken for an interval of width 1. Rounds with no measured time are ignored.
"""

from __future__ import annotations

import math

from ..errors import ConfigError
from ..feedback import RoundFeedback
from .base import LengthCaps, LengthPolicy

#: BanditSpec does not state the delta of its experiments; the proof of Thm 4.3 (App. D.2,
#: last line) takes delta = 1/2, which we use as the default.
DEFAULT_DELTA = 0.5


def confidence_radius(width: float, n: int, t: int, n_arms: int, delta: float) -> float:
    """BanditSpec Alg. 4 line 3 / Alg. 8 line 11 for rewards in an interval of length ``width``
    (``width = L`` for accepted lengths in [1, L+1]):
    cr = width/2 * sqrt((1+n)/n^2 * (1 + 2 log(K t^2 (1+n)^(1/2) / delta)))."""
    if n <= 0:
        return math.inf
    log_term = 2.0 * math.log(n_arms * t * t / delta) + math.log1p(n)  # 2 log(K t^2 sqrt(1+n)/delta)
    return 0.5 * width * math.sqrt((1.0 + n) / (n * n) * (1.0 + log_term))


def _check_int(value: object, what: str, low: int, example: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value) \
            or value < low:
        raise ConfigError(f"{what} must be an integer >= {low}, got {value!r}: pass e.g. {example}")
    return int(value)


def _check_float(value: object, what: str, example: str, upper: float | None = None) -> float:
    ok = (not isinstance(value, bool) and isinstance(value, (int, float)) and value > 0
          and not math.isinf(value) and (upper is None or value <= upper))
    if not ok:
        rng = f"in (0, {upper}]" if upper is not None else "> 0"
        raise ConfigError(f"{what} must be a number {rng}, got {value!r}: pass e.g. {example}")
    return float(value)


class LengthUCB(LengthPolicy):
    """UCBSpec (BanditSpec Alg. 4 / Alg. 8) over draft lengths gamma in {0..L} with the round's
    throughput as reward (BanditSpec 6.2, L = 4): learns the length that maximises tokens/s on
    this machine, including cost cliffs of the verify forward.

    Args: ``L`` maximum speculation length (default 4, as in 6.2); ``delta`` confidence
    parameter of the radius (default 1/2, the value of the proof of Thm 4.3); ``explore``
    multiplies the radius (1.0 = the paper). The policy never stops a draft early
    (``decide`` is always CONTINUE).
    """

    name = "ucbspec-length"
    caps = LengthCaps(reads_time=True, shares_interleaved=True)

    def __init__(self, L: int = 4, delta: float = DEFAULT_DELTA, explore: float = 1.0, **kwargs):
        super().__init__(**kwargs)
        self.L = _check_int(L, "L (maximum speculation length)", 1, "L=4")
        self.delta = _check_float(delta, "delta", "delta=0.5", upper=1.0)
        self.explore = _check_float(explore, "explore", "explore=1.0")
        self.n_arms = self.L + 1
        self.reset()

    def reset(self) -> None:
        self.t = 0  # rounds learnt from
        self.counts = [0] * self.n_arms
        self.sums = [0.0] * self.n_arms  # raw throughput (tokens/s) per arm
        self.max_throughput = 0.0  # running maximum of per-round throughput (normaliser)
        self.chosen = 0

    # -- statistics -------------------------------------------------------------------------
    def means(self) -> list[float]:
        """Normalised mean reward of every length (mean tokens/s / running max; 0 if unseen)."""
        top = self.max_throughput
        return [self.sums[i] / self.counts[i] / top if self.counts[i] and top > 0 else 0.0
                for i in range(self.n_arms)]

    def ucb(self) -> list[float]:
        """UCB_{i,t} = normalised mean + explore * cr_{i,t} (Alg. 8 line 11; inf if unseen)."""
        k, t = self.n_arms, max(self.t, 1)
        return [m + self.explore * confidence_radius(1.0, n, t, k, self.delta) if n else math.inf
                for m, n in zip(self.means(), self.counts)]

    def best(self) -> int:
        """The length with the highest mean throughput so far (exploitation only)."""
        means = self.means()
        return max(range(self.n_arms), key=lambda i: (means[i], -i)) if self.t else 0

    # -- LengthPolicy ------------------------------------------------------------------------
    def begin_round(self, drafter: int) -> int:
        k = self.n_arms
        if self.t < k:  # Alg. 8 lines 4-5: round-robin over the first K rounds
            arm = self.t
        else:
            arm, best_val = 0, -math.inf
            top = self.max_throughput
            for i in range(k):
                n = self.counts[i]
                if n == 0:
                    arm = i
                    break
                val = self.sums[i] / n / top + self.explore * confidence_radius(
                    1.0, n, self.t, k, self.delta)
                if val > best_val:
                    arm, best_val = i, val
        self.chosen = arm
        return arm

    def update(self, feedback: RoundFeedback) -> None:
        seconds = feedback.round_s
        if not seconds > 0:
            return  # no timing: nothing to learn
        # the engine caps the length at the remaining budget: credit the length actually played
        arm = feedback.k_cap if 0 <= feedback.k_cap < self.n_arms else self.chosen
        tput = (feedback.n_accepted + 1) / seconds
        self.counts[arm] += 1
        self.sums[arm] += tput
        self.max_throughput = max(self.max_throughput, tput)
        self.t += 1
