"""Batched ``auto``: the joint batch width against every row planning alone on its row price
(the rule before), and batched AR, alternating in one process (SmolLM2, greedy, mixed suite).

    python scripts/batch_joint_ab.py --concurrency 2,4,8 --repeats 2 -n 64

Per level C: 2C requests (``--requests``) arrive at once, C rows busy; total tokens/s (median over repeats), the
widths of the batch forwards and the rows' mean accepted tokens per round (MAT)."""

from __future__ import annotations

import argparse
import collections
import statistics
import time

from adaspec import SpeculativeEngine
from adaspec.batch import BatchEngine, load_or_measure_batch
from adaspec.bench.workloads import load_workload
from adaspec.models import load_model


def run(engine: SpeculativeEngine, prompts: list, rows: int, n: int, costs, alone: bool) -> dict:
    batch = BatchEngine(engine, max_batch=rows, batch_costs=costs)
    if alone:  # every row plans on its own row price (BatchCosts.row_cost), as before the joint width
        batch._joint_plans = lambda: [batch._plan(r) for r in batch._rows]
    widths: collections.Counter = collections.Counter()
    forward = batch._forward
    batch._forward = lambda inputs: widths.update([max(len(x) for x in inputs)]) or forward(inputs)
    ids = [batch.add(p, max_new_tokens=n) for p in prompts]
    t = time.perf_counter()
    out = batch.run()
    wall = time.perf_counter() - t
    tokens = sum(len(out[i].token_ids) for i in ids)
    rounds = sum(len(out[i].stats.rounds) for i in ids)
    return {"tps": tokens / wall, "mat": tokens / rounds, "wide": sum(v for w, v in widths.items() if w > 1),
            "forwards": sum(widths.values()), "out": [out[i].token_ids for i in ids]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", default="2,4,8")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("-n", "--max-new-tokens", type=int, default=64)
    ap.add_argument("--per-category", type=int, default=None,
                    help="prompts per category of the mixed suite (default: all, in the suite's order)")
    ap.add_argument("--requests", type=int, default=None,
                    help="requests per level, cycling over the prompts (default: 2 x concurrency)")
    args = ap.parse_args()
    target = load_model("smollm2")
    costs = load_or_measure_batch(target)
    ar = SpeculativeEngine(target, ["none"])
    auto = SpeculativeEngine(target, ["prompt-lookup", "suffix", "none"], selector="auto")
    prompts = [auto.encode_prompt(p.turns[0]) for p in load_workload("mixed", per_category=args.per_category)]
    warm = BatchEngine(auto, max_batch=2, batch_costs=costs)
    for p in prompts[:2]:
        warm.add(p, max_new_tokens=8)
    warm.run()
    print("| rows | AR tokens/s | auto, rows alone | auto, joint width | joint / alone | joint / AR "
          "| wide forwards alone | joint | MAT alone | joint |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for c in (int(x) for x in args.concurrency.split(",")):
        n_req = args.requests or 2 * c
        reqs = [prompts[i % len(prompts)] for i in range(n_req)]
        res: dict[str, list] = {"ar": [], "alone": [], "joint": []}
        for _ in range(args.repeats):
            res["ar"].append(run(ar, reqs, c, args.max_new_tokens, costs, False))
            res["alone"].append(run(auto, reqs, c, args.max_new_tokens, costs, True))
            res["joint"].append(run(auto, reqs, c, args.max_new_tokens, costs, False))
        med = {k: statistics.median(r["tps"] for r in v) for k, v in res.items()}
        same = all(r["out"] == res["ar"][0]["out"] for v in res.values() for r in v)
        last = {k: v[-1] for k, v in res.items()}
        print(f"| {c} | {med['ar']:.1f} | {med['alone']:.1f} | {med['joint']:.1f} | {med['joint'] / med['alone']:.2f}x "
              f"| {med['joint'] / med['ar']:.2f}x | {last['alone']['wide']}/{last['alone']['forwards']} "
              f"| {last['joint']['wide']}/{last['joint']['forwards']} | {last['alone']['mat']:.2f} "
              f"| {last['joint']['mat']:.2f} |{'' if same else ' (outputs differ from AR)'}", flush=True)


if __name__ == "__main__":
    main()
