"""Bounded load on loopback against ``adaspec serve`` run as a subprocess (default -d/-s/-l):
64 concurrent streaming openai clients, every response complete and equal to its greedy text,
no 5xx, resident memory flat over 1,000+ requests, and SIGTERM during load (exit 0, no
completed response lost, the state file readable)."""

from __future__ import annotations

import asyncio
import json
import signal
from dataclasses import dataclass

import httpx
import openai
import psutil
import pytest

from serving import free_port, save_tiny_chat_model, start_cli_server, wait_until_up

from adaspec.config import GenerationConfig
from adaspec.engine import SpeculativeEngine
from adaspec.models import load_model

# (user message, max_tokens): repetitive and random prompts, short answers
PROMPTS = [(" ".join(f"w{(i * 7 + j) % 32:02d}" for j in range(4)) * 2, 6 + i % 4 * 2) for i in range(8)]


@dataclass
class Outcome:
    index: int
    text: str
    finish_reason: str | None  # None: the stream ended without finishing (cut at shutdown)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_chat_model(tmp_path_factory.mktemp("tiny-load"))


@pytest.fixture(scope="module")
def expected(model_dir):
    engine = SpeculativeEngine(load_model(model_dir), [])
    return [engine.generate([{"role": "user", "content": p}], GenerationConfig(max_new_tokens=n)).text
            for p, n in PROMPTS]


async def _stream(client: openai.AsyncOpenAI, index: int) -> Outcome:
    prompt, n = PROMPTS[index]
    pieces, finish = [], None
    stream = await client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": prompt}], max_tokens=n, temperature=0,
        stream=True)
    async for chunk in stream:
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    return Outcome(index, "".join(pieces), finish)


async def _load(base: str, clients: int, requests: int, stop_after: int | None = None,
                on_progress=None) -> tuple[list[Outcome], list[BaseException]]:
    """``clients`` concurrent streaming clients sharing ``requests`` requests; a client stops at
    its first error (e.g. the server shutting down)."""
    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=120)
    todo = iter(range(requests))
    done: list[Outcome] = []
    errors: list[BaseException] = []

    async def worker() -> None:
        for i in todo:
            try:
                done.append(await _stream(client, i % len(PROMPTS)))
            except (openai.APIError, httpx.HTTPError, OSError) as exc:
                errors.append(exc)
                return
            if on_progress is not None:
                on_progress(len(done))

    await asyncio.gather(*(worker() for _ in range(clients)))
    await client.close()
    return done, errors


def test_64_streaming_clients_get_exact_answers_with_flat_memory(model_dir, expected, tmp_path):
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = start_cli_server(model_dir, port, tmp_path / "state.json", cache=tmp_path / "cache")
    try:
        wait_until_up(proc, base)
        done, errors = asyncio.run(_load(base, clients=64, requests=384))
        assert not errors and len(done) == 384
        for o in done:
            assert o.finish_reason == "length" and o.text == expected[o.index], o
        rss_warm = psutil.Process(proc.pid).memory_info().rss
        done, errors = asyncio.run(_load(base, clients=64, requests=640))
        assert not errors and len(done) == 640 and all(o.text == expected[o.index] for o in done)
        growth = psutil.Process(proc.pid).memory_info().rss - rss_warm
        assert growth < 64 * 2**20, f"resident memory grew by {growth / 2**20:.0f} MiB over 640 requests"
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0


def test_sigterm_during_load_loses_no_completed_response(model_dir, expected, tmp_path):
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    state = tmp_path / "state.json"
    proc = start_cli_server(model_dir, port, state, "-s", "ucbspec:scope=global", "-l", "static",
                            "--save-every", "1000")
    sent = []

    def progress(n: int) -> None:
        if n >= 24 and not sent:
            sent.append(n)
            proc.send_signal(signal.SIGTERM)

    try:
        wait_until_up(proc, base)
        done, errors = asyncio.run(_load(base, clients=16, requests=100_000, on_progress=progress))
        assert proc.wait(120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert sent and len(done) >= 24 and errors  # the load was cut by the shutdown
    for o in done:  # every response that arrived is whole and exact, or a clean prefix
        if o.finish_reason is not None:
            assert o.text == expected[o.index], o
        else:
            assert expected[o.index].startswith(o.text), o
    completed = sum(o.finish_reason is not None for o in done)
    saved = json.loads(state.read_text())
    assert saved["totals"]["requests"] >= completed >= 24
    assert not any(isinstance(e, openai.InternalServerError) for e in errors)
