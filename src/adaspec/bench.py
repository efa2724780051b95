"""``adaspec bench``: plain decoding vs speculative configurations, side by side, in one process.

Every configuration runs on the same loaded target. Runs are interleaved (prompt by prompt,
configuration by configuration) after a warm-up so that machine noise hits all of them
alike; per-prompt times are medians over repeats. Greedy outputs are compared with plain
decoding token for token and every mismatch is reported.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from .drafters import Drafter, build_drafter
from .engine import SpeculativeEngine
from .models import LoadedModel
from .prompts import BUILTIN_PROMPTS, BenchPrompt


@dataclass
class BenchConfig:
    """One configuration: drafters, selector and length policy (drafters=[] is plain AR)."""

    name: str
    drafters: list[str | Drafter]
    k: int = 5
    selector: str | None = None
    length: str | None = None


@dataclass
class ConfigResult:
    name: str
    tokens: int = 0
    seconds: float = 0.0  # sum over prompts of the median time
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    identical: int = 0
    prompts: int = 0
    mismatches: list[str] = field(default_factory=list)
    overhead_shares: list[float] = field(default_factory=list)
    catch_up_s: float = 0.0
    draft_s: float = 0.0
    target_s: float = 0.0
    per_prompt_tps: list[float] = field(default_factory=list)
    verify_widths: dict[int, int] = field(default_factory=dict)
    cliff_share: float | None = None  # share of rounds whose verify width is in a cost cliff

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def mat(self) -> float:
        return self.tokens / self.rounds if self.rounds else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def discard_rate(self) -> float:
        """SpecDec++ eq. (5.1): discarded drafts per generated token."""
        return (self.drafted - self.accepted) / self.tokens if self.tokens else 0.0

    @property
    def verification_rate(self) -> float:
        """SpecDec++ eq. (5.1): target forwards per generated token."""
        return self.rounds / self.tokens if self.tokens else 0.0

    @property
    def overhead_share(self) -> float:
        """Median over prompts of (median engine overhead per round / median target forward)."""
        return statistics.median(self.overhead_shares) if self.overhead_shares else 0.0


@dataclass
class BenchReport:
    model: str
    max_new_tokens: int
    repeats: int
    results: list[ConfigResult]
    verify_costs: dict[str, Any] | None = None

    @property
    def baseline(self) -> ConfigResult:
        return self.results[0]

    def speedup(self, r: ConfigResult) -> float:
        return self.baseline.seconds / r.seconds if r.seconds else 0.0

    def to_dict(self) -> dict[str, Any]:
        rows = []
        for r in self.results:
            d = asdict(r)
            d.update(tokens_per_s=r.tokens_per_s, mat=r.mat, acceptance_rate=r.acceptance_rate,
                     speedup=self.speedup(r), overhead_share=r.overhead_share,
                     discard_rate=r.discard_rate, verification_rate=r.verification_rate)
            rows.append(d)
        return {"model": self.model, "max_new_tokens": self.max_new_tokens, "repeats": self.repeats,
                "results": rows, "verify_costs": self.verify_costs}

    def markdown(self) -> str:
        lines = ["| configuration | tokens/s | speed-up vs AR | MAT | acceptance | discard rate "
                 "| verification rate | identical to AR |",
                 "|---|---:|---:|---:|---:|---:|---:|---|"]
        for r in self.results:
            same = f"{r.identical}/{r.prompts}" + ("" if r.identical == r.prompts else " MISMATCH")
            lines.append(f"| {r.name} | {r.tokens_per_s:.1f} | {self.speedup(r):.2f}x | {r.mat:.2f} "
                         f"| {r.acceptance_rate:.1%} | {r.discard_rate:.2f} "
                         f"| {r.verification_rate:.2f} | {same} |")
        return "\n".join(lines)


def default_configs(drafters: Sequence[str], ks: Sequence[int], selectors: Sequence[str] = (),
                    lengths: Sequence[str] = (), static: bool = True) -> list[BenchConfig]:
    """Plain AR first (the baseline); then every drafter at every K (static); every selector
    over the whole drafter pool (at the first K); every length policy with every drafter."""
    configs = [BenchConfig("AR (no drafter)", [])]
    if static:
        for d in drafters:
            for k in ks:
                configs.append(BenchConfig(f"{d} k={k}", [d], k=k))
    for sel in selectors:
        configs.append(BenchConfig(f"{sel} over [{', '.join(drafters)}]", list(drafters), k=ks[0],
                                   selector=sel))
    for ln in lengths:
        for d in drafters:
            configs.append(BenchConfig(f"{d} + {ln}", [d], k=ks[0], length=ln))
    return configs


def run_bench(target: LoadedModel, configs: Sequence[BenchConfig],
              prompts: Sequence[BenchPrompt] = BUILTIN_PROMPTS, max_new_tokens: int = 128,
              repeats: int = 1, warmup_tokens: int = 16, measure_costs: bool = True,
              progress: Callable[[str], None] | None = None) -> BenchReport:
    """Run all configurations over all prompts (greedy) and aggregate."""
    if not configs or configs[0].drafters:
        configs = [BenchConfig("AR (no drafter)", []), *configs]
    built: dict[str, Drafter] = {}  # model drafters are loaded once and shared by configurations

    def drafter(spec: str | Drafter) -> Drafter:
        if isinstance(spec, Drafter):
            return spec
        if not spec.startswith("model:"):  # model-free state (e.g. a learning datastore) is not shared
            return build_drafter(spec, target)
        if spec not in built:
            built[spec] = build_drafter(spec, target)
        return built[spec]

    engines = [SpeculativeEngine(target, [drafter(d) for d in c.drafters], k=c.k,
                                 selector=c.selector, length=c.length) for c in configs]
    results = [ConfigResult(c.name) for c in configs]
    encoded = [engines[0].encode_prompt(p.text) for p in prompts]
    for e in engines:  # warm-up: first calls allocate and pick kernels
        e.generate(encoded[0], max_new_tokens=warmup_tokens)
    for pi, ids in enumerate(encoded):
        outs: list[list[int] | None] = [None] * len(engines)
        times: list[list[float]] = [[] for _ in engines]
        last: list[Any] = [None] * len(engines)
        for _ in range(repeats):
            for ci, e in enumerate(engines):
                if progress:
                    progress(f"prompt {pi + 1}/{len(encoded)} [{prompts[pi].category}] {configs[ci].name}")
                res = e.generate(ids, max_new_tokens=max_new_tokens)
                times[ci].append(res.stats.total_s)
                outs[ci], last[ci] = res.token_ids, res
        ref = outs[0]
        for ci, r in enumerate(results):
            st = last[ci].stats
            med = statistics.median(times[ci])
            r.prompts += 1
            r.tokens += st.new_tokens
            r.seconds += med
            r.rounds += st.n_rounds
            r.drafted += st.drafted
            r.accepted += st.accepted
            split = st.time_split
            r.catch_up_s += split["catch_up"]
            r.draft_s += split["drafting"]
            r.target_s += split["target_forward"]
            r.per_prompt_tps.append(st.new_tokens / med if med else 0.0)
            r.overhead_shares.append(st.overhead_share)
            for w, c in st.verify_widths().items():
                r.verify_widths[w] = r.verify_widths.get(w, 0) + c
            if outs[ci] == ref:
                r.identical += 1
            else:
                first = next((j for j, (a, b) in enumerate(zip(outs[ci], ref)) if a != b),
                             min(len(outs[ci]), len(ref)))
                r.mismatches.append(f"prompt {pi} ({prompts[pi].category}): first difference at token {first}")
    costs = None
    if measure_costs:
        if progress:
            progress("measuring the verify-cost curve")
        curve = engines[0].verify_costs()
        costs = curve.to_dict()
        cliffs = set(curve.cliffs())
        for r in results:
            n = sum(r.verify_widths.values())
            r.cliff_share = sum(c for w, c in r.verify_widths.items() if w in cliffs) / n if n else 0.0
    return BenchReport(target.name, max_new_tokens, repeats, results, costs)


def save_report(report: BenchReport, path: str) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(report.to_dict(), fh, indent=2)
