"""llama.cpp's own ``llama-server``: found or built once, launched on 127.0.0.1, stopped.

A CPU user who wants speed runs ``llama-server`` (continuous batching, its own n-gram and
draft-model speculators, prompt caching), so ``adaspec bench`` (the ``llama-server`` peers,
``bench.llama_server_peer``) and ``adaspec bench-serve --llama-server`` measure it. Both go
through this module:

* ``find_llama_server``: the binary a user gave (a path, or ``$ADASPEC_LLAMA_SERVER``), else
  ``llama-server`` on ``PATH``, else the one ``build_llama_server`` put in the adaspec cache for
  the installed llama-cpp-python version;
* ``build_llama_server`` (``adaspec fetch llama-server``): compiles ``tools/server`` of the
  llama.cpp tree that ships in the sdist of the installed llama-cpp-python (``vendor/llama.cpp``),
  the same sources as the library adaspec's llama.cpp backend runs, with cmake and a C++
  compiler, once, into ``cache_dir() / "llama-server" / "llama-cpp-python-VERSION"``. The
  sdist is downloaded with pip (``--no-binary :all:``: a source archive, read as data; nothing
  is installed). Static libraries, no web UI, no network features: one self-contained binary;
  with GCC, dead-store elimination off (``GCC_OPTIONS``: GCC 12.2 miscompiles ggml's AMX kernels);
* ``LlamaServer``: a context manager that starts the binary on a free port of 127.0.0.1 with
  a model file, thread count, flash attention setting, slot count and a context per slot,
  waits for ``/health``, checks the context per slot it got (``/props``), and stops it on exit,
  an error or Ctrl-C (on Linux the server also dies with the adaspec process:
  ``PR_SET_PDEATHSIG``). Its errors are ``LlamaServerError`` with the server's own message.
"""

from __future__ import annotations

import atexit
import importlib.metadata
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..artifacts import cache_dir
from ..errors import AdaspecError, ConfigError

#: an explicit llama-server binary for every command (a path)
LLAMA_SERVER_ENV = "ADASPEC_LLAMA_SERVER"
BINARY = "llama-server.exe" if os.name == "nt" else "llama-server"
#: cmake options of ``build_llama_server``: a static, self-contained server, no UI, no network
BUILD_OPTIONS = ("-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                 "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_SERVER=ON",
                 "-DLLAMA_OPENSSL=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_BUILD_UI=OFF")
#: with GCC: dead-store elimination off. GCC 12.2 drops the stores of ggml's AMX tile shapes as
#: dead (its ``_tile_loadconfig`` declares an 8-byte read of the 64-byte configuration), and the
#: server dies at the first batched forward on a CPU with AMX (docs/llamacpp.md, "CPUs with AMX")
GCC_OPTIONS = ("-DCMAKE_C_FLAGS=-fno-dse", "-DCMAKE_CXX_FLAGS=-fno-dse")
#: progress(stage, done, total, detail): stage "download", "configure" or "build" (percent)
BuildProgress = Callable[[str, int, int, str], None]
_HOST = "127.0.0.1"
#: requests to the loopback server never go through a proxy of the environment (``$http_proxy``)
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class LlamaServerError(AdaspecError):
    """llama-server could not be found, built or started, or it refused a request."""


# -- finding and building ----------------------------------------------------------------------
def installed_llama_cpp_version() -> str | None:
    """The installed llama-cpp-python's version (whose sdist holds the llama.cpp tree), or None."""
    try:
        return importlib.metadata.version("llama-cpp-python")
    except importlib.metadata.PackageNotFoundError:
        return None


def build_root(version: str) -> Path:
    """Where the server built from llama-cpp-python ``version``'s sdist lives."""
    return cache_dir() / "llama-server" / f"llama-cpp-python-{version}"


def cached_llama_server(version: str | None = None) -> Path | None:
    """The built binary for ``version`` (default: the installed llama-cpp-python's), if there."""
    version = version or installed_llama_cpp_version()
    if version is None:
        return None
    path = build_root(version) / BINARY
    return path if path.is_file() and os.access(path, os.X_OK) else None


def _executable(path: Path, where: str) -> Path:
    path = path.expanduser()
    if path.is_dir():
        path = path / BINARY
    if not path.is_file():
        raise LlamaServerError(f"{where}: {path} does not exist: give the path of a llama-server binary")
    if not os.access(path, os.X_OK):
        raise LlamaServerError(f"{where}: {path} is not executable: chmod +x it, or give another binary")
    return path.resolve()


def find_llama_server(path: str | Path | None = None) -> Path:
    """The llama-server binary to run: ``path`` if given, else ``$ADASPEC_LLAMA_SERVER``, else
    ``llama-server`` on ``PATH``, else the one built into the adaspec cache for the installed
    llama-cpp-python (``build_llama_server``). Raises ``LlamaServerError`` naming the fix."""
    if path is not None and str(path):
        return _executable(Path(path), "the llama-server binary given")
    env = os.environ.get(LLAMA_SERVER_ENV)
    if env:
        return _executable(Path(env), f"${LLAMA_SERVER_ENV}")
    on_path = shutil.which(BINARY)
    if on_path:
        return Path(on_path).resolve()
    cached = cached_llama_server()
    if cached is not None:
        return cached
    version = installed_llama_cpp_version()
    where = (f"none is built for llama-cpp-python {version} in {build_root(version)}" if version
             else "llama-cpp-python is not installed, so there is no sdist to build one from")
    raise LlamaServerError(
        f"llama-server not found: not on PATH, ${LLAMA_SERVER_ENV} unset, and {where}. Fix: run "
        "`adaspec fetch llama-server` (builds it once from the llama-cpp-python sdist; needs cmake and a "
        f"C++ compiler), or put llama-server on PATH, or set ${LLAMA_SERVER_ENV}=/path/to/llama-server")


def build_tools() -> tuple[str, str, str]:
    """(cmake, C compiler, C++ compiler) on PATH; raises naming what is missing and how to install it."""
    cmake = shutil.which("cmake")
    cc = next((shutil.which(c) for c in (os.environ.get("CC", ""), "cc", "gcc", "clang") if c and shutil.which(c)),
              None)
    cxx = next((shutil.which(c) for c in (os.environ.get("CXX", ""), "c++", "g++", "clang++")
                if c and shutil.which(c)), None)
    missing = [name for name, found in (("cmake", cmake), ("a C compiler", cc), ("a C++ compiler", cxx))
               if not found]
    if missing:
        raise LlamaServerError(
            f"building llama-server needs {', '.join(missing)}, not found on PATH. Fix: install them "
            "(Debian/Ubuntu: `apt-get install cmake build-essential`; macOS: `xcode-select --install` and "
            "`brew install cmake`; or `pip install cmake`), or put a llama-server binary on PATH")
    return cmake, cc, cxx  # type: ignore[return-value]


def is_gcc(compiler: str) -> bool:
    """Whether ``compiler`` is GCC (clang says so in its ``--version``; GCC names its foundation)."""
    try:
        out = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "Free Software Foundation" in out and "clang" not in out.lower()


def download_sdist(version: str, dest: Path, pip_args: Sequence[str] = ()) -> Path:
    """``pip download`` the llama-cpp-python ``version`` source archive into ``dest`` (reused if there)."""
    dest.mkdir(parents=True, exist_ok=True)
    found = _find_sdist(dest, version)
    if found is not None:
        return found
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
           "--disable-pip-version-check", "--quiet", "--dest", str(dest), *pip_args,
           f"llama-cpp-python=={version}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    found = _find_sdist(dest, version)
    if found is None:
        detail = (proc.stderr or proc.stdout).strip()[-800:]
        raise LlamaServerError(
            f"could not download the llama-cpp-python {version} sdist with pip: {detail or 'no archive'}\n"
            "Fix: check that this machine reaches PyPI, or download it elsewhere and pass "
            "`adaspec fetch llama-server --sdist FILE`")
    return found


def _find_sdist(folder: Path, version: str) -> Path | None:
    for name in (f"llama_cpp_python-{version}.tar.gz", f"llama-cpp-python-{version}.tar.gz"):
        if (folder / name).is_file():
            return folder / name
    return None


def sdist_version(path: Path) -> str:
    """The version in an sdist's file name (``llama_cpp_python-0.3.36.tar.gz`` -> ``0.3.36``)."""
    m = re.fullmatch(r"llama[_-]cpp[_-]python-(.+)\.tar\.gz", path.name)
    if not m:
        raise LlamaServerError(f"{path.name} is not a llama-cpp-python source archive "
                               "(llama_cpp_python-VERSION.tar.gz)")
    return m.group(1)


def extract_llama_cpp(sdist: Path, dest: Path) -> Path:
    """Extract the sdist's ``vendor/llama.cpp`` tree into ``dest`` (replaced); only regular files
    and folders inside it are written (no links, no paths out of ``dest``)."""
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    root = dest.resolve()
    wrote = 0
    try:
        with tarfile.open(sdist, "r:gz") as tar:
            for member in tar:
                parts = Path(member.name).parts
                if len(parts) < 4 or parts[1:3] != ("vendor", "llama.cpp"):
                    continue
                out = (root / Path(*parts[3:])).resolve()
                if root not in out.parents:
                    continue
                if member.isdir():
                    out.mkdir(parents=True, exist_ok=True)
                elif member.isfile():
                    out.parent.mkdir(parents=True, exist_ok=True)
                    src = tar.extractfile(member)
                    assert src is not None
                    with src, out.open("wb") as fh:
                        shutil.copyfileobj(src, fh)
                    if member.mode & 0o111:
                        out.chmod(0o755)
                    wrote += 1
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise LlamaServerError(f"{sdist} is not a readable source archive ({exc}): delete it and fetch again") from exc
    if not (root / "tools" / "server").is_dir():
        raise LlamaServerError(f"{sdist} has no vendor/llama.cpp/tools/server ({wrote} files of llama.cpp): "
                               "this llama-cpp-python version does not ship llama-server's sources")
    return root


def _run_logged(cmd: list[str], log: Path, cwd: Path, on_line: Callable[[str], None] | None = None) -> None:
    with log.open("a", encoding="utf-8") as fh:
        fh.write("$ " + " ".join(cmd) + "\n")
        fh.flush()
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                errors="replace")
        assert proc.stdout is not None
        try:
            for line in proc.stdout:
                fh.write(line)
                if on_line is not None:
                    on_line(line)
            code = proc.wait()
        except BaseException:
            proc.kill()
            proc.wait()
            raise
    if code != 0:
        tail = "".join(log.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True)[-25:])
        raise LlamaServerError(f"`{' '.join(cmd[:3])} ...` failed (exit {code}); the last lines of {log}:\n{tail}")


def build_llama_server(sdist: str | Path | None = None, jobs: int | None = None,
                       progress: BuildProgress | None = None, force: bool = False,
                       pip_args: Sequence[str] = ()) -> Path:
    """Build ``llama-server`` once from a llama-cpp-python sdist and return the binary's path.

    ``sdist``: the archive to build from (default: downloaded with pip for the installed
    llama-cpp-python version). The binary is kept under ``build_root(VERSION)`` with
    ``build.json`` (the version, the cmake options) and ``build.log`` (the sources and the build
    folder are deleted after); an existing one is reused unless ``force``. ``jobs``: parallel compile jobs (default: every core)."""
    if sdist is not None:
        archive = Path(sdist).expanduser()
        if not archive.is_file():
            raise LlamaServerError(f"--sdist {archive}: no such file")
        version = sdist_version(archive)
    else:
        installed = installed_llama_cpp_version()
        if installed is None:
            raise LlamaServerError("llama-cpp-python is not installed, so adaspec does not know which llama.cpp "
                                   "to build: pip install llama-cpp-python, or pass --sdist FILE")
        version, archive = installed, None
    root = build_root(version)
    final = root / BINARY
    if final.is_file() and not force:
        return final
    cmake, cc, cxx = build_tools()
    root.mkdir(parents=True, exist_ok=True)
    if archive is None:
        if progress:
            progress("download", 0, 1, f"llama-cpp-python {version} sdist")
        archive = download_sdist(version, root / "sdist", pip_args)
        if progress:
            progress("download", 1, 1, archive.name)
    src = extract_llama_cpp(archive, root / "src")
    build = root / "build"
    log = root / "build.log"
    log.write_text(f"llama-server from {archive} (llama-cpp-python {version})\n", encoding="utf-8")
    if progress:
        progress("configure", 0, 1, "cmake")
    options = [*BUILD_OPTIONS, *(GCC_OPTIONS if is_gcc(cxx) else ())]
    _run_logged([cmake, "-S", str(src), "-B", str(build), f"-DCMAKE_C_COMPILER={cc}",
                 f"-DCMAKE_CXX_COMPILER={cxx}", *options], log, root)
    if progress:
        progress("configure", 1, 1, "cmake")

    def on_line(line: str) -> None:
        m = re.match(r"\[\s*(\d+)%\]", line)
        if m and progress:
            progress("build", int(m.group(1)), 100, line[m.end():].strip()[:60])

    n = jobs or os.cpu_count() or 1
    _run_logged([cmake, "--build", str(build), "--config", "Release", "--target", "llama-server", "-j", str(n)],
                log, root, on_line)
    built = next((p for p in (build / "bin" / BINARY, build / "bin" / "Release" / BINARY) if p.is_file()), None)
    if built is None:
        raise LlamaServerError(f"the build finished but left no {BINARY} under {build / 'bin'}: see {log}")
    tmp = root / f".{BINARY}.part"
    shutil.copy2(built, tmp)
    os.replace(tmp, final)
    (root / "build.json").write_text(json.dumps({"llama_cpp_python": version, "sdist": archive.name,
                                                 "cmake_options": options}, indent=1), encoding="utf-8")
    for tree in (src, build):  # the sources and objects: ~200 MB; the binary is self-contained
        shutil.rmtree(tree, ignore_errors=True)
    if progress:
        progress("build", 100, 100, str(final))
    return final


def server_version(binary: Path) -> str:
    """``llama-server --version``'s version line (e.g. ``version: 1 (abc123)``), or '' if it has none."""
    try:
        proc = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    lines = [ln.strip() for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip().startswith("version")]
    return lines[0] if lines else ""


# -- launching ---------------------------------------------------------------------------------
def free_port() -> int:
    """A TCP port of 127.0.0.1 free now (the OS's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((_HOST, 0))
        return int(s.getsockname()[1])


#: options ``LlamaServer`` sets itself: a user's ``extra`` options may not repeat them
OWN_OPTIONS = ("-m", "--model", "--host", "--port", "-np", "--parallel")


@dataclass(frozen=True)
class ServerOptions:
    """How to run llama-server: its model file, threads, flash attention, slots and context."""

    model: Path
    threads: int
    #: llama.cpp's flash attention: True ``-fa on``, False ``-fa off``, None ``-fa auto``
    flash_attn: bool | None
    #: tokens every slot must hold (prompt + new tokens of the longest request)
    ctx_per_slot: int
    parallel: int = 1
    #: llama.cpp's weight repacking (extra buffer types: AMX, the CPU's interleaved layouts):
    #: True/None its default (on), False ``--no-repack``
    repack: bool | None = None
    #: more llama-server options (speculators, ``-md``, ...), as on its command line
    extra: tuple[str, ...] = ()
    binary: Path | None = None  # None: ``find_llama_server()``

    def __post_init__(self) -> None:
        if self.threads < 1 or self.parallel < 1 or self.ctx_per_slot < 1:
            raise ConfigError(f"llama-server needs threads, parallel and ctx_per_slot >= 1, got {self.threads}, "
                              f"{self.parallel}, {self.ctx_per_slot}")
        if not Path(self.model).is_file():
            raise ConfigError(f"llama-server's model {self.model} does not exist")
        own = sorted({a.split("=", 1)[0] for a in self.extra} & set(OWN_OPTIONS))
        if own:
            raise ConfigError(f"llama-server options {own} are set by adaspec (model, host, port, slots): "
                              "leave them out of the extra options")

    def argv(self, binary: Path, port: int) -> list[str]:
        """The command line: the extra options come last, so a user's ``-c``, ``-t`` or ``-fa`` wins."""
        fa = {True: "on", False: "off", None: "auto"}[self.flash_attn]
        return [str(binary), "-m", str(self.model), "--host", _HOST, "--port", str(port),
                "-np", str(self.parallel), "-c", str(self.ctx_per_slot * self.parallel),
                "-t", str(self.threads), "-tb", str(self.threads), "-fa", fa,
                *(["--no-repack"] if self.repack is False else []), *self.extra]


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """Linux: the server gets SIGTERM when the adaspec process dies, however it dies. The kernel
    ties it to the thread that started the server: start one from a thread that outlives it."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


_RUNNING: set[LlamaServer] = set()


@atexit.register
def _stop_all() -> None:
    for server in list(_RUNNING):
        server.stop()


@dataclass
class LlamaServer:
    """A llama-server process on 127.0.0.1 (a context manager; see the module docstring).

    ``start`` raises ``LlamaServerError`` with the end of the server's log when it exits or
    does not answer ``/health`` within ``startup_timeout`` seconds; ``slot_ctx`` is the context
    per slot the server reports (``/props``), at least ``options.ctx_per_slot``."""

    options: ServerOptions
    startup_timeout: float = 300.0
    binary: Path = field(init=False)
    port: int = field(init=False, default=0)
    slot_ctx: int = field(init=False, default=0)
    props: dict[str, Any] = field(init=False, default_factory=dict)
    _proc: subprocess.Popen | None = field(init=False, default=None, repr=False)
    _log: Any = field(init=False, default=None, repr=False)

    def __post_init__(self) -> None:
        self.binary = self.options.binary or find_llama_server()

    def __hash__(self) -> int:
        return id(self)

    @property
    def url(self) -> str:
        return f"http://{_HOST}:{self.port}"

    @property
    def base_url(self) -> str:
        """The OpenAI-compatible API's base URL."""
        return self.url + "/v1"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def _exits(self, within: float) -> bool:
        """Whether the process has exited or does within ``within`` seconds (a dropped connection
        comes before the exit is seen)."""
        if self._proc is None:
            return True
        try:
            self._proc.wait(timeout=within)
        except subprocess.TimeoutExpired:
            return False
        return True

    def log_tail(self, lines: int = 15) -> str:
        if self._log is None:
            return ""
        self._log.flush()
        self._log.seek(0)
        text = self._log.read().decode("utf-8", errors="replace")
        return "".join(text.splitlines(keepends=True)[-lines:])

    def start(self) -> LlamaServer:
        if self.running:
            return self
        for attempt in range(3):  # a port taken between free_port() and the server's bind: another one
            self.port = free_port()
            argv = self.options.argv(self.binary, self.port)
            self.close()
            self._log = tempfile.TemporaryFile()
            try:
                self._proc = subprocess.Popen(
                    argv, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
                    preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None)
            except OSError as exc:
                raise LlamaServerError(f"could not run {self.binary}: {exc}") from exc
            _RUNNING.add(self)
            try:
                self._wait_healthy()
                break
            except LlamaServerError as exc:
                tail = self.log_tail(40)
                self.stop()
                if attempt < 2 and "bind" in tail.lower():
                    continue
                raise exc
            except BaseException:
                self.stop()
                raise
        try:
            self.props = self.get("/props")
            self.slot_ctx = int(self.props.get("default_generation_settings", {}).get("n_ctx", 0))
        except BaseException:
            self.stop()
            raise
        if self.slot_ctx and self.slot_ctx < self.options.ctx_per_slot:
            self.stop()
            raise LlamaServerError(
                f"llama-server gave each slot {self.slot_ctx} tokens of context, and the workload needs "
                f"{self.options.ctx_per_slot}: pass a larger -c (it is shared by {self.options.parallel} slots)")
        return self

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        delay = 0.05
        while True:
            assert self._proc is not None
            code = self._proc.poll()
            if code is not None:
                raise LlamaServerError(f"llama-server exited (code {code}) before it was ready; its log ends:\n"
                                       f"{self.log_tail()}")
            try:
                with _OPENER.open(self.url + "/health", timeout=5) as resp:
                    if resp.status == 200:
                        return
            except urllib.error.HTTPError as exc:  # 503 while the model loads
                if exc.code != 503:
                    raise LlamaServerError(f"llama-server's /health answered HTTP {exc.code}") from None
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            if time.monotonic() > deadline:
                raise LlamaServerError(f"llama-server did not answer /health within {self.startup_timeout:.0f} s; "
                                       f"its log ends:\n{self.log_tail()}")
            time.sleep(delay)
            delay = min(0.5, delay * 1.5)

    def stop(self) -> None:
        """Terminate the server (SIGTERM, then SIGKILL after 10 s); idempotent. Its log stays
        readable (``log_tail``) until ``close``."""
        proc, self._proc = self._proc, None
        _RUNNING.discard(self)
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def close(self) -> None:
        self.stop()
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> LlamaServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- requests ---------------------------------------------------------------------------
    def get(self, path: str, timeout: float = 30.0) -> dict[str, Any]:
        return self._request(urllib.request.Request(self.url + path), timeout)

    def post(self, path: str, body: dict[str, Any], timeout: float = 3600.0) -> dict[str, Any]:
        """POST ``body`` as JSON; the JSON answer, or ``LlamaServerError`` with the server's message."""
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode("utf-8"),
                                     headers={"Content-Type": "application/json"}, method="POST")
        return self._request(req, timeout)

    def _request(self, req: urllib.request.Request, timeout: float) -> dict[str, Any]:
        try:
            with _OPENER.open(req, timeout=timeout) as resp:
                return json.loads(resp.read().decode("utf-8"))
        except urllib.error.HTTPError as exc:
            raise LlamaServerError(f"llama-server answered {req.full_url} with HTTP {exc.code}: "
                                   f"{error_message(exc.read())}") from None
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as exc:
            dead = "" if not self._exits(within=2.0) else f" (the server has exited; its log ends:\n{self.log_tail()})"
            raise LlamaServerError(f"no answer from llama-server at {req.full_url}: {exc}{dead}") from None
        except json.JSONDecodeError as exc:
            raise LlamaServerError(f"llama-server's answer to {req.full_url} is not JSON: {exc}") from None


def error_message(body: bytes | str) -> str:
    """The message of a llama-server (or OpenAI-style) error body: ``{"error": {"message": ...}}``."""
    text = body.decode("utf-8", errors="replace") if isinstance(body, bytes) else body
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return text.strip()[:500] or "(empty body)"
    err = data.get("error", data) if isinstance(data, dict) else data
    if isinstance(err, dict):
        return str(err.get("message") or err)[:500]
    return str(err)[:500]
