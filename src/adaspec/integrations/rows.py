"""Which request sits in which batch row: a content-addressed mapping across engine steps.

A serving engine (vLLM) calls its proposer with one row per scheduled request and no request
id; between calls it drops finished rows, condenses the batch (moves the last rows into the
holes), adds new requests and may reorder rows. What it does pass is every row's full token
sequence (``token_ids[i, :num_tokens[i]]``: prompt plus every verified token) and the tokens
verified for the row in this step (``sampled[i]``: accepted drafts plus one bonus or
correction token; empty while a prompt is still being prefilled in chunks). A request that
had ``n`` tokens at the previous call has ``n + len(sampled[i])`` now and the same first
``n`` tokens, so:

    row i continues the stream whose stored context equals token_ids[i, :num_tokens[i] - len(sampled[i])]

Ties (several streams with that exact context, e.g. the same prompt sent twice) are broken
by the drafts: the accepted tokens must be a prefix of the stream's last drafts (a rejected
draft is never re-emitted), rows left with one such stream get it, then each row takes the
stream that sat in the same row, then the oldest. Streams with identical contexts hold
identical drafter state, so only the attribution of their last round can be at stake. A row
that continues no stream starts a new one. A stream absent for more than ``idle_steps`` calls
is evicted (finished, aborted, or preempted for long).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import numpy as np

from ..errors import ConfigError

S = TypeVar("S")


@dataclass(frozen=True)
class Verified:
    """What the engine did with a stream's drafts, read from the row's sampled tokens.

    ``accepted``: drafts accepted (``len(sampled) - 1``); ``verified``: drafts the engine
    scored (fewer than proposed when its scheduler cut them: then the bonus token equals the
    next draft, which a rejection never produces); ``consistent``: the accepted tokens are a
    prefix of the drafts (False means the mapping or the engine disagrees with the drafts).
    """

    accepted: int
    verified: int
    consistent: bool


def read_verification(drafts: Sequence[int], sampled: Sequence[int]) -> Verified:
    """How many of ``drafts`` the engine verified and accepted, given the tokens it emitted."""
    a, d = len(sampled) - 1, len(drafts)
    if a < 0 or a > d or list(sampled[:a]) != list(drafts[:a]):
        return Verified(max(a, 0), d, False)
    if a < d and sampled[a] == drafts[a]:  # a rejected draft is never re-emitted: the cut was here
        return Verified(a, a, True)
    return Verified(a, d, True)


@dataclass
class Stream(Generic[S]):
    """One request as seen through the rows: its context at the last call, the row it sat in,
    the drafts proposed for it then, and the owner's per-request state."""

    sid: int
    context: np.ndarray
    row: int
    payload: S
    drafts: list[int] = field(default_factory=list)
    idle: int = 0


@dataclass
class RowMatch(Generic[S]):
    """The stream a row continues (or starts) and what happened to its last drafts.

    ``stream`` is None for rows with no sampled tokens (partial prefill): no draft for them.
    ``outcome`` is None for a new stream.
    """

    row: int
    stream: Stream[S] | None
    sampled: list[int]
    new: bool = False
    outcome: Verified | None = None


class RowTracker(Generic[S]):
    """Maps batch rows to streams step after step (see the module docstring)."""

    def __init__(self, new_payload: Callable[[int, np.ndarray], S], idle_steps: int = 16):
        if not isinstance(idle_steps, int) or idle_steps < 1:
            raise ConfigError(f"idle_steps must be an integer >= 1, got {idle_steps!r}: pass e.g. 16")
        self.new_payload = new_payload
        self.idle_steps = idle_steps
        self.streams: dict[int, Stream[S]] = {}
        self._next_sid = 0

    def assign(self, sampled: Sequence[Sequence[int]], num_tokens: np.ndarray,
               token_ids: np.ndarray) -> tuple[list[RowMatch[S]], list[Stream[S]]]:
        """Match this call's rows to streams; returns one match per row and the evicted streams.

        Matched streams get the row's current context and row index; their ``drafts`` still
        hold the last call's proposals (the owner replaces them after drafting)."""
        n_rows = len(sampled)
        if len(num_tokens) < n_rows or token_ids.shape[0] < n_rows:
            raise ConfigError(f"{n_rows} rows of sampled tokens but only {len(num_tokens)} token "
                              f"counts and {token_ids.shape[0]} token rows: pass the batch's arrays")
        by_len: dict[int, list[Stream[S]]] = {}
        for st in self.streams.values():
            by_len.setdefault(len(st.context), []).append(st)
        live = [i for i in range(n_rows) if len(sampled[i]) > 0]
        # candidates of each row: streams with exactly the row's context before this step's
        # tokens, split by whether their drafts agree with the tokens the engine emitted
        agree: dict[int, list[Stream[S]]] = {}
        other: dict[int, list[Stream[S]]] = {}
        for i in live:
            n = int(num_tokens[i]) - len(sampled[i])
            for st in by_len.get(n, []):
                if (n == 0 or token_ids[i, n - 1] == st.context[-1]) and np.array_equal(token_ids[i, :n], st.context):
                    ok = read_verification(st.drafts, sampled[i]).consistent
                    (agree if ok else other).setdefault(i, []).append(st)
        found = _assign(live, agree)
        rest = [i for i in live if i not in found]
        found.update(_assign(rest, other, taken={st.sid for st in found.values()}))
        claimed = {st.sid for st in found.values()}

        matches: list[RowMatch[S]] = []
        for i in range(n_rows):
            s_i = [int(t) for t in sampled[i]]
            if not s_i:
                matches.append(RowMatch(i, None, s_i))
                continue
            ctx = np.array(token_ids[i, :int(num_tokens[i])], copy=True)
            st = found.get(i)
            if st is None:
                st = Stream(self._next_sid, ctx, i, self.new_payload(self._next_sid, ctx))
                self.streams[st.sid] = st
                claimed.add(st.sid)
                self._next_sid += 1
                matches.append(RowMatch(i, st, s_i, new=True))
                continue
            outcome = read_verification(st.drafts, s_i)
            st.context, st.row, st.idle = ctx, i, 0
            matches.append(RowMatch(i, st, s_i, outcome=outcome))

        evicted: list[Stream[S]] = []
        for sid in [sid for sid in self.streams if sid not in claimed]:
            st = self.streams[sid]
            st.idle += 1
            st.row = -1  # absent from this call: its old row index means nothing now
            if st.idle > self.idle_steps:
                evicted.append(self.streams.pop(sid))
        return matches, evicted


def _assign(rows: list[int], cands: dict[int, list[Stream[S]]],
            taken: set[int] | None = None) -> dict[int, Stream[S]]:
    """Give each row one of its candidate streams, each stream to one row: first the rows left
    with a single candidate (forced), then the stream that sat in the same row, then the oldest."""
    taken = set(taken or ())
    found: dict[int, Stream[S]] = {}
    rows_of: dict[int, int] = {}
    for i in rows:
        for st in cands.get(i, []):
            rows_of[st.sid] = rows_of.get(st.sid, 0) + 1
    for i in rows:  # the common case: one candidate, wanted by no other row
        opts = cands.get(i, [])
        if len(opts) == 1 and rows_of[opts[0].sid] == 1 and opts[0].sid not in taken:
            found[i] = opts[0]
            taken.add(opts[0].sid)
    rows = [i for i in rows if i not in found]

    def left(i: int) -> list[Stream[S]]:
        return [st for st in cands.get(i, []) if st.sid not in taken]

    pending = [i for i in rows if left(i)]
    while pending:
        forced = [i for i in pending if len(left(i)) == 1]
        i = forced[0] if forced else pending[0]
        opts = left(i)
        st = min(opts, key=lambda c: (c.row != i, c.sid))
        found[i] = st
        taken.add(st.sid)
        pending = [j for j in pending if j != i and left(j)]
    return found
