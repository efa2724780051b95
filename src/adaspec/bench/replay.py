"""Model-free replay of a recorded trace: any drafter policy x length policy in seconds.

``replay`` drives the engine's own round (``round.Round``: look, select, length, draft, settle
with feedback, cost model and counterfactual scoring) on a ``Trace`` (``adaspec.trace``)
instead of models. Three things stand in for them:

* the **target** is the recorded greedy path (``_oracle``): a greedy target's argmax at each
  path position is the path's next token, so a chain is accepted as far as it follows the path
  (a recorded chain: as far as the recording accepted it) and a draft tree along its path, with
  the recorded acceptance probabilities where the chain is the recorded one;
* the **drafters** (``ReplayDrafter``): model-free drafters rebuilt from their spec draft,
  look, score and grow trees for real on the path (a lookup, no model); model drafters and
  drafters that learn from the target's rows replay their recorded chain at each position
  (``DraftStep.stats`` carrying q's statistics), scored by their recorded first tokens;
* the **clock** (``ReplayClock``) is virtual: every priced part of a round advances it by its
  recorded price (``_RoundPricer``), so the round's own timing bookkeeping, and with it every
  time-dependent policy and the cost model, sees deterministic seconds.

EOS and the token budget cut a round as the engine does; policies keep their state across the
prompts of a replay as across the requests of one engine (``scope=global`` carries over).

Exactness: for greedy decoding and time-independent policies the per-round (drafter, cap,
drafted, accepted, emitted) sequence equals a live run's ``stats.rounds`` (checked by
tests/test_trace_replay.py), up to floating-point batch invariance of the models (the
recording's forwards are batched differently from a live run's; a near-tie can flip). A
recorded chain drafted past the recorded ``max_draft`` is cut there and counted (``clipped``).
Time-dependent policies (``caps.time_dependent``: they read round seconds or the cost model;
``time_dependent_policies``) see times synthesised from the recorded costs, so the replay is
deterministic but not a live run.

Predicted seconds price every round where it runs (``_RoundPricer``): the verify-cost
surface V(k+1, L) at the round's cache length L (times the recorded live/measured ratio at
that width, ``EngineOverheads.verify_factor``), the drafter's cost functions of (tokens, L)
for drafting, catch-up, prompt prefill and full-information evaluation, the engine's
measured per-round and per-request overheads and the target prefill measured for the prompt
in the recording: the deterministic ``seconds``. Cost-aware policies decide on the surface the
live engines read (``Trace.policy_surface``, unscaled), as theirs did. The policies' own
compute time is measured during the replay (the same code runs live; ``policy_s``) and added
in ``predicted_s``, from which tokens/s and the speed-up are computed.

Draft trees (``tree=True``) grow from the live drafters; a recorded drafter drafts chains. Not
supported: sampling, stop strings, and length policies that read a model drafter's hidden
states (``specdecpp`` with a model drafter; with model-free drafters it is static).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import typer

from ..config import GenerationConfig, SamplingConfig, validate_k
from ..costs import CostModel, DrafterCosts, EngineOverheads, VerifyCostSurface
from ..drafters import Drafter, NoDrafter, build_drafter, drafter_family, parse_drafter
from ..drafters.base import Decision, Draft, DrafterCaps, DraftStep, Peek, Proposals, StepStats
from ..errors import AdaspecError, ConfigError
from ..length import LengthPolicy, build_length
from ..metrics import RoundRates
from ..registry import REGISTRY
from ..round import Outcome, Round, Row, RowParts, RowPlan, bind_policies, tree_outcome
from ..selection import DrafterPolicy, build_policies, build_selector
from ..trees import DraftTree, walk_tree
from .trace import PromptTrace, Trace

GREEDY = SamplingConfig()
NONE = "none"


def time_dependent_policies() -> frozenset[str]:
    """The registered policies whose decisions depend on round times or the cost model
    (``caps.time_dependent``): their replay is deterministic (synthesised times) but not claimed
    equal to a live run."""
    return frozenset(e.name for kind in ("selector", "length") for e in REGISTRY.entries(kind)
                     if e.caps.time_dependent)


# -- results ----------------------------------------------------------------------------------
@dataclass
class ReplayRound:
    """One replayed round (the fields of ``RoundRecord`` that do not need a clock)."""

    prompt: int
    round: int
    drafter: int  # index in the replayed drafter list
    name: str  # Drafter.name, as RoundRecord.drafter
    k_cap: int
    drafted: int
    accepted: int
    emitted: int
    catch_up_tokens: int
    seconds: float  # predicted: drafter prefill + catch-up + drafting + verification + evaluation
    #                 + engine overhead (policy compute is measured per replay: ReplayResult.policy_s)
    clipped: bool = False  # the policy wanted more than the recorded max_draft tokens

    def key(self) -> tuple[str, int, int, int, int]:
        """What a live ``RoundRecord`` must match: (drafter, k_cap, drafted, accepted, emitted)."""
        return (self.name, self.k_cap, self.drafted, self.accepted, self.emitted)


@dataclass
class PromptReplay:
    index: int
    new_tokens: int
    stop_reason: str
    seconds: float  # predicted, target prefill and per-request overhead included
    ar_seconds: float  # predicted plain decoding of the same tokens
    rounds: list[ReplayRound]


@dataclass
class ReplayResult(RoundRates):
    """A replayed run: per-prompt, per-round records and totals."""

    selector: str
    length: str
    k: int
    drafters: list[str]
    prompts: list[PromptReplay]
    time_dependent: bool
    policy_s: float = 0.0  # measured compute time of the policies during the replay
    wall_s: float = 0.0  # wall time of the replay

    @property
    def rounds(self) -> list[ReplayRound]:
        return [r for p in self.prompts for r in p.rounds]

    @property
    def n_rounds(self) -> int:
        return sum(len(p.rounds) for p in self.prompts)

    @property
    def tokens(self) -> int:
        return sum(p.new_tokens for p in self.prompts)

    @property
    def clipped_rounds(self) -> int:
        return sum(r.clipped for r in self.rounds)

    @property
    def exact(self) -> bool:
        """True if the replay equals a live greedy run round for round (time-independent
        policies, no clipped round)."""
        return not self.time_dependent and self.clipped_rounds == 0

    @property
    def token_count(self) -> int:
        return self.tokens

    @property
    def seconds(self) -> float:
        return sum(p.seconds for p in self.prompts)

    @property
    def ar_seconds(self) -> float:
        return sum(p.ar_seconds for p in self.prompts)

    @property
    def predicted_s(self) -> float:
        """Predicted live seconds: the priced rounds and requests plus the measured policy time."""
        return self.seconds + self.policy_s if self.seconds > 0 else 0.0

    @property
    def tokens_per_s(self) -> float | None:
        return self.tokens / self.predicted_s if self.seconds > 0 else None

    @property
    def speedup(self) -> float | None:
        """Predicted speed-up over plain decoding (same cost model)."""
        return self.ar_seconds / self.predicted_s if self.seconds > 0 else None

    def keys(self, prompt: int) -> list[tuple[str, int, int, int, int]]:
        return [r.key() for r in self.prompts[prompt].rounds]

    @property
    def policy_name(self) -> str:
        """Selector and length policy, e.g. ``ucbspec + static:k=5``."""
        parts = [self.selector] if self.selector != "static" or len(self.drafters) > 1 else []
        return " + ".join(parts + [self.length])

    @property
    def name(self) -> str:
        return f"{self.policy_name} over [{', '.join(self.drafters)}]"

    def summary(self) -> dict[str, Any]:
        return {"config": self.name, "selector": self.selector, "length": self.length, "k": self.k,
                "drafters": self.drafters, "prompts": len(self.prompts), "tokens": self.tokens,
                "rounds": self.n_rounds, "mat": self.mat, "acceptance_rate": self.acceptance_rate,
                "seconds": self.seconds, "predicted_s": self.predicted_s, "tokens_per_s": self.tokens_per_s,
                "speedup": self.speedup,
                "ar_seconds": self.ar_seconds, "clipped_rounds": self.clipped_rounds,
                "time_dependent": self.time_dependent, "exact": self.exact, "policy_s": self.policy_s,
                "replay_s": self.wall_s}

    def to_dict(self, rounds: bool = False) -> dict[str, Any]:
        out = self.summary()
        out["per_prompt"] = [{"index": p.index, "new_tokens": p.new_tokens, "rounds": len(p.rounds),
                              "stop_reason": p.stop_reason, "seconds": p.seconds, "ar_seconds": p.ar_seconds}
                             for p in self.prompts]
        if rounds:
            out["per_round"] = [asdict(r) for r in self.rounds]
        return out


# -- per-prompt views (plain Python lists: the replay loop is pure Python) ---------------------
@dataclass
class _View:
    chains: list[list[int]]  # [position][j]
    accepted: list[int]
    gammas: list[list[float]]
    stats: list[list[tuple[float, float, float]]] | None
    first: list[int]  # first chain token per position (-1: no proposal)


def _views(trace: Trace, p: int) -> list[_View]:
    key = ("views", p)
    got = trace.cache.get(key)
    if got is None:
        got = []
        for tr in trace.prompts[p].tracks:
            lens = tr.lengths.tolist()
            chains = [row[:n] for row, n in zip(tr.chains.tolist(), lens)]
            gammas = [row[:n] for row, n in zip(tr.gammas.tolist(), lens)]
            stats = None
            if tr.stats is not None:
                stats = [[tuple(s) for s in row[:n]] for row, n in zip(tr.stats.tolist(), lens)]
            got.append(_View(chains, tr.accepted.tolist(), gammas, stats,
                             [c[0] if c else -1 for c in chains]))
        trace.cache[key] = got
    return got


@dataclass
class _Pool:
    """The replayed drafters: trace indices (None for ``none``), names and costs."""

    src: list[int | None]
    labels: list[str]
    names: list[str]

    @classmethod
    def of(cls, trace: Trace, drafters: Sequence[str] | None) -> _Pool:
        chosen = list(drafters) if drafters else list(trace.specs)
        if not chosen:
            raise ConfigError("no drafters to replay")
        src: list[int | None] = []
        for d in chosen:
            src.append(None if d == NONE and NONE not in trace.specs else trace.index_of(d))
        if len(set(src)) != len(src):
            raise ConfigError(f"drafters {chosen} list a drafter twice: remove the duplicate")
        labels = [NONE if s is None else trace.specs[s] for s in src]
        names = [NONE if s is None else trace.names[s] for s in src]
        return cls(src, labels, names)


def _label(spec: str | DrafterPolicy | LengthPolicy | int | None, kind: str, k: int) -> str:
    if spec is None:
        return "static" if kind == "selector" else f"static:k={k}"
    if isinstance(spec, int):
        return f"static:k={spec}"
    return spec if isinstance(spec, str) else spec.name


# -- pricing ------------------------------------------------------------------------------------
class _RoundPricer:
    """Predicted seconds of the parts of a round and a request from a trace's costs; all zero
    for a trace recorded without costs. ``t`` is the context (tokens before the round), so
    the target's cache holds ``t - 1`` tokens."""

    def __init__(self, trace: Trace, pool: _Pool, costs: VerifyCostSurface | None = None):
        on = trace.surface is not None
        #: V as the live runs pay it (the surface times ``EngineOverheads.verify_factor`` of the
        #: width); a swapped-in surface (``replay(costs=...)``, e.g. another backend's) is used
        #: as given, prefills included
        o = trace.overheads
        self.swapped = costs is not None and on
        self.surface: VerifyCostSurface | None = (
            costs if self.swapped else trace.surface.scaled(o.verify_factor) if on else None)
        #: V as the live policies read it: the measured surface the engine loads, unscaled
        #: (``Trace.policy_surface`` if the recording re-measured another one)
        self.policy_surface: VerifyCostSurface | None = (
            costs if self.swapped else (trace.policy_surface or trace.surface) if on else None)
        self.costs: list[DrafterCosts | None] = [trace.drafter_costs[s] if on and s is not None else None
                                                 for s in pool.src]
        self.over = trace.overheads if on else EngineOverheads()

    def verify(self, width: int, t: int) -> float:
        return self.surface.cost(width, t - 1) if self.surface is not None else 0.0

    def draft(self, i: int, n: int, t: int) -> float:
        c = self.costs[i]
        return c.draft(n, t) if c is not None else 0.0

    def catch_up(self, i: int, n: int, t: int) -> float:
        c = self.costs[i]
        return c.catch_up(n, t) if c is not None and n > 0 else 0.0

    def drafter_prefill(self, i: int, n_prompt: int) -> float:
        c = self.costs[i]
        return c.prefill(n_prompt) if c is not None else 0.0

    def evaluate(self, scored: Iterable[int], m: int, t: int) -> float:
        """Full-information scoring of ``m`` verified tokens by the drafters ``scored``."""
        if self.surface is None:
            return 0.0
        return sum((self.costs[j].evaluate(m, t) if self.costs[j] is not None else self.over.none_evaluate(m))
                   for j in scored)

    def request(self, pt: PromptTrace) -> float:
        """Target prefill of all prompt tokens but the last (measured for this prompt in the
        recording's AR run; else the surface's), plus the per-request overhead."""
        if self.surface is None:
            return 0.0
        prefill = pt.prefill_s if pt.prefill_s > 0 and not self.swapped else self.surface.prefill(pt.n_prompt - 1)
        return prefill + self.over.request_s

    def round_overhead(self) -> float:
        return self.over.round_s if self.surface is not None else 0.0

    def ar(self, pt: PromptTrace, new_tokens: int) -> float:
        """Plain decoding of ``new_tokens``: one width-1 forward per token at its context."""
        if self.surface is None:
            return 0.0
        o, n = self.over.round_s, pt.n_prompt
        return self.request(pt) + sum(self.verify(1, n + x) + o for x in range(new_tokens))


# -- the replay loop ------------------------------------------------------------------------
class ReplayClock:
    """Virtual seconds for a replayed round: the replayed work (drafting, catch-up, prompt
    ingestion, scoring, verification, the engine's round overhead) advances it by its recorded
    price, and nothing else does, so the round's own bookkeeping (``round.Round``) measures
    priced seconds and the replay is deterministic."""

    def __init__(self) -> None:
        self.now = 0.0
        self._pending = 0.0

    def __call__(self) -> float:
        t, self.now, self._pending = self.now, self.now + self._pending, 0.0
        return t

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def after_next(self, seconds: float) -> None:
        """Advance by ``seconds`` right after the next reading (a price paid inside the phase
        that reading starts)."""
        self._pending += seconds


class ReplayDrafter(Drafter):
    """A recorded drafter as the round runs it in replay, its work priced on the virtual clock.

    Live (model-free drafters that can be rebuilt from their spec without the target, and
    ``none``): the drafter itself drafts, looks, scores and grows trees on the recorded greedy
    path, as it did live (a lookup, no model). Recorded (model drafters, drafters that learn from
    the target's rows, or that cannot be rebuilt): its chain at each path position is the
    trace's, looked at through the rebuilt drafter where one exists (so a look carries its match
    length), scored by its recorded first tokens, and a round drafting past the recorded
    ``max_draft`` is cut there (``clipped``; ``strict`` raises)."""

    def __init__(self, j: int, src: int | None, trace: Trace, price: _RoundPricer, clock: ReplayClock,
                 live: Drafter | None, recorded: bool, strict: bool):
        self.j, self.src, self.price, self.clock = j, src, price, clock
        self.live, self.recorded, self.strict = live, recorded, strict
        self.max_draft = trace.max_draft
        self.name = NONE if src is None else trace.names[src]
        is_model = src is not None and trace.is_model[src]
        family = live.family if live is not None else drafter_family(trace.specs[src]) if src is not None else NONE
        # looked at as live drafters are (the model-free ones), trees from the live ones only; it
        # neither forks nor observes the target (a recorded drafter's rows are the trace's)
        self.caps = DrafterCaps(family=family, runs_model=is_model, free_looks=not is_model, forks=False,
                                drafts_trees=not recorded and live is not None and live.caps.drafts_trees,
                                observes_target=False)
        self.view: _View | None = None
        self.clipped = False
        self._n_prompt = self._seen = 0
        self._looked: tuple[int, int] = (-1, 0)  # (context length, tokens priced) of the last look

    def start(self, view: _View | None) -> None:
        self.view = view

    def begin_request(self, prompt_ids: Sequence[int]) -> None:
        self._n_prompt, self._seen, self._looked = len(prompt_ids), 0, (-1, 0)
        if self.live is not None:
            self.live.begin_request(prompt_ids)

    def _pay_catch_up(self, t: int) -> None:
        """The prompt's ingestion at the first use, then the tokens past what it has seen."""
        if self._seen == 0:
            self.clock.advance(self.price.drafter_prefill(self.j, self._n_prompt))
            self._seen = self._n_prompt
        if t > self._seen:
            self.clock.advance(self.price.catch_up(self.j, t - self._seen, t))
            self._seen = t

    def saw(self, length: int) -> None:
        """The round counts the drafter as caught up to ``length`` tokens (``Row.seen``): its
        catch-up is priced from there, as the engine counts it."""
        if length > self._seen:
            self._seen = length

    def catch_up(self, context: Sequence[int]) -> None:
        self._pay_catch_up(len(context))
        if self.live is not None:
            self.live.catch_up(context)

    def _chain(self, t: int) -> list[int]:
        return self.view.chains[t - self._n_prompt] if self.view is not None else []

    def peek(self, context: Sequence[int], max_tokens: int) -> Peek | None:
        t = len(context)
        self._pay_catch_up(t)
        look = self.live.peek(context, max_tokens) if self.live is not None else None
        if self.recorded:
            chain = self._chain(t)[:max_tokens]
            look = look if look is not None and look.tokens == chain else Peek(chain)
        if look is not None:  # a look again at the same context pays only its further tokens
            priced = self._looked[1] if self._looked[0] == t else 0
            self.clock.advance(self.price.draft(self.j, max(0, len(look.tokens) - priced), t))
            self._looked = (t, max(priced, len(look.tokens)))
        return look

    def draft(self, context, max_tokens, sampling, generator, decide, want_hidden=False) -> Draft:
        t = len(context)
        if not self.recorded:
            out = self.live.draft(context, max_tokens, sampling, generator, decide, want_hidden) \
                if self.live is not None else Draft()
        else:
            out = Draft(tokens=self._recorded_draft(t, max_tokens, decide))
        self.clock.advance(self.price.draft(self.j, len(out.tokens), t))
        return out

    def _recorded_draft(self, t: int, cap: int, decide: Callable[[DraftStep], Decision]) -> list[int]:
        view, x = self.view, t - self._n_prompt
        chain = self._chain(t)
        stats = view.stats[x] if view is not None and view.stats is not None else None
        tokens: list[int] = []
        for j in range(cap):
            if j >= len(chain):
                if len(chain) >= self.max_draft:  # the recording stopped here, the drafter might not have
                    if self.strict:
                        raise ConfigError(
                            f"the policy drafts past the recorded max_draft={self.max_draft}: record with a "
                            "larger max_draft or cap the policy (e.g. max_len=...)")
                    self.clipped = True
                break
            verdict = decide(DraftStep(j, chain[j], stats=StepStats(*stats[j]) if stats is not None else None))
            if verdict is Decision.DISCARD:
                break
            tokens.append(chain[j])
            if verdict is Decision.STOP:
                break
        return tokens

    def draft_tree(self, context, max_depth, max_nodes, sampling, **kwargs) -> DraftTree:
        tree = self.live.draft_tree(context, max_depth, max_nodes, sampling, **kwargs)
        self.clock.advance(self.price.draft(self.j, len(tree), len(context)))
        return tree

    def score(self, context, verified, sampling) -> Proposals:
        t, m = len(context), len(verified)
        if self.recorded or self.live is None:
            first = self.view.first if self.view is not None else []
            x = t - self._n_prompt
            props = Proposals(tokens=[first[x + y] if x + y < len(first) else -1 for y in range(m)])
        else:
            props = self.live.score(context, verified, sampling)
        self.clock.advance(self.price.evaluate([self.j], m, t))
        self._seen = t + m
        return props

    def end_request(self, output_ids: Sequence[int]) -> None:
        if self.live is not None:
            self.live.end_request(output_ids)

    def recorded_gammas(self, t: int, chain: list[int]) -> list[float] | None:
        """The recorded acceptance probabilities of ``chain`` drafted at context ``t``, when it is
        the recorded chain's prefix (else None)."""
        if self.view is None or not chain:
            return None
        x = t - self._n_prompt
        return self.view.gammas[x][: len(chain)] if self.view.chains[x][: len(chain)] == chain else None

    def recorded_accepted(self, t: int) -> int:
        return self.view.accepted[t - self._n_prompt] if self.view is not None else 0


def _replay_drafters(trace: Trace, pool: _Pool, price: _RoundPricer, clock: ReplayClock,
                     strict: bool) -> list[ReplayDrafter]:
    """The pool's drafters for replay: live where a drafter can be rebuilt from its spec without
    the target and needs nothing a trace lacks (a model, the target's rows), else recorded."""
    out = []
    for j, src in enumerate(pool.src):
        live: Drafter | None = NoDrafter() if src is None else None
        if src is not None and not trace.is_model[src]:
            try:  # rebuilt from its spec through the registry when it needs no target
                spec = parse_drafter(trace.specs[src])
                live = None if spec.needs_target else build_drafter(spec.text, None)
            except Exception:  # noqa: BLE001 - any failure (e.g. a moved datastore file): the recorded chains
                live = None
        recorded = src is not None and (live is None or live.caps.runs_model or live.caps.observes_target)
        out.append(ReplayDrafter(j, src, trace, price, clock, live, recorded, strict))
    return out


def _oracle(row: Row, plan: RowPlan, drafters: Sequence[ReplayDrafter], path: Sequence[int]) -> Outcome:
    """What the recorded target made of a plan: a greedy target's argmax at every position of
    the recorded path is the path's next token, so a chain is accepted as far as it follows
    the path (a recorded chain: as far as the recording accepted it) and a tree along its path
    (``trees.walk_tree``); off-path nodes are never accepted. The acceptance probabilities are
    the recorded ones where the chain is the recorded one, else its realised 0/1."""
    t = len(row.tokens)
    if plan.tree is not None:
        depth = [0] * (len(plan.tree) + 1)
        for i, parent in enumerate(plan.tree.parents):
            depth[i + 1] = depth[parent + 1] + 1
        return tree_outcome(plan.tree, walk_tree(plan.tree, lambda r: path[t + depth[r]]))[0]
    chain, d = plan.draft.tokens, drafters[plan.drafter]
    if d.recorded:
        n = min(d.recorded_accepted(t), len(chain)) if chain else 0
    else:
        n = 0
        while n < len(chain) and chain[n] == path[t + n]:
            n += 1
    gammas = d.recorded_gammas(t, chain)
    return Outcome(n, path[t + n], recorded=gammas if gammas is not None else [1.0] * n + [0.0] * (len(chain) - n))


def replay(trace: Trace, selector: str | DrafterPolicy | None = None,
           length: str | int | LengthPolicy | None = None, k: int = 5,
           drafters: Sequence[str] | None = None, max_new_tokens: int | None = None,
           strict: bool = False, costs: VerifyCostSurface | None = None,
           tree: bool = False, tree_nodes: int = 15) -> ReplayResult:
    """Replay ``selector`` x ``length`` (names as for the engine, or fresh instances) over the
    trace's prompts in order, through the engine's own round (``round.Round``). ``drafters``:
    subset / order of the recorded drafters by spec or name (``"none"`` is always available);
    default all, in recording order. ``max_new_tokens`` may lower the recorded budget.
    ``strict``: raise instead of clipping a recorded chain at the recorded ``max_draft``.
    ``costs``: price rounds on this verify-cost surface instead of the recorded one (as
    measured: no ``verify_scale``; prefills from it too), e.g. another backend's: greedy paths
    are the target's argmax on every backend, so the trace's acceptance data transfers (up to
    near-ties); drafter and engine overheads stay recorded. ``tree`` / ``tree_nodes``: draft
    trees from the drafters that replay live (model-free), as ``SpeculativeEngine(tree=True)``."""
    validate_k(k)
    if tree and (isinstance(tree_nodes, bool) or not isinstance(tree_nodes, int) or tree_nodes < 1):
        raise ConfigError(f"tree_nodes must be an integer >= 1, got {tree_nodes!r}")
    pool = _Pool.of(trace, drafters)
    price = _RoundPricer(trace, pool, costs)
    clock = ReplayClock()
    replayed = _replay_drafters(trace, pool, price, clock, strict)
    sel, ln = build_policies(selector, length, k, n_drafters=len(pool.src))
    bind_policies(sel, ln, replayed, tree)
    if ln.caps.needs_hidden and any(d.caps.runs_model for d in replayed):
        raise ConfigError(f"length policy {ln.name!r} reads model drafters' hidden states, which a trace "
                          "does not record: replay it with model-free drafters only, or run it live "
                          "(adaspec bench)")
    budget = trace.max_new_tokens if max_new_tokens is None else max_new_tokens
    if not isinstance(budget, int) or not 1 <= budget <= trace.max_new_tokens:
        raise ConfigError(f"max_new_tokens must be in [1, {trace.max_new_tokens}] (the recorded budget), "
                          f"got {max_new_tokens!r}")
    # as in the engine: the surface it loads, its noise pooled as the engine's policies read
    # it (``VerifyCostSurface.denoised``; not the live/measured-scaled one replay prices with:
    # the scale is not what live policies see), and running means of the (synthesised)
    # drafter costs
    policy_surface = price.policy_surface
    cost_model = CostModel(None if policy_surface is None else policy_surface.denoised())
    for policy in (sel, ln):
        if policy.caps.prices_rounds:
            policy.costs = cost_model
    parts = RowParts(list(replayed), sel, ln, cost_model, tree=tree, tree_nodes=tree_nodes)
    rnd = Round(lambda ids: "", set(trace.eos_ids) if trace.stop_on_eos else set(), clock=clock, tick=clock,
                stopwatch=time.perf_counter)
    time_dep = sel.caps.time_dependent or ln.caps.time_dependent
    result = ReplayResult(sel.name if selector is None else _label(selector, "selector", k),
                          ln.name if length is None and ln.name != "static" else _label(length, "length", k),
                          k, pool.labels, [], time_dep)
    t0 = time.perf_counter()
    for p in range(len(trace.prompts)):
        result.prompts.append(_replay_prompt(trace, p, parts, rnd, clock, price, budget))
    result.policy_s = rnd.policy_s
    result.wall_s = time.perf_counter() - t0
    return result


def _replay_prompt(trace: Trace, p: int, parts: RowParts, rnd: Round, clock: ReplayClock,
                   price: _RoundPricer, budget: int) -> PromptReplay:
    """One request through the round, verified by the recorded target (``_oracle``), greedy."""
    pt: PromptTrace = trace.prompts[p]
    views = _views(trace, p)
    drafters: list[ReplayDrafter] = parts.drafters  # type: ignore[assignment]
    for d in drafters:
        d.start(views[d.src] if d.src is not None else None)
    cfg = GenerationConfig(max_new_tokens=budget, stop_on_eos=trace.stop_on_eos)
    row = Row.new(p, parts, pt.prompt, cfg, "cpu", clock())
    rnd.begin(row)
    rounds: list[ReplayRound] = []
    while True:
        for d in drafters:
            d.clipped = False
        plan = rnd.plan_row(row)
        outcome = _oracle(row, plan, drafters, pt.path)
        t = len(row.tokens)
        t_verify = clock()
        clock.advance(price.verify(plan.width, t))
        verify_s = clock() - t_verify
        clock.after_next(price.round_overhead())  # the round's own work: paid in its bookkeeping
        settled = rnd.settle(row, plan, outcome, verify_s)
        for d, seen in zip(drafters, row.seen):  # the round's bookkeeping of what each has seen
            d.saw(seen)
        rec = settled.record
        rounds.append(ReplayRound(p, len(rounds), plan.drafter, rec.drafter, plan.cap, rec.drafted, rec.accepted,
                                  rec.emitted, rec.catch_up_tokens, rec.total_s,
                                  drafters[plan.drafter].clipped))
        if settled.reason:
            break
    rnd.finish(row)
    new = len(row.output)
    total = price.request(pt) + sum(r.seconds for r in rounds) if trace.surface is not None else 0.0
    return PromptReplay(p, new, settled.reason, total, price.ar(pt, new), rounds)


# -- bench configurations -----------------------------------------------------------------------
def predict_config(trace: Trace, drafters: Sequence[Any], selector: str | None, length: str | None,
                   k: int, tree: bool = False) -> ReplayResult:
    """Replay one bench configuration (its drafter specs, selector, length policy and k) on a
    trace; plain decoding (no drafters) is the ``none`` drafter alone. Raises ConfigError
    when the trace cannot replay it (a drafter it did not record, a policy needing hidden
    states, a drafter instance, draft trees)."""
    specs = [d if isinstance(d, str) else None for d in drafters]
    if None in specs:
        raise ConfigError("drafter instances cannot be matched to a trace: give drafter specs")
    return replay(trace, selector, length, k=k, drafters=specs or [NONE], tree=tree)


def predict_configs(trace: Trace, configs: Sequence[Any]) -> dict[str, ReplayResult | str]:
    """``predict_config`` for bench configurations (``BenchConfig``): name -> replay, or the
    reason it cannot be replayed (peers run Hugging Face's loop, not the engine's)."""
    out: dict[str, ReplayResult | str] = {}
    for c in configs:
        if c.peer:
            out[c.name] = "peer (not the engine's loop)"
            continue
        try:
            out[c.name] = predict_config(trace, c.drafters, c.selector, c.length, c.k,
                                         tree=c.tree)
        except ConfigError as exc:
            out[c.name] = str(exc)
    return out


# -- oracle bounds ------------------------------------------------------------------------------
def _metrics(tokens: int, rounds: int, seconds: float, ar_seconds: float) -> dict[str, Any]:
    return {"tokens": tokens, "rounds": rounds, "mat": tokens / rounds if rounds else 0.0,
            "seconds": seconds, "tokens_per_s": tokens / seconds if seconds > 0 else None,
            "speedup": ar_seconds / seconds if seconds > 0 else None}


def _best_fixed(fixed: dict[str, Any], labels: Sequence[str], n_prompts: int, crit: str,
                ar_total: float) -> dict[str, Any]:
    """Per prompt the best fixed drafter's replay (``crit``: ``by_mat``, fewest rounds first, or
    ``by_time``, least time first), summed over the prompts, with the choices."""
    rounds = seconds = 0.0
    choice = []
    for p in range(n_prompts):
        def score(lab: str, p: int = p) -> tuple[float, float]:
            pr = fixed[lab].prompts[p]
            return (len(pr.rounds), pr.seconds) if crit == "by_mat" else (pr.seconds, len(pr.rounds))
        best = min(labels, key=score)
        choice.append(best)
        rounds += len(fixed[best].prompts[p].rounds)
        seconds += fixed[best].prompts[p].seconds
    tokens = next(iter(fixed.values())).tokens
    return _metrics(tokens, int(rounds), seconds, ar_total) | {"choice": choice}


def oracle_bounds(trace: Trace, k: int = 5, drafters: Sequence[str] | None = None,
                  costs: VerifyCostSurface | None = None) -> dict[str, Any]:
    """Hindsight bounds on a trace, with predicted times from its cost model.

    * ``fixed``: every drafter alone at static ``k`` (a replay);
    * ``best_fixed``: per prompt the best of them, ``by_mat`` (fewest rounds) and ``by_time``;
    * ``oracle_length``: per drafter, SpecDec++ Thm 4.1 (every round drafts exactly the
      tokens the target will accept, up to the recorded max_draft: nothing is discarded);
    * ``greedy_oracle_k`` / ``greedy_oracle``: each round the drafter with the longest accepted
      run, drafting exactly that run, capped at ``k`` / at max_draft;
    * ``dp_rounds``: fewest rounds over any per-round choice of drafter and length (dynamic
      programming over positions; the greedy choice is not always optimal), so its MAT bounds
      every policy's on this trace; ``dp_time``: least predicted time the same way, drafting
      any recorded number of tokens (a wider verify can be cheaper on a cost cliff).
    Oracle times count the target prefill, drafting, verification and the engine's round
    overhead only (no drafter prefill, catch-up, evaluation or policy time), so they are
    lower bounds. ``costs``: another verify-cost surface, as in ``replay``.
    """
    validate_k(k)
    pool = _Pool.of(trace, drafters)
    price = _RoundPricer(trace, pool, costs)
    col = {s: i for i, s in enumerate(pool.src) if s is not None}
    fixed = {lab: replay(trace, None, None, k=k, drafters=[lab], costs=costs) for lab in pool.labels}
    ar_total = sum(r.ar_seconds for r in fixed.values()) / len(fixed)
    tokens = next(iter(fixed.values())).tokens
    out: dict[str, Any] = {"k": k, "max_draft": trace.max_draft, "tokens": tokens, "ar_seconds": ar_total,
                           "fixed": {lab: _metrics(r.tokens, r.n_rounds, r.seconds, r.ar_seconds)
                                     for lab, r in fixed.items()}}
    out["best_fixed"] = {crit: _best_fixed(fixed, pool.labels, len(trace.prompts), crit, ar_total)
                         for crit in ("by_mat", "by_time")}

    def round_s(p: int, x: int, j: int, d: int | None) -> float:
        """A round at position x of prompt p in which recorded drafter d drafts j tokens."""
        t = trace.prompts[p].n_prompt + x
        drafting = price.draft(col[d], j, t) if d is not None else 0.0
        return drafting + price.verify(j + 1, t) + price.round_overhead()

    def start_s(p: int) -> float:
        return price.request(trace.prompts[p])

    def walk(choose) -> tuple[int, float]:
        """Rounds and seconds of a per-round rule choose(p, x, remaining) -> (drafter, n)."""
        rounds, seconds = 0, 0.0
        for p, pt in enumerate(trace.prompts):
            end = min(pt.n_out, trace.max_new_tokens)
            x = 0
            seconds += start_s(p)
            while x < end:
                d, n = choose(p, x, trace.max_new_tokens - x)
                rounds += 1
                seconds += round_s(p, x, n, d)
                x = min(x + n + 1, end)
        return rounds, seconds

    srcs = [s for s in pool.src if s is not None]

    def acc(p: int, d: int, x: int) -> int:
        return _views(trace, p)[d].accepted[x]

    for lab, s in zip(pool.labels, pool.src):
        if s is None:
            continue
        r, sec = walk(lambda p, x, rem, s=s: (s, min(acc(p, s, x), rem - 1)))
        out.setdefault("oracle_length", {})[lab] = _metrics(tokens, r, sec, ar_total)

    def greedy(cap: int):
        def choose(p: int, x: int, rem: int) -> tuple[int | None, int]:
            best, n = None, 0
            for s in srcs:
                a = min(acc(p, s, x), cap, rem - 1)
                if a > n:
                    best, n = s, a
            return best, n
        return choose

    out["greedy_oracle_k"] = _metrics(tokens, *walk(greedy(k)), ar_total)
    out["greedy_oracle"] = _metrics(tokens, *walk(greedy(trace.max_draft)), ar_total)
    out["dp_rounds"] = _metrics(tokens, *_dp(trace, srcs, False, round_s, start_s), ar_total)
    out["dp_time"] = _metrics(tokens, *_dp(trace, srcs, True, round_s, start_s), ar_total)
    return out


def _dp(trace: Trace, srcs: list[int], by_time: bool, round_s, start_s) -> tuple[int, float]:
    """Optimal per-round drafter and length in hindsight: fewest rounds (ties: less time) or
    least time (ties: fewer rounds), with ``round_s(p, x, drafted, drafter)`` and
    ``start_s(p)`` the priced round and request start. Returns (rounds, seconds)."""
    total_r, total_s = 0, 0.0
    for p, pt in enumerate(trace.prompts):
        views = _views(trace, p)
        end = min(pt.n_out, trace.max_new_tokens)
        best: list[tuple[float, float]] = [(0.0, 0.0)] * (end + 1)  # (primary, secondary) to go
        for x in range(end - 1, -1, -1):
            rem = trace.max_new_tokens - x
            # no draft: one plain step
            cands = [(0, None, 0)]  # (drafted, drafter, accepted)
            for s in srcs:
                a = views[s].accepted[x]
                hi = min(len(views[s].chains[x]), rem - 1) if by_time else min(a, rem - 1)
                for j in range(1, hi + 1):
                    cands.append((j, s, min(a, j)))
            opt = None
            for j, s, a in cands:
                nxt = best[min(x + a + 1, end)]
                sec = round_s(p, x, j, s) + (nxt[0] if by_time else nxt[1])
                rnd = 1 + (nxt[1] if by_time else nxt[0])
                val = (sec, rnd) if by_time else (rnd, sec)
                if opt is None or val < opt:
                    opt = val
            best[x] = opt
        r, s = (best[0][1], best[0][0]) if by_time else best[0]
        total_r += int(r)
        total_s += s + start_s(p)
    return total_r, total_s


# -- command line -------------------------------------------------------------------------------
def load_surface(path: str) -> VerifyCostSurface:
    """A verify-cost surface from JSON (``VerifyCostSurface.to_dict``); ConfigError if unreadable."""
    try:
        return VerifyCostSurface.from_dict(json.loads(Path(path).read_text(encoding="utf-8")))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"cannot read a verify-cost surface from {path}: {exc}") from None


def _configs(trace: Trace, selectors: Sequence[str], lengths: Sequence[str], ks: Sequence[int],
             drafters: Sequence[str] | None) -> list[dict[str, Any]]:
    """Like ``adaspec bench``: every drafter alone at every K (when no selector or length is
    given), every selector over the pool (with each length, or static at each K), and every
    length policy with each drafter."""
    pool = list(drafters) if drafters else list(trace.specs)
    out: list[dict[str, Any]] = []
    if not selectors and not lengths:
        out += [{"selector": None, "length": None, "k": k, "drafters": [d]} for d in pool for k in ks]
    for s in selectors:
        if lengths:
            out += [{"selector": s, "length": ln, "k": ks[0], "drafters": pool} for ln in lengths]
        else:
            out += [{"selector": s, "length": None, "k": k, "drafters": pool} for k in ks]
    if lengths and not selectors:
        out += [{"selector": None, "length": ln, "k": ks[0], "drafters": [d]} for ln in lengths for d in pool]
    return out


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _bounds_table(bounds: dict[str, Any]) -> Any:
    """The hindsight bounds of ``oracle_bounds`` as a rich table."""
    from rich.markup import escape
    from rich.table import Table

    ob = Table(title=f"hindsight bounds (k={bounds['k']}, max_draft={bounds['max_draft']})")
    for col in ("bound", "MAT", "rounds", "pred. tokens/s", "pred. speed-up"):
        ob.add_column(col, justify="left" if col == "bound" else "right")
    rows = [(f"fixed {lab} k={bounds['k']}", m) for lab, m in bounds["fixed"].items()]
    rows += [("best fixed per prompt (MAT)", bounds["best_fixed"]["by_mat"]),
             ("best fixed per prompt (time)", bounds["best_fixed"]["by_time"])]
    rows += [(f"oracle length (Thm 4.1) {lab}", m) for lab, m in bounds.get("oracle_length", {}).items()]
    rows += [(f"per-round oracle, cap k={bounds['k']}", bounds["greedy_oracle_k"]),
             ("per-round oracle (greedy)", bounds["greedy_oracle"]),
             ("per-round oracle (fewest rounds)", bounds["dp_rounds"]),
             ("per-round oracle (least time)", bounds["dp_time"])]
    for name, m in rows:
        ob.add_row(escape(name), f"{m['mat']:.2f}", str(m["rounds"]), _fmt(m["tokens_per_s"], ".1f"),
                   _fmt(m["speedup"], ".2f") + "x")
    return ob


def replay_command(
    trace: str = typer.Argument(..., help="trace file written by `adaspec bench --record FILE`"),
    selector: list[str] = typer.Option([], "--selector", "-s", help="drafter policy, repeatable"),
    length: list[str] = typer.Option([], "--length", "-l", help="length policy, repeatable"),
    k: list[int] = typer.Option([5], "--k", "-k", help="static draft length(s), repeatable"),
    drafter: list[str] = typer.Option([], "--drafter", "-d",
                                      help="recorded drafters to use, in this order ('none' always available)"),
    oracle: bool = typer.Option(True, "--oracle/--no-oracle", help="also print hindsight bounds"),
    json_out: str | None = typer.Option(None, "--json", help="write the results as JSON here"),
    costs_file: str | None = typer.Option(None, "--costs", help="price on this verify-cost surface (JSON, as "
                                          "`adaspec costs` caches it), e.g. another backend's"),
    tree: bool = typer.Option(False, "--tree", help="draft trees from the model-free drafters (as the engine's "
                              "tree=True): replayed on the recorded greedy path"),
    tree_nodes: int = typer.Option(15, "--tree-nodes", help="most nodes of a draft tree (with --tree)"),
) -> None:
    """Evaluate drafter x length policies on a recorded greedy trace, without models: MAT and
    acceptance are exact for time-independent policies; times are predicted from the recorded
    costs."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from ..options import fail

    try:
        for kk in k:
            validate_k(kk)
        for spec in selector:  # policy specs checked before the trace is read
            build_selector(spec)
        for spec in length:
            build_length(spec)
        tr = Trace.load(trace)
        surface = load_surface(costs_file) if isinstance(costs_file, str) else None  # (called directly: OptionInfo)
        tree = tree if isinstance(tree, bool) else False  # (called directly: OptionInfo)
        tree_nodes = tree_nodes if isinstance(tree_nodes, int) else 15
        results = [replay(tr, c["selector"], c["length"], c["k"], c["drafters"], costs=surface, tree=tree,
                          tree_nodes=tree_nodes)
                   for c in _configs(tr, selector, length, k, drafter or None)]
        bounds = oracle_bounds(tr, k[0], drafter or None, costs=surface) if oracle else None
    except AdaspecError as exc:
        fail(exc)
    n_tok = sum(min(p.n_out, tr.max_new_tokens) for p in tr.prompts)
    pools = {tuple(r.drafters) for r in results}
    one_pool = len(pools) == 1
    console = Console()
    table = Table(title=escape(f"replay of {trace}: {len(tr.prompts)} requests, {n_tok} tokens, "
                               f"target {tr.target.get('name')}"
                               + (f", drafters [{', '.join(next(iter(pools)))}]" if one_pool else "")))
    for col in ("configuration", "pred. tokens/s", "pred. speed-up", "MAT", "acceptance", "rounds", "exact"):
        table.add_column(col, justify="left" if col == "configuration" else "right")
    for r in results:
        exact = "yes" if r.exact else ("time-dep." if r.time_dependent else f"clipped {r.clipped_rounds}")
        table.add_row(escape(r.policy_name if one_pool else r.name), _fmt(r.tokens_per_s, ".1f"),
                      _fmt(r.speedup, ".2f") + "x", f"{r.mat:.2f}",
                      f"{r.acceptance_rate:.1%}" if r.drafted else "-", str(r.n_rounds), exact)
    console.print(table)
    total_rounds = sum(r.n_rounds for r in results)
    total_s = sum(r.wall_s for r in results)
    console.print(f"[dim]{len(results)} replays, {total_rounds} rounds in {total_s:.2f} s "
                  f"({total_rounds / total_s if total_s else 0:.0f} rounds/s); times predicted from the recorded "
                  "costs; 'time-dep.' policies read round times, so their replay is not a live run[/]")
    if bounds is not None:
        console.print(_bounds_table(bounds))
    if json_out:
        doc = {"trace": trace, "target": tr.target, "drafters": tr.specs,
               "results": [r.to_dict() for r in results], "oracle": bounds}
        Path(json_out).write_text(json.dumps(doc, indent=1), encoding="utf-8")
        console.print(f"written: {json_out}")


__all__ = ["ReplayResult", "ReplayRound", "PromptReplay", "time_dependent_policies", "load_surface", "oracle_bounds", "predict_config",
           "predict_configs", "replay", "replay_command"]
