"""The draft-length policy interface and the static-K baseline.

``begin_round`` returns the round's cap (0 = no speculation this round); ``decide`` sees each
drafted token with the drafter's distribution and says continue / stop / discard; ``update``
learns from the round.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np

from ..config import validate_k, validate_scope
from ..drafters.base import Decision, DraftStep
from ..feedback import RoundFeedback


class LengthPolicy(ABC):
    """Decides when a drafter stops drafting."""

    name: str = "length"
    #: ask model drafters for their final hidden state at each step (SpecDec++ head)
    needs_hidden: bool = False
    #: the cap is a plan that maximises the round's own expected tokens per second (``auto``),
    #: whose gate already decided that the round drafts: a draft tree's node budget keeps
    #: that objective instead of pricing nodes against the generation's running rate
    #: (``trees.nodes_worth_verifying``)
    plans_round_rate: bool = False

    def __init__(self, seed: int | None = 0, scope: str = "request"):
        self.seed, self.scope = seed, validate_scope(scope)
        self.rng = np.random.default_rng(seed)
        self._started = False

    def begin_request(self) -> None:
        """Called at the start of every request; resets the learner unless scope is global."""
        if self.scope == "request" or not self._started:
            self._started = True
            self.reset()

    def reset(self) -> None:
        """(Re)initialise learnt state."""

    @abstractmethod
    def begin_round(self, drafter: int) -> int:
        """Maximum number of tokens to draft this round (0 = plain decoding step)."""

    def decide(self, step: DraftStep) -> Decision:
        """Called after each drafted token (default: keep drafting up to the cap)."""
        return Decision.CONTINUE

    def update(self, feedback: RoundFeedback) -> None:
        """Learn from one round (default: nothing)."""

    def plain_rate(self) -> float | None:
        """Expected tokens per second of the plain step this round's plan chose
        (``plans_round_rate`` policies: the engine then offers a model-free tree, verified when
        a prefix of it pays at the running rate, ``SpeculativeEngine._plain_tree``); None when
        the round drafts or the policy plans no rate (the default)."""
        return None


class StaticLength(LengthPolicy):
    """Draft exactly K tokens (or fewer if the drafter runs out of proposals)."""

    name = "static"

    def __init__(self, k: int = 5, **kwargs):
        super().__init__(**kwargs)
        self.k = validate_k(k)

    def begin_round(self, drafter: int) -> int:
        return self.k
