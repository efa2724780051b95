"""Speed-up under sampling, per drafter and for auto, at several temperatures and seeds, in one
process (one model load, one table): the measurement of issue "sampling metric".

    python scripts/sampling_bench.py --per-category 1 -n 96 --temperatures 0.3,0.7,1.0 --seeds 1,2

Each (temperature, seed) is one ``run_bench`` over the same prompts with AR and every
configuration; speed-up is tokens/s over AR's tokens/s in that run (answers differ in length
under sampling, so whole seconds would mix speed with length: ``BenchRun.speedup_basis``).
Prints, per configuration and temperature, the mean speed-up over the seeds with its range, and
the MAT; ``--json`` writes every run's numbers.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from statistics import fmean

from adaspec.bench.runner import BenchConfig, run_bench
from adaspec.bench.workloads import load_workload
from adaspec.models import load_model


def configs(k: int) -> list[BenchConfig]:
    return [BenchConfig("AR (no drafter)", []),
            BenchConfig(f"prompt-lookup k={k}", ["prompt-lookup"], k=k),
            BenchConfig(f"suffix k={k}", ["suffix"], k=k),
            BenchConfig("prompt-lookup + cost-model", ["prompt-lookup"], k=k, length="cost-model"),
            BenchConfig("suffix + cost-model", ["suffix"], k=k, length="cost-model"),
            BenchConfig("recycle + cost-model", ["recycle"], k=k, length="cost-model"),
            BenchConfig("auto over [pl, suffix, none]", ["prompt-lookup", "suffix", "none"], selector="auto"),
            BenchConfig("auto over [pl, suffix, recycle, none]", ["prompt-lookup", "suffix", "recycle", "none"],
                        selector="auto")]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--suite", default="mixed")
    ap.add_argument("--per-category", type=int, default=1)
    ap.add_argument("-n", "--max-new-tokens", type=int, default=96)
    ap.add_argument("--temperatures", default="0.3,0.7,1.0")
    ap.add_argument("--seeds", default="1,2")
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    temps = [float(t) for t in args.temperatures.split(",")]
    seeds = [int(s) for s in args.seeds.split(",")]

    target = load_model(args.model)
    work = load_workload(args.suite, per_category=args.per_category)
    cfgs = configs(args.k)
    runs: list[dict] = []
    t_start = time.perf_counter()
    for temp in temps:
        for seed in seeds:
            t0 = time.perf_counter()
            run = run_bench(target, cfgs, work, args.max_new_tokens, temperature=temp, seed=seed,
                            measure_costs=False, suite=args.suite,
                            progress=lambda m, t=temp, s=seed: print(f"  T={t} seed={s}: {m}", file=sys.stderr,
                                                                      flush=True))
            assert run.speedup_basis == "tokens per second"
            rows = {r.name: {"speedup": run.speedup(r), "tokens_per_s": r.tokens_per_s, "mat": r.mat,
                             "tokens": r.tokens} for r in run.results}
            runs.append({"temperature": temp, "seed": seed, "rows": rows})
            print(f"T={temp} seed={seed}: {time.perf_counter() - t0:.0f} s; "
                  + ", ".join(f"{n} {v['speedup']:.2f}x" for n, v in rows.items() if v["speedup"] != 1.0),
                  file=sys.stderr, flush=True)

    print(f"\n{len(work)} prompts ({args.suite}) x {args.max_new_tokens} tokens, seeds {seeds}, "
          f"speed-up = tokens/s over AR's in the same run, mean over seeds [min-max]; MAT in brackets; "
          f"{time.perf_counter() - t_start:.0f} s in all\n")
    print("| configuration | " + " | ".join(f"T={t}" for t in temps) + " |")
    print("|---|" + "---:|" * len(temps))
    for c in cfgs[1:]:
        cells = []
        for temp in temps:
            sp = [r["rows"][c.name]["speedup"] for r in runs if r["temperature"] == temp]
            mat = fmean(r["rows"][c.name]["mat"] for r in runs if r["temperature"] == temp)
            cells.append(f"{fmean(sp):.2f}x [{min(sp):.2f}-{max(sp):.2f}] (MAT {mat:.2f})")
        print(f"| {c.name} | " + " | ".join(cells) + " |")
    ar = [fmean(r["rows"][cfgs[0].name]["tokens_per_s"] for r in runs if r["temperature"] == t) for t in temps]
    print("| AR tokens/s | " + " | ".join(f"{v:.1f}" for v in ar) + " |")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"args": vars(args), "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
