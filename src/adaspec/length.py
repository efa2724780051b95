"""Draft-length policies: how many tokens to draft, decided token by token.

``begin_round`` returns the round's cap (0 = no speculation this round); ``decide`` sees each
drafted token with the drafter's distribution and says continue / stop / discard; ``update``
learns from the round. This module holds the interface and the static-K baseline.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable

from .config import validate_k
from .drafters.base import Decision, DraftStep
from .errors import ConfigError, UnknownNameError
from .feedback import RoundFeedback


class LengthPolicy(ABC):
    """Decides when a drafter stops drafting."""

    name: str = "length"
    #: ask model drafters for their final hidden state at each step (SpecDec++ head)
    needs_hidden: bool = False

    def begin_request(self) -> None:
        """Called at the start of every request."""

    @abstractmethod
    def begin_round(self, drafter: int) -> int:
        """Maximum number of tokens to draft this round (0 = plain decoding step)."""

    def decide(self, step: DraftStep) -> Decision:
        """Called after each drafted token (default: keep drafting up to the cap)."""
        return Decision.CONTINUE

    def update(self, feedback: RoundFeedback) -> None:
        """Learn from one round (default: nothing)."""


class StaticLength(LengthPolicy):
    """Draft exactly K tokens (or fewer if the drafter runs out of proposals)."""

    name = "static"

    def __init__(self, k: int = 5):
        self.k = validate_k(k)

    def begin_round(self, drafter: int) -> int:
        return self.k


LENGTH_POLICIES: dict[str, Callable[..., LengthPolicy]] = {"static": StaticLength}


def build_length(spec: str | int | LengthPolicy | None, k: int = 5) -> LengthPolicy:
    """Build a length policy from ``NAME[:key=value,...]``, an int K, or None (static K)."""
    if spec is None:
        return StaticLength(k)
    if isinstance(spec, LengthPolicy):
        return spec
    if isinstance(spec, int):
        return StaticLength(spec)
    from .drafters import parse_params
    from .selection import _number

    name, _, rest = spec.partition(":")
    cls = LENGTH_POLICIES.get(name.strip().lower())
    if cls is None:
        raise UnknownNameError(f"unknown length policy {name!r}: use one of {sorted(LENGTH_POLICIES)}")
    params = {k2: _number(v) for k2, v in parse_params(rest, f"length policy {spec!r}").items()}
    if cls is StaticLength and "k" not in params:
        params["k"] = k
    try:
        return cls(**params)
    except TypeError as exc:
        raise ConfigError(f"bad parameters for length policy {name!r}: {exc}") from None
