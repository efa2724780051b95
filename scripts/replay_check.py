"""Record a trace of a bench workload, replay policies from it, and compare with a live bench.

    python scripts/replay_check.py results/smollm2-mixed [--trace trace.npz]

Reads the live run's summary.json / rounds.csv (written by ``adaspec bench``), records the same
workload for prompt-lookup and suffix (timed), replays the static configurations and a few
time-independent selectors (timed), and reports whether every replayed round (drafter, drafted,
accepted) equals the live one for the configurations the live run also has.
"""

from __future__ import annotations

import argparse
import csv
import json
import time
from collections import defaultdict
from pathlib import Path

from adaspec.models import load_model
from adaspec.bench.workloads import load_workload
from adaspec.bench.replay import replay
from adaspec.bench.trace import Trace, record


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("run", help="a bench output directory (summary.json, rounds.csv)")
    ap.add_argument("--trace", default="trace.npz")
    args = ap.parse_args()
    run = Path(args.run)
    summary = json.loads((run / "summary.json").read_text())
    live: dict[str, dict[tuple[str, int], list[tuple[str, int, int]]]] = defaultdict(lambda: defaultdict(list))
    with open(run / "rounds.csv") as fh:
        for r in csv.DictReader(fh):
            key = (r["prompt_id"], int(r["turn"]))
            live[r["config"]][key].append((r["drafter"], int(r["drafted"]), int(r["accepted"])))
    work = load_workload(summary["suite"], per_category=summary["n_prompts"] // len(summary["categories"]))
    target = load_model(summary["model"])
    drafters = ["prompt-lookup", "suffix"]
    t0 = time.perf_counter()
    trace = record(target, drafters, work, summary["max_new_tokens"], args.trace)
    rec_s = time.perf_counter() - t0
    print(f"recorded {len(work)} prompts x {summary['max_new_tokens']} tokens for {drafters} in {rec_s:.0f} s "
          f"({Path(args.trace).stat().st_size / 1e3:.0f} KB)")
    trace = Trace.load(args.trace)
    configs = [("prompt-lookup k=5", None, ["prompt-lookup"]), ("suffix k=5", None, ["suffix"]),
               ("ucbspec", "ucbspec", drafters + ["none"]), ("metasd-ucb:reward=bd", "metasd-ucb:reward=bd", drafters),
               ("hedgespec", "hedgespec", drafters), ("exp3spec:seed=1", "exp3spec:seed=1", drafters)]
    for name, sel, pool in configs:
        t0 = time.perf_counter()
        res = replay(trace, sel, None, k=5, drafters=pool)
        dt = time.perf_counter() - t0
        line = (f"{name:24s} replay {dt * 1e3:7.1f} ms ({res.n_rounds / dt:,.0f} rounds/s): MAT {res.mat:.2f}, "
                f"predicted speed-up {res.speedup:.2f}x")
        if name in live:
            rounds = [(r.name, r.drafted, r.accepted) for p in res.prompts for r in p.rounds]
            order = {p.id: i for i, p in enumerate(work)}
            ref = [x for key in sorted(live[name], key=lambda k: (order[k[0]], k[1])) for x in live[name][key]]
            same = rounds == ref
            line += f"; live MAT {next(r['mat'] for r in summary['overall'] if r['config'] == name):.2f}; " \
                    f"rounds equal to the live run: {same} ({len(rounds)} vs {len(ref)})"
        print(line)


if __name__ == "__main__":
    main()
