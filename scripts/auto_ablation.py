"""The `auto` ablation by replay of a recorded trace (issue `auto`): the objective (time vs
accepted length), full vs bandit feedback, warm start (global vs request scope) and looking at
the blocks first, against the best single-drafter configurations, on the same trace and the
same basis (predicted seconds over replay's AR). Seconds to run.

    adaspec bench --config benchmarks/smollm2-auto.toml -o results/smollm2-auto   # records trace.npz
    python scripts/auto_ablation.py results/smollm2-auto/trace.npz
"""

from __future__ import annotations

import argparse

from adaspec.bench.replay import replay
from adaspec.bench.trace import Trace

POOL = ["prompt-lookup", "suffix", "none"]
ROWS = [
    ("suffix + cost-model (best single drafter live)", None, "cost-model", ["suffix"]),
    ("suffix + auto length", None, "auto", ["suffix"]),
    ("auto (default: time objective, full information, warm start, no peek)", "auto", None, POOL),
    ("auto, objective=length (the papers' objective: expected accepted tokens)", "auto:objective=length", None, POOL),
    ("auto, feedback=bandit (chosen drafter's rounds only)", "auto:feedback=bandit", None, POOL),
    ("auto, scope=request (no warm start across requests)", "auto:scope=request", None, POOL),
    ("auto, peek=1 (look at the blocks first, conditioned estimates)", "auto:peek=1", None, POOL),
    ("hedgespec + cost-model", "hedgespec:scope=global", "cost-model", POOL),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    args = ap.parse_args()
    trace = Trace.load(args.trace)
    ar = replay(trace, None, None, drafters=["none"])
    print(f"replay of {args.trace}: {len(trace.prompts)} requests; AR {ar.tokens_per_s:.1f} tokens/s predicted\n")
    print("| configuration | predicted tokens/s | speed-up | MAT |")
    print("|---|---:|---:|---:|")
    for name, sel, ln, drafters in ROWS:
        r = replay(trace, sel, ln, k=5, drafters=drafters)
        print(f"| {name} | {r.tokens_per_s:.1f} | {ar.predicted_s / r.predicted_s:.2f}x | {r.mat:.2f} |")


if __name__ == "__main__":
    main()
