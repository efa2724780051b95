"""Tokens per target forward (MAT) of chains and draft trees, replayed against recorded AR
outputs (issue 18): the engine runs unchanged against an oracle target whose argmax is the
recorded greedy continuation, so greedy MAT is exact (the drafters only see tokens) and a
configuration takes seconds instead of a bench's model forwards. Speed is *estimated* on a
verify-cost surface (``--costs``: JSON as ``VerifyCostSurface.to_dict``) plus the measured
drafting and policy time and 2 ms per round; measure real speed with ``adaspec bench``.

    python scripts/tree_replay.py --record ar.json            # SmolLM2 greedy, mixed suite, 2/category
    python scripts/tree_replay.py ar.json --costs surface.json  # suffix and auto, chain and +tree
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

import torch

import adaspec.engine as engine_mod
from adaspec.backends.base import TargetBackend
from adaspec.config import GenerationConfig, SamplingConfig
from adaspec.costs import VerifyCostSurface

POOL = ["prompt-lookup", "suffix", "none"]
CONFIGS = [("suffix k=5", ["suffix"], None, False), ("suffix k=5 +tree", ["suffix"], None, True),
           ("auto", POOL, "auto", False), ("auto +tree", POOL, "auto", True)]


class OracleTarget(TargetBackend):
    """A target whose next token after a prefix of the recorded sequence ``seq`` is the
    recorded one (any other prefix: token 0, never reached by greedy verification's walk)."""

    backend = "transformers"
    supports_trees = True
    name = "oracle"
    tokenizer = None

    def __init__(self, vocab: int, eos: Sequence[int]):
        self.seq: list[int] = []
        self._vocab, self._eos = vocab, set(eos)

    device = property(lambda self: torch.device("cpu"))
    dtype = property(lambda self: torch.float32)
    vocab_size = property(lambda self: self._vocab)
    context_window = property(lambda self: None)

    def model_eos_ids(self) -> set[int]:
        return set(self._eos)

    def new_state(self) -> list[int]:
        return []

    def _rows(self, prefixes: Sequence[list[int]]) -> torch.Tensor:
        out = torch.full((len(prefixes), self._vocab), -10.0)
        s = self.seq
        for i, p in enumerate(prefixes):
            out[i, s[len(p)] if len(p) < len(s) and s[:len(p)] == p else 0] = 10.0
        return out

    def forward(self, state, ids, keep=1, hidden=False):
        state.extend(ids)
        return self._rows([state[:len(state) - keep + 1 + i] for i in range(keep)]), None

    def forward_tree(self, state, last, tree, hidden=False):
        base = [*state, last]
        rows = [base] + [base + [tree.tokens[j] for j in tree.path(i)] for i in range(len(tree))]
        state.append(last)
        state.extend(tree.tokens)
        return self._rows(rows), None

    def keep_path(self, state, start, rows):
        kept = [state[start + r] for r in rows]
        del state[start:]
        state.extend(kept)

    def truncate(self, state, length):
        del state[length:]

    def state_length(self, state):
        return len(state)

    def identity(self) -> str:
        return "oracle"


def record(out: str, model: str, suite: str, per_category: int, max_new_tokens: int) -> None:
    """Greedy AR outputs of the suite (turns in order, as ``adaspec bench`` encodes them)."""
    from adaspec.bench.runner import _turn_prompt
    from adaspec.bench.workloads import load_suite
    from adaspec.models import load_model

    target = load_model(model)
    eng = engine_mod.SpeculativeEngine(target, [])
    gen = GenerationConfig(max_new_tokens=max_new_tokens, sampling=SamplingConfig(temperature=0.0))
    reqs: list[dict[str, Any]] = []
    for p in load_suite(suite, per_category=per_category):
        answers: list[str] = []
        for turn in range(len(p.turns)):
            ids = _turn_prompt(p, turn, answers, eng)
            res = eng.generate(ids, gen)
            answers.append(eng.decode(res.token_ids))
            reqs.append({"id": p.id, "category": p.category, "turn": turn, "prompt": ids, "out": res.token_ids})
    with open(out, "w") as fh:
        json.dump({"vocab": target.vocab_size, "eos": sorted(eng.eos_ids()),
                   "max_new_tokens": max_new_tokens, "requests": reqs}, fh)


def replay(path: str, costs: str) -> None:
    rec = json.load(open(path))
    surface = VerifyCostSurface.from_dict(json.load(open(costs)))
    engine_mod.load_or_measure = lambda *a, **kw: surface  # the engine prices trees on this surface
    gen = GenerationConfig(max_new_tokens=rec["max_new_tokens"], sampling=SamplingConfig(temperature=0.0))
    reqs = rec["requests"]
    for name, drafters, selector, tree in CONFIGS:
        target = OracleTarget(rec["vocab"], rec["eos"])
        eng = engine_mod.SpeculativeEngine(target, drafters, k=5, selector=selector, tree=tree)
        target.seq = reqs[0]["prompt"] + reqs[0]["out"]  # the bench's warm-up
        eng.generate(reqs[0]["prompt"], GenerationConfig(max_new_tokens=16, sampling=gen.sampling))
        toks = rounds = nodes = drafting = 0
        same, secs, py = True, 0.0, 0.0
        for req in reqs:
            target.seq = req["prompt"] + req["out"]
            res = eng.generate(req["prompt"], gen)
            same &= res.token_ids == req["out"]
            toks += res.stats.new_tokens
            ctx = len(req["prompt"]) - 1
            for r in res.stats.rounds:
                rounds += 1
                nodes += r.drafted
                drafting += r.drafted > 0
                py += r.draft_s + r.policy_s
                secs += surface.cost(r.drafted + 1, ctx) + r.draft_s + r.policy_s + 0.002
                ctx += r.emitted
        print(f"{name:20s} MAT {toks / rounds:.3f}  identical to AR: {same}  nodes/round {nodes / rounds:.2f}  "
              f"drafting rounds {drafting / rounds:.2f}  draft+policy {1e3 * py / rounds:.2f} ms/round  "
              f"est. {toks / secs:.1f} tok/s on the surface")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("recording", nargs="?", help="AR outputs recorded with --record")
    ap.add_argument("--record", metavar="OUT", help="record AR outputs to OUT and stop")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--suite", default="mixed")
    ap.add_argument("--per-category", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--costs", help="verify-cost surface JSON (VerifyCostSurface.to_dict)")
    args = ap.parse_args()
    if args.record:
        record(args.record, args.model, args.suite, args.per_category, args.max_new_tokens)
    elif args.recording and args.costs:
        replay(args.recording, args.costs)
    else:
        ap.error("give --record OUT, or a recording and --costs")


if __name__ == "__main__":
    main()
