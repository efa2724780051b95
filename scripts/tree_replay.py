"""Tokens per target forward (MAT) and predicted speed of chains and draft trees, replayed
against recorded greedy outputs (issue 18): the engine runs unchanged against an oracle target
whose argmax is the recorded greedy continuation, so greedy MAT and every decision are exact
(the drafters only see tokens; an off-path tree node is never accepted) and a configuration
takes seconds instead of a bench's model forwards.

Speed is *predicted*: verify steps on the trace's surface at their width and cache length,
times the live/surface ratio per width (the trace's calibration, or ``--live-ratios`` of a
bench run's rounds.csv), plus the engine's own drafting, policy and catch-up work measured
here (CPU time unless ``--wall-clock``) and the recorded per-round and per-request overheads;
AR is priced alike. The engine's policies read the surface the live engines read
(``Trace.policy_surface``). Measure real speed with ``adaspec bench``.

    python scripts/tree_replay.py docs/results/smollm2-auto-trees-v3/trace.npz   # a bench trace
    python scripts/tree_replay.py TRACE.npz --live-ratios RESULTS/rounds.csv --only "suffix k=5 +tree"
    python scripts/tree_replay.py TRACE.npz --costs GRID.json --live-ratios RUN/rounds.csv  # another machine's run
    python scripts/tree_replay.py --record ar.json              # or: AR outputs of SmolLM2 (mixed suite)
    python scripts/tree_replay.py --record qa.json --backend llama.cpp --suite qa --per-category 8
    python scripts/tree_replay.py ar.json --costs surface.json  # priced on a surface JSON, 2 ms a round
    python scripts/tree_replay.py TRACE.npz --only "suffix k=5 +tree" --tree-nodes 31  # a larger node budget
    python scripts/tree_replay.py TRACE.npz --suffix suffix:datastore=$HOME/.cache/adaspec/pool/smollm2/datastores/generalist.jsonl
    python scripts/tree_replay.py TRACE.npz --only auto --add suffix:datastore=$HOME/.cache/adaspec/pool/smollm2/datastores/generalist.jsonl
    python scripts/tree_replay.py TRACE.npz --only auto --costs GRID.json --by-category  # per category, on llama.cpp's grid
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

import adaspec.engine as engine_mod
from adaspec.backends.base import TargetBackend
from adaspec.config import GenerationConfig, SamplingConfig
from adaspec.costs import VerifyCostSurface

POOL = ["prompt-lookup", "suffix", "none"]
#: (name, engine keyword arguments): the bench's configurations, chain and tree side by side
CONFIGS: list[tuple[str, dict[str, Any]]] = [
    (name + tree_tag, dict(kw, tree=bool(tree_tag)))
    for name, kw in [("suffix k=5", {"drafters": ["suffix"], "k": 5}),
                     ("suffix + cost-model", {"drafters": ["suffix"], "length": "cost-model"}),
                     ("auto", {"drafters": POOL, "selector": "auto"})]
    for tree_tag in ("", " +tree")]


class OracleTarget(TargetBackend):
    """A target whose next token after a prefix of the recorded sequence ``seq`` is the
    recorded one (any other prefix: token 0, never reached by greedy verification's walk, and
    kept from recycle's table by ``learn_on_path_only``). Each verify forward adds its price on
    ``priced`` (width, cache length) to ``elapsed``, the engine's clock's offset: the engine
    measures the verify steps a live run would, and its cost model learns their live/surface
    ratio from them (``CostModel.live``) as it does live."""

    backend = "transformers"
    supports_trees = True
    name = "oracle"
    tokenizer = None

    def __init__(self, vocab: int, eos: Sequence[int], priced: VerifyCostSurface | None = None):
        self.seq: list[int] = []
        self._vocab, self._eos = vocab, set(eos)
        self.priced, self.elapsed = priced, 0.0

    def clock(self) -> float:
        """The engine's timer: wall time plus the priced verify steps so far."""
        return time.perf_counter() + self.elapsed

    def _pay(self, state: list[int], width: int) -> None:
        if state and self.priced is not None:  # not the prefill: the engine times it apart
            self.elapsed += self.priced.cost(width, len(state))

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
        self._pay(state, len(ids))
        state.extend(ids)
        return self._rows([state[:len(state) - keep + 1 + i] for i in range(keep)]), None

    def forward_tree(self, state, last, tree, hidden=False):
        self._pay(state, 1 + len(tree))
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


def learn_on_path_only(drafters: Sequence[Any]) -> None:
    """Drafters that learn from the target's rows (recycle) get only the rows on the recorded
    path: the oracle's row after a rejected token says token 0, not what the target predicts
    there (a live round feeds those rows too; the bench's trace leaves them out alike). Rows
    come in path order and row 0 follows the verified context, so row r + 1 is on the path
    exactly when row r is and the input after it is row r's argmax (the recorded token)."""
    for d in drafters:
        if not d.observes_target:
            continue
        learn = d.observe_target

        def observe(inputs: Sequence[int], logits: torch.Tensor, learn: Any = learn) -> None:
            n = min(len(inputs), logits.shape[0])
            best = logits[:n].argmax(-1).tolist()
            on = 1
            while on < n and inputs[on] == best[on - 1]:
                on += 1
            learn(list(inputs[:on]), logits[:on])

        d.observe_target = observe


def record(out: str, model: str, suite: str, per_category: int, max_new_tokens: int,
           backend: str = "transformers") -> None:
    """Greedy AR outputs of the suite (turns in order, as ``adaspec bench`` encodes them) on
    ``backend`` (llama.cpp: its own greedy outputs, for ``look_ceiling.py``)."""
    from adaspec.bench.runner import _turn_prompt
    from adaspec.bench.workloads import load_suite
    from adaspec.models import load_model

    target = load_model(model, backend=backend)
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


@dataclass
class Workload:
    """Requests to replay in order (prompt, AR output, the sequence the oracle follows), the
    surface the engine's policies and node budget read, the one verify steps are priced on
    (live/surface ratio per width applied), the per-round and per-request overheads, and each
    request's prefill seconds."""

    requests: list[dict[str, Any]]
    vocab: int
    eos: list[int]
    max_new_tokens: int
    policy_surface: VerifyCostSurface
    priced: VerifyCostSurface
    round_s: float = 0.002
    request_s: float = 0.0


def live_ratios(trace: Any, rounds_csv: str, surface: VerifyCostSurface | None = None, min_rounds: int = 5) -> Any:
    """``EngineOverheads`` whose per-width verify ratio is a bench run's own (``rounds.csv`` of
    the output directory the trace came with: every configuration's rounds, live verify
    seconds over the trace's surface at the same width and cache length). The ratio drifts
    between hours, and trees verify more wide blocks than chains, so their predicted gain
    depends on it: price with both. ``surface``: the ratios over this surface (a ``--costs``
    grid measured beside the bench run) instead of the trace's."""
    import csv
    from collections import defaultdict

    from adaspec.costs import EngineOverheads

    surface = surface or trace.surface
    n_prompt = {(p.meta.get("id"), int(p.meta.get("turn", 0))): len(p.prompt) for p in trace.prompts}
    ctx: dict[tuple[str, str, str], int] = {}
    sums: dict[int, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])
    for r in csv.DictReader(open(rounds_csv)):
        key = (r["config"], r["prompt_id"], r["turn"])
        if r["round"] == "0":
            ctx[key] = n_prompt[(r["prompt_id"], int(r["turn"]))] - 1
        w = int(r["drafted"]) + 1
        s = sums[w]
        s[0] += 1
        s[1] += float(r["verify_s"])
        s[2] += surface.cost(w, ctx[key])
        ctx[key] += int(r["emitted"])
    widths = sorted(w for w, s in sums.items() if s[0] >= min_rounds)
    return EngineOverheads(round_s=trace.overheads.round_s, request_s=trace.overheads.request_s,
                           verify_widths=widths, verify_ratios=[sums[w][1] / sums[w][2] for w in widths])


def load_workload(path: str, costs: str | None, rounds_csv: str | None = None,
                  policy_priced: bool = False) -> Workload:
    """A bench trace (``.npz``, ``adaspec bench --record``: prompts, greedy paths, surfaces and
    overheads in one file) or a recording from ``--record`` with a surface JSON (``--costs``).
    ``rounds_csv``: verify steps priced at that bench run's live/surface ratio per width, over
    ``costs`` when given (``live_ratios``). ``policy_priced``: the engine's policies read the
    surface steps are priced on (what a grid that matched the live run would decide) instead
    of the grid the live engines read."""
    if path.endswith(".npz"):
        from adaspec.bench.trace import Trace

        tr = Trace.load(path)
        if tr.surface is None:
            raise SystemExit(f"{path} was recorded without costs: give a trace with a surface")
        reqs = [{"prompt": p.prompt, "out": p.output, "seq": p.path, "category": p.meta.get("category", "?"),
                 "prefill_s": p.prefill_s} for p in tr.prompts]
        policy, base = tr.policy_surface or tr.surface, tr.surface
        if costs:  # another grid (another machine): the trace's live ratios were over its own
            policy = base = VerifyCostSurface.from_dict(json.load(open(costs)))
        over = live_ratios(tr, rounds_csv, base) if rounds_csv else tr.overheads
        priced = base.scaled(over.verify_factor) if rounds_csv or not costs else base
        return Workload(reqs, tr.target["vocab_size"], tr.eos_ids, tr.max_new_tokens,
                        priced if policy_priced else policy, priced, over.round_s, over.request_s)
    if not costs:
        raise SystemExit("a --record recording needs --costs (a verify-cost surface JSON)")
    if rounds_csv:
        raise SystemExit("--live-ratios needs a bench trace (.npz): its prompts place the rounds' cache lengths")
    rec = json.load(open(path))
    surface = VerifyCostSurface.from_dict(json.load(open(costs)))
    reqs = [dict(r, seq=r["prompt"] + r["out"], prefill_s=surface.prefill(len(r["prompt"]) - 1))
            for r in rec["requests"]]
    return Workload(reqs, rec["vocab"], rec["eos"], rec["max_new_tokens"], surface, surface)


def replay_config(work: Workload, **engine_kw: Any) -> dict[str, Any]:
    """One configuration over the workload (a warm-up on the first request, as the bench's):
    MAT, nodes per round, and tokens/s priced on the workload's surface (verify steps at their
    width and cache length, plus the drafting, catch-up and policy seconds measured here and
    the recorded per-round and per-request overheads)."""
    engine_mod.load_or_measure = lambda *a, **kw: work.policy_surface  # what the engine's policies read
    first = work.requests[0]
    target = OracleTarget(work.vocab, work.eos, work.priced)
    eng = engine_mod.SpeculativeEngine(target, **engine_kw)
    eng._timer = target.clock
    learn_on_path_only(eng.drafters)
    greedy = SamplingConfig(temperature=0.0)
    target.seq = first["seq"]
    eng.generate(first["prompt"], GenerationConfig(max_new_tokens=16, sampling=greedy))
    out = {"tokens": 0, "rounds": 0, "nodes": 0, "drafting": 0, "python_s": 0.0, "seconds": 0.0,
           "ar_seconds": 0.0, "identical": True, "by_category": {}}
    for req in work.requests:
        target.seq = req["seq"]
        res = eng.generate(req["prompt"], GenerationConfig(max_new_tokens=work.max_new_tokens, sampling=greedy))
        out["identical"] &= res.token_ids == req["out"]
        ctx = len(req["prompt"]) - 1
        secs = req["prefill_s"] + work.request_s
        ar = secs + sum(work.priced.cost(1, ctx + x) + work.round_s for x in range(len(req["out"])))
        for r in res.stats.rounds:
            out["rounds"] += 1
            out["nodes"] += r.drafted
            out["drafting"] += r.drafted > 0
            py = r.draft_s + r.policy_s + r.catch_up_s + r.eval_s + r.drafter_prefill_s
            out["python_s"] += py
            secs += work.priced.cost(r.drafted + 1, ctx) + py + work.round_s
            ctx += r.emitted
        out["tokens"] += res.stats.new_tokens
        out["seconds"] += secs
        out["ar_seconds"] += ar
        cat = out["by_category"].setdefault(req["category"], [0.0, 0.0])
        cat[0] += secs
        cat[1] += ar
    n = max(out["rounds"], 1)
    out.update(mat=out["tokens"] / n, nodes_per_round=out["nodes"] / n, drafting_share=out["drafting"] / n,
               python_ms=1e3 * out["python_s"] / n, tokens_per_s=out["tokens"] / out["seconds"],
               speedup=out["ar_seconds"] / out["seconds"])
    return out


def replay(path: str, costs: str | None, names: Sequence[str] | None = None, rounds_csv: str | None = None,
           suffix: str | None = None, add: Sequence[str] = (), by_category: bool = False,
           policy_priced: bool = False, **engine_kw: Any) -> None:
    """Replay every configuration (``names``: only these); ``suffix``: another suffix spec in
    their place (e.g. ``suffix:datastore=FILE``, a datastore's candidates in the trees); ``add``:
    more drafters for ``auto`` (a pool's datastores); ``by_category``: speed-ups per category too."""
    work = load_workload(path, costs, rounds_csv, policy_priced)
    for name, kw in CONFIGS:
        if names and name not in names:
            continue
        if suffix:
            kw = dict(kw, drafters=[suffix if d == "suffix" else d for d in kw["drafters"]])
        if add and kw.get("selector") == "auto":
            kw = dict(kw, drafters=[*kw["drafters"], *add])
        r = replay_config(work, **kw, **engine_kw)
        print(f"{name:26s} MAT {r['mat']:.3f}  identical to AR: {r['identical']}  nodes/round "
              f"{r['nodes_per_round']:.2f}  drafting rounds {r['drafting_share']:.2f}  python "
              f"{r['python_ms']:.2f} ms/round  est. {r['tokens_per_s']:.2f} tok/s, {r['speedup']:.3f}x AR")
        if by_category:
            print("    " + ", ".join(f"{c} {ar / secs:.3f}x" for c, (secs, ar) in sorted(r["by_category"].items())))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("recording", nargs="?", help="a bench trace (.npz) or AR outputs recorded with --record")
    ap.add_argument("--record", metavar="OUT", help="record AR outputs to OUT and stop")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--backend", default="transformers", help="with --record: the target's backend (llama.cpp)")
    ap.add_argument("--suite", default="mixed")
    ap.add_argument("--per-category", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--costs", help="verify-cost surface JSON (VerifyCostSurface.to_dict); a trace has its own")
    ap.add_argument("--only", action="append", help="replay only this configuration (repeatable)")
    ap.add_argument("--wall-clock", action="store_true",
                    help="time the engine's own work (drafting, policies) by wall time; default: the "
                         "process's CPU time, which another process on a busy machine does not inflate")
    ap.add_argument("--live-ratios", metavar="ROUNDS_CSV",
                    help="price verify steps with the per-width live/surface ratio of this bench run's "
                         "rounds.csv (over --costs when given) instead of the trace's calibration")
    ap.add_argument("--policy-priced", action="store_true",
                    help="the engine's policies read the priced surface (with --live-ratios: the live "
                         "run's costs) instead of the grid: what a grid matching the live run would decide")
    ap.add_argument("--tree-nodes", type=int, default=None,
                    help="most nodes of a draft tree (the engine's tree_nodes, default 15)")
    ap.add_argument("--suffix", metavar="SPEC", help="replace the suffix drafter by SPEC, e.g. "
                    "suffix:datastore=FILE (a datastore built by adaspec build-pool)")
    ap.add_argument("--add", action="append", default=[], metavar="SPEC",
                    help="add a drafter to auto's (repeatable), e.g. a pool's suffix:datastore=FILE")
    ap.add_argument("--by-category", action="store_true", help="predicted speed-ups per prompt category too")
    args = ap.parse_args()
    if args.record:
        record(args.record, args.model, args.suite, args.per_category, args.max_new_tokens, args.backend)
    elif args.recording:
        if not args.wall_clock:
            time.perf_counter = time.process_time  # the engine's timers, in this process only
        kw = {} if args.tree_nodes is None else {"tree_nodes": args.tree_nodes}
        replay(args.recording, args.costs, args.only, args.live_ratios, args.suffix, args.add, args.by_category,
               args.policy_priced, **kw)
    else:
        ap.error("give --record OUT, or a trace (or a recording and --costs)")


if __name__ == "__main__":
    main()
