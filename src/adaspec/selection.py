"""Drafter-selection policies: which drafter drafts the next round.

A policy is model-free: ``select()`` returns a drafter index, ``update(feedback)`` learns
from the round. Policies that set ``full_information = True`` also receive the other
drafters' acceptance probabilities on the verified tokens (Not-a-Bandit 3.2) in
``feedback.counterfactual``. This module holds the interface and the static baseline;
the bandit and full-information learners register here too.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable, Sequence

from .errors import ConfigError, UnknownNameError
from .feedback import RoundFeedback


class DrafterPolicy(ABC):
    """Chooses a drafter each round and learns from the round's feedback."""

    name: str = "policy"
    #: ask the engine to evaluate every other drafter on the verified tokens each round
    full_information: bool = False

    def begin_request(self, drafter_names: Sequence[str]) -> None:
        """Called at the start of every request with the drafters' names."""
        self.n_arms = len(drafter_names)

    @abstractmethod
    def select(self) -> int:
        """Index of the drafter for the next round."""

    def update(self, feedback: RoundFeedback) -> None:
        """Learn from one round (default: nothing)."""


class StaticPolicy(DrafterPolicy):
    """Always the same drafter (the baseline of every paper)."""

    name = "static"

    def __init__(self, arm: int = 0):
        if arm < 0:
            raise ConfigError(f"static drafter index must be >= 0, got {arm}")
        self.arm = arm

    def begin_request(self, drafter_names: Sequence[str]) -> None:
        super().begin_request(drafter_names)
        if self.arm >= self.n_arms:
            raise ConfigError(
                f"static policy picks drafter #{self.arm} but only {self.n_arms} drafter(s) are loaded")

    def select(self) -> int:
        return self.arm


SELECTORS: dict[str, Callable[..., DrafterPolicy]] = {"static": StaticPolicy}


def build_selector(spec: str | DrafterPolicy | None) -> DrafterPolicy:
    """Build a drafter policy from ``NAME[:key=value,...]`` (None -> static)."""
    if spec is None:
        return StaticPolicy()
    if isinstance(spec, DrafterPolicy):
        return spec
    from .drafters import parse_params

    name, _, rest = spec.partition(":")
    cls = SELECTORS.get(name.strip().lower())
    if cls is None:
        raise UnknownNameError(f"unknown selector {name!r}: use one of {sorted(SELECTORS)}")
    params = parse_params(rest, f"selector {spec!r}")
    try:
        return cls(**{k: _number(v) for k, v in params.items()})
    except TypeError as exc:
        raise ConfigError(f"bad parameters for selector {name!r}: {exc}") from None


def _number(text: str) -> int | float | str:
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return text
