"""Trace recording: what every drafter would propose along the target's greedy path.

Under greedy decoding the output of any speculative run is the target's greedy path
(prompt + AR output), and every round starts at a prefix ``path[:t]``: accepted tokens are on
the path. What a drafter proposes at ``t`` depends only on that prefix (model-free drafters
index it and roll drafted tokens back; model drafters draft greedily from it), and a shorter
draft is a prefix of a longer one (drafting is sequential and the length policy only stops
it). So one pass records, for every drafter and every start position ``t``:

* the greedy draft chain of up to ``max_draft`` tokens (shorter: the drafter had no more
  proposals, e.g. prompt lookup without a match);
* its accepted length ``n_acc(t)``: leading chain tokens equal to ``path[t:]`` (a round that
  drafts ``k`` of them accepts ``min(n_acc, k)``);
* at every chain position the acceptance probability the engine's feedback reports
  (``RoundFeedback.acceptance_probs``: p(y) for one-hot drafts, 1 - TV(p, q) for model
  drafters, MetaSD eq. (4)), also after the first rejection, where the prefix is off the
  path: the target is run teacher-forced over ``path[:t] + chain`` as the engine's verify
  forward does (all branches of a block of positions in one forward with tree attention);
* for model drafters the statistics of q the stopping rules read (``StepStats``: top-1 and
  top-2 probability, entropy), computed with the rules' own formulas.

Plus the costs that replay uses to predict time: the target's verify-cost curve
(``engine.verify_costs()``), its prefill per prompt, and per drafter the seconds per drafted,
caught-up and prefilled token, measured by one live calibration run (round-robin over the
drafters and ``none``, so catch-up happens). ``adaspec.replay`` evaluates any drafter x length
policy from a trace without models.

File format (``Trace.save``): one compressed ``.npz`` with a JSON header (``header``, uint8)
and per prompt ``p{i}.prompt``/``p{i}.path`` (int32) and per drafter ``p{i}.d{j}.chain``
(int32 [positions, max_draft], -1 padded), ``.len`` (int16), ``.acc`` (int16), ``.gamma``
(float32, NaN padded) and, for model drafters, ``.stats`` (float32 [positions, max_draft, 3]).
Probabilities are float32 in the engine too, so the stored values are the computed ones.
"""

from __future__ import annotations

import datetime as _dt
import io
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from statistics import fmean
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..config import GenerationConfig, SamplingConfig
from ..costs import (DrafterCosts, EngineOverheads, LinearCost, VerifyCostSurface, cached_surface,
                     load_or_measure, nonneg_lstsq)
from ..drafters import Decision, Drafter, DraftStep, build_drafter
from ..errors import AdaspecError, ConfigError
from ..length.rules import stats_of, stats_probs
from ..length import StaticLength
from ..selection.baselines import RoundRobinPolicy
from ..models import LoadedModel, as_loaded, check_fingerprint, target_fingerprint
from ..version import __version__
from .workloads import turn_prompt

log = logging.getLogger(__name__)

FORMAT = "adaspec.trace"
VERSION = 2  # 2: verify-cost surface, drafter cost functions, engine overheads
GREEDY = SamplingConfig()
Progress = Callable[[str], None]


# -- data ---------------------------------------------------------------------------------
@dataclass
class DrafterTrack:
    """One drafter along one prompt's path; row ``x`` is start position ``t = n_prompt + x``."""

    chains: np.ndarray  # int32 [n_pos, L]: greedy draft chain, -1 padded
    lengths: np.ndarray  # int16 [n_pos]: chain length (< L: the drafter had no more proposals)
    accepted: np.ndarray  # int16 [n_pos]: leading chain tokens equal to path[t:]
    gammas: np.ndarray  # float32 [n_pos, L]: acceptance probability at each chain position
    stats: np.ndarray | None = None  # float32 [n_pos, L, 3]: (top1, top2, entropy) of q

    def chain(self, x: int) -> list[int]:
        return self.chains[x, : int(self.lengths[x])].tolist()


@dataclass
class PromptTrace:
    """One request: its greedy path and every drafter's track."""

    prompt: list[int]
    path: list[int]  # prompt + output + greedy continuation past EOS (for rounds drafting past it)
    n_out: int  # tokens of the live output (it ends at EOS or the token budget)
    stop_reason: str
    prefill_s: float  # measured target prefill of the prompt
    ar_s: float  # measured AR time of the output (prefill included)
    tracks: list[DrafterTrack]
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def n_prompt(self) -> int:
        return len(self.prompt)

    @property
    def output(self) -> list[int]:
        return self.path[self.n_prompt: self.n_prompt + self.n_out]


@dataclass
class Trace:
    """A recorded workload: settings, costs, and one ``PromptTrace`` per request, in order
    (drafters with cross-request state, e.g. a learning suffix datastore, saw them in order)."""

    target: dict[str, Any]  # adaspec.models.target_fingerprint
    specs: list[str]  # drafter labels (the spec strings; unique)
    names: list[str]  # Drafter.name (what RoundRecord.drafter reports)
    is_model: list[bool]
    max_new_tokens: int
    max_draft: int
    eos_ids: list[int]
    stop_on_eos: bool
    surface: VerifyCostSurface | None  # V(k, L) (None: recorded without costs)
    drafter_costs: list[DrafterCosts]
    prompts: list[PromptTrace]
    info: dict[str, Any] = field(default_factory=dict)
    overheads: EngineOverheads = field(default_factory=EngineOverheads)
    #: the surface the live engines' cost-aware policies read when the workload ran (the cached
    #: one before ``record`` measured ``surface`` afresh); replay's policies decide on it, as
    #: theirs did (None: ``surface``)
    policy_surface: VerifyCostSurface | None = None
    #: derived per-prompt views (``adaspec.replay``), built once per loaded trace
    cache: dict[Any, Any] = field(default_factory=dict, repr=False, compare=False)

    # -- identity ---------------------------------------------------------------------------
    def check_target(self, target: Any) -> None:
        """Raise ModelLoadError unless ``target`` is the model this trace was recorded with."""
        check_fingerprint(self.target, as_loaded(target), "this trace")

    def index_of(self, drafter: str) -> int:
        """Index of a recorded drafter by spec or name (ConfigError names the choices)."""
        if drafter in self.specs:
            return self.specs.index(drafter)
        hits = [i for i, n in enumerate(self.names) if n == drafter]
        if len(hits) == 1:
            return hits[0]
        raise ConfigError(f"drafter {drafter!r} is not in this trace: recorded drafters are "
                          f"{self.specs} (or 'none', always available)")

    # -- files ----------------------------------------------------------------------------
    def header(self) -> dict[str, Any]:
        return {
            "format": FORMAT, "version": VERSION, "target": self.target, "specs": self.specs,
            "names": self.names, "is_model": self.is_model, "max_new_tokens": self.max_new_tokens,
            "max_draft": self.max_draft, "eos_ids": self.eos_ids, "stop_on_eos": self.stop_on_eos,
            "surface": self.surface.to_dict() if self.surface is not None else None,
            "drafter_costs": [asdict(c) for c in self.drafter_costs],
            "overheads": asdict(self.overheads),
            "policy_surface": self.policy_surface.to_dict() if self.policy_surface is not None else None,
            "prompts": [{"n_out": p.n_out, "stop_reason": p.stop_reason, "prefill_s": p.prefill_s,
                         "ar_s": p.ar_s, "meta": p.meta} for p in self.prompts],
            "info": self.info,
        }

    def save(self, path: str | Path) -> Path:
        """Write the trace as one compressed .npz file (see the module docstring)."""
        path = Path(path)
        arrays: dict[str, np.ndarray] = {
            "header": np.frombuffer(json.dumps(self.header()).encode("utf-8"), dtype=np.uint8)}
        for i, p in enumerate(self.prompts):
            arrays[f"p{i}.prompt"] = np.asarray(p.prompt, dtype=np.int32)
            arrays[f"p{i}.path"] = np.asarray(p.path, dtype=np.int32)
            for j, tr in enumerate(p.tracks):
                key = f"p{i}.d{j}"
                arrays[f"{key}.chain"] = tr.chains
                arrays[f"{key}.len"] = tr.lengths
                arrays[f"{key}.acc"] = tr.accepted
                arrays[f"{key}.gamma"] = tr.gammas
                if tr.stats is not None:
                    arrays[f"{key}.stats"] = tr.stats
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            buf = io.BytesIO()
            np.savez_compressed(buf, **arrays)
            path.write_bytes(buf.getvalue())
        except OSError as exc:
            raise AdaspecError(f"could not write the trace to {path}: {exc}") from exc
        return path

    @classmethod
    def load(cls, path: str | Path) -> Trace:
        """Read a trace written by ``save``."""
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"trace file not found: {path}: record one with `adaspec bench --record FILE`")
        try:
            with np.load(path, allow_pickle=False) as npz:
                data = {key: npz[key] for key in npz.files}
            h = json.loads(bytes(data["header"]).decode("utf-8"))
        except (OSError, ValueError, KeyError, EOFError) as exc:
            raise ConfigError(f"{path} is not an adaspec trace ({exc}): record one with "
                              "`adaspec bench --record FILE`") from None
        if h.get("format") != FORMAT:
            raise ConfigError(f"{path} is not an adaspec trace (format {h.get('format')!r})")
        if h.get("version") != VERSION:
            raise ConfigError(f"{path} is trace version {h.get('version')}, this adaspec reads version "
                              f"{VERSION}: record it again")
        surface = VerifyCostSurface.from_dict(h["surface"]) if h.get("surface") else None
        prompts = []
        for i, ph in enumerate(h["prompts"]):
            tracks = []
            for j in range(len(h["specs"])):
                key = f"p{i}.d{j}"
                tracks.append(DrafterTrack(
                    chains=data[f"{key}.chain"], lengths=data[f"{key}.len"], accepted=data[f"{key}.acc"],
                    gammas=data[f"{key}.gamma"],
                    stats=data.get(f"{key}.stats")))
            prompts.append(PromptTrace(
                prompt=data[f"p{i}.prompt"].tolist(), path=data[f"p{i}.path"].tolist(), n_out=ph["n_out"],
                stop_reason=ph["stop_reason"], prefill_s=ph["prefill_s"], ar_s=ph["ar_s"], tracks=tracks,
                meta=ph.get("meta", {})))
        return cls(target=h["target"], specs=h["specs"], names=h["names"], is_model=h["is_model"],
                   max_new_tokens=h["max_new_tokens"], max_draft=h["max_draft"], eos_ids=h["eos_ids"],
                   stop_on_eos=h["stop_on_eos"], surface=surface,
                   drafter_costs=[DrafterCosts.from_dict(c) for c in h["drafter_costs"]], prompts=prompts,
                   info=h.get("info", {}), overheads=EngineOverheads.from_dict(h.get("overheads", {})),
                   policy_surface=(VerifyCostSurface.from_dict(h["policy_surface"]) if h.get("policy_surface")
                                   else None))


# -- recording ------------------------------------------------------------------------------
class _TargetSweep:
    """Teacher-forced target distributions along one path and on branches off it.

    The KV cache holds ``path[:cached]``; ``extend_to(b)`` feeds the path up to ``b`` and keeps
    P(i) = p(. | path[:i]) (rows are softmax(logits.float()), as in ``RoundFeedback``).
    ``branches`` scores many branches ``path[:b] + tokens`` in a few wide forwards: the branch
    tokens go on top of the cached path with a custom 4D attention mask (tree attention: each
    branch token sees the path before its branch point and its own branch) and explicit
    position ids, then are cropped. The first call checks this against plain forwards on a
    cache cropped to the branch point, which are used instead if a model ignores custom masks.
    """

    CHUNK = 256  # branch tokens per forward (logits of CHUNK x vocabulary floats)

    def __init__(self, loaded: LoadedModel, path: list[int], n_prompt: int, tree: bool | None):
        from transformers import DynamicCache

        self.model, self.device, self.dtype = loaded.model, loaded.device, loaded.dtype
        self.cache_kw = loaded.cache_kw
        self.path = path
        self.cache = DynamicCache(config=self.model.config)
        self.cached = 0
        self.rows: dict[int, torch.Tensor] = {}
        self.argmax_mismatches = 0
        self.tree = tree  # None: not checked yet
        if n_prompt > 1:
            self._forward(path[: n_prompt - 1], 1)
            self.cached = n_prompt - 1

    @torch.inference_mode()
    def _forward(self, ids: Sequence[int], keep: int, **kwargs: Any) -> torch.Tensor:
        x = torch.tensor([list(ids)], device=self.device)
        out = self.model(input_ids=x, **{self.cache_kw: self.cache}, use_cache=True, logits_to_keep=keep, **kwargs)
        return out.logits[0]

    def extend_to(self, b: int, check_until: int) -> None:
        if b <= self.cached:
            return
        n = b - self.cached
        probs = torch.softmax(self._forward(self.path[self.cached: b], n).float(), dim=-1)
        for x in range(n):
            i = self.cached + 1 + x
            self.rows[i] = probs[x]
            if i < check_until and int(probs[x].argmax()) != self.path[i]:
                self.argmax_mismatches += 1  # the AR path and this teacher-forced pass disagree
        self.cached = b

    def forget_before(self, i: int) -> None:
        for key in [k for k in self.rows if k < i]:
            del self.rows[key]

    def branches(self, items: list[tuple[int, list[int]]]) -> list[torch.Tensor]:
        """p(. | path[:b] + tokens[:y+1]) for every (b, tokens) item (b <= cached), rows [len, V].
        Branches that leave the path at the same point and agree on a prefix (drafters often
        propose the same continuation) are scored once."""
        reps: list[tuple[int, list[int]]] = []
        by_point: dict[int, list[int]] = {}
        ref: list[tuple[int, int]] = [(0, 0)] * len(items)
        for i in sorted(range(len(items)), key=lambda i: (items[i][0], -len(items[i][1]))):
            b, toks = items[i]
            hit = next((r for r in by_point.get(b, []) if reps[r][1][: len(toks)] == toks), None)
            if hit is None:
                hit = len(reps)
                reps.append((b, toks))
                by_point.setdefault(b, []).append(hit)
            ref[i] = (hit, len(toks))
        rows = self._branches(reps)
        return [rows[r][:n] for r, n in ref]

    def _branches(self, items: list[tuple[int, list[int]]]) -> list[torch.Tensor]:
        if not items:
            return []
        if self.tree is None:
            self.tree = self._tree_is_exact(items[:3])
        if not self.tree:
            return self._plain(items)
        out: list[torch.Tensor] = []
        group: list[tuple[int, list[int]]] = []
        for item in items:
            if group and sum(len(t) for _, t in group) + len(item[1]) > self.CHUNK:
                out.extend(self._tree(group))
                group = []
            group.append(item)
        out.extend(self._tree(group))
        return out

    @torch.inference_mode()
    def _tree(self, items: list[tuple[int, list[int]]]) -> list[torch.Tensor]:
        k = self.cached
        ids = [tok for _, toks in items for tok in toks]
        n = len(ids)
        pos = torch.tensor([[b + y for b, toks in items for y in range(len(toks))]], device=self.device)
        allowed = torch.zeros(n, k + n, dtype=torch.bool, device=self.device)
        r = 0
        for b, toks in items:
            m = len(toks)
            allowed[r: r + m, :b] = True
            allowed[r: r + m, k + r: k + r + m] = torch.ones(m, m, dtype=torch.bool, device=self.device).tril()
            r += m
        mask = torch.zeros(1, 1, n, k + n, dtype=self.dtype, device=self.device)
        mask.masked_fill_(~allowed[None, None], torch.finfo(self.dtype).min)
        logits = self._forward(ids, n, attention_mask=mask, position_ids=pos)
        self.cache.crop(-n)
        probs = torch.softmax(logits.float(), dim=-1)
        out, r = [], 0
        for _, toks in items:
            out.append(probs[r: r + len(toks)])
            r += len(toks)
        return out

    def _plain(self, items: list[tuple[int, list[int]]]) -> list[torch.Tensor]:
        """Branches on a cache cropped to each branch point (the path is re-fed afterwards)."""
        top = self.cached
        out: dict[int, torch.Tensor] = {}
        for idx in sorted(range(len(items)), key=lambda i: -items[i][0]):
            b, toks = items[idx]
            if b < self.cached:
                self.cache.crop(b - self.cached)
                self.cached = b
            out[idx] = torch.softmax(self._forward(toks, len(toks)).float(), dim=-1)
            self.cache.crop(-len(toks))
        if self.cached < top:
            self._refeed(top)
        return [out[i] for i in range(len(items))]

    def _refeed(self, b: int) -> None:
        self._forward(self.path[self.cached: b], 1)
        self.cached = b

    def _tree_is_exact(self, items: list[tuple[int, list[int]]]) -> bool:
        tree = self._tree(items)
        plain = self._plain(items)
        tol = 1e-4 if self.dtype == torch.float32 else 2e-2
        ok = all(a.shape == b.shape and bool((a - b).abs().max() <= tol) for a, b in zip(tree, plain))
        if not ok:
            log.warning("this model does not honour a custom 4D attention mask: scoring branches one by "
                        "one (slower recording, same trace)")
        return ok


@dataclass
class _Query:
    """Acceptance probabilities still to compute for one (drafter, start position)."""

    drafter: int
    x: int  # start position - n_prompt
    t: int
    chain: list[int]
    accepted: int
    q_logits: torch.Tensor | None  # [len, V] drafter logits (model drafters)


class TraceRecorder:
    """Records prompts one at a time (``add``), then ``finish()`` returns the Trace.

    Drafters are built once and see the prompts in order, as in one live engine."""

    BLOCK = 16  # start positions drafted before their probabilities are computed

    def __init__(self, target: Any, drafters: Sequence[str | Drafter], max_new_tokens: int,
                 max_draft: int = 16, stop_on_eos: bool = True, progress: Progress | None = None,
                 tree: bool | None = None):
        """``tree``: score off-path branches with tree attention (True), one by one (False), or
        tree attention once it has been checked against one-by-one scoring (None)."""
        from ..engine import SpeculativeEngine

        if not drafters:
            raise ConfigError("record at least one drafter: e.g. drafters=['prompt-lookup', 'suffix']")
        if not isinstance(max_draft, int) or isinstance(max_draft, bool) or not 1 <= max_draft <= 1024:
            raise ConfigError(f"max_draft must be an integer in [1, 1024], got {max_draft!r}: e.g. 16")
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        self.loaded = as_loaded(target)
        self.specs_in = list(drafters)
        self.drafters = [build_drafter(d, self.loaded) for d in drafters]
        self.specs = _unique_labels([d if isinstance(d, str) else d.name for d in drafters])
        if "none" in self.specs:
            raise ConfigError("do not record 'none': replay always offers it (drafters=[..., 'none'])")
        self.max_new_tokens, self.max_draft = max_new_tokens, max_draft
        self.stop_on_eos = stop_on_eos
        self.progress = progress
        self.ar = SpeculativeEngine(self.loaded, [], k=1)
        self.eos = sorted(self.ar.eos_ids()) if stop_on_eos else []
        self.prompts: list[PromptTrace] = []
        self.argmax_mismatches = 0
        self.started = time.perf_counter()
        self._feature_forward: Any = None
        self._tree = tree  # tree-attention branch scoring works for this model (None: not checked)
        self._ar_stats: list[Any] = []  # RequestStats of the AR runs (engine overheads)
        self._calibration_verify: dict[int, float] = {}  # width -> raw live/surface (diagnosis)
        #: ``VerifyProbe.rows`` timed through the live runs: they set the wider widths' prices
        self.probe_rows: list[tuple[int, int, float]] = []
        self._probe_verify: dict[int, float] = {}
        #: a bench's live verify steps, (width, cached tokens, seconds): they price every width
        #: they cover (``live_verify_table``)
        self.live_rows: list[tuple[int, int, float]] = []
        self._verify_base: list[tuple[int, float]] = []

    def _say(self, msg: str) -> None:
        if self.progress is not None:
            self.progress(msg)

    # -- the greedy path --------------------------------------------------------------------
    def _greedy_path(self, ids: list[int]) -> tuple[list[int], int, str, float, float]:
        """(path, n_out, stop reason, prefill s, AR s): AR output, continued greedily past an
        EOS by up to max_draft tokens (rounds may draft past it, and policies see how many of
        those drafts the target accepted)."""
        res = self.ar.generate(ids, GenerationConfig(max_new_tokens=self.max_new_tokens,
                                                     stop_on_eos=self.stop_on_eos))
        out = list(res.token_ids)
        self._ar_stats.append(res.stats)
        extra = min(self.max_draft + 1, self.max_new_tokens - len(out))
        if extra > 0:
            more = self.ar.generate(ids + out, GenerationConfig(max_new_tokens=extra, stop_on_eos=False))
            out_full = out + list(more.token_ids)
        else:
            out_full = out
        return ids + out_full, len(out), res.stats.stop_reason, res.stats.prefill_s, res.stats.total_s

    # -- one prompt -------------------------------------------------------------------------
    def add(self, prompt: Any, meta: dict[str, Any] | None = None) -> PromptTrace:
        """Record one request (token ids, a string or chat messages, encoded as the engine does)."""
        ids = self.ar.encode_prompt(prompt)
        i_prompt = len(self.prompts)
        self._say(f"prompt {i_prompt}: AR path")
        path, n_out, reason, prefill_s, ar_s = self._greedy_path(ids)
        n_prompt, L = len(ids), self.max_draft
        n_pos = n_out
        tracks = [DrafterTrack(chains=np.full((n_pos, L), -1, dtype=np.int32),
                               lengths=np.zeros(n_pos, dtype=np.int16),
                               accepted=np.zeros(n_pos, dtype=np.int16),
                               gammas=np.full((n_pos, L), np.nan, dtype=np.float32),
                               stats=np.full((n_pos, L, 3), np.nan, dtype=np.float32) if d.is_model else None)
                  for d in self.drafters]
        for d in self.drafters:
            d.begin_request(ids)
            if d.caps.reads_target_features:
                d.bind_features(self._features(path))
        sweep = _TargetSweep(self.loaded, path, n_prompt, self._tree)
        live_end = n_prompt + n_out
        # drafters that learn from the target's rows (``RecycleDrafter``) get each path position's
        # row after drafting there, as a live round verifies it after drafting (live rounds also
        # feed the rows of rejected drafts, which a trace does not have)
        observers = [d for d in self.drafters if d.observes_target]
        for t0 in range(n_prompt, live_end, self.BLOCK):  # blocks bound the memory of q rows
            self._say(f"prompt {i_prompt}: position {t0 - n_prompt}/{n_pos}")
            queries: list[_Query] = []
            if observers:
                sweep.extend_to(min(t0 + self.BLOCK, live_end), live_end)
            for t in range(t0, min(t0 + self.BLOCK, live_end)):
                x = t - n_prompt
                ctx = path[:t]
                for j, d in enumerate(self.drafters):
                    q = self._draft(d, ctx, tracks[j], x)
                    acc = _leading_matches(q.chain, path, t)
                    tracks[j].accepted[x] = acc
                    q.drafter, q.x, q.t, q.accepted = j, x, t, acc
                    if q.chain:
                        queries.append(q)
                for d in observers:
                    d.observe_target([path[t - 1]], sweep.rows[t][None])
            self._solve(sweep, queries, tracks, live_end)
            sweep.forget_before(t0 + self.BLOCK)
        self._tree = sweep.tree
        for d in self.drafters:
            d.end_request(path[n_prompt: n_prompt + n_out])
        self.argmax_mismatches += sweep.argmax_mismatches
        if sweep.argmax_mismatches:
            log.warning("prompt %d: the teacher-forced target disagrees with the AR path at %d positions "
                        "(not batch-invariant, e.g. bf16): replay is not exact there", i_prompt,
                        sweep.argmax_mismatches)
        rec = PromptTrace(prompt=ids, path=path, n_out=n_out, stop_reason=reason, prefill_s=prefill_s,
                          ar_s=ar_s, tracks=tracks, meta=dict(meta or {}))
        self.prompts.append(rec)
        return rec

    def _draft(self, d: Drafter, ctx: list[int], track: DrafterTrack, x: int) -> _Query:
        """The drafter's greedy chain after ``ctx`` (up to max_draft tokens) and q's statistics."""
        stats: list[tuple[float, float, float]] = []

        def always(step: DraftStep) -> Decision:
            if d.is_model:
                q = stats_probs(step)
                if q is None:
                    raise AdaspecError(f"model drafter {d.name!r} exposed no distribution while drafting")
                s = stats_of(q)
                stats.append((s.top1, s.top2, s.entropy))
            return Decision.CONTINUE

        d.catch_up(ctx)
        draft = d.draft(ctx, self.max_draft, GREEDY, None, always)
        chain = list(draft.tokens)
        n = len(chain)
        track.lengths[x] = n
        track.chains[x, :n] = chain
        if track.stats is not None and n:
            track.stats[x, :n] = stats
        q_logits = draft.logits if d.is_model else None
        if d.is_model and n and q_logits is None:
            raise AdaspecError(f"model drafter {d.name!r} returned no logits under greedy decoding")
        return _Query(drafter=-1, x=x, t=-1, chain=chain, accepted=0, q_logits=q_logits)

    def _solve(self, sweep: _TargetSweep, queries: list[_Query], tracks: list[DrafterTrack],
               live_end: int) -> None:
        """Acceptance probability at every chain position of the queries: contexts
        ``path[:t] + chain[:j]`` are on the path up to the first rejection, then branch off."""
        if not queries:
            return
        ons = [min(q.accepted, len(q.chain) - 1) for q in queries]  # last on-path chain position
        sweep.extend_to(max(q.t + on for q, on in zip(queries, ons)), live_end)
        items = [(q.t + on, q.chain[on: len(q.chain) - 1]) for q, on in zip(queries, ons)]
        branch_rows = iter(sweep.branches([it for it in items if it[1]]))
        for q, on, (_, toks) in zip(queries, ons, items):
            n = len(q.chain)
            rows = [sweep.rows[q.t + j] for j in range(on + 1)]
            p = torch.stack(rows)
            if toks:
                p = torch.cat([p, next(branch_rows)])
            if q.q_logits is None:
                g = p[torch.arange(n), torch.tensor(q.chain, device=p.device)]
            else:
                qq = torch.softmax(q.q_logits[:n].float(), dim=-1).to(p.device)
                g = torch.minimum(p, qq).sum(-1)
            tracks[q.drafter].gammas[q.x, :n] = g.cpu().numpy()

    def _features(self, path: list[int]) -> Any:
        """A FeatureBuffer with the target's final hidden state at every path position, for
        drafters that draft from target features (they read only rows of the current prefix)."""
        from ..drafters.feature_head import FeatureBuffer, TargetFeatureForward

        if self._feature_forward is None:
            self._feature_forward = TargetFeatureForward(self.loaded.model)
        cfg = self.loaded.model.config
        buf = FeatureBuffer(int(cfg.hidden_size), self.loaded.device, self.loaded.dtype)
        ids = torch.tensor([path[:-1]], device=self.loaded.device)
        buf.append(self._feature_forward(ids, None, 1)[1][0])
        return buf

    # -- costs --------------------------------------------------------------------------------
    CALIBRATION_PROMPTS = 3  # shortest, median and longest prompt: the drafters' context range

    def _calibration_prompts(self) -> list[PromptTrace]:
        by_len = sorted(self.prompts, key=lambda p: p.n_prompt)
        n = len(by_len)
        picks = sorted({0, n // 2, n - 1})[: self.CALIBRATION_PROMPTS]
        return [by_len[i] for i in picks]

    def calibrate(self, surface: VerifyCostSurface) -> tuple[list[DrafterCosts], EngineOverheads]:
        """Per-drafter cost functions and engine overheads from live runs.

        Drafting, catch-up and prefill: a round-robin run over the drafters and ``none`` on the
        calibration prompts (every drafter drafts, prefills and catches up as in the engine),
        fitted as ``LinearCost`` of (tokens, context). Evaluation: the same with full
        information (every round scores the verified tokens with every other drafter), fitted
        jointly (a round's eval time is the sum over the other drafters). Engine overheads:
        the AR runs of the recording, per round ``total - verify`` and the verify step over
        V(1, L), per request ``total - prefill - sum of rounds`` (means: replay predicts sums)."""
        from ..engine import SpeculativeEngine

        n_d = len(self.drafters)
        if not self.prompts:
            return [DrafterCosts() for _ in self.drafters], EngineOverheads()
        samples: dict[str, list[list[tuple[int, int, float]]]] = {
            key: [[] for _ in range(n_d)] for key in ("draft", "catch_up", "prefill")}
        eval_rows: list[tuple[int, int, float]] = []  # (chosen, emitted, eval seconds)
        verify_rows: list[tuple[int, float]] = []  # (width, live verify step / surface)
        gen = GenerationConfig(max_new_tokens=self.max_new_tokens, stop_on_eos=self.stop_on_eos)
        for full in (False, True):
            policy = _FullInfoRoundRobin() if full else RoundRobinPolicy()
            fresh = [build_drafter(s, self.loaded) for s in self.specs_in]  # no state from recording
            # drafting: caps cycling over the surface's widths up to max_draft, so drafting costs
            # of every length and live verify steps of every grid width are seen
            caps = sorted({min(w - 1, self.max_draft) for w in surface.ks if w > 1}) or [self.max_draft]
            engine = SpeculativeEngine(self.loaded, [*fresh, "none"], selector=policy,
                                       length=None if full else _CyclingLength(caps), k=5)
            for pt in self._calibration_prompts():
                self._say(f"calibrating drafter costs ({'evaluation' if full else 'drafting'}), "
                          f"prompt of {pt.n_prompt} tokens")
                stats = engine.generate(pt.prompt, gen).stats
                ctx = pt.n_prompt
                for j, r in enumerate(stats.rounds):
                    i = j % (n_d + 1)
                    verify_rows.append((r.drafted + 1, r.verify_s / surface.cost(r.drafted + 1, ctx - 1)))
                    if full:
                        eval_rows.append((i, r.emitted, r.eval_s))
                    elif i < n_d:
                        if r.k_cap > 0:  # the engine called draft
                            samples["draft"][i].append((r.drafted, ctx, r.draft_s))
                        if r.catch_up_tokens:  # ... and catch_up
                            samples["catch_up"][i].append((r.catch_up_tokens, ctx, r.catch_up_s))
                        if r.drafter_prefill_s > 0:
                            samples["prefill"][i].append((pt.n_prompt, 0, r.drafter_prefill_s))
                    ctx += r.emitted
        out = []
        for i in range(n_d):
            draft = LinearCost.fit(samples["draft"][i])
            catch_up = LinearCost.fit(samples["catch_up"][i])
            if catch_up == LinearCost():  # never behind: a caught-up token costs about a drafted one
                catch_up = LinearCost(per_token=draft.per_token, per_context=draft.per_context)
            out.append(DrafterCosts(draft, catch_up, LinearCost.fit(samples["prefill"][i])))
        evaluate = _fit_evaluation(eval_rows, n_d + 1)
        for i in range(n_d):
            out[i].evaluate = evaluate[i]
        return out, self._overheads(surface, evaluate[n_d], verify_rows)

    def _overheads(self, surface: VerifyCostSurface, none_evaluate: LinearCost,
                   verify_rows: list[tuple[int, float]]) -> EngineOverheads:
        """Means of the AR runs' per-round and per-request overheads, and the live verify step
        over the surface per width (``EngineOverheads.verify_widths``/``verify_ratios``).

        Width 1: a trimmed mean (``VERIFY_TRIM``) of the AR rounds' ratios. Wider: the verify
        probes' (``probe_rows``, timed between a bench's live requests: ``VerifyProbe``) or,
        for widths they lack, the calibration runs' trimmed mean at that width over their own
        width-1 rows, times the AR ratio (``calibration_ratios``). A ratio of two widths
        measured in the same minutes carries no drift of the machine's overall speed (seen:
        width 6 priced 0.95 against 1.03 live while width 1 matched at 0.93); the probes also
        sample the wide forwards' speed regimes over the live runs' own minutes, where the
        calibration's one minute saw width 6 at 1.01 of the surface and the live runs at 0.88
        (long-context suite) or the other way round by 15%. Means, not medians: replay
        predicts total seconds, and a round's time is skewed to the right (a median
        under-prices a run by 1-3% here). The line of older traces (``verify_scale``,
        ``verify_scale_per_width``) is still fitted, for reports."""
        per_round, per_request, ar = [], [], []
        for pt, st in zip(self.prompts, self._ar_stats):
            ctx = pt.n_prompt - 1  # the cache holds all tokens but the newest
            for r in st.rounds:
                per_round.append(r.total_s - r.verify_s)
                ar.append(r.verify_s / surface.cost(1, ctx))
                ctx += r.emitted
            per_request.append(st.total_s - st.prefill_s - sum(r.total_s for r in st.rounds))
        if not per_round:
            return EngineOverheads(none_evaluate=none_evaluate)
        probe = [(w, sec / surface.cost(w, ctx)) for w, ctx, sec in self.probe_rows]
        relative = dict(calibration_ratios(verify_rows))
        relative.update(calibration_ratios(probe))  # the probes' minutes are the live runs' own
        table = [(1, _trimmed_mean(ar))] + [(w, r * _trimmed_mean(ar)) for w, r in sorted(relative.items()) if w > 1]
        self._calibration_verify = dict(calibration_ratios(verify_rows, relative=False))
        self._probe_verify = dict(calibration_ratios(probe, relative=False))
        self._verify_base = table
        if self.live_rows:
            table = list(zip(*live_verify_table(surface, self.live_rows, table)))
        points = [(w - 1, r) for w, r in table]
        scale, per_width = nonneg_lstsq([[1.0, float(w)] for w, _ in points], [r for _, r in points])
        return EngineOverheads(round_s=max(0.0, fmean(per_round)), request_s=max(0.0, fmean(per_request)),
                               verify_scale=scale, verify_scale_per_width=per_width, none_evaluate=none_evaluate,
                               verify_widths=[w for w, _ in table], verify_ratios=[r for _, r in table])

    def finish(self, calibrate: bool = True, fresh_costs: bool = False,
               progress: Callable[[int, int], None] | None = None) -> Trace:
        """The Trace of every prompt added so far (measuring costs unless ``calibrate=False``).
        ``fresh_costs``: measure the verify-cost surface now instead of loading the cached one:
        this machine's speed, and the surface's shape, drift by tens of percent over an hour
        (measured here: V(6)/V(1) at 1,024 cached tokens went from 1.64 to 1.81), and a trace
        should carry the costs of the time it was recorded. ``progress(done, total)``: the
        surface's measurement passes."""
        before = cached_surface(self.loaded) if calibrate and fresh_costs else None  # what engines read
        surface = load_or_measure(self.loaded, refresh=fresh_costs, progress=progress) if calibrate else None
        if surface is not None:
            costs, overheads = self.calibrate(surface)
        else:
            costs, overheads = [DrafterCosts() for _ in self.drafters], EngineOverheads()
        info = {
            "created": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "record_s": time.perf_counter() - self.started,
            "argmax_mismatches": self.argmax_mismatches,
            "tree_attention": self._tree,
            "dtype": str(self.loaded.dtype).replace("torch.", ""), "device": str(self.loaded.device),
            "threads": torch.get_num_threads(),
            "describe": [d.describe() for d in self.drafters],
            # the calibration runs' own live/surface verify ratio per width, before scaling
            "calibration_verify": {str(w): round(r, 4) for w, r in self._calibration_verify.items()},
            # the same for the verify probes timed between the live requests (``VerifyProbe``)
            "probe_verify": {str(w): round(r, 4) for w, r in self._probe_verify.items()},
        }
        if self.live_rows:  # the table before the live rows priced it (``live_verify_table``'s fallback)
            info["verify_base"] = [[w, round(r, 6)] for w, r in self._verify_base]
        info["adaspec_version"] = __version__
        return Trace(target=target_fingerprint(self.loaded), specs=self.specs,
                     names=[d.name for d in self.drafters], is_model=[bool(d.is_model) for d in self.drafters],
                     max_new_tokens=self.max_new_tokens, max_draft=self.max_draft, eos_ids=list(self.eos),
                     stop_on_eos=self.stop_on_eos, surface=surface, drafter_costs=costs,
                     prompts=list(self.prompts), info=info, overheads=overheads,
                     policy_surface=before if before is not None and before.seconds != surface.seconds else None)


class VerifyProbe:
    """Verify steps timed between a bench's live requests, for the trace's per-width prices.

    This machine's wide forwards switch between speed regimes lasting seconds to minutes
    (seen: a width-6 SmolLM2 forward at 77 ms for tens of forwards, then 95 ms, width 1 steady
    at 55 ms), so width ratios measured in the minute of calibration after the live runs
    missed them by up to 15% either way. ``sample()`` (called by ``run_bench`` after every
    request) times a width-1 forward and one wider forward (in turn over ``widths``) on one
    cache of ``context`` random tokens, so the samples spread over the live runs' own minutes;
    ``TraceRecorder`` then prices width w at (probe ratio at w / probe ratio at 1) x the AR
    rounds' ratio, as it does with calibration rows. Needs a backend whose states are
    independent (``free_states() is None``): on llama.cpp's unified cache a second live
    sequence would widen every forward's attention, so the probe is off there."""

    def __init__(self, target: Any, widths: Sequence[int], context: int, seed: int = 0):
        if context < 1:
            raise ConfigError(f"probe context must be a positive number of tokens, got {context}")
        self.target, self.context = target, context
        self.widths = sorted({int(w) for w in widths if w > 1}) or [2]
        self.rows: list[tuple[int, int, float]] = []  # (width, context, seconds)
        self._gen = torch.Generator().manual_seed(seed)
        self._state: Any = None
        self._j = 0

    @staticmethod
    def supported(target: Any) -> bool:
        return target.free_states() is None

    def _ids(self, n: int) -> list[int]:
        return torch.randint(0, self.target.vocab_size, (n,), generator=self._gen).tolist()

    def sample(self) -> None:
        """Time one width-1 and one wider forward (the next of ``widths``), cache cropped back."""
        t = self.target
        if self._state is None:
            self._state = t.new_state()
            t.forward(self._state, self._ids(self.context), 1)
        w = self.widths[self._j % len(self.widths)]
        self._j += 1
        for k in (1, w):
            ids = self._ids(k)
            t0 = time.perf_counter()
            t.forward(self._state, ids, k)
            self.rows.append((k, self.context, time.perf_counter() - t0))
            t.truncate(self._state, self.context)

    def close(self) -> None:
        if self._state is not None:
            self.target.release(self._state)
            self._state = None


class _CyclingLength(StaticLength):
    """Caps in turn from a list (calibration: verify steps of every width of the grid)."""

    def __init__(self, caps: Sequence[int]):
        super().__init__(k=max(caps))
        self.cycle, self._j = list(caps), 0

    def begin_round(self, drafter: int) -> int:
        self._j += 1
        return self.cycle[(self._j - 1) % len(self.cycle)]


#: share of the largest live/surface verify ratios left out of each width's mean: a burst
#: of other load during the few calibration rounds of a width would otherwise set its price
#: for the whole trace (the bench's live times are medians over repeats, which drop bursts too)
VERIFY_TRIM = 0.1


def _trimmed_mean(values: Sequence[float], trim: float = VERIFY_TRIM) -> float:
    v = sorted(values)
    return fmean(v[: max(1, round(len(v) * (1 - trim)))])


def live_verify_table(surface: VerifyCostSurface, rows: Sequence[tuple[int, int, float]],
                      fallback: Sequence[Sequence[float]], trim: float = 0.0
                      ) -> tuple[list[int], list[float]]:
    """(widths, ratios): replay's verify price per width (live seconds over the surface) from
    a bench's own live verify steps, ``rows`` of (width, cached tokens, seconds), pooled over
    its configurations and prompts: the mean at every width seen at least 3 times (``trim``:
    the slowest share left out). Widths only ``fallback`` ((width, ratio) pairs: the probes'
    and calibration's table) prices keep its ratio over its width 1, times the live width 1.

    Why: this machine runs wide forwards in regimes of about a minute (width 6 at 77 or 95 ms,
    width 1 steady), and the share of slow minutes differs from run to run; a bench measures
    thousands of verify steps over exactly the minutes its live times come from, where the
    probes took two per request and the calibration one minute after the run. The bench
    passes the steps of the passes whose times are its live medians (``BenchRun.priced_rows``):
    a slow pass the median drops is dropped from the prices too, and a slow step inside a
    kept pass is paid live, so it is priced (an untrimmed mean)."""
    live = dict(calibration_ratios([(w, s / surface.cost(w, ctx)) for w, ctx, s in rows], relative=False, trim=trim))
    base = {int(w): float(r) for w, r in fallback}
    if 1 not in live or 1 not in base:
        return [int(w) for w, _ in fallback], [float(r) for _, r in fallback]
    table = {w: r / base[1] * live[1] for w, r in base.items()} | live
    widths = sorted(table)
    return widths, [table[w] for w in widths]


def calibration_ratios(rows: Sequence[tuple[int, float]], relative: bool = True,
                       trim: float = VERIFY_TRIM) -> list[tuple[int, float]]:
    """(width, trimmed mean of live verify / surface) for every width seen at least 3 times in
    ``rows``; ``relative``: over the same rows' width-1 mean (drift between the calibration
    runs and the recording cancels), and only if width 1 was seen."""
    by_width: dict[int, list[float]] = {}
    for w, ratio in rows:
        by_width.setdefault(w, []).append(ratio)
    table = sorted((w, _trimmed_mean(v, trim)) for w, v in by_width.items() if len(v) >= 3)
    if not relative:
        return table
    base = dict(table).get(1)
    return [(w, r / base) for w, r in table] if base else []


class _FullInfoRoundRobin(RoundRobinPolicy):
    """Round robin that asks for full information, so every round times the evaluation."""

    full_information = True


def _fit_evaluation(rows: Sequence[tuple[int, int, float]], n: int) -> list[LinearCost]:
    """Per-member ``fixed + per_token x tokens`` from rounds whose eval time is the sum over
    every member but the chosen one: (chosen, verified tokens, seconds) rows."""
    x = [[v for j in range(n) for v in ((1.0, float(m)) if j != i else (0.0, 0.0))] for i, m, _ in rows]
    if not x:
        return [LinearCost() for _ in range(n)]
    coef = nonneg_lstsq(x, [s for *_, s in rows])
    return [LinearCost(fixed=coef[2 * j], per_token=coef[2 * j + 1]) for j in range(n)]


def _unique_labels(labels: list[str]) -> list[str]:
    out: list[str] = []
    for s in labels:
        label, n = s, 2
        while label in out:
            label, n = f"{s}#{n}", n + 1
        out.append(label)
    return out


def _leading_matches(chain: Sequence[int], path: Sequence[int], t: int) -> int:
    n = 0
    while n < len(chain) and t + n < len(path) and chain[n] == path[t + n]:
        n += 1
    return n


def record_trace(target: Any, drafter_specs: Sequence[str | Drafter], prompts: Sequence[Any],
                 max_new_tokens: int, max_draft: int = 16, prompt_meta: Sequence[dict] | None = None,
                 progress: Progress | None = None, stop_on_eos: bool = True,
                 calibrate: bool = True) -> Trace:
    """Record a trace of greedy decoding: for every prompt (token ids, a string or chat
    messages) and every drafter, the draft chain at every position of the target's greedy
    path (module docstring). ``calibrate=False`` skips the cost measurements (replay then
    predicts no times)."""
    if prompt_meta is not None and len(prompt_meta) != len(prompts):
        raise ConfigError(f"prompt_meta has {len(prompt_meta)} entries for {len(prompts)} prompts")
    rec = TraceRecorder(target, drafter_specs, max_new_tokens, max_draft, stop_on_eos, progress)
    for i, p in enumerate(prompts):
        rec.add(p, prompt_meta[i] if prompt_meta is not None else None)
    return rec.finish(calibrate=calibrate)


def record(target: Any, drafters: Sequence[str | Drafter], prompts: Sequence[Any], max_new_tokens: int,
           path: str | Path, *, max_draft: int = 16, progress: Progress | None = None,
           fresh_costs: bool = True, probe: VerifyProbe | None = None,
           live_rows: Sequence[tuple[int, int, float]] = ()) -> Trace:
    """``adaspec bench --record FILE``: record the workload and save it. ``prompts`` are token
    ids, strings, chat messages, or bench prompts (``BenchPrompt``: every turn is one request,
    and a later turn's history holds AR's earlier answers, as in ``run_bench``). The verify-cost
    surface is measured afresh at the end (``fresh_costs``, ~20 s for SmolLM2 here). ``probe``:
    the verify probes of the live runs (``VerifyProbe``), which then set the per-width prices.
    ``live_rows``: the bench's own verify steps, (width, cached tokens, seconds), which price
    every width they cover (``live_verify_table``)."""
    rec = TraceRecorder(target, drafters, max_new_tokens, max_draft, progress=progress)
    rec.probe_rows = list(probe.rows) if probe is not None else []
    rec.live_rows = list(live_rows)
    for p in prompts:
        turns = getattr(p, "turns", None)
        if turns is None:
            rec.add(p)
            continue
        answers: list[str] = []
        for j in range(len(turns)):
            got = rec.add(turn_prompt(p, j, answers, rec.ar),
                          {"id": getattr(p, "id", ""), "category": getattr(p, "category", ""), "turn": j})
            answers.append(rec.ar.decode(got.output))
    def passes(done: int, total: int) -> None:  # the surface's measurement, shown as the trace's
        if progress is not None:
            progress(f"measuring the verify-cost surface for the trace: pass {done}/{total}")

    if progress is not None and fresh_costs:
        progress("measuring the verify-cost surface for the trace")
    trace = rec.finish(fresh_costs=fresh_costs, progress=passes if progress is not None else None)
    trace.save(path)
    return trace
