"""Shared machinery of model-free drafters that read an n-gram index of the text."""

from __future__ import annotations

import copy
import functools
import heapq
import itertools
from abc import abstractmethod
from bisect import bisect_right
from collections import Counter
from collections.abc import Sequence

from ..config import SamplingConfig
from ..trees import DraftTree, PrefixCut, TreeBudget
from .base import Decision, Draft, Drafter, DraftStep, Peek, Proposals, StepDecider
from .index import NgramIndex

#: children considered per tree node
TREE_BRANCH = 4
#: match-length buckets (lower edges) of a candidate's level: SuffixDecoding scores a
#: continuation by its match length and frequency (Oliaro et al. 2024, Sec. 3); 0 is the
#: frequency level (``frequent_candidates``), candidates without any match
CALIBRATION_MATCH = (0, 1, 2, 3, 5, 8, 16)
#: share of its level's matches (lower edges): a continuation's frequency score
CALIBRATION_SHARE = (0.0, 0.2, 0.5, 1.0)
#: trials the prior of a bucket is worth (Beta prior, as ``auto`` v2's estimates)
CALIBRATION_WEIGHT = 8.0

#: a candidate's calibration bucket: (match-length bucket of the level it first appears at,
#: share bucket of its frequency there, 1 if a longer level had matches without it, else 0)
CandidateKey = tuple[int, int, int]


def _bucket(edges: Sequence[float], x: float) -> int:
    return max(bisect_right(edges, x) - 1, 0)


@functools.lru_cache(maxsize=8192)
def candidate_key(match: int, count: int, total: int, late: bool) -> CandidateKey:
    """The calibration bucket of a continuation seen ``count`` times among the ``total``
    matches of length ``match`` (``late``: a longer match level did not contain it).
    Memoised: a tree asks for a few buckets at every node."""
    return (CALIBRATION_MATCH[_bucket(CALIBRATION_MATCH, match)],
            _bucket(CALIBRATION_SHARE, count / total), int(late))


def level_candidates(first: int, levels: Sequence[tuple[int, Sequence[int]]], limit: int | None = None
                     ) -> list[tuple[int, CandidateKey]]:
    """Distinct next-token candidates from the continuations of matches, one level per match
    length, most specific first (SuffixDecoding-style: Oliaro et al. 2024): a token's bucket
    is its match length and its share of that level's matches at the first level it appears
    at. ``first`` (the chain's proposal) leads, the others follow in level order, most frequent
    first (ties: the order of the level, i.e. most recent first). ``limit``: the first that
    many only (a tree node's branching), whose buckets alone are computed (bucketing every
    distinct continuation was half of a 15-node tree's time), and levels are read only until
    they are known."""
    seen: dict[int, tuple[int, int, int, bool]] = {}  # token -> (match, count, total, late)
    ranked: list[int] = []  # tokens but `first`, in rank order: (level, -count, first position)
    late = False
    for match, level in levels:
        if not level:
            continue
        total = len(level)
        # most_common: by count, ties in first-occurrence order (a Counter keeps insertion order
        # and its sort is stable), i.e. most recent first
        for tok, c in ((level[0], 1),) if total == 1 else Counter(level).most_common():
            if tok not in seen:
                seen[tok] = (match, c, total, late)
                if tok != first:
                    ranked.append(tok)
        late = True
        # the later levels rank below: done once `limit` tokens but `first`, and `first`'s own
        # bucket, are known (on a match the 1-gram level's 64 tokens are skipped)
        if limit is not None and len(ranked) >= limit and first in seen:
            break
    out = ([first] + ranked)[:limit] if first in seen else ranked[:limit]
    return [(t, candidate_key(*seen[t])) for t in out]


def frequent_candidates(index: NgramIndex, n: int | None = None) -> list[tuple[int, CandidateKey]]:
    """The ``n`` tokens that occur most often in the indexed text (ties: the most recent
    first), bucket (0, 0, 0): a tree's candidates where no match has any, i.e. after a token
    the request has not seen before. On the mixed suite (SmolLM2, greedy) 40% of suffix tree
    rounds began there, and the next token was among the 4 most frequent 10% of the time (8:
    20%); a node costs little on a flat verify curve and the budget prices it by its
    calibrated score. Needs the index's 1-grams."""
    return [(tok, (0, 0, 0)) for tok in index.frequent(TREE_BRANCH if n is None else n)]


class CandidateCalibration:
    """Calibrated acceptance estimates of a model-free drafter's tree candidates.

    A candidate's probability of being the target's next token (given that its node's path
    was accepted) is estimated per bucket (``candidate_key``) as a Beta mean,
    (hits + w p0) / (trials + w), with the prior p0 (``prior``, measured offline; unknown
    buckets: ``default``) worth w = ``CALIBRATION_WEIGHT`` trials, updated online from what the
    target emitted after every expanded node of the drafter's trees (``IndexedDrafter`` settles
    them at the next ``catch_up``; candidates the node budget cut are settled too, since the
    emitted tokens show whether they would have matched). Only past tokens enter, so trees
    stay a function of the context and the drafter's history, never of the round's draw (the
    one-hot exactness argument of ``adaspec.trees``). Under sampling an emitted token is a draw
    from the target's p, so a hit is an unbiased sample of p(candidate). The counts are kept
    across requests (like ``auto``'s global estimates) and shared by ``fork``'s twins; each
    drafter's ``RequestCalibration`` puts the current request's evidence on top.
    These estimates are the node scores the engine's node budget (``trees.nodes_worth_verifying``)
    prices, so they should be probabilities, not frequency shares (EAGLE-2, Li et al. 2024,
    Sec. 3: a draft score is only useful for pruning when it tracks the acceptance rate).
    """

    def __init__(self, prior: dict[CandidateKey, float], default: float = 0.1,
                 weight: float = CALIBRATION_WEIGHT):
        self.prior, self.default, self.weight = dict(prior), float(default), float(weight)
        self.hits: dict[CandidateKey, float] = {}
        self.trials: dict[CandidateKey, float] = {}

    def estimate(self, key: CandidateKey) -> float:
        w = self.weight
        return ((self.hits.get(key, 0.0) + w * self.prior.get(key, self.default))
                / (self.trials.get(key, 0.0) + w))

    def observe(self, key: CandidateKey, hit: bool) -> None:
        self.hits[key] = self.hits.get(key, 0.0) + float(hit)
        self.trials[key] = self.trials.get(key, 0.0) + 1.0


class RequestCalibration:
    """This request's evidence on top of the shared estimates (``CandidateCalibration``): a
    bucket's probability is (request hits + w p) / (request trials + w), p the shared estimate,
    w = ``CALIBRATION_WEIGHT`` (as ``auto``'s request level over its global one). A bucket's
    acceptance depends on the text: on the held-out suite the 1-gram candidates of a question
    answering prompt hit less often than the suite's average, those of a summary more often,
    and the node budget verifies a tree only where its expected tokens pay. Observations also
    go to the shared counts; the request's are cleared at ``begin_request`` and are the
    drafter's own (a ``fork`` twin gets its own)."""

    def __init__(self, shared: CandidateCalibration, weight: float = CALIBRATION_WEIGHT):
        self.shared, self.weight = shared, float(weight)
        self.hits: dict[CandidateKey, float] = {}
        self.trials: dict[CandidateKey, float] = {}

    def clear(self) -> None:
        self.hits, self.trials = {}, {}

    def estimate(self, key: CandidateKey) -> float:
        p = self.shared.estimate(key)
        t = self.trials.get(key)
        return p if t is None else (self.hits[key] + self.weight * p) / (t + self.weight)

    def observe(self, key: CandidateKey, hit: bool) -> None:
        self.hits[key] = self.hits.get(key, 0.0) + float(hit)
        self.trials[key] = self.trials.get(key, 0.0) + 1.0
        self.shared.observe(key, hit)


class IndexedDrafter(Drafter):
    """A deterministic drafter whose proposal is a pure function of the indexed prefix.

    Drafted tokens are appended to the index (so a match continues) and rolled back at the
    next ``catch_up`` if they were rejected. ``q`` is one-hot, so it is reported as None.
    """

    #: prior of the tree candidates' calibration per bucket (``CandidateCalibration``)
    CALIBRATION_PRIOR: dict[CandidateKey, float] = {}
    #: its prior for a bucket not in the table
    CALIBRATION_DEFAULT = 0.1

    def __init__(self, sizes: Sequence[int]):
        self._index = NgramIndex(sizes)
        #: the n-gram sizes this drafter reads (its index may hold more: ``share_index``)
        self.sizes = self._index.sizes
        self._trusted = 0
        self._match = 0  # match length behind the last proposal (set by ``propose``)
        self.calibration = CandidateCalibration(self.CALIBRATION_PRIOR, self.CALIBRATION_DEFAULT)
        self.request_calibration = RequestCalibration(self.calibration)
        #: the last tree's context length and candidates per expanded path, settled at catch_up
        self._offered: tuple[int, dict[tuple[int, ...], list[tuple[int, CandidateKey]]]] | None = None

    @abstractmethod
    def propose(self) -> int | None:
        """Next-token proposal after the indexed tokens, or None if there is none."""

    def candidate_keys(self, limit: int | None = None) -> list[tuple[int, CandidateKey]]:
        """Distinct next-token candidates after the indexed tokens with their calibration
        buckets (``candidate_key``), ``propose()``'s token first when it has one (default: that
        token alone); ``limit``: at most that many."""
        tok = self.propose()
        return [] if tok is None else [(tok, candidate_key(max(self._match, 1), 1, 1, False))]

    def draft_tree(self, context: Sequence[int], max_depth: int, max_nodes: int,
                   sampling: SamplingConfig | None = None, level_gain: float = 0.0,
                   budget: TreeBudget | None = None, cut: PrefixCut | None = None) -> DraftTree:
        """A best-first tree of up to ``max_nodes`` nodes, ``max_depth`` deep: a node's score is
        its parent's times its candidate probability (the estimated probability that its path
        is accepted), the highest-scoring open candidate is added next, so nodes come in
        best-first order (ties: the chain's proposals first). One candidate at every node gives
        ``peek``'s chain exactly. Candidate probabilities are calibrated
        (``CandidateCalibration``): every expanded node's candidates are kept and settled
        against the emitted tokens at the next ``catch_up``. Its levels cost lookups, not
        forwards: ``level_gain`` and ``budget`` do not apply (the engine cuts the tree). Every
        node goes to ``cut`` (``trees.PrefixCut``); once some node has offered two or more
        candidates, the tree stops growing at the first node ``cut`` refuses (no later node
        could be verified: each scores at most as much). A chain is never cut there."""
        self.catch_up(context)
        index = self._index
        base = len(index)
        tokens: list[int] = []
        parents: list[int] = []
        scores: list[float] = []
        heap: list[tuple[float, int, int, int, tuple[int, ...]]] = []
        order = itertools.count()
        offered: dict[tuple[int, ...], list[tuple[int, CandidateKey]]] = {}
        est = self.request_calibration.estimate
        branched = False  # some node offered two or more candidates

        def expand(node: int, score: float, path: tuple[int, ...]) -> None:
            # the path is read as if indexed (a look: ``NgramIndex.look_append``), never added
            # to the index and rolled back
            nonlocal branched
            index.look_end(base)
            index.look_begin()
            for t in path:
                index.look_append(t)
            offered[path] = cands = self.candidate_keys(TREE_BRANCH)
            if len(cands) > 1:
                branched = True
            for tok, key in cands:
                heapq.heappush(heap, (-score * est(key), next(order), node, tok, path))

        try:
            expand(-1, 1.0, ())
            while heap and len(tokens) < max_nodes:
                neg, _, parent, tok, path = heapq.heappop(heap)
                if cut is not None:
                    if not branched:
                        cut.add(-neg)
                    elif not cut.offer(-neg):
                        break
                tokens.append(tok)
                parents.append(parent)
                scores.append(-neg)
                if len(path) + 1 < max_depth:
                    expand(len(tokens) - 1, -neg, (*path, tok))
        finally:
            index.look_end(base)
        self._offered = (base, offered)
        return DraftTree(tokens, parents, scores)

    def _settle(self, context: Sequence[int]) -> None:
        """Score the last tree's candidates against the tokens emitted after its context: at
        each expanded node on the emitted path, every candidate is a trial, the emitted token
        a hit."""
        assert self._offered is not None
        base, offered = self._offered
        if len(context) <= base:
            return
        self._offered = None
        path: tuple[int, ...] = ()
        for tok in context[base:]:
            cands = offered.get(path)
            if cands is None:
                break
            for cand, key in cands:
                self.request_calibration.observe(key, cand == tok)
            path = (*path, tok)

    def begin_request(self, prompt_ids: Sequence[int]) -> None:
        self._index.clear()
        self._trusted = 0
        self._offered = None
        self.request_calibration.clear()

    def share_index(self, index: NgramIndex) -> None:
        """Read and keep ``index`` (holding at least this drafter's sizes) as the request's
        index, shared with the other drafters of one engine (``share_indexes``)."""
        if not set(self.sizes) <= set(index.sizes):
            raise ValueError(f"{self.name}: an index of sizes {index.sizes} lacks {self.sizes}")
        self._index, self._trusted = index, 0

    def fork(self) -> IndexedDrafter:
        twin = copy.copy(self)  # settings, datastore and calibration shared, index of its own
        twin._index = NgramIndex(self.sizes)
        twin._trusted = 0
        twin._offered = None
        twin.request_calibration = RequestCalibration(self.calibration)
        return twin

    def catch_up(self, context: Sequence[int]) -> None:
        if self._offered is not None:
            self._settle(context)
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
        """The block ``draft`` would propose with no length policy: each token is read by the
        next proposal as if indexed (``NgramIndex.look_append``), and the index is left
        holding ``context`` (no entries to add and roll back: they were a third of a look)."""
        self.catch_up(context)
        index = self._index
        base = len(index)
        tokens: list[int] = []
        match = 0
        index.look_begin()
        try:
            for _ in range(max_tokens):
                tok = self.propose()
                if tok is None:
                    break
                if not tokens:
                    match = self._match
                tokens.append(tok)
                index.look_append(tok)
        finally:
            index.look_end(base)
        return Peek(tokens, match)

    def score(self, context, verified, sampling: SamplingConfig) -> Proposals:
        self.catch_up(context)
        out: list[int] = []
        for tok in verified:
            p = self.propose()
            out.append(-1 if p is None else p)
            self._index.append(tok)
        # trusted up to the context only: a drafter sharing the index (``share_indexes``) may
        # roll the verified tokens back to this context (and append others) before the next sync
        self._trusted = len(context)
        return Proposals(tokens=out)


def share_indexes(drafters: Sequence[Drafter]) -> None:
    """Give one engine's n-gram drafters one request index (the union of their sizes). Each
    drafter syncs the index to the context it is asked about (``NgramIndex.sync`` from its own
    trusted length, never past a context it was given), so after the first drafter of a round
    has brought it up to date the others compare a few tokens instead of indexing them again:
    on SmolLM2's mixed suite each catch-up was ~8 us a round for each drafter, after a forward
    has evicted the index from the caches. Valid while the contexts of a request only grow (as
    in the engines: tokens drafted or scored past a context are rolled back by the next sync,
    whichever drafter appended them). Drafters of different engines, or forks, keep their own."""
    group = [d for d in drafters if isinstance(d, IndexedDrafter)]
    if len(group) < 2:
        return
    shared = NgramIndex(sorted({n for d in group for n in d.sizes}))
    for d in group:
        d.share_index(shared)
