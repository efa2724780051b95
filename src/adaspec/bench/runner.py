"""``adaspec bench``: plain decoding vs speculative configurations and peers, side by side.

Every configuration runs on the same loaded target, in one process. Runs are interleaved
(prompt by prompt, configuration by configuration) after a warm-up so that machine noise hits
all of them alike; each repeat is a pass over the whole workload, and per-prompt times are
medians over passes (minutes apart, so a slow minute of the machine drops out). Greedy outputs are compared
with plain decoding (AR, always the first configuration) token for token and every mismatch
is reported. Multi-turn prompts are run turn by turn; the history of a later turn is AR's
answer, so every configuration sees the same context.

The result is a ``BenchRun``: one ``PromptRecord`` per (configuration, prompt), the per-round
records, and ``summary()``, the ``summary.json`` document (schema ``adaspec.bench/1``,
docs/summary-schema.md) from which ``adaspec.bench.report`` writes report.md and the plots.
"""

from __future__ import annotations

import csv
import datetime as _dt
import json
import re
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from ..config import GenerationConfig, SamplingConfig, validate_k
from ..drafters import Drafter, build_drafter, drafts_trees
from ..engine import SpeculativeEngine
from ..errors import ConfigError
from ..exactness import NEAR_TIE_NATS, divergence_gap
from ..kernels import linear_mode
from ..quant import weights_mode
from ..metrics import Rates, RequestStats
from ..models import LoadedModel
from .workloads import BUILTIN_PROMPTS, BenchPrompt, turn_prompt

SCHEMA = "adaspec.bench/1"
AR_NAME = "AR (no drafter)"
ROUND_FIELDS = ("config", "prompt_id", "category", "position", "turn", "round", "drafter", "k_cap", "drafted",
                "accepted", "emitted", "draft_s", "verify_s", "catch_up_s", "policy_s", "total_s", "tree_nodes")


@dataclass
class BenchConfig:
    """One configuration: drafters, selector and length policy (drafters=[] is plain AR), or
    a peer (``peer="hf-pld"``: Hugging Face assisted generation, see ``adaspec.peers``)."""

    name: str
    drafters: list[str | Drafter] = field(default_factory=list)
    k: int = 5
    selector: str | None = None
    length: str | None = None
    peer: str | None = None
    tree: bool = False  # draft trees from the drafters that propose them (``SpeculativeEngine(tree=)``)

    @property
    def kind(self) -> str:
        """ar | static (one drafter, static K) | adaptive (a selector or length policy) | peer."""
        if self.peer:
            return "peer"
        if not self.drafters:
            return "ar"
        if self.selector is None and self.length is None and len(self.drafters) == 1:
            return "static"
        return "adaptive"

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "k": self.k, "selector": self.selector,
                "length": self.length, "peer": self.peer, "tree": self.tree,
                "drafters": [d if isinstance(d, str) else d.describe() for d in self.drafters]}


@dataclass
class PromptRecord:
    """One configuration on one prompt (all its turns): median time over repeats."""

    config: str
    prompt_id: str
    category: str
    position: int  # order of the prompt in the workload
    tokens: int = 0
    seconds: float = 0.0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    policy_s: float = 0.0
    eval_s: float = 0.0  # full-information scoring of drafters the rounds did not play
    identical: bool = True
    first_mismatch: int | None = None
    #: at the first difference from AR: |log p(AR's token) - log p(this token)| under the target's
    #: logits there (nats); a near-tie when at most ``tie_nats`` (the backend's bound there)
    mismatch_gap: float | None = None
    tie_nats: float = NEAR_TIE_NATS
    error: str | None = None  # a peer that failed on this prompt: what it raised (not in the totals)
    drafter_usage: dict[str, int] = field(default_factory=dict)
    overhead_shares: list[float] = field(default_factory=list)
    verify_widths: dict[int, int] = field(default_factory=dict)
    #: the time of every pass over the workload (turns summed); ``seconds`` is their median
    pass_seconds: list[float] = field(default_factory=list)
    #: the prefill / decode split (``emission_split``; turns summed, medians over passes): seconds
    #: to the first emission of new tokens, and the tokens emitted after it in ``decode_s``
    #: seconds; None where the configuration does not say (a peer without timings)
    prefill_s: float | None = 0.0
    decode_s: float | None = 0.0
    decode_tokens: int | None = 0


def plus(a: Any, b: Any) -> Any:
    """``a + b``, or None when either is unknown (None)."""
    return None if a is None or b is None else a + b


def add_passes(total: Sequence[float], more: Sequence[float]) -> list[float]:
    """Per-pass times summed pass by pass (``total`` empty: a copy of ``more``)."""
    return [a + b for a, b in zip(total, more)] if total else list(more)


@dataclass
class ConfigResult(Rates):
    """Totals of one configuration over a set of prompts."""

    name: str
    tokens: int = 0
    seconds: float = 0.0  # sum over prompts of the median time
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    identical: int = 0
    prompts: int = 0
    policy_s: float = 0.0
    eval_s: float = 0.0
    mismatches: list[str] = field(default_factory=list)  # differences from AR that are not near-ties
    near_ties: list[str] = field(default_factory=list)  # differences at a numeric near-tie
    failed: list[str] = field(default_factory=list)  # prompts a peer failed on (left out of the totals)
    failed_ids: set[str] = field(default_factory=set)
    overhead_shares: list[float] = field(default_factory=list)
    verify_widths: dict[int, int] = field(default_factory=dict)
    cliff_share: float | None = None  # share of rounds whose verify width is in a cost cliff
    #: the workload's time in every pass (sums over prompts): does an order hold in each pass?
    pass_seconds: list[float] = field(default_factory=list)
    #: sums over prompts of ``PromptRecord.prefill_s`` / ``decode_s`` / ``decode_tokens``; None
    #: when a prompt's record has no split
    prefill_s: float | None = 0.0
    decode_s: float | None = 0.0
    decode_tokens: int | None = 0

    @property
    def tokens_per_s(self) -> float:
        """Wall tokens/s: new tokens / the requests' whole time (prefill included)."""
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Tokens emitted after each request's first emission / the time from it to the last."""
        if self.decode_s is None or self.decode_tokens is None:
            return None
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else None

    @property
    def prefill_s_per_prompt(self) -> float | None:
        """Mean seconds to the first emission of new tokens, per prompt (its turns summed)."""
        return self.prefill_s / self.prompts if self.prefill_s is not None and self.prompts else None

    @property
    def token_count(self) -> int:
        return self.tokens

    @property
    def round_count(self) -> int:
        return self.rounds

    @property
    def overhead_share(self) -> float:
        """Median over prompts of (median engine overhead per round / median target forward)."""
        return statistics.median(self.overhead_shares) if self.overhead_shares else 0.0

    @property
    def policy_share(self) -> float:
        """Share of wall time spent in the drafter and length policies."""
        return self.policy_s / self.seconds if self.seconds else 0.0

    @property
    def scoring_share(self) -> float:
        """Share of wall time spent scoring drafters the rounds did not play (full information)."""
        return self.eval_s / self.seconds if self.seconds else 0.0

    @classmethod
    def total(cls, name: str, records: Sequence[PromptRecord]) -> ConfigResult:
        r = cls(name)
        for p in records:
            if p.error is not None:
                r.failed.append(f"prompt {p.prompt_id} ({p.category}): {p.error}")
                r.failed_ids.add(p.prompt_id)
                continue
            r.prompts += 1
            r.tokens += p.tokens
            r.seconds += p.seconds
            r.rounds += p.rounds
            r.drafted += p.drafted
            r.accepted += p.accepted
            r.policy_s += p.policy_s
            r.eval_s += p.eval_s
            r.overhead_shares.extend(p.overhead_shares)
            for w, c in p.verify_widths.items():
                r.verify_widths[w] = r.verify_widths.get(w, 0) + c
            if p.pass_seconds:
                r.pass_seconds = add_passes(r.pass_seconds, p.pass_seconds)
            r.prefill_s, r.decode_s = plus(r.prefill_s, p.prefill_s), plus(r.decode_s, p.decode_s)
            r.decode_tokens = plus(r.decode_tokens, p.decode_tokens)
            if p.identical:
                r.identical += 1
                continue
            where = "" if p.first_mismatch is None else f": first difference at token {p.first_mismatch}"
            if p.mismatch_gap is not None:
                where += f", gap {p.mismatch_gap:.3g} nats"
                if p.tie_nats != NEAR_TIE_NATS:  # a backend whose kernels move margins more
                    where += f" (this backend's near-tie bound there: {p.tie_nats:g})"
            if p.mismatch_gap is not None and p.mismatch_gap <= p.tie_nats:
                r.near_ties.append(f"prompt {p.prompt_id} ({p.category}){where}")
            else:
                r.mismatches.append(f"prompt {p.prompt_id} ({p.category}){where}")
        return r


@dataclass
class BenchRun:
    """Everything one bench run measured."""

    model: str
    configs: list[BenchConfig]
    records: list[PromptRecord]  # config-major is not guaranteed: filter by name
    rounds: list[dict[str, Any]]
    max_new_tokens: int
    repeats: int
    temperature: float = 0.0
    suite: str = "builtin"
    device: str = "cpu"
    dtype: str = "float32"
    verify_costs: dict[str, Any] | None = None
    backend: str = "transformers"  # what ran the target (``backends``)
    #: adaspec's linear kernels (``kernels.linear_mode``): "packed", "small-batch" or "stock"
    linear: str = "stock"
    #: the target's weights (``quant.weights_mode``): "dense" or "gguf[TYPES]/ISA" (its own
    #: quantized blocks; Hugging Face peers then run the dense twin)
    weights: str = "dense"
    #: llama.cpp's flash attention as the target ran it (True, False; None: llama.cpp's own
    #: choice, or another backend)
    flash_attn: bool | None = None
    #: replay's predictions from a trace of this workload (``predict_from``): config -> {"seconds",
    #: "tokens", "per_category": {category: seconds}} or {"unavailable": reason}
    predictions: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: replay's hindsight bounds on that trace: the per-round oracle and, on the same basis,
    #: AR and the per-prompt static oracle (``predict_from``); None without a trace
    round_oracle: dict[str, Any] | None = None
    #: every chain round's verify step of every engine request in every pass (``VerifyStep``);
    #: the trace recorded after the run prices widths by those of the median passes
    #: (``priced_rows``; ``trace.record(live_rows=...)``), and ``predict_from`` leaves each
    #: configuration's own out. Written to ``verify_steps.csv``, so a run can be re-priced offline.
    verify_rows: list[VerifyStep] = field(default_factory=list)
    #: how much the machine's speed drifted between the runs (``steadiness``); None when too few
    #: runs had plain rounds
    steadiness: dict[str, Any] | None = None
    #: every peer's settings (``Peer.settings``: a llama-server's binary, version and command line)
    peer_settings: dict[str, dict[str, Any]] = field(default_factory=dict)

    def priced_rows(self, leave_out: str | None = None) -> list[tuple[int, int, float]]:
        """(width, cached tokens, seconds) of the verify steps replay's prices come from: those
        of the passes whose times are the live medians (``VerifyStep.median``), without the
        configuration ``leave_out``'s own."""
        return [(r.width, r.cached, r.seconds) for r in self.verify_rows
                if r.median and r.config != leave_out]

    # -- aggregation ----------------------------------------------------------------------
    def of(self, config: str, category: str | None = None) -> list[PromptRecord]:
        return [r for r in self.records if r.config == config and (category is None or r.category == category)]

    @property
    def categories(self) -> list[str]:
        return list(dict.fromkeys(r.category for r in self.records))

    def result(self, config: str, category: str | None = None) -> ConfigResult:
        res = ConfigResult.total(config, self.of(config, category))
        if self.verify_costs and res.verify_widths:
            cliffs = set(self.verify_costs.get("cliffs", []))
            n = sum(res.verify_widths.values())
            res.cliff_share = sum(c for w, c in res.verify_widths.items() if w in cliffs) / n
        return res

    @property
    def results(self) -> list[ConfigResult]:
        return [self.result(c.name) for c in self.configs]

    @property
    def baseline(self) -> ConfigResult:
        return self.result(self.configs[0].name)

    @property
    def per_token(self) -> bool:
        """Sampling: every configuration samples answers of other lengths, so speed is compared
        per generated token; greedy answers are identical, so whole seconds compare directly."""
        return self.temperature > 0

    @property
    def speedup_basis(self) -> str:
        return "tokens per second" if self.per_token else "seconds on the same prompts"

    def speedup(self, r: ConfigResult, category: str | None = None) -> float:
        """AR's time / the configuration's time: on the same answers (greedy), or per token (sampling)."""
        base = self.result(self.configs[0].name, category)
        if r.failed_ids:  # a peer that failed on some prompts: compared on the others
            base = ConfigResult.total(base.name, [p for p in self.of(base.name, category)
                                                  if p.prompt_id not in r.failed_ids])
        if self.per_token:
            return r.tokens_per_s / base.tokens_per_s if base.tokens_per_s else 0.0
        return base.seconds / r.seconds if r.seconds else 0.0

    def _workload_time(self, r: ConfigResult) -> float:
        """What "fastest over the workload" minimises: seconds (greedy) or seconds per token (sampling)."""
        if self.per_token:
            return r.seconds / r.tokens if r.tokens else float("inf")
        return r.seconds

    def _scaled(self, ref: PromptRecord, value: float, tokens: int) -> float:
        """``value`` (seconds or rounds) of ``ref``, for an answer of ``tokens`` tokens: unchanged
        when greedy (the same answer), scaled per token when sampling (answers differ in length)."""
        if not self.per_token:
            return value
        return value / ref.tokens * tokens if ref.tokens else 0.0

    # -- replay's predictions ---------------------------------------------------------------
    def predict_from(self, trace: Any) -> None:
        """Replay every configuration on a trace of this workload (``adaspec bench --record``)
        and keep its predicted seconds (total and per category; the policies' measured time is
        shared out by rounds), so every report shows the cost model's error next to the live
        times."""
        from .replay import oracle_bounds

        ks = [c.k for c in self.configs if c.kind == "static"] or [5]
        bounds = oracle_bounds(trace, ks[0])
        per_round = bounds["dp_time"]
        self.round_oracle = {
            "tokens_per_s": per_round["tokens_per_s"], "speedup": per_round["speedup"], "mat": per_round["mat"],
            "static_per_prompt_speedup": bounds["best_fixed"]["by_time"]["speedup"], "k": bounds["k"],
            "max_draft": bounds["max_draft"],
            # replay priced verify widths by this run's live steps, each configuration's own left out
            "live_verify_prices": bool(trace.info.get("verify_base") and self.verify_rows)}
        cats = [p.meta.get("category", "") for p in trace.prompts]
        ids = [p.meta.get("id", str(i)) for i, p in enumerate(trace.prompts)]
        for name, res in self._predict_each(trace).items():
            if isinstance(res, str):
                self.predictions[name] = {"unavailable": res}
                continue
            per_cat: dict[str, float] = {}
            per_prompt: dict[str, float] = {}  # turns of a prompt summed, as in PromptRecord
            n_rounds = max(1, res.n_rounds)
            for p in res.prompts:
                secs = p.seconds + res.policy_s * len(p.rounds) / n_rounds
                per_cat[cats[p.index]] = per_cat.get(cats[p.index], 0.0) + secs
                per_prompt[ids[p.index]] = per_prompt.get(ids[p.index], 0.0) + secs
            self.predictions[name] = {"seconds": res.predicted_s, "tokens": res.tokens, "per_category": per_cat,
                                      "per_prompt": per_prompt}

    def _predict_each(self, trace: Any) -> dict[str, Any]:
        """Replay's prediction of every configuration. When the trace prices verify widths by
        this run's live rounds (``trace.info["verify_base"]``), each configuration is priced
        without its own rounds (leave one out): the error the report shows is then that of a
        configuration the prices never saw, as for a new policy replayed on the trace."""
        import dataclasses

        from .replay import predict_configs
        from .trace import live_verify_table

        base = trace.info.get("verify_base")
        if not base or not self.verify_rows or trace.surface is None:
            return predict_configs(trace, self.configs)
        out: dict[str, Any] = {}
        for c in self.configs:
            widths, ratios = live_verify_table(trace.surface, self.priced_rows(leave_out=c.name), base)
            own = dataclasses.replace(trace, overheads=dataclasses.replace(
                trace.overheads, verify_widths=widths, verify_ratios=ratios), cache={})
            out.update(predict_configs(own, [c]))
        return out

    def _predicted(self, config: str, category: str | None, live: ConfigResult) -> dict[str, Any]:
        """Predicted seconds and tokens/s, and the relative error of the tokens/s (pred / live - 1)."""
        pred = self.predictions.get(config, {})
        secs = pred.get("seconds") if category is None else pred.get("per_category", {}).get(category)
        if not secs or not live.seconds:
            return {"predicted_seconds": None, "predicted_tokens_per_s": None, "prediction_error": None}
        tps = live.tokens / secs
        return {"predicted_seconds": secs, "predicted_tokens_per_s": tps,
                "prediction_error": tps / live.tokens_per_s - 1.0}

    # -- regret (BanditSpec stopping time; cumulative against the best fixed drafter) -------
    def _static_for(self, cfg: BenchConfig) -> list[BenchConfig]:
        """Static single-drafter configurations over the policy's drafters (its fixed arms)."""
        mine = {d if isinstance(d, str) else d.describe() for d in cfg.drafters}
        return [c for c in self.configs if c.kind == "static" and c.k == cfg.k
                and (c.drafters[0] if isinstance(c.drafters[0], str) else c.drafters[0].describe()) in mine]

    def regret(self, cfg: BenchConfig, category: str | None = None) -> dict[str, Any] | None:
        """Regret of an adaptive configuration against its fixed arms in hindsight.

        ``stopping_time``: sum over prompts of the policy's rounds minus the rounds of the
        best fixed drafter for that prompt (BanditSpec's stopping-time regret, the best arm
        chosen per prompt). ``best_arm_ratio``: share of the policy's rounds that used that
        drafter. ``cumulative_seconds``: running sum over the workload of the policy's time
        minus the time of the single fixed configuration that is fastest over the whole
        workload (the best fixed drafter in hindsight). ``cumulative_priced_seconds`` (with
        replay's predictions, ``predict_from``): the same with every prompt's time priced by
        the cost model instead of the wall clock (no timing noise). Under sampling the arms' rounds and
        seconds are scaled to the policy's answer length (``_scaled``)."""
        arms = self._static_for(cfg)
        if cfg.kind != "adaptive" or not arms:
            return None
        mine = sorted(self.of(cfg.name, category), key=lambda r: r.position)
        by_arm = {a.name: {r.prompt_id: r for r in self.of(a.name, category)} for a in arms}
        best_fixed = min(arms, key=lambda a: self._workload_time(self.result(a.name, category)))
        stop_regret, used_best, n_rounds = 0.0, 0, 0
        cum_s, cum_r, acc_s, acc_r = [], [], 0.0, 0.0
        for rec in mine:
            def rounds(a: BenchConfig, rec: PromptRecord = rec) -> float:
                arm = by_arm[a.name][rec.prompt_id]
                return self._scaled(arm, arm.rounds, rec.tokens)

            best = min(arms, key=rounds)
            stop_regret += rec.rounds - rounds(best)
            best_names = by_arm[best.name][rec.prompt_id].drafter_usage  # {its drafter's name: rounds}
            used_best += sum(rec.drafter_usage.get(n, 0) for n in best_names)
            n_rounds += rec.rounds
            ref = by_arm[best_fixed.name][rec.prompt_id]
            acc_s += rec.seconds - self._scaled(ref, ref.seconds, rec.tokens)
            acc_r += rec.rounds - self._scaled(ref, ref.rounds, rec.tokens)
            cum_s.append(acc_s)
            cum_r.append(acc_r)
        mine_p = self.predictions.get(cfg.name, {}).get("per_prompt")
        ref_p = self.predictions.get(best_fixed.name, {}).get("per_prompt")
        priced = None
        if mine_p and ref_p and all(r.prompt_id in mine_p and r.prompt_id in ref_p for r in mine):
            priced, acc = [], 0.0
            for rec in mine:
                acc += mine_p[rec.prompt_id] - ref_p[rec.prompt_id]
                priced.append(acc)
        return {"best_fixed": best_fixed.name, "stopping_time_regret": stop_regret,
                "best_arm_ratio": used_best / n_rounds if n_rounds and len(arms) > 1 else None,
                "cumulative_seconds": cum_s, "cumulative_rounds": cum_r, "cumulative_priced_seconds": priced}

    def oracle(self) -> dict[str, Any] | None:
        """The per-prompt oracle over the static configurations: for every prompt, the static
        drafter that was fastest on it, chosen in hindsight (an upper bound for any drafter
        policy over those drafters at that K, up to switching within a prompt). Under sampling
        "fastest" is per token, and each prompt is priced on AR's answer length."""
        static = [c for c in self.configs if c.kind == "static"]
        if not static:
            return None
        base = {r.prompt_id: r for r in self.of(self.configs[0].name)}
        seconds = tokens = rounds = 0.0
        choice: dict[str, str] = {}
        for pid, ar_rec in base.items():
            candidates = [r for c in static for r in self.of(c.name) if r.prompt_id == pid]
            if self.per_token:  # fastest per token, priced on AR's answer length
                best = min(candidates, key=lambda r: r.seconds / r.tokens if r.tokens else float("inf"))
                n = ar_rec.tokens
            else:
                best = min(candidates, key=lambda r: r.seconds)
                n = best.tokens
            choice[pid] = best.config
            seconds += self._scaled(best, best.seconds, n)
            rounds += self._scaled(best, best.rounds, n)
            tokens += n
        ar = sum(r.seconds for r in base.values())
        return {"seconds": seconds, "tokens_per_s": tokens / seconds if seconds else 0.0,
                "speedup": ar / seconds if seconds else 0.0, "mat": tokens / rounds if rounds else 0.0,
                "choices": choice}

    # -- output ---------------------------------------------------------------------------
    def _row(self, cfg: BenchConfig, category: str | None) -> dict[str, Any]:
        r = self.result(cfg.name, category)
        reg = self.regret(cfg, category)
        return {"config": cfg.name, "prompts": r.prompts, "tokens": r.tokens, "seconds": r.seconds,
                "tokens_per_s": r.tokens_per_s, "decode_tokens_per_s": r.decode_tokens_per_s,
                "prefill_s_per_prompt": r.prefill_s_per_prompt, "speedup": self.speedup(r, category), "mat": r.mat,
                "acceptance_rate": r.acceptance_rate if r.drafted else None,
                "discard_rate": r.discard_rate, "verification_rate": r.verification_rate,
                "policy_overhead_share": r.policy_share, "engine_overhead_share": r.overhead_share,
                "scoring_overhead_share": r.scoring_share if r.eval_s > 0 else None,
                "cliff_share": r.cliff_share, "identical": r.identical, "mismatches": r.mismatches,
                "near_ties": r.near_ties, "failed": r.failed,
                "stopping_time_regret": reg["stopping_time_regret"] if reg else None,
                "best_arm_ratio": reg["best_arm_ratio"] if reg else None,
                "pass_seconds": r.pass_seconds,
                **(self._predicted(cfg.name, category, r) if self.predictions else {})}

    def summary(self) -> dict[str, Any]:
        """The ``summary.json`` document (schema ``adaspec.bench/1``)."""
        from ..version import __version__

        regret = {}
        for c in self.configs:
            reg = self.regret(c)
            if reg:
                regret[c.name] = {k: reg[k] for k in ("best_fixed", "cumulative_seconds", "cumulative_rounds",
                                                      "cumulative_priced_seconds")}
        return {
            "schema": SCHEMA,
            "created": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "adaspec_version": __version__, "model": self.model, "device": self.device,
            "dtype": self.dtype, "backend": self.backend, "linear": self.linear, "weights": self.weights,
            **({"flash_attn": self.flash_attn} if self.backend == "llama.cpp" else {}),
            "temperature": self.temperature,
            "max_new_tokens": self.max_new_tokens,
            "speedup_basis": "per_token" if self.per_token else "seconds",
            "repeats": self.repeats, "suite": self.suite,
            "n_prompts": len({r.prompt_id for r in self.records}), "categories": self.categories,
            "configs": [c.describe() for c in self.configs],
            "peers": self.peer_settings,
            "overall": [self._row(c, None) for c in self.configs],
            "per_category": {cat: [self._row(c, cat) for c in self.configs] for cat in self.categories},
            "per_prompt": [{k: v for k, v in asdict(r).items() if k not in ("overhead_shares", "verify_widths")}
                           for r in self.records],
            "verify_costs": self.verify_costs,
            "regret": regret,
            "oracle": self.oracle(),
            "round_oracle": self.round_oracle,
            "steadiness": self.steadiness,
        }

    def markdown(self) -> str:
        lines = [("| configuration | tokens/s | speed-up vs AR | MAT | acceptance | discard rate "
                  "| verification rate | identical to AR |"),
                 "|---|---:|---:|---:|---:|---:|---:|---|"]
        for r in self.results:
            same = f"{r.identical}/{r.prompts}" + ("" if r.identical == r.prompts else " MISMATCH")
            lines.append(f"| {r.name} | {r.tokens_per_s:.1f} | {self.speedup(r):.2f}x | {r.mat:.2f} "
                         f"| {r.acceptance_rate:.1%} | {r.discard_rate:.2f} "
                         f"| {r.verification_rate:.2f} | {same} |")
        return "\n".join(lines)

    def save(self, out_dir: str | Path, plots: bool = True) -> list[Path]:
        """Write summary.json, rounds.csv and (via ``adaspec.bench.report``) report.md and plots."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        summary = self.summary()
        (out / "summary.json").write_text(json.dumps(summary, indent=1), encoding="utf-8")
        with open(out / "rounds.csv", "w", newline="", encoding="utf-8") as fh:
            w = csv.DictWriter(fh, fieldnames=ROUND_FIELDS)
            w.writeheader()
            w.writerows(self.rounds)
        written = [out / "summary.json", out / "rounds.csv"]
        if self.verify_rows:
            with open(out / "verify_steps.csv", "w", newline="", encoding="utf-8") as fh:
                w = csv.DictWriter(fh, fieldnames=[f.name for f in fields(VerifyStep)])
                w.writeheader()
                w.writerows(asdict(r) for r in self.verify_rows)
            written.append(out / "verify_steps.csv")
        if plots:
            from .report import write_report

            written += write_report(summary, out, out / "rounds.csv")
        return written


def label(spec: str) -> str:
    """A short name for a drafter spec in tables: file paths shortened to their last parts
    (``feature-head:path=/.../pool/smollm2/code/feature-head.pt`` -> ``feature-head:code/feature-head``)."""
    def short(m: re.Match) -> str:
        p = Path(m.group(2))
        stem = p.stem if m.group(1) == "datastore" else f"{p.parent.name}/{p.stem}"
        return ("" if m.group(1) in ("path",) else m.group(1) + "=") + stem
    return re.sub(r"(path|datastore|corpus)=([^,]+)", short, spec)


def default_configs(drafters: Sequence[str], ks: Sequence[int], selectors: Sequence[str] = (),
                    lengths: Sequence[str] = (), static: bool = True,
                    peers: Sequence[str] = (), tree: bool = False,
                    singles: Sequence[str] | None = None) -> list[BenchConfig]:
    """Plain AR first (the baseline); then every single drafter at every K (static); every
    selector over the whole drafter pool (at the first K); every length policy with every
    single drafter; and every peer. ``singles``: the drafters of the static and length rows
    (default: every drafter; the selectors always run over all of them). ``tree``: every engine
    configuration is followed by its twin with draft trees (``NAME +tree``), so chains and trees
    sit side by side."""
    if not ks and drafters and (static or selectors or lengths):
        raise ConfigError("ks is empty: give at least one K (-k 5, ks = [5]): it sets the static "
                          "configurations and the K of the selector and length configurations")
    for k in ks:
        validate_k(k)
    configs = [BenchConfig(AR_NAME, [])]
    alone = list(drafters) if singles is None else list(singles)
    if static:
        for d in alone:
            for k in ks:
                configs.append(BenchConfig(f"{label(d)} k={k}", [d], k=k))
    for sel in selectors:
        pool = ", ".join(label(d) for d in drafters) if len(drafters) <= 4 else f"{len(drafters)} drafters"
        configs.append(BenchConfig(f"{sel} over [{pool}]", list(drafters), k=ks[0], selector=sel))
    for ln in lengths:
        for d in alone:
            configs.append(BenchConfig(f"{label(d)} + {ln}", [d], k=ks[0], length=ln))
    if tree:  # a twin for every configuration with a drafter that drafts trees
        configs = [configs[0]] + [x for c in configs[1:] for x in (
            (c, replace(c, name=f"{c.name} +tree", tree=True)) if any(map(drafts_trees, c.drafters)) else (c,))]
    for p in peers:
        configs.append(BenchConfig(p, peer=p))
    names = [c.name for c in configs]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ConfigError(f"configurations {dup} are listed twice: remove the duplicates")
    return configs


def with_pool_rows(configs: Sequence[BenchConfig], specs: Sequence[str],
                   selectors: Sequence[str]) -> list[BenchConfig]:
    """Each chain row of a selector in ``selectors`` followed by its twin over the same drafters
    plus a pool's (``NAME + pool``): what the engine runs by default once a pool is built for
    the target (``SpeculativeEngine(pool=None)``), next to what it ran before."""
    out: list[BenchConfig] = []
    for c in configs:
        out.append(c)
        if c.selector in selectors and not c.tree and c.kind == "adaptive":
            out.append(replace(c, name=f"{c.name} + pool", drafters=[*c.drafters, *specs]))
    return out


# -- running ------------------------------------------------------------------------------
@dataclass
class _TurnRuns:
    """One turn of one prompt across passes: its input, every configuration's outputs and
    times per pass, the last pass's stats and every run's plain-step time (``steadiness``)."""

    n: int
    ids: Any = None
    outs: list[list[list[int]]] = field(init=False)
    times: list[list[float]] = field(init=False)
    last: list[Any] = field(init=False)
    steps: list[float] = field(default_factory=list)
    splits: list[list[Split]] = field(init=False)  # every pass's ``emission_split``

    def __post_init__(self) -> None:
        self.outs = [[] for _ in range(self.n)]
        self.times = [[] for _ in range(self.n)]
        self.last = [None] * self.n
        self.splits = [[] for _ in range(self.n)]


#: (seconds to the first emission, tokens emitted after it, seconds from it to the last emission)
Split = tuple[float | None, int | None, float | None]


def emission_split(out: Any) -> Split:
    """A request's prefill / decode split, alike for every row. The first emission of new tokens
    ends the prefill: for adaspec's engine the end of its first round (the prefill of all but the
    last prompt token, then the first round's forward over that token and its drafts); for a peer
    what it measured (``PeerRun.first_s``, ``decode_s``, ``decode_tokens``). Decode: the tokens
    emitted after that one, over the seconds from it to the last emission."""
    if isinstance(out, RequestStats):
        if not out.rounds:
            return None, None, None
        first = out.prefill_s + out.rounds[0].total_s
        return first, out.new_tokens - out.rounds[0].emitted, max(0.0, out.total_s - first)
    return out.first_s, out.decode_tokens, out.decode_s


def median_split(splits: Sequence[Split]) -> Split:
    """Medians over passes of the split's times (the tokens of the last pass, as ``PromptRecord.tokens``)."""
    if not splits or any(x is None for sp in splits for x in sp):
        return None, None, None
    return (statistics.median(sp[0] for sp in splits), splits[-1][1],  # type: ignore[type-var]
            statistics.median(sp[2] for sp in splits))  # type: ignore[type-var]


class _Runner:
    """Runs one configuration on encoded prompts: an engine or a peer."""

    def __init__(self, cfg: BenchConfig, target: LoadedModel, drafter: Callable[[str | Drafter], Drafter],
                 device: Any, dtype: Any):
        self.cfg = cfg
        self.engine: SpeculativeEngine | None = None
        self.peer: Any = None
        if cfg.peer:
            from .peers import make_peer

            self.peer = make_peer(target, cfg.peer, device=device, dtype=dtype)
        else:
            self.engine = SpeculativeEngine(target, [drafter(d) for d in cfg.drafters], k=cfg.k,
                                            selector=cfg.selector, length=cfg.length, tree=cfg.tree)

    def run(self, ids: list[int], gen: GenerationConfig, eos: set[int]) -> tuple[list[int], float, Any]:
        """(new token ids, seconds, RequestStats or PeerRun)."""
        if self.peer is not None:
            run = self.peer.run(ids, gen.max_new_tokens, eos)
            return run.token_ids, run.seconds, run
        res = self.engine.generate(ids, gen)
        return res.token_ids, res.stats.total_s, res.stats


def _record_into(rec: PromptRecord, out: Any, seconds: float, split: Split = (None, None, None)) -> None:
    """Add one turn's measurements (engine stats or a peer run; its prefill / decode ``split``) to a
    prompt record."""
    rec.seconds += seconds
    first, n_decode, decode = split
    rec.prefill_s, rec.decode_s = plus(rec.prefill_s, first), plus(rec.decode_s, decode)
    rec.decode_tokens = plus(rec.decode_tokens, n_decode)
    if isinstance(out, RequestStats):
        rec.tokens += out.new_tokens
        rec.rounds += out.n_rounds
        rec.drafted += out.drafted
        rec.accepted += out.accepted
        rec.policy_s += sum(r.policy_s for r in out.rounds)
        rec.eval_s += sum(r.eval_s for r in out.rounds)
        rec.overhead_shares.append(out.overhead_share)
        for name, c in out.drafter_usage().items():
            rec.drafter_usage[name] = rec.drafter_usage.get(name, 0) + c
        for w, c in out.verify_widths().items():
            rec.verify_widths[w] = rec.verify_widths.get(w, 0) + c
    else:  # a peer (adaspec.peers.PeerRun): counts from the target's forwards, no time split
        if out.error is not None and rec.error is None:
            rec.error = out.error
        rec.tokens += out.new_tokens
        rec.rounds += out.rounds
        rec.drafted += out.drafted or 0
        rec.accepted += out.accepted if out.drafted else 0
        for w, c in out.verify_widths.items():
            rec.verify_widths[w] = rec.verify_widths.get(w, 0) + c


#: plain rounds a request needs for its step time to count towards ``steadiness``
STEADY_MIN_ROUNDS = 5


def plain_step_seconds(stats: Any) -> float | None:
    """The mean verify time of a request's plain rounds (nothing drafted, one token): how fast
    the machine ran during that request, its slow moments included (they are what inflates a
    request's time), comparable between configurations. None for peers and for requests with
    fewer than ``STEADY_MIN_ROUNDS`` plain rounds."""
    if not isinstance(stats, RequestStats):
        return None
    times = [r.verify_s for r in stats.rounds if r.drafted == 0 and not r.tree_nodes]
    return statistics.fmean(times) if len(times) >= STEADY_MIN_ROUNDS else None


def steadiness(runs: Sequence[Sequence[float]]) -> dict[str, Any] | None:
    """How much the machine's speed drifted during a bench: every run's plain-step time
    (``plain_step_seconds``) relative to the median over the runs of the same request (every
    configuration and pass). Speed-ups that differ by less than this spread cannot be told
    apart by one pass. ``runs`` holds one list of step times per request; None with fewer than
    4 comparable runs."""
    ratios = []
    for times in runs:
        if len(times) >= 2:
            mid = statistics.median(times)
            ratios += [t / mid for t in times]
    if len(ratios) < 4:
        return None
    deciles = statistics.quantiles(ratios, n=10, method="inclusive")
    return {"runs": len(ratios), "p10": deciles[0], "p90": deciles[-1], "min": min(ratios), "max": max(ratios)}


@dataclass
class VerifyStep:
    """One chain round's verify step in a bench run: what replay's verify prices are made of."""

    config: str
    position: int  # the prompt's place in the workload
    prompt_id: str
    turn: int
    pass_: int  # which pass over the workload (0-based)
    width: int  # tokens verified: drafted + 1
    cached: int  # tokens in the target's cache before the step
    seconds: float
    #: the step's request is one whose time is the live median over passes (with an even
    #: number of passes, both middle ones): the rows replay prices with (``priced_rows``)
    median: bool = True


def _verify_rows_into(rows: list[VerifyStep], config: str, pos: int, prompt_id: str, turn: int, rep: int,
                      n_prompt: int, stats: Any) -> None:
    """Append a request's chain rounds; tree rounds (not replayed) and peers (no rounds) add nothing."""
    if not isinstance(stats, RequestStats):
        return
    ctx = n_prompt - 1  # the cache holds every token but the newest
    for r in stats.rounds:
        if not r.tree_nodes:
            rows.append(VerifyStep(config, pos, prompt_id, turn, rep, r.drafted + 1, ctx, r.verify_s))
        ctx += r.emitted


def median_passes(times: Sequence[float]) -> set[int]:
    """The passes whose times make the median of ``times`` (one, or the two middle ones)."""
    order = sorted(range(len(times)), key=lambda i: times[i])
    n = len(order)
    return {order[n // 2]} if n % 2 else {order[n // 2 - 1], order[n // 2]}


def run_bench(target: LoadedModel, configs: Sequence[BenchConfig],
              prompts: Sequence[BenchPrompt] = BUILTIN_PROMPTS, max_new_tokens: int = 128,
              repeats: int = 1, warmup_tokens: int = 16, measure_costs: bool = True,
              progress: Callable[[str], None] | None = None, temperature: float = 0.0,
              seed: int = 0, suite: str = "builtin", device: str = "cpu",
              dtype: str = "float32", probe: Any = None) -> BenchRun:
    """Run all configurations over all prompts and aggregate.

    Greedy (temperature 0): every output is checked against AR. Sampling: each configuration
    uses the same seed per prompt; outputs are not compared (they are equal in distribution,
    not token for token). ``probe`` (a ``trace.VerifyProbe``): sampled after every request,
    outside its timing, so the trace recorded after the run prices verify widths by the live
    runs' own minutes."""
    if repeats < 1:
        raise ConfigError(f"repeats must be >= 1, got {repeats}")
    if not prompts:
        raise ConfigError("the workload is empty: give at least one prompt")
    if not configs or configs[0].kind != "ar":
        configs = [BenchConfig(AR_NAME, []), *configs]
    configs = list(configs)
    built: dict[str, Drafter] = {}  # model drafters are loaded once and shared by configurations

    def drafter(spec: str | Drafter) -> Drafter:
        if isinstance(spec, Drafter):
            return spec
        if not spec.startswith(("model:", "feature-head:", "tiny-lm:", "early-exit")):
            return build_drafter(spec, target)  # model-free state (e.g. a learning datastore) is not shared
        if spec not in built:
            built[spec] = build_drafter(spec, target)
        return built[spec]

    warmed: list[_Runner] = []
    try:
        for c in configs:
            warmed.append(_Runner(c, target, drafter, device, dtype))
        return _run_passes(target, configs, warmed, drafter, prompts, max_new_tokens, repeats, warmup_tokens,
                           measure_costs, progress, temperature, seed, suite, device, dtype, probe)
    finally:  # a peer's server process stops with the bench, an error or Ctrl-C included
        for r in warmed:
            if r.peer is not None:
                r.peer.close()


def _run_passes(target: LoadedModel, configs: list[BenchConfig], warmed: list[_Runner],
                drafter: Callable[[str | Drafter], Drafter], prompts: Sequence[BenchPrompt], max_new_tokens: int,
                repeats: int, warmup_tokens: int, measure_costs: bool, progress: Callable[[str], None] | None,
                temperature: float, seed: int, suite: str, device: str, dtype: str, probe: Any) -> BenchRun:
    """``run_bench``'s passes over the workload on the built runners, and the aggregation."""
    ar_engine = warmed[0].engine
    assert ar_engine is not None
    eos = ar_engine.eos_ids()
    sampling = SamplingConfig(temperature=temperature, seed=seed)
    greedy = sampling.greedy
    gen = GenerationConfig(max_new_tokens=max_new_tokens, sampling=sampling)
    warm = GenerationConfig(max_new_tokens=warmup_tokens, sampling=sampling)
    first_ids = turn_prompt(prompts[0], 0, [], ar_engine)
    for r in warmed:  # warm-up: first calls allocate and pick kernels
        r.run(first_ids, warm, eos)

    def fresh() -> list[_Runner]:
        """Every pass starts from new engines (peers are kept, and start each pass afresh:
        ``Peer.new_pass``): what a policy,
        a tree calibration or a learning datastore learns in the warm-up or in one pass must
        not help it on the same prompts in the next (each pass is a fresh process). Drafters
        given as objects, not specs, are used as given, state included."""
        out = [r if r.peer is not None else _Runner(c, target, drafter, device, dtype)
               for c, r in zip(configs, warmed)]
        for new, old in zip(out, warmed):  # stateless parts built in the warm-up stay built
            if new is not old and new.engine is not None and old.engine is not None:
                new.engine._feature_forward = old.engine._feature_forward
        return out

    # Repeats are passes over the whole workload (configurations interleaved within each
    # request), not back-to-back runs of one prompt: this machine's speed drifts in regimes of
    # about a minute, and a median over three passes minutes apart drops a slow minute where a
    # median over three runs inside it cannot. Turn t of a later pass reuses AR's answers of
    # the first pass.
    turns = [[_TurnRuns(len(configs)) for _ in p.turns] for p in prompts]
    answers: list[list[str]] = [[] for _ in prompts]
    prompt_lens: list[int] = []
    verify_rows: list[VerifyStep] = []
    for rep in range(repeats):
        runners = fresh()
        for r in runners:
            if r.peer is not None:
                r.peer.new_pass()
        for pos, prompt in enumerate(prompts):
            for turn, tr in enumerate(turns[pos]):
                if rep == 0:
                    tr.ids = turn_prompt(prompt, turn, answers[pos], ar_engine)
                    prompt_lens.append(len(tr.ids))
                for ci, r in enumerate(runners):
                    if progress:
                        again = f" (pass {rep + 1}/{repeats})" if repeats > 1 else ""
                        progress(f"{prompt.id} [{prompt.category}] {configs[ci].name}{again}")
                    out, secs, tr.last[ci] = r.run(tr.ids, gen, eos)
                    tr.splits[ci].append(emission_split(tr.last[ci]))
                    step = plain_step_seconds(tr.last[ci])
                    if step is not None:
                        tr.steps.append(step)
                    tr.outs[ci].append(out)
                    tr.times[ci].append(secs)
                    _verify_rows_into(verify_rows, configs[ci].name, pos, prompt.id, turn, rep, len(tr.ids),
                                      tr.last[ci])
                    if probe is not None:
                        probe.sample()
                if rep == 0:
                    answers[pos].append(ar_engine.decode(tr.outs[0][0]))

    # the live time of a request is its median over passes: replay is priced by those passes
    medians = {(pos, turn, configs[ci].name): median_passes(tr.times[ci])
               for pos in range(len(prompts)) for turn, tr in enumerate(turns[pos]) for ci in range(len(configs))}
    for row in verify_rows:
        row.median = row.pass_ in medians[(row.position, row.turn, row.config)]
    records: list[PromptRecord] = []
    rounds: list[dict[str, Any]] = []
    for pos, prompt in enumerate(prompts):
        recs = [PromptRecord(c.name, prompt.id, prompt.category, pos) for c in configs]
        for turn, tr in enumerate(turns[pos]):
            ids, outs, last = tr.ids, tr.outs, tr.last
            ref = outs[0][0]
            for ci, rec in enumerate(recs):
                _record_into(rec, last[ci], statistics.median(tr.times[ci]), median_split(tr.splits[ci]))
                rec.pass_seconds = add_passes(rec.pass_seconds, tr.times[ci])
                wrong = next((o for o in outs[ci] if o != ref), None)  # every repeat is checked
                if greedy and wrong is not None and rec.identical and rec.error is None:
                    rec.identical = False
                    offset = rec.tokens - len(outs[ci][-1])  # tokens of earlier turns
                    at, rec.mismatch_gap = divergence_gap(target, ids, ref, wrong)
                    rec.tie_nats = target.near_tie_nats_at(len(ids) + at)
                    if runners[ci].peer is not None:  # another kernel path: its own bound (``Peer``)
                        rec.tie_nats = max(rec.tie_nats, runners[ci].peer.tie_nats)
                    rec.first_mismatch = offset + at
                per_round = last[ci].rounds if isinstance(last[ci], RequestStats) else []  # peers: none
                for j, rr in enumerate(per_round):
                    rounds.append({"config": configs[ci].name, "prompt_id": prompt.id,
                                   "category": prompt.category, "position": pos, "turn": turn, "round": j,
                                   "drafter": rr.drafter, "k_cap": rr.k_cap, "drafted": rr.drafted,
                                   "accepted": rr.accepted, "emitted": rr.emitted, "draft_s": rr.draft_s,
                                   "verify_s": rr.verify_s, "catch_up_s": rr.catch_up_s,
                                   "policy_s": rr.policy_s, "total_s": rr.total_s,
                                   "tree_nodes": rr.tree_nodes})
        records.extend(recs)
    costs = None
    if measure_costs:
        if progress:
            progress("measuring the verify-cost surface")
        surface = ar_engine.verify_costs()
        # the curve at the workload's typical cache length (middle of a median request)
        typical = int(statistics.median(prompt_lens)) + max_new_tokens // 2
        costs = surface.curve(typical).to_dict() | {"surface": surface.to_dict()}
    return BenchRun(target.name, configs, records, rounds, max_new_tokens, repeats, temperature,
                    suite, device, dtype, costs, backend=target.backend, verify_rows=verify_rows,
                    linear=linear_mode(getattr(target, "model", None)),
                    weights=weights_mode(getattr(target, "model", None)),
                    flash_attn=getattr(target, "flash_attn", None),
                    steadiness=steadiness([tr.steps for runs in turns for tr in runs]),
                    peer_settings={c.name: r.peer.settings() for c, r in zip(configs, warmed) if r.peer is not None})


# -- config files -------------------------------------------------------------------------
#: keys a bench config file may set (TOML or YAML); CLI flags override them
FILE_KEYS = {"model", "device", "dtype", "backend", "linear", "flash_attn", "weights", "suite", "per_category", "seed",
             "max_new_tokens", "repeats",
             "temperature", "drafters", "ks", "selectors", "lengths", "peers", "static", "costs",
             "out", "config", "tree"}


def load_bench_file(path: str | Path) -> dict[str, Any]:
    """Read a bench method matrix from TOML (``.toml``) or YAML (``.yaml``/``.yml``).

    Top-level keys are ``FILE_KEYS``; ``[[config]]`` tables (a ``config`` list in YAML) add
    explicit configurations with ``name``, ``drafters``, ``k``, ``selector``, ``length``, ``peer``,
    ``tree``."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"bench config file {p} does not exist")
    text = p.read_text(encoding="utf-8")
    if p.suffix == ".toml":
        try:
            import tomllib
        except ModuleNotFoundError:  # Python 3.10
            import tomli as tomllib  # type: ignore[no-redef]
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{p}: invalid TOML: {exc}") from None
    elif p.suffix in (".yaml", ".yml"):
        try:
            import yaml
        except ModuleNotFoundError:
            raise ConfigError("YAML bench files need PyYAML: pip install pyyaml (or use TOML)") from None
        try:
            data = yaml.safe_load(text) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"{p}: invalid YAML: {exc}") from None
    else:
        raise ConfigError(f"bench config {p}: use a .toml or .yaml file")
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: the top level must be a table of settings")
    unknown = sorted(set(data) - FILE_KEYS)
    if unknown:
        raise ConfigError(f"{p}: unknown keys {unknown}; valid keys: {sorted(FILE_KEYS)}")
    return data


def explicit_configs(entries: Sequence[dict[str, Any]]) -> list[BenchConfig]:
    """``[[config]]`` entries of a bench file as configurations."""
    out = []
    allowed = {"name", "drafters", "k", "selector", "length", "peer", "tree"}
    for i, e in enumerate(entries):
        bad = sorted(set(e) - allowed)
        if bad:
            raise ConfigError(f"config #{i + 1}: unknown keys {bad}; valid: {sorted(allowed)}")
        drafters = e.get("drafters", [])
        if isinstance(drafters, str):
            drafters = [drafters]
        name = e.get("name") or e.get("peer") or " + ".join(
            [", ".join(drafters) or "AR", *(x for x in (e.get("selector"), e.get("length")) if x)])
        out.append(BenchConfig(name, list(drafters), k=validate_k(int(e.get("k", 5))),
                               selector=e.get("selector"), length=e.get("length"), peer=e.get("peer"),
                               tree=bool(e.get("tree", False))))
    return out

