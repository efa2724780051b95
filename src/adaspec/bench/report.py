"""Bench reports: ``summary.json`` (schema ``adaspec.bench/1``) -> ``report.md`` and PNG plots.

The tables follow the papers' reporting: speed-up and MAT per method, the SpecDec++ discard and
verification rates (eq. 5.1), BanditSpec's stopping-time regret, and a Not-a-Bandit Table 1
style heterogeneity matrix (static drafters x categories). The field reference is
``docs/summary-schema.md``. matplotlib is imported lazily and used without pyplot (no global
backend or figure state), so importing this module stays cheap.
"""

from __future__ import annotations

import csv
import json
import logging
import math
import re
import textwrap
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import typer

from ..errors import AdaspecError

log = logging.getLogger(__name__)

SCHEMA_ID = "adaspec.bench/1"
DPI = 110
REPORT_FILE = "report.md"
PLOT_FILES = {
    "speedup": "speedup_by_category.png",
    "regret": "cumulative_regret.png",
    "drafters": "drafter_choices.png",
    "pareto": "pareto_discard_verification.png",
    "costs": "verify_costs.png",
    "surface": "verify_cost_surface.png",
}
TOP_KEYS = ("schema", "categories", "configs", "overall", "per_category")
ROW_KEYS = ("config", "prompts", "tokens", "seconds", "tokens_per_s", "speedup", "mat", "acceptance_rate",
            "discard_rate", "verification_rate", "policy_overhead_share", "identical", "mismatches",
            "stopping_time_regret", "best_arm_ratio")
ROUNDS_KEYS = ("config", "category", "position", "drafter")
DASH = "–"

LEGEND = """\
- **speed-up**: greedy: AR seconds / configuration seconds on the same prompts (the answers are
  identical); sampling: configuration tokens/s / AR tokens/s (each configuration samples answers
  of other lengths, so whole seconds would mix speed with length). AR = 1.00x; per category on
  that category's prompts only. The per-prompt oracle and the regret use the same basis.
- **tokens/s**: new tokens / wall seconds of the requests (prefill included). **decode
  tokens/s**: the tokens emitted after each request's first emission / the seconds from that
  emission to the last (adaspec rows: from the rounds' times; llama-server: its own `timings`,
  `predicted_per_second`; see docs/benchmarking.md). **prefill s / prompt**: seconds to the
  first emission of new tokens, per prompt.
- **MAT** (mean accepted tokens): generated tokens per target forward (one forward per round,
  the bonus token included; AR = 1).
- **acceptance**: accepted draft tokens / drafted tokens.
- **discard rate**: (drafted - accepted) / generated tokens; **verification rate**: rounds /
  generated tokens (SpecDec++ eq. 5.1). Both are hardware-independent: lower-left in the
  Pareto plot is better.
- **policy overhead**: policy seconds (drafter and length policies) / total seconds.
- **scoring overhead** (when present): seconds the engine spent scoring drafters a round did
  not play (full-information feedback, e.g. a model drafter's forward over the verified
  tokens) / total seconds; with the policy overhead, what choosing the drafter costs.
- **engine overhead** (when present): median over prompts of the engine's bookkeeping time per
  round / the target forward time; **rounds in cost cliff** (when present): share of rounds whose
  verify width is a cost cliff of the verify-cost curve (a wider block would have been cheaper).
- **stopping-time regret** (BanditSpec eq. 1): rounds of the policy minus rounds of the best
  fixed drafter in hindsight, summed over prompts (negative: the policy beat every fixed drafter).
- **best-arm ratio**: share of rounds in which the policy used the drafter that was best in
  hindsight for that prompt.
- **cumulative regret**: running sum over the workload, in seconds, of (policy time - best fixed
  configuration's time).
- **identical**: prompts whose output equals AR's token for token / prompts; anything less is a
  bug in a lossless method and is marked **MISMATCH** (greedy only: sampled outputs are equal in
  distribution, not token for token, so they are not compared).
"""


class SummarySchemaError(AdaspecError):
    """A bench summary is missing, malformed, or of an unknown schema version."""


# -- loading and validation -------------------------------------------------------------------
def load_summary(path: str | Path) -> dict[str, Any]:
    """Read and validate a ``summary.json`` written by ``adaspec bench``."""
    path = Path(path)
    if not path.is_file():
        raise SummarySchemaError(f"{path}: no such file; run `adaspec bench` first, it writes summary.json "
                                 "into its output directory")
    try:
        summary = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise SummarySchemaError(f"{path}: not valid JSON ({exc}); regenerate it with `adaspec bench`") from exc
    validate_summary(summary, source=str(path))
    return summary


def validate_summary(summary: Any, source: str = "summary") -> None:
    """Check the schema id and the fields the report needs; raise SummarySchemaError naming the problem."""
    if not isinstance(summary, dict):
        raise SummarySchemaError(f"{source}: expected a JSON object, got {type(summary).__name__}")
    schema = summary.get("schema")
    if schema is None:
        raise SummarySchemaError(
            f"{source}: no 'schema' field, so this is not a bench summary (an old `adaspec bench --json` "
            f"file?); expected schema '{SCHEMA_ID}': rerun `adaspec bench` and point the report at its "
            "output directory")
    if schema != SCHEMA_ID:
        raise SummarySchemaError(
            f"{source}: unknown schema {schema!r}; this adaspec reads '{SCHEMA_ID}'. Use the adaspec "
            "version that wrote the file, or rerun `adaspec bench` with this one")
    missing = [k for k in TOP_KEYS if k not in summary]
    if missing:
        raise SummarySchemaError(f"{source}: schema '{SCHEMA_ID}' but missing field(s) {missing}; "
                                 "the file is truncated or hand-edited, rerun `adaspec bench`")
    configs, overall = summary["configs"], summary["overall"]
    if not isinstance(configs, list) or not configs or not all(isinstance(c, dict) and "name" in c for c in configs):
        raise SummarySchemaError(f"{source}: 'configs' must be a non-empty list of objects with a 'name'")
    if not isinstance(overall, list) or len(overall) != len(configs):
        raise SummarySchemaError(f"{source}: 'overall' must hold one row per config ({len(configs)}), "
                                 f"got {len(overall) if isinstance(overall, list) else type(overall).__name__}")
    _check_rows(overall, f"{source}: overall")
    names = [c["name"] for c in configs]
    if [r["config"] for r in overall] != names:
        raise SummarySchemaError(f"{source}: 'overall' rows must follow 'configs' order {names}, "
                                 f"got {[r['config'] for r in overall]}")
    per_cat = summary["per_category"]
    if not isinstance(per_cat, dict):
        raise SummarySchemaError(f"{source}: 'per_category' must be an object category -> rows")
    for cat, rows in per_cat.items():
        if not isinstance(rows, list):
            raise SummarySchemaError(f"{source}: per_category[{cat!r}] must be a list of rows")
        _check_rows(rows, f"{source}: per_category[{cat!r}]")
    unknown = [c for c in per_cat if c not in summary["categories"]]
    if unknown:
        raise SummarySchemaError(f"{source}: per_category has categories {unknown} not listed in 'categories'")


def _check_rows(rows: Sequence[Any], where: str) -> None:
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise SummarySchemaError(f"{where}[{i}]: expected an object, got {type(row).__name__}")
        missing = [k for k in ROW_KEYS if k not in row]
        if missing:
            raise SummarySchemaError(f"{where}[{i}] ({row.get('config', '?')}): missing field(s) {missing}")
        if isinstance(row["identical"], bool) or not isinstance(row["identical"], int):
            raise SummarySchemaError(f"{where}[{i}] ({row['config']}): 'identical' must be the count of "
                                     f"prompts identical to AR (int), got {row['identical']!r}")
        if not isinstance(row["mismatches"], list):
            raise SummarySchemaError(f"{where}[{i}] ({row['config']}): 'mismatches' must be a list of strings")


# -- formatting -------------------------------------------------------------------------------
def _num(v: Any) -> float | None:
    """A finite float, or None for null/NaN (shown as a dash)."""
    if v is None or isinstance(v, bool):
        return None
    f = float(v)
    return None if math.isnan(f) or math.isinf(f) else f


def _fmt(v: Any, spec: str, suffix: str = "") -> str:
    f = _num(v)
    return DASH if f is None else f"{f:{spec}}{suffix}"


def _cell(text: str) -> str:
    """Escape a value for a markdown table cell."""
    return str(text).replace("|", "\\|").replace("\n", " ")


def mismatched(row: dict[str, Any]) -> bool:
    """Does the configuration's output differ from AR other than at numeric near-ties?"""
    return bool(row["mismatches"]) or row["identical"] + len(row.get("near_ties") or []) != row["prompts"]


def _identical(row: dict[str, Any], greedy: bool = True) -> str:
    same = f"{row['identical']}/{row['prompts']}"
    if mismatched(row):
        return f"**{same} MISMATCH**"
    ties = len(row.get("near_ties") or [])
    if ties:
        same += f" (+{ties} near-tie)"
    return same if greedy else "n/a (sampling)"


def _greedy(summary: dict[str, Any]) -> bool:
    return not _num(summary.get("temperature"))


def _table(header: Sequence[str], align: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def overall_table(summary: dict[str, Any]) -> str:
    """One row per configuration: throughput, speed-up, MAT, rates, regret and exactness; the optional
    engine-overhead and cost-cliff columns appear when any row has them."""
    rows_in = summary["overall"]
    extra = [(key, title) for key, title in (("scoring_overhead_share", "scoring overhead"),
                                             ("engine_overhead_share", "engine overhead"),
                                             ("cliff_share", "rounds in cost cliff"))
             if any(_num(r.get(key)) is not None for r in rows_in)]
    split = [(key, title, spec) for key, title, spec in (("decode_tokens_per_s", "decode tokens/s", ".1f"),
                                                         ("prefill_s_per_prompt", "prefill s / prompt", ".3f"))
             if any(_num(r.get(key)) is not None for r in rows_in)]  # absent from older summaries
    header = ["configuration", "tokens/s", *(t for _, t, _ in split), "speed-up", "MAT", "acceptance", "discard",
              "verification", "policy overhead", *(t for _, t in extra), "stopping-time regret", "best-arm ratio",
              "identical to AR"]
    greedy = _greedy(summary)
    rows = [[_cell(r["config"]), _fmt(r["tokens_per_s"], ".1f"), *(_fmt(r.get(k), f) for k, _, f in split),
             _fmt(r["speedup"], ".2f", "x"),
             _fmt(r["mat"], ".2f"), _fmt(_pct(r["acceptance_rate"]), ".1f", "%"), _fmt(r["discard_rate"], ".3f"),
             _fmt(r["verification_rate"], ".3f"), _fmt(_pct(r["policy_overhead_share"]), ".1f", "%"),
             *(_fmt(_pct(r.get(k)), ".1f", "%") for k, _ in extra),
             _fmt(r["stopping_time_regret"], "+.1f"), _fmt(_pct(r["best_arm_ratio"]), ".0f", "%"),
             _identical(r, greedy)] for r in rows_in]
    return _table(header, ["---"] + ["---:"] * (len(header) - 2) + ["---"], rows)


def _pct(v: Any) -> float | None:
    f = _num(v)
    return None if f is None else 100.0 * f


def _row_lookup(summary: dict[str, Any]) -> dict[str, dict[str, dict[str, Any]]]:
    """category -> config -> row; 'all' is the overall row."""
    out = {cat: {r["config"]: r for r in rows} for cat, rows in summary["per_category"].items()}
    out["all"] = {r["config"]: r for r in summary["overall"]}
    return out


def _columns(summary: dict[str, Any]) -> list[str]:
    return [c for c in summary["categories"] if c in summary["per_category"]] + ["all"]


def _best(values: Sequence[float | None], digits: int) -> set[int]:
    """Indices holding the column maximum at the displayed precision (ties all bold)."""
    shown = [None if v is None else round(v, digits) for v in values]
    present = [v for v in shown if v is not None]
    return {i for i, v in enumerate(shown) if present and v == max(present)}


def category_table(summary: dict[str, Any]) -> str:
    """Speed-up per configuration (rows) and category (columns), best per column in bold."""
    cols, lookup = _columns(summary), _row_lookup(summary)
    names = [c["name"] for c in summary["configs"]]
    grid = [[_num(lookup[col].get(n, {}).get("speedup")) for col in cols] for n in names]
    bold = [_best([grid[i][j] for i in range(len(names))], 2) for j in range(len(cols))]
    rows = [[_cell(n)] + [_bold(_fmt(grid[i][j], ".2f", "x"), i in bold[j] and grid[i][j] is not None)
                          for j in range(len(cols))] for i, n in enumerate(names)]
    return _table(["configuration", *map(_cell, cols)], ["---"] + ["---:"] * len(cols), rows)


def _bold(text: str, on: bool) -> str:
    return f"**{text}**" if on else text


def heterogeneity_matrix(summary: dict[str, Any]) -> str | None:
    """Not-a-Bandit Table 1 style: static single-drafter configs x categories, cells 'MAT / speed-up',
    the best MAT and the best speed-up of each column in bold. None when there is no static config."""
    static = [c["name"] for c in summary["configs"] if c.get("kind") == "static"]
    if not static:
        return None
    cols, lookup = _columns(summary), _row_lookup(summary)
    mat = [[_num(lookup[col].get(n, {}).get("mat")) for col in cols] for n in static]
    spd = [[_num(lookup[col].get(n, {}).get("speedup")) for col in cols] for n in static]
    rows = []
    best_mat = [_best([mat[i][j] for i in range(len(static))], 2) for j in range(len(cols))]
    best_spd = [_best([spd[i][j] for i in range(len(static))], 2) for j in range(len(cols))]
    for i, n in enumerate(static):
        cells = [f"{_bold(_fmt(mat[i][j], '.2f'), i in best_mat[j] and mat[i][j] is not None)} / "
                 f"{_bold(_fmt(spd[i][j], '.2f', 'x'), i in best_spd[j] and spd[i][j] is not None)}"
                 for j in range(len(cols))]
        rows.append([_cell(n), *cells])
    return _table(["static configuration", *map(_cell, cols)], ["---"] + ["---:"] * len(cols), rows)


#: the bench categories each pool domain serves (adaspec.training_prompts.DOMAINS -> prompt categories)
DOMAIN_CATEGORIES: dict[str, tuple[str, ...]] = {
    "code": ("code", "code-editing"), "math": ("math",), "chat": ("conversation", "qa"),
    "summarization": ("summarization", "rag", "long-context"), "translation": ("translation",)}
_POOL_ARTIFACT = re.compile(r"/drafters/([^/]+)/(feature-head)\.pt$|/drafters/([^/]+)/(tiny-lm)/?$"
                            r"|/datastores/([^/]+)\.(jsonl)$")


def _pool_drafter(spec: str) -> tuple[str, str] | None:
    """(kind, domain) of a pool artifact's spec (``feature-head:path=ROOT/drafters/code/feature-head.pt``)."""
    m = _POOL_ARTIFACT.search(spec.split("=", 1)[-1])
    if m is None:
        return None
    domain, kind = next((m.group(i), m.group(i + 1)) for i in (1, 3, 5) if m.group(i))
    return ("suffix" if kind == "jsonl" else kind), domain


def specialist_table(summary: dict[str, Any]) -> str | None:
    """Each pool specialist against the pool's generalist of the same kind, on the prompts of the
    specialist's own domain and on all other prompts (MetaSD 4.1 / Not-a-Bandit Table 1): cells
    'MAT / speed-up' over those prompts. None without a generalist and a specialist in the run."""
    static: dict[tuple[str, str], str] = {}
    for c in summary["configs"]:
        if c.get("kind") == "static" and len(c.get("drafters") or []) == 1:
            found = _pool_drafter(c["drafters"][0])
            if found is not None:
                static.setdefault(found, c["name"])
    per: dict[str, dict[str, dict[str, Any]]] = {}  # config -> prompt id -> record
    for rec in summary.get("per_prompt") or []:
        per.setdefault(rec["config"], {})[rec["prompt_id"]] = rec
    ar = per.get(summary["configs"][0]["name"], {})
    per_token = bool(_num(summary.get("temperature")))

    def cell(config: str, own: bool, domain: str) -> tuple[float | None, float | None]:
        cats = DOMAIN_CATEGORIES.get(domain, (domain,))
        recs = [r for r in per.get(config, {}).values() if (r["category"] in cats) == own]
        rounds, tokens = sum(r["rounds"] for r in recs), sum(r["tokens"] for r in recs)
        base_recs = [ar[r["prompt_id"]] for r in recs if r["prompt_id"] in ar]
        secs, base = sum(r["seconds"] for r in recs), sum(r["seconds"] for r in base_recs)
        if per_token and secs and base:  # sampling: tokens/s against AR's tokens/s
            secs, base = secs / tokens, base / sum(r["tokens"] for r in base_recs)
        return (tokens / rounds if rounds else None), (base / secs if secs and base else None)

    rows = []
    for (kind, domain), name in static.items():
        general = static.get((kind, "generalist"))
        if domain == "generalist" or general is None:
            continue
        values = [cell(n, own, domain) for own in (True, False) for n in (name, general)]
        if values[0][0] is None or values[2][0] is None:
            continue
        wins = [values[0][0] > values[1][0], values[2][0] < values[3][0]]
        text = [f"{_fmt(m, '.2f')} / {_fmt(x, '.2f', 'x')}" for m, x in values]
        rows.append([_cell(f"{domain}/{kind}"), ", ".join(DOMAIN_CATEGORIES.get(domain, (domain,))), *text,
                     "yes" if wins[0] else "no", "yes" if wins[1] else "no"])
    if not rows:
        return None
    return _table(["specialist", "own categories", "specialist, own", "generalist, own", "specialist, other",
                   "generalist, other", "beats it on own (MAT)", "loses elsewhere (MAT)"],
                  ["---", "---"] + ["---:"] * 4 + ["---", "---"], rows)


def drafter_usage_table(summary: dict[str, Any]) -> str | None:
    """Share of rounds per drafter, per category, for configs with more than one drafter (from per_prompt)."""
    multi = [c["name"] for c in summary["configs"] if len(c.get("drafters") or []) > 1]
    per_prompt = summary.get("per_prompt") or []
    if not multi or not per_prompt:
        return None
    cols = _columns(summary)
    rows = []
    for name in multi:
        counts: dict[str, dict[str, int]] = {}  # column -> drafter -> rounds
        for p in per_prompt:
            if p.get("config") != name:
                continue
            for col in (p.get("category"), "all"):
                bucket = counts.setdefault(col, {})
                for d, n in (p.get("drafter_usage") or {}).items():
                    bucket[d] = bucket.get(d, 0) + int(n)
        drafters = list(dict.fromkeys(d for b in counts.values() for d in b))
        for d in drafters:
            cells = []
            for col in cols:
                total = sum(counts.get(col, {}).values())
                cells.append(_fmt(_pct(counts[col].get(d, 0) / total) if total else None, ".0f", "%"))
            rows.append([_cell(name), _cell(d), *cells])
    if not rows:
        return None
    return _table(["configuration", "drafter", *map(_cell, cols)], ["---", "---"] + ["---:"] * len(cols), rows)


def steadiness_line(summary: dict[str, Any]) -> str | None:
    """One sentence on how much the machine's speed drifted during the run (``steadiness`` in
    summary.json): the bound under which two configurations' speed-ups cannot be told apart."""
    st = summary.get("steadiness")
    if not st:
        return None
    lo, hi = _num(st.get("p10")), _num(st.get("p90"))
    if lo is None or hi is None:
        return None
    spread = max(hi - 1.0, 1.0 - lo)
    passes = int(_num(summary.get("repeats")) or 1)
    advice = (f" (each request's time is its median over {passes} passes, which damps it)" if passes > 1
              else "; `--repeats 3` takes each request's median over three passes")
    return (f"Machine steadiness: a plain decoding step's mean time in each run was {lo:.2f}-{hi:.2f}x the "
            f"median of the same request's runs (10th-90th percentile of {int(st.get('runs') or 0)} runs, "
            f"extremes {_fmt(st.get('min'), '.2f', 'x')}-{_fmt(st.get('max'), '.2f', 'x')}): speed-ups "
            f"within about {spread:.0%} of each other are within this machine's drift{advice}.")


def markdown_tables(summary: dict[str, Any]) -> str:
    """The overall and per-category speed-up tables (for the terminal), and the machine's
    steadiness."""
    steady = steadiness_line(summary)
    return (f"{overall_table(summary)}\n\nSpeed-up vs AR per category (best in bold):\n\n"
            f"{category_table(summary)}\n" + (f"\n{steady}\n" if steady else ""))


# -- plots ------------------------------------------------------------------------------------
def _figure(width: float, height: float) -> Any:
    from matplotlib.figure import Figure  # lazy: keep `import adaspec` fast; no pyplot global state

    return Figure(figsize=(width, height), dpi=DPI, layout="constrained")


def _save(fig: Any, path: Path) -> Path:
    fig.savefig(path, dpi=DPI, format="png", bbox_inches="tight")
    return path


def _wrap(name: str, width: int = 34) -> str:
    return "\n".join(textwrap.wrap(name, width)) or name


def _short(name: str, width: int = 26) -> str:
    """Middle-elided label for crowded axes (full names are in the tables and legends)."""
    return name if len(name) <= width else name[: width // 2 - 1] + "…" + name[-(width - width // 2):]


def _int_locator() -> Any:
    from matplotlib.ticker import MaxNLocator

    return MaxNLocator(integer=True)


def _colors(n: int) -> list[Any]:
    from matplotlib import colormaps

    cmap = colormaps["tab10" if n <= 10 else "tab20"]
    return [cmap(i % cmap.N) for i in range(n)]


def plot_speedup(summary: dict[str, Any], path: Path) -> Path | None:
    """Grouped bars: speed-up per category (groups) and configuration (bars); AR is the line at 1."""
    names = [c["name"] for c in summary["configs"] if c.get("kind") != "ar"]
    cols, lookup = _columns(summary), _row_lookup(summary)
    if not names:
        return None
    n = len(names)
    bar_w = min(0.8 / n, 0.3)
    fig = _figure(min(18.0, max(6.5, 1.5 + len(cols) * (n * bar_w + 0.5) * 1.2)), 4.6)
    ax = fig.add_subplot()
    for i, (name, color) in enumerate(zip(names, _colors(n))):
        xs = [j + (i - (n - 1) / 2) * bar_w for j in range(len(cols))]
        ys = [_num(lookup[col].get(name, {}).get("speedup")) for col in cols]
        ax.bar([x for x, y in zip(xs, ys) if y is not None], [y for y in ys if y is not None], bar_w,
               color=color, label=_wrap(name))
    ax.axhline(1.0, color="black", lw=1.2, ls="--", label="AR (1.00x)")
    ax.set_xticks(range(len(cols)), [_wrap(c, 14) for c in cols])
    ax.set_ylabel("speed-up vs AR (x)")
    ax.set_title(f"Speed-up per category — {summary.get('model', '?')} on {summary.get('device', '?')}")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    return _save(fig, path)


def plot_regret(summary: dict[str, Any], path: Path) -> Path | None:
    """Cumulative regret (seconds, and rounds when given) over the workload for adaptive configs;
    with replay's predictions also the seconds priced by the cost model (dashed)."""
    regret = {k: v for k, v in (summary.get("regret") or {}).items() if v and v.get("cumulative_seconds")}
    if not regret:
        return None
    with_rounds = any(v.get("cumulative_rounds") for v in regret.values())
    fig = _figure(9.5, 6.4 if with_rounds else 3.8)
    axes = fig.subplots(2 if with_rounds else 1, 1, sharex=True, squeeze=False)[:, 0]
    for (name, r), color in zip(regret.items(), _colors(len(regret))):
        label = _wrap(f"{name} (vs {r.get('best_fixed', '?')})", 48)
        ys = [0.0, *r["cumulative_seconds"]]  # the curve starts at 0 before the first prompt
        marker = "o" if len(ys) <= 40 else None
        axes[0].plot(range(len(ys)), ys, color=color, lw=1.6, marker=marker, ms=3, label=label)
        if r.get("cumulative_priced_seconds"):
            yp = [0.0, *r["cumulative_priced_seconds"]]
            axes[0].plot(range(len(yp)), yp, color=color, lw=1.2, ls="--", label="  priced by the cost model")
        if with_rounds and r.get("cumulative_rounds"):
            yr = [0.0, *r["cumulative_rounds"]]
            axes[1].plot(range(len(yr)), yr, color=color, lw=1.6, marker=marker, ms=3)
    axes[0].set_ylabel("cumulative regret (s)")
    axes[0].set_title("Cumulative regret vs the best fixed configuration in hindsight")
    axes[0].legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    if with_rounds:
        axes[1].set_ylabel("cumulative regret (rounds)")
    for ax in axes:
        ax.axhline(0.0, color="black", lw=0.8)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("prompts done (workload order)")
    axes[-1].xaxis.set_major_locator(_int_locator())
    return _save(fig, path)


@dataclass
class ConfigRounds:
    """Rounds of one config in workload order: drafter and category per round."""

    drafters: list[str] = field(default_factory=list)
    categories: list[str] = field(default_factory=list)


def read_rounds(path: Path) -> dict[str, ConfigRounds]:
    """Group rounds.csv by config in workload order: by position (then `turn` if present), keeping the
    file order within a prompt (the order the rounds ran; `round` restarts at 0 in every turn). With a
    `repeat` column only each prompt's last repeat is kept. SummarySchemaError on bad columns/numbers."""
    with open(path, newline="", encoding="utf-8") as fh:
        reader = csv.DictReader(fh)
        missing = [k for k in ROUNDS_KEYS if k not in (reader.fieldnames or [])]
        if missing:
            raise SummarySchemaError(f"{path}: missing column(s) {missing}; expected the rounds.csv written "
                                     "by `adaspec bench`")
        raw: dict[str, list[tuple[int, int, int, str, str]]] = {}
        for line, row in enumerate(reader, start=2):
            try:
                key = (int(row["position"]), int(row.get("turn") or 0), int(row.get("repeat") or 0))
            except ValueError as exc:
                raise SummarySchemaError(f"{path}:{line}: position/turn/repeat must be integers ({exc})") from exc
            raw.setdefault(row["config"], []).append((*key, row["drafter"], row["category"]))
    out: dict[str, ConfigRounds] = {}
    for cfg, rows in raw.items():
        last: dict[int, int] = {}
        for pos, _, rep, _, _ in rows:
            last[pos] = max(rep, last.get(pos, rep))
        r = ConfigRounds()
        for pos, _, rep, drafter, cat in sorted(rows, key=lambda t: (t[0], t[1])):  # stable: file order kept
            if rep == last[pos]:
                r.drafters.append(drafter)
                r.categories.append(cat)
        out[cfg] = r
    return out


def _rolling(xs: Sequence[float], window: int) -> list[float]:
    """Trailing mean over the last `window` values (fewer at the start)."""
    out, acc = [], 0.0
    for i, x in enumerate(xs):
        acc += x
        if i >= window:
            acc -= xs[i - window]
        out.append(acc / min(i + 1, window))
    return out


def plot_drafter_choices(summary: dict[str, Any], rounds: dict[str, ConfigRounds], path: Path) -> Path | None:
    """Rolling share of rounds per drafter over the workload, one panel per multi-drafter config;
    category changes are marked so switches can be read against the prompt mix."""
    multi = [c for c in summary["configs"] if len(c.get("drafters") or []) > 1 and rounds.get(c["name"])
             and rounds[c["name"]].drafters]
    if not multi:
        return None
    fig = _figure(10.5, 0.6 + 2.5 * len(multi))
    axes = fig.subplots(len(multi), 1, squeeze=False)[:, 0]
    for ax, cfg in zip(axes, multi):
        r = rounds[cfg["name"]]
        n = len(r.drafters)
        window = max(5, min(50, n // 20))
        order = list(dict.fromkeys([*(d for d in cfg["drafters"] if d in r.drafters), *r.drafters]))
        shares = [_rolling([1.0 if d == name else 0.0 for d in r.drafters], window) for name in order]
        xs = list(range(1, n + 1))
        ax.stackplot(xs, shares, labels=[_wrap(d, 24) for d in order], colors=_colors(len(order)), alpha=0.85)
        changes = [i for i in range(1, n) if r.categories[i] != r.categories[i - 1]]
        for i in changes:
            ax.axvline(i + 0.5, color="black", lw=0.6, alpha=0.5)
        if len(changes) < 16:
            for start, end in zip([0, *changes], [*changes, n]):
                ax.text((start + end) / 2, 1.02, r.categories[start], ha="center", va="bottom", fontsize=7,
                        transform=ax.get_xaxis_transform())
        ax.set_xlim(1, n)
        ax.xaxis.set_major_locator(_int_locator())
        ax.set_ylim(0, 1)
        ax.set_ylabel("share of rounds")
        ax.set_title(_short(cfg["name"], 80) + f"  (rolling window {window} rounds)", fontsize=9, pad=14)
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    axes[-1].set_xlabel("round (workload order; vertical lines: category changes)")
    return _save(fig, path)


def plot_pareto(summary: dict[str, Any], path: Path) -> Path | None:
    """SpecDec++ Fig. 3 style: verification rate (x) vs discard rate (y), one numbered point per config."""
    points = [(i, r["config"], _num(r["verification_rate"]), _num(r["discard_rate"]))
              for i, r in enumerate(summary["overall"], start=1)]
    points = [p for p in points if p[2] is not None and p[3] is not None]
    if not points:
        return None
    kinds = {c["name"]: c.get("kind", "?") for c in summary["configs"]}
    markers = {"ar": "s", "static": "o", "adaptive": "^", "peer": "D"}
    fig = _figure(9.0, 5.2)
    ax = fig.add_subplot()
    for (i, name, x, y), color in zip(points, _colors(len(points))):
        ax.scatter([x], [y], s=55, color=color, marker=markers.get(kinds.get(name, "?"), "o"),
                   edgecolor="black", linewidth=0.5, label=_wrap(f"{i}: {name} [{kinds.get(name, '?')}]", 40),
                   zorder=3)
        ax.annotate(str(i), (x, y), textcoords="offset points", xytext=(5, 4), fontsize=8)
    ax.set_xlabel("verification rate = rounds / token (lower is better)")
    ax.set_ylabel("discard rate = discarded drafts / token (lower is better)")
    ax.set_title("Discard vs verification (SpecDec++ eq. 5.1)")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    return _save(fig, path)


def plot_verify_costs(costs: dict[str, Any] | None, path: Path) -> Path | None:
    """Measured target-forward cost for k new tokens relative to k=1, cost cliffs marked."""
    if not costs or not costs.get("ks") or not costs.get("ratios"):
        return None
    ks, ratios = list(costs["ks"]), list(costs["ratios"])
    if len(ks) != len(ratios):
        raise SummarySchemaError(f"verify_costs: {len(ks)} ks but {len(ratios)} ratios")
    fig = _figure(7.5, 4.2)
    ax = fig.add_subplot()
    ax.plot(ks, ratios, marker="o", lw=1.6, label="measured")
    ax.axhline(1.0, color="gray", ls="--", lw=1, label="flat (memory-bound ideal)")
    cliffs = [k for k in costs.get("cliffs") or [] if k in ks]
    if cliffs:
        ax.scatter(cliffs, [ratios[ks.index(k)] for k in cliffs], s=110, facecolor="none", edgecolor="red",
                   linewidth=1.8, zorder=3, label="cost cliff (a wider block is cheaper)")
    ax.set_xlabel("tokens verified in one forward (k)")
    ax.xaxis.set_major_locator(_int_locator())
    ax.set_ylabel("cost relative to k=1")
    context = costs.get("context")
    ax.set_title("Verify-cost curve" + (f" ({context}-token cache)" if context else ""))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_verify_surface(surface: dict[str, Any] | None, path: Path) -> Path | None:
    """Heat map of the verify-cost surface: ms of a target forward over k new tokens (x) on a
    cache of L tokens (y), each cell annotated; cost cliffs (a wider forward is cheaper at
    that L) outlined in red."""
    if not surface or not surface.get("contexts") or not surface.get("ks"):
        return None
    contexts, ks, secs = list(surface["contexts"]), list(surface["ks"]), surface.get("seconds") or []
    if len(secs) != len(contexts) or any(len(r) != len(ks) for r in secs):
        raise SummarySchemaError(f"surface: seconds must be {len(contexts)} rows of {len(ks)} values")
    cliffs = {int(c): set(v) for c, v in (surface.get("cliffs") or {}).items()}
    ms = [[x * 1e3 for x in row] for row in secs]
    fig = _figure(1.2 + 0.62 * len(ks), 1.4 + 0.5 * len(contexts))
    ax = fig.add_subplot()
    im = ax.imshow(ms, aspect="auto", origin="lower", cmap="viridis")
    top = max(max(r) for r in ms)
    for i, c in enumerate(contexts):
        for j, k in enumerate(ks):
            ax.text(j, i, f"{ms[i][j]:.0f}", ha="center", va="center", fontsize=7,
                    color="black" if ms[i][j] > 0.6 * top else "white")
            if k in cliffs.get(c, ()):
                ax.add_patch(_rect(j, i))
    ax.set_xticks(range(len(ks)), [str(k) for k in ks])
    ax.set_yticks(range(len(contexts)), [str(c) for c in contexts])
    ax.set_xlabel("tokens verified in one forward (k)")
    ax.set_ylabel("cache length (tokens)")
    ax.set_title("Verify cost V(k, L), ms per forward (red: cost cliff)")
    fig.colorbar(im, ax=ax, label="ms")
    return _save(fig, path)


def _rect(x: float, y: float) -> Any:
    from matplotlib.patches import Rectangle

    return Rectangle((x - 0.5, y - 0.5), 1, 1, fill=False, edgecolor="red", linewidth=1.6)


#: live configurations closer than this (relative tokens/s) are a tie when rankings are
#: compared: two repeats' medians move by more than that between runs of the same bench
RANK_TIE = 0.01


def rank_swaps(live: dict[str, float], pred: dict[str, float], tie: float = RANK_TIE,
               passes: dict[str, Sequence[float]] | None = None
               ) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """Pairs (faster live, slower live) that replay orders the other way: (swaps, ties), ties
    being the pairs whose live order is noise: within ``tie`` of each other live, or (with
    ``passes``, each configuration's tokens/s in every pass over the workload) not the same
    order in every pass."""
    names = sorted(live, key=lambda n: -live[n])
    swaps, ties = [], []
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            if pred[a] < pred[b]:
                pa, pb = (passes or {}).get(a, ()), (passes or {}).get(b, ())
                unsettled = len(pa) > 1 and len(pa) == len(pb) and any(x <= y for x, y in zip(pa, pb))
                (ties if unsettled or live[a] - live[b] <= tie * live[a] else swaps).append((a, b))
    return swaps, ties


def prediction_table(summary: dict[str, Any]) -> str | None:
    """Replay's predicted tokens/s next to the live run's, per configuration, and whether the
    two rank the configurations alike (None without predictions). Configurations within
    ``RANK_TIE`` of each other live, or not in the same order in every pass over the workload,
    are ties: replay may order them either way."""
    rows_in = [r for r in summary["overall"] if _num(r.get("predicted_tokens_per_s")) is not None]
    if not rows_in:
        return None
    header = ["configuration", "live tokens/s", "replay pred. tokens/s", "error"]
    rows = [[_cell(r["config"]), _fmt(r["tokens_per_s"], ".1f"), _fmt(r["predicted_tokens_per_s"], ".1f"),
             _fmt(_pct(r["prediction_error"]), "+.1f", "%")] for r in rows_in]
    passes = {r["config"]: [r["tokens"] / s for s in r["pass_seconds"] if s]
              for r in rows_in if len(r.get("pass_seconds") or []) > 1}
    swaps, ties = rank_swaps({r["config"]: r["tokens_per_s"] for r in rows_in},
                             {r["config"]: r["predicted_tokens_per_s"] for r in rows_in}, passes=passes)
    worst = max(abs(r["prediction_error"]) for r in rows_in)
    pairs = (lambda ps: "; ".join(f"{b} above {a}" for a, b in ps))
    verdict = (f"differs: replay ranks {pairs(swaps)}, the other way round live." if swaps
               else "the same as the live run's" + (
                   f" (replay ranks {pairs(ties)}: a tie live, within {RANK_TIE:.0%} of each other or"
                   " not in the same order in every pass)."
                   if ties else "."))
    return (_table(header, ["---", "---:", "---:", "---:"], rows)
            + f"\n\nLargest error {worst:.1%}; ranking by tokens/s " + verdict)


# -- report -----------------------------------------------------------------------------------
def _linear_note(linear: Any) -> str:
    """The linear kernels adaspec's configurations ran with (``kernels.py``); peers run stock."""
    if linear in ("small-batch", "packed"):
        return f", {linear} linear kernels; Hugging Face peers on PyTorch's own"
    return f", linear kernels {linear}" if linear else ""


def _weights_note(weights: Any) -> str:
    """The target's weights when they are a GGUF file's own blocks (``quant.weights_mode``)."""
    if isinstance(weights, str) and weights.startswith("gguf"):
        return (f", quantized weights {weights} (adaspec's kernels); Hugging Face peers on the dense "
                "weights, PyTorch's kernels")
    return ""


def _flash_note(flash_attn: Any) -> str:
    """llama.cpp's flash attention in the run (target and llama.cpp peers alike)."""
    return {True: ", flash attention on", False: ", flash attention off"}.get(flash_attn, "")


def _header(summary: dict[str, Any]) -> list[str]:
    g = summary.get
    temp = _num(g("temperature"))
    mode = ("greedy (temperature 0)" if not temp else
            f"sampling, temperature {temp:g} (speed-up from tokens/s: sampled answers differ in length)")
    cats = ", ".join(summary["categories"]) or "none"
    return [f"# adaspec bench report: {g('model', '?')}", "",
            f"- model `{g('model', '?')}` on `{g('device', '?')}` ({g('dtype', '?')}, backend "
            f"`{g('backend', 'transformers')}`{_weights_note(g('weights')) or _linear_note(g('linear'))}"
            f"{_flash_note(g('flash_attn'))}), {mode}",
            f"- suite `{g('suite', '?')}`: {g('n_prompts', '?')} prompts, categories: {cats}",
            f"- max {g('max_new_tokens', '?')} new tokens, {g('repeats', '?')} timed pass(es) over the "
            "workload (median per prompt), configurations interleaved",
            f"- {len(summary['configs'])} configurations; created {g('created', '?')} by adaspec "
            f"{g('adaspec_version', '?')}", ""]


def _mismatches(summary: dict[str, Any]) -> list[str]:
    lines = []
    for r in summary["overall"]:
        for m in r["mismatches"]:
            lines.append(f"- **MISMATCH** {_cell(r['config'])}: {m}")
        for m in r.get("near_ties") or []:
            lines.append(f"- near-tie {_cell(r['config'])}: {m} (a numeric near-tie, not a verification error)")
        for m in r.get("failed") or []:
            lines.append(f"- **FAILED** {_cell(r['config'])}: {_cell(m)} (left out of its totals)")
        if mismatched(r) and not r["mismatches"]:
            lines.append(f"- **MISMATCH** {_cell(r['config'])}: {r['prompts'] - r['identical']} prompt(s) "
                         "differ from AR (no details recorded)")
    return lines


def round_oracle_lines(ro: dict[str, Any] | None) -> list[str]:
    """The per-round oracle of a recorded run (replay's least-time dynamic programme)."""
    if not ro:
        return []
    return ["## Per-round oracle (replay)", "",
            f"The best drafter and draft length of every round, chosen in hindsight on the recorded trace "
            f"(up to {ro['max_draft']} tokens), priced by the cost model: **{ro['tokens_per_s']:.1f} tokens/s, "
            f"{ro['speedup']:.2f}x** over replay's AR, MAT {ro['mat']:.2f} (per-prompt static oracle on the "
            f"same basis, k={ro['k']}: {ro['static_per_prompt_speedup']:.2f}x). A bound no policy reaches: "
            "it knows every round's outcome and pays no policy or catch-up time.", ""]


def write_report(summary: dict[str, Any], out_dir: Path, rounds_csv: Path | None = None) -> list[Path]:
    """Write report.md and the plots into out_dir; return the written paths (report.md first).

    A plot whose data is absent (no adaptive config, no rounds.csv, no verify-cost curve) is
    skipped and the report says why."""
    validate_summary(summary)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    sections: dict[str, str] = {}

    def plot(key: str, title: str, make: Any, why_skipped: str) -> None:
        path = out_dir / PLOT_FILES[key]
        try:
            done = make(path)
        except SummarySchemaError as exc:
            log.warning("plot %s skipped: %s", PLOT_FILES[key], exc)
            done, why_skipped = None, f"bad input ({exc})"
        if done is None:
            sections[key] = f"_{title}: skipped, {why_skipped}._"
        else:
            written.append(done)
            sections[key] = f"![{title}]({PLOT_FILES[key]})"

    plot("speedup", "Speed-up per category", lambda p: plot_speedup(summary, p),
         "no configuration besides AR")
    plot("regret", "Cumulative regret", lambda p: plot_regret(summary, p),
         "no adaptive configuration with regret data in this run")
    if rounds_csv is None or not Path(rounds_csv).is_file():
        why = "no rounds.csv" + (f" ({rounds_csv} not found)" if rounds_csv else " given")
        sections["drafters"] = f"_Drafter choices over rounds: skipped, {why}._"
    else:
        plot("drafters", "Drafter choices over rounds",
             lambda p: plot_drafter_choices(summary, read_rounds(Path(rounds_csv)), p),
             "no configuration with more than one drafter has rounds in rounds.csv")
    plot("pareto", "Discard vs verification rate", lambda p: plot_pareto(summary, p),
         "no configuration has both rates")
    plot("costs", "Verify-cost curve", lambda p: plot_verify_costs(summary.get("verify_costs"), p),
         "the verify-cost curve was not measured")
    plot("surface", "Verify-cost surface",
         lambda p: plot_verify_surface((summary.get("verify_costs") or {}).get("surface"), p),
         "the verify-cost surface was not measured")

    lines = _header(summary)
    mism = _mismatches(summary)
    bad = [r["config"] for r in summary["overall"] if mismatched(r)]
    if bad:
        lines += [f"> **MISMATCH**: {len(bad)} configuration(s) produced output "
                  "different from AR. A lossless method must not; see [Mismatches](#mismatches).", ""]
    steady = steadiness_line(summary)
    lines += ["## Overall", "", overall_table(summary), "", *([steady, ""] if steady else []), sections["speedup"], "",
              "## Speed-up per category", "", "Best per column in bold; `all` is the whole workload.", "",
              category_table(summary), ""]
    oracle = summary.get("oracle")
    if oracle:
        picks: dict[str, int] = {}
        for name in oracle["choices"].values():
            picks[name] = picks.get(name, 0) + 1
        lines += ["## Per-prompt oracle", "",
                  f"The fastest static configuration of each prompt, chosen in hindsight: "
                  f"**{oracle['tokens_per_s']:.1f} tokens/s, {oracle['speedup']:.2f}x** over AR, MAT "
                  f"{oracle['mat']:.2f}. Picks: "
                  + ", ".join(f"{_cell(n)} ({c})" for n, c in sorted(picks.items(), key=lambda x: -x[1])) + ".", ""]
    lines += round_oracle_lines(summary.get("round_oracle"))
    hetero = heterogeneity_matrix(summary)
    lines += ["## Heterogeneity matrix", "",
              "Static single-drafter configurations per category, cells `MAT / speed-up`, the best of each "
              "in bold (Not-a-Bandit Table 1 style): no single drafter winning every column is the case for "
              "choosing the drafter online.", "",
              hetero if hetero else "_No static single-drafter configuration in this run._", ""]
    specialists = specialist_table(summary)
    if specialists:
        lines += ["## Specialists vs the generalist", "",
                  "Each pool specialist and the pool's generalist of the same kind on the prompts of the "
                  "specialist's own domain and on all other prompts, cells `MAT / speed-up`.", "", specialists, ""]
    usage = drafter_usage_table(summary)
    if usage:
        lines += ["## Drafter usage", "", "Share of rounds drafted by each drafter, per category.", "", usage, ""]
    lines += ["## Adaptivity", "", sections["regret"], "", sections["drafters"], "",
              "## Discard vs verification (SpecDec++)", "", sections["pareto"], "",
              "## Verify-cost curve", "", sections["costs"], ""]
    costs = summary.get("verify_costs")
    if costs and costs.get("ks"):
        cliffs = costs.get("cliffs") or []
        lines += ["Cost of one target forward over k tokens relative to k=1: "
                  + ", ".join(f"k={k}: {_fmt(r, '.2f', 'x')}" for k, r in zip(costs["ks"], costs["ratios"]))
                  + (f"; cost cliffs at k = {', '.join(map(str, cliffs))}." if cliffs else "."), ""]
    lines += [sections["surface"], ""]
    predicted = prediction_table(summary)
    if predicted:
        lines += ["## Replay vs live", "", "Times predicted by `adaspec replay` from the trace recorded with "
                  "this run (`--record`), priced with the cost model, next to the live times."
                  + (" Verify widths are priced by this run's live verify steps, each configuration's own "
                     "left out." if (summary.get("round_oracle") or {}).get("live_verify_prices") else ""),
                  "", predicted, ""]
    lines += ["## Mismatches", "", *(mism or ["None: every output matched AR token for token."]), "",
              "## Legend", "", LEGEND]
    report = out_dir / REPORT_FILE
    report.write_text("\n".join(lines), encoding="utf-8")
    return [report, *written]


def report_command(
    directory: str = typer.Argument(..., help="bench output directory holding summary.json (and rounds.csv)"),
    out: str | None = typer.Option(None, "--out", "-o", help="write report.md and plots here (default: DIR)"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="do not print the tables"),
) -> None:
    """Regenerate report.md and the plots from a bench output directory."""
    base = Path(directory)
    summary_path = base if base.suffix == ".json" else base / "summary.json"
    try:
        summary = load_summary(summary_path)
        rounds = summary_path.parent / "rounds.csv"
        paths = write_report(summary, Path(out) if out else summary_path.parent, rounds)
    except AdaspecError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    if not quiet:
        typer.echo(markdown_tables(summary))
    for p in paths:
        typer.echo(f"wrote {p}")
    if any(mismatched(r) for r in summary["overall"]):
        typer.echo("MISMATCH: some outputs differ from AR (see report.md)", err=True)
