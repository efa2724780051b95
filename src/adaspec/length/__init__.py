"""Draft-length policies: how many tokens to draft, decided token by token.

Every policy is one class with ``begin_round`` / ``decide`` / ``update`` and is registered here
in ``registry.REGISTRY`` (kind ``length``) under the name used by
``--length NAME[:key=value,...]``, its spec's parameters those of its constructor.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..registry import REGISTRY, Entry, Spec
from .auto import AutoLength
from .bandit import LengthUCB
from .base import LengthCaps, LengthPolicy, PolicyCaps, StaticLength
from .cost_rule import CostModelRule
from .rules import AdaEDL, HFHeuristic, LogitMargin, MaxConfidence, SVIPDifference, SVIPEntropy
from .specdecpp import SpecDecPPPolicy
from .tapout import TapOut


def register_length(name: str, component: Any, **options: Any) -> Entry:
    """Register a length policy (``registry.Registry.register`` for kind ``length``): a
    ``LengthPolicy`` class, built with the parameters its spec sets."""
    return REGISTRY.register("length", name, component, **options)


_BUILT_IN = (StaticLength, HFHeuristic, MaxConfidence, SVIPEntropy, SVIPDifference, LogitMargin, AdaEDL,
             CostModelRule, SpecDecPPPolicy, TapOut, LengthUCB, AutoLength)
for _cls in _BUILT_IN:
    register_length(_cls.name, _cls)

#: the built-in length policies by name (a listing: ``REGISTRY`` is what parses and builds specs)
LENGTH_POLICIES: dict[str, Callable[..., LengthPolicy]] = {cls.name: cls for cls in _BUILT_IN}


def parse_length(spec: str) -> Spec:
    """A length-policy spec parsed and checked against its parameters (nothing built)."""
    return REGISTRY.parse("length", spec)


def build_length(spec: str | int | LengthPolicy | None, k: int = 5) -> LengthPolicy:
    """Build a length policy from ``NAME[:key=value,...]``, an int K, or None (static K)."""
    if spec is None:
        return StaticLength(k)
    if isinstance(spec, LengthPolicy):
        return spec
    if isinstance(spec, int):
        return StaticLength(spec)
    parsed = parse_length(spec)
    if parsed.name == "static" and "k" not in parsed.given:
        parsed = parsed.with_values(k=k)
    return REGISTRY.build("length", parsed)


__all__ = ["AutoLength", "LengthCaps", "LengthPolicy", "PolicyCaps", "StaticLength", "LENGTH_POLICIES", "build_length",
           "parse_length", "register_length"]
