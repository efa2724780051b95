"""Serve SmolLM2 with vLLM (CPU) without speculation, with vLLM's ngram and suffix methods and
with the adaspec proposer, on the same prompts, one server at a time, in one run.

Run through tools/vllm_check.sh (it builds the venv this needs). For every method: start
``vllm serve`` on 127.0.0.1, send the prompts concurrently (greedy), read vLLM's spec-decode
counters from /metrics, stop the server. Prints a table: outputs equal to the no-speculation
server, draft acceptance rate, mean accepted length (1 + accepted / drafts, vLLM's
definition), wall time (noisy on a shared machine), and writes everything as JSON.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from adaspec.bench.workloads import load_suite
from adaspec.integrations.batch import BatchProposerConfig
from adaspec.integrations.vllm import export_hf, serve_command

HOST = "127.0.0.1"
COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
            "vllm:spec_decode_num_accepted_tokens")
T0 = time.monotonic()


def say(msg: str) -> None:
    print(f"[{time.monotonic() - T0:6.0f}s] {msg}", flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def methods(args: argparse.Namespace, stats_file: Path) -> dict[str, tuple[BatchProposerConfig | None, list[str]]]:
    """Each method: the adaspec settings (adaspec only) and extra ``vllm serve`` arguments."""
    k = args.k
    cfg = BatchProposerConfig(drafters=tuple(args.drafter), selector=args.selector, length=args.length,
                              k=k, stats_file=str(stats_file), stats_every=1)
    return {
        "none": (None, []),
        "ngram": (None, ["--speculative-config", json.dumps(
            {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1, "prompt_lookup_max": 3})]),
        "suffix": (None, ["--speculative-config", json.dumps({"method": "suffix", "num_speculative_tokens": k})]),
        "adaspec": (cfg, []),
    }


def get(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 (loopback only)
        return r.read().decode()


def post(url: str, body: dict, timeout: float) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:  # noqa: S310 (loopback only)
        return json.loads(r.read().decode())


def counters(base: str) -> dict[str, float]:
    """Sum of each spec-decode counter over its label sets (0 when the server has none)."""
    out = dict.fromkeys(COUNTERS, 0.0)
    for line in get(f"{base}/metrics").splitlines():
        for name in COUNTERS:
            if line.startswith(f"{name}_total"):
                out[name] += float(line.rsplit(" ", 1)[1])
    return out


def serve(method: str, setup: tuple[BatchProposerConfig | None, list[str]], args: argparse.Namespace,
          prompts: list[str], log_dir: Path) -> dict:
    port = free_port()
    base = f"http://{HOST}:{port}"
    cfg, extra = setup
    cmd = serve_command(args.model_dir, cfg, host=HOST, port=port, module=True, python=sys.executable,
                        extra=["--served-model-name", "smollm2", "--dtype", "float32",
                               "--max-model-len", str(args.max_model_len), "--max-num-seqs",
                               str(args.max_num_seqs), "--enforce-eager", "--seed", "0",
                               "--gpu-memory-utilization", str(args.memory_share), *extra])
    log_path = log_dir / f"vllm-{method}.log"
    say(f"{method}: starting vllm serve on {base} (log: {log_path})")
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + args.start_timeout
        while True:
            if proc.poll() is not None:
                tail = log_path.read_text(errors="replace").splitlines()[-15:]
                raise RuntimeError(f"{method}: vllm serve exited with {proc.returncode}:\n" + "\n".join(tail))
            try:
                get(f"{base}/health", timeout=2)
                break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{method}: server not up after {args.start_timeout}s: "
                                       f"see {log_path}") from None
                time.sleep(2)
        say(f"{method}: up; sending {len(prompts)} prompts concurrently "
            f"(temperature={args.temperature}, max_tokens={args.max_tokens})")
        before = counters(base)
        t = time.monotonic()

        def ask(text: str) -> dict:
            return post(f"{base}/v1/chat/completions",
                        {"model": "smollm2", "messages": [{"role": "user", "content": text}],
                         "temperature": args.temperature, "max_tokens": args.max_tokens, "seed": 0},
                        timeout=args.request_timeout)

        with concurrent.futures.ThreadPoolExecutor(max_workers=len(prompts)) as pool:
            answers = list(pool.map(ask, prompts))
        wall = time.monotonic() - t
        after = counters(base)
        delta = {k.split(":")[1]: after[k] - before[k] for k in COUNTERS}
        texts = [a["choices"][0]["message"]["content"] for a in answers]
        tokens = sum(a["usage"]["completion_tokens"] for a in answers)
        say(f"{method}: {tokens} tokens in {wall:.1f}s")
        return {"method": method, "wall_s": wall, "completion_tokens": tokens, "texts": texts, **delta}
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", default=str(Path.home() / ".cache" / "adaspec" / "smollm2-hf"))
    ap.add_argument("--methods", default="none,ngram,suffix,adaspec")
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens of every method")
    ap.add_argument("--drafter", action="append", default=None, help="adaspec drafter spec, repeatable")
    ap.add_argument("--selector", default="ucbspec")
    ap.add_argument("--length", default=None)
    ap.add_argument("--per-category", type=int, default=1, help="prompts per category of the mixed suite")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="0 = greedy (outputs must equal no speculation); > 0: sampled with seed 0, "
                         "outputs are not compared")
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--memory-share", type=float, default=0.25,
                    help="--gpu-memory-utilization: on CPU the share of RAM vLLM may reserve")
    ap.add_argument("--start-timeout", type=float, default=400)
    ap.add_argument("--request-timeout", type=float, default=600)
    ap.add_argument("--out", default="vllm-check.json")
    args = ap.parse_args()
    args.drafter = args.drafter or ["prompt-lookup", "suffix"]

    if args.temperature > 0:
        say("WARNING: vllm-cpu 0.32.0 leaves the rejection sampler's per-token temperatures "
            "uninitialised (vllm/utils/cpu_triton_utils.py:390, _expand_kernel_impl): sampled "
            "requests with speculation are not exact on the CPU backend; numbers are not comparable")
    out = Path(args.out).resolve()
    log_dir = out.parent
    stats_file = log_dir / "vllm-check-adaspec-stats.json"
    say(f"exporting SmolLM2 as a Hugging Face directory: {args.model_dir}")
    export_hf("smollm2", args.model_dir)
    prompts = [p.text for p in load_suite("mixed", per_category=args.per_category)]
    table = methods(args, stats_file)
    wanted = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in wanted if m not in table]
    if unknown:
        ap.error(f"unknown method(s) {unknown}: choose from {sorted(table)}")
    results, failures = [], {}
    for m in wanted:
        try:
            results.append(serve(m, table[m], args, prompts, log_dir))
        except (RuntimeError, OSError, urllib.error.URLError) as exc:
            failures[m] = str(exc)
            say(f"{m}: FAILED: {exc}")
    base = next((r for r in results if r["method"] == "none"), None)
    print(f"\n{'method':9} {'equal':>6} {'drafts':>7} {'drafted':>8} {'accepted':>9} {'accept%':>8} "
          f"{'mean_len':>9} {'tokens':>7} {'wall_s':>7}")
    for r in results:
        equal = (sum(a == b for a, b in zip(r["texts"], base["texts"])) if base else None)
        r["equal_to_none"] = equal
        d, dt = r["spec_decode_num_drafts"], r["spec_decode_num_draft_tokens"]
        acc = r["spec_decode_num_accepted_tokens"]
        r["acceptance_rate"] = acc / dt if dt else None
        r["mean_accepted_length"] = 1 + acc / d if d else None
        print(f"{r['method']:9} {'-' if equal is None else f'{equal}/{len(prompts)}':>6} {d:7.0f} {dt:8.0f} "
              f"{acc:9.0f} {100 * (r['acceptance_rate'] or 0):7.1f}% {r['mean_accepted_length'] or 1:9.2f} "
              f"{r['completion_tokens']:7d} {r['wall_s']:7.1f}")
    adaspec_stats = json.loads(stats_file.read_text()) if stats_file.is_file() else None
    if adaspec_stats:
        st = adaspec_stats["stats"]
        print(f"\nadaspec proposer: {st['calls']} calls, {st['rows']} rows, {st['requests']} requests, "
              f"{1e3 * st['propose_s'] / max(st['calls'], 1):.2f} ms per call; inconsistent={st['inconsistent']} "
              f"cut={st['cut']}")
        for name, t in st["drafters"].items():
            print(f"  {name:24} rounds={t['rounds']:5d} drafted={t['drafted']:5d} accepted={t['accepted']:5d}")
    out.write_text(json.dumps({"args": vars(args), "prompts": prompts, "results": results,
                               "failures": failures, "adaspec_stats": adaspec_stats}, indent=2))
    say(f"wrote {out}")
    greedy = args.temperature == 0
    mismatched = [r["method"] for r in results if greedy and base and r["equal_to_none"] != len(prompts)]
    if failures or mismatched:
        say(f"failed methods: {sorted(failures)}; outputs differing from no speculation: {mismatched}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
