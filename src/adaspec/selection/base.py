"""The drafter-policy interface and the static baseline.

A policy is model-free: ``select()`` returns a drafter index, ``update(feedback)`` learns
from the round. Policies that set ``full_information = True`` also receive the other
drafters' acceptance probabilities on the verified tokens (Not-a-Bandit 3.2) in
``feedback.counterfactual``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import numpy as np

from ..config import validate_scope
from ..errors import ConfigError
from ..feedback import RoundFeedback


class DrafterPolicy(ABC):
    """Chooses a drafter each round and learns from the round's feedback.

    ``scope="request"`` re-initialises the learner at every request (the papers' protocol,
    MetaSD 4.1); ``scope="global"`` keeps what it learnt across requests (warm start).
    Randomised policies draw from ``self.rng``, seeded once at construction.
    """

    name: str = "policy"
    #: ask the engine to evaluate every other drafter on the verified tokens each round
    full_information: bool = False

    def __init__(self, seed: int | None = 0, scope: str = "request"):
        self.seed, self.scope = seed, validate_scope(scope)
        self.rng = np.random.default_rng(seed)
        self.n_arms = 0
        self.arm_names: list[str] = []

    def begin_request(self, drafter_names: Sequence[str]) -> None:
        """Called at the start of every request; resets the learner unless scope is global."""
        names = list(drafter_names)
        if self.scope == "request" or names != self.arm_names:
            self.n_arms, self.arm_names = len(names), names
            self.reset()

    def reset(self) -> None:
        """(Re)initialise the learner's state for ``self.n_arms`` arms."""

    @abstractmethod
    def select(self) -> int:
        """Index of the drafter for the next round."""

    def update(self, feedback: RoundFeedback) -> None:
        """Learn from one round (default: nothing)."""


class StaticPolicy(DrafterPolicy):
    """Always the same drafter (the baseline of every paper)."""

    name = "static"

    def __init__(self, arm: int = 0, **kwargs):
        super().__init__(**kwargs)
        if arm < 0:
            raise ConfigError(f"static drafter index must be >= 0, got {arm}")
        self.arm = arm

    def reset(self) -> None:
        if self.arm >= self.n_arms:
            raise ConfigError(
                f"static policy picks drafter #{self.arm} but only {self.n_arms} drafter(s) are loaded")

    def select(self) -> int:
        return self.arm


def argmax(values: Sequence[float]) -> int:
    """Index of the largest value (the first one on ties)."""
    best, best_val = 0, -float("inf")
    for i, v in enumerate(values):
        if v > best_val:
            best, best_val = i, v
    return best


def sample_index(rng: np.random.Generator, probs: Sequence[float]) -> int:
    """Draw an index from a probability vector with one uniform draw (inverse CDF)."""
    u = float(rng.random())
    acc, last = 0.0, 0
    for i, pi in enumerate(probs):
        if pi > 0.0:
            last = i
            acc += pi
            if u < acc:
                return i
    return last  # u beyond the rounded total
