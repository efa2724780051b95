"""Model-free replay of a recorded trace: any drafter policy x length policy in seconds.

``replay`` runs the engine's round loop (``SpeculativeEngine._run``) on a ``Trace``
(``adaspec.trace``) instead of models, step for step: ``selector.select()``; cap =
``min(length.begin_round(i), remaining - 1)``; the drafter's recorded chain at the current
position is offered token by token to ``length.decide`` (CONTINUE / STOP / DISCARD as in the
drafters, ``DraftStep.stats`` carrying q's statistics for model drafters); the round accepts
``min(n_acc, drafted)`` tokens and emits them plus the target's next path token; EOS and the
token budget cut the round as ``_apply_stops`` does; then the selector and the length policy
learn from a ``RoundFeedback`` with the recorded acceptance probabilities, the full-information
counterfactuals (each other drafter's first chain token at every emitted position, as
``_evaluate_others`` computes them under greedy decoding), and synthesised times. Drafter
prefill, catch-up tokens and the full-information "everyone is prefilled" rule follow the
engine's ``seen`` bookkeeping. Policies keep their state across the prompts of a replay as
across the requests of one engine (``scope=global`` carries over).

Exactness: for greedy decoding and time-independent policies the per-round (drafter, cap,
drafted, accepted, emitted) sequence equals a live run's ``stats.rounds`` (checked by
tests/test_trace_replay.py), up to floating-point batch invariance of the models (the
recording's forwards are batched differently from a live run's; a near-tie can flip). Rounds
that would draft past the recorded ``max_draft`` are cut there and counted (``clipped``).
Time-dependent policies (``TIME_DEPENDENT``: they read round seconds or the cost model) see
times synthesised from the recorded costs, so the replay is deterministic but not a live run.

Predicted seconds price every round where it runs (``_RoundPricer``): the verify-cost
surface V(k+1, L) at the round's cache length L (times the recorded live/measured ratio at
that width, ``EngineOverheads.verify_factor``), the drafter's cost functions of (tokens, L)
for drafting, catch-up, prompt prefill and full-information evaluation, the engine's
measured per-round and per-request overheads and the target prefill measured for the prompt
in the recording: the deterministic ``seconds``. Cost-aware policies decide on the surface the
live engines read (``Trace.policy_surface``, unscaled), as theirs did. The policies' own
compute time is measured during the replay (the same code runs live; ``policy_s``) and added
in ``predicted_s``, from which tokens/s and the speed-up are computed.
Not supported: sampling, stop strings, length policies that read a model drafter's
hidden states (``specdecpp`` with a model drafter; with model-free drafters it is static), and
draft trees (``tree=True`` raises ``ConfigError``): a trace records each drafter's *chain* at
every path position and the target's argmax path only, not the drafter's alternatives (the
tree's other branches, their scores) nor the target's argmax after off-path nodes, so a tree
round's accepted length cannot be computed from it; ``adaspec bench --tree`` lists its
``+tree`` configurations with that reason instead of a prediction. Trees are measured live.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import typer

from ..config import SamplingConfig, validate_k
from ..costs import CostModel, DrafterCosts, EngineOverheads, VerifyCostSurface
from ..drafters import Drafter, build_drafter, drafter_family
from ..drafters.base import Decision, Draft, DraftStep, Peek, StepStats
from ..errors import AdaspecError, ConfigError
from ..feedback import RoundFeedback
from ..engine import cut_at_stops
from ..metrics import RoundRates
from ..length import LengthPolicy, build_length
from ..selection import DrafterPolicy, build_policies, build_selector
from .trace import PromptTrace, Trace

GREEDY = SamplingConfig()
#: policies whose decisions depend on round times or the cost model: their replay is
#: deterministic (synthesised times) but not claimed equal to a live run
TIME_DEPENDENT = frozenset({"cost-ucb", "cost-exp3", "cost-hedgespec", "ucbspec-length", "cost-model", "auto"})
NONE = "none"


@dataclass
class _ReplayFeedback(RoundFeedback):
    """RoundFeedback whose ``acceptance_probs`` are the recorded ones (no target logits).

    Not ``gammas=``: under greedy decoding ``chosen_gammas`` must stay the realised 0/1
    acceptances, as in the engine, and it would read ``gammas`` instead."""

    recorded: list[float] = field(default_factory=list)

    @cached_property
    def acceptance_probs(self) -> list[float]:
        return list(self.recorded)


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
    return spec if isinstance(spec, str) else getattr(spec, "name", type(spec).__name__)


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
#: why replay refuses draft trees (module docstring)
TREES_NOT_REPLAYED = ("draft trees cannot be replayed: a trace records each drafter's chain and the target's "
                      "argmax path, not the tree's other branches nor the target's choice after them; "
                      "measure trees live (adaspec bench --tree)")


def replay(trace: Trace, selector: str | DrafterPolicy | None = None,
           length: str | int | LengthPolicy | None = None, k: int = 5,
           drafters: Sequence[str] | None = None, max_new_tokens: int | None = None,
           strict: bool = False, costs: VerifyCostSurface | None = None,
           tree: bool = False) -> ReplayResult:
    """Replay ``selector`` x ``length`` (names as for the engine, or fresh instances) over the
    trace's prompts in order. ``drafters``: subset / order of the recorded drafters by spec or
    name (``"none"`` is always available); default all, in recording order. ``max_new_tokens``
    may lower the recorded budget. ``strict``: raise instead of clipping a round at the
    recorded ``max_draft``. ``costs``: price rounds on this verify-cost surface instead of the
    recorded one (as measured: no ``verify_scale``; prefills from it too), e.g. another
    backend's: greedy paths are the target's argmax on every backend, so the trace's
    acceptance data transfers (up to near-ties); drafter and engine overheads stay recorded.
    ``tree=True`` raises: traces do not record trees (module docstring)."""
    if tree:
        raise ConfigError(TREES_NOT_REPLAYED)
    validate_k(k)
    pool = _Pool.of(trace, drafters)
    sel, ln = build_policies(selector, length, k, n_drafters=len(pool.src))
    for policy in (sel, ln):  # as the engine does
        if hasattr(policy, "bind_drafters"):
            policy.bind_drafters([s is not None and trace.is_model[s] for s in pool.src])
        if hasattr(policy, "bind_families"):
            policy.bind_families([drafter_family(trace.specs[s]) if s is not None else "none" for s in pool.src])
    if ln.needs_hidden and any(trace.is_model[s] for s in pool.src if s is not None):
        raise ConfigError(f"length policy {ln.name!r} reads model drafters' hidden states, which a trace "
                          "does not record: replay it with model-free drafters only, or run it live "
                          "(adaspec bench)")
    budget = trace.max_new_tokens if max_new_tokens is None else max_new_tokens
    if not isinstance(budget, int) or not 1 <= budget <= trace.max_new_tokens:
        raise ConfigError(f"max_new_tokens must be in [1, {trace.max_new_tokens}] (the recorded budget), "
                          f"got {max_new_tokens!r}")
    price = _RoundPricer(trace, pool, costs)
    # as in the engine: the surface it loads, its noise pooled as the engine's policies read
    # it (``VerifyCostSurface.denoised``; not the live/measured-scaled one replay prices with:
    # the scale is not what live policies see), and running means of the (synthesised)
    # drafter costs
    policy_surface = price.policy_surface
    cost_model = CostModel(None if policy_surface is None else policy_surface.denoised())
    for policy in (sel, ln):
        if getattr(policy, "wants_costs", False):
            policy.costs = cost_model
    time_dep = sel.name in TIME_DEPENDENT or ln.name in TIME_DEPENDENT
    result = ReplayResult(sel.name if selector is None else _label(selector, "selector", k),
                          ln.name if length is None and ln.name != "static" else _label(length, "length", k),
                          k, pool.labels, [],
                          time_dep)
    t0 = time.perf_counter()
    for p in range(len(trace.prompts)):
        result.prompts.append(_replay_prompt(trace, p, pool, sel, ln, cost_model, price, budget, strict,
                                             result))
    result.wall_s = time.perf_counter() - t0
    return result


def _peekers(trace: Trace, pool: _Pool, cheap: Sequence[int], prompt: Sequence[int]) -> dict[int, Drafter]:
    """Fresh model-free drafters rebuilt from the trace's specs, so that replay looks at blocks
    the way the engine does (with the match length behind them); a drafter that cannot be
    rebuilt without the target (e.g. a corpus to tokenize) falls back to the recorded chains."""
    out: dict[int, Drafter] = {}
    for j in cheap:
        try:
            d = build_drafter(trace.specs[pool.src[j]], None)  # type: ignore[arg-type]
        except Exception:  # noqa: BLE001 - any failure: use the recorded chains
            continue
        if not d.is_model:
            d.begin_request(list(prompt))
            out[j] = d
    return out


def _replay_prompt(trace: Trace, p: int, pool: _Pool, sel: DrafterPolicy, ln: LengthPolicy,
                   cost_model: CostModel, price: _RoundPricer, budget: int, strict: bool,
                   result: ReplayResult) -> PromptReplay:
    """One request, mirroring ``SpeculativeEngine._run`` (greedy, no stop strings)."""
    pt: PromptTrace = trace.prompts[p]
    views = _views(trace, p)
    path, n_prompt = pt.path, pt.n_prompt
    eos = set(trace.eos_ids) if trace.stop_on_eos else set()
    L = trace.max_draft
    n_drafters = len(pool.src)
    clock = time.perf_counter
    policy_s = 0.0

    def decide(step: DraftStep) -> Decision:
        nonlocal policy_s
        c = clock()
        verdict = ln.decide(step)
        policy_s += clock() - c
        return verdict

    cost_model.last_width = 0  # as the engine: the prefill came last
    c = clock()
    sel.begin_request(pool.names)
    if hasattr(sel, "observe_prompt"):
        sel.observe_prompt(pt.prompt)
    ln.begin_request()
    policy_s += clock() - c
    seen = [0] * n_drafters
    t, remaining = n_prompt, budget
    rounds: list[ReplayRound] = []
    evaluate = getattr(sel, "evaluate", None)
    peek_k = int(getattr(sel, "peek_tokens", 0) or 0)
    looks = getattr(sel, "looks", None)
    cheap = [j for j, sj in enumerate(pool.src) if sj is not None and not trace.is_model[sj]]
    peekers = _peekers(trace, pool, cheap, pt.prompt) if peek_k else {}
    while True:
        cost_model.context = t - 1  # the target's cache length, as in the engine
        peek_s, ingest_s, peeked = 0.0, 0.0, set()
        looked = bool(peek_k) and (looks is None or looks())
        if looked:  # as SpeculativeEngine._peek: every model-free drafter's block, from the trace
            x0, top = t - n_prompt, min(peek_k, remaining - 1)
            blocks = {}
            for j in cheap:
                chain = views[pool.src[j]].chains[x0][:top]
                look = peekers[j].peek(path[:t], top) if j in peekers else None
                blocks[j] = look if look is not None and look.tokens == chain else Peek(chain)
                blocks[j].cut = len(blocks[j].tokens) >= top
                peek_s += price.catch_up(j, t - seen[j], t) if 0 < seen[j] < t else 0.0
                ingest_s += price.drafter_prefill(j, n_prompt) if seen[j] == 0 else 0.0
                peek_s += price.draft(j, len(blocks[j].tokens), t)
                seen[j] = t
            peeked = set(blocks)
            c = clock()
            sel.observe_proposals(blocks)
            policy_s += clock() - c
        c = clock()
        i = sel.select()
        if not 0 <= i < n_drafters:
            raise ConfigError(f"selector {sel.name!r} chose drafter #{i} of {n_drafters}")
        wanted = ln.begin_round(i)
        cap = min(wanted, remaining - 1)
        policy_s += clock() - c
        # priced peeks only (the engine also counts its planning's seconds): deterministic
        if looked and looks is not None and rounds:
            cost_model.observe_look(peek_s)
        src = pool.src[i]
        seconds = price.round_overhead() + peek_s + ingest_s
        if seen[i] == 0:  # first use in this request: drafter prefill of the prompt
            seen[i] = n_prompt
            seconds += price.drafter_prefill(i, n_prompt)
        catch_up = t - seen[i] if seen[i] < t else 0
        x = t - n_prompt
        tokens: list[int] = []
        clipped = False
        if cap > 0 and src is not None:
            view = views[src]
            chain = view.chains[x]
            stats = view.stats[x] if view.stats is not None else None
            for j in range(cap):
                if j >= len(chain):
                    if len(chain) >= L:  # the recording stopped here, the drafter might not have
                        if strict:
                            raise ConfigError(
                                f"prompt {p}, round {len(rounds)}: the policy drafts past the recorded "
                                f"max_draft={L}: record with a larger max_draft or cap the policy "
                                "(e.g. max_len=...)")
                        clipped = True
                    break
                step = DraftStep(j, chain[j], stats=StepStats(*stats[j]) if stats is not None else None)
                verdict = decide(step)
                if verdict is Decision.DISCARD:
                    break
                tokens.append(chain[j])
                if verdict is Decision.STOP:
                    break
        kd = len(tokens)
        n = min(views[src].accepted[x], kd) if kd else 0
        emitted, reason = cut_at_stops(path[t: t + n + 1], remaining, eos)
        m = len(emitted)
        # as the engine (``_draft_chain``): a look is the draft, continued past a look cut at its depth
        draft_s = 0.0
        if cap > 0 and i not in peeked:
            draft_s = price.draft(i, kd, t)
        elif cap > 0 and blocks[i].cut and kd > len(blocks[i].tokens):
            draft_s = price.draft(i, kd - len(blocks[i].tokens), t)
        verify_s = price.verify(kd + 1, t)
        catch_up_s = price.catch_up(i, catch_up, t)
        fb = _ReplayFeedback(
            round=len(rounds), drafter=i, draft=Draft(tokens=tokens), n_accepted=n, emitted=emitted,
            k_cap=cap, target_logits=None, sampling=GREEDY, draft_s=draft_s, verify_s=verify_s,
            catch_up_s=catch_up_s, catch_up_tokens=catch_up,
            recorded=views[src].gammas[x][:kd] if kd else [])
        eval_s = 0.0
        if sel.full_information and (n_drafters > 1 or wanted == 0):  # as SpeculativeEngine._evaluate_others
            cf: dict[int, list[float]] = {} if wanted == 0 else {i: fb.chosen_gammas()}
            alphas: dict[int, list[float]] = {}
            proposed: dict[int, list[bool]] = {}
            for j, sj in enumerate(pool.src):
                if (j == i and wanted != 0) or (evaluate is not None and not evaluate(j)):
                    continue
                first = views[sj].first if sj is not None else None
                g = [1.0 if first is not None and first[x + y] == path[t + y] else 0.0 for y in range(m)]
                cf[j], alphas[j] = g, list(g)
                proposed[j] = [first is not None and first[x + y] >= 0 for y in range(m)]
                seen[j] = t + m
            eval_s = price.evaluate(cf.keys() - ({i} if wanted != 0 else set()), m, t)
            fb.counterfactual, fb.counterfactual_alpha, fb.counterfactual_proposed = cf, alphas, proposed
        t += m
        remaining -= m
        seen[i] = t
        cost_model.observe(i, kd, draft_s, verify_s, catch_up, catch_up_s)
        # as the engine's: outside draft/verify/catch-up, prompt ingestion and scoring
        cost_model.observe_overhead(price.round_overhead() + peek_s)
        cost_model.last_width = kd + 1
        c = clock()
        sel.update(fb)
        ln.update(fb)
        policy_s += clock() - c
        rounds.append(ReplayRound(p, len(rounds), i, pool.names[i], cap, kd, n, m, catch_up,
                                  seconds + draft_s + verify_s + catch_up_s + eval_s, clipped))
        if reason:
            break
    result.policy_s += policy_s
    new = t - n_prompt
    ar = price.ar(pt, new)
    total = price.request(pt) + sum(r.seconds for r in rounds) if trace.surface is not None else 0.0
    return PromptReplay(p, new, reason, total, ar, rounds)


# -- bench configurations -----------------------------------------------------------------------
def predict_config(trace: Trace, drafters: Sequence[Any], selector: str | None, length: str | None,
                   k: int, tree: bool = False) -> ReplayResult:
    """Replay one bench configuration (its drafter specs, selector, length policy and k) on a
    trace; plain decoding (no drafters) is the ``none`` drafter alone. Raises ConfigError
    when the trace cannot replay it (a drafter it did not record, a policy needing hidden
    states, a drafter instance, draft trees)."""
    if tree:
        raise ConfigError(TREES_NOT_REPLAYED)
    specs = [d if isinstance(d, str) else None for d in drafters]
    if None in specs:
        raise ConfigError("drafter instances cannot be matched to a trace: give drafter specs")
    return replay(trace, selector, length, k=k, drafters=specs or [NONE])


def predict_configs(trace: Trace, configs: Sequence[Any]) -> dict[str, ReplayResult | str]:
    """``predict_config`` for bench configurations (``BenchConfig``): name -> replay, or the
    reason it cannot be replayed (peers run Hugging Face's loop, not the engine's)."""
    out: dict[str, ReplayResult | str] = {}
    for c in configs:
        if getattr(c, "peer", None):
            out[c.name] = "peer (not the engine's loop)"
            continue
        try:
            out[c.name] = predict_config(trace, c.drafters, c.selector, c.length, c.k,
                                         tree=getattr(c, "tree", False))
        except ConfigError as exc:
            out[c.name] = str(exc)
    return out


# -- oracle bounds ------------------------------------------------------------------------------
def _metrics(tokens: int, rounds: int, seconds: float, ar_seconds: float) -> dict[str, Any]:
    return {"tokens": tokens, "rounds": rounds, "mat": tokens / rounds if rounds else 0.0,
            "seconds": seconds, "tokens_per_s": tokens / seconds if seconds > 0 else None,
            "speedup": ar_seconds / seconds if seconds > 0 else None}


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
    for crit in ("by_mat", "by_time"):
        rounds = seconds = 0.0
        choice = []
        for p in range(len(trace.prompts)):
            def score(lab: str, p: int = p, crit: str = crit) -> tuple[float, float]:
                pr = fixed[lab].prompts[p]
                return (len(pr.rounds), pr.seconds) if crit == "by_mat" else (pr.seconds, len(pr.rounds))
            best = min(pool.labels, key=score)
            choice.append(best)
            rounds += len(fixed[best].prompts[p].rounds)
            seconds += fixed[best].prompts[p].seconds
        out.setdefault("best_fixed", {})[crit] = _metrics(tokens, int(rounds), seconds, ar_total) | {
            "choice": choice}

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
) -> None:
    """Evaluate drafter x length policies on a recorded greedy trace, without models: MAT and
    acceptance are exact for time-independent policies; times are predicted from the recorded
    costs."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    err = Console(stderr=True)
    try:
        for kk in k:
            validate_k(kk)
        for spec in selector:  # policy specs checked before the trace is read
            build_selector(spec)
        for spec in length:
            build_length(spec)
        tr = Trace.load(trace)
        surface = load_surface(costs_file) if isinstance(costs_file, str) else None  # (called directly: OptionInfo)
        results = [replay(tr, c["selector"], c["length"], c["k"], c["drafters"], costs=surface)
                   for c in _configs(tr, selector, length, k, drafter or None)]
        bounds = oracle_bounds(tr, k[0], drafter or None, costs=surface) if oracle else None
    except AdaspecError as exc:
        # escaped and unwrapped as cli.options.fail prints (bench may not import the cli)
        err.print(f"[bold red]error:[/] {escape(str(exc))}", soft_wrap=True)
        raise typer.Exit(2) from None
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
        console.print(ob)
    if json_out:
        doc = {"trace": trace, "target": tr.target, "drafters": tr.specs,
               "results": [r.to_dict() for r in results], "oracle": bounds}
        Path(json_out).write_text(json.dumps(doc, indent=1), encoding="utf-8")
        console.print(f"written: {json_out}")


__all__ = ["ReplayResult", "ReplayRound", "PromptReplay", "TIME_DEPENDENT", "load_surface", "oracle_bounds", "predict_config",
           "predict_configs", "replay", "replay_command"]
