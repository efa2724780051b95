"""Shared machinery of model-free drafters that read an n-gram index of the text."""

from __future__ import annotations

import copy
import heapq
import itertools
from abc import abstractmethod
from collections import Counter
from collections.abc import Sequence

from ..config import SamplingConfig
from ..trees import DraftTree
from .base import Decision, Draft, Drafter, DraftStep, Peek, Proposals, StepDecider
from .index import NgramIndex

#: weight of a continuation first seen at a shorter (less specific) match, per level
LEVEL_DISCOUNT = 0.25
#: children considered per tree node
TREE_BRANCH = 4


def level_mix(first: int, levels: Sequence[Sequence[int]],
              discount: float = LEVEL_DISCOUNT) -> list[tuple[int, float]]:
    """Next-token candidates with estimated probabilities from the continuations of matches,
    most specific match level first (SuffixDecoding-style frequency scoring): a token weighs
    its share of its first level's matches, times ``discount`` per level it is late;
    normalised; ``first`` (the chain's proposal) leads, the others follow by weight."""
    weights: dict[int, float] = {}
    for j, level in enumerate(levels):
        if not level:
            continue
        scale = discount ** j / len(level)
        for tok, c in Counter(level).items():
            if tok not in weights:
                weights[tok] = c * scale
    total = sum(weights.values()) or 1.0
    rest = sorted((t for t in weights if t != first), key=lambda t: -weights[t])
    return [(t, weights.get(t, 0.0) / total) for t in [first, *rest]]


class IndexedDrafter(Drafter):
    """A deterministic drafter whose proposal is a pure function of the indexed prefix.

    Drafted tokens are appended to the index (so a match continues) and rolled back at the
    next ``catch_up`` if they were rejected. ``q`` is one-hot, so it is reported as None.
    """

    def __init__(self, sizes: Sequence[int]):
        self._index = NgramIndex(sizes)
        self._trusted = 0
        self._match = 0  # match length behind the last proposal (set by ``propose``)

    supports_tree = True

    @abstractmethod
    def propose(self) -> int | None:
        """Next-token proposal after the indexed tokens, or None if there is none."""

    def candidates(self) -> list[tuple[int, float]]:
        """Distinct next-token candidates after the indexed tokens with estimated acceptance
        probabilities, ``propose()``'s token first (default: that token alone)."""
        tok = self.propose()
        return [] if tok is None else [(tok, 1.0)]

    def draft_tree(self, context: Sequence[int], max_depth: int, max_nodes: int,
                   sampling: SamplingConfig | None = None) -> DraftTree:
        """A best-first tree of up to ``max_nodes`` nodes, ``max_depth`` deep: a node's score is
        its parent's times its candidate probability (the estimated probability that its path
        is accepted), the highest-scoring open candidate is added next, so nodes come in
        best-first order (ties: the chain's proposals first). One candidate at every node gives
        ``peek``'s chain exactly."""
        self.catch_up(context)
        index = self._index
        base = len(index)
        tokens: list[int] = []
        parents: list[int] = []
        scores: list[float] = []
        heap: list[tuple[float, int, int, int, tuple[int, ...]]] = []
        order = itertools.count()

        def expand(node: int, score: float, path: tuple[int, ...]) -> None:
            index.truncate(base)
            index.extend(path)
            for tok, w in self.candidates()[:TREE_BRANCH]:
                heapq.heappush(heap, (-score * w, next(order), node, tok, path))

        expand(-1, 1.0, ())
        while heap and len(tokens) < max_nodes:
            neg, _, parent, tok, path = heapq.heappop(heap)
            tokens.append(tok)
            parents.append(parent)
            scores.append(-neg)
            if len(path) + 1 < max_depth:
                expand(len(tokens) - 1, -neg, (*path, tok))
        index.truncate(base)
        return DraftTree(tokens, parents, scores)

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
        """``peek``'s block cut by the length policy, proposed one token at a time: a policy
        that stops after k tokens costs k lookups, not ``max_tokens`` (the same tokens as
        ``apply_decisions`` over the whole peek, since a proposal never depends on later ones)."""
        self.catch_up(context)
        kept: list[int] = []
        for j in range(max_tokens):
            tok = self.propose()
            if tok is None:
                break
            verdict = decide(DraftStep(j, tok))
            if verdict is Decision.DISCARD:
                break
            kept.append(tok)
            self._index.append(tok)
            if verdict is Decision.STOP:
                break
        return Draft(tokens=kept)

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
