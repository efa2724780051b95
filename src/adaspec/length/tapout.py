"""TapOut: a bandit over stopping rules (Sridhar et al., "TapOut: A Bandit-Based Approach to
Dynamic Speculative Decoding").

The arms are training-free stopping rules (Table 1: max-confidence 0.8, SVIP sqrt-entropy 0.6,
SVIP-difference 0.2, logit margin 0.2, AdaEDL); the bandit picks which rule decides when to
stop drafting, with a maximum draft length of 128 (section 4). Two granularities (3.1):

* ``level="sequence"``: one arm per round, chosen in ``begin_round``; it makes every
  stop/continue decision of the round. Reward (3.2, ``r_blend``):
  ``r = alpha |Y| / gamma + (1 - alpha) |Y| / |X|`` with ``Y`` the accepted prefix of the draft
  (``feedback.n_accepted``, bonus / correction token excluded), ``X`` the drafted tokens
  (``feedback.n_drafted``) and ``gamma`` the maximum draft length of Alg. 1 (``max_len``), so
  ``r`` is in [0, 1]; ``alpha = 0.5``. Algorithms: UCB1, UCB-Tuned, Gaussian Thompson sampling.
* ``level="token"``: every position i of the draft is its own bandit (3.1); at each drafted
  token the bandit of that position picks the arm whose decision is used. Bernoulli rewards
  (3.2), learnt with UCB1, UCB-Tuned or Beta-Bernoulli Thompson sampling (3.3).

Token-level reward, where the paper is ambiguous. Section 3.2 says "r = 1 if the token is
accepted, 0 otherwise", but the arm at position i is consulted *after* x_i is drafted
(Alg. 1 lines 3-5), so whether x_i is accepted does not depend on the arm: with that reward
every arm of a position has the same expected reward and nothing is learnt. The default
``token_reward="decision"`` rewards the decision instead: r = 1 if the arm said CONTINUE and
x_i was accepted (the paper's reward for a continue) or said STOP and x_i was rejected (the
oracle of section 1 drafts until the first rejected token, so stopping exactly there is the
right call), else 0. ``token_reward="accepted"`` is the literal reading (r = 1{x_i accepted}
whatever the decision).

Arms see every drafted token they are asked about with their own ``decide``; at token level
every arm is asked at every position (stateful rules such as SVIP-difference need the
previous token's entropy) and only the chosen arm's verdict is used. ``begin_request``,
``begin_round`` and ``update`` are forwarded to every arm (AdaEDL adapts its threshold from
each round's acceptance rate). The cap of a round is ``max_len``; the arms' own caps are
ignored.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from ..drafters.base import Decision, DraftStep
from ..errors import ConfigError
from ..feedback import RoundFeedback
from ..persist import state_type
from .base import LengthPolicy

LEVELS = ("sequence", "token")
ALGOS = ("ucb1", "ucb-tuned", "thompson")
TOKEN_REWARDS = ("decision", "accepted")


def default_arms(**kwargs) -> list[LengthPolicy]:
    """The five stopping rules of TapOut Table 1 with their thresholds (``kwargs`` such as
    ``scope`` are passed to each)."""
    from .rules import AdaEDL, LogitMargin, MaxConfidence, SVIPDifference, SVIPEntropy

    return [cls(**kwargs) for cls in (MaxConfidence, SVIPEntropy, SVIPDifference, LogitMargin,
                                      AdaEDL)]


def arms_from_names(spec: str, **kwargs) -> list[LengthPolicy]:
    """Arms from ``"name+name+..."``: the rules' names (max-confidence, svip, svip-diff,
    logit-margin, adaedl) or class names, e.g. ``svip+adaedl``."""
    from . import rules

    by_name: dict[str, type] = {}
    for cls in (rules.MaxConfidence, rules.SVIPEntropy, rules.SVIPDifference,
                rules.LogitMargin, rules.AdaEDL):
        by_name[str(getattr(cls, "name", cls.__name__)).lower()] = cls
        by_name[cls.__name__.lower()] = cls
    out = []
    for part in filter(None, (p.strip().lower() for p in spec.replace("|", "+").split("+"))):
        if part not in by_name:
            raise ConfigError(f"unknown TapOut arm {part!r}: use names from "
                              f"{sorted(set(by_name))} joined with '+'")
        out.append(by_name[part](**kwargs))
    return out


@state_type
class ArmStats:
    """Counts, reward sums and sums of squares of one K-armed bandit, with the index rules of
    TapOut 3.3: UCB1 (Auer et al. 2002), UCB-Tuned, Gaussian and Beta-Bernoulli Thompson
    sampling. Unplayed arms are played first, in index order; ties go to the lower index."""

    __slots__ = ("n", "s", "ss", "t")

    def __init__(self, k: int):
        self.n = [0] * k
        self.s = [0.0] * k
        self.ss = [0.0] * k
        self.t = 0  # total pulls

    def add(self, arm: int, r: float) -> None:
        self.n[arm] += 1
        self.s[arm] += r
        self.ss[arm] += r * r
        self.t += 1

    def mean(self, arm: int) -> float:
        return self.s[arm] / self.n[arm] if self.n[arm] else 0.0

    def var(self, arm: int) -> float:
        """Empirical (population) variance of the arm's rewards."""
        n = self.n[arm]
        if not n:
            return 0.0
        m = self.s[arm] / n
        return max(0.0, self.ss[arm] / n - m * m)

    def ucb1(self) -> list[float]:
        """mean_a + sqrt(2 log t / N_a) (TapOut 3.3, first display)."""
        lt = math.log(max(self.t, 1))
        return [self.s[a] / n + math.sqrt(2.0 * lt / n) if n else math.inf
                for a, n in enumerate(self.n)]

    def ucb_tuned(self) -> list[float]:
        """mean_a + sqrt(log t / N_a * min(1/4, V_a)), V_a = var_a + sqrt(2 log t / N_a)
        (TapOut 3.3, UCB-Tuned)."""
        lt = math.log(max(self.t, 1))
        out = []
        for a, n in enumerate(self.n):
            if not n:
                out.append(math.inf)
                continue
            v = self.var(a) + math.sqrt(2.0 * lt / n)
            out.append(self.s[a] / n + math.sqrt(lt / n * min(0.25, v)))
        return out

    def gaussian_posterior(self, noise_var: float) -> tuple[np.ndarray, np.ndarray]:
        """Posterior mean and standard deviation of each arm's mean reward under the prior
        N(0.5, noise_var) and Gaussian rewards of known variance ``noise_var``: the prior counts
        as one pseudo-observation of 0.5, so mean = (0.5 + S) / (N + 1), var = noise_var / (N + 1)."""
        n = np.asarray(self.n, dtype=float)
        mean = (0.5 + np.asarray(self.s)) / (n + 1.0)
        return mean, np.sqrt(noise_var / (n + 1.0))

    def beta_posterior(self) -> tuple[np.ndarray, np.ndarray]:
        """Beta(1 + successes, 1 + failures) posteriors (uniform prior, Bernoulli rewards)."""
        s = np.asarray(self.s)
        return 1.0 + s, 1.0 + np.asarray(self.n, dtype=float) - s

    def select(self, algo: str, rng: np.random.Generator, bernoulli: bool,
               noise_var: float) -> int:
        """The arm to play next under ``algo`` (Thompson: Beta-Bernoulli if ``bernoulli``)."""
        if algo == "thompson":
            if bernoulli:
                a, b = self.beta_posterior()
                draws = rng.beta(a, b)
            else:
                m, sd = self.gaussian_posterior(noise_var)
                draws = rng.normal(m, sd)
            return int(np.argmax(draws))
        for a, n in enumerate(self.n):  # every arm once first (UCB)
            if not n:
                return a
        vals = self.ucb1() if algo == "ucb1" else self.ucb_tuned()
        return max(range(len(vals)), key=lambda a: (vals[a], -a))


def _choice(value: object, what: str, allowed: Sequence[str]) -> str:
    v = str(value).strip().lower().replace("_", "-")
    if v == "ucbtuned":
        v = "ucb-tuned"
    if v in ("ts", "thompson-sampling"):
        v = "thompson"
    if v not in allowed:
        raise ConfigError(f"{what} must be one of {list(allowed)}, got {value!r}")
    return v


class TapOut(LengthPolicy):
    """TapOut (Sridhar et al., Alg. 1, 3.1-3.3): a multi-armed bandit chooses which stopping
    rule (Table 1) decides when to stop drafting; sequence level = one rule per round with the
    blended reward of 3.2, token level = one bandit per draft position with Bernoulli rewards.

    Args: ``level`` "sequence" | "token"; ``algo`` "ucb1" | "ucb-tuned" | "thompson" (Gaussian
    TS at sequence level, Beta-Bernoulli at token level); ``alpha`` weight of the normalised
    acceptance length in r_blend (0.5); ``max_len`` maximum draft length gamma (128, section 4);
    ``arms`` list of LengthPolicy rules or "name+name" (default: the five Table 1 rules);
    ``ts_var`` known reward variance of Gaussian TS (0.25, the largest variance of a [0, 1]
    reward); ``token_reward`` "decision" | "accepted" (see the module docstring); ``seed``,
    ``scope`` as every policy (default arms get the same scope).
    """

    name = "tapout"

    def __init__(self, level: str = "sequence", algo: str = "ucb1", alpha: float = 0.5,
                 max_len: int = 128, arms: Sequence[LengthPolicy] | str | None = None,
                 ts_var: float = 0.25, token_reward: str = "decision", **kwargs):
        super().__init__(**kwargs)
        self.level = _choice(level, "level", LEVELS)
        self.algo = _choice(algo, "algo", ALGOS)
        self.token_reward = _choice(token_reward, "token_reward", TOKEN_REWARDS)
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0.0 <= alpha <= 1.0:
            raise ConfigError(f"alpha must be a number in [0, 1], got {alpha!r}: pass e.g. alpha=0.5")
        self.alpha = float(alpha)
        if isinstance(max_len, bool) or not isinstance(max_len, (int, float)) \
                or max_len != int(max_len) or max_len < 1:
            raise ConfigError(f"max_len must be an integer >= 1, got {max_len!r}: pass e.g. max_len=128")
        self.max_len = int(max_len)
        if isinstance(ts_var, bool) or not isinstance(ts_var, (int, float)) or not ts_var > 0 \
                or math.isinf(ts_var):
            raise ConfigError(f"ts_var must be a positive number, got {ts_var!r}: pass e.g. ts_var=0.25")
        self.ts_var = float(ts_var)
        if arms is None:
            self.arms = default_arms(scope=self.scope, max_len=self.max_len)
        elif isinstance(arms, str):
            self.arms = arms_from_names(arms, scope=self.scope, max_len=self.max_len)
        else:
            self.arms = list(arms)
        if not self.arms:
            raise ConfigError("TapOut needs at least one arm: pass arms=[...] or leave the default "
                              "(the five stopping rules of TapOut Table 1)")
        bad = [a for a in self.arms if not isinstance(a, LengthPolicy)]
        if bad:
            raise ConfigError(f"TapOut arms must be LengthPolicy stopping rules, got {bad[0]!r}")
        self.caps = replace(type(self).caps, needs_hidden=any(a.caps.needs_hidden for a in self.arms))
        self.arm_names = [getattr(a, "name", type(a).__name__) for a in self.arms]
        self._arm = -1  # sequence level: arm of the current round
        self._consulted = False  # sequence level: did the arm decide anything this round
        self._trace: list[tuple[int, int, Decision]] = []  # token level: (position, arm, verdict)
        self.reset()

    @property
    def n_arms(self) -> int:
        return len(self.arms)

    # -- learnt state ---------------------------------------------------------------------------
    def reset(self) -> None:
        self.seq = ArmStats(self.n_arms)  # sequence-level bandit
        self.positions: list[ArmStats] = []  # token level: one bandit per draft position
        self.pulls = [0] * self.n_arms  # how often each arm was chosen (rounds or positions)

    def position(self, i: int) -> ArmStats:
        """The bandit of draft position ``i`` (created on first use)."""
        while len(self.positions) <= i:
            self.positions.append(ArmStats(self.n_arms))
        return self.positions[i]

    def values(self) -> list[float]:
        """Learnt value of every arm (TapOut Fig. 5): mean r_blend at sequence level, mean
        Bernoulli reward over all positions at token level."""
        if self.level == "sequence":
            return [self.seq.mean(a) for a in range(self.n_arms)]
        n = [sum(p.n[a] for p in self.positions) for a in range(self.n_arms)]
        s = [sum(p.s[a] for p in self.positions) for a in range(self.n_arms)]
        return [s[a] / n[a] if n[a] else 0.0 for a in range(self.n_arms)]

    def reward(self, feedback: RoundFeedback) -> float:
        """r_blend = alpha |Y| / gamma + (1 - alpha) |Y| / |X| (TapOut 3.2), gamma = max_len;
        0 for an empty draft."""
        x = feedback.n_drafted
        if x == 0:
            return 0.0
        y = min(feedback.n_accepted, x)
        return self.alpha * y / self.max_len + (1.0 - self.alpha) * y / x

    def _select(self, stats: ArmStats) -> int:
        return stats.select(self.algo, self.rng, bernoulli=self.level == "token",
                            noise_var=self.ts_var)

    # -- LengthPolicy ---------------------------------------------------------------------------
    def begin_request(self) -> None:
        super().begin_request()
        for a in self.arms:
            a.begin_request()

    def begin_round(self, drafter: int) -> int:
        for a in self.arms:
            a.begin_round(drafter)
        self._trace = []
        self._consulted = False
        if self.level == "sequence":
            self._arm = self._select(self.seq)
            self.pulls[self._arm] += 1
        return self.max_len

    def decide(self, step: DraftStep) -> Decision:
        if self.level == "sequence":
            self._consulted = True
            return self.arms[self._arm].decide(step)
        verdicts = [a.decide(step) for a in self.arms]
        i = step.index
        if i >= self.max_len:  # cannot happen under the engine's cap
            return Decision.STOP
        arm = self._select(self.position(i))
        self.pulls[arm] += 1
        self._trace.append((i, arm, verdicts[arm]))
        return verdicts[arm]

    def update(self, feedback: RoundFeedback) -> None:
        for a in self.arms:
            a.update(feedback)
        if self.level == "sequence":
            if self._arm >= 0 and self._consulted:
                self.seq.add(self._arm, self.reward(feedback))
            self._consulted = False
            return
        k, n = feedback.n_drafted, feedback.n_accepted
        literal = self.token_reward == "accepted"
        for i, arm, verdict in self._trace:
            if verdict is Decision.DISCARD or i >= k:
                continue  # the token was not verified: no reward
            accepted = i < n
            if literal:
                r = 1.0 if accepted else 0.0
            else:
                r = 1.0 if (verdict is Decision.CONTINUE) == accepted else 0.0
            self.position(i).add(arm, r)
        self._trace = []
