"""The pool's trained heads on a benchmark suite's prompts, without a live benchmark run.

The target's greedy answers to the suite's first turns are distilled once per category (cached
in ``--out``), then every head's engine rounds at k=5 are walked along them
(``evaluate_drafters(..., heldout_fraction=None)``: for a greedy run on the same text this equals
what the live engine accepts, tested on tiny models). Prints MAT@5 per head and category as a
markdown table, each specialist's own categories in bold. Minutes instead of the half hour a
live ``benchmarks/smollm2-pool.toml`` run takes; it gives acceptance only, not speed.

    python scripts/heads_on_suite.py [--model smollm2] [--suite all] [--per-category 6]
                                     [--max-new-tokens 64] [--out results/heads-on-suite]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from adaspec.training.distill import distill_run
from adaspec.training.drafters import evaluate_drafters
from adaspec.models import load_model
from adaspec.training.pool import GENERALIST, default_pool_root, load_manifest
from adaspec.bench.workloads import load_suite
from adaspec.bench.report import DOMAIN_CATEGORIES


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--pool", default=None, help="pool directory (default: the cache's pool/MODEL)")
    ap.add_argument("--suite", default="all")
    ap.add_argument("--per-category", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", default="results/heads-on-suite", help="where the distilled answers are kept")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = load_model(args.model)
    manifest = load_manifest(args.pool or default_pool_root(target))
    heads = {name: Path(e.reports["feature-head"]["out"]) for name, e in manifest.entries.items()
             if "feature-head" in e.reports}
    prompts = load_suite(args.suite, per_category=args.per_category)
    cats = list(dict.fromkeys(p.category for p in prompts))
    sets = []
    for cat in cats:
        todo = [(p.id, p.messages()) for p in prompts if p.category == cat]
        run = distill_run(target, todo, Path(args.out) / cat, domain="chat", temperatures=(0.0,),
                          max_new_tokens=args.max_new_tokens, batch_size=len(todo))
        sets.append(run.path)
    rows = evaluate_drafters("feature-head", target, list(heads.values()), sets, heldout_fraction=None)
    print(f"MAT@5 along the target's greedy answers ({args.per_category} prompts per category, "
          f"{args.max_new_tokens} tokens)\n")
    print("| head | " + " | ".join(cats) + " |")
    print("|---|" + "---:|" * len(cats))
    for name, row in zip(heads, rows):
        own = DOMAIN_CATEGORIES.get(name, ()) if name != GENERALIST else ()
        cells = [f"**{row[c]['mat_k5']:.2f}**" if c in own else f"{row[c]['mat_k5']:.2f}" for c in cats]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
