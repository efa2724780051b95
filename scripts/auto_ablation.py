"""The `auto` ablation by replay of a recorded trace (issue `auto`): the objective (time vs
accepted length), full vs bandit feedback, warm start (global vs request scope) and looking at
the blocks first, against the best single-drafter configurations, on the same trace and the
same basis (predicted seconds over replay's AR). Seconds to run.

    adaspec bench --config benchmarks/smollm2-auto.toml -o results/smollm2-auto   # records trace.npz
    python scripts/auto_ablation.py results/smollm2-auto/trace.npz
    python scripts/auto_ablation.py TRACE --costs docs/results/smollm2-llamacpp/surface.json  # llama.cpp's curve
    python scripts/auto_ablation.py TRACE --by-category --diagnose
    python scripts/auto_ablation.py TRACE --variant auto:shrink=0.5 --variant auto:prior_weight=16  # a sweep

``--costs FILE`` prices the same rounds on another verify-cost surface (JSON as
``VerifyCostSurface.to_dict``): greedy paths are the target's argmax on every backend, so a
trace's acceptance data transfers. ``--by-category`` adds speed-ups per prompt category and
the per-round oracle (least time, hindsight); ``--diagnose`` breaks auto's rounds down into
where it loses against that oracle: drafts with nothing accepted, the other drafter accepting
more, plain steps where a drafter would have been accepted, caps too long or too short.
``--context-bound`` fits, in hindsight on every position of the trace, the best fixed
(drafter, k) for each of auto's peek contexts (``peek_context``: agreement and match bucket)
and walks it: what a rule that sees only those features can get without adapting within a
request. When it is no better than ``auto``, better learning on these features cannot close
the gap to the per-round oracle; only features that tell long runs from short ones can.
``--context-feature`` adds one candidate feature to those contexts (``CONTEXT_FEATURES``: was
the drafter right at the previous position(s), how far the drafters' blocks agree).
"""

from __future__ import annotations

import argparse
import dataclasses
from collections import defaultdict

from adaspec.bench.replay import (ReplayResult, _peekers, _Pool, _RoundPricer, _views, load_surface, oracle_bounds,
                                  replay)
from adaspec.bench.trace import Trace
from adaspec.costs import VerifyCostSurface
from adaspec.drafters import drafter_family
from adaspec.selection.auto import peek_context

POOL = ["prompt-lookup", "suffix", "none"]
ROWS = [
    ("suffix + cost-model (best single drafter live)", None, "cost-model", ["suffix"]),
    ("prompt-lookup + cost-model", None, "cost-model", ["prompt-lookup"]),
    ("suffix + auto length", None, "auto", ["suffix"]),
    ("auto (default: time objective, looks first, lower-bound estimates, warm start)", "auto", None, POOL),
    ("auto, shrink=0 (plans on posterior means)", "auto:shrink=0", None, POOL),
    ("auto, peek=0 (no looking: the engine scores every drafter)", "auto:peek=0", None, POOL),
    ("auto, peek=0, shrink=0 (the controller before this change)", "auto:peek=0,shrink=0", None, POOL),
    ("auto, objective=length (the papers' objective: expected accepted tokens)", "auto:objective=length", None, POOL),
    ("auto, feedback=bandit (chosen drafter's rounds only)", "auto:feedback=bandit", None, POOL),
    ("auto, scope=request (no warm start across requests)", "auto:scope=request", None, POOL),
    ("hedgespec + cost-model", "hedgespec:scope=global", "cost-model", POOL),
]
#: short names of the rows shown per category
SHORT = {"sfx+cm": ROWS[0][0], "pl+cm": ROWS[1][0], "sfx+auto-len": ROWS[2][0], "auto": ROWS[3][0],
         "auto:shrink=0": ROWS[4][0], "auto:peek=0": ROWS[5][0], "auto before": ROWS[6][0]}


def category(trace: Trace, p: int) -> str:
    return str(trace.prompts[p].meta.get("category", "all"))


def by_category(trace: Trace, r: ReplayResult) -> dict[str, float]:
    """Speed-up over replay's AR per prompt category (priced seconds, policy time excluded)."""
    ar: dict[str, float] = defaultdict(float)
    sec: dict[str, float] = defaultdict(float)
    for pr in r.prompts:
        ar[category(trace, pr.index)] += pr.ar_seconds
        sec[category(trace, pr.index)] += pr.seconds
    return {c: ar[c] / sec[c] for c in ar}


def oracle_by_category(trace: Trace, costs: VerifyCostSurface | None) -> dict[str, float]:
    """The per-round oracle (least time, hindsight) per category: a sub-trace per category."""
    out = {}
    for c in dict.fromkeys(category(trace, p) for p in range(len(trace.prompts))):
        idx = [p for p in range(len(trace.prompts)) if category(trace, p) == c]
        sub = dataclasses.replace(trace, prompts=[trace.prompts[p] for p in idx], cache={})
        out[c] = oracle_bounds(sub, 5, POOL[:2], costs=costs)["dp_time"]["speedup"]
    return out


def diagnose(trace: Trace, r: ReplayResult, costs: VerifyCostSurface | None) -> None:
    """Where auto's rounds lose, per category: counts and the verify seconds they add over a
    plain step (priced on the same surface as the replay)."""
    surface = costs if costs is not None else trace.surface.scaled(trace.overheads.verify_factor)
    idx = {name: trace.index_of(name) for name in POOL[:2]}
    rows: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for pr in r.prompts:
        pt = trace.prompts[pr.index]
        cat = category(trace, pr.index)
        t = pt.n_prompt
        for rd in pr.rounds:
            x = t - pt.n_prompt
            acc = {n: int(pt.tracks[j].accepted[x]) for n, j in idx.items()}
            best = max(acc.values())
            v1 = surface.cost(1, t - 1)
            extra = surface.cost(rd.drafted + 1, t - 1) - v1
            row = rows[cat]
            row["rounds"] += 1
            if rd.drafted > 0:
                row["draft rounds"] += 1
                row[f"chose {rd.name}"] += 1
                if rd.accepted == 0:
                    row["drafted, 0 accepted"] += 1
                    row["s lost: 0 accepted"] += extra
                other = [n for n in acc if n != rd.name]
                if other and acc[other[0]] > acc.get(rd.name, 0) and rd.accepted < min(rd.k_cap, acc[other[0]]):
                    row["other drafter better"] += 1
                if rd.drafted > rd.accepted + 1:
                    row["cap too long (>1 wasted)"] += 1
                if rd.accepted == rd.drafted and acc.get(rd.name, 0) > rd.drafted:
                    row["cap too short"] += 1
            elif best >= 2:
                row["plain step, a drafter had >=2"] += 1
            elif best == 1:
                row["plain step, a drafter had 1"] += 1
            row["accepted"] += rd.accepted
            t += rd.emitted
    keys = ["rounds", "draft rounds", "chose prompt-lookup", "chose suffix", "drafted, 0 accepted",
            "s lost: 0 accepted", "other drafter better", "cap too long (>1 wasted)", "cap too short",
            "plain step, a drafter had >=2", "plain step, a drafter had 1", "accepted"]
    cats = list(rows)
    print("\n| auto's rounds | " + " | ".join(cats) + " | all |")
    print("|---|" + "---:|" * (len(cats) + 1))
    for k in keys:
        vals = [rows[c][k] for c in cats]
        fmt = (lambda v: f"{v:.2f}") if k.startswith("s lost") else (lambda v: f"{v:.0f}")
        print(f"| {k} | " + " | ".join(fmt(v) for v in vals) + f" | {fmt(sum(vals))} |")


def _agree_len(blocks: dict[int, list[int]], j: int) -> int:
    """How many leading tokens drafter j's block shares with the longest-agreeing other block."""
    best = 0
    for i, b in blocks.items():
        if i != j and b:
            n = 0
            while n < min(len(b), len(blocks[j])) and b[n] == blocks[j][n]:
                n += 1
            best = max(best, n)
    return best


#: extra context features for ``--context-bound`` (``--context-feature``): what else might tell a
#: long run from a short one, from the drafter's accepted lengths ``acc`` at earlier positions
#: and this position's blocks
CONTEXT_FEATURES = {
    "none": lambda acc, x, blocks, j: "",
    "prev1": lambda acc, x, blocks, j: ":hot" if x >= 1 and acc[x - 1] >= 1 else "",
    "prev2": lambda acc, x, blocks, j: (":hot2" if x >= 2 and acc[x - 1] >= 1 and acc[x - 2] >= 2
                                        else ":hot" if x >= 1 and acc[x - 1] >= 1 else ""),
    "agree-len": lambda acc, x, blocks, j: f":a{min(4, _agree_len(blocks, j))}",
}


def context_bound(trace: Trace, costs: VerifyCostSurface | None, depth: int = 16,
                  feature: str = "none") -> tuple[float, float, int]:
    """The best fixed (drafter, k) per peek context, fitted on every position in hindsight and
    walked along the greedy paths (module docstring): (speed-up over AR, MAT, contexts). Rounds
    are priced as the oracle prices them (verify at the cache length plus round overhead).
    ``feature`` (``CONTEXT_FEATURES``) refines the contexts: was the drafter right at the
    previous position(s), how long do the blocks agree."""
    extra = CONTEXT_FEATURES[feature]
    pool = _Pool.of(trace, POOL)
    price = _RoundPricer(trace, pool, costs)
    cheap = [j for j, s in enumerate(pool.src) if s is not None]
    fams = [drafter_family(trace.specs[s]) if s is not None else "none" for s in pool.src]
    rows: dict[tuple[int, int], dict[int, tuple[str, int, int]]] = {}  # (p, x) -> j -> (context, len, accepted)
    for p, pt in enumerate(trace.prompts):
        views, peekers = _views(trace, p), _peekers(trace, pool, cheap, pt.prompt)
        for x in range(min(pt.n_out, trace.max_new_tokens)):
            t, blocks, match = pt.n_prompt + x, {}, {}
            for j in cheap:
                chain = views[pool.src[j]].chains[x][:depth]
                look = peekers[j].peek(pt.path[:t], depth) if j in peekers else None
                blocks[j], match[j] = chain, (look.match if look is not None and look.tokens == chain else 0)
            rows[(p, x)] = {j: (peek_context(j, blocks, match[j], fams)
                                + extra(views[pool.src[j]].accepted, x, blocks, j),
                                len(blocks[j]), views[pool.src[j]].accepted[x]) for j in cheap if blocks[j]}

    def seconds(p: int, x: int, k: int) -> float:
        return price.verify(k + 1, trace.prompts[p].n_prompt + x) + price.round_overhead()

    tokens: dict[tuple[int, str, int], float] = defaultdict(float)
    secs: dict[tuple[int, str, int], float] = defaultdict(float)
    for (p, x), row in rows.items():
        for j, (ctx, n, acc) in row.items():
            for k in range(n + 1):
                tokens[(j, ctx, k)] += min(acc, k) + 1
                secs[(j, ctx, k)] += seconds(p, x, k)
    rate = {key: tokens[key] / secs[key] for key in tokens}

    def walk(rule) -> tuple[float, int, int]:
        total, n_tok, n_rounds = 0.0, 0, 0
        for p, pt in enumerate(trace.prompts):
            end, x = min(pt.n_out, trace.max_new_tokens), 0
            while x < end:
                j, k = rule(p, x)
                total += seconds(p, x, k)
                x += min(rows[(p, x)][j][2], k) + 1 if k else 1
                n_rounds += 1
            n_tok += end
        return total, n_tok, n_rounds

    def fitted(p: int, x: int) -> tuple[int | None, int]:
        options = [(rate[(j, ctx, k)], j, k) for j, (ctx, n, _) in rows[(p, x)].items() for k in range(n + 1)]
        best = max(options, default=(0.0, None, 0))
        return best[1], best[2]

    ar = walk(lambda p, x: (None, 0))[0]
    s, n_tok, n_rounds = walk(fitted)
    return ar / s, n_tok / n_rounds, len({(j, c) for j, c, _ in tokens})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--costs", help="verify-cost surface JSON to price the rounds on (e.g. llama.cpp's)")
    ap.add_argument("--by-category", action="store_true", help="speed-ups per category and the per-round oracle")
    ap.add_argument("--diagnose", action="store_true", help="where auto's rounds lose, per category")
    ap.add_argument("--context-bound", action="store_true",
                    help="the best fixed (drafter, k) per peek context, fitted in hindsight")
    ap.add_argument("--context-feature", choices=sorted(CONTEXT_FEATURES), default="none",
                    help="with --context-bound: refine the contexts by one more feature")
    ap.add_argument("--variant", action="append", default=[], metavar="SPEC",
                    help="one more auto row over [pl, suffix, none], e.g. auto:shrink=0.5 (repeatable): a sweep")
    args = ap.parse_args()
    trace = Trace.load(args.trace)
    costs = load_surface(args.costs) if args.costs else None
    ar = replay(trace, None, None, drafters=["none"], costs=costs)
    print(f"replay of {args.trace}{' priced on ' + args.costs if costs else ''}: {len(trace.prompts)} requests; "
          f"AR {ar.tokens_per_s:.1f} tokens/s predicted\n")
    print("| configuration | predicted tokens/s | speed-up | MAT |")
    print("|---|---:|---:|---:|")
    results = {}
    rows = ROWS + [(f"{spec} (variant)", spec, None, POOL) for spec in args.variant]
    for name, sel, ln, drafters in rows:
        r = replay(trace, sel, ln, k=5, drafters=drafters, costs=costs)
        results[name] = r
        print(f"| {name} | {r.tokens_per_s:.1f} | {ar.predicted_s / r.predicted_s:.3f}x | {r.mat:.2f} |")
    ob = oracle_bounds(trace, 5, POOL[:2], costs=costs)
    print(f"| per-round oracle (least time, hindsight) | {ob['dp_time']['tokens_per_s']:.1f} | "
          f"{ob['dp_time']['speedup']:.2f}x | {ob['dp_time']['mat']:.2f} |")
    if args.by_category:
        table = {short: by_category(trace, results[n]) for short, n in SHORT.items()}
        table["oracle"] = oracle_by_category(trace, costs)
        cats = list(table["auto"])
        print("\n| speed-up over AR | " + " | ".join(cats) + " |")
        print("|---|" + "---:|" * len(cats))
        for name, row in table.items():
            print(f"| {name} | " + " | ".join(f"{row[c]:.3f}" for c in cats) + " |")
        best = {c: max(table[n][c] for n in ("sfx+cm", "pl+cm", "sfx+auto-len")) for c in cats}
        print("| auto / best single | " + " | ".join(f"{table['auto'][c] / best[c]:.3f}" for c in cats) + " |")
    if args.diagnose:
        diagnose(trace, results[ROWS[3][0]], costs)
    if args.context_bound:
        speedup, mat, n_ctx = context_bound(trace, costs, feature=args.context_feature)
        print(f"\nbest fixed (drafter, k) per peek context, fitted in hindsight ({n_ctx} contexts): "
              f"{speedup:.3f}x over AR, MAT {mat:.2f} (auto {ar.predicted_s / results[ROWS[3][0]].predicted_s:.3f}x)")


if __name__ == "__main__":
    main()
