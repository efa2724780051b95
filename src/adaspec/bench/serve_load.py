"""``adaspec bench-serve``: drive a running OpenAI-compatible server with the official
``openai`` client over a prompt workload, at several concurrency levels, and report time to
first token, inter-chunk latency, time per output token (p50 / p95) and total tokens/s.

A streamed chunk carries one round's accepted tokens, so with speculative decoding the time
between chunks is per round; time per output token is ``(last - first) / (tokens - 1)`` of
each request. Works against any OpenAI-compatible server (vLLM, llama-server, ...).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from statistics import mean, quantiles

import typer

from ..errors import AdaspecError, ConfigError
from .workloads import BenchPrompt, default_per_category, load_workload


@dataclass
class RequestTiming:
    """One streamed request, as the client saw it."""

    ttft_s: float
    chunk_gaps_s: list[float]
    tokens: int
    total_s: float
    mat: float | None  # from the adaspec statistics, when the server is adaspec

    @property
    def tpot_s(self) -> float | None:
        return (self.total_s - self.ttft_s) / (self.tokens - 1) if self.tokens > 1 else None


@dataclass
class LevelResult:
    """Percentiles and throughput of one concurrency level."""

    concurrency: int
    requests: int
    tokens: int
    wall_s: float
    ttft_p50: float
    ttft_p95: float
    itl_p50: float
    itl_p95: float
    tpot_p50: float
    tpot_p95: float
    mat: float | None

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0


def percentile(values: Sequence[float], q: int) -> float:
    """The q-th percentile (inclusive method); NaN for no values."""
    if not values:
        return float("nan")
    if len(values) == 1:
        return float(values[0])
    return quantiles(values, n=100, method="inclusive")[q - 1]


async def _one(client, model: str, prompt: BenchPrompt, max_tokens: int) -> RequestTiming:
    t0 = time.perf_counter()
    first, last, gaps, tokens, mat = None, None, [], 0, None
    stream = await client.chat.completions.create(
        model=model, messages=prompt.messages(), max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True})
    async for chunk in stream:
        now = time.perf_counter()
        if chunk.choices and chunk.choices[0].delta.content:
            if first is None:
                first = now
            else:
                gaps.append(now - last)
            last = now
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        extra = (chunk.model_extra or {}).get("adaspec")
        if extra:
            mat = extra.get("mat")
    end = time.perf_counter()
    first = end if first is None else first
    return RequestTiming(first - t0, gaps, tokens, (last or end) - t0, mat)


async def run_level(base_url: str, model: str, prompts: Sequence[BenchPrompt], concurrency: int,
                    requests: int, max_tokens: int, api_key: str = "unused") -> LevelResult:
    """``requests`` requests (cycling over ``prompts``) from ``concurrency`` concurrent clients."""
    import openai

    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=3600)
    todo = iter(range(requests))
    timings: list[RequestTiming] = []

    async def worker() -> None:
        for i in todo:
            timings.append(await _one(client, model, prompts[i % len(prompts)], max_tokens))

    t0 = time.perf_counter()
    try:
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    finally:
        await client.close()
    wall = time.perf_counter() - t0
    ttft = [t.ttft_s for t in timings]
    gaps = [g for t in timings for g in t.chunk_gaps_s]
    tpot = [t.tpot_s for t in timings if t.tpot_s is not None]
    mats = [t.mat for t in timings if t.mat is not None]
    return LevelResult(concurrency, len(timings), sum(t.tokens for t in timings), wall,
                       percentile(ttft, 50), percentile(ttft, 95), percentile(gaps, 50),
                       percentile(gaps, 95), percentile(tpot, 50), percentile(tpot, 95),
                       mean(mats) if mats else None)


def markdown(label: str, results: Sequence[LevelResult]) -> str:
    """One table row per concurrency level (milliseconds for latencies)."""
    rows = ["| server | concurrency | requests | tokens/s | TTFT p50 / p95 (ms) | inter-chunk p50 / p95 (ms) "
            "| per token p50 / p95 (ms) | MAT |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        rows.append(f"| {label} | {r.concurrency} | {r.requests} | {r.tokens_per_s:.1f} | "
                    f"{r.ttft_p50 * 1e3:.0f} / {r.ttft_p95 * 1e3:.0f} | {r.itl_p50 * 1e3:.0f} / "
                    f"{r.itl_p95 * 1e3:.0f} | {r.tpot_p50 * 1e3:.0f} / {r.tpot_p95 * 1e3:.0f} | "
                    f"{'-' if r.mat is None else format(r.mat, '.2f')} |")
    return "\n".join(rows)


def bench_serve_command(
    url: str = typer.Option("http://127.0.0.1:8000/v1", help="the server's OpenAI base URL"),
    model: str | None = typer.Option(None, help="model id (default: the server's first model)"),
    concurrency: list[int] = typer.Option([1, 4, 16], "--concurrency", "-c", help="client count, repeatable"),
    suite: str = typer.Option("mixed", help="prompt workload (a suite, humaneval, .jsonl or .txt)"),
    per_category: int | None = typer.Option(None, help="prompts per category (0 = all) [default: 1 for the "
                                            "built-in suites; every prompt of a file or of humaneval]"),
    requests: int = typer.Option(16, help="requests per concurrency level (cycling over the prompts)"),
    max_tokens: int = typer.Option(64, help="max_tokens of every request (greedy)"),
    label: str = typer.Option("server", help="name of this server in the table"),
    json_out: str | None = typer.Option(None, "--json", help="also write the results as JSON here"),
) -> None:
    """Measure a running server's latency and throughput at several concurrency levels."""
    try:
        import openai
    except ImportError:
        raise typer.BadParameter("bench-serve needs the openai client: pip install openai") from None
    try:
        if any(c < 1 for c in concurrency) or requests < 1 or max_tokens < 1:
            raise ConfigError("--concurrency, --requests and --max-tokens must be >= 1")
        if not url.startswith(("http://", "https://")):
            raise ConfigError(f"--url {url!r}: give the server's OpenAI base URL, e.g. http://127.0.0.1:8000/v1")
        if json_out and not Path(json_out).expanduser().parent.is_dir():
            raise ConfigError(f"--json {json_out}: the folder {Path(json_out).parent} does not exist")
        if per_category is None:  # a built-in suite: one prompt a category; a user's file: all
            per_category = 1 if default_per_category(suite) is not None else 0
        if per_category < 0:
            raise ConfigError(f"--per-category must be >= 0 (0 = every prompt), got {per_category}")
        prompts = load_workload(suite, per_category or None)
    except AdaspecError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    each = f"{per_category} per category" if per_category else "all"
    typer.echo(f"workload {suite}: {len(prompts)} prompts ({each}), cycled over {requests} requests a level", err=True)
    if model is None:
        model = openai.OpenAI(base_url=url, api_key="unused").models.list().data[0].id
    asyncio.run(run_level(url, model, prompts[:1], 1, 1, 8))  # warm-up
    results = []
    for c in concurrency:
        results.append(asyncio.run(run_level(url, model, prompts, c, max(requests, c), max_tokens)))
        typer.echo(f"concurrency {c}: {results[-1].tokens_per_s:.1f} tokens/s", err=True)
    typer.echo(markdown(label, results))
    if json_out:
        with open(json_out, "w", encoding="utf-8") as f:
            json.dump({"label": label, "url": url, "model": model, "suite": suite, "max_tokens": max_tokens,
                       "levels": [{**asdict(r), "tokens_per_s": r.tokens_per_s} for r in results]}, f, indent=2)
