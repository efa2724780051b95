"""The engine's own per-round work (everything but the target's forwards), measured apart from them.

Records each prompt's greedy continuation on the real target once, then replays the engine on a
*scripted* target: its logits follow that continuation (so every drafter, policy and verdict
behaves as in the live run) and each forward spins for the time the measured verify-cost surface
gives it (so cost-aware policies see the same prices, and the core stays as busy as live). The
engine thread's CPU time during the replay, minus the spins (``time.thread_time``; other load
inflates it less than wall time), is its overhead: looking, policies, drafting, catch-up, verification on the
logits, bookkeeping. Printed per configuration as microseconds per round and per token, and as a
share of the predicted wall time (surface forwards + overhead).

    python scripts/loop_overhead.py --backend llama.cpp --per-category 2 -n 128

Not a test: numbers depend on the machine. Use it to see what a change to the hot loop costs,
on a busy machine too.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch

from adaspec import SpeculativeEngine
from adaspec.backends.base import TargetBackend
from adaspec.bench.workloads import load_workload
from adaspec.costs import VerifyCostSurface

CONFIGS = {
    "AR": dict(drafters=[], selector=None, length=None),
    "suffix + cost-model": dict(drafters=["suffix"], selector=None, length="cost-model"),
    "auto over [pl, suffix, none]": dict(drafters=["prompt-lookup", "suffix", "none"],
                                         selector="auto", length=None),
}


class ScriptedTarget(TargetBackend):
    """Logits that make ``truth[p + 1]`` the argmax after position p; forwards sleep V(k, L)."""

    def __init__(self, real: TargetBackend, surface: VerifyCostSurface):
        self.real, self.surface = real, surface
        self.backend, self.name, self.tokenizer = real.backend, real.name, real.tokenizer
        self.truth: list[int] = []
        self.slept = 0.0
        self.spun = 0.0  # CPU time of the spins (not the engine's work)

    device = property(lambda self: torch.device("cpu"))
    dtype = property(lambda self: torch.float32)
    vocab_size = property(lambda self: self.real.vocab_size)
    context_window = property(lambda self: self.real.context_window)

    def model_eos_ids(self) -> set[int]:
        return self.real.model_eos_ids()

    def new_state(self) -> list[int]:
        return [0]

    def _sleep(self, s: float) -> None:
        """Spin (not sleep) for the forward's price: the core stays as busy as under a real
        forward (a sleeping core wakes slow and cold, which inflated the measured overhead
        2-4x on a quiet machine); the spin's own CPU time is subtracted (``spun``)."""
        self.slept += s
        c0, end = time.thread_time(), time.perf_counter() + s
        while time.perf_counter() < end:
            pass
        self.spun += time.thread_time() - c0

    def prefill(self, state: list[int], prompt: Sequence[int]) -> None:
        if len(prompt) > 1:
            state[0] = len(prompt) - 1
            pre = self.surface.prefill_seconds
            if pre:
                self._sleep(max(0.0, _interp(self.surface.contexts, pre, len(prompt))))

    def forward(self, state: list[int], ids: Sequence[int], keep: int = 1,
                hidden: bool = False) -> tuple[torch.Tensor, None]:
        start = state[0]
        self._sleep(self.surface.cost(len(ids), start))
        state[0] = start + len(ids)
        rows = torch.zeros(keep, self.vocab_size)
        eos = min(self.model_eos_ids())
        for r, p in enumerate(range(state[0] - keep, state[0])):
            nxt = self.truth[p + 1] if p + 1 < len(self.truth) else eos
            rows[r, nxt] = 1.0
        return rows, None

    def truncate(self, state: list[int], length: int) -> None:
        state[0] = min(state[0], length)

    def state_length(self, state: list[int]) -> int:
        return state[0]

    def identity(self) -> str:
        return "scripted|" + self.real.identity()

    def request_scope(self):
        return self.real.request_scope()  # as live: llama.cpp keeps torch on one thread


def _interp(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    if x <= xs[0]:
        return ys[0] * x / max(1, xs[0])
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return ys[-1] * x / xs[-1]


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--backend", default="llama.cpp")
    ap.add_argument("--suite", default="mixed")
    ap.add_argument("--per-category", type=int, default=2)
    ap.add_argument("-n", "--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--config", action="append", choices=sorted(CONFIGS),
                    help="configurations to run (default: all)")
    ap.add_argument("--profile", action="store_true",
                    help="print each configuration's top functions by own time (cProfile, last repeat)")
    args = ap.parse_args(argv)

    real_engine = SpeculativeEngine.from_pretrained(args.model, [], backend=args.backend)
    real = real_engine.target
    surface = real_engine.verify_costs()
    prompts = load_workload(args.suite, args.per_category)
    scripted = ScriptedTarget(real, surface)
    truths: list[tuple[int, list[int]]] = []  # (prompt length, prompt + greedy continuation)
    for i, bp in enumerate(prompts):
        ids = real_engine.encode_prompt(bp.text)
        out = real_engine.generate(ids, max_new_tokens=args.max_new_tokens)
        truths.append((len(ids), list(ids) + list(out.token_ids)))
        print(f"\rrecorded {i + 1}/{len(prompts)} continuations", end="", flush=True)
    print()

    engines: dict[str, Any] = {}
    for name in args.config or list(CONFIGS):
        c = CONFIGS[name]
        eng = SpeculativeEngine(scripted, c["drafters"], selector=c["selector"], length=c["length"])
        eng._costs = surface  # the real target's surface (the scripted one has none of its own)
        eng._attach_costs()
        engines[name] = eng
    rows: dict[str, list[tuple[float, float, int, int]]] = {n: [] for n in engines}
    for rep in range(args.repeats):
        for name, eng in engines.items():  # interleaved: configurations see the same machine
            prof = cProfile.Profile() if args.profile and rep == args.repeats - 1 else None
            if prof:
                prof.enable()
            cpu = slept = wall = 0.0
            rounds = tokens = 0
            for n_prompt, truth in truths:
                scripted.truth = truth
                scripted.slept = scripted.spun = 0.0
                t0, c0 = time.perf_counter(), time.thread_time()
                out = eng.generate(truth[:n_prompt], max_new_tokens=args.max_new_tokens)
                cpu += time.thread_time() - c0 - scripted.spun
                wall += time.perf_counter() - t0
                slept += scripted.slept
                if list(out.token_ids) != truth[n_prompt:n_prompt + len(out.token_ids)]:
                    raise SystemExit(f"{name}: output differs from the recorded continuation")
                rounds += out.stats.n_rounds
                tokens += len(out.token_ids)
            rows[name].append((cpu, slept, rounds, tokens))
            if prof:
                prof.disable()
                print(f"--- {name}")
                pstats.Stats(prof).sort_stats("tottime").print_stats(18)
        print(f"repeat {rep + 1}/{args.repeats} done", flush=True)

    print(f"\n{args.model} on {args.backend}, {len(prompts)} prompts x {args.max_new_tokens} tokens, "
          f"median of {args.repeats} (CPU time of the engine's thread; forwards priced by the surface)")
    print(f"{'configuration':34s} {'rounds':>6s} {'tokens':>6s} {'us/round':>9s} {'us/token':>9s} "
          f"{'overhead %':>10s} {'pred tok/s':>10s}")
    for name, rs in rows.items():
        cpu = statistics.median(r[0] for r in rs)
        slept = statistics.median(r[1] for r in rs)
        rounds, tokens = rs[0][2], rs[0][3]
        print(f"{name:34s} {rounds:6d} {tokens:6d} {1e6 * cpu / rounds:9.0f} {1e6 * cpu / tokens:9.0f} "
              f"{100 * cpu / (cpu + slept):9.2f}% {tokens / (cpu + slept):10.1f}")


if __name__ == "__main__":
    main()
