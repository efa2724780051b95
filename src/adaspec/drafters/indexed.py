"""Shared machinery of model-free drafters that read an n-gram index of the text."""

from __future__ import annotations

import copy
from abc import abstractmethod
from collections.abc import Sequence

from ..config import SamplingConfig
from .base import Draft, Drafter, Peek, Proposals, StepDecider, apply_decisions
from .index import NgramIndex


class IndexedDrafter(Drafter):
    """A deterministic drafter whose proposal is a pure function of the indexed prefix.

    Drafted tokens are appended to the index (so a match continues) and rolled back at the
    next ``catch_up`` if they were rejected. ``q`` is one-hot, so it is reported as None.
    """

    def __init__(self, sizes: Sequence[int]):
        self._index = NgramIndex(sizes)
        self._trusted = 0
        self._match = 0  # match length behind the last proposal (set by ``propose``)

    @abstractmethod
    def propose(self) -> int | None:
        """Next-token proposal after the indexed tokens, or None if there is none."""

    def begin_request(self, prompt_ids: Sequence[int]) -> None:
        self._index.clear()
        self._trusted = 0

    def fork(self) -> IndexedDrafter:
        twin = copy.copy(self)  # settings and datastore shared, index of its own
        twin._index = NgramIndex(self._index.sizes)
        twin._trusted = 0
        return twin

    def catch_up(self, context: Sequence[int]) -> None:
        self._trusted = self._index.sync(context, self._trusted)

    def draft(self, context, max_tokens, sampling, generator, decide: StepDecider,
              want_hidden: bool = False) -> Draft:
        return Draft(tokens=apply_decisions(self.peek(context, max_tokens).tokens, decide))

    def peek(self, context: Sequence[int], max_tokens: int) -> Peek:
        """Proposed tokens are appended to the index (a match continues through them); the next
        ``catch_up`` rolls back the ones the target rejected."""
        self.catch_up(context)
        tokens: list[int] = []
        match = 0
        for _ in range(max_tokens):
            tok = self.propose()
            if tok is None:
                break
            if not tokens:
                match = self._match
            tokens.append(tok)
            self._index.append(tok)
        return Peek(tokens, match)

    def score(self, context, verified, sampling: SamplingConfig) -> Proposals:
        self.catch_up(context)
        out: list[int] = []
        for tok in verified:
            p = self.propose()
            out.append(-1 if p is None else p)
            self._index.append(tok)
        self._trusted = len(self._index)
        return Proposals(tokens=out)
