"""Logit processing and the exact speculative-sampling verification step.

The verification rule is the one of Chen et al. / Leviathan et al. as restated in
SpecDec++ Appendix C (Algorithm 2) and Not-a-Bandit 2.2: accept draft y_i with
probability min(1, p_i(y_i) / q_i(y_i)); at the first rejection sample from
Norm[(p_i - q_i)_+]; if all K drafts pass, sample a bonus token from p_{K+1}.
Model-free drafters propose deterministically (one-hot q), so the ratio is p_i(y_i).
Greedy decoding accepts y_i iff it is the argmax of p_i.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .config import SamplingConfig


def process_logits(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """Turn raw logits [..., V] into sampling probabilities under temperature, top-k, top-p.

    The same function is applied to the target and to every drafter so that p and q are
    processed consistently (required for the output to follow the processed target).
    """
    if cfg.greedy:
        raise ValueError("process_logits is for sampling; greedy decoding uses argmax")
    x = logits.float() / cfg.temperature
    vocab = x.shape[-1]
    if 0 < cfg.top_k < vocab:
        kth = torch.topk(x, cfg.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if cfg.top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        sorted_p = torch.softmax(sorted_x, dim=-1)
        # drop a token when the mass strictly before it already reaches top_p (keeps >= 1 token)
        drop_sorted = (torch.cumsum(sorted_p, dim=-1) - sorted_p) >= cfg.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return torch.softmax(x, dim=-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """Draw one token id from a probability vector [V]."""
    return int(torch.multinomial(probs, 1, generator=generator).item())


def acceptance_probability(p: torch.Tensor, q: torch.Tensor | None, token: int | None) -> float:
    """Probability that one speculative step is accepted: sum_x min(p, q) = 1 - TV(p, q).

    For a one-hot (deterministic) proposal ``token`` it is p(token); with no proposal it is 0.
    (Not-a-Bandit Theorem 1.)
    """
    if q is not None:
        return float(torch.minimum(p, q.to(p.device)).sum().item())
    if token is None or token < 0:
        return 0.0
    return float(p[token].item())


@dataclass(frozen=True)
class Verdict:
    """Outcome of verifying one block of drafts."""

    n_accepted: int  # drafts accepted (bonus / correction token not included)
    next_token: int  # the correction token (after a rejection) or the bonus token


#: dtypes whose CPU logits ``row_argmax`` reads through numpy
_NUMPY_DTYPES = (torch.float32, torch.float64, torch.float16)


def row_argmax(logits: torch.Tensor) -> list[int]:
    """The argmax of every row of ``logits`` [n, V] (first index on ties, as torch's). On CPU
    through numpy: torch's CPU argmax over a large vocabulary costs several times numpy's, a
    visible share of a round on llama.cpp."""
    if logits.device.type == "cpu" and logits.dtype in _NUMPY_DTYPES and not logits.requires_grad:
        return logits.numpy().argmax(-1).tolist()
    return logits.argmax(dim=-1).tolist()


def verify_greedy(target_logits: torch.Tensor, drafts: Sequence[int]) -> Verdict:
    """Greedy verification: accept the longest prefix of drafts equal to the target's argmax."""
    argmax = row_argmax(target_logits)
    n = 0
    while n < len(drafts) and drafts[n] == argmax[n]:
        n += 1
    return Verdict(n, int(argmax[n]))


def verify_sampling(
    p: torch.Tensor,
    drafts: Sequence[int],
    q: torch.Tensor | None,
    generator: torch.Generator | None,
) -> Verdict:
    """Exact speculative sampling over one block.

    Args:
        p: processed target probabilities [K+1, V] at the K drafted positions and the bonus one.
        drafts: the K drafted token ids.
        q: processed drafter probabilities [K, V], or None for deterministic (one-hot) drafts.
        generator: RNG for the uniform draws and the residual / bonus sample.
    """
    k = len(drafts)
    n = k
    if k:
        idx = torch.tensor(list(drafts), device=p.device)
        rows = torch.arange(k, device=p.device)
        ratio = p[rows, idx]
        if q is not None:
            ratio = ratio / q.to(p.device)[rows, idx]
        u = torch.rand(k, generator=generator, device=p.device)
        rejected = torch.nonzero(~(u < ratio))  # NaN ratio (q(y) = 0) rejects
        if rejected.numel():
            n = int(rejected[0, 0].item())
    if n == k:
        return Verdict(k, sample(p[k], generator))
    if q is not None:
        residual = torch.clamp(p[n] - q[n].to(p.device), min=0.0)
    else:
        residual = p[n].clone()
        residual[drafts[n]] = 0.0
    total = residual.sum()
    if float(total) <= 0.0:  # p == q up to rounding: rejection had probability ~0
        residual, total = p[n], p[n].sum()
    return Verdict(n, sample(residual / total, generator))
