"""The scheduler: requests join and leave between rounds, and every active row runs one round.

``BatchEngine`` is the one loop every decoding path drives: ``SpeculativeEngine.generate`` /
``stream`` (a batch of one whose row drafts with the engine's own drafters and policies),
``generate_batch`` and ``adaspec serve`` (continuous batching, each request with its own forked
drafters and policies). A step admits waiting requests (at most ``prefill_chunk`` prompt tokens
of prefill on the joining request's own state, so joining never stalls the others for long),
plans every row (``round.Round.plan``), verifies them (one forward over every row where the
backend has batched states, ``backends.base.RowStates``; else one row at a time on its own
state, trees and target features included), accepts each row exactly on its own logits, and
settles it (``Round.settle``). A finished or cancelled row leaves in the same step, so the next
step refills it from the queue.
"""

from __future__ import annotations

import copy
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .backends.base import RowStates
from .backends.transformers import LoadedModel, forward_rows
from .config import GenerationConfig
from .costs import BatchCosts, batch_grid_rows, load_or_measure_batch_costs
from .drafters import Drafter
from .drafters.indexed import share_indexes
from .errors import ConfigError
from .metrics import RoundRecord
from .round import (GenerationResult, Outcome, Round, Row, RowParts, RowPlan, Settled, accept, accept_tree,
                    fork_policies, joint_width)

#: prompt tokens a joining request prefills per ``step()`` (bounds the others' stall)
DEFAULT_PREFILL_CHUNK = 256

__all__ = ["BatchEngine", "BatchEvent", "batching_problem", "joint_width", "load_or_measure_batch",
           "measure_batch_costs", "measure_row_costs", "DEFAULT_PREFILL_CHUNK"]


@dataclass
class BatchEvent:
    """What one ``step()`` did for one request: the tokens it accepted this round (empty while
    it prefills), and, when it finished, why and its result."""

    request: int
    tokens: list[int]
    finished: bool = False
    stop_reason: str = ""  # eos, stop_string, max_new_tokens, cancelled
    round: RoundRecord | None = None
    result: GenerationResult | None = None  # once finished


def batching_problem(engine: Any, drafters: bool = True) -> str | None:
    """Why ``engine``'s requests cannot share one target forward (a message naming the fix), or
    None: the one rule of every batched path. On a backend without batched states the rows run
    one at a time (no problem); on one with them (transformers), rows verify chains (no draft
    trees), and (``drafters``) every drafter must draft for one request at a time
    (``drafter_problem``)."""
    target = engine.target
    problem = target.batching_problem()
    if problem is not None:
        return problem
    if not target.new_rows().batched:
        return None
    if engine.tree:
        return "batched rounds verify chains: build the engine with tree=False"
    for d in engine.drafters if drafters else ():
        problem = drafter_problem(d)
        if problem is not None:
            return problem
    return None


def drafter_problem(d: Drafter) -> str | None:
    """Why drafter ``d`` cannot draft for requests that share a batched forward, or None: it
    must fork a per-request state (``Drafter.fork``), and a batched forward computes no target
    features (EAGLE-style heads draft from them)."""
    if not d.caps.forks:
        return (f"drafter {d.name!r} cannot draft for several requests at once: batch with the "
                "model-free drafters (none, prompt-lookup, suffix, recycle) or model drafters")
    if d.caps.reads_target_features:
        return (f"drafter {d.name!r} drafts from the target's features, which batched rounds do not "
                "compute: batch with model-free or model drafters")
    return None


def _pool_hint(engine: Any) -> str:
    """The fix when the unbatchable drafters came with the engine's default (a built pool)."""
    if engine.default_pool:
        return " (the engine's default drafters include a built pool's heads: SpeculativeEngine(..., pool=False))"
    return ""


class BatchEngine:
    """Continuous batching over a ``SpeculativeEngine``.

    ``add(prompt, config)`` queues a request and returns its id; ``step()`` admits waiting
    requests (at most ``prefill_chunk`` prompt tokens per step), runs one round for every active
    row and returns the ``BatchEvent``s; ``cancel(id)`` drops a request at once, wherever it is.
    Requests use the engine's drafters (forked per request: ``Drafter.fork``) and policies
    (copied per request; ``auto``'s global counts stay shared, as across the engine's
    sequential requests) or their own (``drafters`` indices, ``selector``, ``length``, ``k``, as
    ``with_policies``).

    Args:
        engine: the engine whose target, drafters and cost model are used.
        max_batch: most rows decoded together (more requests wait in a queue).
        prefill_chunk: most prompt tokens prefilled per ``step()`` (a long prompt over several
            steps, several short ones in one); None: a whole prompt at once.
        compact_fraction: compact a padded batch cache when holes exceed this fraction of the
            longest row (``backends.transformers.PaddedRows``).
        batch_costs: the batch verify-cost surface for per-row pricing (``BatchCosts``); None:
            measured (and cached on disk) when the policies price rounds, else unused.
    """

    def __init__(self, engine: Any, *, max_batch: int = 8, prefill_chunk: int | None = DEFAULT_PREFILL_CHUNK,
                 compact_fraction: float = 0.25, batch_costs: BatchCosts | None = None, _solo: bool = False):
        for name, v in (("max_batch", max_batch), ("prefill_chunk", 1 if prefill_chunk is None else prefill_chunk)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {v!r}")
        if not 0.0 < compact_fraction:
            raise ConfigError(f"compact_fraction must be > 0, got {compact_fraction!r}: e.g. 0.25")
        self.engine, self.target = engine, engine.target
        if max_batch > 1 or not _solo:
            problem = batching_problem(engine, drafters=False) if max_batch > 1 else None
            if problem:
                raise ConfigError(problem)
        self.max_batch, self.prefill_chunk = max_batch, prefill_chunk
        self._solo = _solo
        # one cost model for the batch's policies: the engine's running means, priced per batch
        self.cost_model = engine.cost_model if _solo else copy.copy(engine.cost_model)
        self._wants_costs = engine.prices_rounds
        if not _solo:
            self.cost_model.batch = batch_costs
            if engine.selector.caps.forks_sharing:  # auto: its global counts exist before forking
                engine.selector.begin_request(engine.drafter_names)
        self.round = Round(engine.decode, engine.eos_ids(), clock=engine._timer)
        self.states: RowStates = self.target.new_rows(compact_fraction)
        self._next_id = 0
        self._waiting: deque[Row] = deque()
        self._joining: Row | None = None
        self._rows: list[Row] = []

    @classmethod
    def solo(cls, engine: Any) -> BatchEngine:
        """The single-request path (``generate``, ``stream``): a batch of one whose row drafts
        with the engine's own drafters, policies and cost model (what it learns is the
        engine's), prefilled at once, with draft trees and target features."""
        return cls(engine, max_batch=1, prefill_chunk=None, _solo=True)

    # -- lifecycle -------------------------------------------------------------------------------
    @property
    def active(self) -> list[int]:
        """Ids of the requests being decoded, in row order."""
        return [r.id for r in self._rows]

    @property
    def pending(self) -> list[int]:
        """Ids of requests queued or prefilling, not decoding yet."""
        return ([self._joining.id] if self._joining else []) + [r.id for r in self._waiting]

    @property
    def queued(self) -> list[int]:
        """Ids of requests waiting for a row (not prefilling yet)."""
        return [r.id for r in self._waiting]

    @property
    def compactions(self) -> int:
        return self.states.compactions

    def __len__(self) -> int:
        return len(self._rows) + len(self._waiting) + (self._joining is not None)

    def add(self, prompt: Any, config: GenerationConfig | None = None, *,
            drafters: Sequence[int] | None = None, selector: Any = None, length: Any = None,
            k: int = 5, **overrides: Any) -> int:
        """Queue a request (prompt as for ``generate``) and return its id. ``drafters`` /
        ``selector`` / ``length`` / ``k``: its own configuration (``with_policies``); default:
        the engine's, copied."""
        engine = self.engine
        cfg = engine._config(config, overrides)
        prompt_ids = engine.encode_prompt(prompt, cfg.chat_template)
        engine._check_fits(len(prompt_ids), cfg.max_new_tokens)
        return self.admit(prompt_ids, cfg, self._request_parts(drafters, selector, length, k))

    def admit(self, prompt_ids: Sequence[int], cfg: GenerationConfig, parts: RowParts) -> int:
        """Queue encoded ``prompt_ids`` with the parts that draft for it; returns its id. Its
        policies begin its request now (a configuration they cannot run fails here:
        ``Round.admit``), its drafters when it leaves the queue (``step``: at ``max_batch=1``
        they are the engine's own, which the requests before it use until they end)."""
        row = Row.new(self._next_id, parts, prompt_ids, cfg, self.target.device, self.engine._timer())
        row.features = self.engine._features_for(parts.drafters)
        self.round.admit(row)
        self._next_id += 1
        self._waiting.append(row)
        return row.id

    def _request_parts(self, drafters: Sequence[int] | None, selector: Any, length: Any, k: int) -> RowParts:
        """A request's own parts: the engine's drafters forked (or those at ``drafters``), its
        policies copied (or built from ``selector`` / ``length`` / ``k``), the batch's cost model."""
        engine = self.engine
        view = copy.copy(engine)
        view.cost_model = self.cost_model  # the batch's; a row with its own drafters sees it through them
        if drafters is None and selector is None and length is None:
            view.selector, view.length = self._fork_policies()
        else:
            view = view.with_policies(drafters, selector=selector, length=length, k=k)
            self._wants_costs |= view.prices_rounds
        if self.max_batch == 1:  # one request at a time: the engine's own drafters (trees, features)
            return RowParts(list(view.drafters), view.selector, view.length, view.cost_model, engine.tree,
                            engine.tree_nodes, engine.tree_calibration)
        for d in view.drafters:
            problem = drafter_problem(d)
            if problem is not None:
                raise ConfigError(f"batched decoding needs a drafter per request: {problem}{_pool_hint(engine)}")
        forked = [d.fork() for d in view.drafters]
        share_indexes(forked)  # the row's n-gram drafters: one index, as the engine's
        return RowParts(forked, view.selector, view.length, view.cost_model, engine.tree, engine.tree_nodes,
                        engine.tree_calibration)

    def _fork_policies(self) -> tuple[Any, Any]:
        """Per-request copies of the engine's selector and length policy that price rounds with
        this batch's cost model (``round.fork_policies``: ``auto``'s global counts shared)."""
        engine = self.engine
        return fork_policies(engine.selector, engine.length, {id(engine.cost_model): self.cost_model})

    @torch.inference_mode()
    def cancel(self, request: int) -> bool:
        """Drop a request wherever it is (queued, prefilling, decoding); its row is freed at once.
        Returns whether it was found."""
        for row in list(self._waiting):
            if row.id == request:
                self._waiting.remove(row)
                return True
        if self._joining is not None and self._joining.id == request:
            self.target.release(self._joining.state)
            self._joining = None
            return True
        for r, row in enumerate(self._rows):
            if row.id == request:
                row.stats.stop_reason = "cancelled"
                self._finish(row)
                self._rows.pop(r)
                self.states.leave([r])
                return True
        return False

    @torch.inference_mode()
    def step(self) -> list[BatchEvent]:
        """Admit (at most ``prefill_chunk`` prompt tokens of prefill: one piece of a long prompt,
        or several short prompts, each whole), then one round for every active row."""
        budget = self.prefill_chunk
        while budget is None or budget > 0:
            if self._joining is None:
                if not self._waiting or len(self._rows) >= self.max_batch:
                    break
                self._joining = self._waiting.popleft()
                self.round.begin(self._joining)  # its drafters begin now (its policies did at ``admit``)
                self._joining.state = self.target.new_state()
                self._joining.t_start = self.engine._timer()  # stats time it from here (queueing apart)
            fed = self._prefill(self._joining, budget)
            budget = None if budget is None else budget - fed
            if self._joining is not None:  # its next piece waits for the next step's budget
                break
        return self._round() if self._rows else []

    def run(self) -> dict[int, GenerationResult]:
        """Step until every request is done; results by request id."""
        out: dict[int, GenerationResult] = {}
        while len(self):
            for ev in self.step():
                if ev.finished:
                    out[ev.request] = ev.result
        return out

    # -- prefill and joining -------------------------------------------------------------------
    def _prefill(self, row: Row, budget: int | None) -> int:
        """Feed the next piece of the prompt (all but its last token) when it fits ``budget``;
        the row joins the batch when its prompt is in. Returns the tokens fed (0: wait for the
        next step).

        A prompt of at most ``prefill_chunk`` tokens to compute (those its backend's prefix
        cache does not hold: ``cached_prefix``) goes through the backend's own ``prefill`` in
        one piece, as ``generate`` feeds it; a longer one goes in pieces of ``prefill_chunk``
        tokens from its start (the backend's ``prefill_piece``: the kernels of ``prefill``).
        The pieces never depend on what else joins in the step, so the KV a prompt gets, and a
        greedy answer, are the same at every concurrency (a piece that does not fit what is
        left of the step's budget waits for the next step)."""
        todo = row.prompt_ids[:-1]
        fed = 0
        if row.features is not None:  # every prompt row's hidden state, in one forward
            if todo:
                row.features.append(self.engine._forward(row.state, todo, keep=1, features=True)[1])
            fed = row.prefilled = len(todo)
        elif budget is None or (row.prefilled == 0 and
                                (rest := len(todo) - self.target.cached_prefix(row.prompt_ids)) <= self.prefill_chunk):
            # a whole prompt: no chunking, or what it computes (past the prefix cache's share) fits a piece
            if budget is not None and rest > budget:
                return 0
            row.stats.cached_prompt_tokens = self.target.prefill(row.state, row.prompt_ids) or 0
            fed = len(todo) - row.stats.cached_prompt_tokens
            row.prefilled = len(todo)
        else:
            piece = todo[row.prefilled: row.prefilled + self.prefill_chunk]
            if len(piece) > budget:
                return 0
            self.target.prefill_piece(row.state, piece)
            fed = len(piece)
            row.prefilled += fed
            if row.prefilled >= len(todo):
                self.target.keep_prompt(row.state, todo)
        if row.prefilled >= len(todo):
            row.stats.prefill_s = self.engine._timer() - row.t_start
            self.states.join(row.state, row.prefilled)
            row.state, self._joining = None, None
            self._rows.append(row)
        return fed

    # -- one round --------------------------------------------------------------------------------
    def _round(self) -> list[BatchEvent]:
        rows, cm = self._rows, self.cost_model
        batched = self.states.batched and len(rows) > 1
        if batched and self._wants_costs and cm.batch is None:
            cm.batch = load_or_measure_batch(self.target, rows=batch_grid_rows(self.max_batch))
        plans = self.round.plan(rows, batch=cm if batched and cm.batch is not None else None,
                                shared=len(rows) if batched else 1, columns=self.states.columns if batched else 0)
        settled = self._verify_and_settle(plans, batched)
        events, done = [], []
        for r, (row, s) in enumerate(zip(rows, settled)):
            event = BatchEvent(row.id, s.emitted, round=s.record)
            if s.reason:
                event.finished, event.stop_reason = True, s.reason
                event.result = self._finish(row)
                done.append(r)
            events.append(event)
        self._rows = [row for r, row in enumerate(rows) if r not in set(done)]
        self.states.end_round(done)
        return events

    def _verify_and_settle(self, plans: list[RowPlan], batched: bool) -> list[Settled]:
        """Verify every row (one forward over all of them when ``batched``), then settle each."""
        rows, clock = self._rows, self.engine._timer
        if batched:
            t = clock()
            logits = self.states.forward([[row.tokens[-1], *p.draft.tokens] for row, p in zip(rows, plans)])
            outcomes = []
            for r, (row, plan) in enumerate(zip(rows, plans)):
                outcome = accept(row, plan, logits[r, : plan.width])
                self.states.keep(r, outcome.n + 1)
                outcomes.append(outcome)
            verify_s = clock() - t
            return [self.round.settle(row, plan, outcome, verify_s, len(rows))
                    for row, plan, outcome in zip(rows, plans, outcomes)]
        out = []
        for r, (row, plan) in enumerate(zip(rows, plans)):
            t = clock()
            outcome = self._verify_one(self.states.state(r), row, plan)
            out.append(self.round.settle(row, plan, outcome, clock() - t))
        return out

    def _verify_one(self, state: Any, row: Row, plan: RowPlan) -> Outcome:
        """One row's verify forward on its own state (chain or tree, with target features when
        its drafters read them), exact acceptance, and its state cut to the accepted tokens."""
        target, features = self.target, row.features is not None
        context = len(row.tokens)
        if plan.tree is not None:
            logits, hidden = target.forward_tree(state, row.tokens[-1], plan.tree, hidden=features)
            outcome, kept = accept_tree(row, plan, logits, hidden)
            target.keep_path(state, context - 1, kept)
            return outcome
        k = len(plan.draft.tokens)
        logits, hidden = self.engine._forward(state, [row.tokens[-1], *plan.draft.tokens], keep=k + 1,
                                              features=features)
        outcome = accept(row, plan, logits, hidden)
        if k > outcome.n:
            target.truncate(state, context + outcome.n)
        return outcome

    def _finish(self, row: Row) -> GenerationResult:
        self.round.finish(row)
        out = row.output
        return GenerationResult(self.engine.decode(out), out, row.prompt_ids, row.stats)

    def compact(self) -> None:
        """Gather every row's KV without holes now (padded batch states; a no-op elsewhere)."""
        self.states.compact()

    def row_kv(self, request: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The valid keys and values of a request's row, per layer ([heads, tokens, dim]): what a
        batch-1 cache of its tokens would hold (tests, debugging; padded batch states)."""
        return self.states.row_kv(self.active.index(request))


# -- the batch cost surface ---------------------------------------------------------------------
def load_or_measure_batch(target: LoadedModel, progress: Callable[[int, int], None] | None = None,
                          **grid: Any) -> BatchCosts:
    """The target's batch verify-cost surface, measured once and cached (``costs.BatchCosts``;
    ``grid``: ``rows``, ``widths``, ``contexts`` other than the defaults; ``progress(done,
    total)`` after each cache length and row count measured)."""
    measure = measure_batch_costs if isinstance(target, LoadedModel) else measure_row_costs
    return load_or_measure_batch_costs(target, measure, progress=progress, **grid)


@torch.inference_mode()
def measure_batch_costs(target: LoadedModel, rows: Sequence[int], widths: Sequence[int],
                        contexts: Sequence[int], repeats: int = 2, warmup: int = 1,
                        progress: Callable[[int, int], None] | None = None) -> BatchCosts:
    """Median seconds of the batched verify forward (padded cache, 4D mask, as the batch engine
    runs it) over ``rows`` x ``widths`` at each cache length of ``contexts``."""
    from statistics import median

    t_start = time.perf_counter()
    gen = torch.Generator().manual_seed(0)
    vocab = target.vocab_size
    seconds = []
    if progress is not None:
        progress(0, len(contexts) * len(rows))
    for c in contexts:
        per_rows = []
        for b in rows:
            cache = target.new_state()
            prefix = torch.randint(0, vocab, (b, c), generator=gen)
            valid = torch.ones(b, c, dtype=torch.bool)
            forward_rows(target, cache, torch.zeros(b, 0, dtype=torch.bool), prefix.tolist())
            times: dict[int, list[float]] = {w: [] for w in widths}
            for rep in range(warmup + repeats):
                for w in widths:
                    ids = torch.randint(0, vocab, (b, w), generator=gen).tolist()
                    t0 = time.perf_counter()
                    forward_rows(target, cache, valid, ids)
                    dt = time.perf_counter() - t0
                    cache.crop(-w)
                    if rep >= warmup:
                        times[w].append(dt)
            per_rows.append([median(times[w]) for w in widths])
            target.release(cache)
            if progress is not None:
                progress(len(seconds) * len(rows) + len(per_rows), len(contexts) * len(rows))
        seconds.append(per_rows)
    return BatchCosts(list(contexts), list(rows), list(widths), seconds,
                      measure_s=time.perf_counter() - t_start)


@torch.inference_mode()
def measure_row_costs(target: Any, rows: Sequence[int], widths: Sequence[int], contexts: Sequence[int],
                      repeats: int = 2, warmup: int = 1,
                      progress: Callable[[int, int], None] | None = None) -> BatchCosts:
    """``measure_batch_costs`` through the target's own batched ``RowStates`` (``new_rows``:
    llama.cpp's sequences in one ``llama_batch``): median seconds of ``forward`` over ``rows``
    rows of ``widths`` tokens each on states of each cache length of ``contexts``, the inputs
    dropped after each (``keep`` nothing). Where every row at a length would not fit a shared
    KV cache (``context_window`` cells for all sequences, llama.cpp's unified cache), that row
    count is measured at the longest length that fits."""
    t_start = time.perf_counter()
    gen = torch.Generator().manual_seed(0)
    total = len(contexts) * len(rows)
    free = target.free_states()
    if free is not None and free < max(rows):
        raise ConfigError(f"measuring the batch cost grid needs {max(rows)} free KV states and this target has "
                          f"{free}: load it with more sequences (llama.cpp: n_seq_max, load_model(sequences=N)) "
                          "or batch fewer rows")
    seconds = []
    if progress is not None:
        progress(0, total)
    with target.request_scope():  # timed as requests run (llama.cpp: torch off its cores)
        for c in contexts:
            seconds.append(_row_costs_at(target, c, rows, widths, repeats, warmup, gen,
                                         lambda done: progress(len(seconds) * len(rows) + done, total)
                                         if progress is not None else None))
    return BatchCosts(list(contexts), list(rows), list(widths), seconds,
                      measure_s=time.perf_counter() - t_start)


def _row_costs_at(target: Any, c: int, rows: Sequence[int], widths: Sequence[int], repeats: int, warmup: int,
                  gen: torch.Generator, progress: Callable[[int], None]) -> list[list[float]]:
    """``measure_row_costs`` at cache length ``c``: per row count, the median seconds per width."""
    from statistics import median

    vocab, window, widest = target.vocab_size, target.context_window, max(widths)
    per_rows = []
    for b in rows:
        length = c if window is None else max(1, min(c, window // b - widest))
        states = target.new_rows()
        try:
            for _ in range(b):
                state = target.new_state()
                target.forward(state, torch.randint(0, vocab, (length,), generator=gen).tolist(), keep=1)
                states.join(state, length)
            times: dict[int, list[float]] = {w: [] for w in widths}
            for rep in range(warmup + repeats):
                for w in widths:
                    ids = torch.randint(0, vocab, (b, w), generator=gen).tolist()
                    t0 = time.perf_counter()
                    states.forward(ids)
                    dt = time.perf_counter() - t0
                    states.end_round()  # nothing kept: back to ``length`` tokens a row
                    if rep >= warmup:
                        times[w].append(dt)
        finally:
            states.release()
        per_rows.append([median(times[w]) for w in widths])
        progress(len(per_rows))
    return per_rows
