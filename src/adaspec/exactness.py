"""Checks that an output is what greedy decoding of the target would produce.

``greedy_reference`` runs plain ``model.generate(do_sample=False)``. ``tie_check`` is for
settings where bit-exact equality cannot hold (bf16 is not batch-invariant, nor are llama.cpp's
CPU kernels: verifying k tokens at once can flip an argmax between near-tied tokens): given the
reference's logits teacher-forced on the output itself, each emitted token must be the argmax
or within ``max_gap`` nats of it, and every position where it is not is reported with its gap.
``check_tie_aware`` computes those logits with one forward of a Hugging Face model;
``divergence_gap`` measures the first difference between two outputs on a backend.

The bounds are where numerics end and verification errors begin: a wrong token accepted by a
broken verifier lies below the argmax by the margin the target put between them, not by kernel
noise, and the tests (``tests/test_exactness.py``, ``tests/test_llamacpp_exactness.py``) inject
such acceptances and check that these functions report them beyond the bound.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from collections.abc import Sequence

import torch

#: the near-tie bound of batch-invariant kernels (fp32 on PyTorch; llama.cpp with flash attention
#: on short sequences whose block kernels were probed equal): a greedy output that differs from
#: plain decoding where plain decoding's two best tokens were this close (nats) differs at a
#: float-rounding tie (batched and one-token forwards sum in another order), not from a
#: verification error; ``TargetBackend.near_tie_nats`` defaults to it
NEAR_TIE_NATS = 0.05
#: the near-tie bound on llama.cpp (``LlamaCppTarget.near_tie_nats``), whose CPU kernels are not
#: batch-invariant: a verify block's logits are not the one-token forwards' (another matrix
#: kernel for several rows; without flash attention at any length, with it past 256 cached
#: cells, where one query takes the split-KV path). It is the largest move of the two best
#: tokens' margin between one-token decoding and verify blocks measured over the built-in suites
#: (``tools/llamacpp_numerics.py``; the table is in docs/llamacpp.md), rounded up. A difference
#: from plain decoding within it is reported as a near-tie; one beyond it is a mismatch (the
#: bench exits 1, the tests fail): a verifier that accepts a wrong token puts it a whole margin
#: below the argmax, beyond the bound (``tests/test_llamacpp_exactness.py`` injects one)
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
    """Result of a tie-aware greedy check: ``ok`` when no token lies beyond the bound."""

    ok: bool
    n_tokens: int
    n_exact: int  # tokens equal to the target's argmax
    n_ties: int  # tokens within max_gap of the argmax but not equal to it
    violations: list[tuple[int, float]] = field(default_factory=list)  # (position, gap in nats)
    #: every position whose token is not the argmax, with its gap (the ties and the violations)
    divergences: list[tuple[int, float]] = field(default_factory=list)


def tie_check(logits: torch.Tensor, output_ids: Sequence[int], max_gap: float | Sequence[float]) -> TieCheck:
    """Is every output token the argmax of its row of ``logits``, or within ``max_gap`` nats of it?

    ``logits`` [len(output_ids), vocab]: row j is the reference's logits before output token j,
    teacher-forced on the output itself (the output's own prefix), so every position is judged,
    not only the first difference. The gap at j is log p(argmax) - log p(token j) under that row;
    ``max_gap`` is one bound or one per position (a backend's bound can depend on the length,
    ``TargetBackend.near_tie_nats_at``)."""
    n = len(output_ids)
    if logits.shape[0] != n:
        raise ValueError(f"tie_check needs one logits row per output token: {logits.shape[0]} rows "
                         f"for {n} tokens")
    if n == 0:
        return TieCheck(True, 0, 0, 0)
    bounds = [float(max_gap)] * n if isinstance(max_gap, (int, float)) else [float(b) for b in max_gap]
    if len(bounds) != n:
        raise ValueError(f"tie_check got {len(bounds)} bounds for {n} tokens")
    logp = torch.log_softmax(logits.double(), dim=-1)
    out = torch.tensor(list(output_ids), device=logp.device)
    rows = torch.arange(n, device=logp.device)
    gaps = (logp.max(dim=-1).values - logp[rows, out]).tolist()
    hit = (logp.argmax(dim=-1) == out).tolist()
    divergences = [(j, gaps[j]) for j in range(n) if not hit[j]]
    violations = [(j, g) for j, g in divergences if g > bounds[j]]
    n_exact = n - len(divergences)
    return TieCheck(not violations, n, n_exact, len(divergences) - len(violations), violations, divergences)


@torch.inference_mode()
def check_tie_aware(model: Any, prompt_ids: Sequence[int], output_ids: Sequence[int],
                    max_gap: float = NEAR_TIE_NATS) -> TieCheck:
    """``tie_check`` of ``output_ids`` against a Hugging Face causal LM: the rows come from one
    forward over the prompt and the output."""
    if not output_ids:
        return TieCheck(True, 0, 0, 0)
    device = next(model.parameters()).device
    ids = torch.tensor([list(prompt_ids) + list(output_ids)], device=device)
    logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1: -1]
    return tie_check(logits, output_ids, max_gap)


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
