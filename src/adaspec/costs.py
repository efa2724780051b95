"""The measured cost model: what a target forward, a draft and a catch-up cost on this machine.

Verification: a target forward over k new tokens costs V(k, L), a function of the cache
length L as well as of k. On CPUs the k-axis is not flat and not even monotone (a blocked
GEMM kernel can make k=5-9 cheaper than k=2-3: a cost cliff), and a forward on a long cache costs more, and grows faster with k,
than on a short one (attention over L keys). The engine measures V on a small grid of
(L, k) once per model, device, dtype, thread count and machine (``VerifyCostSurface``),
caches it on disk and interpolates between grid points, so that cost-aware policies, replay
and the bench price a round at the context it runs at; the cost model scales it by the live
ratio the rounds show (``LiveVerifyRatio``). Drafting and catch-up costs are linear functions
of what drives them (``LinearCost``: tokens and context length), fitted from live rounds.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import logging
import math
import time
from bisect import bisect_right
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from statistics import median, median_low
from typing import Any

import torch

from .errors import ConfigError
from .feedback import NO_CONTEXT, RoundContext
from .backends.base import TargetBackend
from .artifacts import cached_measurement
from .kernels import machine_identity
from .models import cache_dir

log = logging.getLogger(__name__)

CLIFF_FACTOR = 1.15  # k is "in a cliff" if some larger k' is this much cheaper
DEFAULT_KS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16)
#: cache lengths of the grid: short chats to retrieval / summary prompts of 1k tokens (V is
#: extrapolated linearly in L past the last: attention cost grows linearly with the cache)
DEFAULT_CONTEXTS = (32, 128, 256, 512, 1024)
SURFACE_FORMAT = "surface/4"  # part of the cache key: bump when the measurement changes (4: median_low)
#: a grid whose passes are quick gets more timed passes (medians of more forwards), up to this
#: many, while they fit in ``GRID_BUDGET_S`` with the warm-up: a 2-pass grid of a fast target
#: moves by several percent between two measurements, and ``auto`` plans every round on it
MAX_GRID_REPEATS = 8
GRID_BUDGET_S = 20.0


@dataclass
class VerifyCostCurve:
    """Median seconds of a target forward over k new tokens after ``context`` cached tokens."""

    ks: list[int]
    seconds: list[float]
    context: int
    key: str = ""

    def cost(self, k: int) -> float:
        """Seconds for a forward over k tokens (linear extrapolation past the last k)."""
        if k <= 0:
            return 0.0
        if k in self.ks:
            return self.seconds[self.ks.index(k)]
        if k < self.ks[0]:
            return self.seconds[0]
        if k > self.ks[-1]:
            if len(self.ks) == 1:
                return self.seconds[0]
            k0, k1 = self.ks[-2], self.ks[-1]
            slope = max(0.0, (self.seconds[-1] - self.seconds[-2]) / (k1 - k0))
            return self.seconds[-1] + slope * (k - k1)
        lo = max(x for x in self.ks if x < k)
        hi = min(x for x in self.ks if x > k)
        a, b = self.cost(lo), self.cost(hi)
        return a + (b - a) * (k - lo) / (hi - lo)

    def ratio(self, k: int) -> float:
        """Cost of k tokens relative to one token."""
        return self.cost(k) / self.cost(1)

    def cliffs(self) -> list[int]:
        """Widths k for which a wider forward (k' > k) is at least CLIFF_FACTOR x cheaper."""
        out = []
        for i, k in enumerate(self.ks):
            later = self.seconds[i + 1:]
            if later and self.seconds[i] > CLIFF_FACTOR * min(later):
                out.append(k)
        return out

    def to_dict(self) -> dict:
        return asdict(self) | {"ratios": [round(self.ratio(k), 3) for k in self.ks],
                               "cliffs": self.cliffs()}

    def table(self) -> str:
        rows = [f"k={k:>2}: {s * 1e3:7.1f} ms  {self.ratio(k):4.2f}x" + ("  <- cliff" if k in self.cliffs() else "")
                for k, s in zip(self.ks, self.seconds)]
        return "\n".join(rows)


#: widths every surface row is precomputed for: auto prices blocks of up to max_k + 1 = 65
#: tokens every round (a row past the grid's widest k was 17 interpolations, 50 us a round)
DENSE_WIDTHS = 65


#: a wider forward measured cheaper than a narrower one by at most this share of the
#: narrower's seconds is timing noise (``monotone_within_noise``): exactly the dips that are
#: not cliffs by ``CLIFF_FACTOR``, so policies and reports agree on what a cliff is
NOISE_DIP = 1.0 - 1.0 / CLIFF_FACTOR


def monotone_within_noise(seconds: Sequence[float], tol: float = NOISE_DIP) -> list[float]:
    """``seconds`` over increasing widths, pooled (averaged) wherever a wider forward was
    measured cheaper by at most ``tol`` of the narrower's: pool-adjacent-violators (the
    non-decreasing least-squares fit) with merges limited to such dips, so a drop larger than
    ``tol`` (by default a ``CLIFF_FACTOR`` cliff) stays a cost cliff. Why: a grid median of a
    few forwards moves by several percent between widths whose true costs are equal, and
    policies that price every width take such a dip as a cliff and stop there (`auto` would
    plan 3-token blocks where 4 or 5 cost the same). The real cliffs of blocked kernels are
    far larger (30% and more)."""
    blocks: list[list[float]] = []  # [mean, count]
    for v in seconds:
        blocks.append([float(v), 1.0])
        while len(blocks) > 1:
            (m1, w1), (m2, w2) = blocks[-2], blocks[-1]
            if not (m2 < m1 and m1 - m2 <= tol * m1):
                break
            blocks[-2:] = [[(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2]]
    out: list[float] = []
    for m, w in blocks:
        out += [m] * int(w)
    return out


@dataclass
class VerifyCostSurface:
    """Median seconds V(k, L) of a target forward over k new tokens on an L-token cache, on a
    grid (``seconds[i][j]`` for ``contexts[i]``, ``ks[j]``), and of a prefill of L tokens on an
    empty cache (``prefill_seconds[i]``).

    Between grid points V is interpolated linearly, first along k within each context (as
    ``VerifyCostCurve.cost``), then along L; below the first context the first row is used,
    past the last one the last two rows are extrapolated (never below the last row). Every
    width up to ``max(ks[-1], DENSE_WIDTHS)`` is precomputed per context, so ``cost`` is one
    bisection and two list reads (policies call it inside the draft loop), and ``row`` one
    interpolation of two lists.

    On a backend that reuses its compute graph for a repeated shape (``reuses_graphs``:
    llama.cpp) ``seconds`` are steady forwards (the same width as the one before) and
    ``switch_s`` is what a forward of another width pays on top (``CostModel.switch_cost``).
    """

    contexts: list[int]
    ks: list[int]
    seconds: list[list[float]]
    prefill_seconds: list[float] = field(default_factory=list)
    key: str = ""
    measure_s: float = 0.0  # wall time of the measurement
    switch_s: float = 0.0  # extra seconds of a forward whose width differs from the last one's

    def __post_init__(self) -> None:
        if not self.contexts or not self.ks:
            raise ConfigError("a verify-cost surface needs at least one context and one k")
        if sorted(set(self.contexts)) != list(self.contexts) or sorted(set(self.ks)) != list(self.ks):
            raise ConfigError(f"surface contexts {self.contexts} and ks {self.ks} must be strictly increasing")
        if len(self.seconds) != len(self.contexts) or any(len(r) != len(self.ks) for r in self.seconds):
            raise ConfigError(f"surface seconds must be {len(self.contexts)} rows of {len(self.ks)} values")
        if self.prefill_seconds and len(self.prefill_seconds) != len(self.contexts):
            raise ConfigError(f"surface prefill_seconds must have {len(self.contexts)} values, one per context")
        self._rows = [VerifyCostCurve(list(self.ks), list(r), c) for c, r in zip(self.contexts, self.seconds)]
        top = max(self.ks[-1], DENSE_WIDTHS)
        self._dense = [[0.0] + [row.cost(w) for w in range(1, top + 1)] for row in self._rows]

    @classmethod
    def of(cls, costs: VerifyCostSurface | VerifyCostCurve | None) -> VerifyCostSurface | None:
        """A surface from a surface, a one-context curve (V then does not depend on L), or None."""
        if costs is None or isinstance(costs, VerifyCostSurface):
            return costs
        return cls([costs.context], list(costs.ks), [list(costs.seconds)], key=costs.key)

    @classmethod
    def from_dict(cls, data: dict) -> VerifyCostSurface:
        return cls(contexts=list(data["contexts"]), ks=list(data["ks"]),
                   seconds=[list(r) for r in data["seconds"]],
                   prefill_seconds=list(data.get("prefill_seconds", [])), key=data.get("key", ""),
                   measure_s=float(data.get("measure_s", 0.0)), switch_s=float(data.get("switch_s", 0.0)))

    def _row(self, i: int, k: int) -> float:
        dense = self._dense[i]
        return dense[k] if k < len(dense) else self._rows[i].cost(k)

    def cost(self, k: int, context: int) -> float:
        """Seconds of a forward over ``k`` tokens on a ``context``-token cache."""
        if k <= 0:
            return 0.0
        cs = self.contexts
        if context <= cs[0] or len(cs) == 1:
            return self._row(0, k)
        i = min(bisect_right(cs, context) - 1, len(cs) - 2)
        a, b = self._row(i, k), self._row(i + 1, k)
        v = a + (b - a) * ((context - cs[i]) / (cs[i + 1] - cs[i]))  # as ``row``: the same float
        return max(v, b) if context > cs[-1] else v

    def row(self, context: int, max_k: int) -> list[float]:
        """[0, V(1, L), ..., V(max_k, L)]: ``cost`` for every width at once, one interpolation
        (policies price every width each round)."""
        cs = self.contexts
        if max_k >= len(self._dense[0]):
            return [0.0] + [self.cost(k, context) for k in range(1, max_k + 1)]
        if context <= cs[0] or len(cs) == 1:
            return self._dense[0][: max_k + 1]
        i = min(bisect_right(cs, context) - 1, len(cs) - 2)
        f = (context - cs[i]) / (cs[i + 1] - cs[i])
        lo, hi = self._dense[i], self._dense[i + 1]
        out = [a + (b - a) * f for a, b in zip(lo[: max_k + 1], hi[: max_k + 1])]
        if context > cs[-1]:
            out = [max(v, b) for v, b in zip(out, hi)]
        return out

    def curve(self, context: int) -> VerifyCostCurve:
        """V(., context) over the grid's ks (a grid row, or interpolated)."""
        return VerifyCostCurve(list(self.ks), [self.cost(k, context) for k in self.ks], context, self.key)

    def denoised(self, tol: float = NOISE_DIP) -> VerifyCostSurface:
        """The surface with each context's row fitted by ``monotone_within_noise``: what the
        engine's policies price (``SpeculativeEngine._attach_costs``); reports and
        ``adaspec costs`` show the measured one. Computed once per ``tol`` (a server prices each
        request's policies on it; the surface, like its interpolation tables, is not changed
        after it is made)."""
        memo = self.__dict__.setdefault("_denoised", {})
        if tol not in memo:
            memo[tol] = replace(self, seconds=[monotone_within_noise(r, tol) for r in self.seconds])
        return memo[tol]

    def cliffs(self, context: int) -> list[int]:
        """Widths in a cost cliff at this context (``VerifyCostCurve.cliffs``)."""
        return self.curve(context).cliffs()

    def cliffs_by_context(self) -> dict[int, list[int]]:
        return {c: row.cliffs() for c, row in zip(self.contexts, self._rows)}

    def prefill(self, n_tokens: int) -> float:
        """Seconds of a prefill forward over ``n_tokens`` on an empty cache: linear between the
        measured (context, seconds) points, from (1, V(1, 0)) below the first, extrapolated
        with the last segment's slope past the last; without prefill points, V(n, 0)."""
        if n_tokens <= 0:
            return 0.0
        if not self.prefill_seconds:
            return self.cost(n_tokens, 0)
        xs = [1, *self.contexts] if self.contexts[0] > 1 else list(self.contexts)
        ys = [self._row(0, 1), *self.prefill_seconds] if self.contexts[0] > 1 else list(self.prefill_seconds)
        if len(xs) == 1:
            return ys[0]
        i = min(max(bisect_right(xs, n_tokens) - 1, 0), len(xs) - 2)
        return max(0.0, ys[i] + (ys[i + 1] - ys[i]) * (n_tokens - xs[i]) / (xs[i + 1] - xs[i]))

    def scaled(self, factor: float | Callable[[int], float], per_width: float = 0.0) -> VerifyCostSurface:
        """The surface with V(k, L) multiplied by the live verify step's ratio to the measured
        forward at width k: ``factor(k)`` for a function of the width
        (``EngineOverheads.verify_factor``), else ``factor + per_width (k - 1)``; prefills by
        the ratio at width 1. Grid widths are scaled, so widths between them interpolate the
        scaled values."""
        f = factor if callable(factor) else (lambda k: factor + per_width * (k - 1))
        rows = [[x * f(k) for k, x in zip(self.ks, r)] for r in self.seconds]
        return VerifyCostSurface(list(self.contexts), list(self.ks), rows,
                                 [x * f(1) for x in self.prefill_seconds], self.key, self.measure_s,
                                 self.switch_s)

    def to_dict(self) -> dict:
        return {"contexts": self.contexts, "ks": self.ks, "seconds": self.seconds,
                "prefill_seconds": self.prefill_seconds, "key": self.key, "measure_s": self.measure_s,
                "switch_s": self.switch_s, "cliffs": {str(c): v for c, v in self.cliffs_by_context().items()}}

    def table(self) -> str:
        """Milliseconds per (cache length, k), ratios to k=1 at the same length, cliffs marked *."""
        head = "   cache " + "".join(f"{'k=' + str(k):>8}" for k in self.ks) + "   prefill"
        lines = [head]
        for i, (c, row) in enumerate(zip(self.contexts, self._rows)):
            cl = set(row.cliffs())
            cells = "".join(f"{s * 1e3:7.1f}{'*' if k in cl else ' '}" for k, s in zip(self.ks, row.seconds))
            pre = f"{self.prefill_seconds[i] * 1e3:8.1f}" if self.prefill_seconds else "       -"
            lines.append(f"{c:>8} {cells} {pre}")
            lines.append(" " * 9 + "".join(f"{row.ratio(k):7.2f}x" for k in self.ks))
        lines.append("ms per forward over k new tokens on a cache of that many tokens (second line: "
                     "ratio to k=1); * = cost cliff (a wider forward is cheaper)")
        if self.switch_s:
            lines.append(f"a forward of another width than the last one's: +{self.switch_s * 1e3:.2f} ms "
                         "(the backend rebuilds its compute graph)")
        return "\n".join(lines)


@dataclass
class LinearCost:
    """Seconds = ``fixed`` + ``per_token`` x tokens + ``per_context`` x context length: a
    drafter's draft, catch-up or prefill time as a function of what drives it (tokens for
    model drafters, context length for prompt lookup and suffix matching)."""

    fixed: float = 0.0
    per_token: float = 0.0
    per_context: float = 0.0

    def __call__(self, n_tokens: float, context: int = 0) -> float:
        """Seconds of one call over ``n_tokens`` (0 tokens: a call that produced nothing, e.g.
        a prompt-lookup attempt without a match, still costs ``fixed``)."""
        return self.fixed + self.per_token * n_tokens + self.per_context * context

    @classmethod
    def fit(cls, samples: Sequence[tuple[int, int, float]]) -> LinearCost:
        """Least squares over (tokens, context, seconds) samples of calls, coefficients kept
        >= 0; a driver without spread in the samples gets no coefficient."""
        if not samples:
            return cls()
        coef = nonneg_lstsq([[1.0, float(n), float(c)] for n, c, _ in samples], [s for *_, s in samples])
        return cls(*coef)


def nonneg_lstsq(x: Sequence[Sequence[float]], y: Sequence[float]) -> list[float]:
    """Least squares ``x b = y`` with ``b >= 0``: constant columns other than the first and
    all-zero columns get 0, and the most negative coefficient is dropped until none is left
    (an active-set approximation of NNLS, enough for the few cost drivers here)."""
    import numpy as np

    a = np.asarray(x, dtype=float)
    v = np.asarray(y, dtype=float)
    n_cols = a.shape[1]
    active = [j for j in range(n_cols) if a[:, j].any() and (j == 0 or np.ptp(a[:, j]) > 0)]
    out = [0.0] * n_cols
    while active:
        coef, *_ = np.linalg.lstsq(a[:, active], v, rcond=None)
        worst = min(range(len(active)), key=lambda i: coef[i])
        if coef[worst] >= 0:
            for j, c in zip(active, coef):
                out[j] = float(c)
            break
        active.pop(worst)
    return out


@dataclass
class DrafterCosts:
    """One drafter's measured costs: drafting n tokens at context L, catching up on n tokens,
    the prompt prefill at its first use in a request (n = prompt tokens), and the
    full-information evaluation (``score``) of n verified tokens."""

    draft: LinearCost = field(default_factory=LinearCost)
    catch_up: LinearCost = field(default_factory=LinearCost)
    prefill: LinearCost = field(default_factory=LinearCost)
    evaluate: LinearCost = field(default_factory=LinearCost)

    @classmethod
    def from_dict(cls, data: dict) -> DrafterCosts:
        return cls(**{k: LinearCost(**v) for k, v in data.items()})


@dataclass
class EngineOverheads:
    """What live runs add to the measured costs: per round, the engine's time outside the
    verify step, drafters and policies (bookkeeping, stop checks, records) and per request
    (begin_request of drafters and policies, statistics); the live verify step (forward,
    greedy verification, input tensor, cache crop) over the surface's V(w, L) at the same
    width and cache length, per width; and the full-information evaluation of the ``none``
    drafter (gammas of an empty proposal) per verified token.

    The verify ratio is a table (``verify_widths``, ``verify_ratios``: one robust mean per
    width observed live, piecewise linear between them, flat outside), not one factor nor a
    line in w: it is not monotone in w. Measured on SmolLM2 fp32 (2 threads, mixed suite,
    every round of a quiet 7-configuration bench): 0.95 at w=1, 0.86 at 5, 0.82-0.84 at 6,
    0.88-0.90 at 8, 0.82-0.90 at 12, 0.90-0.94 at 16-17 -- the grid's forwards, each after
    a forward of another width and with five caches alive, cost relatively more at mid widths
    than the engine's. A line through those points (the earlier model, ``verify_scale +
    verify_scale_per_width (w - 1)``, fitted mostly on widths 1 and 17 of the calibration
    runs) priced w=5-6 8-17% too high, so replay under-predicted every drafting
    configuration; it is kept for traces recorded before the table (``verify_factor``)."""

    round_s: float = 0.0
    request_s: float = 0.0
    verify_scale: float = 1.0
    verify_scale_per_width: float = 0.0
    none_evaluate: LinearCost = field(default_factory=LinearCost)
    verify_widths: list[int] = field(default_factory=list)
    verify_ratios: list[float] = field(default_factory=list)

    def verify_factor(self, width: int) -> float:
        """Live verify step / surface at ``width``: the table (``_interp``, flat past its
        ends), else the line of older traces."""
        if self.verify_widths:
            if width >= self.verify_widths[-1]:
                return self.verify_ratios[-1]
            return _interp(self.verify_widths, self.verify_ratios, width)
        return self.verify_scale + self.verify_scale_per_width * (width - 1)

    @classmethod
    def from_dict(cls, data: dict) -> EngineOverheads:
        return cls(round_s=float(data.get("round_s", 0.0)), request_s=float(data.get("request_s", 0.0)),
                   verify_scale=float(data.get("verify_scale", 1.0)),
                   verify_scale_per_width=float(data.get("verify_scale_per_width", 0.0)),
                   none_evaluate=LinearCost(**data.get("none_evaluate", {})),
                   verify_widths=[int(w) for w in data.get("verify_widths", [])],
                   verify_ratios=[float(r) for r in data.get("verify_ratios", [])])


def _surface_key(loaded: TargetBackend, contexts: Sequence[int], ks: Sequence[int]) -> str:
    ident = (f"{SURFACE_FORMAT}|{loaded.identity()}|{machine_identity(loaded.device)}"
             f"|ctx={list(contexts)}|ks={list(ks)}")
    return hashlib.sha256(ident.encode()).hexdigest()[:16]


def grid_contexts(loaded: TargetBackend, contexts: Sequence[int], ks: Sequence[int]) -> list[int]:
    """The grid's contexts that fit the model's window with the widest forward (the largest
    fitting length replaces those that do not)."""
    if not contexts or any(not isinstance(c, int) or c < 1 for c in contexts):
        raise ConfigError(f"cost-grid contexts must be positive integers, got {list(contexts)}: e.g. 128,512")
    if not ks or any(not isinstance(k, int) or k < 1 for k in ks):
        raise ConfigError(f"cost-grid ks must be positive integers, got {list(ks)}: e.g. 1,2,4,8")
    cs = sorted(set(contexts))
    window = loaded.context_window
    if window is None:
        return cs
    top = window - max(ks) - 1
    if top < 1:
        raise ConfigError(f"the model's context window ({window}) is too short for k up to {max(ks)}")
    fit = [c for c in cs if c <= top]
    return fit + ([top] if len(fit) < len(cs) else [])


@torch.inference_mode()
def measure_verify_surface(loaded: TargetBackend, contexts: Sequence[int] = DEFAULT_CONTEXTS,
                           ks: Sequence[int] = DEFAULT_KS, repeats: int = 2, warmup: int = 1,
                           progress: Callable[[int, int], None] | None = None,
                           budget_s: float | None = None) -> VerifyCostSurface:
    """Time target forwards over k new tokens on caches of every grid length (the low
    medians of ``repeats`` after ``warmup`` passes: of two, the faster), and the prefill of each length (once, after an
    untimed warm-up prefill: the first forwards of a shape allocate and page in). Contexts and
    ks are interleaved within each pass so machine noise hits the grid alike. With
    ``budget_s``, the first pass's time sets the timed passes: as many as fit in the budget
    with the warm-up, ``repeats`` at least and ``MAX_GRID_REPEATS`` at most.
    On a backend that ``reuses_graphs`` each width is timed twice in a row: the second is the
    steady V, and the median of first minus second the switch ``switch_s``.
    ``progress(done, total)`` after every pass. Runs on any backend (``TargetBackend``)."""
    t_start = time.perf_counter()
    contexts = grid_contexts(loaded, contexts, ks)
    device, vocab = loaded.device, loaded.vocab_size
    gen = torch.Generator().manual_seed(0)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def timed(ids: list[int], cache: object, keep: int) -> float:
        sync()
        t0 = time.perf_counter()
        loaded.forward(cache, ids, keep)
        sync()
        return time.perf_counter() - t0

    prefix = torch.randint(0, vocab, (max(contexts),), generator=gen).tolist()
    # one live state per context, prefilled twice (untimed warm-up, then timed). A backend whose
    # states share one pool (llama.cpp: a unified KV cache, whose used span sets every forward's
    # attention width, and n_seq_max sequences) gets one state at a time, prefilled every pass:
    # with all contexts live, a 32-token forward there paid for ~2,000 cells of attention
    together = loaded.free_states() is None
    caches: list[object] = []
    pre: list[float] = [0.0] * len(contexts)
    times: dict[tuple[int, int], list[float]] = {(c, k): [] for c in contexts for k in ks}
    switches: list[float] = []
    total = warmup + repeats
    steady = bool(getattr(loaded, "reuses_graphs", False))

    def measure(cache: object, c: int, rep: int) -> None:
        for k in ks:
            ids = torch.randint(0, vocab, (k,), generator=gen).tolist()
            dt = timed(ids, cache, k)
            loaded.truncate(cache, c)
            if steady:  # the same shape again: the graph is reused
                again = timed(ids, cache, k)
                loaded.truncate(cache, c)
                if rep >= warmup:
                    switches.append(dt - again)
                dt = again
            if rep >= warmup:
                times[(c, k)].append(dt)

    # timed as requests run (``TargetBackend.request_scope``): on llama.cpp with AMX, outside
    # it the caller's idle OpenMP workers throttled every forward and put cliffs in the grid
    scope = getattr(loaded, "request_scope", None)
    try:
        rep = 0
        with scope() if scope is not None else contextlib.nullcontext():
            while rep < total:
                t_pass = time.perf_counter()
                if together and rep <= warmup:  # prefills: untimed in the warm-up, then timed once
                    for cache in caches:
                        loaded.release(cache)
                    caches = [loaded.new_state() for _ in contexts]
                    pre = [timed(prefix[:c], cache, 1) for c, cache in zip(contexts, caches)]
                for j, c in enumerate(contexts):
                    if together:
                        measure(caches[j], c, rep)
                        continue
                    cache = loaded.new_state()
                    try:
                        t = timed(prefix[:c], cache, 1)
                        pre[j] = t if rep == warmup else pre[j]
                        measure(cache, c, rep)
                    finally:
                        loaded.release(cache)
                if rep == 0 and budget_s:
                    pass_s = max(time.perf_counter() - t_pass, 1e-9)
                    fit = int((budget_s - pass_s * warmup) // pass_s)
                    total = warmup + max(repeats, min(MAX_GRID_REPEATS, fit))
                rep += 1
                if progress is not None:
                    progress(rep, total)
    finally:
        for cache in caches:
            loaded.release(cache)
    # the lower middle of an even count (of 2, the smaller): machine noise only adds time, and
    # llama.cpp's grids get 2 timed passes in the budget, whose mean a single slow forward moved
    seconds = [[median_low(times[(c, k)]) for k in ks] for c in contexts]
    return VerifyCostSurface(list(contexts), list(ks), seconds, pre, measure_s=time.perf_counter() - t_start,
                             switch_s=max(0.0, median(switches)) if switches else 0.0)


def measure_verify_costs(loaded: TargetBackend, ks: Sequence[int] = DEFAULT_KS,
                         context: int = 200, repeats: int = 3, warmup: int = 1) -> VerifyCostCurve:
    """One row of the surface: forwards over k new tokens on a ``context``-token cache."""
    return measure_verify_surface(loaded, (context,), ks, repeats, warmup).curve(context)


def load_or_measure(loaded: TargetBackend, ks: Sequence[int] = DEFAULT_KS,
                    contexts: Sequence[int] = DEFAULT_CONTEXTS, repeats: int = 2, refresh: bool = False,
                    progress: Callable[[int, int], None] | None = None,
                    budget_s: float | None = GRID_BUDGET_S) -> VerifyCostSurface:
    """Measured surface for this model and machine, cached in ``$ADASPEC_CACHE/costs``
    (``measure_verify_surface``: at least ``repeats`` timed passes, more while ``budget_s``
    allows)."""
    contexts = grid_contexts(loaded, contexts, ks)
    key = _surface_key(loaded, contexts, ks)
    return cached_measurement(Path(cache_dir()) / "costs" / f"{key}.json", key, VerifyCostSurface.from_dict,
                   lambda: measure_verify_surface(loaded, contexts, ks, repeats, progress=progress,
                                                  budget_s=budget_s),
                   "verify-cost surface", refresh, shown=progress is not None)


def cached_surface(loaded: TargetBackend, ks: Sequence[int] = DEFAULT_KS,
                   contexts: Sequence[int] = DEFAULT_CONTEXTS) -> VerifyCostSurface | None:
    """The surface ``load_or_measure`` would return now without measuring: the cached one, or
    None if there is none (or it is unreadable). Engines read it (``verify_costs``), so a
    trace keeps it as the surface its live policies decided on (``Trace.policy_surface``)."""
    contexts = grid_contexts(loaded, contexts, ks)
    key = _surface_key(loaded, contexts, ks)
    path = Path(cache_dir()) / "costs" / f"{key}.json"
    try:
        found = VerifyCostSurface.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError, ConfigError):
        return None
    found.key = key
    return found


#: the batch verify-cost grid: rows in the batch, tokens per row, cache lengths (columns)
BATCH_ROWS = (1, 2, 4, 8, 16, 32)
BATCH_WIDTHS = (1, 2, 3, 4, 6, 8)
BATCH_CONTEXTS = (128, 512)
BATCH_FORMAT = "batch/1"  # part of the cache key: bump when the measurement changes


def _interp(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise linear: the first value below the grid, the last segment's slope (>= 0) past it."""
    if len(xs) == 1 or x <= xs[0]:
        return ys[0]
    i = min(bisect_right(xs, x) - 1, len(xs) - 2)
    slope = (ys[i + 1] - ys[i]) / (xs[i + 1] - xs[i])
    if x > xs[-1]:
        slope = max(slope, 0.0)
    return ys[i] + slope * (x - xs[i])


@dataclass
class BatchCosts:
    """Median seconds V(rows, width, L) of one padded batch forward: ``rows`` rows of ``width``
    new tokens each on an ``L``-column batch cache (``seconds[context][rows][width]``),
    interpolated linearly along width, rows and L (``_interp``).

    ``row_cost`` is what one row's block costs in such a batch, for the per-row policies: its
    share of a plain batched step plus the whole increase its width causes, since the forward
    is as wide as its widest row: V(R, 1)/R + V(R, w) - V(R, 1). With the other rows plain,
    a row that drafts raises the batch's tokens per second exactly when its own rate under this
    price rises, so as the batch grows compute-bound (V(R, w) - V(R, 1) ~ R (w - 1) V1), rows
    draft less, down to plain decoding."""

    contexts: list[int]
    rows: list[int]
    widths: list[int]
    seconds: list[list[list[float]]]
    key: str = ""
    measure_s: float = 0.0

    def __post_init__(self) -> None:
        for name, xs in (("contexts", self.contexts), ("rows", self.rows), ("widths", self.widths)):
            if not xs or sorted(set(xs)) != list(xs):
                raise ConfigError(f"batch costs {name} {xs} must be non-empty and strictly increasing")
        if (len(self.seconds) != len(self.contexts) or any(len(r) != len(self.rows) for r in self.seconds)
                or any(len(w) != len(self.widths) for r in self.seconds for w in r)):
            raise ConfigError(f"batch costs seconds must be {len(self.contexts)} x {len(self.rows)} x "
                              f"{len(self.widths)} values (contexts x rows x widths)")

    def cost(self, rows: int, width: int, context: int) -> float:
        """Seconds of a forward over ``rows`` rows of ``width`` tokens on ``context`` columns."""
        if width <= 0 or rows <= 0:
            return 0.0
        per_ctx = [_interp(self.rows, [_interp(self.widths, w, width) for w in r], rows) for r in self.seconds]
        return max(0.0, _interp(self.contexts, per_ctx, context))

    def row_cost(self, rows: int, width: int, context: int) -> float:
        """The price of one row's ``width``-token block in a batch of ``rows`` (class docstring)."""
        if width <= 0:
            return 0.0
        plain = self.cost(rows, 1, context)
        return plain / max(rows, 1) + max(0.0, self.cost(rows, width, context) - plain)

    @classmethod
    def from_dict(cls, data: dict) -> BatchCosts:
        return cls(list(data["contexts"]), list(data["rows"]), list(data["widths"]),
                   [[list(w) for w in r] for r in data["seconds"]], data.get("key", ""),
                   float(data.get("measure_s", 0.0)))

    def to_dict(self) -> dict:
        return asdict(self)

    def table(self, context: int | None = None) -> str:
        """Milliseconds per (rows, width) at one cache length (default: the first)."""
        c = self.contexts[0] if context is None else context
        head = f"cache {c}: rows " + "".join(f"{'w=' + str(w):>8}" for w in self.widths)
        lines = [head] + [f"{r:>15} " + "".join(f"{self.cost(r, w, c) * 1e3:8.1f}" for w in self.widths)
                          for r in self.rows]
        return "\n".join(lines)


class StepCosts:
    """A serving engine's verify costs learnt from its own step times (the vLLM proposer, which
    cannot time a forward of its own): a decayed mean of the step's seconds per (rows, width),
    rows in powers of two, width the batch's widest block (1 + its longest draft), as
    ``BatchCosts`` (flat in the cache length) for the policies' prices (``CostModel``).

    Widths not observed for a row count are read off a line fitted to the observed ones
    (V(w) = a + b (w - 1), b >= 0); with one width observed, ``prior_slope`` a per token (a
    flat curve, as a GPU's at small batches: drafting looks cheap until wider steps are seen,
    which is how wider widths get observed at all)."""

    def __init__(self, decay: float = 0.9, prior_slope: float = 0.02, max_width: int = 17):
        if not 0.0 <= decay < 1.0:
            raise ConfigError(f"decay must be in [0, 1), got {decay!r}")
        self.decay, self.prior_slope, self.max_width = decay, prior_slope, max_width
        self._seconds: dict[int, dict[int, float]] = {}  # rows bucket -> width -> seconds
        self._costs: BatchCosts | None = None

    @staticmethod
    def bucket(rows: int) -> int:
        return 1 << max(0, int(rows) - 1).bit_length()

    def observe(self, rows: int, width: int, seconds: float) -> None:
        """A step of ``rows`` rows, the widest ``width`` tokens, took ``seconds``."""
        if rows < 1 or width < 1 or not seconds > 0.0:
            return
        table = self._seconds.setdefault(self.bucket(rows), {})
        w = min(int(width), self.max_width)
        old = table.get(w)
        table[w] = seconds if old is None else self.decay * old + (1 - self.decay) * seconds
        self._costs = None

    def curve(self, bucket: int) -> list[float]:
        """V(1..max_width) of a row bucket: observed means, the fitted line elsewhere."""
        table = self._seconds[bucket]
        ws = sorted(table)
        if len(ws) == 1:
            a = table[ws[0]] / (1 + self.prior_slope * (ws[0] - 1))
            b = self.prior_slope * a
        else:
            mean_w = sum(ws) / len(ws)
            mean_v = sum(table[w] for w in ws) / len(ws)
            var = sum((w - mean_w) ** 2 for w in ws)
            b = max(0.0, sum((w - mean_w) * (table[w] - mean_v) for w in ws) / var)
            a = mean_v - b * (mean_w - 1)
        return [table.get(w, max(0.0, a + b * (w - 1))) for w in range(1, self.max_width + 1)]

    def costs(self) -> BatchCosts | None:
        """The learnt costs as ``BatchCosts`` (None before any step)."""
        if self._costs is None and self._seconds:
            rows = sorted(self._seconds)
            self._costs = BatchCosts([0], rows, list(range(1, self.max_width + 1)),
                                     [[self.curve(r) for r in rows]], key="learnt from step times")
        return self._costs

    def surface(self) -> VerifyCostSurface | None:
        """The one-row curve (the smallest row bucket's) as a verify-cost surface."""
        costs = self.costs()
        if costs is None:
            return None
        return VerifyCostSurface([0], list(costs.widths), [list(costs.seconds[0][0])], key=costs.key)


def batch_grid_rows(max_batch: int) -> list[int]:
    """The batch grid's row counts for batches of at most ``max_batch`` rows: ``BATCH_ROWS`` up
    to the first that holds ``max_batch`` (on SmolLM2, AVX2 EPYC, rows 1-8 took 45 s, rows 1-32
    150 s, and a batch of 8 never prices 16 or 32)."""
    out = [r for r in BATCH_ROWS if r < max_batch]
    return out + [next((r for r in BATCH_ROWS if r >= max_batch), max_batch)]


def load_or_measure_batch_costs(loaded: TargetBackend,
                                measure: Callable[..., BatchCosts],
                                rows: Sequence[int] = BATCH_ROWS, widths: Sequence[int] = BATCH_WIDTHS,
                                contexts: Sequence[int] = BATCH_CONTEXTS, refresh: bool = False,
                                progress: Callable[[int, int], None] | None = None) -> BatchCosts:
    """``measure(loaded, rows, widths, contexts, progress=progress)`` once per model, device,
    dtype, thread count and machine (the surface's key scheme), cached in
    ``$ADASPEC_CACHE/costs``."""
    contexts = grid_contexts(loaded, contexts, widths)
    ident = (f"{BATCH_FORMAT}|{loaded.identity()}|{machine_identity(loaded.device)}"
             f"|ctx={list(contexts)}|rows={list(rows)}|w={list(widths)}")
    key = hashlib.sha256(ident.encode()).hexdigest()[:16]
    return cached_measurement(Path(cache_dir()) / "costs" / f"batch-{key}.json", key, BatchCosts.from_dict,
                   lambda: measure(loaded, list(rows), list(widths), list(contexts), progress=progress),
                   "batch verify costs", refresh, shown=progress is not None)


class LiveVerifyRatio:
    """Live verify seconds over the surface's price, per width, learned from the rounds
    (``CostModel.observe``): the grid is measured once, in other conditions, and the live step
    adds verification and cache work, more at wide widths than at narrow ones, so a grid alone
    prices wide trees low against narrow blocks.

    Per width, a decayed mean of log(live / priced), shrunk toward a weighted line in the width
    fitted over every width's mean (``prior`` rounds' weight): a width verified a few times
    reads mostly the trend all rounds show, and one slow forward moves nothing much (each log
    ratio is also clipped to +-``clip`` around the line). A width never verified interpolates
    its neighbours' estimates, flat past the narrowest and widest. ``decay`` applies per
    observed round (~200 rounds' memory at 0.995): a machine's prices drift slowly, a round's
    noise is large."""

    def __init__(self, decay: float = 0.995, prior: float = 10.0, clip: float = 0.5):
        if not 0.0 < decay <= 1.0 or prior <= 0.0 or clip <= 0.0:
            raise ConfigError(f"LiveVerifyRatio needs 0 < decay <= 1, prior > 0 and clip > 0, "
                              f"got decay={decay}, prior={prior}, clip={clip}")
        self.decay, self.prior, self.clip = decay, prior, clip
        self._sum: dict[int, float] = {}  # decayed sums of log ratios, per width
        self._weight: dict[int, float] = {}  # decayed counts, per width
        self._line = (0.0, 0.0)  # (a, b): log ratio ~ a + b (w - 1), weighted over the widths
        self._factors: list[float] = [1.0]  # factor per width 0.. (cache; [1.0]: rebuild)

    @property
    def seen(self) -> bool:
        return bool(self._weight)

    def trend(self, width: int) -> float:
        """The fitted line's log ratio at ``width``."""
        return self._line[0] + self._line[1] * (width - 1)

    def observe(self, width: int, live_s: float, priced_s: float) -> None:
        """A verify forward of ``width`` tokens took ``live_s`` where the surface said ``priced_s``."""
        if live_s <= 0.0 or priced_s <= 0.0 or width < 1:
            return
        x = math.log(live_s / priced_s)
        if self._weight:
            t = self.trend(width)
            x = min(max(x, t - self.clip), t + self.clip)
        d = self.decay
        for w in self._weight:
            self._sum[w] *= d
            self._weight[w] *= d
        self._sum[width] = self._sum.get(width, 0.0) + x
        self._weight[width] = self._weight.get(width, 0.0) + 1.0
        # weighted least squares of the widths' means on (w - 1)
        sw = sx = sy = sxx = sxy = 0.0
        for w, n in self._weight.items():
            u, y = w - 1, self._sum[w] / n
            sw += n
            sx += n * u
            sy += n * y
            sxx += n * u * u
            sxy += n * u * y
        var = sw * sxx - sx * sx
        b = (sw * sxy - sx * sy) / var if var > 1e-12 * sw * sw else 0.0
        self._line = ((sy - b * sx) / sw, b)
        self._factors = [1.0]

    def factors(self, max_width: int) -> list[float]:
        """[1.0, f(1), ..., f(max_width)] (at least): the multipliers of V at each width (all 1
        before any observation)."""
        if len(self._factors) <= max_width:
            if not self._weight:
                return [1.0] * (max_width + 1)
            widths = sorted(self._weight)
            logs = [(self._sum[w] + self.prior * self.trend(w)) / (self._weight[w] + self.prior) for w in widths]
            out = [1.0]
            for w in range(1, max(max_width, widths[-1], 32) + 1):  # policies ask width by width
                if w <= widths[0]:
                    x = logs[0]
                elif w >= widths[-1]:
                    x = logs[-1]
                else:
                    i = bisect_right(widths, w) - 1
                    x = logs[i] + (logs[i + 1] - logs[i]) * (w - widths[i]) / (widths[i + 1] - widths[i])
                out.append(math.exp(x))
            self._factors = out
        return self._factors

    def factor(self, width: int) -> float:
        return self.factors(width)[width] if width >= 1 else 1.0


class CostModel:
    """What rounds cost on this machine, for cost-aware policies (model-free numbers only).

    Combines the measured verify-cost surface (if available), read at the round's context
    (``feedback.RoundContext``: the row's cache length, the rows of its forward, the width of
    the forward before it; passed to every price by the round and the policies that price
    rounds, never kept here) with running means, updated after every round, of each drafter's
    seconds per drafted token and per caught-up token, and of observed verify times per width.
    A one-context ``VerifyCostCurve`` is accepted as a surface that does not depend on L.
    The surface's prices are multiplied by the live/surface ratio of the rounds' verify
    steps per width (``LiveVerifyRatio``; ``live_verify=False``: the surface as measured).
    """

    def __init__(self, surface: VerifyCostSurface | VerifyCostCurve | None = None, decay: float = 0.9, *,
                 curve: VerifyCostCurve | None = None, drafters: dict[int, DrafterCosts] | None = None,
                 live_verify: bool = True):
        self.surface = VerifyCostSurface.of(surface if surface is not None else curve)
        #: live verify seconds over the surface's, per width (None: the surface as measured)
        self.live: LiveVerifyRatio | None = LiveVerifyRatio() if live_verify else None
        self.decay = decay
        #: measured cost functions per drafter index (e.g. a trace's); preferred over running means
        self.drafters: dict[int, DrafterCosts] = dict(drafters or {})
        self.draft_token_s: dict[int, float] = {}
        self.catch_up_token_s: dict[int, float] = {}
        self.verify_width_s: dict[int, float] = {}
        #: running mean of a round's seconds outside drafting, verification and catch-up
        #: (looks, policies, bookkeeping): paid by every round alike. Not scoring (budgeted on
        #: its own, ``eval_share``) nor a drafter's first-use prompt ingestion (once a request)
        self.round_overhead_s = 0.0
        self._overhead_seen = False
        #: running mean of a looking round's peeks and planning (``observe_look``; ``auto``)
        self.look_s = 0.0
        #: decayed tokens and priced seconds of the rounds so far (``observe_round``): the
        #: generation's running rate, the opportunity cost of a round's seconds
        self.rate_decay = 0.999
        self._rate_tokens = 0.0
        self._rate_seconds = 0.0
        #: decayed seconds of full-information scoring and of whole rounds (``observe_eval``)
        self._eval_s = 0.0
        self._round_s = 0.0
        #: batched rounds (``adaspec.batch``): the batch surface; a round of several rows
        #: (``RoundContext.rows`` > 1) is priced as the row's share of it (``row_cost``)
        self.batch: BatchCosts | None = None

    @property
    def curve(self) -> VerifyCostSurface | None:
        """The measured surface (name kept from the single-curve model)."""
        return self.surface

    @curve.setter
    def curve(self, costs: VerifyCostSurface | VerifyCostCurve | None) -> None:
        self.surface = VerifyCostSurface.of(costs)

    def _ema(self, table: dict[int, float], key: int, value: float) -> None:
        old = table.get(key)
        table[key] = value if old is None else self.decay * old + (1 - self.decay) * value

    def observe(self, drafter: int, drafted: int, draft_s: float, verify_s: float,
                catch_up_tokens: int, catch_up_s: float, ctx: RoundContext = NO_CONTEXT) -> None:
        """A round's measured seconds: drafting, verifying ``drafted + 1`` tokens (in the
        round's context ``ctx``) and catching up."""
        if drafted:
            self._ema(self.draft_token_s, drafter, draft_s / drafted)
        if catch_up_tokens:
            self._ema(self.catch_up_token_s, drafter, catch_up_s / catch_up_tokens)
        width = drafted + 1
        self._ema(self.verify_width_s, width, verify_s)
        if self.live is not None and self.surface is not None and ctx.rows <= 1:  # a batch row's share is not V
            self.live.observe(width, verify_s, self._surface_price(width, ctx))

    def observe_overhead(self, seconds: float) -> None:
        seconds = max(0.0, seconds)
        if not self._overhead_seen:
            self.round_overhead_s, self._overhead_seen = seconds, True
        else:
            self.round_overhead_s = self.decay * self.round_overhead_s + (1 - self.decay) * seconds

    def observe_look(self, seconds: float) -> None:
        """Seconds a round spent looking at the drafters' blocks and planning (``auto``'s
        peeks): what skipping a look saves (``AutoController.looks``)."""
        seconds = max(0.0, seconds)
        self.look_s = seconds if self.look_s == 0.0 else self.decay * self.look_s + (1 - self.decay) * seconds

    def observe_round(self, emitted: int, width: int, other_s: float, ctx: RoundContext = NO_CONTEXT) -> None:
        """A finished round: ``emitted`` tokens for a verify forward of ``width`` tokens (priced
        by ``verify_cost`` in the round's context, so live runs and replays agree) plus
        ``other_s`` measured seconds outside the verify step. Feeds ``running_rate``."""
        keep = self.rate_decay
        self._rate_tokens = keep * self._rate_tokens + emitted
        self._rate_seconds = keep * self._rate_seconds + self.verify_cost(width, ctx) + max(0.0, other_s)

    def observe_eval(self, eval_s: float, round_s: float) -> None:
        """A round's seconds scoring drafters it did not play (full information) and its whole
        seconds: ``eval_share`` is the scoring's share of the wall time (decayed by
        ``rate_decay`` per round, kept across requests)."""
        keep = self.rate_decay
        self._eval_s = keep * self._eval_s + max(0.0, eval_s)
        self._round_s = keep * self._round_s + max(0.0, round_s)

    @property
    def eval_share(self) -> float:
        """Share of the wall time spent scoring drafters the rounds did not play (0 before any)."""
        return self._eval_s / self._round_s if self._round_s > 0.0 else 0.0

    def running_rate(self, ctx: RoundContext = NO_CONTEXT) -> float:
        """Tokens per second of the rounds so far (decayed by ``rate_decay`` per round, kept
        across requests); before any round, plain decoding's 1 / (overhead + V(1)) in ``ctx``."""
        if self._rate_seconds > 0.0:
            return self._rate_tokens / self._rate_seconds
        plain = self.round_overhead_s + self.verify_cost(1, ctx)
        return 1.0 / plain if plain > 0.0 else 0.0

    def verify_cost(self, width: int, ctx: RoundContext = NO_CONTEXT) -> float:
        """Seconds of one target forward over ``width`` tokens in the round's context (its
        ``cache_len``-token cache): the surface (times ``live``'s ratio), else observed times,
        else 0. In a batch of several rows: the row's price of a ``width``-token block
        (``BatchCosts.row_cost``)."""
        if self.batch is not None and ctx.rows > 1:
            return self.batch.row_cost(ctx.rows, width, ctx.batch_columns)
        if self.surface is not None:
            v = self._surface_price(width, ctx)
            return v * self.live.factor(width) if self.live is not None else v
        if width in self.verify_width_s:
            return self.verify_width_s[width]
        if self.verify_width_s:  # nearest observed width
            nearest = min(self.verify_width_s, key=lambda w: abs(w - width))
            return self.verify_width_s[nearest]
        return 0.0

    def _surface_price(self, width: int, ctx: RoundContext) -> float:
        """The surface's V(width, cache length) plus ``switch_cost``: what the grid says, before
        ``live``'s ratio (the price that ratio is learned against)."""
        v = self.surface.cost(width, ctx.cache_len)
        return v + self.switch_cost(width, ctx.last_width) if self.surface.switch_s else v

    def verify_row(self, max_width: int, ctx: RoundContext = NO_CONTEXT) -> list[float]:
        """[0, verify_cost(1), ..., verify_cost(max_width)] in the round's context."""
        if self.surface is not None and not (self.batch is not None and ctx.rows > 1):
            row = self.surface.row(ctx.cache_len, max_width)
            extra, last = self._block_switch(ctx.last_width), ctx.last_width
            if extra and max_width > 1:  # ``switch_cost`` of every width, at once
                steady, row = row, row[:2] + [v + extra for v in row[2:]]
                if 1 < last <= max_width:
                    row[last] = steady[last]
            if self.live is not None and self.live.seen:
                f = self.live.factors(max_width)
                row = [v * f[w] for w, v in enumerate(row)]
            return row
        return [0.0] + [self.verify_cost(w, ctx) for w in range(1, max_width + 1)]

    def switch_cost(self, width: int, last_width: int = 0) -> float:
        """What a verify forward of ``width`` tokens adds, on a backend that rebuilds its compute
        graph for a new shape (``VerifyCostSurface.switch_s`` = s), after a forward of
        ``last_width`` (0: the prefill, ``RoundContext.last_width``). A run of blocks costs one
        rebuild going in and one coming out (the plain step after it), whenever it ends: a block after a plain step is charged both (2 s), a
        block of another width than the block before it one (s), a plain step or a block of
        the same width nothing (the way out was paid on the way in). 0 on other backends."""
        if width <= 1 or width == last_width:
            return 0.0
        return self._block_switch(last_width)

    def _block_switch(self, last_width: int) -> float:
        """``switch_cost`` of a block of a width other than ``last_width``: 2 s after a plain
        step (or none yet), s after another block, 0 without a switch price."""
        s = self.surface.switch_s if self.surface is not None else 0.0
        return s if last_width > 1 else 2.0 * s

    def draft_cost(self, drafter: int, n_tokens: float, ctx: RoundContext = NO_CONTEXT) -> float:
        """Estimated seconds for ``drafter`` to draft ``n_tokens`` in the round's context: its
        measured function of (tokens, cache length), else the running mean per token (0 if never
        observed)."""
        f = self.drafters.get(drafter)
        if f is not None:
            return f.draft(n_tokens, ctx.cache_len)
        return self.draft_token_s.get(drafter, 0.0) * n_tokens

    def catch_up_cost(self, drafter: int, n_tokens: float, ctx: RoundContext = NO_CONTEXT) -> float:
        """Estimated seconds for ``drafter`` to catch up on ``n_tokens`` (as ``draft_cost``)."""
        if n_tokens <= 0:
            return 0.0
        f = self.drafters.get(drafter)
        if f is not None:
            return f.catch_up(n_tokens, ctx.cache_len)
        return self.catch_up_token_s.get(drafter, 0.0) * n_tokens

    def knows(self, drafter: int) -> bool:
        """Has ``drafter`` a measured cost function or an observed drafting time?"""
        return drafter in self.drafters or drafter in self.draft_token_s

    def for_drafters(self, keys: Sequence[int]) -> DrafterCostView:
        """This model as seen by an engine view drafting with the drafters at ``keys``
        (``SpeculativeEngine.with_policies``): its drafter i is drafter ``keys[i]`` here."""
        return DrafterCostView(self, keys)


class DrafterCostView:
    """A ``CostModel`` seen by an engine view that drafts with a subset of the engine's drafters
    (``SpeculativeEngine.with_policies``; a server request or a batch row with its own
    drafters): the view's drafter i is the shared model's drafter ``keys[i]``, so a drafter's
    learnt seconds stay its own whatever its index in a view (before, a request drafting with
    suffix alone wrote suffix's seconds under index 0, prompt lookup's in the engine, and a batch
    without the pool's heads wrote the datastore's under a head's). Every other attribute (the
    surface, the overheads, the running rate) is the shared model's, read and written through; a copy (``copy.copy``, as ``BatchEngine`` takes) copies the shared model
    and keeps the mapping."""

    def __init__(self, base: CostModel, keys: Sequence[int]):
        object.__setattr__(self, "_base", base)
        object.__setattr__(self, "_keys", tuple(int(k) for k in keys))

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("_base", "_keys"):
            raise AttributeError(name)
        return getattr(self._base, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._base, name, value)

    def __copy__(self) -> DrafterCostView:
        return DrafterCostView(copy.copy(self._base), self._keys)

    @property
    def keys(self) -> tuple[int, ...]:
        return self._keys

    def for_drafters(self, keys: Sequence[int]) -> DrafterCostView:
        return DrafterCostView(self._base, [self._keys[k] for k in keys])

    def knows(self, drafter: int) -> bool:
        return self._base.knows(self._keys[drafter])

    def observe(self, drafter: int, drafted: int, draft_s: float, verify_s: float,
                catch_up_tokens: int, catch_up_s: float, ctx: RoundContext = NO_CONTEXT) -> None:
        self._base.observe(self._keys[drafter], drafted, draft_s, verify_s, catch_up_tokens, catch_up_s, ctx)

    def draft_cost(self, drafter: int, n_tokens: float, ctx: RoundContext = NO_CONTEXT) -> float:
        return self._base.draft_cost(self._keys[drafter], n_tokens, ctx)

    def catch_up_cost(self, drafter: int, n_tokens: float, ctx: RoundContext = NO_CONTEXT) -> float:
        return self._base.catch_up_cost(self._keys[drafter], n_tokens, ctx)
