"""Incremental detokenisation with OpenAI stop-string semantics.

The streamed deltas are always prefixes of the final text, so the chunks of a stream
concatenate to exactly the non-streamed text: incomplete UTF-8 is held back, and so is a tail
that could still turn into a stop string (which, as in OpenAI's API, is not returned).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


class TextAssembler:
    """Turns accepted-token chunks into text deltas; ``push`` per chunk, ``finish`` once."""

    def __init__(self, decode: Callable[[list[int]], str], stop: Sequence[str] = ()):
        self._decode = decode
        self._stop = tuple(stop)
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self.token_ids: list[int] = []
        self.text = ""  # text emitted so far
        self.stopped = False  # a stop string ended the text

    def push(self, chunk: Sequence[int]) -> str:
        """Add tokens; return the new text that is safe to show (possibly empty)."""
        if self.stopped:
            return ""
        self.token_ids.extend(chunk)
        return self._advance(final=False)

    def finish(self) -> str:
        """The rest of the text once generation has ended."""
        return "" if self.stopped else self._advance(final=True)

    def _advance(self, final: bool) -> str:
        full = self._decode(self.token_ids)
        cut = min((i for i in (full.find(s) for s in self._stop) if i >= 0), default=-1)
        if cut >= 0:
            full, final, self.stopped = full[:cut], True, True
        elif not final:
            if full.endswith("\ufffd"):
                return ""
            full = full[: len(full) - self._hold] if self._hold else full
        if not full.startswith(self.text) or len(full) <= len(self.text):
            return ""
        delta, self.text = full[len(self.text):], full
        return delta
