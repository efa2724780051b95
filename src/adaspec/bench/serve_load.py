"""``adaspec bench-serve``: drive a running OpenAI-compatible server with the official
``openai`` client over a prompt workload, at several concurrency levels, and report time to
first token, inter-chunk latency, time per output token (p50 / p95) and total tokens/s.

A streamed chunk carries one round's accepted tokens, so with speculative decoding the time
between chunks is per round; time per output token is ``(last - first) / (tokens - 1)`` of
each request. Works against any OpenAI-compatible server (vLLM, llama-server, ...).

``--llama-server ARGS`` starts llama.cpp's server itself (``bench.llama_server``) on the model's
GGUF file with ``--parallel N``, N the largest concurrency, and measures it the same way: its
slots are sized to the workload (the longest prompt under the server's own chat template, from
its ``/apply-template`` and ``/tokenize``, plus ``--max-tokens``), and a user's ``-c`` too small
for that is refused before any request. A request that fails (a refused connection, an HTTP
error, a stream cut short) is reported as one line naming the request and what the server said,
and the command exits with code 1; it never stops on a traceback.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from statistics import mean, quantiles
from typing import Any

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
    """Percentiles and throughput of one concurrency level (over the requests that completed)."""

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
    failures: list[RequestFailure] = field(default_factory=list)

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


@dataclass
class RequestFailure:
    """A request of a level that did not complete: which one and what the server said."""

    level: int  # the concurrency
    request: int  # 1-based within the level
    prompt_id: str
    message: str

    def line(self) -> str:
        return (f"request {self.request} (prompt {self.prompt_id}) at concurrency {self.level} failed: "
                f"{self.message}")


def failure_message(exc: BaseException) -> str:
    """What a failed request's error says, in one line: the HTTP status and the server's message,
    or the connection problem."""
    import openai

    if isinstance(exc, openai.APIStatusError):
        body = exc.body if isinstance(exc.body, dict) else {}
        msg = body.get("message") or (body.get("error") or {}).get("message") if body else None
        return f"HTTP {exc.status_code}: {msg or exc.message}"
    if isinstance(exc, openai.APIConnectionError):
        cause = exc.__cause__ or exc.__context__
        return f"{exc.message} ({type(cause).__name__}: {cause})" if cause else exc.message
    return f"{type(exc).__name__}: {exc}"


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
    failures: list[RequestFailure] = []

    async def worker() -> None:
        for i in todo:
            prompt = prompts[i % len(prompts)]
            try:
                timings.append(await _one(client, model, prompt, max_tokens))
            except (openai.APIError, OSError) as exc:  # reported per request, never a traceback
                failures.append(RequestFailure(concurrency, i + 1, prompt.id, failure_message(exc)))

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
                       mean(mats) if mats else None, sorted(failures, key=lambda f: f.request))


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


#: tokens of context per llama-server slot before the workload is measured (then enlarged to fit)
SLOT_CTX = 4096


def _ctx_given(args: Sequence[str]) -> bool:
    return any(a in ("-c", "--ctx-size") or a.startswith("--ctx-size=") for a in args)


def prompt_tokens(server: Any, prompt: BenchPrompt) -> int:
    """Tokens of ``prompt``'s first turn under the running llama-server's own chat template."""
    text = server.post("/apply-template", {"messages": prompt.messages()})["prompt"]
    return len(server.post("/tokenize", {"content": text, "add_special": True, "parse_special": True})["tokens"])


def start_llama_server(model: Path, args: Sequence[str], parallel: int, prompts: Sequence[BenchPrompt],
                       max_tokens: int, threads: int, binary: Path | None = None,
                       log: Any = None) -> Any:
    """A started ``LlamaServer`` with ``parallel`` slots, each holding the workload's longest
    prompt (the server's chat template) plus ``max_tokens``; enlarged once when the first guess
    (``SLOT_CTX``) is too small; a user's ``-c`` that is too small is an error naming the fix."""
    from .llama_server import LlamaServer, ServerOptions

    user_ctx = _ctx_given(args)
    slot = 1 if user_ctx else SLOT_CTX
    for _ in range(2):
        server = LlamaServer(ServerOptions(model=model, threads=threads, flash_attn=False, ctx_per_slot=slot,
                                           parallel=parallel, extra=tuple(args), binary=binary)).start()
        try:
            longest, need = max(((p, prompt_tokens(server, p)) for p in prompts), key=lambda x: x[1])
        except BaseException:
            server.close()
            raise
        need += max_tokens
        if need <= server.slot_ctx:
            return server
        server.close()
        if user_ctx:
            raise ConfigError(f"prompt {longest.id} needs {need} tokens (with --max-tokens {max_tokens}) and "
                              f"llama-server's slots hold {server.slot_ctx} (its -c shared by {parallel} slots): "
                              f"pass -c {need * parallel} or more, or lower --max-tokens")
        slot = -(-need // 256) * 256
        if log:
            log(f"llama-server: slots of {server.slot_ctx} tokens are too small for prompt {longest.id} "
                f"({need} tokens): restarting with {slot} per slot")
    raise ConfigError("llama-server's slots stayed too small for the workload")  # not reached


def _measure(url: str, model: str | None, prompts: Sequence[BenchPrompt], concurrency: Sequence[int],
             requests: int, max_tokens: int) -> tuple[str, list[LevelResult]]:
    """The warm-up and every level against one server; (model id, results). Raises ``ConfigError``
    when the server cannot be reached or the warm-up fails."""
    import openai

    if model is None:
        try:
            model = openai.OpenAI(base_url=url, api_key="unused", max_retries=0).models.list().data[0].id
        except (openai.APIError, OSError, IndexError) as exc:
            msg = "it lists no model" if isinstance(exc, IndexError) else failure_message(exc)
            raise ConfigError(f"no usable OpenAI server at {url}: {msg}. Start one (adaspec serve, llama-server), "
                              "pass its --url, or let bench-serve start llama-server (--llama-server)") from None
    warm = asyncio.run(run_level(url, model, prompts[:1], 1, 1, 8))
    if warm.failures:
        raise ConfigError(f"the warm-up request failed: {warm.failures[0].message}")
    results = []
    for c in concurrency:
        results.append(asyncio.run(run_level(url, model, prompts, c, max(requests, c), max_tokens)))
        failed = f", {len(results[-1].failures)} failed" if results[-1].failures else ""
        typer.echo(f"concurrency {c}: {results[-1].tokens_per_s:.1f} tokens/s{failed}", err=True)
    return model, results


def bench_serve_command(
    url: str = typer.Option("http://127.0.0.1:8000/v1", help="the server's OpenAI base URL"),
    model: str | None = typer.Option(None, help="model id (default: the server's first model); with "
                                     "--llama-server the model to serve: smollm2, a fetched name or a .gguf "
                                     "file [default: smollm2]"),
    concurrency: list[int] = typer.Option([1, 4, 16], "--concurrency", "-c", help="client count, repeatable"),
    suite: str = typer.Option("mixed", help="prompt workload (a suite, humaneval, .jsonl or .txt)"),
    per_category: int | None = typer.Option(None, help="prompts per category (0 = all) [default: 1 for the "
                                            "built-in suites; every prompt of a file or of humaneval]"),
    requests: int = typer.Option(16, help="requests per concurrency level (cycling over the prompts)"),
    max_tokens: int = typer.Option(64, help="max_tokens of every request (greedy)"),
    label: str | None = typer.Option(None, help="name of this server in the table [default: server; "
                                     "'llama-server ARGS' for a started one]"),
    json_out: str | None = typer.Option(None, "--json", help="also write the results as JSON here"),
    llama_server: str | None = typer.Option(
        None, "--llama-server", help="start llama.cpp's llama-server and measure it instead of --url: ARGS are "
        "its extra options as one quoted string ('' for none), e.g. --llama-server '--spec-default'; it runs "
        "with --parallel = the largest -c, slots sized to the workload, -t --threads, -fa off unless ARGS say"),
    llama_server_bin: Path | None = typer.Option(None, help="the llama-server binary [default: $ADASPEC_LLAMA_"
                                                 "SERVER, PATH, or the one `adaspec fetch llama-server` built]"),
    threads: int | None = typer.Option(None, help="--llama-server: its -t [default: torch's thread count, as "
                                       "adaspec's llama.cpp backend]"),
) -> None:
    """Measure a server's latency and throughput at several concurrency levels: a running one
    (--url), or llama-server started for the run (--llama-server)."""
    import shlex

    try:
        import openai  # noqa: F401
    except ImportError:
        raise typer.BadParameter("bench-serve needs the openai client: pip install openai") from None
    server = None
    try:
        if any(c < 1 for c in concurrency) or requests < 1 or max_tokens < 1:
            raise ConfigError("--concurrency, --requests and --max-tokens must be >= 1")
        if not url.startswith(("http://", "https://")):
            raise ConfigError(f"--url {url!r}: give the server's OpenAI base URL, e.g. http://127.0.0.1:8000/v1")
        if json_out and not Path(json_out).expanduser().parent.is_dir():
            raise ConfigError(f"--json {json_out}: the folder {Path(json_out).parent} does not exist")
        if threads is not None and threads < 1:
            raise ConfigError(f"--threads must be >= 1, got {threads}")
        if llama_server is None and (llama_server_bin is not None or threads is not None):
            raise ConfigError("--llama-server-bin and --threads start llama-server: add --llama-server ARGS")
        if per_category is None:  # a built-in suite: one prompt a category; a user's file: all
            per_category = 1 if default_per_category(suite) is not None else 0
        if per_category < 0:
            raise ConfigError(f"--per-category must be >= 0 (0 = every prompt), got {per_category}")
        prompts = load_workload(suite, per_category or None)
        each = f"{per_category} per category" if per_category else "all"
        typer.echo(f"workload {suite}: {len(prompts)} prompts ({each}), cycled over {requests} requests a level",
                   err=True)
        if llama_server is not None:
            from ..models import locate_model
            from .llama_server import find_llama_server

            try:
                args = shlex.split(llama_server)
            except ValueError as exc:
                raise ConfigError(f"--llama-server {llama_server!r}: {exc}") from None
            gguf = locate_model(model or "smollm2")
            if gguf is None:
                raise ConfigError(f"--model {model}: llama-server serves a GGUF file: give smollm2, a fetched "
                                  "model's name or a .gguf path")
            binary = find_llama_server(llama_server_bin)
            if threads is None:
                import torch

                threads = torch.get_num_threads()
            typer.echo(f"starting {binary} on {gguf.name} with {max(concurrency)} slots ...", err=True)
            server = start_llama_server(gguf, args, max(concurrency), prompts, max_tokens, threads, binary,
                                        log=lambda m: typer.echo(m, err=True))
            typer.echo(f"llama-server ready at {server.url}: {server.slot_ctx} tokens per slot", err=True)
            url, model = server.base_url, None
            label = label or " ".join(["llama-server", *args])
        model, results = _measure(url, model, prompts, concurrency, requests, max_tokens)
    except AdaspecError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    finally:
        if server is not None:
            server.close()
    label = label or "server"
    typer.echo(markdown(label, results))
    failures = [f for r in results for f in r.failures]
    for f in failures:
        typer.echo(f"FAILED {f.line()}", err=True)
    if json_out:
        with open(json_out, "w", encoding="utf-8") as f:
            json.dump({"label": label, "url": url, "model": model, "suite": suite, "max_tokens": max_tokens,
                       "levels": [{**asdict(r), "tokens_per_s": r.tokens_per_s} for r in results]}, f, indent=2)
    if failures:
        raise typer.Exit(1)
