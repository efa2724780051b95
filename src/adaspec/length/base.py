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
from ..persist import Stored
from ..registry import read_flags


@dataclass(frozen=True)
class PolicyCaps:
    """What any policy (a selector, a length policy) may take part in; ``LengthCaps`` and
    ``selection.base.SelectorCaps`` add their own. ``prices_rounds``: it prices rounds on the
    engine's cost model (``costs``, bound by the engine, which then measures the verify-cost
    surface) and receives the round's ``feedback.RoundContext`` (``select(ctx)``,
    ``begin_round(drafter, ctx)``). ``reads_time``: its decisions read the rounds' measured
    seconds (a replay synthesises them: deterministic, not a live run). ``shares_interleaved``:
    its ``update`` reads only the feedback, so one learner may serve requests whose rounds
    interleave (the vLLM proposer, ``scope=global``). ``forks_sharing``: per-request copies share
    what it learns across requests (``shared_state``: auto's global counts)."""

    prices_rounds: bool = False
    reads_time: bool = False
    shares_interleaved: bool = False
    forks_sharing: bool = False

    @property
    def time_dependent(self) -> bool:
        """Do its decisions depend on round times or the cost model?"""
        return self.prices_rounds or self.reads_time


@dataclass(frozen=True)
class LengthCaps(PolicyCaps):
    """What a length policy takes part in, declared by its class (``LengthPolicy.caps``; set on
    the instance where it depends on the policy's parameters) and read by the round and its
    callers, which never probe a policy for hooks (``PolicyCaps``' fields, and these).

    ``needs_hidden``: model drafters report their final hidden state at each step
    (``DraftStep.hidden``: SpecDec++'s head). ``plans_round_rate``: the cap is a plan that
    maximises the round's own expected tokens per second (``auto``), whose gate already decided
    that the round drafts: a draft tree's node budget keeps that objective instead of pricing
    nodes against the generation's running rate (``trees.nodes_worth_verifying``), and a plain
    step may become a model-free tree (``plain_rate``). ``follows_selector``: its cap is its
    selector's plan (``auto`` paired with ``auto``), so a batch that chooses the rows' common
    width (``SelectorCaps.plans_jointly``) commits both."""

    needs_hidden: bool = False
    plans_round_rate: bool = False
    follows_selector: bool = False


#: class attributes of earlier policies, read into the record when a subclass sets them
_LENGTH_FLAGS = {"needs_hidden": "needs_hidden", "plans_round_rate": "plans_round_rate",
                 "wants_costs": "prices_rounds"}


class LengthPolicy(Stored, ABC):
    """Decides when a drafter stops drafting. What it takes part in is its ``caps``
    (``LengthCaps``)."""

    name: str = "length"
    caps: LengthCaps = LengthCaps()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        flags = read_flags(cls, _LENGTH_FLAGS)
        if flags:
            cls.caps = replace(cls.caps, **flags)

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
