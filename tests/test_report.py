"""Bench reports from a synthetic summary.json + rounds.csv: files, PNGs, tables, schema errors."""

from __future__ import annotations

import copy
import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from adaspec.bench.report import (PLOT_FILES, REPORT_FILE, SCHEMA_ID, SummarySchemaError, category_table,
                                  heterogeneity_matrix, load_summary, markdown_tables, prediction_table, rank_swaps,
                                  read_rounds, report_command, write_report)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
CATS = ["code", "math"]
ADAPTIVE = "ucbspec over [prompt-lookup, suffix]"


def _row(config: str, *, speedup: float, mat: float, identical: int = 2, prompts: int = 2,
         mismatches: list[str] | None = None, regret: float | None = None, best_arm: float | None = None) -> dict:
    tokens, seconds = 64 * prompts, 2.0 * prompts / speedup
    return {"config": config, "prompts": prompts, "tokens": tokens, "seconds": seconds,
            "tokens_per_s": tokens / seconds, "speedup": speedup, "mat": mat,
            "acceptance_rate": None if mat == 1.0 else 0.5, "discard_rate": 0.0 if mat == 1.0 else 0.25,
            "verification_rate": 1.0 / mat, "policy_overhead_share": 0.0 if regret is None else 0.012,
            "identical": identical, "mismatches": mismatches or [], "stopping_time_regret": regret,
            "best_arm_ratio": best_arm}


def make_summary() -> dict:
    """AR, two static drafters (each best on one category) and an adaptive config with a mismatch."""
    configs = [
        {"name": "AR (no drafter)", "kind": "ar", "drafters": [], "k": 5, "selector": None, "length": None,
         "peer": None},
        {"name": "prompt-lookup k=5", "kind": "static", "drafters": ["prompt-lookup"], "k": 5, "selector": None,
         "length": None, "peer": None},
        {"name": "suffix k=5", "kind": "static", "drafters": ["suffix"], "k": 5, "selector": None,
         "length": None, "peer": None},
        {"name": ADAPTIVE, "kind": "adaptive", "drafters": ["prompt-lookup", "suffix"], "k": 5,
         "selector": "ucbspec", "length": None, "peer": None},
    ]
    per_category = {
        "code": [_row("AR (no drafter)", speedup=1.0, mat=1.0, prompts=1),
                 _row("prompt-lookup k=5", speedup=1.9, mat=3.10, prompts=1),
                 _row("suffix k=5", speedup=1.2, mat=2.05, prompts=1),
                 _row(ADAPTIVE, speedup=1.7, mat=2.90, prompts=1, regret=3.0, best_arm=0.8)],
        "math": [_row("AR (no drafter)", speedup=1.0, mat=1.0, prompts=1),
                 _row("prompt-lookup k=5", speedup=1.1, mat=1.40, prompts=1),
                 _row("suffix k=5", speedup=1.45, mat=2.25, prompts=1),
                 _row(ADAPTIVE, speedup=1.3, mat=2.0, prompts=1, identical=0, regret=4.0, best_arm=0.6,
                      mismatches=["prompt 1 (math): first difference at token 17"])],
    }
    overall = [_row("AR (no drafter)", speedup=1.0, mat=1.0),
               _row("prompt-lookup k=5", speedup=1.5, mat=2.25),
               _row("suffix k=5", speedup=1.33, mat=2.15),
               _row(ADAPTIVE, speedup=1.48, mat=2.45, identical=1, regret=7.0, best_arm=0.7,
                    mismatches=["prompt 1 (math): first difference at token 17"])]
    per_prompt = []
    for pos, cat in enumerate(CATS):
        for c in configs:
            usage = {"prompt-lookup": 9, "suffix": 3} if pos == 0 else {"prompt-lookup": 2, "suffix": 10}
            per_prompt.append({"config": c["name"], "prompt_id": f"{cat}-0", "category": cat, "position": pos,
                               "tokens": 64, "seconds": 1.0, "rounds": 12, "drafted": 40, "accepted": 20,
                               "identical": not (c["name"] == ADAPTIVE and cat == "math"),
                               "first_mismatch": 17 if (c["name"] == ADAPTIVE and cat == "math") else None,
                               "policy_s": 0.01,
                               "drafter_usage": usage if c["kind"] == "adaptive" else {}})
    return {"schema": SCHEMA_ID, "created": "2026-11-21T13:00:00Z", "adaspec_version": "0.1.0",
            "model": "tiny-test-model", "device": "cpu", "dtype": "float32", "temperature": 0.0,
            "max_new_tokens": 64, "repeats": 1, "suite": "mixed", "n_prompts": 2, "categories": CATS,
            "configs": configs, "overall": overall, "per_category": per_category, "per_prompt": per_prompt,
            "verify_costs": {"ks": [1, 2, 3, 4], "seconds": [0.05, 0.06, 0.09, 0.065],
                             "ratios": [1.0, 1.2, 1.8, 1.3], "cliffs": [3], "context": 256,
                             "surface": {"contexts": [32, 512], "ks": [1, 2, 3, 4],
                                         "seconds": [[0.04, 0.05, 0.07, 0.05], [0.05, 0.06, 0.09, 0.065]],
                                         "cliffs": {"32": [3], "512": [3]}}},
            "regret": {ADAPTIVE: {"best_fixed": "prompt-lookup k=5", "cumulative_seconds": [0.1, 0.25],
                                  "cumulative_rounds": [3, 7]}}}


def write_rounds(path: Path) -> Path:
    """24 rounds per prompt for the adaptive config (drafter switches with the category), a few for others."""
    cols = ["config", "prompt_id", "category", "position", "round", "drafter", "k_cap", "drafted", "accepted",
            "emitted", "draft_s", "verify_s", "catch_up_s", "policy_s", "total_s"]
    with open(path, "w", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh)
        w.writerow(cols)
        for pos, cat in enumerate(CATS):
            for rnd in range(24):
                drafter = ("prompt-lookup" if rnd % 4 else "suffix") if pos == 0 else ("suffix" if rnd % 4 else
                                                                                       "prompt-lookup")
                w.writerow([ADAPTIVE, f"{cat}-0", cat, pos, rnd, drafter, 5, 5, 2, 3, 0.001, 0.05, 0.0,
                            0.0001, 0.052])
            for rnd in range(3):
                w.writerow(["prompt-lookup k=5", f"{cat}-0", cat, pos, rnd, "prompt-lookup", 5, 5, 2, 3,
                            0.001, 0.05, 0.0, 0.0, 0.052])
    return path


@pytest.fixture
def bench_dir(tmp_path: Path) -> Path:
    (tmp_path / "summary.json").write_text(json.dumps(make_summary()), encoding="utf-8")
    write_rounds(tmp_path / "rounds.csv")
    return tmp_path


def test_write_report_writes_report_and_valid_pngs(bench_dir: Path):
    out = bench_dir / "out"
    paths = write_report(load_summary(bench_dir / "summary.json"), out, bench_dir / "rounds.csv")
    assert paths[0] == out / REPORT_FILE
    assert sorted(p.name for p in paths[1:]) == sorted(PLOT_FILES.values())
    for p in paths[1:]:
        data = p.read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 5000, p
    text = paths[0].read_text(encoding="utf-8")
    for name in PLOT_FILES.values():
        assert f"]({name})" in text
    assert "skipped" not in text
    assert "tiny-test-model" in text and "`cpu`" in text and "suite `mixed`" in text
    assert "> **MISMATCH**: 1 configuration(s)" in text
    assert f"- **MISMATCH** {ADAPTIVE}: prompt 1 (math): first difference at token 17" in text
    assert "SpecDec++ eq. 5.1" in text and "stopping-time regret" in text and "best-arm ratio" in text
    # drafter usage from per_prompt: 11 of 24 adaptive rounds by prompt-lookup overall, 9/12 on code
    assert f"| {ADAPTIVE} | prompt-lookup | 75% | 17% | 46% |" in text
    assert "Replay vs live" not in text  # no trace recorded


def test_report_shows_replay_predictions_and_ranking(bench_dir: Path):
    summary = load_summary(bench_dir / "summary.json")
    for row, pred in zip(summary["overall"], (12.0, 18.0, 17.0, 19.0)):
        row |= {"predicted_tokens_per_s": pred, "prediction_error": pred / row["tokens_per_s"] - 1}
    text = prediction_table(summary)
    assert "| prompt-lookup k=5 |" in text and "ranking by tokens/s differs" in text
    live = {r["config"]: r["tokens_per_s"] for r in summary["overall"]}
    assert f"{(18.0 / live['prompt-lookup k=5'] - 1) * 100:+.1f}%" in text
    for row in summary["overall"]:  # predictions proportional to the live run: same ranking
        row |= {"predicted_tokens_per_s": 1.1 * row["tokens_per_s"], "prediction_error": 0.1}
    assert "the same as the live run's" in prediction_table(summary)
    assert "Largest error 10.0%" in prediction_table(summary)
    written = write_report(summary, bench_dir / "out")
    assert "## Replay vs live" in written[0].read_text(encoding="utf-8")


def test_ranking_tolerates_live_ties_only():
    live = {"a": 30.0, "b": 29.8, "c": 20.0}
    assert rank_swaps(live, {"a": 31.0, "b": 30.0, "c": 21.0}) == ([], [])
    assert rank_swaps(live, {"a": 30.0, "b": 31.0, "c": 21.0}) == ([], [("a", "b")])  # 0.7% apart live: a tie
    assert rank_swaps(live, {"a": 20.0, "b": 31.0, "c": 21.0}) == ([("a", "c")], [("a", "b")])
    assert rank_swaps({"a": 30.0, "b": 29.0}, {"a": 30.0, "b": 31.0}) == ([("a", "b")], [])  # 3.3% apart
    summary = {"overall": [{"config": n, "tokens_per_s": v, "predicted_tokens_per_s": p,
                            "prediction_error": p / v - 1} for (n, v), p in zip(live.items(), (30.0, 31.0, 21.0))]}
    text = prediction_table(summary)
    assert ("the same as the live run's (replay ranks b above a: a tie live, within 1% of each other or not in "
            "the same order in every pass).") in text
    summary["overall"][2]["predicted_tokens_per_s"] = 32.0
    assert "differs: replay ranks c above a; c above b, the other way round live." in prediction_table(summary)


def test_a_live_order_that_did_not_hold_in_every_pass_is_a_tie():
    live, pred = {"a": 30.0, "b": 29.0}, {"a": 30.0, "b": 31.0}  # 3.3% apart live
    assert rank_swaps(live, pred, passes={"a": [31.0, 30.0, 29.5], "b": [29.0, 28.0, 29.0]}) == ([("a", "b")], [])
    assert rank_swaps(live, pred, passes={"a": [31.0, 30.0, 28.5], "b": [29.0, 28.0, 29.0]}) == ([], [("a", "b")])
    assert rank_swaps(live, pred, passes={"a": [30.0], "b": [29.0]}) == ([("a", "b")], [])  # one pass: no evidence
    summary = {"overall": [
        {"config": "a", "tokens": 300, "tokens_per_s": 30.0, "predicted_tokens_per_s": 30.0, "prediction_error": 0.0,
         "pass_seconds": [300 / 31.0, 300 / 30.0, 300 / 28.5]},
        {"config": "b", "tokens": 300, "tokens_per_s": 29.0, "predicted_tokens_per_s": 31.0, "prediction_error": 0.07,
         "pass_seconds": [300 / 29.0, 300 / 28.0, 300 / 29.0]}]}
    assert "the same as the live run's (replay ranks b above a: a tie live" in prediction_table(summary)


def test_overall_and_category_tables_numbers_and_mismatch_marker():
    tables = markdown_tables(make_summary())
    lines = tables.splitlines()
    ar = next(line for line in lines if line.startswith("| AR (no drafter) | 32.0 |"))
    assert "| 1.00x | 1.00 |" in ar and ar.endswith("| 2/2 |")
    pl = next(line for line in lines if line.startswith("| prompt-lookup k=5 | 48.0 | 1.50x | 2.25 | 50.0% |"))
    assert pl.endswith("| – | – | 2/2 |")
    ada = next(line for line in lines if line.startswith(f"| {ADAPTIVE} |"))
    assert "| +7.0 | 70% | **1/2 MISMATCH** |" in ada and "| 1.2% |" in ada
    assert "Heterogeneity" not in tables and "cost cliff" not in tables
    cat = category_table(make_summary())
    assert cat.splitlines()[0] == "| configuration | code | math | all |"
    assert "| prompt-lookup k=5 | **1.90x** | 1.10x | **1.50x** |" in cat
    assert "| suffix k=5 | 1.20x | **1.45x** | 1.33x |" in cat


def test_optional_columns_and_sampling_mode():
    summary = make_summary()
    for i, r in enumerate(summary["overall"]):
        r.update(engine_overhead_share=0.05, cliff_share=0.25 if i else None,
                 scoring_overhead_share=0.007 if r["config"] == ADAPTIVE else None)
    summary["temperature"] = 0.8
    lines = markdown_tables(summary).splitlines()
    assert ("| policy overhead | scoring overhead | engine overhead | rounds in cost cliff | stopping-time regret |"
            in lines[0])
    pl = next(line for line in lines if line.startswith("| prompt-lookup k=5 |"))
    assert pl.endswith("| 0.0% | – | 5.0% | 25.0% | – | – | n/a (sampling) |")
    assert "| 1.2% | 0.7% | 5.0% |" in next(line for line in lines if line.startswith(f"| {ADAPTIVE} |"))
    ada = next(line for line in lines if line.startswith(f"| {ADAPTIVE} |"))
    assert ada.endswith("| **1/2 MISMATCH** |")  # a recorded mismatch is shown even when sampling


def test_heterogeneity_matrix_bolds_best_per_column_static_only():
    matrix = heterogeneity_matrix(make_summary())
    rows = matrix.splitlines()
    assert rows[0] == "| static configuration | code | math | all |"
    assert len(rows) == 4  # header, alignment, two static configs; AR and adaptive excluded
    assert rows[2] == "| prompt-lookup k=5 | **3.10** / **1.90x** | 1.40 / 1.10x | **2.25** / **1.50x** |"
    assert rows[3] == "| suffix k=5 | 2.05 / 1.20x | **2.25** / **1.45x** | 2.15 / 1.33x |"
    summary = make_summary()
    for c in summary["configs"]:
        c["kind"] = "ar" if c["kind"] == "ar" else "adaptive"
    assert heterogeneity_matrix(summary) is None


def test_missing_data_skips_plots_and_says_so(tmp_path: Path):
    summary = make_summary()
    summary["verify_costs"] = None
    summary["regret"] = {}
    summary["overall"][1]["discard_rate"] = None  # a null rate drops that point, not the plot
    paths = write_report(summary, tmp_path)
    assert sorted(p.name for p in paths[1:]) == sorted([PLOT_FILES["speedup"], PLOT_FILES["pareto"]])
    text = (tmp_path / REPORT_FILE).read_text(encoding="utf-8")
    assert "_Cumulative regret: skipped, no adaptive configuration" in text
    assert "_Drafter choices over rounds: skipped, no rounds.csv given._" in text
    assert "_Verify-cost curve: skipped, the verify-cost curve was not measured._" in text
    assert not (tmp_path / PLOT_FILES["costs"]).exists()


def test_bad_rounds_csv_skips_only_that_plot(tmp_path: Path):
    bad = tmp_path / "rounds.csv"
    bad.write_text("config,position\nx,1\n", encoding="utf-8")
    paths = write_report(make_summary(), tmp_path / "out", bad)
    text = paths[0].read_text(encoding="utf-8")
    assert "Drafter choices over rounds: skipped, bad input" in text and "missing column(s)" in text
    assert len(paths) == 1 + len(PLOT_FILES) - 1


def test_read_rounds_orders_by_position_and_turn_and_keeps_last_repeat(tmp_path: Path):
    path = tmp_path / "rounds.csv"  # `round` restarts per turn: within a prompt, file order is run order
    path.write_text("config,category,position,turn,repeat,round,drafter\n"
                    "A,math,1,0,0,0,x\nA,code,0,1,1,0,c\nA,code,0,0,0,0,old\nA,code,0,0,1,0,a\n"
                    "A,code,0,0,1,1,b\nA,math,1,0,0,1,y\nB,code,0,0,0,0,z\n", encoding="utf-8")
    rounds = read_rounds(path)
    assert rounds["A"].drafters == ["a", "b", "c", "x", "y"]
    assert rounds["A"].categories == ["code", "code", "code", "math", "math"]
    assert rounds["B"].drafters == ["z"]


@pytest.mark.parametrize("mutate, message", [
    (lambda s: s.pop("schema"), "no 'schema' field"),
    (lambda s: s.update(schema="adaspec.bench/2"), "unknown schema 'adaspec.bench/2'"),
    (lambda s: s.pop("per_category"), "missing field(s) ['per_category']"),
    (lambda s: s["overall"].pop(), "one row per config (4), got 3"),
    (lambda s: s["overall"][2].pop("mat"), "overall[2] (suffix k=5): missing field(s) ['mat']"),
    (lambda s: s["overall"][0].update(identical=True), "'identical' must be the count"),
    (lambda s: s["overall"].reverse(), "must follow 'configs' order"),
])
def test_schema_errors_are_clear(tmp_path: Path, mutate, message):
    summary = copy.deepcopy(make_summary())
    mutate(summary)
    path = tmp_path / "summary.json"
    path.write_text(json.dumps(summary), encoding="utf-8")
    with pytest.raises(SummarySchemaError) as info:
        load_summary(path)
    assert message in str(info.value) and str(path) in str(info.value)


def test_load_summary_missing_file_and_bad_json(tmp_path: Path):
    with pytest.raises(SummarySchemaError, match="no such file; run `adaspec bench`"):
        load_summary(tmp_path / "summary.json")
    (tmp_path / "summary.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(SummarySchemaError, match="not valid JSON"):
        load_summary(tmp_path / "summary.json")


def test_report_command_regenerates_from_directory(bench_dir: Path):
    app = typer.Typer()
    app.command("report")(report_command)
    app.command("noop")(lambda: None)  # two commands, so `report` is a subcommand as in the real CLI
    runner = CliRunner()
    res = runner.invoke(app, ["report", str(bench_dir)])
    assert res.exit_code == 0, res.output
    assert "**1/2 MISMATCH**" in res.output and f"wrote {bench_dir / REPORT_FILE}" in res.output
    assert all((bench_dir / name).read_bytes().startswith(PNG_MAGIC) for name in PLOT_FILES.values())
    res = runner.invoke(app, ["report", str(bench_dir / "nowhere")])
    assert res.exit_code == 2 and "no such file" in res.output


def test_import_does_not_load_matplotlib():
    code = "import sys, adaspec.bench.report; print('matplotlib' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def _pool_summary() -> dict:
    """AR, a generalist head and two specialists on code and math prompts (one prompt each)."""
    root = "/cache/pool/smollm2"
    names = {"AR": [], "gen": [f"feature-head:path={root}/drafters/generalist/feature-head.pt"],
             "code": [f"feature-head:path={root}/drafters/code/feature-head.pt"],
             "math": [f"feature-head:path={root}/drafters/math/feature-head.pt"],
             "mathstore": [f"suffix:datastore={root}/datastores/math.jsonl"]}
    configs = [{"name": n, "kind": "ar" if n == "AR" else "static", "drafters": d} for n, d in names.items()]
    # (rounds, seconds) for prompts in categories code and math; 60 tokens each
    runs = {"AR": ((60, 6.0), (60, 6.0)), "gen": ((30, 4.0), (30, 4.0)), "code": ((20, 3.0), (40, 5.0)),
            "math": ((40, 5.0), (24, 3.0)), "mathstore": ((30, 4.0), (30, 4.0))}
    per_prompt = [{"config": n, "prompt_id": f"{cat}-1", "category": cat, "tokens": 60, "rounds": r, "seconds": s}
                  for n, pair in runs.items() for cat, (r, s) in zip(("code", "math"), pair)]
    return {"configs": configs, "per_prompt": per_prompt}


def test_specialist_table_compares_each_specialist_with_the_generalist_in_and_out_of_domain():
    from adaspec.bench.report import specialist_table

    table = specialist_table(_pool_summary())
    lines = table.splitlines()
    assert len(lines) == 4  # header, rule, code and math heads (the datastore has no generalist store)
    code = next(ln for ln in lines if ln.startswith("| code/feature-head"))
    # own (code prompt): specialist MAT 3.00, 2.00x; generalist 2.00, 1.50x; other (math prompt): 1.50 vs 2.00
    assert "| 3.00 / 2.00x | 2.00 / 1.50x | 1.50 / 1.20x | 2.00 / 1.50x | yes | yes |" in code
    assert "math/feature-head | math | 2.50 / 2.00x" in table
    assert specialist_table({"configs": _pool_summary()["configs"][:3], "per_prompt": []}) is None
