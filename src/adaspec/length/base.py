"""The draft-length policy interface, its capability record and the static-K baseline.

``begin_round`` returns the round's cap (0 = no speculation this round); ``decide`` sees each
drafted token with the drafter's distribution and says continue / stop / discard; ``update``
learns from the round. What else it takes part in is declared in its ``caps`` (``LengthCaps``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ..config import validate_k, validate_scope
from ..drafters.base import Decision, DraftStep
from ..feedback import RoundFeedback
from ..persist import load_state, state_of, state_type


@dataclass(frozen=True)
class LengthCaps:
    """What a length policy takes part in, declared by its class (``LengthPolicy.caps``; set on
    the instance where it depends on the policy's parameters) and read by the round and its
    callers, which never probe a policy for hooks.

    ``needs_hidden``: model drafters report their final hidden state at each step
    (``DraftStep.hidden``: SpecDec++'s head). ``plans_round_rate``: the cap is a plan that
    maximises the round's own expected tokens per second (``auto``), whose gate already decided
    that the round drafts: a draft tree's node budget keeps that objective instead of pricing
    nodes against the generation's running rate (``trees.nodes_worth_verifying``), and a plain
    step may become a model-free tree (``plain_rate``). ``prices_rounds``, ``reads_time``,
    ``shares_interleaved``, ``forks_sharing``: as in ``selection.base.SelectorCaps``
    (``begin_round`` receives the round's ``RoundContext`` when it prices rounds).
    ``follows_selector``: its cap is its selector's plan (``auto`` paired with ``auto``), so a
    batch that chooses the rows' common width (``SelectorCaps.plans_jointly``) commits both."""

    needs_hidden: bool = False
    plans_round_rate: bool = False
    prices_rounds: bool = False
    reads_time: bool = False
    shares_interleaved: bool = False
    forks_sharing: bool = False
    follows_selector: bool = False

    @property
    def time_dependent(self) -> bool:
        """Do its decisions depend on round times or the cost model?"""
        return self.prices_rounds or self.reads_time


#: class attributes of earlier policies, read into the record when a subclass sets them
_LENGTH_FLAGS = {"needs_hidden": "needs_hidden", "plans_round_rate": "plans_round_rate",
                 "wants_costs": "prices_rounds"}


class LengthPolicy(ABC):
    """Decides when a drafter stops drafting. What it takes part in is its ``caps``
    (``LengthCaps``)."""

    name: str = "length"
    caps: LengthCaps = LengthCaps()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        flags = {field: cls.__dict__[attr] for attr, field in _LENGTH_FLAGS.items()
                 if attr in cls.__dict__ and isinstance(cls.__dict__[attr], bool)}
        if flags:
            cls.caps = replace(cls.caps, **flags)
        state_type(cls)  # its objects may be stored (``state_dict``)

    def state_dict(self) -> dict[str, Any]:
        """What the policy has learnt, as plain JSON data (``persist``: its attributes but the
        cost model and the capability record); ``load_state_dict`` puts it into a policy
        built from the same spec."""
        return state_of([self])[0]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict``'s data into this policy (built from the same spec)."""
        load_state([self], [state])

    @property
    def needs_hidden(self) -> bool:
        """Ask model drafters for their final hidden state at each step (``caps``)."""
        return self.caps.needs_hidden

    @property
    def plans_round_rate(self) -> bool:
        return self.caps.plans_round_rate

    @property
    def wants_costs(self) -> bool:
        return self.caps.prices_rounds

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

    def bind(self, drafters: Sequence[Any], trees: Sequence[bool]) -> None:
        """The drafters' capability records (``drafters.base.DrafterCaps``) and which of them
        draft trees this engine, told once before any request (default: nothing)."""

    @abstractmethod
    def begin_round(self, drafter: int) -> int:
        """Maximum number of tokens to draft this round (0 = plain decoding step;
        ``caps.prices_rounds``: ``begin_round(drafter, ctx)``, the round's ``RoundContext``)."""

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

    def shared_state(self) -> list[Any]:
        """``caps.forks_sharing``: the objects a per-request copy shares with this policy
        (``round.fork_policies``); default none."""
        return []


class StaticLength(LengthPolicy):
    """Draft exactly K tokens (or fewer if the drafter runs out of proposals)."""

    name = "static"
    caps = LengthCaps(shares_interleaved=True)

    def __init__(self, k: int = 5, **kwargs):
        super().__init__(**kwargs)
        self.k = validate_k(k)

    def begin_round(self, drafter: int) -> int:
        return self.k
