"""The speculative round, written once, over rows.

A *row* is one request in flight (``Row``: its tokens, budget, generator, statistics and its
parts: drafters, selector, length policy, cost model). Every path that decodes speculatively
drives the same ``Round``:

1. ``plan(rows)``: per row, the drafter policy looks at the cheap drafters' blocks (when it
   looks first), picks a drafter, which catches up on the tokens it has not seen (MetaSD's
   switching cost); the length policy caps the block and rules on each drafted token
   (continue, stop, discard); a drafter that drafts trees offers its best-first tree, cut
   where its nodes stop paying on the verify-cost surface. Several rows that price their
   rounds on a batch surface choose the batch's width together (``joint_width``);
2. the caller verifies every row's ``[last] + drafts`` in one target forward (a batch of one
   is the single-request case; ``backends.base.RowStates``) and hands each row's logits to
   ``accept`` (exact rejection sampling or greedy matching, ``sampling.py``; trees:
   ``accept_tree``), or supplies the outcome itself (replay's recorded target, a serving
   engine's realised acceptances);
3. ``settle(row, plan, outcome, ...)``: stops are cut exactly where plain decoding would have
   stopped, the accepted tokens join the row, the round's feedback (target and drafter
   distributions, accepted length, times and, for full-information learners, every other
   drafter's acceptance on the verified tokens: Not-a-Bandit 3.2) goes to both policies and
   the cost model, and the round is recorded (``metrics.RoundRecord``).

Time is read from one clock (``clock()``): ``perf_counter`` (after a CUDA synchronise) when
decoding, a priced virtual clock in replay, so that the same bookkeeping measures live rounds
and prices replayed ones. ``PhaseTimes`` holds a round's marks.

The output is the target's (greedy: token for token; sampling: in distribution).
"""

from __future__ import annotations

import copy
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import torch

from .config import GenerationConfig
from .costs import CostModel
from .drafters import Decision, Draft, Drafter, DraftStep
from .drafters.base import Peek, apply_decisions
from .drafters.feature_head import FeatureBuffer
from .errors import ConfigError
from .feedback import NO_CONTEXT, RoundContext, RoundFeedback, alphas_from_proposals, gammas_from_proposals
from .length import LengthPolicy
from .length.cost_rule import ConfidenceCalibration
from .metrics import RequestStats, RoundRecord
from .sampling import process_logits, verify_greedy, verify_sampling
from .selection import DrafterPolicy
from .trees import (DraftTree, PrefixCut, TreeVerdict, calibrated_scores, node_trials, nodes_worth_verifying,
                    tree_gammas, verify_tree_greedy, verify_tree_sampling)

#: ``RowPlan.drafter`` of a plain step no policy planned (drafting cannot pay in this batch)
PLAIN = -1
#: widest block ``drafting_can_pay`` considers (auto's longest draft, 16, plus the last token)
MAX_WIDTH = 17
#: plain rounds a batch takes, where no row's block pays at its row price, between two rounds it
#: plans jointly to see whether the rows' blocks pay together (``Round.plan``)
JOINT_PROBE_EVERY = 8
#: such a probe drafts, and the next round is planned jointly too, only where its expected rate
#: beats the plain batch's by this factor: a drafting batch pays for what the rate leaves out
#: (its rows' looks and policies, the holes rejected tokens leave in the padded cache: on
#: SmolLM2, 16 rows of distinct prompts, widths the rate priced at 1.0-1.1x ran at 0.6x)
JOINT_MARGIN = 1.25


class Clock:
    """``perf_counter`` that synchronises CUDA first, so GPU work is attributed correctly."""

    def __init__(self, device: torch.device | str = "cpu"):
        self._sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else None

    def __call__(self) -> float:
        if self._sync is not None:
            self._sync()
        return time.perf_counter()


@dataclass
class RowParts:
    """What drafts for a row: its drafters and policies, the cost model they price rounds on,
    and the tree settings (``SpeculativeEngine``'s; per request in a batch)."""

    drafters: list[Drafter]
    selector: DrafterPolicy
    length: LengthPolicy
    cost_model: CostModel
    tree: bool = False
    tree_nodes: int = 15
    tree_calibration: ConfidenceCalibration = field(default_factory=ConfidenceCalibration)

    @property
    def names(self) -> list[str]:
        return [d.name for d in self.drafters]

    @property
    def prices_rounds(self) -> bool:
        """Do the selector or the length policy price rounds on the cost model?"""
        return self.selector.caps.prices_rounds or self.length.caps.prices_rounds


@dataclass(eq=False)
class Row:
    """One request in flight: its parts, tokens (prompt + output), budget, stops, generator,
    statistics, which context length each drafter has seen, and the target's features for
    feature drafters. ``state`` is the backend's per-request KV while it prefills (then it
    joins the batch's ``RowStates``)."""

    id: int
    parts: RowParts
    prompt_ids: list[int]
    cfg: GenerationConfig
    generator: torch.Generator | None
    stats: RequestStats
    t_start: float
    tokens: list[int] = field(default_factory=list)
    remaining: int = 0
    stop_max: int = 0
    seen: list[int] = field(default_factory=list)
    features: FeatureBuffer | None = None
    state: Any = None
    prefilled: int = 0
    admitted: bool = False  # its policies began its request (``Round.admit``)
    started: bool = False  # its drafters too (``Round.begin``)
    #: which drafters draft trees, and the first model-free one (``auto``'s plain-step tree)
    trees: list[bool] = field(default_factory=list)
    plain_tree: int | None = None
    #: most tokens a round may draft, besides the policy's cap and the budget (None: no more)
    draft_cap: int | None = None

    @classmethod
    def new(cls, rid: int, parts: RowParts, prompt_ids: Sequence[int], cfg: GenerationConfig,
            device: torch.device | str, t_start: float) -> Row:
        """A request's row before its prefill: its generator seeded (a fresh seed unless
        ``cfg.sampling.seed``), its budget and stop window set."""
        sampling = cfg.sampling
        seed = sampling.seed if sampling.seed is not None else secrets.randbits(62)
        gen = None if sampling.greedy else torch.Generator(device=device).manual_seed(seed)
        stats = RequestStats(prompt_tokens=len(prompt_ids), seed=None if sampling.greedy else seed)
        # tokens a stop string can span: at most its UTF-8 bytes (byte-fallback tokens are 1 byte)
        stop_max = max((len(s.encode("utf-8")) for s in cfg.stop), default=0)
        trees = [parts.tree and d.caps.drafts_trees for d in parts.drafters]
        plain_tree = next((j for j, d in enumerate(parts.drafters) if trees[j] and not d.caps.runs_model), None) \
            if parts.length.caps.plans_round_rate else None
        return cls(rid, parts, list(prompt_ids), cfg, gen, stats, t_start, tokens=list(prompt_ids),
                   remaining=cfg.max_new_tokens, stop_max=stop_max, seen=[0] * len(parts.drafters),
                   trees=trees, plain_tree=plain_tree)

    @property
    def n_prompt(self) -> int:
        return len(self.prompt_ids)

    @property
    def output(self) -> list[int]:
        return self.tokens[len(self.prompt_ids):]


@dataclass
class GenerationResult:
    """Output of one request."""

    text: str
    token_ids: list[int]  # generated tokens only
    prompt_ids: list[int]
    stats: RequestStats

    def to_dict(self, rounds: bool = False) -> dict:
        return {"text": self.text, "token_ids": self.token_ids,
                "stats": self.stats.to_dict(rounds=rounds)}


@dataclass
class PhaseTimes:
    """A row's clock marks in ``plan``: round start, drafter chosen, its prompt ingested,
    caught up, drafted; plus the seconds inside them that were not what they name (the
    length policy's rulings while drafting; prompt ingestion by drafters looked at)."""

    start: float
    selected: float
    prefilled: float
    caught_up: float
    drafted: float
    policy_in_draft: float = 0.0
    look_ingest: float = 0.0

    @classmethod
    def at(cls, t: float) -> PhaseTimes:
        return cls(t, t, t, t, t)

    @property
    def draft_s(self) -> float:
        return self.drafted - self.caught_up - self.policy_in_draft

    @property
    def catch_up_s(self) -> float:
        return self.caught_up - self.prefilled

    @property
    def drafter_prefill_s(self) -> float:
        return self.prefilled - self.selected


@dataclass
class RowPlan:
    """One row's choice for the round: drafter (``PLAIN``: not planned), the length policy's
    wish and the cap, the chain or tree drafted, and the plan's times."""

    drafter: int
    wanted: int
    cap: int
    draft: Draft
    tree: DraftTree | None
    catch_up_tokens: int
    times: PhaseTimes
    looked: bool = False  # the selector was shown the blocks (``peeked``)
    peeked: dict[int, Peek] = field(default_factory=dict)
    #: the round's context, as its policies and cost model price it
    ctx: RoundContext = NO_CONTEXT

    @property
    def width(self) -> int:
        """Tokens the row's verify forward feeds: its last token plus its drafts or nodes."""
        return 1 + (len(self.tree) if self.tree is not None else len(self.draft.tokens))


@dataclass
class Outcome:
    """What verification made of a row's plan. Chains: ``n`` drafts accepted and the target's
    ``next_token``; ``logits`` the rows read ([k + 1, V]; None when the outcome was recorded
    or realised elsewhere, whose ``gammas`` then give the acceptance probabilities), ``hidden``
    their final hidden states (feature drafters). Trees: ``draft`` is the chain the policies
    read (the accepted path, then the first child of its end), ``path`` the accepted nodes."""

    n: int
    next_token: int
    logits: torch.Tensor | None = None
    hidden: torch.Tensor | None = None
    gammas: list[float] | None = None
    draft: Draft | None = None  # trees: the round's chain
    path: list[int] | None = None  # trees: accepted nodes
    #: replay: acceptance probabilities recorded for the drafted tokens (``RoundFeedback.gammas``
    #: is for synthetic rounds that set them as the chosen drafter's own)
    recorded: list[float] | None = None


@dataclass
class Settled:
    """A row after its round: the tokens it emitted, why it stopped ('' if it goes on) and the
    round's record."""

    emitted: list[int]
    reason: str
    record: RoundRecord


def accept(row: Row, plan: RowPlan, logits: torch.Tensor, hidden: torch.Tensor | None = None) -> Outcome:
    """Exact acceptance of a chain row from its verify logits [k + 1, V] (greedy matching, or
    rejection sampling with the row's generator): SpecDec / SpS, Leviathan et al. 2023 Alg. 1."""
    sampling, draft = row.cfg.sampling, plan.draft
    if sampling.greedy:
        verdict = verify_greedy(logits, draft.tokens)
    else:
        verdict = verify_sampling(process_logits(logits, sampling), draft.tokens, draft.probs, row.generator)
    return Outcome(verdict.n_accepted, verdict.next_token, logits, hidden)


def accept_tree(row: Row, plan: RowPlan, logits: torch.Tensor,
                hidden: torch.Tensor | None = None) -> tuple[Outcome, list[int]]:
    """Exact acceptance of a tree row (``trees.verify_tree_greedy`` / ``verify_tree_sampling``)
    from the logits of ``[last] + tree`` ([1 + nodes, V]): ``tree_outcome``."""
    tree, sampling = plan.tree, row.cfg.sampling
    assert tree is not None
    if sampling.greedy:
        return tree_outcome(tree, verify_tree_greedy(logits, tree), logits, hidden)
    probs = process_logits(logits, sampling)
    return tree_outcome(tree, verify_tree_sampling(probs, tree, row.generator), logits, hidden, probs)


def tree_outcome(tree: DraftTree, verdict: TreeVerdict, logits: torch.Tensor | None = None,
                 hidden: torch.Tensor | None = None,
                 probs: torch.Tensor | None = None) -> tuple[Outcome, list[int]]:
    """A tree's verdict as the policies read it: the accepted path, then the first child of its
    end (which was rejected), with the logits and hidden rows of those positions and the
    gammas at each of them (Not-a-Bandit Theorem 2 from the target's ``probs`` when sampling;
    0/1 under greedy); and the forward rows to keep (the root and the accepted nodes)."""
    rows = verdict.rows
    n = len(verdict.path)
    kids = tree.children()[rows[-1]]
    chain = rows + [kids[0] + 1] if kids else rows
    draft = Draft(tokens=[tree.tokens[r - 1] for r in chain[1:]])
    gammas = [1.0] * n + [0.0] * (len(chain) - 1 - n) if probs is None else tree_gammas(probs, tree, chain[:-1])
    return Outcome(n, verdict.next_token, None if logits is None else logits[chain],
                   None if hidden is None else hidden[chain], gammas, draft, verdict.path), rows


def fork_policies(selector: DrafterPolicy, length: LengthPolicy, memo: dict[int, Any]) -> tuple[Any, Any]:
    """Per-request copies of a selector and its length policy (paired ones stay paired) that
    share ``auto``'s global counts (scope=global) with the originals: what one request teaches
    reaches the next ones, as in sequential serving; the rest is per request. ``memo``: objects
    the copies keep as they are (the cost model they price rounds on: ``{id(old): new}``). What
    a copy shares is the policy's ``shared_state()`` (``caps.forks_sharing``)."""
    memo = dict(memo)
    for p in (selector, length):
        if p.caps.forks_sharing:
            for shared in p.shared_state():
                memo[id(shared)] = shared
    return copy.deepcopy((selector, length), memo)


def bind_policies(selector: DrafterPolicy, length: LengthPolicy, drafters: Sequence[Drafter], tree: bool) -> None:
    """Tell both policies their drafters' capability records (which run a network, their
    families: ``auto`` does not count agreement within one) and which draft trees (the node
    budget prices those): ``bind`` of ``DrafterPolicy`` and ``LengthPolicy``."""
    caps = [d.caps for d in drafters]
    trees = [tree and c.drafts_trees for c in caps]
    selector.bind(caps, trees)
    length.bind(caps, trees)


def cut_at_stops(emitted: list[int], remaining: int, eos: set[int],
                 hits_stop: Callable[[list[int]], bool] | None = None) -> tuple[list[int], str]:
    """Cut a round's tokens at EOS, a stop string (``hits_stop(prefix)``) or the token budget,
    exactly where plain decoding would have stopped; returns the kept tokens and the reason."""
    for j, t in enumerate(emitted):
        if t in eos:
            return emitted[: j + 1], "eos"
        if hits_stop is not None and hits_stop(emitted[: j + 1]):
            return emitted[: j + 1], "stop_string"
        if j + 1 >= remaining:
            return emitted[: j + 1], "max_new_tokens"
    return emitted, ""


def joint_width(curves: Sequence[Sequence[float]], rows: int, least: int, overhead: float,
                cost: Callable[[int], float]) -> int:
    """The batch width W >= ``least`` with the most expected tokens per second,
    sum_r E_r(W - 1) / (rows o + V(W)) (``Round.plan``): ``curves[r][k]`` is a joint row's
    expected emitted tokens at cap k (flat past its end), each of the other rows counts one
    token, ``cost(W)`` is the batch forward's seconds. Ties go to the narrower."""
    top = max((len(c) for c in curves), default=1)
    best_w, best_rate = least, -1.0
    for w in range(least, max(least, top) + 1):
        rate = joint_rate(curves, rows, w, overhead, cost)
        if rate > best_rate:
            best_w, best_rate = w, rate
    return best_w


def joint_rate(curves: Sequence[Sequence[float]], rows: int, width: int, overhead: float,
               cost: Callable[[int], float]) -> float:
    """The batch's expected tokens per second at ``width`` (``joint_width``)."""
    tokens = sum(c[min(width - 1, len(c) - 1)] for c in curves) + (rows - len(curves))
    return tokens / max(rows * overhead + cost(width), 1e-12)


class Round:
    """The round's logic (see the module docstring) for any number of rows. ``decode(ids)``
    turns token ids into text (stop strings); ``eos``: the ids that end a request (when its
    ``stop_on_eos``); ``clock``: the seconds every time in the round is read from (synchronised
    with the device); ``tick``: the same seconds read without a device synchronise, for the
    length policy's rulings inside drafting (default ``time.perf_counter``). ``stopwatch``:
    when given, the real seconds of the policies' calls accumulate in ``policy_s`` (replay, whose
    clock is virtual). ``last_width``: the width of the last verify forward the round settled
    (0 after a request's prefill): the forward a row's next round follows on this target
    (``RoundContext.last_width``)."""

    def __init__(self, decode: Callable[[Sequence[int]], str], eos: set[int],
                 clock: Callable[[], float] = time.perf_counter, tick: Callable[[], float] | None = None,
                 stopwatch: Callable[[], float] | None = None):
        self.decode, self.eos, self.clock = decode, set(eos), clock
        self.tick = time.perf_counter if tick is None else tick
        self.stopwatch, self.policy_s = stopwatch, 0.0
        self.last_width = 0
        self._joint_open = False  # the last joint probe drafted: plan the next round jointly too
        self._plain_rounds = 0  # plain rounds since the last joint probe

    def _timed(self, call: Callable[[], Any]) -> Any:
        """``call()``, its real seconds added to ``policy_s`` when a stopwatch is set."""
        if self.stopwatch is None:
            return call()
        t = self.stopwatch()
        try:
            return call()
        finally:
            self.policy_s += self.stopwatch() - t

    # -- a request begins and ends ----------------------------------------------------------
    def admit(self, row: Row) -> None:
        """The row's policies begin its request (once): a configuration they cannot run on its
        drafters fails here, when a scheduler queues the request. They are the request's own
        (copies) or, one request at a time, the engine's; what they estimate from shared state
        (``auto``'s global counts) they read when they plan."""
        if row.admitted:
            return
        parts = row.parts

        def begin() -> None:
            parts.selector.begin_request(parts.names)
            if parts.selector.caps.reads_prompt:  # policies that decide from the prompt (router)
                parts.selector.observe_prompt(row.prompt_ids)
            parts.length.begin_request()

        self._timed(begin)
        row.admitted = True

    def begin(self, row: Row) -> None:
        """The row's request begins (once, before its first round): its policies (``admit``, if
        not yet) and its drafters, on its prompt. A scheduler calls it when the row leaves the
        queue, after the requests before it ended: one request at a time, the drafters are the
        engine's own, and begun earlier they would draft on a later request's prompt."""
        if row.started:
            return
        self.admit(row)
        for d in row.parts.drafters:
            d.begin_request(row.prompt_ids)
        self.last_width = 0  # the prefill's shape came last (``CostModel.switch_cost``)
        row.started = True

    def end(self, row: Row) -> None:
        """The row's request ended: its drafters see its output (datastores that learn)."""
        if row.started:
            for d in row.parts.drafters:
                d.end_request(row.output)

    # -- 1. plan ------------------------------------------------------------------------------
    def context(self, row: Row, rows: int = 1, columns: int = 0) -> RoundContext:
        """The row's ``RoundContext`` this round: its cache length, the ``rows`` verified by the
        round's forward over a batch cache of ``columns`` columns, the last forward's width."""
        return RoundContext(len(row.tokens) - 1, rows, columns, self.last_width)

    def plan(self, rows: Sequence[Row], batch: CostModel | None = None, shared: int = 1,
             columns: int = 0) -> list[RowPlan]:
        """Every row's plan. ``shared``: rows verified by one forward, over a batch cache of
        ``columns`` columns (each row is priced as its share: ``RoundContext``). ``batch``: the
        cost model of rows that share one forward and price their rounds on its batch surface
        (``CostModel.batch``): cost-aware rows then take plain steps without planning where no
        block could pay (``drafting_can_pay``), and ``auto`` rows with free blocks choose the
        batch's width together (``joint_width``).

        Where no block pays at a row's price but blocks could pay together (every row drafting,
        ``drafting_can_pay(joint=True)``: a batch of rows that all draft well, such as requests
        repeating answers a shared suffix store holds), every ``JOINT_PROBE_EVERY``-th round is
        planned jointly (a probe); it drafts only where its width's expected rate is
        ``JOINT_MARGIN`` times the plain batch's, and then the next round is planned jointly
        too, until one is not worth that margin.

        A round that gives at least half its rows their first token (a burst of requests that
        joined together) is planned plain for those cost-aware rows: a joint width pays for the
        batch's tokens per second, but every joining row would wait for its wide forward for
        its first token (SmolLM2, 16 requests at once with the suffix store's answers: the
        first token at 465-607 ms after a joint forward, 184-297 ms after a plain one). It
        counts as a plain round for the probes; the next round plans as below. A request
        joining a running batch alone is planned as usual."""
        ctxs = [self.context(row, shared, columns) for row in rows]
        if len(rows) == 1 or batch is None:
            return [self.plan_row(row, ctx=ctx) for row, ctx in zip(rows, ctxs)]
        if 2 * sum(len(row.tokens) == row.n_prompt for row in rows) >= len(rows):  # mostly first tokens
            self._plain_rounds += 1  # a plain round as the probes count them
            return self._plain_plans(rows, ctxs)
        if drafting_can_pay(batch, shared, columns):
            return self._joint_plans(rows, batch, ctxs)
        if self._joint_open or self._plain_rounds + 1 >= JOINT_PROBE_EVERY:  # a probe is due
            self._plain_rounds = 0
            if drafting_can_pay(batch, shared, columns, joint=True):
                return self._joint_plans(rows, batch, ctxs, margin=JOINT_MARGIN)
        else:
            self._plain_rounds += 1
        self._joint_open = False
        return self._plain_plans(rows, ctxs)

    def _plain_plans(self, rows: Sequence[Row], ctxs: Sequence[RoundContext]) -> list[RowPlan]:
        """Plain steps for the rows that price their rounds; the others plan as they do."""
        return [self.plain(row, ctx) if row.parts.prices_rounds else self.plan_row(row, ctx=ctx)
                for row, ctx in zip(rows, ctxs)]

    def plain(self, row: Row, ctx: RoundContext = NO_CONTEXT) -> RowPlan:
        """A plain step without asking the row's policies (drafting cannot pay in this batch)."""
        self.begin(row)
        return RowPlan(PLAIN, 0, 0, Draft(), None, 0, PhaseTimes.at(self.clock()), ctx=ctx)

    def _joint_plans(self, rows: Sequence[Row], cm: CostModel, ctxs: Sequence[RoundContext],
                     margin: float | None = None) -> list[RowPlan]:
        """Every row's plan, the batch's width chosen jointly for the rows that can (``auto``
        with free blocks: ``AutoController.block_curve``).

        A padded forward is as wide as its widest row, so a row priced alone pays the whole
        widening and declines, while a row priced at its 1/R share over-drafts. The batch
        instead picks the width W that maximises its expected tokens per second,

            sum_r E_r(W - 1) / (R o + V(R, W)),

        E_r(k) the row's expected emitted tokens at cap k (its best drafter's), V the batch
        surface (``BatchCosts.cost``), o the per-row round overhead; W is at least the other
        rows' widest block, and every joint row then drafts up to W - 1 tokens (free: the forward
        is that wide anyway). Joint rows are those whose selector plans jointly and whose length
        policy follows it (``SelectorCaps.plans_jointly``, ``LengthCaps.follows_selector``).
        ``margin`` (a probe, ``plan``): W stays the least unless its rate is ``margin`` times
        the rate at the least width; whether it was is kept for the next round's plan."""
        if margin is not None:
            self._joint_open = False  # kept open only by a width worth the margin (below)
        looks: dict[int, tuple[tuple[dict[int, Peek], bool, float, float], list]] = {}
        for r, row in enumerate(rows):
            sel, length = row.parts.selector, row.parts.length
            if not (sel.caps.plans_jointly and length.caps.follows_selector):
                continue
            look = self.look(row)
            looks[r] = (look, sel.block_curve() or [])  # no curve: planned on its own below
        plans: dict[int, RowPlan] = {}
        for r, row in enumerate(rows):
            if r not in looks or not looks[r][1]:
                plans[r] = self.plan_row(row, looks[r][0] if r in looks else None, ctxs[r])
        curves = {r: c for r, (_, c) in looks.items() if c}
        if curves:
            least = max((p.width for p in plans.values()), default=1)
            columns = ctxs[0].batch_columns
            expected = [[e for e, _, _ in c] for c in curves.values()]
            cost = lambda w: cm.batch.cost(len(rows), w, columns)  # noqa: E731
            width = joint_width(expected, len(rows), least, cm.round_overhead_s, cost)
            if margin is not None:
                self._joint_open = width > least and (
                    joint_rate(expected, len(rows), width, cm.round_overhead_s, cost)
                    >= margin * joint_rate(expected, len(rows), least, cm.round_overhead_s, cost))
                width = width if self._joint_open else least
            for r in curves:
                rows[r].parts.selector.commit(width - 1)
                plans[r] = self.plan_row(rows[r], looks[r][0], ctxs[r])
        return [plans[r] for r in range(len(rows))]

    def look(self, row: Row) -> tuple[dict[int, Peek], bool, float, float]:
        """The row's looks at its free-looking drafters' blocks (``Drafter.peek``), shown to its
        selector when it looks first (``SelectorCaps.looks``): (blocks, looked, round start,
        prompt ingestion seconds of drafters looked at for the first time this request)."""
        self.begin(row)
        t0 = self.clock()
        selector = row.parts.selector
        caps = selector.caps
        looked = caps.looks > 0 and (not caps.skips_looks or selector.looks())  # auto:look_share>0
        if not looked:
            return {}, False, t0, 0.0
        peeked, ingest = self._peek(row, min(caps.looks, row.remaining - 1))
        self._timed(lambda: selector.observe_proposals(peeked))
        return peeked, True, t0, ingest

    def plan_row(self, row: Row, look: tuple[dict[int, Peek], bool, float, float] | None = None,
                 ctx: RoundContext | None = None) -> RowPlan:
        """The row's drafter choice, catch-up and draft after its ``look`` (taken here if not
        given): a chain, or a tree where the drafter drafts trees. ``ctx``: the round's context
        (default: the row alone, ``context``), passed to the policies that price rounds."""
        parts, tokens, clock = row.parts, row.tokens, self.clock
        peeked, looked, t0, look_ingest = self.look(row) if look is None else look
        selector, length, drafters = parts.selector, parts.length, parts.drafters
        if ctx is None:
            ctx = self.context(row)
        i = self._timed(partial(selector.select, ctx) if selector.caps.prices_rounds else selector.select)
        if not 0 <= i < len(drafters):
            raise ConfigError(f"selector {selector.name!r} chose drafter #{i} of {len(drafters)}")
        # 0: the policy chose a plain step (not the budget)
        wanted = self._timed(partial(length.begin_round, i, ctx) if length.caps.prices_rounds
                             else partial(length.begin_round, i))
        cap = min(wanted, row.remaining - 1) if row.draft_cap is None else min(wanted, row.remaining - 1, row.draft_cap)
        t_selected = clock()
        if looked and selector.caps.skips_looks and row.stats.rounds:
            parts.cost_model.observe_look(t_selected - t0)  # the first look also ingests the prompt
        times = PhaseTimes(t0, t_selected, t_selected, t_selected, t_selected, look_ingest=look_ingest)
        if self._ingest_prompt(row, i):
            times.prefilled = clock()
        catch_up_tokens = 0
        if row.seen[i] < len(tokens):
            catch_up_tokens = len(tokens) - row.seen[i]  # produced while it was not used
            drafters[i].catch_up(tokens)
        times.caught_up = clock()
        plan = RowPlan(i, wanted, cap, Draft(), None, catch_up_tokens, times, looked, peeked, ctx)
        self._draft(row, plan)
        times.drafted = clock()
        return plan

    def _draft(self, row: Row, plan: RowPlan) -> None:
        """Fill ``plan``'s chain or tree: ``auto``'s plain step may become the first model-free
        tree drafter's tree (``_plain_tree``); a tree drafter's tree, or its chain when it
        offered one (a tree of one chain is the chain path)."""
        length, room = row.parts.length, row.remaining - 1

        tick = self.tick

        def decide(step: DraftStep) -> Decision:
            t = tick()
            verdict = self._timed(lambda: length.decide(step))
            plan.times.policy_in_draft += tick() - t
            return verdict

        tree = None
        if plan.cap == 0 and row.plain_tree is not None and row.plain_tree in plan.peeked and room > 0:
            tree = self._plain_tree(row, row.plain_tree, room, plan.ctx)
            if tree is not None:  # the round is that drafter's, allowed the tree's tokens
                plan.drafter, plan.cap = row.plain_tree, len(tree)
                plan.wanted = plan.cap
                if tree.is_chain:
                    plan.draft, tree = Draft(tokens=list(tree.tokens)), None
        elif plan.cap > 0 and row.trees[plan.drafter]:
            tree = self.draft_tree(row, plan.drafter, plan.cap, room, plan.ctx)
            if tree is None:  # the drafter offered one chain: drafted as without trees
                plan.draft = self.draft_chain(row, plan, decide)
            elif tree.is_chain:  # a chain (or a tree cut to one) is verified as one
                plan.draft, tree = Draft(tokens=apply_decisions(tree.tokens, decide)), None
        else:
            plan.draft = self.draft_chain(row, plan, decide)
        plan.tree = tree

    def draft_chain(self, row: Row, plan: RowPlan, decide: Callable[[DraftStep], Decision]) -> Draft:
        """The chosen drafter's chain of at most ``plan.cap`` tokens, drafted exactly as the
        drafter would: from its looked-at block (a look is deterministic drafting), looked at
        again ``cap`` deep when the cap goes past a look cut at its depth; else a fresh draft.

        Never a draft from ``tokens`` + the look: a drafter takes the context it is given as
        verified, so a rejected look token would stay in the n-gram drafters' index (their next
        catch-up checks only the tokens past what they trust), and a tree the drafter offered
        earlier in the round was settled against it."""
        cap, tokens = plan.cap, row.tokens
        if cap <= 0:
            return Draft()
        drafter = row.parts.drafters[plan.drafter]
        look = plan.peeked.get(plan.drafter)
        if look is not None:
            kept = apply_decisions(look.tokens[:cap], decide)
            n = len(kept)
            if n < cap and n == len(look.tokens) and look.cut:  # on past the look's end
                deeper = drafter.peek(tokens, cap)  # the same first n tokens (deterministic)
                if deeper is not None:
                    def go_on(step: DraftStep) -> Decision:
                        return decide(replace(step, index=step.index + n))
                    kept += apply_decisions(deeper.tokens[n:cap], go_on)
            return Draft(tokens=kept, look_s=look.seconds)
        return drafter.draft(tokens, cap, row.cfg.sampling, row.generator, decide,
                             want_hidden=row.parts.length.caps.needs_hidden and drafter.caps.runs_model)

    def _plain_tree(self, row: Row, index: int, room: int, ctx: RoundContext) -> DraftTree | None:
        """With trees on, ``auto`` planned a plain step (its looks found no chain that pays):
        model-free drafter ``index``'s tree (it was looked at, so it has seen the tokens), cut
        where its nodes stop paying at the generation's running rate R (the m maximising
        E_m - R (o + V(m + 1)), m = 0 the plain step: ``trees.nodes_worth_verifying``). On a
        flat verify curve a few candidates after a token without a match cost almost nothing.
        None: the plain step."""
        if row.parts.length.plain_rate() is None:
            return None
        tree = self.draft_tree(row, index, 1, room, ctx)
        return tree if tree is not None and len(tree) else None

    def draft_tree(self, row: Row, index: int, cap: int, room: int,
                   ctx: RoundContext = NO_CONTEXT) -> DraftTree | None:
        """The drafter's tree cut to the best-first prefix worth verifying
        (``trees.nodes_worth_verifying``); None when a model-free drafter offered a single
        chain, which is then drafted exactly as without trees: a tree of one chain is the chain
        path.

        Depth: a model drafter's tree is ``cap`` deep (every level costs a drafter forward), at
        most ``tree_nodes``, and a level is drafted only while the drafter's scores say it may
        add more tokens than its forward's seconds yield at the running rate. A model-free
        drafter's is ``tree_nodes - 1`` deep whatever the cap (at most ``room``, the tokens
        left): its nodes cost lookups, and the budget prices each by its calibrated score; one
        less than the nodes, so that a tree of one chain means the drafter had no alternative.
        Once branched it grows only while a later node could still be verified
        (``trees.PrefixCut``): a tree stopped there is cut, never taken for one chain.

        A model-free tree is cut at the generation's running rate R (Dinkelbach's objective
        E_m - R (o + V(m + 1))), also where a length policy that plans the round's rate
        (``auto``) planned a chain: its best-first nodes include the chain's, each priced by its
        calibrated score, so the cut is the best prefix-closed part of the candidates the chain
        is one of, and the tree replaces the chain whenever it branched. A model drafter's tree
        keeps auto's ratio objective. ``ctx``: the round's context (where widths are priced)."""
        parts, tokens, sampling = row.parts, row.tokens, row.cfg.sampling
        drafter, costs, n_nodes = parts.drafters[index], parts.cost_model, parts.tree_nodes
        model = drafter.caps.runs_model
        verify_cost = costs.verify_row(n_nodes + 1, ctx).__getitem__  # every width at once
        # the opportunity cost of a second is the generation's running rate; a model drafter's
        # tree under a policy that plans the round's rate (auto) keeps that policy's objective
        rate = None if parts.length.caps.plans_round_rate and model else costs.running_rate(ctx)
        if model:
            # its q are calibrated on the tree nodes the target saw; a level is one drafter
            # forward: worth it while it may add more expected tokens than its seconds yield
            # at the running rate, and only for nodes the budget would verify
            f = parts.tree_calibration.factor(id(drafter))
            level_s = max(0.0, costs.draft_cost(index, 1, ctx) - costs.draft_cost(index, 0, ctx))

            def budget(part: DraftTree) -> int:
                if part.scores is None:
                    return len(part)
                return nodes_worth_verifying(calibrated_scores(part, f), verify_cost,
                                             costs.round_overhead_s, rate)

            tree = drafter.draft_tree(tokens, min(cap, n_nodes), n_nodes, sampling,
                                      level_gain=level_s * costs.running_rate(ctx) / max(f, 1e-6), budget=budget)
            if tree.is_chain:
                return tree
            scores = calibrated_scores(tree, f) if tree.scores is not None else None
        else:
            depth = min(max(n_nodes - 1, 1), room)
            cut = PrefixCut.priced(verify_cost, costs.round_overhead_s, n_nodes, rate)
            tree = drafter.draft_tree(tokens, depth, n_nodes, sampling, cut=cut)
            if tree.is_chain and not cut.stopped:
                return tree if not len(tree) else None
            scores = tree.scores
        if scores is None:
            return tree
        return tree.prefix(nodes_worth_verifying(scores, verify_cost, costs.round_overhead_s, rate))

    def _peek(self, row: Row, max_tokens: int) -> tuple[dict[int, Peek], float]:
        """Every free-looking drafter's proposal (``Drafter.peek``: ``DrafterCaps.free_looks``), by index, and
        the seconds of the prompt's ingestion by drafters looked at for the first time this
        request (once per request, not priced per round); the rest of the time counts as the
        round's policy overhead, which the cost model prices."""
        out: dict[int, Peek] = {}
        ingest = 0.0
        clock, tokens = self.clock, row.tokens
        for j, d in enumerate(row.parts.drafters):
            if not d.caps.free_looks:
                continue
            ingest += self._ingest_prompt(row, j)
            t = clock()
            props = d.peek(tokens, max_tokens)
            if props is not None:
                props.seconds, props.cut = clock() - t, len(props.tokens) >= max_tokens
                out[j] = props
                row.seen[j] = len(tokens)
        return out, ingest

    def _ingest_prompt(self, row: Row, j: int, context: Sequence[int] | None = None) -> float:
        """Drafter ``j``'s first use in a request (``seen[j]`` 0), chosen, looked at or scored:
        it reads the prompt (its prefill), once. Returns the seconds (0 if already seen): they
        are recorded as drafter prefill, never as a round's overhead."""
        if row.seen[j] != 0 or not row.n_prompt:
            return 0.0
        t = self.clock()
        row.parts.drafters[j].catch_up((row.tokens if context is None else context)[: row.n_prompt])
        row.seen[j] = row.n_prompt
        return self.clock() - t

    # -- 3. settle ----------------------------------------------------------------------------
    def settle(self, row: Row, plan: RowPlan, outcome: Outcome, verify_s: float, rows: int = 1,
               observed: Sequence[int] | None = None) -> Settled:
        """Stops, tokens, feedback to the row's policies and cost model, and its round record.
        ``verify_s``: the seconds of the forward that verified ``rows`` rows (a row's share is
        ``verify_s / rows``); ``observed``: the inputs whose logits are ``outcome.logits``
        (chains: ``[last] + drafts``) for drafters that learn from the target's rows."""
        t_settle = self.clock()
        parts, tokens = row.parts, row.tokens
        drafters, cm = parts.drafters, parts.cost_model
        draft = outcome.draft if outcome.draft is not None else plan.draft
        n = outcome.n
        observers = [d for d in drafters if d.caps.observes_target]
        fed = observed if observed is not None else [tokens[-1], *draft.tokens]
        emitted, reason = self.apply_stops(row, [*draft.tokens[:n], outcome.next_token])
        context_len = len(tokens)
        tokens.extend(emitted)
        if row.features is not None and outcome.hidden is not None:  # rows of [last, accepted drafts]
            row.features.append(outcome.hidden[: len(emitted)])
        row.remaining -= len(emitted)
        i = plan.drafter
        if i == PLAIN:  # not planned (drafting could not pay): no policy or drafter saw the round
            if outcome.logits is not None:
                for d in observers:
                    d.observe_target(fed, outcome.logits)
            record = RoundRecord(drafter="none", k_cap=0, drafted=0, accepted=0, emitted=len(emitted), draft_s=0.0,
                                 verify_s=verify_s, catch_up_s=0.0, catch_up_tokens=0, policy_s=0.0, eval_s=0.0,
                                 total_s=verify_s, drafter_prefill_s=0.0)
            return self._record(row, record, emitted, reason)
        row.seen[i] = len(tokens)
        times, share = plan.times, verify_s / rows
        k = len(plan.tree) if plan.tree is not None else len(draft.tokens)
        feedback = RoundFeedback(
            round=len(row.stats.rounds), drafter=i, draft=draft, n_accepted=n, emitted=emitted,
            k_cap=plan.cap, target_logits=outcome.logits, sampling=row.cfg.sampling, draft_s=times.draft_s,
            verify_s=share, catch_up_s=times.catch_up_s, catch_up_tokens=plan.catch_up_tokens,
            gammas=outcome.gammas, tree_nodes=0 if plan.tree is None else k, recorded=outcome.recorded,
            context=plan.ctx)
        t_eval = self.clock()
        eval_ingest = 0.0
        if parts.selector.caps.full_information and (len(drafters) > 1 or plan.wanted == 0):
            feedback.counterfactual, eval_ingest = self.evaluate_others(
                row, plan, tokens[:context_len], emitted, outcome.logits, feedback)
            for j in feedback.counterfactual:
                row.seen[j] = len(tokens)
        t_scored = self.clock()
        if outcome.logits is not None:
            for d in observers:  # after scoring: a score of this round must not read its own rows
                d.observe_target(fed, outcome.logits)
        t_observed = self.clock()
        cm.observe(i, k, times.draft_s, share, plan.catch_up_tokens, times.catch_up_s, plan.ctx)
        if plan.tree is not None and drafters[i].caps.runs_model and plan.tree.scores is not None and outcome.path is not None:
            parts.tree_calibration.observe(id(drafters[i]), *node_trials(plan.tree, outcome.path))
        self._timed(lambda: (parts.selector.update(feedback), parts.length.update(feedback)))
        t_end = self.clock()
        eval_s = t_scored - t_eval
        # the per-round overhead the plans price is the rounds' own work (looks, planning,
        # bookkeeping): not a drafter's prompt ingestion at its first use (chosen, looked at or
        # scored), paid once per request, nor scoring (``eval_share`` budgets it; a model
        # drafter is scored every round while it warms up): both in it made every plain step of
        # a fresh engine look dearer, and auto drafted where it did not pay
        own = (times.drafted - times.start) + (t_end - t_settle)
        cm.observe_overhead(own - times.draft_s - times.catch_up_s - times.drafter_prefill_s
                            - times.look_ingest - eval_s)
        cm.observe_eval(eval_s, own + share)
        if parts.tree:  # the running rate prices tree nodes only (``draft_tree``)
            cm.observe_round(len(emitted), k + 1, own - times.drafter_prefill_s - times.look_ingest - eval_ingest,
                             plan.ctx)
        self.last_width = k + 1
        # the chosen drafter's look, when its block is the draft, was drafting (a static
        # configuration pays it too): recorded as such, not as the controller's time
        record = RoundRecord(
            drafter=drafters[i].name, k_cap=plan.cap, drafted=k, accepted=n, emitted=len(emitted),
            draft_s=times.draft_s + draft.look_s, verify_s=verify_s, catch_up_s=times.catch_up_s,
            catch_up_tokens=plan.catch_up_tokens,
            policy_s=(times.selected - times.start) + times.policy_in_draft + (t_end - t_observed)
            - times.look_ingest - draft.look_s,
            eval_s=eval_s - eval_ingest, total_s=own + verify_s,
            drafter_prefill_s=times.drafter_prefill_s + times.look_ingest + eval_ingest,
            tree_nodes=0 if plan.tree is None else k)
        return self._record(row, record, emitted, reason)

    @staticmethod
    def _record(row: Row, record: RoundRecord, emitted: list[int], reason: str) -> Settled:
        row.stats.rounds.append(record)
        if reason:
            row.stats.stop_reason = reason
        return Settled(emitted, reason, record)

    def finish(self, row: Row, now: float | None = None) -> None:
        """Close a row's statistics (its output length and seconds) and end its request."""
        row.stats.new_tokens = len(row.tokens) - row.n_prompt
        row.stats.total_s = (self.clock() if now is None else now) - row.t_start
        self.end(row)

    def apply_stops(self, row: Row, emitted: list[int]) -> tuple[list[int], str]:
        cfg = row.cfg
        hits = None
        if cfg.stop:
            def hits(new: list[int]) -> bool:
                return self._hits_stop(row, new)
        return cut_at_stops(emitted, row.remaining, self.eos if cfg.stop_on_eos else set(), hits)

    def _hits_stop(self, row: Row, new: list[int]) -> bool:
        """Does the tail of the generated text (never the prompt) contain a stop string?"""
        tokens, window = row.tokens, row.stop_max + 8
        start = max(row.n_prompt, len(tokens) - max(0, window - len(new)))
        tail = self.decode((tokens[start:] + new)[-window:])
        return any(s in tail for s in row.cfg.stop)

    def evaluate_others(self, row: Row, plan: RowPlan, context: list[int], emitted: list[int],
                        logits: torch.Tensor | None, feedback: RoundFeedback) -> tuple[dict[int, list[float]], float]:
        """Full information (Not-a-Bandit 3.2): prefill the verified tokens into every other
        drafter and compute its acceptance probability at each of them, without target calls.
        When the chosen drafter had a zero cap it is scored like the others. A selector may skip
        drafters (``SelectorCaps.scores_subset``: ``selector.to_score`` gives the round's set;
        skipped evaluation, B.5). Under greedy decoding the target's argmax at each
        emitted position is the emitted token, so no logits are needed. Also returns the
        seconds drafters scored for the first time this request spent ingesting the prompt."""
        parts, sampling = row.parts, row.cfg.sampling
        chosen, score_chosen = plan.drafter, plan.wanted == 0
        m = len(emitted)
        target_probs: torch.Tensor | None = None
        argmax = emitted if sampling.greedy else None
        out: dict[int, list[float]] = {} if score_chosen else {chosen: feedback.chosen_gammas()}
        alphas: dict[int, list[float]] = {}
        proposed: dict[int, list[bool]] = {}
        ingest = 0.0
        if parts.selector.caps.scores_subset:  # the round's set at once (auto)
            scored = parts.selector.to_score(chosen, score_chosen)
        else:
            scored = [j for j in range(len(parts.drafters)) if j != chosen or score_chosen]
        target_logits = logits[:m] if logits is not None else torch.zeros(m, 0)
        for j in scored:
            ingest += self._ingest_prompt(row, j, context)
            props = parts.drafters[j].score(context, emitted, sampling)
            if not sampling.greedy and target_probs is None:
                target_probs = feedback.target_probs[:m]
            out[j] = gammas_from_proposals(target_logits, target_probs, props, sampling, argmax)
            alphas[j] = alphas_from_proposals(target_probs, props, emitted, sampling)
            proposed[j] = [t >= 0 for t in props.tokens] if props.tokens is not None else [True] * m
        feedback.counterfactual_alpha = alphas
        feedback.counterfactual_proposed = proposed
        return out, ingest


def drafting_can_pay(cm: CostModel, rows: int, columns: int = 0, joint: bool = False) -> bool:
    """Could any block pay in this batch if every drafted token were accepted: w tokens for
    o + price(w) against one for o + price(1), w up to ``MAX_WIDTH``, on the batch price of a
    row of ``rows`` over ``columns`` cache columns (``CostModel.verify_cost``) with the round
    overhead o? When not, no cost-aware policy drafts, so their rows take plain steps without
    planning (whose per-row Python work, the looks and the policies, is a noticeable share of a
    compute-bound round at many rows).

    This is one row's best case at its row price, stricter than the joint width's (every row
    drafting and accepted: R w tokens for R o + V(R, w)), with which the rows looked and
    planned where the width seldom paid, and the batch ran slower. ``joint``: that joint best
    case instead (``Round.plan``'s probes)."""
    if cm.batch is None or rows <= 1:
        return True
    o = cm.round_overhead_s
    if joint:
        together = rows * o + cm.batch.cost(rows, 1, columns)
        return any(w * together > rows * o + cm.batch.cost(rows, w, columns) for w in range(2, MAX_WIDTH + 1))
    ctx = RoundContext(rows=rows, batch_columns=columns)
    plain = o + cm.verify_cost(1, ctx)
    return any(w * plain > o + cm.verify_cost(w, ctx) for w in range(2, MAX_WIDTH + 1))
