"""Prompt lookup decoding (PLD): copy the continuation of an earlier n-gram match.

Saxena's prompt lookup / HF ``prompt_lookup_num_tokens``: match the last n tokens (n from
``max_ngram`` down to ``min_ngram``) against the prompt and the generated text and propose
the token that followed. We take the most recent match (locality helps in generation; HF
takes the earliest). Each drafted token is appended to the index, so proposals continue the
match and stay a pure function of the prefix.
"""

from __future__ import annotations

from ..errors import ConfigError
from .base import DrafterCaps
from .indexed import CandidateKey, IndexedDrafter, frequent_candidates, level_candidates

#: most recent matches per n-gram size read for a tree's candidates
MAX_TREE_HITS = 64


def check_ngrams(min_ngram: int, max_ngram: int) -> None:
    """The n-gram sizes of prompt lookup: 1 <= min_ngram <= max_ngram."""
    if not (1 <= min_ngram <= max_ngram):
        raise ConfigError(f"prompt-lookup needs 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")


class PromptLookupDrafter(IndexedDrafter):
    name = "prompt-lookup"
    caps = DrafterCaps(family="prompt-lookup")
    #: tree candidates' acceptance per (n-gram size bucket, share bucket, late) before any data
    #: (``CandidateCalibration``): measured on the mixed suite (SmolLM2, 2 prompts per
    #: category, 128 tokens, buckets with >= 20 trials)
    CALIBRATION_PRIOR = {
        (1, 0, 0): 0.11, (1, 0, 1): 0.03, (1, 1, 0): 0.10, (1, 1, 1): 0.05, (1, 2, 0): 0.20,
        (1, 2, 1): 0.04, (1, 3, 0): 0.38, (2, 0, 1): 0.10, (2, 1, 0): 0.21, (2, 1, 1): 0.12,
        (2, 2, 0): 0.24, (2, 2, 1): 0.07, (2, 3, 0): 0.58, (3, 1, 0): 0.36, (3, 2, 0): 0.27,
        (3, 3, 0): 0.85,
        (0, 0, 0): 0.025,  # the frequency level (``frequent_candidates``), as suffix's
    }
    CALIBRATION_DEFAULT = 0.05

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, name: str | None = None):
        check_ngrams(min_ngram, max_ngram)
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.name = name or self.name
        super().__init__(range(min_ngram, max_ngram + 1))

    def propose(self) -> int | None:
        """Next-token proposal for the indexed prefix, or None without a match."""
        toks = self._index.tokens
        for n in self.sizes:
            if len(toks) < n:
                continue
            hits = self._index.continuations(tuple(toks[-n:]))
            if hits:
                self._match = n
                return toks[hits[-1]]
        return None

    def candidate_keys(self, limit: int | None = None) -> list[tuple[int, CandidateKey]]:
        """The continuations of several distinct matches: every n-gram size with matches is a
        level (longest first), its tokens ranked by their share of its recent matches; the
        chain's proposal (the most recent match of the longest n-gram) leads. Without any
        match (a token the request has not seen), its most frequent tokens
        (``frequent_candidates``, with 1-grams in the index)."""
        first = self.propose()
        if first is None:  # (1-grams: its own sizes', not those of an index it shares)
            return frequent_candidates(self._index, limit) if 1 in self.sizes else []
        toks = self._index.tokens
        levels = [(n, [toks[h] for h in reversed(self._index.continuations(tuple(toks[-n:]))[-MAX_TREE_HITS:])])
                  for n in self.sizes if len(toks) >= n]
        return level_candidates(first, levels, limit)

    def describe(self) -> str:
        return f"{self.name}(ngram={self.min_ngram}..{self.max_ngram})"
