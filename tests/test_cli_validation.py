"""Every CLI command rejects bad options before it loads a model or starts any work.

"Before any work" is proven structurally, not by timing: the ``no_work`` fixture replaces
``load_model`` (wherever a module holds it) and the expensive entry points of every command
(benchmark, trace recording, distillation, training, pool building, download, cost measurement,
trace reading, report writing) with functions that fail the test if called. A bad option must
then end in exit code 2 with a clear one-line message naming the option and the fix, never a
traceback. ``test_every_command_has_a_case`` makes a new command without cases fail.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from adaspec.cli import app

HEAVY = ["adaspec.bench.runner.run_bench", "adaspec.bench.trace.record", "adaspec.bench.trace.Trace.load",
         "adaspec.bench.report.write_report", "adaspec.costs.load_or_measure",
         "adaspec.training.distill.distill_run", "adaspec.training.distill.build_datastore_info",
         "adaspec.training.drafters.train_drafter", "adaspec.training.pool.build_pool",
         "adaspec.training.fetch.fetch", "adaspec.training.specdecpp_head.train_head",
         "adaspec.serve.run_server", "adaspec.bench.serve_load.run_level"]


class WorkStarted(AssertionError):
    """A command began loading a model or doing its work although an option was invalid."""


@pytest.fixture
def no_work(monkeypatch):
    """Every model load and every command's expensive step fails the test if reached; CUDA is
    reported absent (as on this CPU-only torch), so the device check is deterministic."""
    import adaspec.bench.replay  # noqa: F401 - the modules whose attributes are replaced
    import adaspec.bench.report  # noqa: F401
    import adaspec.bench.runner  # noqa: F401
    import adaspec.bench.trace  # noqa: F401
    import adaspec.training.specdecpp_head  # noqa: F401
    from adaspec import models

    def forbidden(what):
        def fail(*args, **kwargs):
            raise WorkStarted(f"{what} was called although the options are invalid")
        return fail

    original = models.load_model
    for name, module in list(sys.modules.items()):
        if name.startswith("adaspec") and getattr(module, "load_model", None) is original:
            monkeypatch.setattr(module, "load_model", forbidden(f"{name}.load_model"))
    for target in HEAVY:
        monkeypatch.setattr(target, forbidden(target) if not target.endswith("Trace.load")
                            else staticmethod(forbidden(target)))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def _cases(tmp: Path) -> list[tuple[list[str], str]]:
    """(arguments, regex the message must match); ``tmp`` holds an empty ``distilled/``
    directory and a ``t.npz`` file (see the test), nothing else."""
    missing = str(tmp / "missing")
    data = tmp / "distilled"
    trace = tmp / "t.npz"
    return [
        # train-router
        (["train-router", str(trace), "-o", str(tmp / "r.json"), "--ks", "two"], r"--ks must be comma-separated integers"),
        (["train-router", str(trace), "-o", str(tmp / "r.json"), "--ks", "0"], r"--ks needs integers >= 1"),
        (["train-router", str(trace), "-o", f"{missing}/r.json"], r"--out .*: the folder .* does not exist"),
        # vllm-args
        (["vllm-args", str(tmp), "-d", "model:x"], r"for a draft model use the serving engine's own"),
        (["vllm-args", str(tmp), "--selector", "bogus"], r"unknown selector 'bogus'"),
        (["vllm-args", str(tmp), "-k", "0"], r"draft length k must be an integer >= 1"),
        (["vllm-args", str(tmp), "--scope", "forever"], r"scope must be 'request' or 'global'"),
        # serve
        (["serve", "--device", "cuda"], r"--device cuda: this torch build has no CUDA"),
        (["serve", "-d", "bogus"], r"--drafter 'bogus': unknown drafter"),
        (["serve", "-s", "bandit9"], r"unknown selector 'bandit9'"),
        (["serve", "--port", "70000"], r"--port 70000: must be an integer >= 1 and <= 65535"),
        (["serve", "--max-queue", "0"], r"--max-queue 0: must be"),
        (["serve", "--max-batch", "0"], r"--max-batch 0: must be an integer >= 1"),
        (["serve", "--max-batch", "300", "--backend", "llama.cpp"], r"--max-batch 300: a llama.cpp context holds at most 256"),
        (["serve", "--flash-attn"], r"--flash-attn/--no-flash-attn is for --backend llama.cpp"),
        (["serve", "--timeout", "0"], r"--timeout 0.0: must be"),
        (["serve", "--prefix-cache-tokens", "-1"], r"--prefix-cache-tokens -1: must be an integer >= 0"),
        (["serve", "--prefill-chunk", "0"], r"--prefill-chunk 0: must be an integer >= 1"),
        (["serve", "--suffix-store-tokens", "-1"], r"--suffix-store-tokens must be >= 0 \(0: off\), got -1"),
        (["serve", "-d", "suffix", "--suffix-store-tokens", "5"], r"with -d, give -d suffix:learn=true,max_tokens=N"),
        (["serve", "--state-file", f"{missing}/s.json"], r"--state-file .*: the folder .* does not exist"),
        # bench-serve
        (["bench-serve", "--url", "127.0.0.1:8000"], r"give the server's OpenAI base URL"),
        (["bench-serve", "-c", "0"], r"--concurrency, --requests, --max-tokens and --repeats must be >= 1"),
        (["bench-serve", "--json", f"{missing}/x.json"], r"--json .*: the folder .* does not exist"),
        (["bench-serve", "--suite", "nonsense"], r"nonsense"),
        # generate
        (["generate", "hi", "--device", "cuda"], r"--device cuda: this torch build has no CUDA .* use --device cpu"),
        (["generate", "hi", "--device", "tpu9"], r"--device 'tpu9': not a torch device"),
        (["generate", "hi", "--dtype", "float8"], r"unknown dtype 'float8'"),
        (["generate", "hi", "-m", f"{missing}.gguf"], r"GGUF file not found"),
        (["generate", "hi", "-m", str(tmp)], r"is not a model directory \(no config.json\)"),
        (["generate", "hi", "-d", "bogus"], r"--drafter 'bogus': unknown drafter"),
        (["generate", "hi", "-d", "prompt-lookup:max_ngram=x"], r"max_ngram='x' is not a valid int"),
        (["generate", "hi", "-d", "early-exit"], r"early-exit needs the number of layers"),
        (["generate", "hi", "-d", f"feature-head:path={missing}.pt"], r"feature head file not found"),
        (["generate", "hi", "-k", "0"], r"k must be an integer >= 1"),
        (["generate", "hi", "--selector", "bandit9"], r"unknown selector 'bandit9'"),
        (["generate", "hi", "--length", "magic"], r"unknown length policy 'magic'"),
        (["generate", "hi", "-t", "-1"], r"temperature must be >= 0"),
        (["generate", "hi", "--top-p", "0"], r"top_p must be in \(0, 1\]"),
        (["generate", "hi", "--tree", "--tree-nodes", "0"], r"--tree-nodes 0: must be an integer >= 1"),
        (["generate", "hi", "--tree", "--backend", "llama.cpp"], r"--tree: draft trees are verified on the "
         r"transformers backend, not llama.cpp"),
        (["generate", "hi", "--flash-attn"], r"--flash-attn/--no-flash-attn is for --backend llama.cpp"),
        # bench
        (["bench", "--record", str(tmp / "t2.npz"), "-d", "none"], r"--record: drafter 'none' cannot be recorded"),
        (["bench", "--record", str(tmp / "t.json")], r"a trace is a .npz file"),
        (["bench", "--record", str(tmp / "t3.npz"), "--no-record"], r"--record and --no-record contradict"),
        (["generate", "hi", "-s", "auto:peek=3"], r"peek must be 0 or 1"),
        (["bench", "--record", str(tmp / "no" / "t.npz")], r"does not exist: create it first"),
        (["bench", "--device", "cuda"], r"--device cuda: this torch build has no CUDA"),
        (["bench", "--repeats", "0"], r"--repeats 0: must be an integer >= 1"),
        (["bench", "-n", "0"], r"--max-new-tokens 0: must be an integer >= 1"),
        (["bench", "-t", "-0.5"], r"--temperature -0.5: must be a number >= 0"),
        (["bench", "-s", "nope"], r"unknown selector 'nope'"),
        (["bench", "-l", "magic"], r"unknown length policy 'magic'"),
        (["bench", "-k", "0"], r"k must be an integer >= 1"),
        (["bench", "--tree", "--backend", "llamacpp"], r"--tree: draft trees are verified on the transformers "
         r"backend"),
        (["bench", "-d", "suffixx"], r"--drafter 'suffixx': unknown drafter"),
        (["bench", "-m", f"{missing}.gguf"], r"GGUF file not found"),
        (["bench", "--suite", f"{missing}.jsonl"], r"prompt file not found: .*missing.jsonl"),
        # costs
        (["costs", "--device", "cuda"], r"--device cuda: this torch build has no CUDA"),
        (["costs", "--no-flash-attn"], r"--flash-attn/--no-flash-attn is for --backend llama.cpp"),
        (["bench", "--flash-attn", "--backend", "transformers"], r"--flash-attn/--no-flash-attn is for --backend"),
        (["costs", "--dtype", "int3"], r"unknown dtype 'int3'"),
        # train-head
        (["train-head", "--device", "cuda"], r"--device cuda: this torch build has no CUDA"),
        (["train-head", "-d", "suffix"], r"--drafter 'suffix': use model:REF"),
        (["train-head", "-d", "early-exit:layers=x"], r"layers='x' is not a valid int"),
        (["train-head", "--epochs", "0"], r"epochs must be an integer >= 1"),
        (["train-head", "--prompts", missing], r"prompt file not found"),
        # report
        (["report", missing], r"missing/summary.json: no such file; run `adaspec bench` first"),
        # distill
        (["distill", "--domain", "poetry"], r"unknown training domain"),
        (["distill", "-t", "-0.5"], r"--temperature -0.5: must be a number >= 0"),
        (["distill", "--samples", "0"], r"--samples 0: must be an integer >= 1"),
        (["distill", "-m", f"{missing}.gguf"], r"GGUF file not found"),
        # build-datastore
        (["build-datastore", missing, "-o", str(tmp / "ds.jsonl")], r"DATA '.*missing': no such directory"),
        (["build-datastore", str(data), "-o", str(tmp / "ds.jsonl"), "--min-match", "0"],
         r"--min-match 0: must be an integer >= 1"),
        # build-pool
        (["build-pool", "--domains", "poetry"], r"pool domains must be distinct names among"),
        (["build-pool", "--kinds", "eagle"], r"pool drafter kinds must be distinct names among"),
        (["build-pool", "--epochs", "0"], r"--epochs 0: must be an integer >= 1"),
        (["build-pool", "--threads", "0"], r"--threads 0: must be an integer >= 1"),
        # fetch: every name is checked before the first download
        (["fetch", "qwen2.5-coder-0.5b", "bogus-model"], r"unknown model 'bogus-model' to fetch: use one of"),
        # replay
        (["replay", str(trace), "-k", "0"], r"k must be an integer >= 1"),
        (["replay", str(trace), "-s", "nope"], r"unknown selector 'nope'"),
        (["replay", str(trace), "-l", "magic"], r"unknown length policy 'magic'"),
        # train-drafter
        (["train-drafter", "--kind", "eagle", "--data", str(data), "-o", str(tmp / "h.pt")],
         r"kind.*use one of"),
        (["train-drafter", "--kind", "feature-head", "--data", missing, "-o", str(tmp / "h.pt")],
         r"--data '.*missing': no such directory"),
        (["train-drafter", "--kind", "feature-head", "--data", str(data), "-o", str(tmp / "h.pt"),
          "--heldout", "1.5"], r"heldout_fraction"),
        (["train-drafter", "--kind", "tiny-lm", "--data", str(data), "-o", str(tmp / "lm"),
          "--init-from", missing], r"--init-from '.*missing': no such directory"),
    ]


CASES = _cases(Path("TMP"))  # for the test ids and the command coverage only


@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"{a[0]}-{i}" for i, (a, _) in enumerate(CASES)])
def test_bad_option_fails_before_any_work(case, no_work, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "distilled").mkdir()
    (tmp_path / "t.npz").write_bytes(b"never read")
    args, pattern = _cases(tmp_path)[case]
    res = CliRunner().invoke(app, args)
    text = " ".join(res.output.split())  # rich wraps long lines
    assert not isinstance(res.exception, WorkStarted), f"{args}: {res.exception}"
    assert res.exit_code == 2, (args, res.exit_code, text, res.exception)
    assert "Traceback" not in res.output
    assert re.search(pattern, text), f"{args}: {pattern!r} not in {text!r}"


@pytest.mark.parametrize("command", [["bench", "--suite"], ["build-datastore", "-o", "ds.jsonl"], ["report"]])
def test_an_error_prints_a_long_path_with_brackets_in_one_piece(command, no_work, tmp_path):
    """Error messages are neither hard-wrapped (a path breaks where the line ends) nor read as
    rich markup (``[draft]`` would vanish), in the main CLI and the training commands alike."""
    path = tmp_path / ("long-folder-name-" * 6) / "[draft] missing.jsonl"
    res = CliRunner().invoke(app, [*command, str(path)])
    assert res.exit_code == 2, res.output
    assert str(path) in res.output, res.output


def test_every_command_has_a_case():
    commands = {c.name or c.callback.__name__.replace("_", "-") for c in app.registered_commands}
    covered = {args[0] for args, _ in CASES}
    assert len(commands) >= 11
    assert commands == covered, f"commands without a bad-option case: {sorted(commands - covered)}"


@pytest.mark.parametrize("args", [
    ["generate", "hi", "-n", "2"], ["bench", "--no-costs"], ["costs"], ["train-head"], ["distill", "-n", "2"],
    ["build-pool", "--quick"], ["fetch", "qwen2.5-coder-0.5b"], ["replay", "t.npz"],
    ["build-datastore", "distilled", "-o", "ds.jsonl"],
    ["train-drafter", "--kind", "feature-head", "--data", "distilled", "-o", "h.pt"],
    ["serve", "--no-state"], ["bench-serve", "--model", "m", "-c", "1"], ["vllm-args", "hf", "--export", "smollm2"],
    ["train-router", "t.npz", "-o", "r.json"],
], ids=lambda a: a[0])
def test_the_guard_stops_valid_commands(args, no_work, tmp_path, monkeypatch):
    """Control of the structural proof: with valid options the same commands do reach a
    guarded step, so a bad option that got past the checks could not pass unnoticed."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "distilled").mkdir()
    (tmp_path / "t.npz").write_bytes(b"never read")
    res = CliRunner().invoke(app, args)
    assert isinstance(res.exception, WorkStarted), (args, res.exit_code, res.output)
