"""Continuous batching: the active requests speculate together, one target forward per round.

Each request keeps what is its own (forked drafters, its own selector and length policy, its
``torch.Generator``, tokens, stops and statistics) and chooses its drafter and block (0: a plain
step) as in ``SpeculativeEngine``, except that ``auto`` rows choose the batch's width together
(``BatchEngine._joint_plans``); one padded forward verifies every row's ``[last] + drafts``
and each row is accepted exactly (``verify_greedy`` / ``verify_sampling``) on its own logits.

KV layout (chosen by measuring, ``scripts/batch_cache_layout.py``, docs/architecture.md): one
padded batch ``DynamicCache`` whose columns are per-row slots. A round appends W = max row width
columns to every row; a row's padding and rejected columns become *holes* that a per-row
``valid`` vector masks out of later rounds (4D mask), and positions come from each row's true
length, so holes cost attention width but never a copy. Trailing columns that are holes in
every row are cropped after each round; the cache is compacted (valid columns gathered per row,
left-padded) when holes grow past ``compact_fraction`` of the longest row. A new request is
prefilled on its own batch-1 cache, at most ``prefill_chunk`` tokens per ``step()``, then merged
(left-padded with holes); a finished or cancelled row leaves at once (``index_select``). The
alternative, per-request caches stacked into a batch each round, copies every cache every round
(HF's ``DynamicCache`` already copies once per forward), which measured slower even against
30% holes (SmolLM2, 256 tokens per row, 4 tokens per row and round: 4 rows 642 vs 595 ms, 16
rows 2662 vs 1648 ms on a loaded machine; a compaction cost about a fifth of a round).
"""

from __future__ import annotations

import copy
import secrets
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .config import GenerationConfig
from .costs import BatchCosts, batch_grid_rows
from .drafters import Draft, Drafter, DraftStep, Decision
from .drafters.indexed import share_indexes
from .engine import GenerationResult
from .errors import AdaspecError, ConfigError
from .feedback import RoundFeedback
from .metrics import RequestStats, RoundRecord
from .models import TREE_ATTENTION, LoadedModel
from .sampling import process_logits, verify_greedy, verify_sampling

#: prompt tokens a joining request prefills per ``step()`` (bounds the others' stall)
DEFAULT_PREFILL_CHUNK = 256
#: compact the cache when its hole columns exceed this fraction of the longest row
DEFAULT_COMPACT_FRACTION = 0.25
#: widest block ``_drafting_can_pay`` considers (auto's longest draft, 16, plus the last token)
MAX_WIDTH = 17
#: ``_RowPlan.drafter`` of a plain step that no policy planned
PLAIN = -1


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


@dataclass(eq=False)
class _Request:
    """Per-request state: an engine view with its own drafters and policies, its tokens,
    budget, generator and statistics; ``prefill`` is its batch-1 cache while it joins."""

    id: int
    view: Any  # SpeculativeEngine view (own drafters, selector, length)
    prompt_ids: list[int]
    cfg: GenerationConfig
    generator: torch.Generator | None
    stats: RequestStats
    t_start: float
    tokens: list[int] = field(default_factory=list)
    remaining: int = 0
    stop_max: int = 0
    seen: list[int] = field(default_factory=list)
    prefill: Any = None
    prefilled: int = 0  # prompt tokens (of all but the last) in ``prefill``
    started: bool = False

    @property
    def cost_aware(self) -> bool:
        """Do the request's policies price rounds (then they never draft where it cannot pay)?"""
        return self.view.prices_rounds


@dataclass
class _Look:
    """A row's looks this round (``BatchEngine._look``): the blocks shown to its selector."""

    peeked: dict
    looked: bool
    timed: bool  # the selector may skip looks: their seconds feed ``CostModel.observe_look``
    seconds: float
    ingest: float = 0.0  # prompt ingestion by drafters looked at for the first time this request


@dataclass
class _RowPlan:
    """One row's choice for the round: drafter, cap, draft and timings."""

    drafter: int
    cap: int
    draft: Draft
    catch_up_tokens: int
    t: tuple[float, float, float, float, float]  # round start, selected, prefill done, caught up, drafted
    policy_in_draft: float
    ingest: float = 0.0  # the look's prompt ingestion (``_Look.ingest``)


def batching_problem(engine: Any, drafters: bool = True) -> str | None:
    """Why ``engine`` cannot decode requests in a batch (a message naming the fix), or None:
    the target, its attention, trees and (``drafters``) every loaded drafter are checked."""
    if not isinstance(engine.target, LoadedModel):
        return (f"batched decoding runs on the transformers backend, and this engine's target is on "
                f"{engine.target.backend!r}: load the model with backend='transformers'")
    if engine.tree:
        return "batched rounds verify chains: build the engine with tree=False"
    impl = getattr(engine.target.model.config, "_attn_implementation", None)
    if impl not in TREE_ATTENTION:
        return (f"batched rounds need an attention implementation that takes a custom 4D mask "
                f"({', '.join(TREE_ATTENTION)}), and this model uses {impl!r}: load it with "
                "attn_implementation='sdpa'")
    for d in engine.drafters if drafters else ():
        if type(d).fork is Drafter.fork or getattr(d, "uses_target_features", False):
            return (f"drafter {d.name!r} cannot draft for several requests at once: batch with the "
                    "model-free drafters (none, prompt-lookup, suffix, recycle)")
    return None


def _pool_hint(engine: Any) -> str:
    """The fix when the unbatchable drafters came with the engine's default (a built pool)."""
    if getattr(engine, "default_pool", None):
        return " (the engine's default drafters include a built pool's heads: SpeculativeEngine(..., pool=False))"
    return ""


class BatchEngine:
    """Continuous batching over a ``SpeculativeEngine`` (transformers targets).

    ``add(prompt, config)`` queues a request and returns its id; ``step()`` admits waiting
    requests (at most ``prefill_chunk`` prompt tokens per step), runs one batched round for every active row and
    returns the ``BatchEvent``s; ``cancel(id)`` drops a request at once. Requests may use the
    engine's drafters (forked per request: ``Drafter.fork``) and policies (copied per request;
    ``auto``'s global counts stay shared, as across the engine's sequential requests) or their
    own (``drafters`` indices, ``selector``, ``length``, ``k``, as ``with_policies``).

    Args:
        engine: the engine whose target, drafters and cost model are used.
        max_batch: most rows verified together (more requests wait in a queue).
        prefill_chunk: most prompt tokens prefilled per ``step()`` (a long prompt over several
            steps, several short ones in one).
        compact_fraction: compact the cache when holes exceed this fraction of the longest row.
        batch_costs: the batch verify-cost surface for per-row pricing (``BatchCosts``); None:
            measured (and cached on disk) when the policies price rounds, else unused.
    """

    def __init__(self, engine: Any, *, max_batch: int = 8, prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
                 compact_fraction: float = DEFAULT_COMPACT_FRACTION, batch_costs: BatchCosts | None = None):
        problem = batching_problem(engine, drafters=False)
        if problem:
            raise ConfigError(problem)
        for name, v, lo in (("max_batch", max_batch, 1), ("prefill_chunk", prefill_chunk, 1)):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ConfigError(f"{name} must be an integer >= {lo}, got {v!r}")
        if not 0.0 < compact_fraction:
            raise ConfigError(f"compact_fraction must be > 0, got {compact_fraction!r}: e.g. 0.25")
        self.engine, self.target = engine, engine.target
        self.max_batch, self.prefill_chunk, self.compact_fraction = max_batch, prefill_chunk, compact_fraction
        # one cost model for the batch's policies: the engine's running means, priced per batch
        self.cost_model = copy.copy(engine.cost_model)
        self._wants_costs = engine.prices_rounds
        self.cost_model.batch = batch_costs
        ctl = getattr(engine.selector, "controller", None)  # auto: global counts exist before forking
        if ctl is not None and list(getattr(ctl, "names", [])) != engine.drafter_names:
            engine.selector.begin_request(engine.drafter_names)
        self._eos = engine.eos_ids()
        self._pad = 0
        self._next_id = 0
        self._waiting: deque[_Request] = deque()
        self._joining: _Request | None = None
        self._rows: list[_Request] = []
        self._cache: Any = None
        self._valid = torch.zeros(0, 0, dtype=torch.bool)
        self.compactions = 0

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
        view = copy.copy(engine)
        view.cost_model = self.cost_model  # the batch's; a row with its own drafters sees it through them
        if drafters is None and selector is None and length is None:
            view.selector, view.length = self._fork_policies()
        else:
            view = view.with_policies(drafters, selector=selector, length=length, k=k)
            self._wants_costs |= view.prices_rounds
        try:
            view.drafters = [d.fork() for d in view.drafters]
            share_indexes(view.drafters)  # the row's n-gram drafters: one index, as the engine's
        except AdaspecError as exc:
            raise ConfigError(f"batched decoding needs a drafter per request: {exc}{_pool_hint(engine)}") from None
        if any(getattr(d, "uses_target_features", False) for d in view.drafters):
            raise ConfigError("feature drafters (EAGLE-style heads) are not batched yet: use model-free drafters "
                              f"(none, prompt-lookup, suffix, recycle) with the batch engine{_pool_hint(engine)}")
        seed = cfg.sampling.seed if cfg.sampling.seed is not None else secrets.randbits(62)
        gen = None if cfg.sampling.greedy else torch.Generator(device=self.target.device).manual_seed(seed)
        stats = RequestStats(prompt_tokens=len(prompt_ids), seed=None if cfg.sampling.greedy else seed)
        req = _Request(self._next_id, view, prompt_ids, cfg, gen, stats, time.perf_counter(),
                       tokens=list(prompt_ids), remaining=cfg.max_new_tokens,
                       stop_max=max((len(s.encode("utf-8")) for s in cfg.stop), default=0),
                       seen=[0] * len(view.drafters))
        self._next_id += 1
        self._waiting.append(req)
        return req.id

    @torch.inference_mode()
    def cancel(self, request: int) -> bool:
        """Drop a request wherever it is (queued, prefilling, decoding); its row is freed at once.
        Returns whether it was found."""
        for req in list(self._waiting):
            if req.id == request:
                self._waiting.remove(req)
                return True
        if self._joining is not None and self._joining.id == request:
            self.target.release(self._joining.prefill)
            self._joining = None
            return True
        for i, req in enumerate(self._rows):
            if req.id == request:
                req.stats.stop_reason = "cancelled"
                self._finish(req)
                self._drop_rows([i])
                return True
        return False

    @torch.inference_mode()
    def step(self) -> list[BatchEvent]:
        """Admit (at most ``prefill_chunk`` prompt tokens of prefill: one chunk of a long prompt,
        or several short prompts), then one batched round for every active row."""
        budget = self.prefill_chunk
        while budget > 0:
            if self._joining is None:
                if not self._waiting or len(self._rows) >= self.max_batch:
                    break
                self._joining = self._waiting.popleft()
                self._joining.prefill = self.target.new_state()
                self._joining.t_start = time.perf_counter()  # stats time it from here (queueing apart)
            budget -= self._prefill_chunk(self._joining, budget)
            if self._joining is not None:  # the budget ran out inside its prompt
                break
        return self._round() if self._rows else []

    # -- prefill and joining -------------------------------------------------------------------
    def _prefill_chunk(self, req: _Request, budget: int) -> int:
        """Feed up to ``budget`` more tokens of the prompt (all but its last token); merge the
        request as a row when its prompt is in. Returns the tokens fed."""
        todo = req.prompt_ids[:-1]
        chunk = todo[req.prefilled: req.prefilled + budget]
        if chunk:
            self.target.forward(req.prefill, chunk, keep=1)
            req.prefilled += len(chunk)
        if req.prefilled >= len(todo):
            req.stats.prefill_s = time.perf_counter() - req.t_start
            self._merge(req.prefill, req.prefilled)
            req.prefill, self._joining = None, None
            self._rows.append(req)
        return len(chunk)

    def _merge(self, single: Any, length: int) -> None:
        """Append a batch-1 cache of ``length`` tokens as a new row (left-padded with holes)."""
        b = len(self._rows)
        t = self._valid.shape[1] if b else 0
        width = max(t, length)
        row_valid = torch.zeros(1, width, dtype=torch.bool)
        row_valid[0, width - length:] = True
        if b == 0:
            self._cache, self._valid = single, row_valid
            return
        for mine, theirs in zip(self._cache.layers, single.layers):
            if theirs.get_seq_length() == 0 and mine.get_seq_length() == 0:
                continue
            ref = mine if mine.get_seq_length() else theirs
            mk, mv = _kv(mine, b, t, ref)
            tk, tv = _kv(theirs, 1, length, ref)
            if not mine.is_initialized:
                mine.lazy_initialization(ref.keys, ref.values)
            mine.keys = torch.cat([_left_pad(mk, width), _left_pad(tk, width)], 0)
            mine.values = torch.cat([_left_pad(mv, width), _left_pad(tv, width)], 0)
        self._valid = torch.cat([_left_pad(self._valid, width), row_valid], 0)
        self.target.release(single)

    # -- the cache -------------------------------------------------------------------------------
    def _drop_rows(self, rows: Sequence[int]) -> None:
        keep = [i for i in range(len(self._rows)) if i not in set(rows)]
        self._rows = [self._rows[i] for i in keep]
        if not keep:
            self._cache, self._valid = None, torch.zeros(0, 0, dtype=torch.bool)
            return
        idx = torch.tensor(keep)
        self._cache.batch_select_indices(idx.to(self.target.device))
        self._valid = self._valid[idx]
        self._maybe_compact()

    def _maybe_compact(self) -> None:
        """Gather each row's valid columns (left-padded) when holes are worth a copy."""
        lengths = self._valid.sum(1)
        longest = int(lengths.max()) if len(lengths) else 0
        t = self._valid.shape[1]
        if t - longest <= max(8, self.compact_fraction * longest):
            return
        self.compact()

    @torch.inference_mode()
    def compact(self) -> None:
        """Move every row's valid columns to the right end of ``max length`` columns."""
        lengths = self._valid.sum(1)
        width = int(lengths.max())
        # per row: the sorted indices of its valid columns, right-aligned; holes gather column 0
        order = torch.sort((~self._valid).to(torch.int8), dim=1, stable=True).indices  # valid first
        idx = torch.zeros(len(lengths), width, dtype=torch.long)
        new_valid = torch.zeros(len(lengths), width, dtype=torch.bool)
        for r, n in enumerate(lengths.tolist()):
            idx[r, width - n:] = order[r, :n]
            new_valid[r, width - n:] = True
        dev_idx = idx.to(self.target.device)
        for layer in self._cache.layers:
            if layer.get_seq_length() == 0:
                continue
            g = dev_idx[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[-1])
            layer.keys = layer.keys.gather(2, g)
            layer.values = layer.values.gather(2, g)
        self._valid = new_valid
        self.compactions += 1

    def row_kv(self, request: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The valid keys and values of a request's row, per layer ([heads, tokens, dim]): what a
        batch-1 cache of its tokens would hold (tests, debugging)."""
        r = self.active.index(request)
        cols = self._valid[r].nonzero().flatten().to(self.target.device)
        return [(layer.keys[r].index_select(1, cols), layer.values[r].index_select(1, cols))
                for layer in self._cache.layers]

    # -- one round --------------------------------------------------------------------------------
    @staticmethod
    def _start(req: _Request) -> None:
        """The request's first round: its drafters and policies begin (as in ``_rounds``)."""
        if req.started:
            return
        req.view._begin_request(req.prompt_ids)
        req.started = True

    def _drafting_can_pay(self) -> bool:
        """Could any block pay in this batch if every drafted token were accepted: w tokens for
        o + price(w) against one for o + price(1), w up to ``MAX_WIDTH``, on the batch price
        (``CostModel.verify_cost``) with the round overhead o? When not, no cost-aware policy
        drafts, so their rows take plain steps without planning (whose per-row Python work, the
        looks and the policies, measured 3-4% of a compute-bound round at 8-32 rows).

        This is one row's best case at its row price, stricter than the joint width's (every
        row drafting and accepted: R w tokens for R o + V(R, w)). With the joint best case as
        the rule, SmolLM2's rows looked and planned at 8 and 16 rows and the batch ran 0.97x
        and 0.95x as fast (the width paid in 10 of 127 forwards at 8 rows, never at 16;
        ``scripts/batch_joint_ab.py``)."""
        cm = self.cost_model
        if cm.batch is None or cm.rows <= 1:
            return True
        o = cm.round_overhead_s
        plain = o + cm.verify_cost(1)
        return any(w * plain > o + cm.verify_cost(w) for w in range(2, MAX_WIDTH + 1))

    def _plain(self, req: _Request) -> _RowPlan:
        """A plain step without asking the row's policies (drafting cannot pay in this batch)."""
        self._start(req)
        t = time.perf_counter()
        return _RowPlan(PLAIN, 0, Draft(), 0, (t, t, t, t, t), 0.0)

    def _look(self, req: _Request) -> _Look:
        """The row's looks at its model-free drafters' blocks (``Drafter.peek``), shown to its
        selector: the first part of ``_plan``."""
        view, tokens, selector = req.view, req.tokens, req.view.selector
        self._start(req)
        t0 = time.perf_counter()
        self.cost_model.context = len(tokens) - 1
        peek_k = int(getattr(selector, "peek_tokens", 0) or 0)
        looks = getattr(selector, "looks", None)
        peeked = {}
        ingest = 0.0
        looked = bool(peek_k) and (looks is None or looks())
        if looked:
            peeked, ingest = view._peek(tokens, min(peek_k, req.remaining - 1), req.seen, len(req.prompt_ids))
            selector.observe_proposals(peeked)
        return _Look(peeked, looked, looks is not None, time.perf_counter() - t0, ingest)

    def _plan(self, req: _Request, look: _Look | None = None) -> _RowPlan:
        """The row's drafter choice, catch-up and draft (as in ``SpeculativeEngine._rounds``),
        after its ``look`` (taken here if not given)."""
        view, tokens = req.view, req.tokens
        selector, length, drafters = view.selector, view.length, view.drafters
        now = time.perf_counter
        if look is None:
            look = self._look(req)
        t0 = now() - look.seconds
        self.cost_model.context = len(tokens) - 1
        peeked, looked = look.peeked, look.looked
        i = selector.select()
        if not 0 <= i < len(drafters):
            raise ConfigError(f"selector {selector.name!r} chose drafter #{i} of {len(drafters)}")
        cap = min(length.begin_round(i), req.remaining - 1)
        t1 = now()
        if looked and look.timed and req.stats.rounds:  # the first look also ingests the prompt
            self.cost_model.observe_look(t1 - t0)
        drafter: Drafter = drafters[i]
        view._ingest_prompt(i, tokens, len(req.prompt_ids), req.seen)
        t_pre = now()
        catch_up_tokens = len(tokens) - req.seen[i]
        if catch_up_tokens:
            drafter.catch_up(tokens)
        t2 = now()
        spent = [0.0]

        def decide(step: DraftStep) -> Decision:
            t = time.perf_counter()
            verdict = length.decide(step)
            spent[0] += time.perf_counter() - t
            return verdict

        draft = view._draft_chain(i, tokens, cap, peeked, req.cfg.sampling, req.generator, decide)
        return _RowPlan(i, cap, draft, catch_up_tokens, (t0, t1, t_pre, t2, now()), spent[0], look.ingest)

    def _joint_plans(self) -> list[_RowPlan]:
        """Every row's plan, the batch's width chosen jointly for the rows that can (``auto``
        with free blocks: ``AutoController.block_curve``).

        A padded forward is as wide as its widest row, so a row priced alone pays the whole
        widening and declines (SmolLM2, 4 rows: 45 / 54 / 65 ms at width 1 / 2 / 4, one row's
        4-token block priced at 3.4x its plain step: no row drafted), while a row priced at its
        1/R share over-drafts (0.60x batched AR at 16 rows).
        The batch instead picks the width W that maximises its expected tokens per second,

            sum_r E_r(W - 1) / (R o + V(R, W)),

        E_r(k) the row's expected emitted tokens at cap k (its best drafter's), V the batch
        surface (``BatchCosts.cost``), o the per-row round overhead; W is at least the other
        rows' widest block, and every joint row then drafts up to W - 1 tokens (free: the forward
        is that wide anyway)."""
        rows, cm = self._rows, self.cost_model
        joint: dict[int, tuple[_Look, list[tuple[float, int, int]]]] = {}
        if len(rows) > 1 and cm.batch is not None:
            for r, req in enumerate(rows):
                sel, length = req.view.selector, req.view.length
                if not (hasattr(sel, "block_curve") and getattr(length, "controller", None) is not None
                        and length.controller is getattr(sel, "controller", None)):
                    continue
                look = self._look(req)
                joint[r] = (look, sel.block_curve() or [])  # no curve: planned on its own below
        plans: dict[int, _RowPlan] = {}
        for r, req in enumerate(rows):
            if r not in joint or not joint[r][1]:
                plans[r] = self._plan(req, joint[r][0] if r in joint else None)
        curves = {r: c for r, (_, c) in joint.items() if c}
        if curves:
            least = max((len(p.draft.tokens) + 1 for p in plans.values()), default=1)
            ctx = cm.batch_context
            width = joint_width([[e for e, _, _ in c] for c in curves.values()], len(rows), least,
                                cm.round_overhead_s, lambda w: cm.batch.cost(len(rows), w, ctx))
            for r in curves:
                rows[r].view.selector.commit(width - 1)
                plans[r] = self._plan(rows[r], joint[r][0])
        return [plans[r] for r in range(len(rows))]

    def _forward(self, inputs: list[list[int]]) -> torch.Tensor:
        """One padded forward over every row's inputs: logits [rows, W, vocab]."""
        logits = forward_rows(self.target, self._cache, self._valid, inputs, self._pad)
        self._valid = torch.cat([self._valid, torch.zeros(len(inputs), logits.shape[1], dtype=torch.bool)], 1)
        return logits

    def _round(self) -> list[BatchEvent]:
        rows = len(self._rows)
        self.cost_model.rows = rows
        self.cost_model.batch_context = self._valid.shape[1]
        if self._wants_costs and rows > 1 and self.cost_model.batch is None:
            self.cost_model.batch = load_or_measure_batch(self.target, rows=batch_grid_rows(self.max_batch))
        plain = not self._drafting_can_pay()
        if plain:
            plans = [self._plain(req) if req.cost_aware else self._plan(req) for req in self._rows]
        else:
            plans = self._joint_plans()
        t_fwd = time.perf_counter()
        t_before = self._valid.shape[1]
        logits = self._forward([[req.tokens[-1], *p.draft.tokens] for req, p in zip(self._rows, plans)])
        verdicts = []
        for r, (req, plan) in enumerate(zip(self._rows, plans)):
            k, sampling = len(plan.draft.tokens), req.cfg.sampling
            row = logits[r, : k + 1]
            if sampling.greedy:
                v = verify_greedy(row, plan.draft.tokens)
            else:
                v = verify_sampling(process_logits(row, sampling), plan.draft.tokens, plan.draft.probs,
                                    req.generator)
            self._valid[r, t_before: t_before + v.n_accepted + 1] = True
            verdicts.append(v)
        kept = t_before + max(v.n_accepted + 1 for v in verdicts)
        self._crop(kept)
        verify_s = time.perf_counter() - t_fwd
        events, done = [], []
        for r, (req, plan, v) in enumerate(zip(self._rows, plans, verdicts)):
            ev = self._account(req, plan, v, logits[r, : len(plan.draft.tokens) + 1], verify_s, rows)
            events.append(ev)
            if ev.finished:
                done.append(r)
        if done:
            self._drop_rows(done)
        else:
            self._maybe_compact()
        self.cost_model.rows = 1
        return events

    def _crop(self, columns: int) -> None:
        drop = self._valid.shape[1] - columns
        if drop > 0:
            self._cache.crop(-drop)
            self._valid = self._valid[:, :columns]

    def _account(self, req: _Request, plan: _RowPlan, verdict: Any, logits: torch.Tensor,
                 verify_s: float, rows: int) -> BatchEvent:
        """Stops, tokens, feedback to the row's policies, its round record and event."""
        view, now = req.view, time.perf_counter
        n, draft, i = verdict.n_accepted, plan.draft, plan.drafter
        # as ``SpeculativeEngine._rounds``: the verified rows go to the drafters that learn from
        # them after the round's scoring
        observers = [d for d in view.drafters if d.observes_target]
        fed = [req.tokens[-1], *draft.tokens] if observers else None
        emitted, reason = view._apply_stops([*draft.tokens[:n], verdict.next_token], req.tokens,
                                            len(req.prompt_ids), req.remaining, req.cfg, req.stop_max,
                                            self._eos)
        context_len = len(req.tokens)
        req.tokens.extend(emitted)
        req.remaining -= len(emitted)
        if i == PLAIN:  # not planned (drafting could not pay): no policy or drafter saw the round
            for d in observers:
                d.observe_target(fed, logits)
            return self._event(req, RoundRecord(
                drafter="none", k_cap=0, drafted=0, accepted=0, emitted=len(emitted), draft_s=0.0,
                verify_s=verify_s, catch_up_s=0.0, catch_up_tokens=0, policy_s=0.0, eval_s=0.0,
                total_s=verify_s, drafter_prefill_s=0.0), emitted, reason)
        req.seen[i] = len(req.tokens)
        t0, t_sel, t_pre, t_caught, t_drafted = plan.t
        draft_s = t_drafted - t_caught - plan.policy_in_draft
        catch_up_s = t_caught - t_pre
        share = verify_s / rows
        fb = RoundFeedback(round=len(req.stats.rounds), drafter=i, draft=draft, n_accepted=n,
                           emitted=emitted, k_cap=plan.cap, target_logits=logits, sampling=req.cfg.sampling,
                           draft_s=draft_s, verify_s=share, catch_up_s=catch_up_s,
                           catch_up_tokens=plan.catch_up_tokens)
        t5 = now()
        selector, length = view.selector, view.length
        eval_ingest = 0.0
        if selector.full_information and (len(view.drafters) > 1 or plan.cap == 0):
            fb.counterfactual, eval_ingest = view._evaluate_others(
                i, req.tokens[:context_len], emitted, logits, fb, req.cfg.sampling, score_chosen=plan.cap == 0,
                seen=req.seen, n_prompt=len(req.prompt_ids))
            for j in fb.counterfactual:
                req.seen[j] = len(req.tokens)
        t6 = now()
        for d in observers:
            d.observe_target(fed, logits)
        t6o = now()
        view.cost_model.observe(i, len(draft.tokens), draft_s, share, plan.catch_up_tokens, catch_up_s)
        selector.update(fb)
        length.update(fb)
        t7 = now()
        own = (t_drafted - t0) + (t7 - t5)
        # as the engine's: neither prompt ingestion (once per request) nor scoring is the rounds' own overhead
        self.cost_model.observe_overhead(own - draft_s - catch_up_s - (t_pre - t_sel) - plan.ingest - (t6 - t5))
        record = RoundRecord(drafter=view.drafters[i].name, k_cap=plan.cap, drafted=len(draft.tokens),
                             accepted=n, emitted=len(emitted), draft_s=draft_s + draft.look_s,
                             verify_s=verify_s, catch_up_s=catch_up_s, catch_up_tokens=plan.catch_up_tokens,
                             policy_s=(t_sel - t0) + plan.policy_in_draft + (t7 - t6o) - plan.ingest - draft.look_s,
                             eval_s=t6 - t5 - eval_ingest, total_s=own + verify_s,
                             drafter_prefill_s=(t_pre - t_sel) + plan.ingest + eval_ingest)
        return self._event(req, record, emitted, reason)

    def _event(self, req: _Request, record: RoundRecord, emitted: list[int], reason: str) -> BatchEvent:
        """Record the round; the request's event (with its result when it finished)."""
        req.stats.rounds.append(record)
        event = BatchEvent(req.id, emitted, round=record)
        if reason:
            req.stats.stop_reason = reason
            event.finished, event.stop_reason = True, reason
            event.result = self._finish(req)
        return event

    def _finish(self, req: _Request) -> GenerationResult:
        n_prompt = len(req.prompt_ids)
        req.stats.new_tokens = len(req.tokens) - n_prompt
        req.stats.total_s = time.perf_counter() - req.t_start
        if req.started:
            for d in req.view.drafters:
                d.end_request(req.tokens[n_prompt:])
        out = req.tokens[n_prompt:]
        return GenerationResult(req.view.decode(out), out, req.prompt_ids, req.stats)

    def _fork_policies(self) -> tuple[Any, Any]:
        """Per-request copies of the engine's selector and length policy that price rounds with
        this batch's cost model and share ``auto``'s global counts (scope=global) with the
        engine: learnt across requests, as in sequential serving; the rest is per request."""
        engine = self.engine
        memo: dict[int, Any] = {id(engine.cost_model): self.cost_model}
        for p in (engine.selector, engine.length):
            ctl = getattr(p, "controller", None)
            if ctl is not None and getattr(ctl, "scope", "") == "global":
                for attr in ("global_counts", "global_ctx", "global_clock"):
                    shared = getattr(ctl, attr, None)
                    if shared is not None:
                        memo[id(shared)] = shared
        return copy.deepcopy((engine.selector, engine.length), memo)

    def run(self) -> dict[int, GenerationResult]:
        """Step until every request is done; results by request id."""
        out: dict[int, GenerationResult] = {}
        while len(self):
            for ev in self.step():
                if ev.finished:
                    out[ev.request] = ev.result
        return out


# -- the padded forward ------------------------------------------------------------------------
def joint_width(curves: Sequence[Sequence[float]], rows: int, least: int, overhead: float,
                cost: Callable[[int], float]) -> int:
    """The batch width W >= ``least`` with the most expected tokens per second,
    sum_r E_r(W - 1) / (rows o + V(W)) (``BatchEngine._joint_plans``): ``curves[r][k]`` is a
    joint row's expected emitted tokens at cap k (flat past its end), each of the other rows
    counts one token, ``cost(W)`` is the batch forward's seconds. Ties go to the narrower."""
    top = max((len(c) for c in curves), default=1)
    best_w, best_rate = least, -1.0
    for w in range(least, max(least, top) + 1):
        tokens = sum(c[min(w - 1, len(c) - 1)] for c in curves) + (rows - len(curves))
        rate = tokens / max(rows * overhead + cost(w), 1e-12)
        if rate > best_rate:
            best_w, best_rate = w, rate
    return best_w


def batch_attention_mask(valid: torch.Tensor, widths: Sequence[int], width: int, dtype: torch.dtype,
                         device: torch.device | str = "cpu") -> torch.Tensor:
    """Additive float mask [rows, 1, W, T + W] for a forward of ``width`` new columns per row on
    a cache of ``T`` columns: query j < widths[r] sees the row's valid columns and new columns
    0..j; a padding query (j >= widths[r]) sees only itself (a row with nothing to attend to
    would give NaN under SDPA)."""
    rows, t = valid.shape
    j = torch.arange(width)
    real = j[None, :] < torch.tensor(list(widths))[:, None]  # [rows, W]
    allowed = torch.zeros(rows, width, t + width, dtype=torch.bool)
    allowed[:, :, :t] = valid[:, None, :] & real[:, :, None]
    causal = j[None, :] <= j[:, None]  # [W, W]: key i <= query j
    allowed[:, :, t:] = (causal[None] & real[:, :, None]) | (torch.eye(width, dtype=torch.bool)[None] & ~real[:, :, None])
    mask = torch.zeros(rows, width, t + width, dtype=dtype)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask.to(device)[:, None]


@torch.inference_mode()
def forward_rows(target: LoadedModel, cache: Any, valid: torch.Tensor, inputs: Sequence[Sequence[int]],
                 pad: int = 0) -> torch.Tensor:
    """One forward of every row's ``inputs`` (padded to the widest) on the padded batch cache:
    positions continue each row's true length (its valid columns); logits [rows, W, vocab]. A
    lone row without holes (concurrency 1) takes the engine's own forward, mask-free."""
    if len(inputs) == 1 and bool(valid.all()):  # one row without holes: the batch-1 forward
        return target.forward(cache, inputs[0], keep=len(inputs[0]))[0][None].float()
    device = target.device
    widths = [len(x) for x in inputs]
    width = max(widths)
    ids = torch.full((len(inputs), width), pad, dtype=torch.long)
    for r, x in enumerate(inputs):
        ids[r, : len(x)] = torch.tensor(list(x), dtype=torch.long)
    pos = valid.sum(1, keepdim=True) + torch.arange(width)[None, :]
    mask = batch_attention_mask(valid, widths, width, target.dtype, device)
    out = target.model(input_ids=ids.to(device), attention_mask=mask, position_ids=pos.to(device),
                       **{target.cache_kw: cache}, use_cache=True)
    return out.logits.float()


def _kv(layer: Any, rows: int, length: int, ref: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's keys and values, or empty ones shaped like ``ref``'s (an unused cache)."""
    if layer.get_seq_length() > 0:
        return layer.keys, layer.values
    shape = (rows, ref.keys.shape[1], length, ref.keys.shape[-1])
    z = torch.zeros(shape, dtype=ref.keys.dtype, device=ref.keys.device)
    return z, z.clone()


def _left_pad(x: torch.Tensor, width: int) -> torch.Tensor:
    """Pad the column axis (dim 2 of KV, dim 1 of a valid mask) on the left to ``width``."""
    dim = 2 if x.dim() == 4 else 1
    missing = width - x.shape[dim]
    if missing <= 0:
        return x
    shape = list(x.shape)
    shape[dim] = missing
    return torch.cat([torch.zeros(shape, dtype=x.dtype, device=x.device), x], dim)


def load_or_measure_batch(target: LoadedModel, progress: Callable[[int, int], None] | None = None,
                          **grid: Any) -> BatchCosts:
    """The target's batch verify-cost surface, measured once and cached (``costs.BatchCosts``;
    ``grid``: ``rows``, ``widths``, ``contexts`` other than the defaults; ``progress(done,
    total)`` after each cache length and row count measured)."""
    from .costs import load_or_measure_batch_costs

    return load_or_measure_batch_costs(target, measure_batch_costs, progress=progress, **grid)


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
