"""The bench harness: regret and summary on hand-made records, multi-turn runs, config files."""

from __future__ import annotations

import csv
import json

import pytest

from conftest import make_tiny_model, word_tokenizer

from adaspec.bench.runner import (
    SCHEMA,
    BenchConfig,
    BenchRun,
    PromptRecord,
    default_configs,
    explicit_configs,
    load_bench_file,
    run_bench,
)
from adaspec.errors import ConfigError
from adaspec.models import as_loaded
from adaspec.bench.workloads import BenchPrompt

WORDS = [f"w{i:02d}" for i in range(32)]


def _rec(config, pid, pos, rounds, seconds, usage, tokens=10):
    return PromptRecord(config, pid, "cat" if pid != "p2" else "other", pos, tokens=tokens, seconds=seconds,
                        rounds=rounds, drafted=rounds, accepted=rounds // 2, drafter_usage=usage)


@pytest.fixture
def hand_run():
    configs = [BenchConfig("AR", []), BenchConfig("A k=5", ["a"]), BenchConfig("B k=5", ["b"]),
               BenchConfig("sel", ["a", "b"], selector="ucbspec")]
    records = [
        _rec("AR", "p1", 0, 10, 2.0, {}), _rec("AR", "p2", 1, 10, 2.0, {}),
        _rec("A k=5", "p1", 0, 4, 1.0, {"a": 4}), _rec("A k=5", "p2", 1, 8, 1.8, {"a": 8}),
        _rec("B k=5", "p1", 0, 6, 1.2, {"b": 6}), _rec("B k=5", "p2", 1, 5, 1.1, {"b": 5}),
        # the policy: p1 uses a 3 times and b 2 times (5 rounds), p2 a 1 and b 6 (7 rounds)
        _rec("sel", "p1", 0, 5, 1.3, {"a": 3, "b": 2}), _rec("sel", "p2", 1, 7, 1.5, {"a": 1, "b": 6}),
    ]
    return BenchRun("m", configs, records, [], 10, 1)


def test_regret_against_fixed_arms(hand_run):
    reg = hand_run.regret(hand_run.configs[3])
    # best arm per prompt by rounds: p1 -> A (4), p2 -> B (5); stopping-time regret (5-4)+(7-5)
    assert reg["stopping_time_regret"] == 3
    assert reg["best_arm_ratio"] == pytest.approx((3 + 6) / 12)
    # best fixed configuration over the workload by time: A 2.8 s, B 2.3 s -> B
    assert reg["best_fixed"] == "B k=5"
    assert reg["cumulative_seconds"] == pytest.approx([0.1, 0.5])
    assert reg["cumulative_rounds"] == [-1, 1]
    assert hand_run.regret(hand_run.configs[1]) is None  # static configurations have no regret


def test_summary_schema_and_speedups(hand_run):
    s = hand_run.summary()
    assert s["schema"] == SCHEMA and s["n_prompts"] == 2 and s["categories"] == ["cat", "other"]
    assert [c["kind"] for c in s["configs"]] == ["ar", "static", "static", "adaptive"]
    overall = {r["config"]: r for r in s["overall"]}
    assert overall["A k=5"]["speedup"] == pytest.approx(4.0 / 2.8)
    assert overall["sel"]["mat"] == pytest.approx(20 / 12)
    assert overall["sel"]["stopping_time_regret"] == 3
    cat = {r["config"]: r for r in s["per_category"]["cat"]}
    assert cat["B k=5"]["speedup"] == pytest.approx(2.0 / 1.2)
    assert cat["sel"]["stopping_time_regret"] == 1  # p1 only
    assert set(s["regret"]) == {"sel"}
    json.dumps(s)


def test_default_configs_with_peers_and_duplicates():
    configs = default_configs(["prompt-lookup"], [3], peers=["hf-pld"])
    assert [c.kind for c in configs] == ["ar", "static", "peer"]
    with pytest.raises(ConfigError, match="twice"):
        default_configs(["prompt-lookup", "prompt-lookup"], [3])
    with pytest.raises(ConfigError, match="k must be"):
        default_configs(["prompt-lookup"], [0])
    with pytest.raises(ConfigError, match="ks is empty"):  # was an IndexError
        default_configs(["suffix"], [], lengths=["cost-model"], static=False)
    assert [c.kind for c in default_configs([], [], peers=["hf-pld"])] == ["ar", "peer"]


def test_bench_file_toml(tmp_path):
    f = tmp_path / "matrix.toml"
    f.write_text('drafters = ["prompt-lookup"]\nks = [2, 4]\nmax_new_tokens = 8\n'
                 '[[config]]\nname = "joint"\ndrafters = ["prompt-lookup", "suffix"]\n'
                 'selector = "ucbspec"\nlength = "cost-model"\nk = 4\n')
    data = load_bench_file(f)
    assert data["ks"] == [2, 4]
    (cfg,) = explicit_configs(data["config"])
    assert cfg.name == "joint" and cfg.kind == "adaptive" and cfg.k == 4 and cfg.length == "cost-model"
    bad = tmp_path / "bad.toml"
    bad.write_text("drafter = ['x']\n")
    with pytest.raises(ConfigError, match="unknown keys"):
        load_bench_file(bad)
    with pytest.raises(ConfigError, match="unknown keys"):
        explicit_configs([{"name": "x", "selectr": "ucbspec"}])
    with pytest.raises(ConfigError, match="does not exist"):
        load_bench_file(tmp_path / "missing.toml")


def test_multi_turn_run_writes_summary_and_rounds(tmp_path):
    target = as_loaded(make_tiny_model(seed=0), word_tokenizer(WORDS), "tiny")
    work = [BenchPrompt("t1", "copy", ("w01 w02 w03 w04 w01 w02 w03", "w04 w01 w02")),
            BenchPrompt("t2", "random", ("w07 w19 w03 w22 w11 w05",))]
    configs = default_configs(["prompt-lookup", "suffix"], [3], selectors=["ucbspec"])
    run = run_bench(target, configs, work, max_new_tokens=6, measure_costs=False)
    recs = {(r.config, r.prompt_id): r for r in run.records}
    for c in configs:
        assert recs[(c.name, "t1")].tokens == 12  # two turns of 6 tokens
        assert recs[(c.name, "t2")].tokens == 6
        assert all(recs[(c.name, p)].identical for p in ("t1", "t2"))
    sel = recs[(configs[-1].name, "t1")]
    assert sum(sel.drafter_usage.values()) == sel.rounds
    written = run.save(tmp_path, plots=False)
    assert {p.name for p in written} == {"summary.json", "rounds.csv", "verify_steps.csv"}
    assert all(len(r.pass_seconds) == 1 for r in run.records)  # one pass: its time is the median
    assert all(r.pass_seconds[0] == r.seconds for r in run.records)
    with open(tmp_path / "rounds.csv") as fh:
        rows = list(csv.DictReader(fh))
    spec_rounds = sum(r.rounds for r in run.records if r.config != configs[0].name)
    ar_rounds = sum(r.rounds for r in run.records if r.config == configs[0].name)
    assert len(rows) == spec_rounds + ar_rounds
    assert json.loads((tmp_path / "summary.json").read_text())["schema"] == SCHEMA


def test_repeats_are_passes_over_the_workload():
    """Each repeat runs every prompt (every turn, every configuration) before the next repeat
    starts, so a prompt's median spans passes minutes apart; a later turn's history is the
    first pass's AR answer, and the records equal a single pass's in tokens and outputs."""
    target = as_loaded(make_tiny_model(seed=0), word_tokenizer(WORDS), "tiny")
    work = [BenchPrompt("t1", "copy", ("w01 w02 w03 w04 w01 w02 w03", "w04 w01 w02")),
            BenchPrompt("t2", "random", ("w07 w19 w03 w22 w11 w05",))]
    configs = default_configs(["prompt-lookup"], [3])
    seen: list[str] = []
    one = run_bench(target, configs, work, max_new_tokens=6, measure_costs=False)
    run = run_bench(target, configs, work, max_new_tokens=6, measure_costs=False, repeats=3,
                    progress=seen.append)
    names = [c.name for c in run.configs]
    per_pass = [f"{p} [{c}] {n}" for p, c, turns in (("t1", "copy", 2), ("t2", "random", 1))
                for _ in range(turns) for n in names]
    assert seen == [f"{m} (pass {r}/3)" for r in (1, 2, 3) for m in per_pass]
    key = lambda r: (r.config, r.prompt_id, r.tokens, r.rounds, r.identical)  # noqa: E731
    assert [key(r) for r in run.records] == [key(r) for r in one.records]
    assert len(run.rounds) == len(one.rounds)


def test_every_pass_starts_from_fresh_engines():
    """What an engine learns in one pass (here a learning datastore, which stores every output)
    must not help it on the same prompts in the next: every pass drafts and verifies exactly as
    the first, round for round."""
    target = as_loaded(make_tiny_model(seed=0), word_tokenizer(WORDS), "tiny")
    work = [BenchPrompt("t1", "random", ("w07 w19 w03 w22 w11 w05",)),
            BenchPrompt("t2", "random", ("w13 w02 w29 w08",))]
    configs = [BenchConfig("learn", ["suffix:learn=1"], k=3)]
    run = run_bench(target, configs, work, max_new_tokens=12, measure_costs=False, repeats=2)
    widths = [[(r.position, r.width) for r in run.verify_rows if r.pass_ == p] for p in (0, 1)]
    assert widths[0] and widths[0] == widths[1]


def test_live_verify_rows_and_leave_one_out_predictions(tmp_path, monkeypatch):
    """``run_bench`` keeps every chain round's verify step of every pass; the steps of the
    passes whose times are the live medians price replay: a trace recorded with them prices
    widths by them, and ``predict_from`` prices each configuration without its own rows."""
    import csv
    import dataclasses

    from adaspec.bench.trace import record

    monkeypatch.setenv("ADASPEC_CACHE", str(tmp_path))
    target = as_loaded(make_tiny_model(seed=0), word_tokenizer(WORDS), "tiny")
    work = [BenchPrompt("t1", "copy", ("w01 w02 w03 w04 w01 w02 w03 w04 w01 w02",))]
    configs = default_configs(["prompt-lookup"], [3])
    run = run_bench(target, configs, work, max_new_tokens=8, measure_costs=False, repeats=3)
    names = [c.name for c in run.configs]
    n_rounds = {n: sum(r.rounds for r in run.records if r.config == n) for n in names}
    for n in names:  # every pass's rounds, one pass of three priced: the median one
        mine = [row for row in run.verify_rows if row.config == n]
        assert len(mine) == 3 * n_rounds[n]
        assert {row.pass_ for row in mine} == {0, 1, 2}
        assert len({row.pass_ for row in mine if row.median}) == 1
    assert all(r.width >= 1 and r.cached >= 1 and r.seconds > 0 for r in run.verify_rows)
    assert {r.width for r in run.verify_rows if r.config == names[0]} == {1}  # AR: plain steps
    priced = run.priced_rows()
    assert len(priced) == sum(n_rounds.values())
    trace = record(target, ["prompt-lookup"], work, 8, tmp_path / "t.npz", fresh_costs=False,
                   live_rows=priced)
    assert trace.info["verify_base"] and trace.overheads.verify_widths[0] == 1
    import adaspec.bench.trace as trace_mod

    seen: list[list[tuple[int, int, float]]] = []
    orig = trace_mod.live_verify_table

    def spy(surface, rows, fallback):
        seen.append(list(rows))
        return orig(surface, rows, fallback)

    monkeypatch.setattr(trace_mod, "live_verify_table", spy)
    run.predict_from(trace)
    assert len(seen) == len(names)
    for n, rows in zip(names, seen):  # each configuration priced without its own rows
        assert rows == [(r.width, r.cached, r.seconds) for r in run.verify_rows if r.median and r.config != n]
    assert all("seconds" in run.predictions[n] for n in names)
    bare = dataclasses.replace(trace, info={k: v for k, v in trace.info.items() if k != "verify_base"})
    seen.clear()
    run.predict_from(bare)  # a trace without live prices: one replay of every configuration
    assert seen == []
    run.save(tmp_path / "out", plots=False)  # every step is written, for re-pricing offline
    with open(tmp_path / "out" / "verify_steps.csv", encoding="utf-8") as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == len(run.verify_rows) and rows[0]["config"] == names[0]
    assert sum(r["median"] == "True" for r in rows) == len(priced)


def test_median_passes_are_the_middle_times():
    from adaspec.bench.runner import median_passes

    assert median_passes([3.0, 1.0, 2.0]) == {2}
    assert median_passes([5.0]) == {0}
    assert median_passes([4.0, 1.0, 3.0, 2.0]) == {2, 3}  # even: both middle passes


def test_sampling_bench_does_not_compare_outputs():
    target = as_loaded(make_tiny_model(seed=0), word_tokenizer(WORDS), "tiny")
    work = [BenchPrompt("t2", "random", ("w07 w19 w03 w22 w11 w05",))]
    run = run_bench(target, default_configs(["prompt-lookup"], [3]), work, max_new_tokens=6,
                    measure_costs=False, temperature=1.0, seed=3)
    assert all(r.identical == r.prompts for r in run.results)
    assert run.temperature == 1.0


def test_per_prompt_oracle(hand_run):
    o = hand_run.oracle()
    # p1: A (1.0 s) beats B (1.2 s); p2: B (1.1 s) beats A (1.8 s)
    assert o["choices"] == {"p1": "A k=5", "p2": "B k=5"}
    assert o["seconds"] == pytest.approx(2.1) and o["speedup"] == pytest.approx(4.0 / 2.1)
    assert o["mat"] == pytest.approx(20 / 9)
    assert hand_run.summary()["oracle"]["choices"] == o["choices"]


@pytest.fixture
def sampled_run():
    """T > 0: every configuration samples answers of other lengths. B runs at exactly AR's speed
    per token (10 tokens/s) with longer answers; A is 2x per token on p1 and level on p2."""
    configs = [BenchConfig("AR", []), BenchConfig("A k=5", ["a"]), BenchConfig("B k=5", ["b"]),
               BenchConfig("sel", ["a", "b"], selector="ucbspec")]
    records = [
        _rec("AR", "p1", 0, 10, 1.0, {}, tokens=10), _rec("AR", "p2", 1, 20, 2.0, {}, tokens=20),
        _rec("A k=5", "p1", 0, 4, 0.2, {"a": 4}, tokens=4), _rec("A k=5", "p2", 1, 10, 3.0, {"a": 10}, tokens=30),
        _rec("B k=5", "p1", 0, 20, 2.0, {"b": 20}, tokens=20), _rec("B k=5", "p2", 1, 40, 4.0, {"b": 40}, tokens=40),
        _rec("sel", "p1", 0, 5, 0.5, {"a": 5}, tokens=8), _rec("sel", "p2", 1, 12, 2.4, {"b": 12}, tokens=24),
    ]
    return BenchRun("m", configs, records, [], 40, 1, temperature=0.7)


def test_sampling_speedup_is_per_token(sampled_run):
    s = sampled_run.summary()
    assert s["speedup_basis"] == "per_token"
    overall = {r["config"]: r for r in s["overall"]}
    # B: 60 tokens in 6 s against AR's 30 in 3 s: the same speed, although its seconds doubled
    assert overall["B k=5"]["speedup"] == pytest.approx(1.0)
    assert overall["A k=5"]["speedup"] == pytest.approx((34 / 3.2) / 10)
    assert {r["config"]: r["speedup"] for r in s["per_category"]["cat"]}["A k=5"] == pytest.approx(2.0)


def test_sampling_oracle_and_regret_per_token(sampled_run):
    o = sampled_run.oracle()
    # per token: p1 A 0.05 s/token beats B 0.1; p2 A and B tie at 0.1 s/token
    assert o["choices"]["p1"] == "A k=5"
    # priced on AR's answer lengths: p1 10 tokens x 0.05 s, p2 20 tokens x 0.1 s
    assert o["seconds"] == pytest.approx(0.5 + 2.0) and o["speedup"] == pytest.approx(3.0 / 2.5)
    reg = sampled_run.regret(sampled_run.configs[3])
    # best fixed per token over the workload: A 3.2 s / 34 tokens beats B 6 s / 60 tokens
    assert reg["best_fixed"] == "A k=5"
    # p1: 0.5 s for 8 tokens vs A's 0.05 s/token x 8 = 0.4; p2: 2.4 s for 24 tokens vs 0.1 x 24 = 2.4
    assert reg["cumulative_seconds"] == pytest.approx([0.1, 0.1])
    # stopping time: arms' rounds per token x the policy's tokens; p1 best A 1.0/token -> 8 rounds,
    # p2 best A (10/30) -> 8 rounds; policy 5 and 12
    assert reg["stopping_time_regret"] == pytest.approx((5 - 8) + (12 - 8))


def test_greedy_speedup_unchanged_by_the_per_token_basis(hand_run):
    assert hand_run.summary()["speedup_basis"] == "seconds"
    assert hand_run.speedup(hand_run.result("A k=5")) == pytest.approx(4.0 / 2.8)


def test_verify_probe_samples_after_every_request_without_changing_outputs():
    """``run_bench(probe=...)``: one probe sample (a width-1 and one wider forward on the
    probe's own cache, cropped back) after every request; the runs' outputs are untouched."""
    from adaspec.bench.trace import VerifyProbe

    target = as_loaded(make_tiny_model(seed=0), word_tokenizer(WORDS), "tiny")
    work = [BenchPrompt("t1", "copy", ("w01 w02 w03 w04 w01 w02 w03",)),
            BenchPrompt("t2", "random", ("w07 w19 w03 w22 w11 w05",))]
    configs = default_configs(["prompt-lookup"], [3])
    probe = VerifyProbe(target, [1, 2, 4, 8], context=12)
    plain = run_bench(target, configs, work, max_new_tokens=6, measure_costs=False, repeats=2)
    run = run_bench(target, configs, work, max_new_tokens=6, measure_costs=False, repeats=2, probe=probe)
    n_requests = len(work) * len(run.configs) * 2  # AR included, 2 repeats
    assert [w for w, _, _ in probe.rows] == [x for j in range(n_requests) for x in (1, (2, 4, 8)[j % 3])]
    assert all(ctx == 12 and s > 0 for _, ctx, s in probe.rows)
    assert target.state_length(probe._state) == 12  # every probe forward cropped back
    assert [(r.config, r.tokens, r.identical) for r in run.records] == [
        (r.config, r.tokens, r.identical) for r in plain.records]
    probe.close()
    assert probe._state is None
    with pytest.raises(ConfigError, match="positive number of tokens"):
        VerifyProbe(target, [1, 2], context=0)


def test_every_shipped_bench_config_loads():
    """The config files in benchmarks/ (the commands results.md quotes) stay readable: keys,
    types and explicit configurations are checked as `adaspec bench --config` checks them."""
    from pathlib import Path

    from adaspec.bench.runner import explicit_configs, load_bench_file

    files = sorted((Path(__file__).resolve().parents[1] / "benchmarks").glob("*.toml"))
    assert len(files) >= 9  # one a question (benchmarks/README.md)
    for f in files:
        data = load_bench_file(f)
        names = [c.name for c in explicit_configs(data.get("config", []))]
        assert len(names) == len(set(names)), f"{f.name}: repeated configuration names"


def test_steadiness_is_the_spread_of_plain_step_times_within_each_request():
    """Each run's plain-step time against the median of its request's runs; the 10th-90th
    percentile of those ratios is the drift two speed-ups must exceed to be told apart."""
    from adaspec.bench.runner import steadiness

    st = steadiness([[0.10, 0.10, 0.12, 0.08], [0.20, 0.30], [0.5]])  # a lone run compares with nothing
    ratios = sorted([1.0, 1.0, 1.2, 0.8, 0.8, 1.2])
    assert st["runs"] == 6 and st["min"] == pytest.approx(0.8) and st["max"] == pytest.approx(1.2)
    assert ratios[0] <= st["p10"] <= 1.0 <= st["p90"] <= ratios[-1]
    assert steadiness([[0.1, 0.1, 0.1, 0.1]]) == {"runs": 4, "p10": 1.0, "p90": 1.0, "min": 1.0, "max": 1.0}
    assert steadiness([[0.1, 0.2]]) is None and steadiness([]) is None  # too few runs to say


def test_plain_step_seconds_reads_plain_rounds_only():
    from adaspec.bench.runner import STEADY_MIN_ROUNDS, plain_step_seconds
    from adaspec.metrics import RequestStats, RoundRecord

    def rnd(drafted, verify_s, tree_nodes=0):
        return RoundRecord("x", 5, drafted, 0, 1, 0.0, verify_s, 0.0, 0, 0.0, 0.0, verify_s, tree_nodes=tree_nodes)

    stats = RequestStats()
    stats.rounds = [rnd(0, 0.05)] * STEADY_MIN_ROUNDS + [rnd(5, 0.5)] * 9 + [rnd(3, 0.5, tree_nodes=3)] * 9
    assert plain_step_seconds(stats) == pytest.approx(0.05)  # drafted rounds and trees left out (mean)
    stats.rounds = stats.rounds[1:]
    assert plain_step_seconds(stats) is None  # too few plain rounds
    assert plain_step_seconds(object()) is None  # a peer's run: no rounds


def test_bench_reports_the_machines_steadiness(tmp_path):
    from adaspec.bench.report import markdown_tables, steadiness_line, write_report

    target = as_loaded(make_tiny_model(seed=0), word_tokenizer(WORDS), "tiny")
    work = [BenchPrompt("t1", "random", ("w07 w19 w03 w22 w11 w05",)),
            BenchPrompt("t2", "random", ("w09 w01 w13 w02",))]
    run = run_bench(target, default_configs(["suffix"], [3]), work, max_new_tokens=12, measure_costs=False,
                    repeats=2)
    st = run.summary()["steadiness"]
    assert st is not None and st["runs"] >= 4  # AR's runs alone: 2 prompts x 2 passes
    assert st["min"] <= st["p10"] <= st["p90"] <= st["max"]
    line = steadiness_line(run.summary())
    assert line.startswith("Machine steadiness:") and "median over 2 passes" in line  # two passes given
    assert line in markdown_tables(run.summary())
    write_report(run.summary(), tmp_path)
    assert line in (tmp_path / "report.md").read_text()
    one_pass = {**run.summary(), "repeats": 1}
    assert "--repeats 3" in steadiness_line(one_pass)
    assert steadiness_line({**run.summary(), "steadiness": None}) is None
