"""Does replay predict live runs? Run a bench live, record the same workload, replay every
configuration, and compare tokens/s and the ranking, side by side in one process.

    python scripts/replay_check.py --suite mixed --per-category 2 -n 128
    python scripts/replay_check.py --suite summarization,rag --per-category 4 -n 128

Configurations: AR, prompt-lookup and suffix at static k, the cost-model length rule with each,
and cost-aware HedgeSpec + the cost-model rule over [prompt-lookup, suffix, none] (override with
--static-k, --selector, --length). Prints the live and predicted tokens/s, the error of each, the
largest error, whether the two rankings agree, the grid measurement time and the engine
overheads recorded in the trace; --json writes it all. Also checks that every replayed round of
a time-independent configuration equals the live one (drafter, drafted, accepted).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from adaspec.bench.report import rank_swaps
from adaspec.bench.runner import BenchConfig, run_bench
from adaspec.bench.trace import record
from adaspec.bench.workloads import load_workload
from adaspec.costs import load_or_measure
from adaspec.models import load_model

DRAFTERS = ["prompt-lookup", "suffix"]


def configs(k: int, selector: str, length: str) -> list[BenchConfig]:
    out = [BenchConfig("AR (no drafter)", [])]
    out += [BenchConfig(f"{d} k={k}", [d], k=k) for d in DRAFTERS]
    out += [BenchConfig(f"{d} + {length}", [d], k=k, length=length) for d in DRAFTERS]
    out.append(BenchConfig(f"{selector} + {length} over [{', '.join(DRAFTERS)}, none]", [*DRAFTERS, "none"],
                           k=k, selector=selector, length=length))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--suite", default="mixed")
    ap.add_argument("--per-category", type=int, default=2)
    ap.add_argument("-n", "--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--static-k", type=int, default=5)
    ap.add_argument("--selector", default="cost-hedgespec")
    ap.add_argument("--length", default="cost-model")
    ap.add_argument("--trace", default="/tmp/replay_check_trace.npz")
    ap.add_argument("--prompts", type=int, default=0, help="use only the first N prompts (0 = all)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    target = load_model(args.model)
    t0 = time.perf_counter()
    surface = load_or_measure(target, progress=lambda d, n: print(f"  cost grid: pass {d}/{n}", file=sys.stderr))
    print(f"cost grid: {len(surface.contexts)} cache lengths x {len(surface.ks)} widths; measuring it took "
          f"{surface.measure_s:.1f} s (loaded in {time.perf_counter() - t0:.1f} s)")
    work = []
    for suite in args.suite.split(","):
        work += load_workload(suite, per_category=args.per_category)
    if args.prompts > 0:
        work = work[: args.prompts]
    cfgs = configs(args.static_k, args.selector, args.length)
    t0 = time.perf_counter()
    run = run_bench(target, cfgs, work, args.max_new_tokens, args.repeats, suite=args.suite,
                    progress=lambda m: print(f"  live: {m}", file=sys.stderr, flush=True))
    live_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    trace = record(target, DRAFTERS, work, args.max_new_tokens, args.trace,
                   progress=lambda m: print(f"  record: {m}", file=sys.stderr, flush=True))
    rec_s = time.perf_counter() - t0
    run.predict_from(trace)
    rows = run.summary()["overall"]
    print(f"{len(work)} prompts ({args.suite}) x {args.max_new_tokens} tokens: live bench {live_s:.0f} s, "
          f"recording {rec_s:.0f} s")
    o = trace.overheads
    print(f"engine overheads: {o.round_s * 1e3:.2f} ms per round, {o.request_s * 1e3:.1f} ms per request; "
          "live verify step / surface V(w, L): "
          + (", ".join(f"w={w} {r:.3f}" for w, r in zip(o.verify_widths, o.verify_ratios)) or f"{o.verify_scale:.3f}"))
    for name, c in zip(trace.specs, trace.drafter_costs):
        print(f"  {name}: draft {c.draft}, catch-up {c.catch_up}, evaluate {c.evaluate}")
    print(f"{'configuration':58s} {'live tok/s':>10s} {'pred tok/s':>10s} {'error':>7s}")
    for r in rows:
        print(f"{r['config']:58s} {r['tokens_per_s']:10.2f} {r['predicted_tokens_per_s']:10.2f} "
              f"{r['prediction_error']:+7.1%}")
    live = [r["config"] for r in sorted(rows, key=lambda r: -r["tokens_per_s"])]
    pred = [r["config"] for r in sorted(rows, key=lambda r: -r["predicted_tokens_per_s"])]
    worst = max(abs(r["prediction_error"]) for r in rows)
    swaps, ties = rank_swaps({r["config"]: r["tokens_per_s"] for r in rows},
                             {r["config"]: r["predicted_tokens_per_s"] for r in rows})
    print(f"largest error {worst:.1%}; same ranking: {not swaps}"
          + (f" (live ties, within 1%: {ties})" if ties else ""))
    if live != pred:
        print(f"  live:   {live}\n  replay: {pred}")
    from adaspec.bench.replay import predict_configs

    rounds_equal = {}
    by_name = {c.name: c for c in cfgs}
    for name, res in predict_configs(trace, cfgs).items():
        if isinstance(res, str) or res.time_dependent or not by_name[name].drafters:
            continue
        mine = [(r.name, r.drafted, r.accepted) for r in res.rounds]
        ref = [(r["drafter"], r["drafted"], r["accepted"]) for r in run.rounds if r["config"] == name]
        rounds_equal[name] = mine == ref
    print(f"replayed rounds equal to the live ones: {rounds_equal}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "same_ranking": not swaps, "rank_ties": ties,
                                               "largest_error": worst, "grid_measure_s": surface.measure_s,
                                               "live_s": live_s, "record_s": rec_s,
                                               "rounds_equal": rounds_equal}, indent=1))


if __name__ == "__main__":
    main()
