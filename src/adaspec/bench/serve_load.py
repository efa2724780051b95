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

Several servers in one run (``--url`` and ``--llama-server`` are repeatable; every launched
server is started first and stopped at the end): ``--repeats R`` passes, each running every
server through every level in turn, so a slow minute of the machine hits all of them; a level's
tokens/s is its median over passes and its latency percentiles pool every pass's requests (after
an unmeasured warm-up burst at the highest concurrency, ``warm_up``), and
a steadiness line gives the spread of the passes' tokens/s around their medians. Every request's
text is kept (``--json`` / ``--out``), and the greedy texts are compared per server against its
own texts at the lowest concurrency (batching must not change a greedy answer), and between
servers at that level against the first server's. ``--out DIR`` writes ``serve.json``,
``report.md`` and ``serve.png`` (tokens/s and time to the first content token against
concurrency, one line per server).
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
    prompt_id: str = ""
    request: int = 0  # 1-based within its level
    text: str = ""  # the streamed content (greedy: comparable between servers and levels)

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
    timings: list[RequestTiming] = field(default_factory=list)  # every completed request, by number

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0

    def texts(self) -> dict[str, str]:
        """prompt id -> the text of its first completed request in this level."""
        out: dict[str, str] = {}
        for t in self.timings:
            out.setdefault(t.prompt_id, t.text)
        return out


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
    first, last, gaps, tokens, mat, pieces = None, None, [], 0, None, []
    stream = await client.chat.completions.create(
        model=model, messages=prompt.messages(), max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True})
    async for chunk in stream:
        now = time.perf_counter()
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
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
    return RequestTiming(first - t0, gaps, tokens, (last or end) - t0, mat, prompt.id, text="".join(pieces))


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
                timing = await _one(client, model, prompt, max_tokens)
                timing.request = i + 1
                timings.append(timing)
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
                       mean(mats) if mats else None, sorted(failures, key=lambda f: f.request),
                       sorted(timings, key=lambda t: t.request))


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


def server_model(url: str) -> str:
    """The first model a running OpenAI server lists; ``ConfigError`` when it cannot be reached."""
    import openai

    try:
        return openai.OpenAI(base_url=url, api_key="unused", max_retries=0).models.list().data[0].id
    except (openai.APIError, OSError, IndexError) as exc:
        msg = "it lists no model" if isinstance(exc, IndexError) else failure_message(exc)
        raise ConfigError(f"no usable OpenAI server at {url}: {msg}. Start one (adaspec serve, llama-server), "
                          "pass its --url, or let bench-serve start llama-server (--llama-server)") from None


def warm_up(url: str, model: str, prompts: Sequence[BenchPrompt], concurrency: int = 1) -> None:
    """One short request (``ConfigError`` with the server's message when it fails), then, where
    ``concurrency`` > 1, one unmeasured burst of that many short requests over ``prompts``: a
    server's first batch that wide pays one-time costs (buffers made, code run the first time)
    that are not its steady speed. Without it the first measured pass's 16-client burst got its
    first tokens after 350 ms on adaspec (173-195 ms in the later passes) and 2.0-2.1 s on
    llama-server (133-178 ms later; SmolLM2, EPYC Zen 4). A failed request of the burst is
    reported, not fatal: the measured levels report their own."""
    warm = asyncio.run(run_level(url, model, prompts[:1], 1, 1, 8))
    if warm.failures:
        raise ConfigError(f"the warm-up request to {url} failed: {warm.failures[0].message}")
    if concurrency > 1:
        burst = asyncio.run(run_level(url, model, prompts, concurrency, concurrency, 8))
        if burst.failures:
            typer.echo(f"warm-up burst at {url}: {len(burst.failures)} of {concurrency} requests failed (not "
                       f"measured): {burst.failures[0].message}", err=True)


@dataclass
class ServerRuns:
    """One server's levels in every pass: ``passes[p][i]`` is pass ``p`` at ``concurrency[i]``."""

    label: str
    url: str
    model: str
    concurrency: list[int]
    passes: list[list[LevelResult]] = field(default_factory=list)

    def level(self, i: int) -> LevelResult:
        """Level ``i`` over every pass: the median pass's tokens and time (the lower middle one
        for an even count), so ``tokens_per_s`` is the median over passes; latency percentiles
        and MAT over every pass's requests; the completed requests and failures of all passes."""
        runs = [p[i] for p in self.passes]
        mid = sorted(runs, key=lambda r: r.tokens_per_s)[(len(runs) - 1) // 2]
        timings = [t for r in runs for t in r.timings]
        ttft = [t.ttft_s for t in timings]
        gaps = [g for t in timings for g in t.chunk_gaps_s]
        tpot = [t.tpot_s for t in timings if t.tpot_s is not None]
        mats = [t.mat for t in timings if t.mat is not None]
        return LevelResult(self.concurrency[i], len(timings), mid.tokens, mid.wall_s,
                           percentile(ttft, 50), percentile(ttft, 95), percentile(gaps, 50), percentile(gaps, 95),
                           percentile(tpot, 50), percentile(tpot, 95), mean(mats) if mats else None,
                           [f for r in runs for f in r.failures], timings)

    @property
    def levels(self) -> list[LevelResult]:
        return [self.level(i) for i in range(len(self.concurrency))]

    def pass_rates(self) -> list[list[float]]:
        """Every level's tokens/s in each pass (one list per level)."""
        return [[p[i].tokens_per_s for p in self.passes] for i in range(len(self.concurrency))]


def steadiness_line(servers: Sequence[ServerRuns]) -> str | None:
    """The spread of each pass's tokens/s around the median of its server and level (the
    10th-90th percentile and the extremes), or None with fewer than 2 passes."""
    from .runner import steadiness

    spread = steadiness([rates for srv in servers for rates in srv.pass_rates()])
    if spread is None:
        return None
    return (f"steadiness: each pass's tokens/s over the median of its server and level, {spread['runs']} runs: "
            f"p10-p90 {spread['p10']:.2f}-{spread['p90']:.2f}, min {spread['min']:.2f}, max {spread['max']:.2f} "
            "(throughputs closer than this are not told apart by the run)")


def agreement_lines(servers: Sequence[ServerRuns]) -> list[str]:
    """Greedy texts compared: each server's at every level (every pass) against its own at the
    lowest concurrency (first pass), and each server's at the lowest concurrency against the
    first server's. A difference there means batching or the server changed a greedy answer
    (or two tokens were nearly tied: the texts carry no margins)."""
    lines = []
    refs = []
    for srv in servers:
        low = min(range(len(srv.concurrency)), key=lambda i: srv.concurrency[i])
        ref = srv.passes[0][low].texts()
        refs.append(ref)
        parts = []
        for i, c in enumerate(srv.concurrency):
            done = [t for p in srv.passes for t in p[i].timings if t.prompt_id in ref]
            same = sum(t.text == ref[t.prompt_id] for t in done)
            parts.append(f"c={c} {same}/{len(done)}")
        lines.append(f"{srv.label}: texts equal to its own at c={srv.concurrency[low]}: " + ", ".join(parts))
    for srv, ref in zip(servers[1:], refs[1:]):
        common = [pid for pid in ref if pid in refs[0]]
        same = sum(ref[pid] == refs[0][pid] for pid in common)
        lines.append(f"{srv.label} against {servers[0].label}, lowest concurrency: {same}/{len(common)} prompts' "
                     "texts equal")
    return lines


def markdown_all(servers: Sequence[ServerRuns]) -> str:
    """One table for every server and level (``markdown``'s columns)."""
    tables = [markdown(srv.label, srv.levels).splitlines() for srv in servers]
    return "\n".join(tables[0] + [row for t in tables[1:] for row in t[2:]])


def plot(servers: Sequence[ServerRuns], path: Path) -> Path:
    """Tokens/s and time to the first content token (p50) against concurrency, a line per server."""
    from matplotlib.figure import Figure  # lazy; no pyplot global state

    fig = Figure(figsize=(10, 4), dpi=120, layout="constrained")
    ax_tps, ax_ttft = fig.subplots(1, 2)
    for srv in servers:
        levels = sorted(srv.levels, key=lambda r: r.concurrency)
        xs = [r.concurrency for r in levels]
        ax_tps.plot(xs, [r.tokens_per_s for r in levels], marker="o", label=srv.label)
        ax_ttft.plot(xs, [r.ttft_p50 for r in levels], marker="o", label=srv.label)
    for ax, title in ((ax_tps, "total tokens/s"), (ax_ttft, "time to first content token, p50 (s)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({c for srv in servers for c in srv.concurrency}),
                      labels=[str(c) for c in sorted({c for srv in servers for c in srv.concurrency})])
        ax.set_xlabel("concurrent clients")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    ax_tps.legend(fontsize=8)
    fig.savefig(path, format="png", bbox_inches="tight")
    return path


def _server_json(srv: ServerRuns) -> dict[str, Any]:
    return {"label": srv.label, "url": srv.url, "model": srv.model,
            "levels": [{**asdict(r), "tokens_per_s": r.tokens_per_s} for r in srv.levels],
            "pass_tokens_per_s": srv.pass_rates()}


def _check_options(concurrency: Sequence[int], requests: int, max_tokens: int, repeats: int, urls: Sequence[str],
                   json_out: str | None, out: Path | None, threads: int | None, launched: Sequence[str],
                   llama_server_bin: Path | None) -> None:
    """``bench-serve``'s option checks, before anything is measured (``--out`` is created)."""
    if any(c < 1 for c in concurrency) or requests < 1 or max_tokens < 1 or repeats < 1:
        raise ConfigError("--concurrency, --requests, --max-tokens and --repeats must be >= 1")
    for u in urls:
        if not u.startswith(("http://", "https://")):
            raise ConfigError(f"--url {u!r}: give the server's OpenAI base URL, e.g. http://127.0.0.1:8000/v1")
    if json_out and not Path(json_out).expanduser().parent.is_dir():
        raise ConfigError(f"--json {json_out}: the folder {Path(json_out).parent} does not exist")
    if out:
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"--out {out}: cannot create it ({exc})") from None
    if threads is not None and threads < 1:
        raise ConfigError(f"--threads must be >= 1, got {threads}")
    if not launched and (llama_server_bin is not None or threads is not None):
        raise ConfigError("--llama-server-bin and --threads start llama-server: add --llama-server ARGS")


def _launch_llama_servers(stack: Any, launched: Sequence[str], names: Sequence[str], model: str | None,
                          llama_server_bin: Path | None, threads: int | None, concurrency: Sequence[int],
                          prompts: Sequence[Any], max_tokens: int) -> list[ServerRuns]:
    """One llama-server per ``--llama-server ARGS``, stopped when ``stack`` closes; ``names``: their
    labels (the default: 'llama-server ARGS')."""
    import shlex

    from ..models import locate_model
    from .llama_server import find_llama_server

    gguf = locate_model(model or "smollm2")
    if gguf is None:
        raise ConfigError(f"--model {model}: llama-server serves a GGUF file: give smollm2, a fetched "
                          "model's name or a .gguf path")
    binary = find_llama_server(llama_server_bin)
    if threads is None:
        import torch

        threads = torch.get_num_threads()
    servers = []
    for j, text in enumerate(launched):
        try:
            args = shlex.split(text)
        except ValueError as exc:
            raise ConfigError(f"--llama-server {text!r}: {exc}") from None
        typer.echo(f"starting {binary} {' '.join(args)} on {gguf.name} with {max(concurrency)} slots ...", err=True)
        server = start_llama_server(gguf, args, max(concurrency), prompts, max_tokens, threads, binary,
                                    log=lambda m: typer.echo(m, err=True))
        stack.callback(server.close)
        typer.echo(f"llama-server ready at {server.url}: {server.slot_ctx} tokens per slot", err=True)
        name = names[j] if j < len(names) else " ".join(["llama-server", *args])
        servers.append(ServerRuns(name, server.base_url, server_model(server.base_url), list(concurrency)))
    return servers


def _measure(servers: Sequence[ServerRuns], prompts: Sequence[Any], concurrency: Sequence[int], requests: int,
             max_tokens: int, repeats: int) -> None:
    """Warm every server (``warm_up``: a request, then a burst at the highest concurrency), then
    ``repeats`` passes: every server through every level, in turn."""
    for srv in servers:
        warm_up(srv.url, srv.model, prompts, max(concurrency))
    for rep in range(repeats):
        for srv in servers:
            levels = []
            for c in concurrency:
                levels.append(asyncio.run(run_level(srv.url, srv.model, prompts, c, max(requests, c), max_tokens)))
                failed = f", {len(levels[-1].failures)} failed" if levels[-1].failures else ""
                again = f" (pass {rep + 1}/{repeats})" if repeats > 1 else ""
                typer.echo(f"{srv.label}, concurrency {c}{again}: {levels[-1].tokens_per_s:.1f} tokens/s"
                           f"{failed}", err=True)
            srv.passes.append(levels)


def _report(servers: Sequence[ServerRuns], suite: str, n_prompts: int, max_tokens: int, repeats: int,
            json_out: str | None, out: Path | None) -> list[Any]:
    """Print the tables, the steadiness and agreement lines and every failure; write ``--json``
    and ``--out``; return the failures."""
    table = markdown_all(servers)
    steady = steadiness_line(servers)
    agree = agreement_lines(servers)
    typer.echo(table)
    for line in ([steady] if steady else []) + agree:
        typer.echo(line)
    failures = [f for srv in servers for r in srv.levels for f in r.failures]
    for srv in servers:
        for r in srv.levels:
            for f in r.failures:
                typer.echo(f"FAILED {srv.label}: {f.line()}", err=True)
    doc = {**_server_json(servers[0]), "suite": suite, "max_tokens": max_tokens, "repeats": repeats,
           "servers": [_server_json(srv) for srv in servers], "steadiness": steady, "agreement": agree}
    if json_out:
        Path(json_out).expanduser().write_text(json.dumps(doc, indent=1), encoding="utf-8")
    if out:
        (out / "serve.json").write_text(json.dumps(doc, indent=1), encoding="utf-8")
        plot(servers, out / "serve.png")
        (out / "report.md").write_text(
            f"# bench-serve: {suite}, {n_prompts} prompts, {max_tokens} tokens, {repeats} pass(es)\n\n{table}\n\n"
            + "".join(f"- {line}\n" for line in ([steady] if steady else []) + agree)
            + "".join(f"- FAILED {f.line()}\n" for f in failures) + "\n![serve](serve.png)\n", encoding="utf-8")
        typer.echo(f"written: {out / 'serve.json'}, {out / 'report.md'}, {out / 'serve.png'}", err=True)
    return failures


def bench_serve_command(
    url: list[str] | None = typer.Option(None, help="a running server's OpenAI base URL, repeatable "
                                         "[default: http://127.0.0.1:8000/v1 unless --llama-server is given]"),
    model: str | None = typer.Option(None, help="model id (default: the server's first model); with "
                                     "--llama-server the model to serve: smollm2, a fetched name or a .gguf "
                                     "file [default: smollm2]"),
    concurrency: list[int] = typer.Option([1, 4, 16], "--concurrency", "-c", help="client count, repeatable"),
    suite: str = typer.Option("mixed", help="prompt workload (a suite, humaneval, .jsonl or .txt)"),
    per_category: int | None = typer.Option(None, help="prompts per category (0 = all) [default: 1 for the "
                                            "built-in suites; every prompt of a file or of humaneval]"),
    requests: int = typer.Option(16, help="requests per concurrency level (cycling over the prompts)"),
    max_tokens: int = typer.Option(64, help="max_tokens of every request (greedy)"),
    repeats: int = typer.Option(1, help="passes: every server through every level, in turn; a level's tokens/s "
                                "is its median over passes"),
    label: list[str] | None = typer.Option(None, help="names of the servers in the tables, repeatable, in order: "
                                           "every --url, then every --llama-server [default: server; "
                                           "'llama-server ARGS']"),
    json_out: str | None = typer.Option(None, "--json", help="also write the results as JSON here"),
    out: Path | None = typer.Option(None, "--out", "-o", help="write serve.json, report.md and serve.png here"),
    llama_server: list[str] | None = typer.Option(
        None, "--llama-server", help="start llama.cpp's llama-server and measure it: ARGS are its extra options "
        "as one quoted string ('' for none), e.g. --llama-server '--spec-default'; repeatable (one server each); "
        "it runs with --parallel = the largest -c, slots sized to the workload, -t --threads, -fa off unless "
        "ARGS say"),
    llama_server_bin: Path | None = typer.Option(None, help="the llama-server binary [default: $ADASPEC_LLAMA_"
                                                 "SERVER, PATH, or the one `adaspec fetch llama-server` built]"),
    threads: int | None = typer.Option(None, help="--llama-server: its -t [default: torch's thread count, as "
                                       "adaspec's llama.cpp backend]"),
) -> None:
    """Measure servers' latency and throughput at several concurrency levels: running ones
    (--url), and llama-server started for the run (--llama-server)."""
    from contextlib import ExitStack

    try:
        import openai  # noqa: F401
    except ImportError:
        raise typer.BadParameter("bench-serve needs the openai client: pip install openai") from None
    launched = llama_server or []
    urls = list(url or ([] if launched else ["http://127.0.0.1:8000/v1"]))
    servers: list[ServerRuns] = []
    with ExitStack() as stack:
        try:
            _check_options(concurrency, requests, max_tokens, repeats, urls, json_out, out, threads, launched,
                           llama_server_bin)
            names = list(label or [])
            if len(names) > len(urls) + len(launched):
                raise ConfigError(f"{len(names)} --label for {len(urls) + len(launched)} servers: give one per server")
            if per_category is None:  # a built-in suite: one prompt a category; a user's file: all
                per_category = 1 if default_per_category(suite) is not None else 0
            if per_category < 0:
                raise ConfigError(f"--per-category must be >= 0 (0 = every prompt), got {per_category}")
            prompts = load_workload(suite, per_category or None)
            each = f"{per_category} per category" if per_category else "all"
            typer.echo(f"workload {suite}: {len(prompts)} prompts ({each}), cycled over {requests} requests a "
                       "level", err=True)
            for i, u in enumerate(urls):
                name = names[i] if i < len(names) else ("server" if len(urls) == 1 else f"server {i + 1}")
                servers.append(ServerRuns(name, u, model or server_model(u), list(concurrency)))
            if launched:
                servers += _launch_llama_servers(stack, launched, names[len(urls):], model, llama_server_bin,
                                                 threads, concurrency, prompts, max_tokens)
            _measure(servers, prompts, concurrency, requests, max_tokens, repeats)
        except AdaspecError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2) from None
    failures = _report(servers, suite, len(prompts), max_tokens, repeats, json_out, out)
    if failures:
        raise typer.Exit(1)
