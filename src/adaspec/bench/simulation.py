"""Synthetic drafter environments: test and compare policies without any model.

Two arm families, as in the papers' analyses:
- ``GeometricArm(alpha)``: each drafted token is accepted with probability alpha
  independently, so the accepted length (bonus included) is a truncated geometric variable in
  [1, L+1] (BanditSpec eq. (4)).
- ``TVArm(a, b)``: at every position the acceptance probability gamma = 1 - TV(p, q_i) is drawn
  from Beta(a, b), and the token is accepted with probability gamma.

``SyntheticEnv.step`` simulates one round for the chosen arm and returns a ``RoundFeedback``
with the per-position gammas of the chosen arm and, for full-information learners, of every
other arm on the emitted positions. Times come from a simple cost model so that cost-aware
policies can be tested too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ..config import SamplingConfig
from ..drafters.base import Draft
from ..feedback import RoundFeedback

_SAMPLING = SamplingConfig(temperature=1.0)


@dataclass(frozen=True)
class GeometricArm:
    alpha: float
    draft_token_s: float = 0.0  # seconds per drafted token

    def gammas(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return np.full(n, self.alpha)

    @property
    def mean_gamma(self) -> float:
        return self.alpha


@dataclass(frozen=True)
class TVArm:
    a: float
    b: float
    draft_token_s: float = 0.0

    def gammas(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return rng.beta(self.a, self.b, size=n)

    @property
    def mean_gamma(self) -> float:
        return self.a / (self.a + self.b)


Arm = GeometricArm | TVArm


def expected_accepted_length(gamma: float, L: int) -> float:
    """E[accepted length incl. bonus] for i.i.d. per-token acceptance gamma and L drafts:
    sum_{k=0}^{L} gamma^k (Leviathan et al.; BanditSpec eq. (4))."""
    return float(sum(gamma ** k for k in range(L + 1)))


@dataclass
class SimResult:
    choices: list[int] = field(default_factory=list)
    accepted_lengths: list[int] = field(default_factory=list)

    @property
    def rounds(self) -> int:
        """Stopping time: rounds needed to produce the requested tokens."""
        return len(self.choices)

    def best_arm_ratio(self, best: int) -> float:
        return self.choices.count(best) / len(self.choices) if self.choices else 0.0


class SyntheticEnv:
    """A stream of rounds over fixed arms; ``verify_s(k)`` is the target cost of k+1 rows."""

    def __init__(self, arms: Sequence[Arm], L: int = 5, seed: int = 0,
                 verify_s: Sequence[float] | None = None):
        self.arms = list(arms)
        self.L = L
        self.rng = np.random.default_rng(seed)
        self.verify = list(verify_s) if verify_s is not None else [1.0] * (L + 2)
        self.t = 0

    def best_arm(self) -> int:
        return int(np.argmax([expected_accepted_length(a.mean_gamma, self.L) for a in self.arms]))

    def step(self, arm: int, k: int | None = None, full_information: bool = False) -> RoundFeedback:
        """Simulate one round with ``arm`` drafting ``k`` (default L) tokens."""
        k = self.L if k is None else k
        all_g = {i: a.gammas(self.rng, k + 1) for i, a in enumerate(self.arms)}
        g = all_g[arm][:k]
        u = self.rng.random(k)
        n = int(np.argmax(u >= g)) if np.any(u >= g) else k
        emitted = [0] * (n + 1)
        a = self.arms[arm]
        fb = RoundFeedback(
            round=self.t, drafter=arm, draft=Draft(tokens=[0] * k), n_accepted=n, emitted=emitted,
            k_cap=k, target_logits=None, sampling=_SAMPLING, gammas=[float(x) for x in g],
            draft_s=a.draft_token_s * k, verify_s=self.verify[min(k, len(self.verify) - 1)])
        if full_information:
            cf = {i: [float(x) for x in gi[: n + 1]] for i, gi in all_g.items() if i != arm}
            cf[arm] = fb.chosen_gammas()
            fb.counterfactual = cf
        self.t += 1
        return fb

    def run(self, policy, n_tokens: int, names: Sequence[str] | None = None) -> SimResult:
        """Run ``policy`` until ``n_tokens`` tokens are produced (one request)."""
        policy.begin_request(list(names) if names else [f"arm{i}" for i in range(len(self.arms))])
        full = policy.caps.full_information
        out = SimResult()
        produced = 0
        while produced < n_tokens:
            i = policy.select()
            fb = self.step(i, full_information=full)
            policy.update(fb)
            out.choices.append(i)
            out.accepted_lengths.append(len(fb.emitted))
            produced += len(fb.emitted)
        return out
