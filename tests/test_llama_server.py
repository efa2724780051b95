"""llama-server: finding and building it, the launcher, the ``llama-server`` bench peers and
``bench-serve --llama-server``, against a stub server (``llama_server_stub.py``, a Python HTTP
server on 127.0.0.1 run as a subprocess); a slow test runs a real build when one is cached."""

from __future__ import annotations

import io
import json
import os
import stat
import subprocess
import sys
import tarfile
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import make_tiny_model, word_tokenizer

from adaspec.bench import llama_server as ls
from adaspec.bench.llama_server import (LlamaServer, LlamaServerError, ServerOptions, build_llama_server,
                                        extract_llama_cpp, find_llama_server, sdist_version)
from adaspec.bench.llama_server_peer import (LlamaServerPeer, completion_request, parse_completion,
                                             parse_llama_server_peer)
from adaspec.bench.peers import all_peer_names, check_peer
from adaspec.errors import ConfigError, PromptError
from adaspec.models import as_loaded

STUB = Path(__file__).with_name("llama_server_stub.py")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty adaspec cache and a PATH without llama-server: nothing is found by accident."""
    root = tmp_path / "cache"
    monkeypatch.setenv("ADASPEC_CACHE", str(root))
    monkeypatch.delenv(ls.LLAMA_SERVER_ENV, raising=False)
    bare = tmp_path / "bare-bin"
    bare.mkdir()
    monkeypatch.setenv("PATH", str(bare))
    return root


def _script(path: Path, body: str) -> Path:
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


@pytest.fixture
def stub(tmp_path, monkeypatch):
    """An executable llama-server stand-in; its command line is written to ``argv.json`` and every
    POST body to ``requests.jsonl``."""
    monkeypatch.setenv("STUB_ARGV", str(tmp_path / "argv.json"))
    monkeypatch.setenv("STUB_REQUESTS", str(tmp_path / "requests.jsonl"))
    return _script(tmp_path / "llama-server", f'exec "{sys.executable}" "{STUB}" "$@"')


def _argv(tmp_path: Path) -> list[str]:
    return json.loads((tmp_path / "argv.json").read_text())


def _requests(tmp_path: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines()]


@pytest.fixture
def model_file(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF")
    return path


# -- finding -----------------------------------------------------------------------------------
def test_find_prefers_the_given_path_then_env_then_path_then_cache(cache, tmp_path, monkeypatch):
    with pytest.raises(LlamaServerError, match="adaspec fetch llama-server"):
        find_llama_server()
    version = ls.installed_llama_cpp_version() or "0.0.0"
    monkeypatch.setattr(ls, "installed_llama_cpp_version", lambda: version)
    ls.build_root(version).mkdir(parents=True)
    built = _script(ls.build_root(version) / ls.BINARY, "exit 0")
    assert find_llama_server() == built.resolve()
    on_path = _script(Path(os.environ["PATH"]) / ls.BINARY, "exit 0")
    assert find_llama_server() == on_path.resolve()
    env = _script(tmp_path / "env-server", "exit 0")
    monkeypatch.setenv(ls.LLAMA_SERVER_ENV, str(env))
    assert find_llama_server() == env.resolve()
    given = _script(tmp_path / "given-server", "exit 0")
    assert find_llama_server(given) == given.resolve()


def test_find_names_a_missing_or_unusable_binary(cache, tmp_path, monkeypatch):
    with pytest.raises(LlamaServerError, match="does not exist"):
        find_llama_server(tmp_path / "nope")
    plain = tmp_path / "not-exec"
    plain.write_text("x")
    with pytest.raises(LlamaServerError, match="not executable"):
        find_llama_server(plain)
    monkeypatch.setenv(ls.LLAMA_SERVER_ENV, str(tmp_path / "gone"))
    with pytest.raises(LlamaServerError, match=r"\$ADASPEC_LLAMA_SERVER"):
        find_llama_server()


# -- building ----------------------------------------------------------------------------------
def _sdist(path: Path, files: dict[str, bytes], top: str = "llama_cpp_python-9.9.9") -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(f"{top}/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def test_sdist_version_and_safe_extraction(tmp_path):
    assert sdist_version(Path("llama_cpp_python-0.3.36.tar.gz")) == "0.3.36"
    with pytest.raises(LlamaServerError, match="not a llama-cpp-python source archive"):
        sdist_version(Path("other-1.0.tar.gz"))
    archive = _sdist(tmp_path / "llama_cpp_python-9.9.9.tar.gz", {
        "vendor/llama.cpp/tools/server/README.md": b"server",
        "vendor/llama.cpp/CMakeLists.txt": b"project(x)",
        "vendor/llama.cpp/../../../escape.txt": b"no",
        "llama_cpp/__init__.py": b"not llama.cpp"})
    root = extract_llama_cpp(archive, tmp_path / "src")
    assert (root / "tools" / "server" / "README.md").read_bytes() == b"server"
    assert not (tmp_path / "escape.txt").exists() and not (root / "llama_cpp").exists()
    bare = _sdist(tmp_path / "llama_cpp_python-9.9.8.tar.gz", {"vendor/llama.cpp/CMakeLists.txt": b"x"})
    with pytest.raises(LlamaServerError, match="tools/server"):
        extract_llama_cpp(bare, tmp_path / "src2")


def test_the_sdist_downloads_on_a_machine_without_its_build_backend(tmp_path, monkeypatch):
    """pip reads an sdist's metadata to download it; with ``--no-build-isolation`` it needs
    llama-cpp-python's build backend (scikit-build-core) installed, which a fresh machine lacks
    (``adaspec fetch llama-server`` failed there with "No module named 'scikit_build_core'")."""
    calls = []

    def fake_pip(cmd, **kwargs):  # pip on a machine without scikit-build-core
        calls.append(cmd)
        if "--no-build-isolation" in cmd:
            return SimpleNamespace(returncode=1, stdout="", stderr="ModuleNotFoundError: No module named 'scikit_build_core'")
        dest = Path(cmd[cmd.index("--dest") + 1])
        (dest / "llama_cpp_python-9.9.9.tar.gz").write_bytes(b"archive")
        return SimpleNamespace(returncode=0, stdout="", stderr="")

    monkeypatch.setattr(ls.subprocess, "run", fake_pip)
    got = ls.download_sdist("9.9.9", tmp_path / "sdist")
    assert got.name == "llama_cpp_python-9.9.9.tar.gz" and "--no-binary" in calls[0]
    assert ls.download_sdist("9.9.9", tmp_path / "sdist") == got and len(calls) == 1  # reused, not downloaded again
    monkeypatch.setattr(ls.subprocess, "run", lambda cmd, **kw: SimpleNamespace(returncode=1, stdout="", stderr="no index"))
    with pytest.raises(LlamaServerError, match="(?s)could not download.*no index.*--sdist FILE"):
        ls.download_sdist("9.9.8", tmp_path / "other")


def test_build_says_what_is_missing(cache, tmp_path):
    archive = _sdist(tmp_path / "llama_cpp_python-9.9.9.tar.gz", {"vendor/llama.cpp/tools/server/x": b""})
    with pytest.raises(LlamaServerError, match="needs cmake, a C compiler, a C\\+\\+ compiler.*apt-get install"):
        build_llama_server(archive)


def _fake_toolchain(folder: Path, fail: bool = False) -> None:
    """cmake, cc and c++ stand-ins: configure makes the build folder; --build prints progress lines
    and writes build/bin/llama-server (or fails)."""
    _script(folder / "cc", "exit 0")
    _script(folder / "c++", "exit 0")
    build = '/bin/mkdir -p "$2/bin"; echo "[ 50%] Building CXX object server.cpp.o"; '
    build += ('echo "error: server.cpp:1: boom"; exit 2' if fail else
              'printf "#!/bin/sh\\necho version: 7 fake\\n" > "$2/bin/llama-server"; /bin/chmod +x "$2/bin/llama-server"; '
              'echo "[100%] Built target llama-server"')
    _script(folder / "cmake", f'if [ "$1" = "--build" ]; then {build}; else '
            'while [ "$1" != "-B" ]; do shift; done; /bin/mkdir -p "$2"; echo "-- Configuring done"; fi')


def test_build_from_an_sdist_with_progress(cache, tmp_path):
    _fake_toolchain(Path(os.environ["PATH"]))
    archive = _sdist(tmp_path / "llama_cpp_python-9.9.9.tar.gz", {"vendor/llama.cpp/tools/server/x.cpp": b""})
    seen = []
    path = build_llama_server(archive, jobs=3, progress=lambda *a: seen.append(a))
    assert path == ls.build_root("9.9.9") / ls.BINARY and path.is_file()
    assert ls.cached_llama_server("9.9.9") == path
    assert [s[0] for s in seen] == ["configure", "configure", "build", "build", "build"]
    assert seen[2][1:3] == (50, 100) and seen[-1][1:3] == (100, 100)
    meta = json.loads((ls.build_root("9.9.9") / "build.json").read_text())
    assert meta["llama_cpp_python"] == "9.9.9" and "-DLLAMA_BUILD_SERVER=ON" in meta["cmake_options"]
    assert "-DCMAKE_CXX_FLAGS=-fno-dse" not in meta["cmake_options"]  # the fake c++ is not GCC
    log = (ls.build_root("9.9.9") / "build.log").read_text()
    assert "--target llama-server -j 3" in log and "-DBUILD_SHARED_LIBS=OFF" in log
    assert ls.server_version(path) == "version: 7 fake"
    assert not (ls.build_root("9.9.9") / "src").exists() and not (ls.build_root("9.9.9") / "build").exists()
    assert build_llama_server(archive, progress=lambda *a: pytest.fail("rebuilt")) == path  # built once


def test_a_failed_build_shows_the_end_of_its_log(cache, tmp_path):
    _fake_toolchain(Path(os.environ["PATH"]), fail=True)
    archive = _sdist(tmp_path / "llama_cpp_python-9.9.9.tar.gz", {"vendor/llama.cpp/tools/server/x.cpp": b""})
    with pytest.raises(LlamaServerError, match=r"failed \(exit 2\)(.|\n)*boom"):
        build_llama_server(archive)
    assert ls.cached_llama_server("9.9.9") is None


def test_fetch_llama_server_command(cache, tmp_path):
    from typer.testing import CliRunner

    from adaspec.cli import app

    _fake_toolchain(Path(os.environ["PATH"]))
    archive = _sdist(tmp_path / "llama_cpp_python-9.9.9.tar.gz", {"vendor/llama.cpp/tools/server/x.cpp": b""})
    res = CliRunner().invoke(app, ["fetch", "llama-server", "--sdist", str(archive)])
    assert res.exit_code == 0, res.output
    assert str(ls.build_root("9.9.9") / ls.BINARY) in res.output and "version: 7 fake" in res.output
    res = CliRunner().invoke(app, ["fetch", "llama-server", "smollm2"])
    assert res.exit_code == 2 and "on its own" in res.output


# -- the launcher ------------------------------------------------------------------------------
def test_launcher_passes_its_options_and_waits_for_health(stub, model_file, tmp_path, monkeypatch):
    monkeypatch.setenv("STUB_LOAD_S", "0.6")  # /health answers 503 while "loading"
    opts = ServerOptions(model=model_file, threads=3, flash_attn=False, ctx_per_slot=1000, parallel=4,
                         extra=("--spec-default",), binary=stub)
    with LlamaServer(opts) as server:
        assert server.running and server.slot_ctx == 1000
        argv = _argv(tmp_path)
        assert argv[argv.index("-m") + 1] == str(model_file)
        assert argv[argv.index("--host") + 1] == "127.0.0.1"
        assert argv[argv.index("--port") + 1] == str(server.port)
        assert [argv[argv.index(k) + 1] for k in ("-np", "-c", "-t", "-tb", "-fa")] == ["4", "4000", "3", "3", "off"]
        assert argv[-1] == "--spec-default"  # a user's options come last and win
        assert server.get("/health") == {"status": "ok"}
        proc = server._proc
    assert not server.running and proc.poll() is not None  # stopped on exit


def test_launcher_stops_the_server_on_ctrl_c(stub, model_file):
    opts = ServerOptions(model=model_file, threads=1, flash_attn=None, ctx_per_slot=64, binary=stub)
    with pytest.raises(KeyboardInterrupt):
        with LlamaServer(opts) as server:
            proc = server._proc
            raise KeyboardInterrupt
    assert proc.poll() is not None


def test_launcher_errors_name_the_cause(stub, model_file, monkeypatch):
    opts = ServerOptions(model=model_file, threads=1, flash_attn=True, ctx_per_slot=64, binary=stub)
    monkeypatch.setenv("STUB_MODE", "exit")
    with pytest.raises(LlamaServerError, match=r"exited \(code 3\)(.|\n)*failed to load model"):
        LlamaServer(opts).start()
    monkeypatch.setenv("STUB_MODE", "unhealthy")
    server = LlamaServer(opts, startup_timeout=1.0)
    with pytest.raises(LlamaServerError, match="did not answer /health within 1 s"):
        server.start()
    assert not server.running
    monkeypatch.setenv("STUB_MODE", "ok")
    monkeypatch.setenv("STUB_SLOT_CTX", "32")
    with pytest.raises(LlamaServerError, match="gave each slot 32 tokens.*needs 64"):
        LlamaServer(opts).start()
    with pytest.raises(ConfigError, match="set by adaspec"):
        ServerOptions(model=model_file, threads=1, flash_attn=None, ctx_per_slot=64, extra=("--port", "1"))
    with pytest.raises(ConfigError, match="does not exist"):
        ServerOptions(model=model_file.with_name("gone.gguf"), threads=1, flash_attn=None, ctx_per_slot=64)


def test_a_refused_request_carries_the_servers_message(stub, model_file, monkeypatch):
    monkeypatch.setenv("STUB_MODE", "fail")
    opts = ServerOptions(model=model_file, threads=1, flash_attn=False, ctx_per_slot=64, binary=stub)
    with LlamaServer(opts) as server:
        with pytest.raises(LlamaServerError, match="HTTP 400: the request exceeds the available context size"):
            server.post("/completion", {"prompt": [1], "n_predict": 1})


# -- the peer specs ----------------------------------------------------------------------------
def test_peer_specs_parse_into_server_options(tmp_path):
    assert parse_llama_server_peer("llama-server").server_args() == []
    spec = parse_llama_server_peer("llama-server:spec=ngram-mod+ngram-map-k+ngram-simple")
    assert spec.server_args() == ["--spec-type", "ngram-mod,ngram-map-k,ngram-simple"]
    assert parse_llama_server_peer("llama-server:spec=default").server_args() == ["--spec-default"]
    assert parse_llama_server_peer("llama-server:spec=ngram-mod+ngram-simple,n_max=16").server_args() == [
        "--spec-type", "ngram-mod,ngram-simple", "--spec-ngram-mod-n-max", "16", "--spec-ngram-mod-n-min", "16",
        "--spec-ngram-simple-size-m", "16"]
    draft = tmp_path / "draft.gguf"
    draft.write_bytes(b"GGUF")
    assert parse_llama_server_peer(f"llama-server:draft={draft},n_max=5").server_args() == [
        "--spec-type", "draft-simple", "-md", str(draft), "--spec-draft-n-max", "5"]
    spec = parse_llama_server_peer("llama-server:bin=/opt/ls,flash_attn=1,repack=0")
    assert spec.binary == Path("/opt/ls") and spec.flash_attn is True and spec.repack is False
    for bad, msg in [("llama-server:spec=ngram-nope", "unknown speculator"),
                     ("llama-server:spec=draft-simple", "needs a draft model"),
                     ("llama-server:n_max=4", "add spec=TYPES"),
                     ("llama-server:spec=ngram-mod,n_max=0", "n_max must be >= 1"),
                     ("llama-server:spec=ngram-mod+ngram-mod", "listed twice"),
                     ("llama-server:flash_attn=2", "flash_attn must be 0 or 1"),
                     ("llama-server:repack=yes", "repack must be 0 or 1"),
                     ("llama-server:draft=smollm2.txt", "draft=smollm2.txt"),
                     ("llama-server:k=3", "unknown parameter")]:
        with pytest.raises(ConfigError, match=msg):
            check_peer(bad)
    assert any(n.startswith("llama-server") for n in all_peer_names())


def test_bench_refuses_a_missing_binary_before_loading(cache, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    import adaspec.models
    from adaspec.cli import app

    monkeypatch.setattr(adaspec.models, "load_model", lambda *a, **k: pytest.fail("loaded a model"))
    res = CliRunner().invoke(app, ["bench", "-p", f"llama-server:bin={tmp_path / 'nope'}", "--no-costs"])
    assert res.exit_code == 2 and "does not exist" in res.output
    res = CliRunner().invoke(app, ["bench", "-p", "llama-server", "--no-costs"])
    assert res.exit_code == 2 and "adaspec fetch llama-server" in res.output


def test_completion_request_and_answer():
    body = completion_request([5, 6, 7], 4)
    assert body["prompt"] == [5, 6, 7] and body["n_predict"] == 4 and body["cache_prompt"] is False
    assert body["return_tokens"] is True and body["samplers"] == ["top_k"] and body["top_k"] == 1
    answer = {"tokens": [1, 2, 9, 3], "timings": {"prompt_n": 3, "cache_n": 0, "prompt_ms": 30.0, "predicted_n": 4,
                                                   "predicted_ms": 60.0, "draft_n": 4, "draft_n_accepted": 2}}
    run = parse_completion(answer, 3, 4, {9}, 0.2)
    assert run.token_ids == [1, 2, 9]  # cut at adaspec's EOS, kept
    assert (run.first_s, run.decode_s, run.decode_tokens) == (0.03, 0.06, 3)
    assert (run.rounds, run.drafted, run.prefill_tokens, run.seconds) == (2, 4, 3, 0.2)
    with pytest.raises(LlamaServerError, match="did not take the token ids"):
        parse_completion(answer, 5, 4, set(), 0.2)
    with pytest.raises(PromptError, match="truncated"):
        parse_completion(answer | {"truncated": True}, 3, 4, set(), 0.2)
    with pytest.raises(LlamaServerError, match="no 'timings'"):
        parse_completion({"content": "x"}, 3, 4, set(), 0.2)


# -- the peer ----------------------------------------------------------------------------------
def _target(path: Path, window: int = 256) -> SimpleNamespace:
    return SimpleNamespace(name="stub", path=path, context_window=window, threads=2, flash_attn=False, repack=False)


def test_peer_runs_greedy_requests_on_exact_token_ids(stub, model_file, tmp_path):
    peer = LlamaServerPeer(_target(model_file), f"llama-server:spec=ngram-mod+ngram-map-k,bin={stub}")
    try:
        argv = _argv(tmp_path)
        assert argv[argv.index("--spec-type") + 1] == "ngram-mod,ngram-map-k"
        assert argv[argv.index("-c") + 1] == "256" and argv[argv.index("-np") + 1] == "1"
        assert argv[argv.index("--cache-ram") + 1] == "0" and argv[argv.index("-fa") + 1] == "off"
        assert "--no-repack" in argv  # the target's weight layout
        run = peer.run([3, 4, 5], 6, eos_ids={9})
        assert run.token_ids == [6, 7, 8, 9] and run.error is None  # stub: 6, 7, ... cut at EOS 9
        assert run.first_s == pytest.approx(0.013) and run.decode_tokens == 5 and run.decode_s == pytest.approx(0.010)
        assert run.drafted == 6 and run.rounds == 3  # predicted_n 6 - 3 accepted
        sent = _requests(tmp_path)[-1]
        assert sent["path"] == "/completion" and sent["body"]["prompt"] == [3, 4, 5]
        assert sent["body"]["cache_prompt"] is False and sent["body"]["n_predict"] == 6
        with pytest.raises(PromptError, match="exceeds the llama-server peer's context"):
            peer.run(list(range(250)), 10, set())
        settings = peer.settings()
        assert settings["version"] == "version: 1 (stub)" and "--spec-type" in settings["argv"]
    finally:
        peer.close()
    assert not peer.server.running


def test_peer_failures_are_results(stub, model_file, monkeypatch):
    monkeypatch.setenv("STUB_MODE", "fail")
    peer = LlamaServerPeer(_target(model_file), f"llama-server:bin={stub}")
    try:
        run = peer.run([1, 2], 4, set())
        assert run.token_ids == [] and "HTTP 400" in run.error
    finally:
        peer.close()
    monkeypatch.setenv("STUB_MODE", "die")
    peer = LlamaServerPeer(_target(model_file), f"llama-server:bin={stub}")
    try:
        run = peer.run([1, 2], 4, set())
        assert "no answer from llama-server" in run.error and "exited" in run.error
    finally:
        peer.close()


def _tiny_target():
    return as_loaded(make_tiny_model(seed=0), word_tokenizer([f"w{i:02d}" for i in range(32)]), "tiny")


def _count_starts(monkeypatch) -> list[LlamaServer]:
    started: list[LlamaServer] = []
    real_start = LlamaServer.start
    monkeypatch.setattr(LlamaServer, "start", lambda self: started.append(self) or real_start(self))
    return started


def test_bench_runs_the_peer_beside_ar_and_stops_it(stub, tmp_path, monkeypatch):
    from adaspec.bench import llamacpp_peer
    from adaspec.bench.runner import BenchConfig, run_bench
    from adaspec.bench.workloads import turn_prompt
    from adaspec.bench.workloads import BenchPrompt
    from adaspec.config import GenerationConfig
    from adaspec.engine import SpeculativeEngine

    target = _tiny_target()
    model_file = tmp_path / "tiny.gguf"
    model_file.write_bytes(b"GGUF")
    monkeypatch.setattr(llamacpp_peer, "target_gguf", lambda t: model_file)
    prompts = [BenchPrompt.single("code", "w01 w02 w03", id="p1"), BenchPrompt.single("qa", "w04 w05", id="p2")]
    ar = SpeculativeEngine(target, [])
    answers = {}
    for p in prompts[:1]:  # the stub answers p1 as AR does, and p2 otherwise
        ids = turn_prompt(p, 0, [], ar)
        answers[",".join(map(str, ids))] = ar.generate(ids, GenerationConfig(max_new_tokens=6)).token_ids
    (tmp_path / "answers.json").write_text(json.dumps(answers))
    monkeypatch.setenv("STUB_ANSWERS", str(tmp_path / "answers.json"))
    spec = f"llama-server:bin={stub}"
    started = _count_starts(monkeypatch)
    run = run_bench(target, [BenchConfig("AR (no drafter)", []), BenchConfig(spec, peer=spec)], prompts,
                    max_new_tokens=6, repeats=2, warmup_tokens=2, measure_costs=False)
    assert started and not started[0].running  # stopped when the bench ended
    recs = {r.prompt_id: r for r in run.of(spec)}
    assert recs["p1"].identical and not recs["p2"].identical and recs["p2"].first_mismatch is not None
    from adaspec.exactness import NEAR_TIE_NATS_LLAMACPP

    assert recs["p2"].tie_nats == NEAR_TIE_NATS_LLAMACPP  # judged at llama.cpp's bound (Peer.tie_nats)
    assert recs["p1"].decode_tokens == 5 and recs["p1"].decode_s == pytest.approx(0.010)
    summary = run.summary()
    rows = {r["config"]: r for r in summary["overall"]}
    assert rows[spec]["decode_tokens_per_s"] == pytest.approx(500.0)  # the stub's 2 ms a token
    assert rows["AR (no drafter)"]["decode_tokens_per_s"] > 0 and rows["AR (no drafter)"]["prefill_s_per_prompt"] > 0
    assert summary["peers"][spec]["version"] == "version: 1 (stub)"
    assert len(_requests(tmp_path)) == 1 + 2 * 2  # warm-up, then two passes over two prompts


def test_a_speculating_server_starts_every_pass_afresh(stub, tmp_path, monkeypatch):
    """llama-server's n-gram pools outlive requests: a speculating peer is started again before
    each pass (and warmed on the chat header), so a pass cannot draft a prompt from its answer in
    the pass before; a plain server is started once."""
    from adaspec.bench import llamacpp_peer
    from adaspec.bench.runner import BenchConfig, run_bench
    from adaspec.bench.workloads import BenchPrompt

    target = _tiny_target()
    model_file = tmp_path / "tiny.gguf"
    model_file.write_bytes(b"GGUF")
    monkeypatch.setattr(llamacpp_peer, "target_gguf", lambda t: model_file)
    prompts = [BenchPrompt.single("code", "w01 w02 w03", id="p1")]
    plain, spec = f"llama-server:bin={stub}", f"llama-server:bin={stub},spec=ngram-mod"
    for name, starts in ((plain, 1), (spec, 1 + 3)):
        started = _count_starts(monkeypatch)
        run_bench(target, [BenchConfig("AR (no drafter)", []), BenchConfig(name, peer=name)], prompts,
                  max_new_tokens=4, repeats=3, warmup_tokens=2, measure_costs=False)
        assert len(started) == starts and not any(s.running for s in started), name


def test_bench_stops_started_servers_when_a_later_config_fails(stub, model_file, monkeypatch):
    from adaspec.bench import llamacpp_peer
    from adaspec.bench.runner import BenchConfig, run_bench
    from adaspec.bench.workloads import BenchPrompt
    from adaspec.errors import AdaspecError

    monkeypatch.setattr(llamacpp_peer, "target_gguf", lambda t: model_file)
    started = _count_starts(monkeypatch)
    spec = f"llama-server:bin={stub}"
    with pytest.raises(AdaspecError, match="no-such-drafter"):
        run_bench(_tiny_target(),
                  [BenchConfig(spec, peer=spec), BenchConfig("bad", ["no-such-drafter"])],
                  [BenchPrompt.single("qa", "w01 w02")], max_new_tokens=2, measure_costs=False)
    assert started and not started[0].running


# -- bench-serve --llama-server ----------------------------------------------------------------
def _bench_serve(*args: str):
    from typer.testing import CliRunner

    from adaspec.cli import app

    return CliRunner().invoke(app, ["bench-serve", *args])


def test_bench_serve_starts_llama_server_with_a_slot_per_client(stub, tmp_path):
    out = tmp_path / "serve.json"
    res = _bench_serve("--llama-server", "--spec-default", "--llama-server-bin", str(stub), "--model",
                       str(_gguf(tmp_path)), "-c", "1", "-c", "3", "--requests", "3", "--max-tokens", "4",
                       "--suite", "qa", "--threads", "2", "--json", str(out))
    assert res.exit_code == 0, res.output
    argv = _argv(tmp_path)
    assert [argv[argv.index(k) + 1] for k in ("-np", "-c", "-t")] == ["3", str(3 * 4096), "2"]
    assert argv[-1] == "--spec-default"
    assert "| llama-server --spec-default | 3 | 3 |" in res.output
    data = json.loads(out.read_text())
    assert [lv["concurrency"] for lv in data["levels"]] == [1, 3] and data["model"] == "stub-model"
    assert all(lv["tokens"] > 0 and not lv["failures"] for lv in data["levels"])
    paths = [r["path"] for r in _requests(tmp_path)]
    assert "/apply-template" in paths and "/tokenize" in paths  # the slots were sized to the workload


def _gguf(tmp_path: Path) -> Path:
    path = tmp_path / "served.gguf"
    path.write_bytes(b"GGUF")
    return path


def test_bench_serve_refuses_a_context_too_small_for_the_workload(stub, tmp_path):
    res = _bench_serve("--llama-server", "-c 8", "--llama-server-bin", str(stub), "--model", str(_gguf(tmp_path)),
                       "-c", "2", "--requests", "2", "--max-tokens", "16", "--suite", "qa")
    assert res.exit_code == 2
    assert "needs" in res.output and "pass -c" in res.output and "Traceback" not in res.output


def test_bench_serve_reports_failed_requests_as_lines(stub, tmp_path, monkeypatch):
    monkeypatch.setenv("STUB_MODE", "fail")
    res = _bench_serve("--llama-server", "", "--llama-server-bin", str(stub), "--model", str(_gguf(tmp_path)),
                       "-c", "1", "--requests", "2", "--suite", "qa")
    assert res.exit_code == 2 and "warm-up request to http://127.0.0.1:" in res.output
    assert "failed: HTTP 400: the request exceeds the available context size" in res.output
    monkeypatch.setenv("STUB_MODE", "flaky")  # the warm-up passes, then every second request fails
    res = _bench_serve("--llama-server", "", "--llama-server-bin", str(stub), "--model", str(_gguf(tmp_path)),
                       "-c", "1", "--requests", "4", "--suite", "qa")
    assert res.exit_code == 1 and "Traceback" not in res.output
    assert "FAILED llama-server: request 1 (prompt qa-01) at concurrency 1 failed: HTTP 400: the request" in res.output
    assert "request 3 (prompt qa-01)" in res.output and "| llama-server | 1 | 2 |" in res.output


def test_bench_serve_compares_servers_over_passes(stub, tmp_path):
    res = _bench_serve("--llama-server", "", "--llama-server", "--spec-default", "--llama-server-bin", str(stub),
                       "--model", str(_gguf(tmp_path)), "-c", "1", "-c", "2", "--requests", "2", "--max-tokens", "4",
                       "--suite", "qa+math", "--repeats", "2", "--out", str(tmp_path / "out"))
    assert res.exit_code == 0, res.output
    assert "| llama-server | 2 | 4 |" in res.output and "| llama-server --spec-default | 1 | 4 |" in res.output
    assert "steadiness: each pass's tokens/s over the median of its server and level, 8 runs" in res.output
    assert "llama-server: texts equal to its own at c=1: c=1 4/4, c=2 4/4" in res.output
    assert "llama-server --spec-default against llama-server, lowest concurrency: 2/2 prompts' texts equal" in res.output
    data = json.loads((tmp_path / "out" / "serve.json").read_text())
    assert [s["label"] for s in data["servers"]] == ["llama-server", "llama-server --spec-default"]
    texts = [t["text"] for t in data["servers"][0]["levels"][0]["timings"]]
    assert len(texts) == 4 and all(texts)  # every request's text kept
    assert len(data["servers"][1]["pass_tokens_per_s"][0]) == 2
    assert (tmp_path / "out" / "serve.png").stat().st_size > 0
    assert "![serve](serve.png)" in (tmp_path / "out" / "report.md").read_text()


def test_bench_serve_names_an_unreachable_server():
    port = ls.free_port()
    res = _bench_serve("--url", f"http://127.0.0.1:{port}/v1", "-c", "1", "--requests", "1", "--suite", "qa")
    assert res.exit_code == 2 and f"no usable OpenAI server at http://127.0.0.1:{port}/v1" in res.output
    assert "Traceback" not in res.output


def test_level_failures_name_the_request(stub, model_file, monkeypatch):
    import asyncio

    from adaspec.bench.serve_load import run_level
    from adaspec.bench.workloads import BenchPrompt

    monkeypatch.setenv("STUB_MODE", "fail")
    opts = ServerOptions(model=model_file, threads=1, flash_attn=False, ctx_per_slot=64, parallel=2, binary=stub)
    with LlamaServer(opts) as server:
        level = asyncio.run(run_level(server.base_url, "stub-model", [BenchPrompt.single("qa", "a b", id="q7")],
                                      2, 3, 4))
    assert level.requests == 0 and [f.request for f in level.failures] == [1, 2, 3]
    assert level.failures[0].line() == ("request 1 (prompt q7) at concurrency 2 failed: HTTP 400: the request "
                                        "exceeds the available context size, try increasing it")


# -- a real build ------------------------------------------------------------------------------
@pytest.mark.slow
def test_real_llama_server_peer_matches_adaspec_ar_on_smollm2():
    """The cached build (``adaspec fetch llama-server``) on SmolLM2's GGUF, beside the llama.cpp
    backend's AR: the same prompt ids, its timings parsed, the server stopped afterwards."""
    binary = ls.cached_llama_server()
    if binary is None and not os.environ.get(ls.LLAMA_SERVER_ENV):
        pytest.skip("no llama-server built for this llama-cpp-python: run `adaspec fetch llama-server`")
    from adaspec.bench.runner import BenchConfig, run_bench
    from adaspec.bench.workloads import load_workload
    from adaspec.models import load_model

    target = load_model("smollm2", backend="llama.cpp")
    specs = ["llama-server", "llama-server:spec=ngram-mod+ngram-map-k+ngram-simple"]
    run = run_bench(target, [BenchConfig("AR (no drafter)", []), *(BenchConfig(s, peer=s) for s in specs)],
                    load_workload("code-editing", per_category=2), max_new_tokens=32, measure_costs=False)
    for s in specs:
        res = run.result(s)
        assert not res.failed, res.failed
        assert res.identical + len(res.near_ties) == res.prompts, res.mismatches
        assert res.decode_tokens_per_s and res.decode_tokens_per_s > 0 and res.prefill_s_per_prompt > 0
        assert run.summary()["peers"][s]["version"].startswith("version")
    proc = subprocess.run(["pgrep", "-f", f"{binary} -m"], capture_output=True, text=True)
    assert proc.stdout.strip() == "", "a llama-server outlived the bench"
