"""Continuous batching benchmark (issue 19): total tokens/s and per-request latency at several
concurrency levels, for the sequential batch-1 engine with ``auto``, batched AR and batched
``auto``, on SmolLM2, greedy, the built-in prompts, in one process (one model load).

    PYTHONPATH=src python scripts/batch_bench.py --concurrency 1,2,4,8,16,32 --out docs/results/batch

At each level C, C x ``--rounds-of-requests`` requests (at least ``--min-requests``, at most
``--max-requests``) arrive at once: the sequential engine serves them one after the other, the
batch engines keep C rows busy (a finished row is refilled from the queue at once). TTFT is
from the common arrival to a request's first token (queueing included); per-token latency is
(finish - first token) / (tokens - 1). A level stops admitting requests after ``--level-s``
seconds (those in flight finish). ``mismatch`` counts requests whose greedy output differs
from the sequential engine's (fp32 batched forwards are not bit-identical: near-ties can flip),
and in brackets those that the tie-aware checker (``exactness.check_tie_aware``) does not
explain as numeric near-ties (target: 0).
The verify-cost surface and the batch costs are measured before timing (once per machine, cached;
``--refresh-costs`` measures them again: do, on a quiet machine, if they were measured under load).
Writes ``bench.json`` and ``bench.md`` in ``--out``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from statistics import quantiles

import torch

from adaspec import SpeculativeEngine
from adaspec.batch import BatchEngine, load_or_measure_batch
from adaspec.costs import BatchCosts
from adaspec.bench.workloads import load_workload
from adaspec.exactness import NEAR_TIE_NATS, check_tie_aware
from adaspec.models import load_model

MODES = ("sequential-auto", "batched-ar", "batched-auto")


def pct(xs: list[float], q: int) -> float:
    if not xs:
        return float("nan")
    if len(xs) == 1:
        return xs[0]
    return quantiles(xs, n=100, method="inclusive")[q - 1]


def summarise(mode: str, level: int, arrivals: float, first: dict[int, float], done: dict[int, float],
              tokens: dict[int, list[int]], end: float) -> dict:
    ttft = [first[i] - arrivals for i in done if i in first]
    tpot = [(done[i] - first[i]) / (len(tokens[i]) - 1) for i in done if len(tokens[i]) > 1]
    total = sum(len(tokens[i]) for i in done)
    wall = end - arrivals
    return {"mode": mode, "concurrency": level, "requests": len(done), "tokens": total, "wall_s": wall,
            "tokens_per_s": total / wall if wall > 0 else 0.0,
            "ttft_p50_s": pct(ttft, 50), "ttft_p95_s": pct(ttft, 95),
            "tpot_p50_s": pct(tpot, 50), "tpot_p95_s": pct(tpot, 95)}


def run_sequential(engine: SpeculativeEngine, prompts: list[list[int]], max_new: int, level_s: float):
    first: dict[int, float] = {}
    done: dict[int, float] = {}
    tokens: dict[int, list[int]] = {}
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        if time.perf_counter() - t0 > level_s:
            break

        def on_tokens(chunk: list[int], i: int = i) -> None:
            first.setdefault(i, time.perf_counter())

        tokens[i] = engine.generate(p, max_new_tokens=max_new, on_tokens=on_tokens).token_ids
        done[i] = time.perf_counter()
    return t0, first, done, tokens


def run_batched(engine: SpeculativeEngine, prompts: list[list[int]], max_new: int, level: int,
                level_s: float, costs: BatchCosts | None):
    batch = BatchEngine(engine, max_batch=level, batch_costs=costs)
    first: dict[int, float] = {}
    done: dict[int, float] = {}
    tokens: dict[int, list[int]] = {}
    t0 = time.perf_counter()
    ids = {batch.add(p, max_new_tokens=max_new): i for i, p in enumerate(prompts)}
    while len(batch):
        if time.perf_counter() - t0 > level_s:  # stop admitting: drop the queued ones
            for rid in batch.queued:
                batch.cancel(rid)
        for ev in batch.step():
            i = ids[ev.request]
            if ev.tokens:
                first.setdefault(i, time.perf_counter())
                tokens.setdefault(i, []).extend(ev.tokens)
            if ev.finished:
                done[i] = time.perf_counter()
    return t0, first, done, tokens


def table(rows: list[dict]) -> str:
    head = ("| concurrency | mode | requests | tokens/s | TTFT p50 (s) | TTFT p95 (s) | per-token p50 (ms) "
            "| per-token p95 (ms) | differ (not near-tie) |\n|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        lines.append(f"| {r['concurrency']} | {r['mode']} | {r['requests']} | {r['tokens_per_s']:.1f} | "
                     f"{r['ttft_p50_s']:.2f} | {r['ttft_p95_s']:.2f} | {r['tpot_p50_s'] * 1e3:.1f} | "
                     f"{r['tpot_p95_s'] * 1e3:.1f} | {r.get('mismatch', 0)} ({r.get('mismatch_not_tie', 0)}) |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--suite", default="mixed")
    ap.add_argument("--concurrency", default="1,2,4,8,16,32")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("-n", "--max-new-tokens", type=int, default=128)
    ap.add_argument("--rounds-of-requests", type=int, default=2, help="requests per level = this x concurrency")
    ap.add_argument("--min-requests", type=int, default=8)
    ap.add_argument("--max-requests", type=int, default=64)
    ap.add_argument("--level-s", type=float, default=600.0, help="stop admitting requests after this long")
    ap.add_argument("--grid-rows", default="1,2,4,8,16,32", help="rows of the batch cost grid")
    ap.add_argument("--refresh-costs", action="store_true",
                    help="measure the verify-cost surface and the batch costs again (on a quiet machine)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default="docs/results/batch")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise SystemExit(f"unknown mode(s) {bad}: use {', '.join(MODES)}")
    levels = [int(x) for x in args.concurrency.split(",")]
    target = load_model(args.model)
    engines = {"sequential-auto": SpeculativeEngine(target), "batched-ar": SpeculativeEngine(target, ["none"]),
               "batched-auto": SpeculativeEngine(target)}
    print("verify-cost surfaces (measured once per machine, cached)...", flush=True)
    engines["sequential-auto"].verify_costs(refresh=args.refresh_costs)
    costs = None
    if "batched-auto" in modes and max(levels) > 1:
        costs = load_or_measure_batch(target, rows=[int(x) for x in args.grid_rows.split(",")],
                                      refresh=args.refresh_costs)
        for c in costs.contexts:
            print(costs.table(c), flush=True)
    prompts_all = [engines["sequential-auto"].encode_prompt(p.turns[0]) for p in load_workload(args.suite)]
    warm = prompts_all[-1]
    for m in modes:  # warm-up (untimed): first-shape allocations, the learners' first request
        if m == "sequential-auto":
            engines[m].generate(warm, max_new_tokens=16)
        else:
            warm_batch = BatchEngine(engines[m], max_batch=2, batch_costs=costs)
            for _ in range(2):
                warm_batch.add(warm, max_new_tokens=16)
            warm_batch.run()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    for level in levels:
        n = min(args.max_requests, max(args.min_requests, args.rounds_of_requests * level))
        prompts = [prompts_all[i % len(prompts_all)] for i in range(n)]
        reference: dict[int, list[int]] = {}
        for mode in modes:
            print(f"concurrency {level}: {mode}, {n} requests ...", flush=True)
            if mode == "sequential-auto":
                t0, first, done, tokens = run_sequential(engines[mode], prompts, args.max_new_tokens, args.level_s)
                reference = {i: tokens[i] for i in done}
            else:
                t0, first, done, tokens = run_batched(engines[mode], prompts, args.max_new_tokens, level,
                                                      args.level_s, costs)
            row = summarise(mode, level, t0, first, done, tokens, max(done.values(), default=t0))
            differ = [i for i in done if i in reference and reference[i] != tokens[i]]
            row["mismatch"] = len(differ)
            # a difference is a numeric near-tie when every token is the target's argmax or within
            # NEAR_TIE_NATS of it (teacher-forced on the batched output itself)
            row["mismatch_not_tie"] = sum(1 for i in differ if not check_tie_aware(
                target.model, prompts[i], tokens[i], max_gap=NEAR_TIE_NATS).ok)
            rows.append(row)
            print(f"  {row['requests']} requests, {row['tokens_per_s']:.1f} tokens/s, TTFT p50 "
                  f"{row['ttft_p50_s']:.2f}s p95 {row['ttft_p95_s']:.2f}s, per token p50 "
                  f"{row['tpot_p50_s'] * 1e3:.1f}ms, mismatch {row['mismatch']}", flush=True)
            (out / "bench.json").write_text(json.dumps({"args": vars(args), "threads": torch.get_num_threads(),
                                                        "rows": rows}, indent=2))
    md = f"# Continuous batching ({args.model}, greedy, suite {args.suite}, {args.max_new_tokens} new tokens)\n\n"
    (out / "bench.md").write_text(md + table(rows) + "\n")
    print(table(rows))


if __name__ == "__main__":
    main()
