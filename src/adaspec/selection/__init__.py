"""Drafter-selection policies: which drafter drafts the next round.

Every policy is one class with ``select()`` / ``update(feedback)`` and is registered in
``SELECTORS`` under the name used by ``--selector NAME[:key=value,...]``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..errors import ConfigError, UnknownNameError
from .auto import AutoLength, AutoSelector
from .banditspec import EXP3Spec, UCBSpec
from .base import DrafterPolicy, StaticPolicy
from .baselines import RoundRobinPolicy, UniformRandomPolicy
from .cost_aware import CostAwareEXP3, CostAwareUCB
from .hedgespec import CostAwareHedgeSpec, HedgeSpec
from .router import RouterPolicy
from .metasd import (PETC, DiscountedUCB, MetaSDEXP3, MetaSDUCB, SequentialHalving,
                     SlidingWindowUCB, ThompsonSampling)

SELECTORS: dict[str, Callable[..., DrafterPolicy]] = {
    "static": StaticPolicy,
    "random": UniformRandomPolicy,
    "round-robin": RoundRobinPolicy,
    "ucbspec": UCBSpec,
    "exp3spec": EXP3Spec,
    "cost-ucb": CostAwareUCB,
    "cost-exp3": CostAwareEXP3,
    "metasd-ucb": MetaSDUCB,
    "metasd-exp3": MetaSDEXP3,
    "sh": SequentialHalving,
    "petc": PETC,
    "d-ucb": DiscountedUCB,
    "sw-ucb": SlidingWindowUCB,
    "thompson": ThompsonSampling,
    "hedgespec": HedgeSpec,
    "cost-hedgespec": CostAwareHedgeSpec,
    "auto": AutoSelector,
    "router": RouterPolicy,
}


def build_selector(spec: str | DrafterPolicy | None) -> DrafterPolicy:
    """Build a drafter policy from ``NAME[:key=value,...]`` (None -> static)."""
    if spec is None:
        return StaticPolicy()
    if isinstance(spec, DrafterPolicy):
        return spec
    from ..drafters import parse_params

    name, _, rest = spec.partition(":")
    cls = SELECTORS.get(name.strip().lower())
    if cls is None:
        raise UnknownNameError(f"unknown selector {name!r}: use one of {sorted(SELECTORS)}")
    params = parse_params(rest, f"selector {spec!r}")
    try:
        return cls(**{k: parse_number(v) for k, v in params.items()})
    except TypeError as exc:
        raise ConfigError(f"bad parameters for selector {name!r}: {exc}") from None


#: the selector when several drafters are given without one (engine, bench, replay, server)
DEFAULT_SELECTOR = "auto"


def build_policies(selector: str | DrafterPolicy | None, length: Any, k: int = 5,
                   n_drafters: int = 1) -> tuple[DrafterPolicy, Any]:
    """The drafter and length policies of a configuration. No selector: ``auto`` over several
    drafters, the one drafter itself (static) otherwise. A selector that decides the length
    too (``auto``) supplies its paired length policy when no length policy is given."""
    from ..length import build_length

    if selector is None and n_drafters > 1:
        selector = DEFAULT_SELECTOR
    sel = build_selector(selector)
    paired = sel.paired_length() if length is None else None
    return sel, (paired if paired is not None else build_length(length, k))


def parse_number(text: str) -> int | float | str:
    """'3' -> 3, '0.5' -> 0.5, anything else stays a string."""
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return text


__all__ = ["AutoLength", "AutoSelector", "DEFAULT_SELECTOR", "DrafterPolicy", "StaticPolicy", "SELECTORS", "build_policies",
           "build_selector", "parse_number"]
