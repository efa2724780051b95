"""Token recycling: the target's own next-token predictions, kept from earlier verify steps.

Every verify forward computes the target's distribution at each position it verifies, and all
but the emitted token's are thrown away. Token Recycling (Luo et al. 2024, "Turning Trash into
Treasure: Accelerating Inference of Large Language Models with Token Recycling", Sec. 3.1)
keeps, for every token, the target's top-k next tokens the last time that token was a verify
input (an adjacency table over the vocabulary, kept across requests), and drafts from it: after
token x, the table's first token for x, then the first for that, and so on; a tree takes the
top-k at each node (their Sec. 3.2, with calibrated node scores here instead of a static tree).

It proposes where the n-gram drafters have nothing: after a token the request has not seen,
where prompt lookup and suffix matching have no match (40% of suffix's rounds on the mixed
suite). Model-free and deterministic (the table only changes after a round, from that round's
verified positions), so looks, trees and exactness work as for prompt lookup; the engine feeds
it the target's logits after each verify (``observe_target``). By default it keeps the top token
only (``top=1``): an argmax costs ~3 us a row, a top-4 ~50 us (2% of a llama.cpp step of
SmolLM2), and a chain reads only the first; ``top`` > 1 gives its trees that many branches.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..errors import ConfigError
from ..sampling import row_argmax
from .base import DrafterCaps
from .indexed import CandidateKey, IndexedDrafter

#: calibration buckets of recycled candidates: (RECYCLED, rank in the table's row, 0); a match
#: bucket no n-gram level uses
RECYCLED = -1


def check_top(top: int) -> None:
    """The recycled candidates per token: 1 <= top <= 16."""
    if isinstance(top, bool) or not isinstance(top, int) or not 1 <= top <= 16:
        raise ConfigError(f"recycle needs 1 <= top <= 16, got {top!r}: e.g. recycle:top=4")


class RecycleDrafter(IndexedDrafter):
    """Drafts from the target's top ``top`` next tokens after each token, recorded from earlier
    verify steps (module docstring). The table is shared by ``fork``'s twins and kept across
    requests; before a token has been a verify input the drafter has nothing after it."""

    name = "recycle"
    #: the engines feed the table (``Drafter.observe_target``: ``observes_target`` by implementing it)
    caps = DrafterCaps(family="recycle")
    #: a candidate's acceptance by its rank in the table's row before any data (measured on the
    #: mixed suite's greedy paths, SmolLM2: the target's next token 42%, 7%, 5%, 3% of the time)
    CALIBRATION_PRIOR = {(RECYCLED, 0, 0): 0.40, (RECYCLED, 1, 0): 0.07, (RECYCLED, 2, 0): 0.05,
                         (RECYCLED, 3, 0): 0.03}
    CALIBRATION_DEFAULT = 0.02

    def __init__(self, top: int = 1, name: str | None = None):
        check_top(top)
        self.top = top
        self.name = name or self.name
        #: token -> the target's top next tokens the last time it was a verify input
        self.table: dict[int, list[int]] = {}
        super().__init__([1])

    def observe_target(self, inputs: Sequence[int], logits: torch.Tensor) -> None:
        """A verify step's input tokens and the target's logits rows at them (row i: the
        distribution of the token after ``inputs[i]``, rows past a rejected token included:
        they are the target's predictions after that token, as Token Recycling keeps them)."""
        n = min(len(inputs), logits.shape[0])
        if n <= 0:
            return
        table = self.table
        if self.top == 1:
            for x, t in zip(inputs, row_argmax(logits[:n])):
                table[x] = [t]
            return
        rows = torch.topk(logits[:n], min(self.top, logits.shape[-1]), dim=-1).indices.tolist()
        for x, row in zip(inputs, rows):
            table[x] = row

    def propose(self) -> int | None:
        toks = self._index.tokens
        row = self.table.get(toks[-1]) if toks else None
        if not row:
            return None
        self._match = 0
        return row[0]

    def candidate_keys(self, limit: int | None = None) -> list[tuple[int, CandidateKey]]:
        """The row of the last token, best first, each bucketed by its rank."""
        toks = self._index.tokens
        row = self.table.get(toks[-1]) if toks else None
        if not row:
            return []
        return [(t, (RECYCLED, r, 0)) for r, t in enumerate(row[:limit])]

    def describe(self) -> str:
        return f"{self.name}(top={self.top}, {len(self.table)} tokens seen)"
