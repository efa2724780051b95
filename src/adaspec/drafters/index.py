"""An n-gram index over a token sequence that can be extended and rolled back.

Maps each n-gram to the positions of the token that *follows* it, in increasing order, so
the most recent occurrence is the last element. Only n-grams whose continuation is known
are indexed; a proposal is therefore a pure function of the indexed prefix, which keeps
live drafting and teacher-forced scoring (and trace replay) consistent.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence


def _by_frequency(item: tuple[tuple[int, ...], list[int]]) -> tuple[int, int]:
    """A 1-gram's rank in ``NgramIndex.frequent``: its occurrences, then its latest position."""
    return len(item[1]), item[1][-1]


class NgramIndex:
    def __init__(self, sizes: Iterable[int]):
        self.sizes = tuple(sorted(set(int(n) for n in sizes), reverse=True))
        if not self.sizes or self.sizes[-1] < 1:
            raise ValueError(f"n-gram sizes must be >= 1, got {self.sizes}")
        self.tokens: list[int] = []
        self.maps: dict[int, dict[tuple[int, ...], list[int]]] = {}
        #: while a drafter looks ahead (``IndexedDrafter.peek``): the look's tokens' entries,
        #: kept apart from ``maps`` (a small dict, dropped when the look ends: no rollback)
        self.look: dict[tuple[int, ...], list[int]] | None = None
        #: bumped by every change of the indexed tokens (not by a look): what caches key on
        self.version = 0
        #: (version, the most frequent 1-gram entries at it): ``frequent``'s cache
        self._frequent: tuple[int, list[tuple[tuple[int, ...], list[int]]]] | None = None
        self.clear()

    def __len__(self) -> int:
        return len(self.tokens)

    def clear(self) -> None:
        self.version += 1
        self.tokens = []
        self.maps = {n: {} for n in self.sizes}
        self._levels = [(n, self.maps[n]) for n in self.sizes]  # (n, its map): the hot loops' view

    def append(self, token: int) -> None:
        self.version += 1
        toks = self.tokens
        i = len(toks)
        for n, m in self._levels:
            if i >= n:
                key = tuple(toks[i - n:i])
                hits = m.get(key)
                if hits is None:
                    m[key] = [i]
                else:
                    hits.append(i)
        toks.append(token)

    def extend(self, tokens: Iterable[int]) -> None:
        for t in tokens:
            self.append(t)

    def truncate(self, length: int) -> None:
        """Roll back to the first ``length`` tokens."""
        toks = self.tokens
        if len(toks) > length:
            self.version += 1
        while len(toks) > length:
            toks.pop()
            i = len(toks)
            for n, m in self._levels:
                if i >= n:
                    key = tuple(toks[i - n:i])
                    hits = m[key]
                    hits.pop()
                    if not hits:
                        del m[key]

    def sync(self, context: Sequence[int], trusted: int) -> int:
        """Make the index hold exactly ``context``; ``tokens[:trusted]`` is known to match.

        Returns the new trusted length (= len(context)).
        """
        toks = self.tokens
        n = min(len(toks), len(context))
        i = min(trusted, n)
        while i < n and toks[i] == context[i]:
            i += 1
        if i < len(toks):
            self.truncate(i)
        if len(context) > i:
            self.extend(context[i:])
        return len(context)

    def continuations(self, key: tuple[int, ...]) -> list[int]:
        """Positions of the tokens that followed earlier occurrences of ``key`` (oldest first),
        a look's tokens included (``look_append``)."""
        hits = self.maps[len(key)].get(key, [])
        if self.look:
            extra = self.look.get(key)
            if extra:
                return hits + extra
        return hits

    def frequent(self, n: int) -> list[int]:
        """The ``n`` tokens that occur most often in the indexed text, a look's tokens included
        (ties: the most recent first). Needs 1-grams in the index (else []). A tree asks at
        every node after a token the request has not seen: the index's ranking is kept until
        the index changes, and a look's few 1-grams are merged into its head (the top n +
        |look| untouched by the look hold the top n)."""
        ones = self.maps.get(1)
        look = [(k, v) for k, v in self.look.items() if len(k) == 1] if self.look else []
        if ones is None or not (ones or look):
            return []
        need = min(n + len(look), len(ones))
        cached = self._frequent
        if cached is None or cached[0] != self.version or len(cached[1]) < need:
            cached = self._frequent = (self.version, heapq.nlargest(max(need, n + 16), ones.items(),
                                                                    key=_by_frequency))
        top = cached[1]
        if look:
            merged = dict(top)
            for key, extra in look:
                merged[key] = ones.get(key, []) + extra
            return [key[0] for key, _ in heapq.nlargest(n, merged.items(), key=_by_frequency)]
        return [key[0] for key, _ in top[:n]]

    def look_begin(self) -> None:
        """Start a look: ``look_append``'s tokens are read as if appended, until ``look_end``."""
        self.look = {}

    def look_append(self, token: int) -> None:
        """``append`` for a look: the token goes on ``tokens``, its entries into ``look``."""
        toks, look = self.tokens, self.look
        assert look is not None, "look_append outside a look (look_begin first)"
        i = len(toks)
        for n, _ in self._levels:
            if i >= n:
                look.setdefault(tuple(toks[i - n:i]), []).append(i)
        toks.append(token)

    def look_end(self, length: int) -> None:
        """End a look begun at ``length`` tokens: the index holds them again, as before it."""
        del self.tokens[length:]
        self.look = None
