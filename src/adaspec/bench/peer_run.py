"""What one greedy ``generate`` call of a benchmark peer returns (Hugging Face's loop,
``bench.peers``; llama.cpp's, ``bench.llamacpp_peer``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class PeerRun:
    """One greedy ``generate`` call of a peer."""

    token_ids: list[int]  # new tokens only (the EOS included when emitted, as in adaspec)
    seconds: float  # wall time of generate
    target_forwards: int  # every target forward, the prompt's included
    rounds: int  # target forwards that emit tokens (all of them in HF): MAT = new tokens / rounds
    prefill_tokens: int  # width of the first target forward: the prompt (+ first drafts)
    drafted: int  # draft tokens the target verified (0 for hf-greedy)
    assistant_forwards: int | None = None  # forwards of the assistant model (hf-assisted only)
    verify_widths: dict[int, int] = field(default_factory=dict)  # width -> count, forwards after the first
    error: str | None = None  # the peer failed on this prompt (llama.cpp peers): what it raised

    @property
    def new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def accepted(self) -> int:
        """Accepted drafts: every round emits its accepted drafts plus one target token."""
        return self.new_tokens - self.rounds

    @property
    def mat(self) -> float:
        return self.new_tokens / self.rounds if self.rounds else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"token_ids": self.token_ids, "new_tokens": self.new_tokens, "seconds": self.seconds,
                "tokens_per_s": self.tokens_per_s, "target_forwards": self.target_forwards,
                "rounds": self.rounds, "mat": self.mat, "prefill_tokens": self.prefill_tokens,
                "drafted": self.drafted, "accepted": self.accepted,
                "assistant_forwards": self.assistant_forwards, "verify_widths": self.verify_widths,
                "error": self.error}
