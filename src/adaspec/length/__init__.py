"""Draft-length policies: how many tokens to draft, decided token by token.

Every policy is one class with ``begin_round`` / ``decide`` / ``update`` and is registered in
``LENGTH_POLICIES`` under the name used by ``--length NAME[:key=value,...]``.
"""

from __future__ import annotations

from collections.abc import Callable

from ..errors import ConfigError, UnknownNameError
from .bandit import LengthUCB
from .base import LengthPolicy, StaticLength
from .cost_rule import CostModelRule
from .rules import AdaEDL, HFHeuristic, LogitMargin, MaxConfidence, SVIPDifference, SVIPEntropy
from .specdecpp import SpecDecPPPolicy
from .tapout import TapOut

def _auto(**params) -> LengthPolicy:
    """``--length auto`` (selection/auto.py; imported lazily: selection imports this package)."""
    from ..selection.auto import AutoLength

    return AutoLength(**params)


LENGTH_POLICIES: dict[str, Callable[..., LengthPolicy]] = {
    "static": StaticLength,
    "hf-heuristic": HFHeuristic,
    "max-confidence": MaxConfidence,
    "svip": SVIPEntropy,
    "svip-diff": SVIPDifference,
    "logit-margin": LogitMargin,
    "adaedl": AdaEDL,
    "cost-model": CostModelRule,
    "specdecpp": SpecDecPPPolicy,
    "tapout": TapOut,
    "ucbspec-length": LengthUCB,
    "auto": _auto,
}


def build_length(spec: str | int | LengthPolicy | None, k: int = 5) -> LengthPolicy:
    """Build a length policy from ``NAME[:key=value,...]``, an int K, or None (static K)."""
    if spec is None:
        return StaticLength(k)
    if isinstance(spec, LengthPolicy):
        return spec
    if isinstance(spec, int):
        return StaticLength(spec)
    from ..drafters import parse_params
    from ..selection import parse_number

    name, _, rest = spec.partition(":")
    cls = LENGTH_POLICIES.get(name.strip().lower())
    if cls is None:
        raise UnknownNameError(f"unknown length policy {name!r}: use one of {sorted(LENGTH_POLICIES)}")
    params = {key: parse_number(v) for key, v in parse_params(rest, f"length policy {spec!r}").items()}
    if cls is StaticLength and "k" not in params:
        params["k"] = k
    try:
        return cls(**params)
    except TypeError as exc:
        raise ConfigError(f"bad parameters for length policy {name!r}: {exc}") from None


__all__ = ["LengthPolicy", "StaticLength", "LENGTH_POLICIES", "build_length"]
