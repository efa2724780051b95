"""Where `auto`'s policy time goes in a live engine: per-call timers around looking (the
engine's peeks), planning (``choose``), learning (``observe``), the length policy's per-token
decisions and the cost model's bookkeeping, on the built-in suite, after one untimed pass
(the engine warmed). Prints the policy and scoring shares of the wall time (``RoundRecord``)
and each call's microseconds per round. Not a test: numbers depend on the machine and its load.

    python scripts/policy_split.py                                   # SmolLM2 PyTorch, the pool if cached
    python scripts/policy_split.py --no-pool
    python scripts/policy_split.py --backend llama.cpp -d prompt-lookup -d suffix -d none --tokens 128
"""

from __future__ import annotations

import argparse
import functools
import time
from typing import Any

from adaspec import SpeculativeEngine
from adaspec import engine as engine_mod
from adaspec.bench.workloads import load_workload
from adaspec.config import GenerationConfig
from adaspec.selection import auto as auto_mod


def timed(acc: dict[str, float], obj: Any, name: str, key: str) -> None:
    """Wrap ``obj.name`` (a class attribute) to add its seconds to ``acc[key]``."""
    f = getattr(obj, name)

    @functools.wraps(f)
    def g(*a: Any, **k: Any) -> Any:
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            acc[key] = acc.get(key, 0.0) + time.perf_counter() - t

    setattr(obj, name, g)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", default="smollm2")
    ap.add_argument("--backend", default="transformers")
    ap.add_argument("-d", "--drafter", action="append", default=None, help="drafters (default: auto's pool)")
    ap.add_argument("--no-pool", action="store_true", help="without the trained pool's drafters")
    ap.add_argument("--suite", default="mixed")
    ap.add_argument("--per-category", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--shares-only", action="store_true",
                    help="no per-call timers (they add ~1 us a call): only the records' policy and scoring shares")
    args = ap.parse_args()

    acc: dict[str, float] = {}
    wrap = (lambda *_: None) if args.shares_only else timed  # without timers: the shares as the bench measures them
    wrap(acc, auto_mod.AutoController, "choose", "plan (choose)")
    wrap(acc, auto_mod.AutoController, "observe", "learn (observe)")
    wrap(acc, auto_mod.AutoController, "observe_proposals", "read looks (observe_proposals)")
    wrap(acc, auto_mod.AutoController, "evaluate", "scoring gate (evaluate)")
    wrap(acc, engine_mod.SpeculativeEngine, "_peek", "look (peek)")
    kw: dict[str, Any] = {"backend": args.backend}
    if args.drafter:
        kw.update(drafters=args.drafter, selector="auto")
    if args.no_pool:
        kw["pool"] = False
    eng = SpeculativeEngine.from_pretrained(args.model, **kw)
    wrap(acc, type(eng.length), "decide", "per-token stop (decide)")
    wrap(acc, type(eng.length), "begin_round", "cap (begin_round)")
    wrap(acc, type(eng.length), "update", "length update")
    wrap(acc, type(eng.cost_model), "observe", "cost model observe")
    prompts = load_workload(args.suite, per_category=args.per_category)
    cfg = GenerationConfig(max_new_tokens=args.tokens)

    def run() -> dict[str, float]:
        tot = {"policy": 0.0, "eval": 0.0, "total": 0.0, "rounds": 0}
        for p in prompts:
            for r in eng.generate(p.text, cfg).stats.rounds:
                tot["policy"] += r.policy_s
                tot["eval"] += r.eval_s
                tot["total"] += r.total_s
                tot["rounds"] += 1
        return tot

    run()  # warm: first forwards, the drafters' first requests
    acc.clear()
    t = run()
    n = t["rounds"]
    print(f"drafters: {', '.join(eng.drafter_names)}")
    print(f"{n} rounds, {1000 * t['total'] / n:.2f} ms a round; policy {100 * t['policy'] / t['total']:.2f}% "
          f"+ scoring {100 * t['eval'] / t['total']:.2f}% of the rounds' wall time")
    for k, v in sorted(acc.items(), key=lambda x: -x[1]):
        print(f"  {k:32s} {1e6 * v / n:8.1f} us/round  {100 * v / t['total']:.3f}%")


if __name__ == "__main__":
    main()
