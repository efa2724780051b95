"""The drafter-policy interface, its capability record and the static baseline.

A policy is model-free: ``select()`` returns a drafter index, ``update(feedback)`` learns
from the round. What else it takes part in is declared in its ``caps`` (``SelectorCaps``):
policies with ``full_information`` also receive the other drafters' acceptance
probabilities on the verified tokens (Not-a-Bandit 3.2) in ``feedback.counterfactual``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ..config import validate_scope
from ..errors import ConfigError
from ..feedback import RoundFeedback
from ..length.base import PolicyCaps
from ..persist import Stored
from ..registry import read_flags


@dataclass(frozen=True)
class SelectorCaps(PolicyCaps):
    """What a drafter policy takes part in, declared by its class (``DrafterPolicy.caps``; set on
    the instance where it depends on the policy's parameters) and read by the round and its
    callers, which never probe a policy for hooks (``length.base.PolicyCaps``' fields, and
    these). Every hook named here has a default on ``DrafterPolicy``; the record says which
    ones the round calls.

    ``looks``: tokens of every free-looking drafter's block (``DrafterCaps.free_looks``) the
    round shows ``observe_proposals`` before ``select`` (0: none). ``skips_looks``: the round
    asks ``looks()`` each round whether to look, and times the looks (``CostModel.observe_look``).
    ``full_information``: the round scores the other drafters on the verified tokens
    (``feedback.counterfactual``); ``scores_subset``: only those ``to_score`` names.
    ``reads_prompt``: ``observe_prompt(prompt_ids)`` at each request's start (a router).
    ``plans_jointly``: ``block_curve`` / ``commit`` let a batch choose the rows' common width
    (auto)."""

    looks: int = 0
    skips_looks: bool = False
    full_information: bool = False
    scores_subset: bool = False
    reads_prompt: bool = False
    plans_jointly: bool = False


#: class attributes of earlier policies, read into the record when a subclass sets them
_SELECTOR_FLAGS = {"full_information": "full_information", "wants_costs": "prices_rounds"}


class DrafterPolicy(Stored, ABC):
    """Chooses a drafter each round and learns from the round's feedback.

    ``scope="request"`` re-initialises the learner at every request (the papers' protocol,
    MetaSD 4.1); ``scope="global"`` keeps what it learnt across requests (warm start).
    Randomised policies draw from ``self.rng``, seeded once at construction. What it takes part
    in is its ``caps`` (``SelectorCaps``).
    """

    name: str = "policy"
    caps: SelectorCaps = SelectorCaps()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        flags = read_flags(cls, _SELECTOR_FLAGS)
        if flags:
            cls.caps = replace(cls.caps, **flags)

    def __init__(self, seed: int | None = 0, scope: str = "request"):
        self.seed, self.scope = seed, validate_scope(scope)
        self.rng = np.random.default_rng(seed)
        self.n_arms = 0
        self.arm_names: list[str] = []

    @property
    def full_information(self) -> bool:
        """Ask the engine to score every other drafter on the verified tokens (``caps``)."""
        return self.caps.full_information

    @property
    def wants_costs(self) -> bool:
        """Does it price rounds on the cost model (``caps.prices_rounds``)?"""
        return self.caps.prices_rounds

    def begin_request(self, drafter_names: Sequence[str]) -> None:
        """Called at the start of every request; resets the learner unless scope is global."""
        names = list(drafter_names)
        if self.scope == "request" or names != self.arm_names:
            self.n_arms, self.arm_names = len(names), names
            self.reset()

    def reset(self) -> None:
        """(Re)initialise the learner's state for ``self.n_arms`` arms."""

    def bind(self, drafters: Sequence[Any], trees: Sequence[bool]) -> None:
        """The drafters' capability records (``drafters.base.DrafterCaps``) and which of them
        draft trees this engine, told once by the engine, replay and the proposer before any
        request (default: nothing)."""

    @abstractmethod
    def select(self) -> int:
        """Index of the drafter for the next round (``caps.prices_rounds``: ``select(ctx)``, the
        round's ``RoundContext``)."""

    def update(self, feedback: RoundFeedback) -> None:
        """Learn from one round (default: nothing)."""

    # -- hooks the round calls as ``caps`` says ------------------------------------------------
    def observe_prompt(self, prompt_ids: Sequence[int]) -> None:
        """The request's prompt (``caps.reads_prompt``)."""

    def looks(self) -> bool:
        """Show this round's blocks (``caps.skips_looks``)? Default: always."""
        return True

    def observe_proposals(self, blocks: dict[int, Any]) -> None:
        """This round's blocks of the free-looking drafters, by index (``caps.looks`` > 0)."""

    def to_score(self, chosen: int, score_chosen: bool = False) -> list[int]:
        """The drafters to score this round (``caps.scores_subset``), in index order: default
        every drafter but the chosen one (unless ``score_chosen``: it drafted nothing)."""
        return [j for j in range(self.n_arms) if j != chosen or score_chosen]

    def paired_length(self) -> Any:
        """The length policy it pairs with when none is given (auto), or None (default)."""
        return None

    def block_curve(self) -> list[tuple[float, int, int]] | None:
        """``caps.plans_jointly``: per cap k, (expected emitted tokens, drafter, its cap), or
        None when this round cannot be planned jointly (default)."""
        return None

    def commit(self, k: int) -> None:
        """``caps.plans_jointly``: play cap ``k`` this round (a batch's joint width less one)."""
        raise NotImplementedError(f"selector {self.name!r} does not plan jointly")

    def shared_state(self) -> list[Any]:
        """``caps.forks_sharing``: the objects a per-request copy shares with this policy
        (``round.fork_policies``); default none."""
        return []


class StaticPolicy(DrafterPolicy):
    """Always the same drafter (the baseline of every paper)."""

    name = "static"
    caps = SelectorCaps(shares_interleaved=True)

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
