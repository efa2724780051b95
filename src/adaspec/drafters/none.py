"""The "no speculation" drafter: proposes nothing, so a round is one plain decoding step."""

from __future__ import annotations

from collections.abc import Sequence

from ..config import SamplingConfig
from .base import Draft, Drafter, DrafterCaps, Proposals


class NoDrafter(Drafter):
    name = "none"
    caps = DrafterCaps(family="none")

    def begin_request(self, prompt_ids: Sequence[int]) -> None:
        pass

    def catch_up(self, context: Sequence[int]) -> None:
        pass

    def draft(self, context, max_tokens, sampling, generator, decide, want_hidden=False) -> Draft:
        return Draft()

    def score(self, context, verified, sampling: SamplingConfig) -> Proposals:
        return Proposals(tokens=[-1] * len(verified))

    def fork(self) -> NoDrafter:
        return NoDrafter()
