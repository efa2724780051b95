"""Batched plain decoding with the small-batch linear kernel against PyTorch's own, in one process.

    python scripts/batch_kernel_ab.py [--batch 1,4,8,16] [--tokens 32] [--repeats 2]

For each batch size, ``generate_batch`` over the first B prompts of the mixed suite, the two
kernels interleaved (``kernels.stock_kernels`` for PyTorch's), total tokens/s per run. A
benchmark: run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import time

from adaspec import SpeculativeEngine
from adaspec.bench.workloads import load_workload
from adaspec.kernels import stock_kernels


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", default="1,4,8,16")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    engine = SpeculativeEngine.from_pretrained("smollm2", drafters=["none"])
    model = engine.target.model
    prompts = [p.turns[0] for p in load_workload("mixed", per_category=4)]
    print("| rows | repeat | stock tokens/s | small-batch tokens/s |\n|---:|---:|---:|---:|")
    for rows in (int(b) for b in args.batch.split(",")):
        batch = prompts[:rows]
        for rep in range(args.repeats):
            speeds = []
            for stock in (True, False):
                t0 = time.perf_counter()
                if stock:
                    with stock_kernels(model, attention=False):
                        results = engine.generate_batch(batch, max_new_tokens=args.tokens)
                else:
                    results = engine.generate_batch(batch, max_new_tokens=args.tokens)
                speeds.append(sum(len(r.token_ids) for r in results) / (time.perf_counter() - t0))
            print(f"| {rows} | {rep + 1} | {speeds[0]:.1f} | {speeds[1]:.1f} |", flush=True)


if __name__ == "__main__":
    main()
