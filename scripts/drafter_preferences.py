"""Which drafter an adaptive configuration chose, and how long it drafted, per category, from
bench runs' rounds.csv (issue 20: "the same `auto` on both backends shows the same drafter
preferences where the verify-cost curves agree"), beside each run's verify-cost curve.

    python scripts/drafter_preferences.py torch=RUN_A/rounds.csv llama.cpp=RUN_B/rounds.csv \
        --costs torch=COSTS_A.json --costs llama.cpp=COSTS_B.json
    D=docs/results/smollm2-backend-preferences   # the 2026-11-29 comparison (rounds.csv gzipped)
    python scripts/drafter_preferences.py PyTorch=$D/torch/rounds.csv.gz llama.cpp=$D/llamacpp/rounds.csv.gz \
        --costs PyTorch=$D/torch-costs.json --costs llama.cpp=$D/llamacpp-costs.json

Per category and run: the share of rounds that drafted, the mean drafted block of those
rounds, each drafter's share of them, and the accepted share of drafted tokens. ``--config``
picks the configuration (default: the first whose name starts with ``auto``).
"""
from __future__ import annotations

import argparse
import csv
import gzip
from collections import defaultdict
from pathlib import Path

from adaspec.bench.replay import load_surface


def _labelled(text: str) -> tuple[str, Path]:
    label, sep, path = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"{text!r}: expected LABEL=PATH")
    return label, Path(path).expanduser()


def read_rounds(path: Path, config: str | None) -> tuple[str, list[dict[str, str]]]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    names = list(dict.fromkeys(r["config"] for r in rows))
    name = config or next((n for n in names if n.startswith("auto")), None)
    if name not in names:
        raise SystemExit(f"{path}: no configuration {name!r}; it has {names}")
    return name, [r for r in rows if r["config"] == name]


def preferences(rows: list[dict[str, str]]) -> dict[str, dict[str, float | dict[str, float]]]:
    """Per category (and ``all``): drafting share, mean block, drafter shares, acceptance."""
    groups: dict[str, list[dict[str, str]]] = defaultdict(list)
    for r in rows:
        groups[r["category"]].append(r)
        groups["all"].append(r)
    out = {}
    for cat, rs in groups.items():
        drafting = [r for r in rs if int(r["drafted"]) > 0]
        drafted = sum(int(r["drafted"]) for r in drafting)
        by = defaultdict(int)
        for r in drafting:
            by[r["drafter"]] += 1
        out[cat] = {"rounds": len(rs), "drafting": len(drafting) / max(1, len(rs)),
                    "block": drafted / max(1, len(drafting)),
                    "accepted": sum(int(r["accepted"]) for r in drafting) / max(1, drafted),
                    "shares": {d: n / max(1, len(drafting)) for d, n in sorted(by.items())}}
    return out


def curve(path: Path, context: int) -> str:
    """The verify-cost ratios (k tokens against one) of a grid at ``context`` cached tokens."""
    c = load_surface(str(path)).curve(context)
    return f"cache {context}: " + ", ".join(f"k={k} {s / c.seconds[0]:.2f}x" for k, s in zip(c.ks, c.seconds))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", type=_labelled, help="LABEL=rounds.csv, one per run")
    ap.add_argument("--config", help="configuration name (default: the first auto one)")
    ap.add_argument("--costs", action="append", type=_labelled, default=[], help="LABEL=cost grid JSON")
    ap.add_argument("--context", type=int, default=256, help="cache length of the printed curves")
    args = ap.parse_args()
    tables = {}
    for label, path in args.runs:
        name, rows = read_rounds(path, args.config)
        tables[label] = preferences(rows)
        print(f"{label}: {name!r}, {len(rows)} rounds ({path})")
    for label, path in args.costs:
        print(f"{label} verify curve, {curve(path, args.context)}")
    labels = list(tables)
    cats = sorted({c for t in tables.values() for c in t} - {"all"}) + ["all"]
    print("\n| category | " + " | ".join(f"{lb}: drafting rounds, mean block, accepted, drafter shares"
                                      for lb in labels) + " |")
    print("|---|" + "---|" * len(labels))
    for cat in cats:
        cells = []
        for lb in labels:
            p = tables[lb].get(cat)
            if p is None:
                cells.append("")
                continue
            shares = " / ".join(f"{d} {s:.0%}" for d, s in p["shares"].items())
            cells.append(f"{p['drafting']:.0%}, {p['block']:.1f}, {p['accepted']:.0%}, {shares}")
        print(f"| {cat} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
