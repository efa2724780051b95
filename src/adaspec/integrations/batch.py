"""Drafter and length selection for every row of a serving engine's batch (engine-independent).

Each call receives the batch as the engine keeps it: the tokens verified for each row in this
step, each row's token count and its token buffer. The rows are mapped to requests
(``rows.RowTracker``), each request's policies learn from the fate of its last drafts, and
each row is drafted again by the drafter and with the length its policies pick (0 allowed).
Model-free drafters only (none, prompt lookup, suffix with its datastore: ``serving_drafters``):
they need nothing from the engine but tokens, and the engine verifies their drafts losslessly.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..backends.transformers import LoadedModel
from ..config import GenerationConfig, SamplingConfig, validate_k, validate_scope
from ..costs import CostModel, StepCosts
from ..drafters import Draft, Drafter, DrafterCaps, build_drafter, parse_drafter, parse_params
from ..drafters.indexed import share_indexes
from ..errors import ConfigError
from ..length import LengthPolicy, build_length
from ..registry import REGISTRY
from ..round import Outcome, Round, Row, RowParts, RowPlan, bind_policies, fork_policies
from ..selection import DrafterPolicy, build_selector
from .rows import RowMatch, RowTracker, Stream

log = logging.getLogger(__name__)

#: the engine reports accepted counts, not the request's sampling settings: feedback is built
#: from realised acceptances (1 per accepted draft, 0 at the rejected one), as under greedy;
#: the engine ends its requests (no EOS, no budget here)
_SERVED = GenerationConfig(max_new_tokens=2**62, stop_on_eos=False, sampling=SamplingConfig())


@dataclass(frozen=True)
class BatchProposerConfig:
    """What the serving proposer runs. ``drafters``: model-free drafter specs (the arms);
    ``selector`` / ``length``: adaspec policy specs (``length=None``: always ``k``); ``k``: the
    most drafts per row (vLLM's ``num_speculative_tokens``); ``scope``: the policies' scope
    when their spec sets none (``global``: one learner shared by all requests; ``request``:
    one per request); ``idle_steps``: calls a request may be absent before it is forgotten;
    ``stats_file``: JSON file rewritten every ``stats_every`` calls with ``BatchStats``."""

    drafters: tuple[str, ...] = ("prompt-lookup", "suffix")
    selector: str = "ucbspec"
    length: str | None = None
    k: int = 5
    scope: str = "global"
    idle_steps: int = 16
    max_model_len: int | None = None
    stats_file: str | None = None
    stats_every: int = 50

    def __post_init__(self) -> None:
        drafters = (self.drafters,) if isinstance(self.drafters, str) else tuple(self.drafters)
        if not drafters or not all(isinstance(d, str) and d.strip() for d in drafters):
            raise ConfigError(f"drafters must be a non-empty list of drafter specs, got {self.drafters!r}: "
                              "pass e.g. [\"prompt-lookup\", \"suffix\"]")
        object.__setattr__(self, "drafters", drafters)
        validate_k(self.k)
        validate_scope(self.scope)
        if not isinstance(self.stats_every, int) or self.stats_every < 1:
            raise ConfigError(f"stats_every must be an integer >= 1, got {self.stats_every!r}")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int)
                                               or self.max_model_len < 2):
            raise ConfigError(f"max_model_len must be an integer >= 2, got {self.max_model_len!r}")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> BatchProposerConfig:
        """Build from a JSON object; unknown keys are an error that lists the known ones."""
        if not isinstance(data, Mapping):
            raise ConfigError(f"the adaspec proposer settings must be a JSON object, got {data!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown adaspec proposer setting(s) {unknown}: allowed are {sorted(known)}")
        return cls(**dict(data))

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["drafters"] = list(self.drafters)
        return out


@dataclass
class DrafterTotals:
    """Rounds one drafter drafted and what the engine made of them."""

    rounds: int = 0
    drafted: int = 0  # drafts the engine verified
    accepted: int = 0

    def to_dict(self) -> dict[str, float]:
        return {"rounds": self.rounds, "drafted": self.drafted, "accepted": self.accepted,
                "acceptance_rate": self.accepted / self.drafted if self.drafted else 0.0,
                "mean_accepted_length": 1 + self.accepted / self.rounds if self.rounds else 0.0}


@dataclass
class BatchStats:
    """Global statistics of a serving proposer, across all requests."""

    calls: int = 0
    rows: int = 0  # rows drafted for
    requests: int = 0  # requests seen (streams started)
    finished: int = 0  # requests forgotten after ``idle_steps`` absent calls
    inconsistent: int = 0  # outcomes that disagree with the drafts (not learnt from)
    cut: int = 0  # rounds whose drafts the engine's scheduler shortened
    propose_s: float = 0.0  # time spent in ``propose`` (mapping, learning, drafting)
    drafters: dict[str, DrafterTotals] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {k: v for k, v in dataclasses.asdict(self).items() if k != "drafters"}
        out["drafters"] = {name: t.to_dict() for name, t in self.drafters.items()}
        return out


def with_scope(spec: str, scope: str) -> str:
    """``spec`` with ``scope=SCOPE`` added unless it sets a scope itself."""
    name, _, rest = spec.partition(":")
    if "scope" in parse_params(rest, f"policy {spec!r}"):
        return spec
    return f"{name}:{rest},scope={scope}" if rest.strip() else f"{name}:scope={scope}"


def serves(caps: DrafterCaps) -> bool:
    """Can a drafter of these capabilities draft for a serving engine's rows? It must run no
    model and read nothing from the engine but tokens (no target rows, no target features)."""
    return not (caps.runs_model or caps.observes_target or caps.reads_target_features)


def serving_drafters() -> list[str]:
    """The registered drafters a serving proposer runs (``serves``), by spec name."""
    return [e.name for e in REGISTRY.entries("drafter") if serves(e.caps)]


def model_free_drafter(spec: str, tokenizer: Any = None) -> Drafter:
    """Build a model-free drafter from its spec; model drafters are refused with the fix."""
    parsed = parse_drafter(spec)
    if not serves(parsed.entry.caps):
        raise ConfigError(
            f"drafter {spec!r} is not model-free: a serving proposer runs {', '.join(serving_drafters())}; "
            "for a draft model use the serving engine's own method (vLLM: draft_model, eagle)")
    return build_drafter(parsed.text, LoadedModel(model=None, tokenizer=tokenizer, name="serving target"))


def check_policy(policy: DrafterPolicy | LengthPolicy, kind: str) -> None:
    """Refuse policies a serving proposer cannot feed, naming the fix."""
    if isinstance(policy, LengthPolicy) and policy.caps.needs_hidden:
        raise ConfigError(f"{kind} {policy.name!r} reads a model drafter's hidden states; a serving "
                          "proposer runs model-free drafters: pick another length policy")
    if policy.scope == "global" and not (policy.caps.shares_interleaved or policy.caps.forks_sharing):
        shared = [e.name for k in ("selector", "length") for e in REGISTRY.entries(k)
                  if e.caps.shares_interleaved or e.caps.forks_sharing]
        raise ConfigError(
            f"{kind} {policy.name!r} keeps state between choosing and learning, so one learner "
            "shared by interleaved requests would credit the wrong round: add scope=request "
            f"(one learner per request) or use {', '.join(dict.fromkeys(shared))}")


class BatchProposer:
    """Drafts for every row of a serving engine's batch with adaspec's round (``round.Round``).

    ``propose(sampled, num_tokens, token_ids)`` returns one draft list per row. Each request is a
    ``Row`` (its drafters forked; its policies shared or its own, as below) that follows the row
    mapping of ``RowTracker``: a call first settles each row's last round with what the engine
    made of its drafts (``rows.read_verification``: accepted, verified, consistent; the engine's
    step between the calls as the verify seconds), then plans the next round of every row.
    Policies of ``scope=global`` are one learner for all requests, except ``auto``, whose
    requests are forked with its global counts shared (as in ``BatchEngine``); ``scope=request``
    gives each request its own. Cost-aware policies (``auto``, ``cost-model``, ...) price rounds
    on the engine's step times, learnt online per batch size and draft width
    (``costs.StepCosts``), and the batch's ``auto`` rows choose their width together.
    ``clock`` times drafting and the engine's step between calls.
    """

    def __init__(self, config: BatchProposerConfig, tokenizer: Any = None,
                 clock: Callable[[], float] = time.perf_counter):
        self.config = config
        self.prototypes = [model_free_drafter(s, tokenizer) for s in config.drafters]
        self.names = [d.name for d in self.prototypes]
        self.labels = list(dict.fromkeys(config.drafters))  # stats keys: the specs as given
        selector = with_scope(config.selector or "static", config.scope)
        length = with_scope(config.length or f"static:k={config.k}", config.scope)
        sel = build_selector(selector)
        paired = sel.paired_length() if config.length is None else None  # auto sets the length too
        self.selector = sel
        self.length = paired if paired is not None else build_length(length, config.k)
        check_policy(self.selector, "selector")
        check_policy(self.length, "length policy")
        bind_policies(self.selector, self.length, self.prototypes, tree=False)
        self.steps = StepCosts()
        self.cost_model = CostModel()
        for policy in (self.selector, self.length):
            if policy.caps.prices_rounds:
                policy.costs = self.cost_model
        self.selector.begin_request(self.names)  # checks the arms (static index, ...) once
        self.length.begin_request()
        self.round = Round(lambda ids: "", set(), clock=clock, tick=clock)
        self.tracker: RowTracker[Row] = RowTracker(self._new_request, config.idle_steps)
        self.stats = BatchStats(drafters={label: DrafterTotals() for label in self.labels})
        self._clock = clock
        self._last_end: float | None = None
        self._last_shape = (0, 1)  # rows drafted for and the widest block, at the last call
        self._plans: dict[int, RowPlan] = {}  # stream id -> its last round's plan
        #: stream id of every row at the last call (None: no sampled tokens), for inspection
        self.last_rows: list[int | None] = []

    # -- per request ---------------------------------------------------------------------------
    def _policies(self, sid: int) -> tuple[DrafterPolicy, LengthPolicy]:
        """The shared learners (scope=global), or the request's own copies, seeded per request
        (``auto``'s global counts shared with the prototype's)."""
        own = [p.scope != "global" or p.caps.forks_sharing for p in (self.selector, self.length)]
        if not any(own):
            return self.selector, self.length
        twins = fork_policies(self.selector, self.length, {id(self.cost_model): self.cost_model})
        out = []
        for policy, twin, mine in zip((self.selector, self.length), twins, own):
            if mine:
                twin.rng = np.random.default_rng(None if policy.seed is None else [policy.seed, sid])
            out.append(twin if mine else policy)
        return out[0], out[1]

    def _new_request(self, sid: int, context: np.ndarray) -> Row:
        drafters = [d.fork() for d in self.prototypes]
        share_indexes(drafters)  # one index for the request's n-gram drafters, as the engine's
        selector, length = self._policies(sid)
        self.stats.requests += 1
        return Row.new(sid, RowParts(drafters, selector, length, self.cost_model), [], _SERVED, "cpu",
                       self._clock())

    def _finish(self, stream: Stream[Row]) -> None:
        self.round.end(stream.payload)  # suffix datastores with learn=true keep the output
        self._plans.pop(stream.sid, None)
        self.stats.finished += 1

    # -- one call --------------------------------------------------------------------------------
    def propose(self, sampled: Sequence[Sequence[int]], num_tokens: np.ndarray,
                token_ids: np.ndarray) -> list[list[int]]:
        """One draft list per row (empty: no speculation for that row this step)."""
        start = self._clock()
        step_s = start - self._last_end if self._last_end is not None else 0.0
        if self._last_end is not None and self._last_shape[0]:
            self.steps.observe(*self._last_shape, step_s)
        matches, evicted = self.tracker.assign(sampled, num_tokens, token_ids)
        for stream in evicted:
            self._finish(stream)
        live = [m for m in matches if m.stream is not None]
        for m in live:
            self._settle(m, step_s, max(1, self._last_shape[0]))
        cm = self.cost_model  # this call's plans are priced on the step times learnt so far
        cm.surface, cm.batch = self.steps.surface(), self.steps.costs()
        plans = self.round.plan([m.stream.payload for m in live], batch=cm if len(live) > 1 else None,
                                shared=len(live))
        drafts = {}
        for m, plan in zip(live, plans):
            self._plans[m.stream.sid] = plan
            m.stream.drafts = drafts[m.stream.sid] = [int(t) for t in plan.draft.tokens]
        out = [drafts[m.stream.sid] if m.stream is not None else [] for m in matches]
        self.last_rows = [None if m.stream is None else m.stream.sid for m in matches]
        self._last_shape = (len(live), 1 + max((len(d) for d in out), default=0))
        self.stats.calls += 1
        self.stats.rows += len(live)
        if self.config.stats_file and self.stats.calls % self.config.stats_every == 0:
            self.write_stats(self.config.stats_file)
        self._last_end = self._clock()
        self.stats.propose_s += self._last_end - start
        return out

    def _settle(self, m: RowMatch[Row], step_s: float, rows: int) -> None:
        """The row's last round settled with the fate of its drafts (``m.outcome``), its context
        brought up to the engine's and its next draft capped (``k``, the model's window)."""
        row, stream, outcome = m.stream.payload, m.stream, m.outcome
        context = stream.context.tolist()
        plan = self._plans.pop(stream.sid, None)
        if m.new:
            row.prompt_ids = context[: len(context) - len(m.sampled)]
            row.tokens, row.stats.prompt_tokens = list(row.prompt_ids), len(row.prompt_ids)
            self.round.begin(row)
        elif plan is not None and outcome is not None:
            if not outcome.consistent:
                self.stats.inconsistent += 1
                log.warning("row %d: sampled tokens disagree with the drafts proposed for its request; "
                            "round not learnt from", m.row)
            else:
                self._learn(row, plan, outcome, list(m.sampled), step_s, rows)
        if row.tokens != context:  # partial prefills, a round not learnt from
            row.tokens = context
        window = self.config.max_model_len
        row.draft_cap = self.config.k if window is None else max(0, min(self.config.k, window - 1 - len(context)))

    def _learn(self, row: Row, plan: RowPlan, outcome: Any, sampled: list[int], step_s: float, rows: int) -> None:
        """Settle the row's round: ``outcome.accepted`` of the ``outcome.verified`` drafts (the
        engine's scheduler may verify fewer than proposed) and the engine's next token."""
        k, n = outcome.verified, outcome.accepted
        cut = k < len(plan.draft.tokens)
        self.stats.cut += cut
        if cut:
            plan.draft, plan.cap = Draft(tokens=plan.draft.tokens[:k]), k
        gammas = [1.0] * n + ([0.0] if n < k else [])
        settled = self.round.settle(row, plan, Outcome(n, sampled[n], gammas=gammas), step_s, rows)
        totals = self.stats.drafters[self.config.drafters[plan.drafter]]
        totals.rounds += 1
        totals.drafted += settled.record.drafted
        totals.accepted += settled.record.accepted
        row.stats.rounds.clear()  # a serving request is long-lived: no per-round history kept


    # -- reporting -------------------------------------------------------------------------------
    def write_stats(self, path: str | Path) -> None:
        """Write ``stats`` (and the settings) as JSON, replacing the file atomically."""
        path = Path(path)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"config": self.config.to_dict(), "stats": self.stats.to_dict()},
                                  indent=2), encoding="utf-8")
        os.replace(tmp, path)
