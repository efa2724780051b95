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
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..errors import AdaspecError
from .index import NgramIndex
from .indexed import CandidateKey, IndexedDrafter, frequent_candidates, level_candidates

log = logging.getLogger(__name__)

_SEP = -1  # separates documents in the datastore; never matches a real token


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
        self.index = NgramIndex([min_match])
        self.evicted_tokens = 0
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def add(self, tokens: Sequence[int]) -> None:
        toks = [int(t) for t in tokens]
        if len(toks) <= self.min_match:
            return
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


class SuffixDrafter(IndexedDrafter):
    name = family = "suffix"
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
        if not (1 <= min_match <= max_match):
            raise AdaspecError(f"suffix needs 1 <= min_match <= max_match, got {min_match}, {max_match}")
        self.min_match, self.max_match, self.max_candidates = min_match, max_match, max_candidates
        self.datastore = datastore
        if datastore is not None and datastore.min_match != min_match:
            raise AdaspecError("datastore min_match differs from the drafter's: rebuild it")
        self.learn = learn
        self.name = name or self.name
        # 1-grams too: a tree's last candidate level (``candidate_keys``), never the chain's
        super().__init__([min_match, 1])

    def _matches(self, source: list[int], hits: list[int], seq: list[int],
                 out: list[tuple[int, int]]) -> None:
        """Extend candidate matches backwards: (match length, continuation) of each recent hit,
        most recent first."""
        m0, mmax, ls = self.min_match, self.max_match, len(seq)
        for c in reversed(hits[-self.max_candidates:]):
            nxt = source[c]
            if nxt == _SEP:
                continue
            ln = m0
            while ln < mmax and ln < ls and c - ln - 1 >= 0 and source[c - ln - 1] == seq[ls - ln - 1]:
                ln += 1
            out.append((ln, nxt))

    def _found(self) -> list[tuple[int, int]]:
        """(match length, continuation) of every candidate match, context before datastore."""
        seq = self._index.tokens
        found: list[tuple[int, int]] = []
        if len(seq) < self.min_match:
            return found
        key = tuple(seq[-self.min_match:])
        self._matches(seq, self._index.continuations(key), seq, found)
        if self.datastore is not None:
            self._matches(self.datastore.index.tokens, self.datastore.index.continuations(key), seq, found)
        return found

    @staticmethod
    def _top(cands: list[int]) -> int:
        counts = Counter(cands)
        top = max(counts.values())
        return next(t for t in cands if counts[t] == top)  # cands are most-recent first

    def propose(self) -> int | None:
        """The most frequent continuation among the longest matches."""
        found = self._found()
        if not found:
            return None
        best = max(ln for ln, _ in found)
        self._match = best
        return self._top([t for ln, t in found if ln == best])

    def candidate_keys(self) -> list[tuple[int, CandidateKey]]:
        """SuffixDecoding-style candidates (Oliaro et al. 2024): each match length is a level
        (longest first), its continuations ranked by their frequency among its matches; below
        ``min_match``, the continuations of the last token's recent occurrences in the request
        (the 1-gram level, as prompt lookup's shortest n-gram), so a tree has candidates where
        the chain has no match (on the mixed suite 73% of suffix rounds had none); after a
        token the request has not seen, its most frequent tokens (``frequent_candidates``). The
        chain's proposal (``propose``) leads when there is one."""
        found = self._found()
        levels: list[tuple[int, list[int]]] = []
        first = None
        if found:
            lengths = sorted({ln for ln, _ in found}, reverse=True)
            levels = [(length, [t for ln, t in found if ln == length]) for length in lengths]
            self._match = lengths[0]
            first = self._top(levels[0][1])
        seq = self._index.tokens
        if self.min_match > 1 and seq:
            hits = self._index.continuations((seq[-1],))[-self.max_candidates:]
            levels.append((1, [seq[h] for h in reversed(hits)]))  # most recent first
        if not any(lv for _, lv in levels):  # a token the request has not seen: its most frequent
            return frequent_candidates(self._index)
        return level_candidates(self._top(levels[0][1]) if first is None else first, levels)

    def end_request(self, output_ids: Sequence[int]) -> None:
        if self.learn and self.datastore is not None:
            self.datastore.add(output_ids)

    def describe(self) -> str:
        ds = f", datastore={len(self.datastore)} tokens" if self.datastore is not None else ""
        return f"{self.name}(match={self.min_match}..{self.max_match}{ds})"


