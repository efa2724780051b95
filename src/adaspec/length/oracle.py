"""The hindsight-optimal draft lengths of greedy decoding (SpecDec++ Theorem 4.1), for
evaluation only: an upper bound that no length policy can beat with the same drafter.

Given the target's greedy tokens X_1..X_N and the drafter's teacher-forced greedy proposals
Y_i = argmax q(. | prompt, X_<i), the oracle stops every round right before the first
disagreement Y_i != X_i, so no drafted token is ever discarded and the target runs once per
disagreement, plus once for the tail after the last one (N_target = |S| + 1). With a token
budget of N (as in the engine) a disagreement at the last position N needs no extra round.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..config import SamplingConfig
from ..drafters.base import Drafter, Proposals


@dataclass
class OracleResult:
    """Per-round oracle draft lengths and the resulting metrics."""

    lengths: list[int]  # drafted (= accepted) tokens per round
    emitted: list[int]  # tokens emitted per round (accepted + the target's token)

    @property
    def rounds(self) -> int:
        """Target forwards N_target."""
        return len(self.lengths)

    @property
    def mat(self) -> float:
        """Mean accepted tokens per target forward, bonus/correction included."""
        return sum(self.emitted) / self.rounds if self.lengths else 0.0

    @property
    def verification_rate(self) -> float:
        """N_target / N (SpecDec++ eq. (5.1)); the discard rate is 0 by construction."""
        n = sum(self.emitted)
        return self.rounds / n if n else 0.0


def oracle_greedy_lengths(drafted: Sequence[int], target: Sequence[int]) -> OracleResult:
    """SpecDec++ Theorem 4.1 in hindsight.

    ``drafted[i]`` is the drafter's greedy proposal for position i given the target's tokens
    before it (-1: no proposal, e.g. a model-free drafter without a match, which counts as a
    disagreement); ``target[i]`` is the target's greedy token. Rounds follow the engine's
    budget rule: a round never drafts past the last token (cap = remaining - 1), so
    N_target = |S minus {N}| + 1.
    """
    n = len(target)
    if len(drafted) < n:
        raise ValueError(f"need a proposal for each of the {n} target tokens, got {len(drafted)}")
    lengths: list[int] = []
    emitted: list[int] = []
    s = 0
    while s < n:
        i = s
        while i < n - 1 and drafted[i] == target[i]:  # at most remaining - 1 drafts
            i += 1
        lengths.append(i - s)  # tokens s..i-1 drafted and accepted; the target emits token i
        emitted.append(i - s + 1)
        s = i + 1
    return OracleResult(lengths, emitted)


def proposal_tokens(proposals: Proposals) -> list[int]:
    """One greedy proposal per position from ``Drafter.score`` output (-1: none)."""
    if proposals.tokens is not None:
        return list(proposals.tokens)
    assert proposals.probs is not None
    return proposals.probs.argmax(-1).tolist()


def oracle_for_drafter(drafter: Drafter, prompt_ids: Sequence[int],
                       target_tokens: Sequence[int]) -> OracleResult:
    """Oracle lengths of ``drafter`` on a greedy target output (one teacher-forced pass)."""
    drafter.begin_request(prompt_ids)
    props = drafter.score(list(prompt_ids), list(target_tokens), SamplingConfig())
    return oracle_greedy_lengths(proposal_tokens(props), target_tokens)
