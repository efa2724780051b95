"""Measure the small-batch linear kernel against PyTorch's own ``F.linear`` on a real target.

    python scripts/linear_kernels.py [--model smollm2] [--context 300] [--reps 15]

Prints two tables, each median-of-reps, both kernels interleaved in one process:
1. the target's linear layers alone (every weight once, as in one forward), per row count;
2. one target forward over w new tokens on a cache of ``--context`` tokens (the verify-cost
   curve's row), with the kernel and without, and the ratio of each to its own 1-token step.
Run it on a quiet machine: it is a benchmark.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from adaspec.kernels import linear, stock_linears
from adaspec.models import load_model


def _median_ms(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--rows", default="1,2,3,4,5,6,8,9,12,16")
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    loaded = load_model(args.model)  # linear="auto": small-batch layers on CPU float32
    model = loaded.model
    weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    print(f"{args.model}: {len(weights)} linear layers, {sum(w.numel() for w in weights) / 1e6:.0f} M weights, "
          f"{torch.get_num_threads()} threads")

    print("\n| rows | F.linear ms | small-batch ms | ratio |\n|---:|---:|---:|---:|")
    with torch.inference_mode():
        for n in rows:
            xs = {w.shape[1]: torch.randn(n, w.shape[1]) for w in weights}
            stock = _median_ms(lambda: [F.linear(xs[w.shape[1]], w) for w in weights], args.reps)
            small = _median_ms(lambda: [linear(xs[w.shape[1]], w) for w in weights], args.reps)
            print(f"| {n} | {stock:.1f} | {small:.1f} | {small / stock:.2f} |", flush=True)

    ids = torch.randint(0, loaded.vocab_size, (args.context,), generator=torch.Generator().manual_seed(0)).tolist()
    state = loaded.new_state()
    loaded.forward(state, ids)

    def step(width: int) -> float:
        new = list(range(100, 100 + width))

        def once() -> None:
            loaded.forward(state, new, keep=width)
            loaded.truncate(state, args.context)
        once()  # warm
        return _median_ms(once, args.reps)

    print(f"\nforward over w new tokens on a {args.context}-token cache:\n"
          "| w | stock ms | small-batch ms | stock / its 1-token step | small-batch / its 1-token step |"
          " small-batch / stock |\n|---:|---:|---:|---:|---:|---:|")
    base: dict[str, float] = {}
    for w in rows:
        with stock_linears(model):
            stock = step(w)
        small = step(w)
        base.setdefault("stock", stock)
        base.setdefault("small", small)
        print(f"| {w} | {stock:.1f} | {small:.1f} | {stock / base['stock']:.2f} | {small / base['small']:.2f} | "
              f"{small / stock:.2f} |", flush=True)


if __name__ == "__main__":
    main()
