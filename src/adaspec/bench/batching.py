"""Continuous batching benchmark (``adaspec bench --concurrency 1,4,16``): total tokens/s and
per-request latency at several concurrency levels, for the one-request-at-a-time engine with
``auto``, batched plain decoding and batched ``auto`` (``BatchEngine``), greedy, one model load.

At each level C, ``max(min_requests, rounds_of_requests x C)`` requests (at most
``max_requests``) arrive at once: the sequential engine serves them one after the other, the
batch engines keep C rows busy (a finished row is refilled from the queue at once). TTFT is
from the common arrival to a request's first token (queueing included); per-token latency is
(finish - first token) / (tokens - 1). ``mismatch`` counts requests whose greedy output differs
from the sequential engine's (batched fp32 forwards are not bit-identical, so near-ties can
flip), and ``mismatch_not_tie`` those the tie-aware checker (``exactness.check_tie_aware``)
does not explain as numeric near-ties (the contract: 0). The verify-cost surface and the batch
costs are measured before timing (once per machine, cached).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from statistics import quantiles
from typing import Any

from ..errors import ConfigError

MODES = ("sequential-auto", "batched-ar", "batched-auto")


@dataclass(frozen=True)
class BatchingPlan:
    """What ``run_batching`` runs: the concurrency levels, the modes and the request counts."""

    levels: tuple[int, ...]
    modes: tuple[str, ...] = MODES
    max_new_tokens: int = 128
    rounds_of_requests: int = 2
    min_requests: int = 8
    max_requests: int = 64
    grid_rows: tuple[int, ...] = (1, 2, 4, 8, 16, 32)

    def __post_init__(self) -> None:
        if not self.levels or any(not isinstance(c, int) or c < 1 for c in self.levels):
            raise ConfigError(f"--concurrency {','.join(map(str, self.levels)) or '(empty)'}: give levels >= 1, "
                              "comma-separated (--concurrency 1,4,16)")
        bad = [m for m in self.modes if m not in MODES]
        if bad:
            raise ConfigError(f"unknown batching mode(s) {bad}: use {', '.join(MODES)}")
        if self.max_new_tokens < 1:
            raise ConfigError(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")

    def requests(self, level: int) -> int:
        return min(self.max_requests, max(self.min_requests, self.rounds_of_requests * level))


def parse_levels(text: str) -> tuple[int, ...]:
    """``"1,4,16"`` -> (1, 4, 16), with an error naming the bad part."""
    from .temperatures import parse_list

    return parse_list("--concurrency", text, int, "1,4,16")


def _pct(xs: list[float], q: int) -> float:
    if not xs:
        return float("nan")
    if len(xs) == 1:
        return xs[0]
    return quantiles(xs, n=100, method="inclusive")[q - 1]


def _summarise(mode: str, level: int, arrivals: float, first: dict[int, float], done: dict[int, float],
               tokens: dict[int, list[int]], end: float) -> dict:
    ttft = [first[i] - arrivals for i in done if i in first]
    tpot = [(done[i] - first[i]) / (len(tokens[i]) - 1) for i in done if len(tokens[i]) > 1]
    total = sum(len(tokens[i]) for i in done)
    wall = end - arrivals
    return {"mode": mode, "concurrency": level, "requests": len(done), "tokens": total, "wall_s": wall,
            "tokens_per_s": total / wall if wall > 0 else 0.0,
            "ttft_p50_s": _pct(ttft, 50), "ttft_p95_s": _pct(ttft, 95),
            "tpot_p50_s": _pct(tpot, 50), "tpot_p95_s": _pct(tpot, 95)}


def _run_sequential(engine: Any, prompts: list[list[int]], max_new: int):
    first: dict[int, float] = {}
    done: dict[int, float] = {}
    tokens: dict[int, list[int]] = {}
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        def on_tokens(chunk: list[int], i: int = i) -> None:
            first.setdefault(i, time.perf_counter())

        tokens[i] = engine.generate(p, max_new_tokens=max_new, on_tokens=on_tokens).token_ids
        done[i] = time.perf_counter()
    return t0, first, done, tokens


def _run_batched(engine: Any, prompts: list[list[int]], max_new: int, level: int, costs: Any):
    from ..batch import BatchEngine

    batch = BatchEngine(engine, max_batch=level, batch_costs=costs)
    first: dict[int, float] = {}
    done: dict[int, float] = {}
    tokens: dict[int, list[int]] = {}
    t0 = time.perf_counter()
    ids = {batch.add(p, max_new_tokens=max_new): i for i, p in enumerate(prompts)}
    while len(batch):
        for ev in batch.step():
            i = ids[ev.request]
            if ev.tokens:
                first.setdefault(i, time.perf_counter())
                tokens.setdefault(i, []).extend(ev.tokens)
            if ev.finished:
                done[i] = time.perf_counter()
    return t0, first, done, tokens


def run_batching(target: Any, workload: Sequence[Any], plan: BatchingPlan,
                 progress: Callable[[str], None] | None = None) -> list[dict]:
    """Every mode at every level of ``plan`` on the first turns of ``workload``; one row each
    (``_summarise``'s keys plus ``mismatch`` and ``mismatch_not_tie``)."""
    from ..batch import BatchEngine, load_or_measure_batch
    from ..engine import SpeculativeEngine
    from ..exactness import NEAR_TIE_NATS, check_tie_aware

    say = progress or (lambda msg: None)
    engines = {"sequential-auto": SpeculativeEngine(target), "batched-ar": SpeculativeEngine(target, ["none"]),
               "batched-auto": SpeculativeEngine(target)}
    say("verify-cost surfaces (measured once per machine, cached)")
    engines["sequential-auto"].verify_costs()
    costs = None
    if "batched-auto" in plan.modes and max(plan.levels) > 1:
        costs = load_or_measure_batch(target, rows=list(plan.grid_rows))
    prompts_all = [engines["sequential-auto"].encode_prompt(p.turns[0]) for p in workload]
    warm = prompts_all[-1]
    for m in plan.modes:  # warm-up (untimed): first-shape allocations, the learners' first request
        if m == "sequential-auto":
            engines[m].generate(warm, max_new_tokens=16)
        else:
            warm_batch = BatchEngine(engines[m], max_batch=2, batch_costs=costs)
            for _ in range(2):
                warm_batch.add(warm, max_new_tokens=16)
            warm_batch.run()
    rows: list[dict] = []
    for level in plan.levels:
        n = plan.requests(level)
        prompts = [prompts_all[i % len(prompts_all)] for i in range(n)]
        reference: dict[int, list[int]] = {}
        for mode in plan.modes:
            say(f"concurrency {level}: {mode}, {n} requests")
            if mode == "sequential-auto":
                t0, first, done, tokens = _run_sequential(engines[mode], prompts, plan.max_new_tokens)
                reference = {i: tokens[i] for i in done}
            else:
                t0, first, done, tokens = _run_batched(engines[mode], prompts, plan.max_new_tokens, level, costs)
            row = _summarise(mode, level, t0, first, done, tokens, max(done.values(), default=t0))
            differ = [i for i in done if i in reference and reference[i] != tokens[i]]
            row["mismatch"] = len(differ)
            model = getattr(target, "model", None)
            row["mismatch_not_tie"] = sum(1 for i in differ if model is None or not check_tie_aware(
                model, prompts[i], tokens[i], max_gap=NEAR_TIE_NATS).ok)
            rows.append(row)
    return rows


def batching_table(rows: Sequence[dict]) -> str:
    """The rows as a markdown table (``bench.md``)."""
    lines = ["| concurrency | mode | requests | tokens/s | TTFT p50 (s) | TTFT p95 (s) | per-token p50 (ms) "
             "| per-token p95 (ms) | differ (not near-tie) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['concurrency']} | {r['mode']} | {r['requests']} | {r['tokens_per_s']:.1f} | "
                     f"{r['ttft_p50_s']:.2f} | {r['ttft_p95_s']:.2f} | {r['tpot_p50_s'] * 1e3:.1f} | "
                     f"{r['tpot_p95_s'] * 1e3:.1f} | {r.get('mismatch', 0)} ({r.get('mismatch_not_tie', 0)}) |")
    return "\n".join(lines)
