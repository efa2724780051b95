"""The bench harness and the command line, on a tiny model saved to disk."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from conftest import make_tiny_model, word_tokenizer

from adaspec.bench.runner import default_configs, run_bench
from adaspec.cli import app
from adaspec.models import as_loaded
from adaspec.bench.workloads import BenchPrompt, default_per_category

WORDS = [f"w{i:02d}" for i in range(32)]
PROMPTS = [BenchPrompt("c1", "copy", ("w01 w02 w03 w04 w01 w02 w03 w04 w01 w02",)),
           BenchPrompt("r1", "random", ("w07 w19 w03 w22 w11 w05",))]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    model = make_tiny_model(seed=0)
    model.save_pretrained(path)
    word_tokenizer(WORDS).save_pretrained(path)
    return str(path)


def test_run_bench_checks_every_output_against_ar():
    target = as_loaded(make_tiny_model(seed=0), word_tokenizer(WORDS), "tiny")
    configs = default_configs(["prompt-lookup", "suffix"], [2, 4], selectors=["ucbspec"],
                              lengths=["cost-model"])
    assert configs[0].drafters == [] and len(configs) == 1 + 4 + 1 + 2
    report = run_bench(target, configs, PROMPTS, max_new_tokens=12, measure_costs=False)
    assert [r.name for r in report.results] == [c.name for c in configs]
    for r in report.results:
        assert r.identical == r.prompts == 2 and not r.mismatches
        assert r.tokens == 24 and r.seconds > 0 and r.rounds > 0
        assert report.speedup(r) > 0
    assert report.baseline.mat == 1.0
    md = report.markdown()
    assert md.count("\n") == len(configs) + 1 and "discard rate" in md
    json.dumps(report.summary())


def test_run_bench_reports_a_mismatch(monkeypatch):
    """A configuration whose output differs from AR is reported, never hidden."""
    import adaspec.bench.runner
    from adaspec.engine import SpeculativeEngine

    class Corrupting(SpeculativeEngine):
        def generate(self, prompt, config=None, **kw):
            res = super().generate(prompt, config, **kw)
            if self.drafter_names != ["none"]:
                res.token_ids[-1] = (res.token_ids[-1] + 1) % 32
            return res

    monkeypatch.setattr(adaspec.bench.runner, "SpeculativeEngine", Corrupting)
    target = as_loaded(make_tiny_model(seed=0), word_tokenizer(WORDS), "tiny")
    report = run_bench(target, default_configs(["prompt-lookup"], [3]), PROMPTS,
                       max_new_tokens=8, measure_costs=False)
    ar, sd = report.results
    assert ar.identical == 2 and not ar.mismatches
    assert sd.identical == 0 and len(sd.mismatches) == 2
    assert "first difference at token 7" in sd.mismatches[0]
    assert "MISMATCH" in report.markdown()


def test_run_bench_checks_every_repeat(monkeypatch):
    """With --repeats 2 a configuration that is wrong only in its first repeat is still
    reported: every repeat's output is compared with AR, not only the last one."""
    import adaspec.bench.runner
    from adaspec.engine import SpeculativeEngine

    class WrongOnce(SpeculativeEngine):
        calls = 0

        def generate(self, prompt, config=None, **kw):
            res = super().generate(prompt, config, **kw)
            if self.drafter_names != ["none"] and config.max_new_tokens == 8:  # not the warm-up
                WrongOnce.calls += 1
                if WrongOnce.calls <= len(PROMPTS):  # the first pass over the workload
                    res.token_ids[2] = (res.token_ids[2] + 1) % 32
            return res

    monkeypatch.setattr(adaspec.bench.runner, "SpeculativeEngine", WrongOnce)
    target = as_loaded(make_tiny_model(seed=0), word_tokenizer(WORDS), "tiny")
    report = run_bench(target, default_configs(["prompt-lookup"], [3]), PROMPTS, max_new_tokens=8,
                       repeats=2, measure_costs=False)
    ar, sd = report.results
    assert WrongOnce.calls == 2 * len(PROMPTS)
    assert ar.identical == 2 and sd.identical == 0
    assert "first difference at token 2" in sd.mismatches[0]


def test_cli_generate_json(model_dir):
    res = CliRunner().invoke(app, ["generate", "w01 w02 w03 w01 w02", "-m", model_dir, "-n", "6",
                                   "--json", "--no-chat-template", "-d", "prompt-lookup"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert len(out["token_ids"]) == 6 and out["stats"]["new_tokens"] == 6


def test_cli_generate_streams_plain_text(model_dir):
    """Without --json: the streamed text and a newline on stdout, the statistics on stderr;
    the text is what the library generates with the same options."""
    from adaspec import SpeculativeEngine
    from adaspec.models import load_model

    prompt = "w01 w02 w03 w01 w02"
    res = CliRunner().invoke(app, ["generate", prompt, "-m", model_dir, "-n", "7", "--no-chat-template",
                                   "-d", "prompt-lookup", "-k", "3"])
    assert res.exit_code == 0, res.output
    expected = SpeculativeEngine(load_model(model_dir), ["prompt-lookup"], k=3).generate(
        prompt, max_new_tokens=7, chat_template=False)
    assert expected.text and res.stdout == expected.text + "\n"
    summary = " ".join(res.stderr.split())
    assert "7 tokens in" in summary and "MAT" in summary and "stop: max_new_tokens" in summary


@pytest.mark.parametrize("args,needle", [
    (["-d", "nonsense"], "unknown drafter"),
    (["-k", "0"], "k must be"),
    (["-t", "-1"], "temperature"),
    (["--top-p", "1.5"], "top_p"),
    (["--selector", "nope"], "unknown selector"),
])
def test_cli_generate_bad_input(model_dir, args, needle):
    res = CliRunner().invoke(app, ["generate", "w01 w02", "-m", model_dir, "--no-chat-template",
                                   *args])
    assert res.exit_code == 2
    assert needle in res.output


def test_cli_bench_runs_and_writes_the_report(model_dir, tmp_path):
    suite = tmp_path / "work.jsonl"
    suite.write_text("\n".join(json.dumps({"question_id": p.id, "category": p.category, "turns": list(p.turns)})
                               for p in PROMPTS))
    out = tmp_path / "report"
    res = CliRunner().invoke(app, ["bench", "-m", model_dir, "-d", "prompt-lookup", "-k", "3", "-s", "ucbspec",
                                   "-d", "suffix", "--suite", str(suite), "--peer", "hf-pld",
                                   "-n", "8", "--no-costs", "--out", str(out), "--json", str(tmp_path / "s.json")])
    assert res.exit_code == 0, res.output
    data = json.loads((out / "summary.json").read_text())
    assert [r["config"] for r in data["overall"]] == [
        "AR (no drafter)", "prompt-lookup k=3", "suffix k=3", "ucbspec over [prompt-lookup, suffix]",
        "prompt-lookup + cost-model", "suffix + cost-model", "hf-pld"]  # -l cost-model by default
    assert all(r["identical"] == r["prompts"] == 2 for r in data["overall"])
    # adaptive configurations, greedy: a trace is recorded, replay predicts, the per-round oracle is shown
    assert (out / "trace.npz").is_file()
    ro = data["round_oracle"]
    assert ro["speedup"] > 0 and ro["speedup"] >= ro["static_per_prompt_speedup"] * 0.999
    assert "## Per-round oracle (replay)" in (out / "report.md").read_text()
    assert all(r["predicted_tokens_per_s"] for r in data["overall"] if r["config"] != "hf-pld")
    assert (out / "report.md").is_file() and (out / "rounds.csv").is_file()
    assert any(p.suffix == ".png" for p in out.iterdir())
    assert json.loads((tmp_path / "s.json").read_text())["schema"] == data["schema"]
    # stderr is not a terminal here: progress comes as plain lines, the first and the last item included
    total = 2 * 7
    assert f"bench: 1/{total} (7%)" in res.output and f"bench: {total}/{total} (100%)" in res.output


def test_default_per_category_keeps_all_of_a_users_file():
    assert default_per_category("mixed") == default_per_category("code+code-editing") == 2
    assert default_per_category("my.jsonl") is None and default_per_category("humaneval") is None
    assert default_per_category("code+my.jsonl") is None


def test_cli_bench_runs_every_prompt_of_a_file_and_says_how_many(model_dir, tmp_path):
    """A file's prompts all run unless --per-category says otherwise (2 per category is the
    built-in suites' default only), and the bench names the workload's size."""
    suite = tmp_path / "mine.jsonl"
    suite.write_text("\n".join(json.dumps({"question_id": f"q{i}", "category": "qa", "turns": [f"w0{i + 1} w02 w03 w0{i + 1} w02 w03"]})
                               for i in range(3)))
    base = ["bench", "-m", model_dir, "-d", "prompt-lookup", "-k", "3", "-s", "none", "-l", "none", "-p", "none",
            "--suite", str(suite), "-n", "4", "--no-costs", "--no-record", "--no-plots"]
    for extra, n, said in (([], 3, "3 prompts (all)"), (["--per-category", "2"], 2, "2 prompts (2 per category)")):
        out = tmp_path / f"r{n}"
        res = CliRunner().invoke(app, [*base, *extra, "--out", str(out)])
        assert res.exit_code == 0, res.output
        assert said in res.output
        data = json.loads((out / "summary.json").read_text())
        assert data["n_prompts"] == n


def test_cli_bench_bad_input(model_dir, tmp_path):
    res = CliRunner().invoke(app, ["bench", "-m", model_dir, "--suite", "nonsense", "--no-costs"])
    assert res.exit_code == 2 and "nonsense" in res.output
    res = CliRunner().invoke(app, ["bench", "-m", model_dir, "--config", str(tmp_path / "x.toml")])
    assert res.exit_code == 2 and "does not exist" in res.output


def _suite_file(tmp_path):
    suite = tmp_path / "work.jsonl"
    suite.write_text("\n".join(json.dumps({"question_id": p.id, "category": p.category, "turns": list(p.turns)})
                               for p in PROMPTS))
    return str(suite)


def test_cli_bench_without_matrix_options_runs_the_quick_matrix_and_says_so(model_dir, tmp_path):
    """No -d/-k/-s/-l/--config/--full: AR, the single drafters prompt-lookup and suffix with the
    cost-model length, auto over the default arms, hf-pld, one prompt per category, no trace;
    the plan (and --full) is named before it starts."""
    out = tmp_path / "quick"
    res = CliRunner().invoke(app, ["bench", "-m", model_dir, "--suite", _suite_file(tmp_path), "-n", "6",
                                   "--no-costs", "--no-plots", "--out", str(out)])
    assert res.exit_code == 0, res.output
    data = json.loads((out / "summary.json").read_text())
    assert [r["config"] for r in data["overall"]] == [
        "AR (no drafter)", "auto over [prompt-lookup, suffix, recycle]", "prompt-lookup + cost-model",
        "suffix + cost-model", "hf-pld"]
    assert data["n_prompts"] == 2  # one per category of the file's two
    assert not (out / "trace.npz").exists()
    assert "quick bench: 5 configurations" in res.output and "--full" in res.output


def test_cli_bench_full_runs_the_whole_matrix_and_the_trace(model_dir, tmp_path):
    out = tmp_path / "full"
    res = CliRunner().invoke(app, ["bench", "--full", "-m", model_dir, "--suite", _suite_file(tmp_path), "-n", "6",
                                   "--no-costs", "--no-plots", "--peer", "hf-pld", "--out", str(out)])
    assert res.exit_code == 0, res.output
    names = [r["config"] for r in json.loads((out / "summary.json").read_text())["overall"]]
    assert "recycle k=5" in names and "recycle + cost-model" in names and "prompt-lookup k=5" in names
    assert (out / "trace.npz").is_file()
    assert "quick bench" not in res.output


def test_cli_bench_concurrency_runs_the_batching_benchmark(model_dir, tmp_path):
    out = tmp_path / "batch"
    res = CliRunner().invoke(app, ["bench", "-m", model_dir, "--concurrency", "1,2", "--suite",
                                   _suite_file(tmp_path), "-n", "5", "--out", str(out)])
    assert res.exit_code == 0, res.output
    rows = json.loads((out / "bench.json").read_text())["rows"]
    assert [(r["concurrency"], r["mode"]) for r in rows] == [
        (c, m) for c in (1, 2) for m in ("sequential-auto", "batched-ar", "batched-auto")]
    assert all(r["requests"] == 8 and r["mismatch_not_tie"] == 0 for r in rows)
    assert "| concurrency | mode |" in (out / "bench.md").read_text()
    for bad, said in ((["--concurrency", "1,x"], "integers"), (["--concurrency", "0"], "levels >= 1"),
                      (["--concurrency", "2", "-d", "suffix"], "--concurrency runs the batching")):
        res = CliRunner().invoke(app, ["bench", "-m", model_dir, *bad])
        assert res.exit_code == 2 and said in res.output, res.output


def test_cli_bench_temperatures_runs_one_bench_per_temperature_and_seed(model_dir, tmp_path):
    out = tmp_path / "sampling"
    res = CliRunner().invoke(app, ["bench", "-m", model_dir, "-d", "prompt-lookup", "-k", "3", "-s", "none", "-l", "none",
                                   "--temperatures", "0.5,1", "--seeds", "1,2", "--suite", _suite_file(tmp_path),
                                   "-n", "5", "--no-costs", "--out", str(out)])
    assert res.exit_code == 0, res.output
    table = json.loads((out / "sampling.json").read_text())
    assert table["temperatures"] == [0.5, 1.0] and table["seeds"] == [1, 2]
    assert [r["config"] for r in table["rows"]] == ["prompt-lookup k=3"]
    cell = table["rows"][0]["cells"]["0.5"]
    assert cell["min"] <= cell["mean"] <= cell["max"] and cell["mat"] >= 1.0
    assert len(table["runs"]["1.0"]) == 2  # one run per seed
    assert "| prompt-lookup k=3 |" in (out / "sampling.md").read_text()
    for bad, said in ((["--temperatures", "0"], "must be > 0"), (["--temperatures", "0.5", "-t", "0.5"], "leave out"),
                      (["--temperatures", "a"], "give numbers")):
        res = CliRunner().invoke(app, ["bench", "-m", model_dir, *bad])
        assert res.exit_code == 2 and said in res.output, res.output
