"""Suffix drafter: longest-suffix match over the request and an optional datastore.

In the spirit of SuffixDecoding and REST: find the earlier positions whose preceding tokens
match the longest suffix of the current text (at least ``min_match`` tokens, at most
``max_match``), in the request's own context and in a bounded datastore of earlier outputs
or a corpus; propose the most frequent next token among the longest matches (ties: most
recent, context before datastore). Deterministic, so q is one-hot.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from ..errors import AdaspecError
from .base import DrafterCaps
from .index import NgramIndex
from .indexed import CandidateKey, IndexedDrafter, frequent_candidates, level_candidates

log = logging.getLogger(__name__)

_SEP = -1  # separates documents in the datastore; never matches a real token
#: cached candidate lists a datastore keeps (``SuffixDatastore.recent``) before starting over
#: (each up to ``max_candidates`` hits: ~2 KB at 64, so ~16 MB at most)
RECENT_CACHE = 8192


class RecentHits:
    """A datastore key's most recent hits, for ``SuffixDrafter.propose``, each part computed
    when first asked for (most keys of a new text are asked once, and building every part for
    up to ``max_candidates`` hits took ~24 us, half the datastore drafter's look): ``longer``,
    the hits with a given token before the key (the only ones that can match longer than the
    key); ``nexts``, every continuation, most recent first, document ends dropped; ``counts``,
    ``first`` and ``top`` over them. Valid until the datastore changes."""

    __slots__ = ("source", "hits", "key_len", "_longer", "_nexts", "_counts", "_first", "_top")

    def __init__(self, source: list[int], hits: list[int], n: int, key_len: int):
        self.source, self.hits, self.key_len = source, hits[-n:], key_len
        self._longer: dict[int | tuple[int, int], list[tuple[int, int]]] = {}
        self._nexts: list[int] | None = None
        self._counts: Counter[int] | None = None
        self._first: dict[int, int] | None = None
        self._top: int | None = None

    def longer(self, before: int) -> list[tuple[int, int]]:
        """(position, continuation) of the hits whose key ``before`` precedes, most recent first."""
        got = self._longer.get(before)
        if got is None:
            src, k1 = self.source, self.key_len + 1
            got = self._longer[before] = [(c, src[c]) for c in reversed(self.hits)
                                          if c >= k1 and src[c - k1] == before and src[c] != _SEP]
        return got

    def longer2(self, before: int, before2: int) -> list[tuple[int, int]]:
        """``longer(before)``'s hits that ``before2`` precedes too (matching two tokens past the key)."""
        got = self._longer.get((before, before2))
        if got is None:
            src, k2 = self.source, self.key_len + 2
            got = self._longer[(before, before2)] = [
                (c, t) for c, t in self.longer(before) if c >= k2 and src[c - k2] == before2]
        return got

    @property
    def nexts(self) -> list[int]:
        if self._nexts is None:
            src = self.source
            self._nexts = [src[c] for c in reversed(self.hits) if src[c] != _SEP]
        return self._nexts

    @property
    def counts(self) -> Counter[int]:
        if self._counts is None:
            self._counts = Counter(self.nexts)
        return self._counts

    @property
    def first(self) -> dict[int, int]:
        if self._first is None:
            self._first = {}
            for j, t in enumerate(self.nexts):
                self._first.setdefault(t, j)
        return self._first

    @property
    def top(self) -> int | None:
        if self._top is None and self.nexts:
            self._top = SuffixDrafter._top(self.nexts)
        return self._top


class SuffixDatastore:
    """A bounded store of token sequences with an n-gram index, persisted as JSON lines.

    When the total size exceeds ``max_tokens`` the oldest documents are evicted (FIFO) and the
    eviction is counted in ``evicted_tokens`` and logged: nothing is dropped silently.
    """

    def __init__(self, min_match: int = 2, max_tokens: int = 1_000_000):
        if max_tokens < 1:
            raise AdaspecError(f"datastore max_tokens must be >= 1, got {max_tokens}")
        self.min_match = min_match
        self.max_tokens = max_tokens
        self.docs: list[list[int]] = []
        # 1-grams too: a tree's level below the request's own 1-gram level (``candidate_keys``);
        # on 1M tokens they add ~9% to the index's memory (213 against 196 MB) and ~40% to its build
        self.index = NgramIndex([min_match, 1])
        self.evicted_tokens = 0
        self._size = 0
        self._recent: dict[tuple[tuple[int, ...], int], RecentHits] = {}

    def __len__(self) -> int:
        return self._size

    def recent(self, key: tuple[int, ...], n: int) -> RecentHits:
        """The last ``n`` hits of ``key`` (a ``min_match``-gram), cached until ``add``."""
        r = self._recent.get((key, n))
        if r is None:
            if len(self._recent) >= RECENT_CACHE:
                self._recent.clear()
            r = self._recent[(key, n)] = RecentHits(self.index.tokens, self.index.continuations(key), n,
                                                    self.min_match)
        return r

    def add(self, tokens: Sequence[int]) -> None:
        toks = [int(t) for t in tokens]
        if len(toks) <= self.min_match:
            return
        self._recent.clear()
        if len(toks) > self.max_tokens:
            raise AdaspecError(
                f"a document of {len(toks)} tokens does not fit a datastore of max_tokens="
                f"{self.max_tokens}: raise max_tokens or split the document")
        self.docs.append(toks)
        self._size += len(toks)
        if self._size > self.max_tokens:
            self._evict()
        else:
            self.index.extend(toks)
            self.index.append(_SEP)

    def _evict(self) -> None:
        # evict oldest documents down to 75% of the bound (rebuilding the index is amortised),
        # never the document just added
        while len(self.docs) > 1 and self._size > 0.75 * self.max_tokens:
            doc = self.docs.pop(0)
            self._size -= len(doc)
            self.evicted_tokens += len(doc)
        log.info("suffix datastore full: evicted oldest documents (%d tokens so far)",
                 self.evicted_tokens)
        self.index.clear()
        for doc in self.docs:
            self.index.extend(doc)
            self.index.append(_SEP)

    def save(self, path: str | Path) -> None:
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(json.dumps({"adaspec_datastore": 1, "min_match": self.min_match,
                                 "max_tokens": self.max_tokens}) + "\n")
            fh.writelines(json.dumps(doc) + "\n" for doc in self.docs)

    @classmethod
    def load(cls, path: str | Path, max_tokens: int | None = None,
             min_match: int | None = None) -> SuffixDatastore:
        """Load a saved datastore (.jsonl of token-id lists; ``~`` is expanded)."""
        path = Path(path).expanduser()
        if not path.is_file():
            raise AdaspecError(f"datastore file not found: {path}")
        with open(path, encoding="utf-8") as fh:
            lines = [ln for ln in fh if ln.strip()]
        header: dict[str, Any] = {}
        if lines and lines[0].lstrip().startswith("{"):
            header = json.loads(lines.pop(0))
        store = cls(min_match=min_match or header.get("min_match", 2),
                    max_tokens=max_tokens or header.get("max_tokens", 1_000_000))
        for i, ln in enumerate(lines, 2 if header else 1):
            doc = json.loads(ln)
            if not isinstance(doc, list) or not all(isinstance(t, int) for t in doc):
                raise AdaspecError(f"{path}:{i}: expected a JSON list of token ids")
            store.add(doc)
        return store

    @classmethod
    def from_text(cls, path: str | Path, tokenizer: Any, max_tokens: int = 1_000_000,
                  min_match: int = 2) -> SuffixDatastore:
        """Build from a plain-text corpus: one document per blank-line separated paragraph."""
        if tokenizer is None:
            raise AdaspecError("building a datastore from text needs the target's tokenizer")
        text = Path(path).expanduser().read_text(encoding="utf-8")
        store = cls(min_match=min_match, max_tokens=max_tokens)
        for para in text.split("\n\n"):
            if para.strip():
                store.add(tokenizer(para, add_special_tokens=False)["input_ids"])
        return store


def check_matches(min_match: int, max_match: int) -> None:
    """The match lengths of suffix matching: 1 <= min_match <= max_match."""
    if not (1 <= min_match <= max_match):
        raise AdaspecError(f"suffix needs 1 <= min_match <= max_match, got {min_match}, {max_match}")


class SuffixDrafter(IndexedDrafter):
    name = "suffix"
    caps = DrafterCaps(family="suffix")
    #: tree candidates' acceptance per (match-length bucket, share bucket, late) before any
    #: data (``CandidateCalibration``): measured on the mixed suite (SmolLM2, 2 prompts per
    #: category, 128 tokens, buckets with >= 20 trials; ``docs/drafters-and-policies.md``)
    CALIBRATION_PRIOR = {
        (1, 0, 0): 0.11, (1, 0, 1): 0.03, (1, 1, 0): 0.10, (1, 1, 1): 0.05, (1, 2, 0): 0.20,
        (1, 2, 1): 0.04, (1, 3, 0): 0.38, (2, 1, 0): 0.21, (2, 1, 1): 0.17, (2, 2, 0): 0.24,
        (2, 2, 1): 0.09, (2, 3, 0): 0.58, (2, 3, 1): 0.07, (3, 2, 0): 0.23, (3, 3, 0): 0.70,
        (3, 3, 1): 0.06, (5, 3, 0): 0.75, (8, 3, 0): 0.88, (16, 3, 0): 0.97,
        (0, 0, 0): 0.025,  # the frequency level: 10% of next tokens among the 4 most frequent
    }
    CALIBRATION_DEFAULT = 0.05

    def __init__(self, min_match: int = 2, max_match: int = 24, max_candidates: int = 64,
                 datastore: SuffixDatastore | None = None, learn: bool = False,
                 name: str | None = None):
        check_matches(min_match, max_match)
        self.min_match, self.max_match, self.max_candidates = min_match, max_match, max_candidates
        self.datastore = datastore
        if datastore is not None and datastore.min_match != min_match:
            raise AdaspecError("datastore min_match differs from the drafter's: rebuild it")
        self.learn = learn
        self.name = name or self.name
        # 1-grams too: a tree's last candidate level (``candidate_keys``), never the chain's
        super().__init__([min_match, 1])

    def _lengths(self, source: list[int], hits: list[int], seq: list[int]) -> Iterator[tuple[int, int]]:
        """(match length, continuation) of each recent hit of the context's last ``min_match``
        tokens in ``source``, extended backwards, most recent first. (Most hits stop at
        ``min_match``: one comparison decides them.)"""
        m0, ls = self.min_match, len(seq)
        top = min(self.max_match, ls)  # longest match: the context's length at most
        recent = hits[-self.max_candidates:]
        before = seq[ls - m0 - 1] if top > m0 else None  # the context token just before the key
        for c in reversed(recent):
            nxt = source[c]
            if nxt == _SEP:
                continue
            i = c - m0 - 1
            if before is None or i < 0 or source[i] != before:
                yield m0, nxt
                continue
            yield self._extend(source, c, seq, m0 + 1, top), nxt

    @staticmethod
    def _extend(source: list[int], c: int, seq: list[int], ln: int, top: int) -> int:
        """The length of the match behind hit ``c`` (the continuation's position in
        ``source``), its last ``ln`` tokens known to match the context ``seq``: extended back
        while the two agree, ``top`` at most."""
        i, j = c - ln - 1, len(seq) - ln - 1
        while ln < top and i >= 0 and source[i] == seq[j]:
            ln, i, j = ln + 1, i - 1, j - 1
        return ln

    def _sources(self) -> list[tuple[list[int], list[int]]]:
        """(tokens, hits of the context's last ``min_match`` tokens): the context, then the
        datastore; none while the context is shorter than ``min_match``."""
        seq = self._index.tokens
        if len(seq) < self.min_match:
            return []
        key = tuple(seq[-self.min_match:])
        out = [(seq, self._index.continuations(key))]
        if self.datastore is not None:
            out.append((self.datastore.index.tokens, self.datastore.index.continuations(key)))
        return out

    def _found(self) -> list[tuple[int, int]]:
        """(match length, continuation) of every candidate match, context before datastore."""
        seq = self._index.tokens
        return [m for source, hits in self._sources() for m in self._lengths(source, hits, seq)]

    @staticmethod
    def _top(cands: list[int]) -> int:
        if len(cands) == 1:
            return cands[0]
        counts = Counter(cands)
        top = max(counts.values())
        return next(t for t in cands if counts[t] == top)  # cands are most-recent first

    def propose(self) -> int | None:
        """The most frequent continuation among the longest matches, ties to the first in
        ``_found``'s order (context first, most recent first). The same token as from
        ``_found``, without listing every match: the datastore's hits come from its cache
        (``SuffixDatastore.recent``), and only those with the context's token before the key
        are extended (a proposal is a hot path: one per looked-at token)."""
        seq = self._index.tokens
        m0, ls = self.min_match, len(seq)
        if ls < m0:
            return None
        key = tuple(seq[-m0:])
        best, group = 0, []
        for ln, nxt in self._lengths(seq, self._index.continuations(key), seq):
            if ln == best:
                group.append(nxt)
            elif ln > best:
                best, group = ln, [nxt]
        if self.datastore is not None:
            r = self.datastore.recent(key, self.max_candidates)
            source, top = self.datastore.index.tokens, min(self.max_match, ls)
            # (length, continuation) of the hits that match past the key: those matching one token
            # more are m0 + 1 long unless some match two more, and only those are extended
            longer: list[tuple[int, int]] = []
            if top > m0:
                one = r.longer(seq[ls - m0 - 1])
                two = r.longer2(seq[ls - m0 - 1], seq[ls - m0 - 2]) if one and top > m0 + 1 else []
                longer = ([(self._extend(source, c, seq, m0 + 2, top), t) for c, t in two] if two
                          else [(m0 + 1, t) for _, t in one])
            ds_best = max(ln for ln, _ in longer) if longer else m0 if r.nexts else 0
            if ds_best > best:
                best, group = ds_best, []
            if ds_best == best > m0:
                group += [t for ln, t in longer if ln == best]
            elif ds_best == best == m0:  # every datastore hit is in the group
                self._match = best
                return self._top_with(group, r)
        if not group:
            return None
        self._match = best
        return self._top(group)

    @staticmethod
    def _top_with(group: list[int], r: RecentHits) -> int:
        """``_top`` of ``group + r.nexts`` from ``r``'s counts."""
        if not group:
            return r.top  # type: ignore[return-value]
        counts = Counter(group)
        for t, c in r.counts.items():
            counts[t] += c
        top = max(counts.values())
        for t in group:
            if counts[t] == top:
                return t
        return min((t for t, c in counts.items() if c == top), key=r.first.__getitem__)

    def candidate_keys(self, limit: int | None = None) -> list[tuple[int, CandidateKey]]:
        """SuffixDecoding-style candidates (Oliaro et al. 2024): each match length is a level
        (longest first), its continuations ranked by their frequency among its matches; below
        ``min_match``, the continuations of the last token's recent occurrences in the request
        (the 1-gram level, as prompt lookup's shortest n-gram), so a tree has candidates where
        the chain has no match (on the mixed suite 73% of suffix rounds had none), then in the
        datastore (its 1-gram level: after a token the request has not seen, the next token was
        among the generalist datastore's 4 most frequent continuations 24% of the time against
        11% for the request's most frequent tokens); after a token neither has seen, the
        request's most frequent tokens (``frequent_candidates``). The chain's proposal
        (``propose``) leads when there is one."""
        found = self._found()
        levels: list[tuple[int, list[int]]] = []
        first = None
        if found:
            lengths = sorted({ln for ln, _ in found}, reverse=True)
            levels = [(length, [t for ln, t in found if ln == length]) for length in lengths]
            self._match = lengths[0]
            first = self._top(levels[0][1])
        seq = self._index.tokens
        if seq:  # the 1-gram levels: the request's (below min_match), then the datastore's
            last = (seq[-1],)
            ones = [self._index] if self.min_match > 1 else []
            if self.datastore is not None:
                ones.append(self.datastore.index)
            for index in ones:
                src, hits = index.tokens, index.continuations(last)[-self.max_candidates:]
                levels.append((1, [src[h] for h in reversed(hits) if src[h] != _SEP]))  # most recent first
        levels = [lv for lv in levels if lv[1]]
        if not levels:  # a token neither the request nor the datastore has seen: its most frequent
            return frequent_candidates(self._index, limit)
        return level_candidates(self._top(levels[0][1]) if first is None else first, levels, limit)

    def end_request(self, output_ids: Sequence[int]) -> None:
        """With ``learn``, the answer joins the datastore for later requests (shared by every
        fork: ``adaspec serve``'s store across requests). An answer longer than the whole
        store keeps its last ``max_tokens`` tokens, logged: a request never fails for what its
        drafter learns."""
        if self.learn and self.datastore is not None:
            store = self.datastore
            if len(output_ids) > store.max_tokens:
                log.info("suffix datastore: an answer of %d tokens keeps its last %d (max_tokens)",
                         len(output_ids), store.max_tokens)
                output_ids = output_ids[-store.max_tokens:]
            store.add(output_ids)

    def describe(self) -> str:
        ds = f", datastore={len(self.datastore)} tokens" if self.datastore is not None else ""
        return f"{self.name}(match={self.min_match}..{self.max_match}{ds})"


