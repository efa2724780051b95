"""Measure adaspec's linear kernels against PyTorch's own ``F.linear`` on a real target.

    python scripts/linear_kernels.py [--model smollm2] [--context 300] [--reps 15]

Prints two tables, each median-of-reps, the kernels interleaved in one process:
1. the target's linear layers alone (every weight once, as in one forward), per row count:
   ``F.linear``, the transposed product (``small-batch``) and prepacked oneDNN (``packed``);
2. one target forward over w new tokens on a cache of ``--context`` tokens (the verify-cost
   curve's row) with each kernel (``stock``, ``small-batch``, ``packed``), and each one's
   ratio to its own 1-token step.
Run it on a quiet machine: it is a benchmark.
"""

from __future__ import annotations

import argparse
import statistics
import time
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from adaspec.kernels import PackedLinear, SmallBatchLinear, linear, stock_kernels
from adaspec.models import load_model

KERNELS = ("stock", "small-batch", "packed")


def _median_ms(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


@contextmanager
def kernel(model: torch.nn.Module, name: str):
    """Run ``model``'s (packed) linear layers with kernel ``name`` inside the block."""
    if name == "stock":
        with stock_kernels(model, attention=False):
            yield
        return
    layers = [m for m in model.modules() if isinstance(m, SmallBatchLinear)]
    cls = PackedLinear if name == "packed" else SmallBatchLinear
    before = [type(m) for m in layers]
    for m in layers:
        m.__class__ = cls
    try:
        yield
    finally:
        for m, c in zip(layers, before):
            m.__class__ = c


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--rows", default="1,2,3,4,5,6,8,9,12,16,24,32")
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    loaded = load_model(args.model, linear="packed")
    model = loaded.model
    layers = [m for m in model.modules() if isinstance(m, PackedLinear)]
    weights = [m.weight for m in layers]
    packs = [m.pack() for m in layers]  # the packs load_model made
    print(f"{args.model}: {len(weights)} linear layers, {sum(w.numel() for w in weights) / 1e6:.0f} M weights, "
          f"{torch.get_num_threads()} threads")

    print("\n| rows | F.linear ms | small-batch ms | packed ms | small-batch / F.linear | packed / F.linear |\n"
          "|---:|---:|---:|---:|---:|---:|")
    with torch.inference_mode():
        for n in rows:
            xs = {w.shape[1]: torch.randn(n, w.shape[1]) for w in weights}
            stock = _median_ms(lambda: [F.linear(xs[w.shape[1]], w) for w in weights], args.reps)
            small = _median_ms(lambda: [linear(xs[w.shape[1]], w) for w in weights], args.reps)
            packed = _median_ms(lambda: [torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None, "none", [], "")
                                         for w, p in zip(weights, packs)], args.reps)
            print(f"| {n} | {stock:.1f} | {small:.1f} | {packed:.1f} | {small / stock:.2f} | {packed / stock:.2f} |",
                  flush=True)

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

    print(f"\nforward over w new tokens on a {args.context}-token cache "
          "(ms; in brackets: / the kernel's own 1-token step):\n"
          "| w | " + " | ".join(KERNELS) + " | packed / stock |\n|---:|" + "---:|" * (len(KERNELS) + 1))
    base: dict[str, float] = {}
    for w in rows:
        ms = {}
        for name in KERNELS:
            with kernel(model, name):
                ms[name] = step(w)
            base.setdefault(name, ms[name])
        cells = " | ".join(f"{ms[k]:.1f} ({ms[k] / base[k]:.2f})" for k in KERNELS)
        print(f"| {w} | {cells} | {ms['packed'] / ms['stock']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
