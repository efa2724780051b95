"""Where a live round's time goes: AR against auto, per prompt, on a real target.

    python scripts/round_breakdown.py --backend llama.cpp --ids math-01,qa-02,translation-01

Runs plain decoding, ``auto`` over prompt lookup, suffix and ``none``, and ``auto`` over
``none`` alone (its planning without any drafter) on each prompt of the mixed suite named by
``--ids``, interleaved, ``--repeats`` times after a warm-up, and prints per configuration the
median total and the mean seconds per round of each part the engine times (verify, and its
width-1 rounds apart; drafting; catch-up; policy: looking, planning and learning; evaluation;
the rest). Seen on llama.cpp (SmolLM2 GGUF, 2 threads): auto's policy 190-205 us a round on a
6.8-7.3 ms forward, AR's 9 us, auto over none alone 63-67 us (docs/results.md, 2026-11-25 night).
"""

from __future__ import annotations

import argparse
import statistics

from adaspec import SpeculativeEngine
from adaspec.bench.runner import _turn_prompt
from adaspec.bench.workloads import load_workload
from adaspec.config import GenerationConfig
from adaspec.models import load_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--backend", default="transformers")
    ap.add_argument("--ids", default="math-01,qa-02,translation-01", help="mixed-suite prompt ids")
    ap.add_argument("-n", "--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    m = load_model(args.model, backend=args.backend)
    engines = {"AR": SpeculativeEngine(m, []),
               "auto": SpeculativeEngine(m, ["prompt-lookup", "suffix", "none"], selector="auto"),
               "auto over none": SpeculativeEngine(m, ["none"], selector="auto")}
    wanted = args.ids.split(",")
    work = [p for p in load_workload("mixed") if p.id in wanted]
    gen = GenerationConfig(max_new_tokens=args.max_new_tokens)
    for p in work:
        ids = _turn_prompt(p, 0, [], engines["AR"])
        for e in engines.values():
            e.generate(ids, GenerationConfig(max_new_tokens=16))
        runs: dict[str, list] = {k: [] for k in engines}
        for _ in range(args.repeats):
            for k, e in engines.items():
                runs[k].append(e.generate(ids, gen).stats)
        print(f"== {p.id} ({len(ids)} prompt tokens); us per round")
        for k, sts in runs.items():
            rounds = [r for s in sts for r in s.rounds]
            n = len(rounds)

            def mean_us(attr: str) -> float:
                return sum(getattr(r, attr) for r in rounds) / n * 1e6

            w1 = [r.verify_s for r in rounds if r.drafted == 0]
            rest = sum(r.total_s - r.verify_s - r.draft_s - r.catch_up_s - r.policy_s - r.eval_s
                       for r in rounds) / n * 1e6
            print(f"  {k:15s} median total {statistics.median(s.total_s for s in sts) * 1e3:7.1f} ms, "
                  f"{len(sts[-1].rounds):4d} rounds | verify {mean_us('verify_s'):6.0f} "
                  f"(width 1: {statistics.fmean(w1) * 1e6 if w1 else 0:6.0f}) draft {mean_us('draft_s'):4.0f} "
                  f"catch-up {mean_us('catch_up_s'):4.0f} policy {mean_us('policy_s'):4.0f} "
                  f"eval {mean_us('eval_s'):4.0f} rest {rest:4.0f}")


if __name__ == "__main__":
    main()
