"""Speed-up under sampling at several temperatures and seeds (``adaspec bench --temperatures
0.3,0.7,1.0 --seeds 1,2``), in one process: one ``run_bench`` per (temperature, seed) over the
same prompts with AR and every configuration. The speed-up is tokens/s over AR's tokens/s in
that run (answers differ in length under sampling, so whole seconds would mix speed with
length: ``BenchRun.speedup_basis``); a cell is the mean over the seeds with its range, and the
mean MAT. Sampled outputs are not compared with AR's (they are equal in distribution, not token
for token: the exactness tests check that)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from statistics import mean
from typing import Any

from ..errors import ConfigError


def parse_list(option: str, text: str, cast: type = float, example: str = "0.3,0.7,1.0") -> tuple:
    """``"0.3,0.7"`` -> (0.3, 0.7) (``cast`` each), with an error naming the option and the fix."""
    kind = "integers" if cast is int else "numbers"
    try:
        values = tuple(cast(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ConfigError(f"{option} {text!r}: give {kind}, comma-separated ({option} {example})") from None
    if not values:
        raise ConfigError(f"{option} is empty: give at least one value ({option} {example})")
    return values


def parse_temperatures(text: str) -> tuple[float, ...]:
    values = parse_list("--temperatures", text)
    if any(not v > 0 for v in values):
        raise ConfigError(f"--temperatures {text}: every value must be > 0 (greedy is the plain bench)")
    return values


def run_temperatures(run: Callable[[float, int], Any], temperatures: Sequence[float],
                     seeds: Sequence[int]) -> dict:
    """``run(temperature, seed)`` -> a ``BenchRun`` for every pair; the table's rows
    (``{"config", "cells": {T: {"mean", "min", "max", "mat"}}}``), AR's tokens/s per
    temperature and every run's overall rows."""
    runs: dict[float, list[Any]] = {t: [run(t, s) for s in seeds] for t in temperatures}
    names = [r.name for r in next(iter(runs.values()))[0].results]
    rows = []
    for name in names[1:]:
        cells = {}
        for t, these in runs.items():
            ups = [b.speedup(b.result(name)) for b in these]
            cells[t] = {"mean": mean(ups), "min": min(ups), "max": max(ups),
                        "mat": mean(b.result(name).mat for b in these)}
        rows.append({"config": name, "cells": cells})
    ar = {t: mean(b.result(names[0]).tokens_per_s for b in these) for t, these in runs.items()}
    return {"temperatures": list(temperatures), "seeds": list(seeds), "rows": rows, "ar_tokens_per_s": ar,
            "runs": {str(t): [b.summary()["overall"] for b in these] for t, these in runs.items()}}


def temperatures_table(table: dict) -> str:
    """The table as markdown: a row per configuration, a column per temperature."""
    ts = table["temperatures"]
    lines = ["| configuration | " + " | ".join(f"T={t:g}" for t in ts) + " |", "|---|" + "---:|" * len(ts)]
    for row in table["rows"]:
        cells = [f"{c['mean']:.2f}x [{c['min']:.2f}-{c['max']:.2f}] ({c['mat']:.2f})"
                 for c in (row["cells"][t] for t in ts)]
        lines.append(f"| {row['config']} | " + " | ".join(cells) + " |")
    lines.append("| AR tokens/s | " + " | ".join(f"{table['ar_tokens_per_s'][t]:.1f}" for t in ts) + " |")
    return "\n".join(lines)
