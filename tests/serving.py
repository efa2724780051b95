"""Helpers for the server tests: a tiny chat model on disk, a live server on 127.0.0.1 (in a
thread or as a subprocess), and a bounded wait. Servers only ever listen on loopback."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from conftest import make_tiny_model, word_tokenizer

WORDS = [f"w{i:02d}" for i in range(32)]
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
SRC = str(Path(__file__).resolve().parents[1] / "src")


def save_tiny_chat_model(path: Path, max_positions: int = 512) -> str:
    """A tiny Llama with a word tokenizer and a chat template (the content of each message)."""
    make_tiny_model(seed=0, max_positions=max_positions).save_pretrained(path)
    tok = word_tokenizer(WORDS)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(path)
    return str(path)


def wait_for(check: Callable[[], bool], timeout: float = 60.0, what: str = "condition") -> None:
    """Poll ``check`` until true; fail after ``timeout`` seconds (a bound, not a timing assert)."""
    end = time.monotonic() + timeout
    while not check():
        if time.monotonic() > end:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.02)


@contextmanager
def serve_in_thread(app) -> Iterator[str]:
    """Run ``app`` with uvicorn on a free loopback port in a thread; yields the base URL."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    wait_for(lambda: server.started, 60, "the server to start")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_cli_server(model_dir: str, port: int, state_file: Path, *extra: str,
                     cache: Path | None = None) -> subprocess.Popen:
    """``adaspec serve`` as a subprocess on 127.0.0.1:port (from this checkout's sources)."""
    env = {**os.environ, "PYTHONPATH": SRC}
    if cache is not None:
        env["ADASPEC_CACHE"] = str(cache)
    cmd = [sys.executable, "-c", "import sys; from adaspec.cli import main; sys.argv=['adaspec', "
           "*sys.argv[1:]]; main()", "serve", "--model", model_dir, "--host", "127.0.0.1",
           "--port", str(port), "--threads", "1", "--state-file", str(state_file),
           "--log-level", "warning", "--served-model-name", "tiny", *extra]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_until_up(proc: subprocess.Popen, base: str, timeout: float = 120.0) -> None:
    import httpx

    def up() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}: {proc.stdout.read()}")
        try:
            return httpx.get(f"{base}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    wait_for(up, timeout, "the server subprocess to answer /health")
