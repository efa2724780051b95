"""Measure adaspec's attention (``kernels.GQA_ATTENTION``) against transformers' own SDPA path.

    python scripts/attention_kernels.py [--model smollm2] [--contexts 400,1200] [--reps 15]

One target forward over w new tokens on a cache of each ``--contexts`` length (a row of the
verify-cost curve), with transformers' ``"sdpa"`` attention and with ``GQA_ATTENTION``,
interleaved in one process, median of ``--reps``; both with the linear kernels ``load_model``
installs. Also checks that the two give bit-identical logits. Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from adaspec.kernels import GQA_ATTENTION
from adaspec.models import load_model

WIDTHS = (1, 2, 3, 4, 5, 8, 12, 16)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--contexts", default="400,1200")
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    target = load_model(args.model)
    model = target.model
    if model.config._attn_implementation != GQA_ATTENTION:
        raise SystemExit(f"load_model did not install {GQA_ATTENTION} (attention is "
                         f"{model.config._attn_implementation!r}): nothing to compare")
    gen = torch.Generator().manual_seed(0)
    vocab = target.vocab_size
    for ctx in (int(c) for c in args.contexts.split(",")):
        state = target.new_state()
        target.forward(state, torch.randint(0, vocab, (ctx,), generator=gen).tolist())
        print(f"\ncontext {ctx}: median ms per forward over w tokens (reps {args.reps})")
        print(f"{'w':>3} {'sdpa':>7} {'gqa':>7} {'gqa/sdpa':>9}  identical")
        for w in WIDTHS:
            block = torch.randint(0, vocab, (w,), generator=gen).tolist()
            times: dict[str, list[float]] = {"sdpa": [], GQA_ATTENTION: []}
            logits: dict[str, torch.Tensor] = {}
            for rep in range(args.reps + 2):
                for impl in times:
                    model.set_attn_implementation(impl)
                    t0 = time.perf_counter()
                    out, _ = target.forward(state, block, keep=w)
                    dt = time.perf_counter() - t0
                    target.truncate(state, ctx)
                    if rep >= 2:  # two warm-up rounds
                        times[impl].append(dt)
                    logits[impl] = out
            a, b = (statistics.median(t) * 1000 for t in times.values())
            same = torch.equal(logits["sdpa"], logits[GQA_ATTENTION])
            print(f"{w:>3} {a:7.1f} {b:7.1f} {b / a:9.3f}  {same}")
        model.set_attn_implementation(GQA_ATTENTION)


if __name__ == "__main__":
    main()
