"""What a benchmark peer is (``Peer``) and what one greedy ``generate`` call of it returns
(``PeerRun``, timed by an ``EmissionClock``): Hugging Face's loop (``bench.peers``), llama.cpp's
(``bench.llamacpp_peer``) and llama-server's (``bench.llama_server_peer``)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol


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
    #: seconds from the start to the first emission of new tokens (the prefill, with the first
    #: token); the decode phase: ``decode_tokens`` emitted after that one in ``decode_s`` (to the
    #: last emission). None: the peer does not say.
    first_s: float | None = None
    decode_s: float | None = None
    decode_tokens: int | None = None

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
                "error": self.error, "first_s": self.first_s, "decode_s": self.decode_s,
                "decode_tokens": self.decode_tokens}


class Peer(Protocol):
    """What ``adaspec bench`` needs of a peer: a name, greedy requests, its settings, and ``close``
    (frees what it holds: a llama-server process). ``tie_nats``: the near-tie bound of its
    outputs against the target's plain decoding (``exactness``): the suite's float bound where
    it computes the target's own model in float arithmetic, llama.cpp's where either side rounds
    activations to 8 bits (llama.cpp's kernels; the ``gguf-q8`` target against its dense twin).
    A peer's difference beyond it is reported, but only adaspec's own configurations, which
    are lossless, fail the bench."""

    tie_nats: float

    @property
    def name(self) -> str: ...

    def run(self, prompt_ids: list[int], max_new_tokens: int, eos_ids: set[int]) -> PeerRun: ...

    def settings(self) -> dict[str, Any]: ...

    def new_pass(self) -> None:
        """Before each timed pass over the workload: forget what earlier requests taught it (a
        server's n-gram pool), as adaspec's configurations start every pass from new engines,
        so that a pass cannot draft from the answers of the same prompts in the pass before."""

    def close(self) -> None: ...


class EmissionClock:
    """When new tokens appeared: ``tick(n)`` after each emission of ``n`` tokens; ``split()`` is
    (seconds to the first emission, tokens emitted after it, seconds from it to the last)."""

    def __init__(self, now: Any = time.perf_counter):
        self._now = now
        self.t0 = now()
        self.first: float | None = None
        self.last: float | None = None
        self.after_first = 0

    def tick(self, n: int = 1) -> None:
        if n <= 0:
            return
        t = self._now()
        if self.first is None:
            self.first = t
        else:
            self.after_first += n
        self.last = t

    def split(self) -> tuple[float | None, int | None, float | None]:
        if self.first is None or self.last is None:
            return None, None, None
        return self.first - self.t0, self.after_first, self.last - self.first
