"""An n-gram index over a token sequence that can be extended and rolled back.

Maps each n-gram to the positions of the token that *follows* it, in increasing order, so
the most recent occurrence is the last element. Only n-grams whose continuation is known
are indexed; a proposal is therefore a pure function of the indexed prefix, which keeps
live drafting and teacher-forced scoring (and trace replay) consistent.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


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
        self.clear()

    def __len__(self) -> int:
        return len(self.tokens)

    def clear(self) -> None:
        self.tokens = []
        self.maps = {n: {} for n in self.sizes}
        self._levels = [(n, self.maps[n]) for n in self.sizes]  # (n, its map): the hot loops' view

    def append(self, token: int) -> None:
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
