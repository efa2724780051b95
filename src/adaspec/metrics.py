"""Per-round records and per-request statistics.

Definitions: MAT = generated tokens / target forward passes in decoding (bonus included);
acceptance rate = accepted drafts / drafted tokens; discard rate N_discarded / N and
verification rate N_target / N as in SpecDec++ eq. (5.1), N = generated tokens.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from statistics import median


@dataclass
class RoundRecord:
    """One draft-verify round."""

    drafter: str
    k_cap: int
    drafted: int
    accepted: int
    emitted: int
    draft_s: float
    verify_s: float
    catch_up_s: float
    catch_up_tokens: int
    policy_s: float
    eval_s: float
    total_s: float
    drafter_prefill_s: float = 0.0  # prompt ingestion at the drafter's first use in the request
    tree_nodes: int = 0  # nodes of the round's draft tree (0: a chain; ``drafted`` counts them too)

    @property
    def overhead_s(self) -> float:
        """Engine bookkeeping: round time not spent in models or policies."""
        return max(0.0, self.total_s - self.draft_s - self.verify_s - self.catch_up_s
                   - self.policy_s - self.eval_s - self.drafter_prefill_s)


class Rates:
    """MAT, acceptance, discard and verification rates (SpecDec++ eq. 5.1) from four counts:
    a class provides ``token_count`` (generated tokens), ``round_count`` (target forwards in
    decoding), ``drafted`` and ``accepted``."""

    token_count: int
    round_count: int
    drafted: int
    accepted: int

    @property
    def mat(self) -> float:
        """Mean accepted tokens per target forward (bonus included)."""
        return self.token_count / self.round_count if self.round_count else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def discard_rate(self) -> float:
        """Discarded drafts per generated token."""
        return (self.drafted - self.accepted) / self.token_count if self.token_count else 0.0

    @property
    def verification_rate(self) -> float:
        """Target forwards per generated token."""
        return self.round_count / self.token_count if self.token_count else 0.0


class RoundRates(Rates):
    """``Rates`` whose drafted, accepted and round counts come from a list of per-round records
    (``self.rounds``, each with ``drafted`` and ``accepted``)."""

    rounds: list

    @property
    def round_count(self) -> int:
        return len(self.rounds)

    @property
    def drafted(self) -> int:
        return sum(r.drafted for r in self.rounds)

    @property
    def accepted(self) -> int:
        return sum(r.accepted for r in self.rounds)


@dataclass
class RequestStats(RoundRates):
    """Statistics of one generate call."""

    prompt_tokens: int = 0
    #: prompt tokens whose KV an earlier request left (the backend's ``prefix_cache``)
    cached_prompt_tokens: int = 0
    new_tokens: int = 0
    prefill_s: float = 0.0
    total_s: float = 0.0
    stop_reason: str = ""
    seed: int | None = None
    rounds: list[RoundRecord] = field(default_factory=list)

    # -- counts ---------------------------------------------------------------------------
    @property
    def n_rounds(self) -> int:
        return len(self.rounds)

    @property
    def drafter_prefill_s(self) -> float:
        return self._sum("drafter_prefill_s")

    @property
    def token_count(self) -> int:
        return self.new_tokens

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.total_s if self.total_s > 0 else 0.0

    # -- time split -------------------------------------------------------------------------
    def _sum(self, attr: str) -> float:
        return sum(getattr(r, attr) for r in self.rounds)

    @property
    def time_split(self) -> dict[str, float]:
        """Seconds spent per activity; they add up to ``total_s``."""
        split = {
            "prefill": self.prefill_s,
            "drafter_prefill": self.drafter_prefill_s,
            "target_forward": self._sum("verify_s"),
            "drafting": self._sum("draft_s"),
            "catch_up": self._sum("catch_up_s"),
            "policy": self._sum("policy_s"),
            "evaluation": self._sum("eval_s"),
            "overhead": self._sum("overhead_s"),
        }
        split["other"] = max(0.0, self.total_s - sum(split.values()))
        return split

    @property
    def overhead_share(self) -> float:
        """Median engine overhead per round as a share of the median target forward."""
        if not self.rounds:
            return 0.0
        verify = median(r.verify_s for r in self.rounds)
        return median(r.overhead_s for r in self.rounds) / verify if verify > 0 else 0.0

    def verify_widths(self) -> dict[int, int]:
        """How many rounds verified k+1 tokens, per width (to compare with the cost curve)."""
        return dict(Counter(r.drafted + 1 for r in self.rounds))

    def drafter_usage(self) -> dict[str, int]:
        return dict(Counter(r.drafter for r in self.rounds))

    def to_dict(self, rounds: bool = False) -> dict:
        out = {
            "prompt_tokens": self.prompt_tokens,
            "cached_prompt_tokens": self.cached_prompt_tokens,
            "new_tokens": self.new_tokens,
            "rounds": self.n_rounds,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "mat": self.mat,
            "acceptance_rate": self.acceptance_rate,
            "discard_rate": self.discard_rate,
            "verification_rate": self.verification_rate,
            "tokens_per_s": self.tokens_per_s,
            "total_s": self.total_s,
            "time_split_s": self.time_split,
            "catch_up_tokens": sum(r.catch_up_tokens for r in self.rounds),
            "overhead_share": self.overhead_share,
            "drafter_usage": self.drafter_usage(),
            "verify_widths": self.verify_widths(),
            "stop_reason": self.stop_reason,
            "seed": self.seed,
        }
        if rounds:
            out["per_round"] = [asdict(r) for r in self.rounds]
        return out

    def summary(self) -> str:
        s = self.time_split
        return (f"{self.new_tokens} tokens in {self.total_s:.2f}s ({self.tokens_per_s:.1f} tok/s), "
                f"{self.n_rounds} rounds, MAT {self.mat:.2f}, acceptance {self.acceptance_rate:.1%}, "
                f"target {s['target_forward']:.2f}s, drafting {s['drafting']:.2f}s, "
                f"catch-up {s['catch_up']:.3f}s, stop: {self.stop_reason}")
