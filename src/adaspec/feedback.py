"""What the engine tells policies after each round (model-free data only).

Carries the target distribution at every drafted position (plus the bonus position), the
drafter's distributions, the accepted length and measured times, and, for full-information
learners, the acceptance probabilities gamma of the *other* drafters on the verified tokens
(Not-a-Bandit 3.2). Probabilities are computed lazily so that policies that do not need
them cost nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

import torch

from .config import SamplingConfig
from .drafters.base import Draft, Proposals
from .persist import state_type
from .sampling import row_argmax


def gammas_from_proposals(
    target_logits: torch.Tensor, target_probs: torch.Tensor | None, proposals: Proposals,
    sampling: SamplingConfig, argmax: Sequence[int] | None = None,
) -> list[float]:
    """Per-position acceptance probability of a drafter's teacher-forced proposals.

    Sampling: 1 - TV(p, q) for dense q, p(y) for a one-hot proposal y (Not-a-Bandit Thm 1).
    Greedy: 1 if the proposal (a dense q's argmax) equals the target's argmax (``argmax``: the
    rows' argmax, when the caller has it), else 0. ``target_probs`` is read only when
    sampling: None is fine for greedy.
    """
    m = target_logits.shape[0]
    if sampling.greedy:
        toks = proposals.tokens[:m] if proposals.tokens is not None else row_argmax(_dense(proposals)[:m])
        am = row_argmax(target_logits) if argmax is None else argmax
        return [1.0 if t == a else 0.0 for t, a in zip(toks, am)]
    assert target_probs is not None
    if proposals.tokens is not None:
        return [float(target_probs[j, t]) if t >= 0 else 0.0 for j, t in enumerate(proposals.tokens[:m])]
    q = _dense(proposals)[:m].to(target_probs.device)
    return torch.minimum(target_probs[: q.shape[0]], q).sum(-1).tolist()


def _dense(proposals: Proposals) -> torch.Tensor:
    assert proposals.probs is not None, "Proposals carry tokens or probs"
    return proposals.probs


def alphas_from_proposals(target_probs: torch.Tensor | None, proposals: Proposals, emitted: list[int],
                          sampling: SamplingConfig) -> list[float]:
    """Acceptance probability of the *realised* token at each emitted position,
    alpha_j = min(1, q_j(x_j) / p_j(x_j)) (1[x_j = y_j] for one-hot or greedy proposals); used
    by the corrected counterfactual acceptance-length estimator (selection/hedgespec.py)."""
    m = len(emitted)
    if proposals.tokens is not None:
        return [1.0 if t == e else 0.0 for t, e in zip(proposals.tokens[:m], emitted)]
    if sampling.greedy:
        return [1.0 if t == e else 0.0 for t, e in zip(row_argmax(_dense(proposals)[:m]), emitted)]
    assert target_probs is not None
    q = _dense(proposals)[:m].to(target_probs.device)
    x = torch.tensor(emitted[: q.shape[0]], device=q.device)
    i = torch.arange(q.shape[0], device=q.device)
    return (q[i, x] / target_probs[i, x].clamp_min(1e-30)).clamp(max=1.0).tolist()


@state_type
@dataclass(frozen=True)
class RoundContext:
    """The round a row is planned in, as the policies that price rounds read it: passed by the
    round (``round.Round.plan``) to their ``select(ctx)`` and ``begin_round(drafter, ctx)``
    (``SelectorCaps.prices_rounds`` / ``LengthCaps.prices_rounds``), to the cost model's prices
    (``costs.CostModel.verify_cost(width, ctx)``, ...) and in the round's feedback
    (``RoundFeedback.context``), instead of being set on a shared cost model. Plain data: a
    policy given the same contexts and feedback decides the same way.

    ``cache_len``: tokens in the row's target cache (its context less the last token, which the
    verify forward feeds). ``rows``: rows verified by the round's forward (more than one: the
    row pays its share of a batched forward, ``costs.BatchCosts.row_cost``). ``batch_columns``:
    the batch cache's columns that forward reads (padded rows). ``last_width``: the width of the
    forward before this round (0: the prefill), for backends that rebuild their compute graph
    for a new shape (``CostModel.switch_cost``)."""

    cache_len: int = 0
    rows: int = 1
    batch_columns: int = 0
    last_width: int = 0


#: the context of a lone row with an empty cache (a policy asked outside a round: tests, tools)
NO_CONTEXT = RoundContext()


@dataclass
class RoundFeedback:
    """Everything a drafter or length policy may learn from one round."""

    round: int
    drafter: int  # index of the drafter used
    draft: Draft
    n_accepted: int  # drafted tokens accepted (bonus excluded)
    emitted: list[int]  # tokens appended to the output (accepted + correction/bonus, after stops)
    k_cap: int  # length cap the length policy set for the round
    target_logits: torch.Tensor | None  # [len(draft)+1, V] raw target logits (None: synthetic)
    sampling: SamplingConfig
    draft_s: float = 0.0
    verify_s: float = 0.0
    catch_up_s: float = 0.0
    catch_up_tokens: int = 0
    #: full information: drafter index -> gamma at each emitted position (None if not asked).
    #: The chosen drafter's list is one shorter when all drafts passed (no proposal at the
    #: bonus position).
    counterfactual: dict[int, list[float]] | None = None
    #: full information: drafter index -> alpha (acceptance probability of the realised token)
    #: at each emitted position, for the other drafters (see ``alphas_from_proposals``)
    counterfactual_alpha: dict[int, list[float]] | None = None
    #: full information: drafter index -> did it propose a token at each emitted position
    #: (model-free drafters often have no match; dense model proposals always propose)
    counterfactual_proposed: dict[int, list[bool]] | None = None
    #: per-position acceptance probabilities given directly (synthetic environments, replay)
    gammas: list[float] | None = None
    #: nodes of the round's draft tree (0: a chain); a tree round reads as a chain (the
    #: accepted path, then the first child of its end), not as the drafter's chain's outcome
    tree_nodes: int = 0
    #: acceptance probabilities recorded for the drafted tokens (replay of a trace): what
    #: ``acceptance_probs`` returns, while ``chosen_gammas`` stays the realised 0/1 under greedy
    recorded: list[float] | None = None
    extra: dict[str, float] = field(default_factory=dict)
    #: the round's context (its row's cache length, the rows of its forward, ...)
    context: RoundContext = NO_CONTEXT

    @property
    def n_drafted(self) -> int:
        return len(self.draft.tokens)

    @property
    def accepted_length(self) -> int:
        """Accepted tokens including the bonus / correction token (BanditSpec reward, in [1, K+1])."""
        return self.n_accepted + 1

    def chosen_gammas(self) -> list[float]:
        """The chosen drafter's gamma on the emitted positions, on the same scale as the
        counterfactual ones: greedy -> 1 for accepted drafts and 0 for the rejected one;
        sampling -> acceptance probabilities. No entry at the bonus position."""
        k, n = self.n_drafted, self.n_accepted
        if self.sampling.greedy and self.gammas is None:
            return [1.0] * n + ([0.0] if n < k else [])
        return self.acceptance_probs[: min(n + 1, k)]

    @cached_property
    def target_probs(self) -> torch.Tensor:
        """Target distribution p at each position: processed for sampling, softmax for greedy."""
        if self.sampling.greedy:
            return torch.softmax(self.target_logits.float(), dim=-1)
        from .sampling import process_logits

        return process_logits(self.target_logits, self.sampling)

    @cached_property
    def draft_probs(self) -> torch.Tensor | None:
        """Drafter q at each drafted position (None for one-hot, model-free drafts)."""
        if self.draft.probs is not None:
            return self.draft.probs
        if self.draft.logits is not None:
            return torch.softmax(self.draft.logits.float(), dim=-1)
        return None

    @property
    def round_s(self) -> float:
        """Model time of the round: drafting + verification + catch-up (cost-aware rewards)."""
        return self.draft_s + self.verify_s + self.catch_up_s

    @cached_property
    def acceptance_probs(self) -> list[float]:
        """gamma_i = 1 - TV(p_i, q_i) at each drafted position (p_i(y_i) for one-hot drafts)."""
        if self.gammas is not None:
            return list(self.gammas)
        if self.recorded is not None:
            return list(self.recorded)
        k = self.n_drafted
        if k == 0:
            return []
        p = self.target_probs[:k]
        q = self.draft_probs
        if q is None:
            idx = torch.tensor(self.draft.tokens, device=p.device)
            return p[torch.arange(k, device=p.device), idx].tolist()
        return torch.minimum(p, q.to(p.device)).sum(-1).tolist()
