"""Non-learning drafter baselines: uniform random and round-robin.

(The static baseline is ``StaticPolicy`` in ``base.py``; "no speculation" is the drafter named
``none``, which any policy can use as one of its arms.)
"""

from __future__ import annotations

from ..errors import ConfigError
from ..feedback import RoundFeedback
from .base import DrafterPolicy, SelectorCaps


def _need_arms(policy: DrafterPolicy) -> int:
    if policy.n_arms <= 0:
        raise ConfigError(f"selector {policy.name!r} has no drafters: call begin_request(names) "
                          "with at least one drafter name first")
    return policy.n_arms


class UniformRandomPolicy(DrafterPolicy):
    """A drafter drawn uniformly at random every round (the no-learning lower reference;
    BanditSpec's stopping-time regret eq. (1) of this policy grows linearly)."""

    name = "random"
    caps = SelectorCaps(shares_interleaved=True)

    def select(self) -> int:
        return int(self.rng.integers(_need_arms(self)))


class RoundRobinPolicy(DrafterPolicy):
    """Drafters in turn, 0, 1, ..., K-1, 0, ... (BanditSpec Alg. 8 lines 4-5 forever: pure
    exploration). With ``scope="global"`` the cycle continues across requests."""

    name = "round-robin"
    caps = SelectorCaps(shares_interleaved=True)

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.t = 0

    def reset(self) -> None:
        self.t = 0

    def select(self) -> int:
        k = _need_arms(self)
        return self.t % k

    def update(self, feedback: RoundFeedback) -> None:
        self.t += 1
