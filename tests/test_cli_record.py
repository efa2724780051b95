"""``adaspec bench --record`` and ``adaspec replay`` through the command line."""

from __future__ import annotations

import json

import pytest

from typer.testing import CliRunner

from conftest import make_tiny_model, word_tokenizer

from adaspec.cli import app

WORDS = [f"w{i:02d}" for i in range(32)]


@pytest.fixture
def tiny_dir(tmp_path, monkeypatch):
    """A tiny model directory, with a fresh cache (its cost surface is measured in the test)."""
    monkeypatch.setenv("ADASPEC_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "tiny"
    make_tiny_model(seed=0).save_pretrained(path)
    word_tokenizer(WORDS).save_pretrained(path)
    return path


def test_bench_record_then_replay_matches_the_bench(tmp_path, tiny_dir, caplog):
    path = tiny_dir
    suite = tmp_path / "work.jsonl"
    suite.write_text(json.dumps({"question_id": "c1", "category": "copy",
                                 "turns": ["w01 w02 w03 w04 w01 w02 w03 w04 w01 w02"]}))
    trace = tmp_path / "trace.npz"
    res = CliRunner().invoke(app, ["bench", "-m", str(path), "-d", "prompt-lookup", "-d", "suffix", "-k", "3",
                                   "-s", "ucbspec", "--peer", "none", "--suite", str(suite), "-n", "10",
                                   "--no-costs", "--no-plots", "-o", str(tmp_path / "out"), "--record", str(trace)])
    assert res.exit_code == 0, res.output
    assert trace.is_file()
    # the trace's fresh surface is shown as the trace stage's progress, not announced in the log
    assert "measuring the verify-cost surface for the trace: pass 1/" in res.output
    assert "verify-cost surface of this model on this machine again" not in caplog.text
    res = CliRunner().invoke(app, ["replay", str(trace), "-s", "ucbspec", "-k", "3",
                                   "--json", str(tmp_path / "r.json")])
    assert res.exit_code == 0, res.output
    live = json.loads((tmp_path / "out" / "summary.json").read_text())
    row = next(r for r in live["overall"] if r["config"].startswith("ucbspec"))
    assert f"{row['mat']:.2f}" in res.output  # the replayed MAT equals the live one
    for r in live["overall"]:  # --record: replay's prediction next to every live configuration
        assert r["predicted_tokens_per_s"] > 0
        assert r["prediction_error"] == pytest.approx(r["predicted_tokens_per_s"] / r["tokens_per_s"] - 1)
    regret = next(v for k, v in live["regret"].items() if k.startswith("ucbspec"))
    assert len(regret["cumulative_priced_seconds"]) == len(regret["cumulative_seconds"]) == 1
    res = CliRunner().invoke(app, ["bench", "-m", str(path), "-t", "0.7", "--peer", "none", "--record", str(trace)])
    assert res.exit_code == 2 and "greedy" in res.output


def test_costs_command_prints_the_surface_and_writes_the_heat_map(tmp_path, tiny_dir):
    png = tmp_path / "surface.png"
    res = CliRunner().invoke(app, ["costs", "-m", str(tiny_dir), "--png", str(png)])
    assert res.exit_code == 0, res.output
    assert "k=16" in res.output and "cost cliff" in res.output and "measuring the grid took" in res.output
    rows = [line.split()[0] for line in res.output.splitlines() if line[:8].strip().isdigit()]
    assert rows == ["32", "128", "256", "495"]  # the default grid, cut at the tiny model's window (512)
    assert png.read_bytes().startswith(b"\x89PNG")
