"""The measured verify-cost curve: time of one target forward over k new tokens.

On CPUs the curve is not flat and not even monotone (measured for SmolLM2-135M fp32 on two
threads: k=2-3 cost 1.7-1.85x a single token, k=5-9 only 1.2-1.4x: a GEMM cliff). The engine
measures it once per model, device, dtype and thread count, caches it on disk, and exposes it
so that the bench and cost-aware policies know what a block of k drafts really costs.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from statistics import median

import torch

from .models import LoadedModel, cache_dir

log = logging.getLogger(__name__)

CLIFF_FACTOR = 1.15  # k is "in a cliff" if some larger k' is this much cheaper
DEFAULT_KS = tuple(range(1, 11)) + (12, 16)


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


def _curve_key(loaded: LoadedModel, context: int, ks: Sequence[int]) -> str:
    model = loaded.model
    n_params = sum(p.numel() for p in model.parameters())
    ident = (f"{loaded.name}|{type(model).__name__}|{n_params}|{loaded.device}|{loaded.dtype}|"
             f"threads={torch.get_num_threads()}|ctx={context}|ks={list(ks)}|torch={torch.__version__}")
    return hashlib.sha256(ident.encode()).hexdigest()[:16]


@torch.inference_mode()
def measure_verify_costs(loaded: LoadedModel, ks: Sequence[int] = DEFAULT_KS,
                         context: int = 200, repeats: int = 3, warmup: int = 1) -> VerifyCostCurve:
    """Time target forwards over k new tokens on a ``context``-token cache; medians of repeats.

    The ks are interleaved within each repeat so machine noise hits them alike.
    """
    from transformers import DynamicCache

    model = loaded.model
    device = loaded.device
    vocab = loaded.vocab_size
    gen = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, vocab, (1, context), generator=gen).to(device)
    cache = DynamicCache(config=model.config)
    model(input_ids=prefix, past_key_values=cache, use_cache=True, logits_to_keep=1)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times: dict[int, list[float]] = {k: [] for k in ks}
    for rep in range(warmup + repeats):
        for k in ks:
            ids = torch.randint(0, vocab, (1, k), generator=gen).to(device)
            sync()
            t0 = time.perf_counter()
            model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=k)
            sync()
            dt = time.perf_counter() - t0
            cache.crop(-k)
            if rep >= warmup:
                times[k].append(dt)
    return VerifyCostCurve(ks=list(ks), seconds=[median(times[k]) for k in ks], context=context)


def load_or_measure(loaded: LoadedModel, ks: Sequence[int] = DEFAULT_KS,
                    context: int = 200, repeats: int = 3, refresh: bool = False) -> VerifyCostCurve:
    """Measured curve for this model and machine, cached in ``$ADASPEC_CACHE/costs``."""
    key = _curve_key(loaded, context, ks)
    path = Path(cache_dir()) / "costs" / f"{key}.json"
    if path.is_file() and not refresh:
        try:
            data = json.loads(path.read_text())
            return VerifyCostCurve(ks=data["ks"], seconds=data["seconds"], context=data["context"], key=key)
        except (ValueError, KeyError) as exc:
            log.warning("ignoring unreadable cost cache %s: %s", path, exc)
    curve = measure_verify_costs(loaded, ks=ks, context=context, repeats=repeats)
    curve.key = key
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(curve)))
    except OSError as exc:
        log.warning("could not cache the verify-cost curve in %s: %s", path, exc)
    return curve


class CostModel:
    """What rounds cost on this machine, for cost-aware policies (model-free numbers only).

    Combines the measured verify-cost curve (if available) with running means, updated by the
    engine after every round, of each drafter's seconds per drafted token and per caught-up
    token, and of observed verify times per width.
    """

    def __init__(self, curve: VerifyCostCurve | None = None, decay: float = 0.9):
        self.curve = curve
        self.decay = decay
        self.draft_token_s: dict[int, float] = {}
        self.catch_up_token_s: dict[int, float] = {}
        self.verify_width_s: dict[int, float] = {}
        #: running mean of a round's seconds outside drafting, verification and catch-up
        #: (policies, full-information scoring, bookkeeping): paid by every round alike
        self.round_overhead_s = 0.0
        self._overhead_seen = False

    def _ema(self, table: dict[int, float], key: int, value: float) -> None:
        old = table.get(key)
        table[key] = value if old is None else self.decay * old + (1 - self.decay) * value

    def observe(self, drafter: int, drafted: int, draft_s: float, verify_s: float,
                catch_up_tokens: int, catch_up_s: float) -> None:
        if drafted:
            self._ema(self.draft_token_s, drafter, draft_s / drafted)
        if catch_up_tokens:
            self._ema(self.catch_up_token_s, drafter, catch_up_s / catch_up_tokens)
        self._ema(self.verify_width_s, drafted + 1, verify_s)

    def observe_overhead(self, seconds: float) -> None:
        seconds = max(0.0, seconds)
        if not self._overhead_seen:
            self.round_overhead_s, self._overhead_seen = seconds, True
        else:
            self.round_overhead_s = self.decay * self.round_overhead_s + (1 - self.decay) * seconds

    def verify_cost(self, width: int) -> float:
        """Seconds of one target forward over ``width`` tokens (curve, else observed, else 0)."""
        if self.curve is not None:
            return self.curve.cost(width)
        if width in self.verify_width_s:
            return self.verify_width_s[width]
        if self.verify_width_s:  # nearest observed width
            nearest = min(self.verify_width_s, key=lambda w: abs(w - width))
            return self.verify_width_s[nearest]
        return 0.0

    def draft_cost(self, drafter: int, n_tokens: int) -> float:
        """Estimated seconds for ``drafter`` to draft ``n_tokens`` (0 if never observed)."""
        return self.draft_token_s.get(drafter, 0.0) * n_tokens

    def catch_up_cost(self, drafter: int, n_tokens: int) -> float:
        return self.catch_up_token_s.get(drafter, 0.0) * n_tokens
