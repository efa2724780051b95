"""Drafter-selection policies: which drafter drafts the next round.

Every policy is one class with ``select()`` / ``update(feedback)`` and is registered here in
``registry.REGISTRY`` (kind ``selector``) under the name used by
``--selector NAME[:key=value,...]``, its spec's parameters those of its constructor.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..length import build_length
from ..registry import REGISTRY, Entry, Spec, parse_number
from .auto import AutoLength, AutoSelector
from .banditspec import EXP3Spec, UCBSpec
from .base import DrafterPolicy, SelectorCaps, StaticPolicy
from .baselines import RoundRobinPolicy, UniformRandomPolicy
from .cost_aware import CostAwareEXP3, CostAwareUCB
from .hedgespec import CostAwareHedgeSpec, HedgeSpec
from .router import RouterPolicy
from .metasd import (PETC, DiscountedUCB, MetaSDEXP3, MetaSDUCB, SequentialHalving,
                     SlidingWindowUCB, ThompsonSampling)


def register_selector(name: str, component: Any, **options: Any) -> Entry:
    """Register a drafter policy (``registry.Registry.register`` for kind ``selector``): a
    ``DrafterPolicy`` class, built with the parameters its spec sets."""
    return REGISTRY.register("selector", name, component, **options)


_BUILT_IN = (StaticPolicy, UniformRandomPolicy, RoundRobinPolicy, UCBSpec, EXP3Spec, CostAwareUCB, CostAwareEXP3,
             MetaSDUCB, MetaSDEXP3, SequentialHalving, PETC, DiscountedUCB, SlidingWindowUCB, ThompsonSampling,
             HedgeSpec, CostAwareHedgeSpec, AutoSelector, RouterPolicy)
for _cls in _BUILT_IN:
    register_selector(_cls.name, _cls)

#: the built-in selectors by name (a listing: ``REGISTRY`` is what parses and builds specs)
SELECTORS: dict[str, Callable[..., DrafterPolicy]] = {cls.name: cls for cls in _BUILT_IN}


def parse_selector(spec: str) -> Spec:
    """A selector spec parsed and checked against its parameters (nothing built)."""
    return REGISTRY.parse("selector", spec)


def build_selector(spec: str | DrafterPolicy | None) -> DrafterPolicy:
    """Build a drafter policy from ``NAME[:key=value,...]`` (None -> static)."""
    if spec is None:
        return StaticPolicy()
    if isinstance(spec, DrafterPolicy):
        return spec
    return REGISTRY.build("selector", parse_selector(spec))


#: the selector when several drafters are given without one (engine, bench, replay, server)
DEFAULT_SELECTOR = "auto"


def build_policies(selector: str | DrafterPolicy | None, length: Any, k: int = 5,
                   n_drafters: int = 1) -> tuple[DrafterPolicy, Any]:
    """The drafter and length policies of a configuration. No selector: ``auto`` over several
    drafters, the one drafter itself (static) otherwise. A selector that decides the length
    too (``auto``) supplies its paired length policy when no length policy is given."""
    if selector is None and n_drafters > 1:
        selector = DEFAULT_SELECTOR
    sel = build_selector(selector)
    paired = sel.paired_length() if length is None else None
    return sel, (paired if paired is not None else build_length(length, k))


__all__ = ["AutoLength", "AutoSelector", "DEFAULT_SELECTOR", "DrafterPolicy", "SelectorCaps", "StaticPolicy",
           "SELECTORS", "build_policies", "build_selector", "parse_number", "parse_selector", "register_selector"]
