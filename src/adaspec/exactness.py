"""Checks that an output is what greedy decoding of the target would produce.

``greedy_reference`` runs plain ``model.generate(do_sample=False)``. ``check_tie_aware`` is for
settings where bit-exact equality cannot hold (bf16 is not batch-invariant: verifying k tokens
at once can flip an argmax between near-tied tokens): each emitted token must be the target's
argmax or within ``max_gap`` nats of it, teacher-forced on the output itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from collections.abc import Sequence

import torch

#: a greedy output that differs from plain decoding where the two tokens' log-probabilities are
#: this close (nats) differs at a numeric near-tie (batched vs one-token forwards, bf16, quantized
#: kernels), not from a verification error
NEAR_TIE_NATS = 0.05
#: the same on llama.cpp, whose CPU kernels are not batch-invariant (without flash attention, the
#: CPU default, at any length: max 0.75 nats; with it, once the KV cache holds more than 256 cells,
#: where one query takes flash attention's split-KV path and a verify block does not: max 1.18): the
#: largest move of the two best tokens' margin between one-token decoding and verify blocks,
#: measured over the built-in suites (scripts/llamacpp_numerics.py, docs/llamacpp.md), rounded up
NEAR_TIE_NATS_LLAMACPP = 1.25


@torch.inference_mode()
def greedy_reference(model: Any, prompt_ids: Sequence[int], max_new_tokens: int,
                     eos_token_id: Any = None) -> list[int]:
    """Plain greedy continuation from Hugging Face ``generate`` (the ground truth)."""
    device = next(model.parameters()).device
    x = torch.tensor([list(prompt_ids)], device=device)
    kwargs: dict[str, Any] = {"max_new_tokens": max_new_tokens, "do_sample": False,
                              "attention_mask": torch.ones_like(x)}
    if eos_token_id is not None:
        kwargs["eos_token_id"] = eos_token_id
    out = model.generate(x, **kwargs)
    return out[0, len(prompt_ids):].tolist()


@dataclass
class TieCheck:
    """Result of a tie-aware greedy check."""

    ok: bool
    n_tokens: int
    n_exact: int  # tokens equal to the target's argmax
    n_ties: int  # tokens within max_gap of the argmax but not equal to it
    violations: list[tuple[int, float]] = field(default_factory=list)  # (position, gap in nats)


@torch.inference_mode()
def check_tie_aware(model: Any, prompt_ids: Sequence[int], output_ids: Sequence[int],
                    max_gap: float = 0.05) -> TieCheck:
    """Is every output token the target's argmax, or within ``max_gap`` nats of it?"""
    if not output_ids:
        return TieCheck(True, 0, 0, 0)
    device = next(model.parameters()).device
    ids = torch.tensor([list(prompt_ids) + list(output_ids)], device=device)
    logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1: -1].float()
    logp = torch.log_softmax(logits, dim=-1)
    out = torch.tensor(list(output_ids), device=device)
    gaps = (logp.max(dim=-1).values - logp[torch.arange(len(output_ids), device=device), out]).tolist()
    argmax_hit = (logp.argmax(dim=-1) == out).tolist()
    n_exact = sum(argmax_hit)
    viol = [(j, g) for j, g in enumerate(gaps) if not argmax_hit[j] and g > max_gap]
    n_ties = len(output_ids) - n_exact - len(viol)
    return TieCheck(not viol, len(output_ids), n_exact, n_ties, viol)


@torch.inference_mode()
def divergence_gap(target: Any, prompt_ids: Sequence[int], reference: Sequence[int],
                   output: Sequence[int]) -> tuple[int, float | None]:
    """Where ``output`` first differs from the ``reference`` greedy output, and how close the two
    tokens were there: |log p(reference token) - log p(output token)| in nats under the target's
    logits after the shared prefix. On a batch-invariant backend one forward gives them; on one
    that is not (llama.cpp), they are computed as plain decoding computed them (the prompt, then
    one token at a time), so the gap is the margin the reference itself saw. The gap is None
    where one output is a prefix of the other (they differ in length only)."""
    at = next((j for j, (a, b) in enumerate(zip(output, reference)) if a != b), None)
    if at is None:
        return min(len(output), len(reference)), None
    state = target.new_state()
    try:
        if getattr(target, "batch_invariant", True):
            logits, _ = target.forward(state, [*prompt_ids, *reference[:at]], keep=1)
        else:
            target.prefill(state, prompt_ids)
            for tok in [prompt_ids[-1], *reference[:at]]:
                logits, _ = target.forward(state, [tok], keep=1)
    finally:
        target.release(state)
    logp = torch.log_softmax(logits[-1].float(), dim=-1)
    return at, abs(float(logp[reference[at]] - logp[output[at]]))
