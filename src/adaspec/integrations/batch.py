"""Drafter and length selection for every row of a serving engine's batch (engine-independent).

Each call receives the batch as the engine keeps it: the tokens verified for each row in this
step, each row's token count and its token buffer. The rows are mapped to requests
(``rows.RowTracker``), each request's policies learn from the fate of its last drafts, and
each row is drafted again by the drafter and with the length its policies pick (0 allowed).
Model-free drafters only (none, prompt lookup, suffix with its datastore): they need nothing
from the engine but tokens, and the engine verifies their drafts losslessly.
"""

from __future__ import annotations

import copy
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

from ..config import SamplingConfig, validate_k, validate_scope
from ..drafters import Draft, Drafter, build_drafter, parse_params
from ..drafters.indexed import share_indexes
from ..errors import ConfigError
from ..feedback import RoundFeedback
from ..length import LengthPolicy, StaticLength, build_length
from ..length.bandit import LengthUCB
from ..length.rules import HFHeuristic
from ..models import LoadedModel
from ..selection import DrafterPolicy, StaticPolicy, build_selector
from ..selection.banditspec import UCBSpec
from ..selection.baselines import RoundRobinPolicy, UniformRandomPolicy
from .rows import RowMatch, RowTracker, Stream

log = logging.getLogger(__name__)

MODEL_FREE = ("none", "prompt-lookup", "pld", "suffix")
#: policies whose ``update`` reads only the feedback, so one learner may serve the requests in
#: flight, whose rounds interleave (others keep state from choosing to learning: scope=request)
SHARED_OK: tuple[type, ...] = (StaticPolicy, UniformRandomPolicy, RoundRobinPolicy, UCBSpec,
                               StaticLength, LengthUCB, HFHeuristic)
#: the engine reports accepted counts, not the request's sampling settings: feedback is built
#: from realised acceptances (1 per accepted draft, 0 at the rejected one), as under greedy
_REALISED = SamplingConfig()


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


@dataclass
class _Request:
    """Per-request state: its own drafter indices, its policies (shared ones for scope=global),
    its context as a list and the last round's choice."""

    drafters: list[Drafter]
    selector: DrafterPolicy
    length: LengthPolicy
    tokens: list[int] = field(default_factory=list)
    prompt_len: int = 0
    rounds: int = 0
    chosen: int = -1
    cap: int = 0
    draft_s: float = 0.0


def with_scope(spec: str, scope: str) -> str:
    """``spec`` with ``scope=SCOPE`` added unless it sets a scope itself."""
    name, _, rest = spec.partition(":")
    if "scope" in parse_params(rest, f"policy {spec!r}"):
        return spec
    return f"{name}:{rest},scope={scope}" if rest.strip() else f"{name}:scope={scope}"


def model_free_drafter(spec: str, tokenizer: Any = None) -> Drafter:
    """Build a model-free drafter from its spec; model drafters are refused with the fix."""
    name = spec.strip().partition(":")[0].strip().lower()
    if name not in MODEL_FREE:
        raise ConfigError(
            f"drafter {spec!r} is not model-free: a serving proposer runs {', '.join(MODEL_FREE)}; "
            "for a draft model use the serving engine's own method (vLLM: draft_model, eagle)")
    return build_drafter(spec, LoadedModel(model=None, tokenizer=tokenizer, name="serving target"))


def check_policy(policy: DrafterPolicy | LengthPolicy, kind: str) -> None:
    """Refuse policies a serving proposer cannot feed, naming the fix."""
    if getattr(policy, "wants_costs", False):
        raise ConfigError(f"{kind} {policy.name!r} needs adaspec's measured verify costs, which a "
                          "serving engine does not report: pick one without costs (e.g. ucbspec, "
                          "ucbspec-length)")
    if getattr(policy, "needs_hidden", False):
        raise ConfigError(f"{kind} {policy.name!r} reads a model drafter's hidden states; a serving "
                          "proposer runs model-free drafters: pick another length policy")
    if policy.scope == "global" and type(policy) not in SHARED_OK:
        raise ConfigError(
            f"{kind} {policy.name!r} keeps state between choosing and learning, so one learner "
            "shared by interleaved requests would credit the wrong round: add scope=request "
            "(one learner per request) or use static, random, round-robin, ucbspec, "
            "ucbspec-length or hf-heuristic")


class BatchProposer:
    """Drafts for every row of a serving engine's batch with adaspec's policies.

    ``propose(sampled, num_tokens, token_ids)`` returns one draft list per row. Per-request
    state (drafter indices, scope=request policies) follows the row mapping of
    ``RowTracker``; global state (scope=global policies, suffix datastores, ``stats``) is shared.
    ``clock`` times drafting and the engine's step between calls (cost-aware rewards).
    """

    def __init__(self, config: BatchProposerConfig, tokenizer: Any = None,
                 clock: Callable[[], float] = time.perf_counter):
        self.config = config
        self.prototypes = [model_free_drafter(s, tokenizer) for s in config.drafters]
        self.names = [d.name for d in self.prototypes]
        self.labels = list(dict.fromkeys(config.drafters))  # stats keys: the specs as given
        self.selector = build_selector(with_scope(config.selector or "static", config.scope))
        self.length = build_length(with_scope(config.length or f"static:k={config.k}", config.scope),
                                   config.k)
        check_policy(self.selector, "selector")
        check_policy(self.length, "length policy")
        self.selector.begin_request(self.names)  # checks the arms (static index, ...) once
        self.length.begin_request()
        self.tracker: RowTracker[_Request] = RowTracker(self._new_request, config.idle_steps)
        self.stats = BatchStats(drafters={label: DrafterTotals() for label in self.labels})
        self._clock = clock
        self._last_end: float | None = None
        #: stream id of every row at the last call (None: no sampled tokens), for inspection
        self.last_rows: list[int | None] = []

    # -- per request ---------------------------------------------------------------------------
    def _own(self, policy: Any, sid: int) -> Any:
        """The shared learner (scope=global) or a fresh copy for one request, seeded per request."""
        if policy.scope == "global":
            return policy
        twin = copy.deepcopy(policy)
        twin.rng = np.random.default_rng(None if policy.seed is None else [policy.seed, sid])
        return twin

    def _new_request(self, sid: int, context: np.ndarray) -> _Request:
        req = _Request([d.fork() for d in self.prototypes], self._own(self.selector, sid),
                       self._own(self.length, sid))
        share_indexes(req.drafters)  # one index for the request's n-gram drafters, as the engine's
        for d in req.drafters:
            d.begin_request([])
        if req.selector is not self.selector:
            req.selector.begin_request(self.names)
        if req.length is not self.length:
            req.length.begin_request()
        self.stats.requests += 1
        return req

    def _finish(self, stream: Stream[_Request]) -> None:
        req = stream.payload
        for d in req.drafters:  # suffix datastores with learn=true keep the output
            d.end_request(req.tokens[req.prompt_len:])
        self.stats.finished += 1

    # -- one call --------------------------------------------------------------------------------
    def propose(self, sampled: Sequence[Sequence[int]], num_tokens: np.ndarray,
                token_ids: np.ndarray) -> list[list[int]]:
        """One draft list per row (empty: no speculation for that row this step)."""
        start = self._clock()
        step_s = start - self._last_end if self._last_end is not None else 0.0
        matches, evicted = self.tracker.assign(sampled, num_tokens, token_ids)
        for stream in evicted:
            self._finish(stream)
        out: list[list[int]] = []
        for m in matches:
            if m.stream is None:
                out.append([])
                continue
            req = m.stream.payload
            req.tokens.extend(m.stream.context[len(req.tokens):].tolist())
            if m.new:
                req.prompt_len = len(req.tokens) - len(m.sampled)
            elif req.chosen >= 0 and m.outcome is not None:
                self._learn(m, req, step_s)
            m.stream.drafts = self._draft(req)
            out.append(m.stream.drafts)
        self.last_rows = [None if m.stream is None else m.stream.sid for m in matches]
        self.stats.calls += 1
        self.stats.rows += sum(1 for m in matches if m.stream is not None)
        if self.config.stats_file and self.stats.calls % self.config.stats_every == 0:
            self.write_stats(self.config.stats_file)
        self._last_end = self._clock()
        self.stats.propose_s += self._last_end - start
        return out

    def _draft(self, req: _Request) -> list[int]:
        i = req.selector.select()
        if not 0 <= i < len(req.drafters):
            raise ConfigError(f"selector {req.selector.name!r} chose drafter #{i} of {len(req.drafters)}")
        cap = min(req.length.begin_round(i), self.config.k)
        if self.config.max_model_len is not None:  # the engine verifies nothing past its window
            cap = min(cap, self.config.max_model_len - 1 - len(req.tokens))
        t0 = self._clock()
        draft = req.drafters[i].draft(req.tokens, cap, _REALISED, None, req.length.decide) \
            if cap > 0 else Draft()
        req.draft_s = self._clock() - t0
        req.chosen, req.cap = i, max(cap, 0)
        return [int(t) for t in draft.tokens]

    def _learn(self, m: RowMatch[_Request], req: _Request, step_s: float) -> None:
        """Feed the request's policies the fate of its last drafts (``m.outcome``)."""
        stream, outcome = m.stream, m.outcome
        assert stream is not None and outcome is not None
        if not outcome.consistent:
            self.stats.inconsistent += 1
            log.warning("row %d: sampled tokens disagree with the drafts proposed for its request; "
                        "round not learnt from", m.row)
            return
        k, n = outcome.verified, outcome.accepted
        cut = k < len(stream.drafts)
        self.stats.cut += cut
        gammas = [1.0] * n + ([0.0] if n < k else [])
        fb = RoundFeedback(
            round=req.rounds, drafter=req.chosen, draft=Draft(tokens=stream.drafts[:k]),
            n_accepted=n, emitted=list(m.sampled), k_cap=k if cut else req.cap,
            target_logits=None, sampling=_REALISED, draft_s=req.draft_s, verify_s=step_s,
            gammas=gammas)
        if req.selector.full_information and len(req.drafters) > 1:
            self._counterfactual(fb, req, m.sampled)
        req.selector.update(fb)
        req.length.update(fb)
        req.rounds += 1
        totals = self.stats.drafters[self.config.drafters[req.chosen]]
        totals.rounds += 1
        totals.drafted += k
        totals.accepted += n

    def _counterfactual(self, fb: RoundFeedback, req: _Request, emitted: list[int]) -> None:
        """Full information for model-free drafters: would drafter j have proposed each emitted
        token? (1/0: the emitted token follows the target's distribution, so the indicator is an
        unbiased estimate of p(proposal).)"""
        before = req.tokens[: len(req.tokens) - len(emitted)]
        cf: dict[int, list[float]] = {fb.drafter: fb.chosen_gammas()}
        for j, d in enumerate(req.drafters):
            if j != fb.drafter:
                props = d.score(before, emitted, _REALISED).tokens or []
                cf[j] = [1.0 if p == e else 0.0 for p, e in zip(props, emitted)]
        fb.counterfactual = cf
        fb.counterfactual_alpha = {j: g for j, g in cf.items() if j != fb.drafter}

    # -- reporting -------------------------------------------------------------------------------
    def write_stats(self, path: str | Path) -> None:
        """Write ``stats`` (and the settings) as JSON, replacing the file atomically."""
        path = Path(path)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"config": self.config.to_dict(), "stats": self.stats.to_dict()},
                                  indent=2), encoding="utf-8")
        os.replace(tmp, path)
