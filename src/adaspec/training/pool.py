"""The domain drafter pool: one command distils, indexes and trains a drafter per domain.

MetaSD (4.1, F.1-F.2) and Not-a-Bandit (4.2, Table 1) select among drafters specialised on
different tasks, each trained on the target's own responses to that task, plus a
"one-size-fits-all" generalist trained on the union. ``build_pool`` makes that pool for a
target on CPU:

1. it distils the target's responses to every domain's training prompts (``adaspec.distill``,
   resumable),
2. builds a REST-style suffix datastore of each domain's responses (and of all of them),
3. trains the requested drafter kinds (``feature-head``, ``tiny-lm``) with
   ``adaspec.drafter_training.train_drafter``: the generalist on the union first, then each
   domain's specialist, fine-tuned from the generalist on that domain only,

and writes ``pool.json``, the manifest, whose spec strings the engine and the benchmark take
directly (``pool_specs``). Artifacts live under
``cache_dir() / "pool" / TARGET``, never in the repository.

Layout of a pool directory::

    pool.json                      manifest (format adaspec.pool/1)
    data/DOMAIN/                   distilled sets (adaspec.distill/1)
    datastores/DOMAIN.jsonl        suffix datastores (generalist.jsonl: all domains)
    drafters/DOMAIN/feature-head.pt, drafters/DOMAIN/tiny-lm/
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any

import numpy as np
import typer

from .distill import (DEFAULT_BATCH_SIZE, DOMAINS, Progress, build_datastore_info,
                      distill_run, domain_prompts, load_distilled)
from ..errors import AdaspecError, ConfigError, ModelLoadError, PromptSetChangedError
from ..models import FINGERPRINT_KEYS, LoadedModel, target_fingerprint

from ..pools import (GENERALIST, POOL_FORMAT, SPEC_KINDS, TRAINABLE_KINDS,  # noqa: F401
                     PoolDrafter, PoolEntry, PoolManifest, _json_default, default_pool_root, load_manifest,
                     pool_specs)
#: defaults of the full pool: training prompts per domain, greedy responses of <= 128 tokens.
#: The budget is set by CPU time (measured, see docs/training.md, "How long it takes"): distillation runs at ~100
#: tokens/s, the target features (cached per set, shared by the generalist and the specialists)
#: at ~5 ms per token and head training at ~0.5 ms per token and epoch on a quiet 2-core
#: machine. Greedy-only data match greedy decoding, and more prompts generalise better than more
#: samples per prompt; add T = 0.7 (MetaSD F.1) with ``temperatures=(0.0, 0.7)`` at twice the cost.
#: The prose domains get twice the prompts: with 400 their specialists did not beat the
#: generalist (fine-tuning on the prompts the generalist had already fit overfitted from the
#: first epoch: translation held-out MAT 1.433, 1.426, 1.413 at lr 3e-4, generalist 1.43).
DEFAULT_POOL_PROMPTS: dict[str, int] = {"code": 400, "math": 400, "chat": 800, "summarization": 800,
                                        "translation": 800}
DEFAULT_POOL_TOKENS = 128
DEFAULT_POOL_TEMPERATURES: tuple[float, ...] = (0.0,)
#: training of the generalist (and of specialists trained from scratch): the union holds ~310k
#: response tokens, so a few epochs of 1024-token batches. Pools stop on epochs, never on a
#: clock: a minute cap would make the trained weights depend on the machine's speed and load
DEFAULT_POOL_TRAIN_OPTS: dict[str, Any] = {"batch_tokens": 1024, "lr": 2e-3, "epochs": 6}
#: specialists start from the generalist and fine-tune on their domain only: with a fifth of the
#: data, a specialist trained from scratch lost to the generalist on 2 of 5 domains (measured)
SPECIALIST_TRAIN_OPTS: dict[str, Any] = {"epochs": 3, "lr": 1e-3}
#: bumped when the held-out matrix's contents change, so a rebuild recomputes a kept one
HELDOUT_VERSION = 2
#: the minutes-scale smoke version (``--quick``)
QUICK = {"n_prompts": 8, "max_new_tokens": 32, "temperatures": (0.0,), "train_opts": {"epochs": 2},
         "specialist_opts": {"epochs": 1}}
#: train_drafter(kind, target, data, out, **opts) -> TrainReport (adaspec.drafter_training)
Trainer = Callable[..., Any]
#: evaluate_drafters(kind, target, paths, data, heldout_fraction=, seed=, progress=) -> one
#: {domain: {"mat_k5", "top1", ...}} per path (adaspec.drafter_training)
Evaluator = Callable[..., list[dict[str, dict[str, float]]]]


def prompt_counts(n_prompts: int | Mapping[str, int], domains: Sequence[str]) -> dict[str, int]:
    """Training prompts per domain from one count for all or a ``{domain: count}`` mapping."""
    if isinstance(n_prompts, Mapping):
        missing = [d for d in domains if d not in n_prompts]
        if missing:
            raise ConfigError(f"no prompt count for domain(s) {', '.join(missing)}: give every pool domain a "
                              "count, or one count for all")
        counts = {d: n_prompts[d] for d in domains}
    else:
        counts = dict.fromkeys(domains, n_prompts)
    bad = {d: n for d, n in counts.items() if isinstance(n, bool) or not isinstance(n, int) or n < 1}
    if bad:
        raise ConfigError(f"prompt counts must be integers >= 1, got {bad}")
    return counts


def parse_prompt_counts(text: str, default: int | Mapping[str, int]) -> int | dict[str, int]:
    """``--n-prompts``: ``N`` (every domain), ``domain=N,...`` (overrides of ``default``) or both."""
    base = default
    overrides: dict[str, int] = {}
    for item in _split_list([text]):
        name, sep, value = item.rpartition("=")
        name = name.strip()
        try:
            n = int(value)
        except ValueError:
            raise ConfigError(f"--n-prompts: {item!r} is not a count: use N (every domain) or DOMAIN=N, e.g. "
                              "'400' or 'translation=800,chat=600'") from None
        if not sep:
            base = n
        elif name not in DOMAINS:
            raise ConfigError(f"--n-prompts: unknown domain {name!r}: use one of {', '.join(DOMAINS)}")
        else:
            overrides[name] = n
    if not overrides:
        return base if isinstance(base, int) else dict(base)
    return (dict.fromkeys(DOMAINS, base) if isinstance(base, int) else dict(base)) | overrides


def _data_key(dirs: Sequence[str | Path], opts: Mapping[str, Any]) -> str:
    """Identity of a training run's inputs: the data files' sizes and sample counts, the options."""
    parts = []
    for d in dirs:
        d = Path(d)
        meta = json.loads((d / "meta.json").read_text(encoding="utf-8"))
        parts.append(f"{d.name}:{meta['n_samples']}:{(d / 'samples.jsonl').stat().st_size}")
    parts.append(json.dumps(dict(opts), sort_keys=True, default=str))
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def _report_dict(report: Any) -> dict[str, Any]:
    if hasattr(report, "to_dict"):
        return json.loads(json.dumps(report.to_dict(), default=_json_default))
    if isinstance(report, Mapping):
        return json.loads(json.dumps(dict(report), default=_json_default))
    return {"repr": repr(report)}


def _kind_opts(train_opts: Mapping[str, Any] | None, kind: str,
               defaults: Mapping[str, Any] = DEFAULT_POOL_TRAIN_OPTS) -> dict[str, Any]:
    """Options for one kind: the common ones, updated by ``train_opts[kind]`` when it is a dict."""
    opts = dict(defaults) | {k: v for k, v in (train_opts or {}).items() if k not in TRAINABLE_KINDS}
    per_kind = (train_opts or {}).get(kind)
    if per_kind is not None:
        if not isinstance(per_kind, Mapping):
            raise ConfigError(f"train_opts[{kind!r}] must be a dict of options for that kind")
        opts.update(per_kind)
    return opts


def _default_trainer() -> Trainer:
    from .drafters import train_drafter

    return train_drafter


def _default_evaluator() -> Evaluator:
    from .drafters import evaluate_drafters

    return evaluate_drafters


def _artifact(root: Path, domain: str, kind: str) -> Path:
    return root / "drafters" / domain / ("feature-head.pt" if kind == "feature-head" else "tiny-lm")


def check_pool_options(domains: Sequence[str], kinds: Sequence[str], n_prompts: int | Mapping[str, int],
                       datastores: bool = True) -> dict[str, int]:
    """Check ``build_pool``'s choices without a model (``adaspec build-pool`` calls it before
    loading the target); returns the prompt count of every domain."""
    domains, kinds = list(domains), list(kinds)
    if not domains:
        raise ConfigError("build_pool needs at least one domain")
    bad = [d for d in domains if d not in DOMAINS]
    if bad or len(set(domains)) != len(domains):
        raise ConfigError(f"pool domains must be distinct names among {', '.join(DOMAINS)}, got {domains}")
    bad = [k for k in kinds if k not in TRAINABLE_KINDS]
    if bad or len(set(kinds)) != len(kinds):
        raise ConfigError(f"pool drafter kinds must be distinct names among {', '.join(TRAINABLE_KINDS)}, "
                          f"got {kinds}")
    if not kinds and not datastores:
        raise ConfigError("build_pool: nothing to build (no drafter kinds and no datastores)")
    return prompt_counts(n_prompts, domains)


def build_pool(target: LoadedModel, out_root: str | Path | None = None, *, domains: Sequence[str] = DOMAINS,
               n_prompts: int | Mapping[str, int] = DEFAULT_POOL_PROMPTS, kinds: Sequence[str] = ("feature-head",),
               generalist: bool = True, temperatures: Sequence[float] = DEFAULT_POOL_TEMPERATURES,
               max_new_tokens: int = DEFAULT_POOL_TOKENS, batch_size: int = DEFAULT_BATCH_SIZE, seed: int = 0,
               datastores: bool = True, datastore_max_tokens: int = 1_000_000,
               train_opts: Mapping[str, Any] | None = None, specialise: bool = True,
               specialist_opts: Mapping[str, Any] | None = None, retrain: bool = False,
               heldout: bool = True, progress: Progress | None = None,
               on_stage: Callable[[str], None] | None = None, trainer: Trainer | None = None,
               evaluator: Evaluator | None = None) -> PoolManifest:
    """Build (or finish, or refresh) the domain pool of ``target`` and return its manifest.

    Distillation resumes where a previous run stopped; datastores are rebuilt (seconds); a
    drafter is retrained only when its data or options changed, its file is missing, or
    ``retrain`` (specialists also when the generalist they start from changed). ``train_opts``
    go to ``train_drafter`` (``{"epochs": 10, "tiny-lm": {...}}``: common options, and per-kind
    ones under the kind's name). With ``specialise`` (and a generalist) every domain's drafter
    is the generalist fine-tuned on that domain, with ``SPECIALIST_TRAIN_OPTS`` updated by
    ``specialist_opts``; otherwise each is trained from scratch. With ``heldout``, every drafter
    of a kind is then scored on every domain's held-out prompts (``manifest.heldout``, the
    pool's heterogeneity matrix on held-out data; kept while the drafters are unchanged).
    ``n_prompts`` is one count for every domain or a ``{domain: count}`` mapping covering them.
    ``trainer`` / ``evaluator`` replace ``train_drafter`` / ``evaluate_drafters`` (tests).
    ``pool.json`` is rewritten after every stage, so an interrupted build leaves a usable
    manifest of what is done. Stage times are recorded per entry.
    """
    t_all = time.perf_counter()
    domains = list(domains)
    kinds = list(kinds)
    counts = check_pool_options(domains, kinds, n_prompts, datastores)
    root = Path(out_root).expanduser() if out_root is not None else default_pool_root(target)
    root = root.resolve()
    fingerprint = target_fingerprint(target)
    old: PoolManifest | None = None
    if (root / "pool.json").is_file():
        old = load_manifest(root)
        if any(old.target.get(k) != fingerprint.get(k) for k in FINGERPRINT_KEYS):
            raise ModelLoadError(f"the pool in {root} was built for target {old.target.get('name')!r}, not "
                                 f"{target.name!r}: use another --out, or delete {root}")
    settings = {"domains": domains, "n_prompts": counts, "kinds": kinds, "generalist": generalist,
                "temperatures": [float(t) for t in temperatures], "max_new_tokens": max_new_tokens,
                "batch_size": batch_size, "seed": seed, "datastores": datastores,
                "datastore_max_tokens": datastore_max_tokens, "train_opts": dict(train_opts or {}),
                "specialise": specialise, "specialist_opts": dict(specialist_opts or {})}
    manifest = PoolManifest(root=root, target=fingerprint, settings=settings,
                            created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"))
    say = on_stage or (lambda _msg: None)

    # 1. distillation, every domain first: the generalist needs all of it, and training is resumable
    for domain in domains:
        prompts = domain_prompts(domain, counts[domain], seed)
        data_dir = root / "data" / domain
        if (data_dir / "meta.json").is_file():
            extra = {s.prompt_id for s in load_distilled(data_dir).samples} - {p for p, _ in prompts}
            if extra:
                raise ConfigError(f"{data_dir} holds responses to {len(extra)} prompts outside this run's prompt "
                                  "set (it was built with more prompts or another seed): use the same "
                                  f"--n-prompts/--seed, another --out, or delete {data_dir}")
        try:
            run = distill_run(target, prompts, data_dir, domain=domain, temperatures=temperatures,
                              max_new_tokens=max_new_tokens, batch_size=batch_size, seed=seed, progress=progress)
        except PromptSetChangedError as exc:
            raise PromptSetChangedError(
                f"the {domain} training prompts changed since {data_dir} was distilled (new training material in "
                f"this adaspec version, or another tokenizer/chat template): delete {data_dir} and run build-pool "
                f"again to distil the domain afresh ({exc})") from exc
        ds = load_distilled(run.path, target)
        entry = PoolEntry(domain=domain, data=[str(run.path)], n_samples=len(ds.samples),
                          n_output_tokens=ds.n_output_tokens)
        prev = old.entries.get(domain) if old is not None else None
        # a resumed set's time includes the earlier runs that wrote the samples it kept
        entry.times["distill_s"] = run.seconds + (prev.times.get("distill_s", 0.0) if prev and run.skipped else 0.0)
        entry.reports["distill"] = {"new_samples": run.new_samples, "new_tokens": run.new_tokens,
                                    "skipped": run.skipped, "seconds": run.seconds,
                                    "tokens_per_s": run.tokens_per_s}
        manifest.entries[domain] = entry
        manifest.save()
        say(f"{domain}: {entry.n_samples} samples, {entry.n_output_tokens} output tokens ({run.new_tokens} new "
            f"in {run.seconds:.0f} s, {run.tokens_per_s:.1f} tokens/s)")
    if generalist:
        manifest.entries[GENERALIST] = PoolEntry(
            domain=GENERALIST, data=[d for e in manifest.entries.values() for d in e.data],
            n_samples=sum(e.n_samples for e in manifest.entries.values()),
            n_output_tokens=sum(e.n_output_tokens for e in manifest.entries.values()))

    # 2. datastores (responses only; see adaspec.distill.build_datastore)
    if datastores:
        for name, entry in manifest.entries.items():
            t0 = time.perf_counter()
            info = build_datastore_info(entry.data, root / "datastores" / f"{name}.jsonl", datastore_max_tokens,
                                        target=target)
            entry.specs["suffix"] = f"suffix:datastore={info.path}"
            entry.reports["suffix"] = {"documents": info.documents, "tokens": info.tokens}
            entry.times["datastore_s"] = time.perf_counter() - t0
        manifest.save()
        say(f"datastores: {len(manifest.entries)} written to {root / 'datastores'}")

    # 3. drafters: the generalist on the union (MetaSD's one-size-fits-all) first, then every domain,
    #    fine-tuned from the generalist (``specialise``) or trained from scratch
    if kinds:
        train = trainer or _default_trainer()
        names = sorted(manifest.entries, key=lambda n: n != GENERALIST)  # generalist first, then domain order
        for kind in kinds:
            base_key = ""
            for name in names:
                entry = manifest.entries[name]
                opts = _kind_opts(train_opts, kind)
                out = _artifact(root, name, kind)
                fine_tune = specialise and name != GENERALIST and GENERALIST in manifest.entries
                if fine_tune:
                    opts = opts | dict(SPECIALIST_TRAIN_OPTS) | _kind_opts(specialist_opts, kind, defaults={})
                    opts["init_from"] = str(_artifact(root, GENERALIST, kind))
                key = _data_key(entry.data, opts | ({"base": base_key} if fine_tune else {}))
                prev = old.entries.get(name) if old is not None else None
                if (not retrain and prev is not None and prev.train_keys.get(kind) == key
                        and kind in prev.reports and out.exists()):
                    entry.reports[kind] = prev.reports[kind]
                    entry.times[f"train_{kind}_s"] = prev.times.get(f"train_{kind}_s", 0.0)
                    entry.reports[kind]["reused"] = True
                    say(f"{name}/{kind}: unchanged, kept {out}")
                else:
                    out.parent.mkdir(parents=True, exist_ok=True)
                    t0 = time.perf_counter()
                    stage_progress = None
                    if progress is not None:
                        def stage_progress(stage: str, done: int, total: int, _p: str = f"{name}/{kind}") -> None:
                            progress(f"{_p}: {stage}", done, total)
                    report = train(kind, target, list(entry.data), out, progress=stage_progress, **opts)
                    entry.times[f"train_{kind}_s"] = time.perf_counter() - t0
                    entry.reports[kind] = _report_dict(report)
                    say(f"{name}/{kind}: {'fine-tuned' if fine_tune else 'trained'} in "
                        f"{entry.times[f'train_{kind}_s']:.0f} s -> {out}")
                if name == GENERALIST:
                    base_key = key
                entry.train_keys[kind] = key
                entry.specs[kind] = f"{kind}:path={out}"
                manifest.save()

    # 4. the held-out matrix: each drafter of a kind on each domain's held-out prompts (the split
    #    train_drafter made, so no drafter saw them; specialists share the generalist's split)
    if kinds and heldout:
        evaluate = evaluator or _default_evaluator()
        domain_data = [d for name in domains for d in manifest.entries[name].data]
        for kind in kinds:
            names = [n for n, e in manifest.entries.items() if kind in e.specs]
            opts = _kind_opts(train_opts, kind)
            key = hashlib.sha256(json.dumps([HELDOUT_VERSION] + [[n, manifest.entries[n].train_keys[kind]]
                                                                 for n in names]).encode()).hexdigest()[:16]
            prev = old.heldout.get(kind) if old is not None else None
            if not retrain and isinstance(prev, dict) and prev.get("key") == key:
                manifest.heldout[kind] = prev
                say(f"held-out matrix ({kind}): drafters unchanged, kept")
                continue
            t0 = time.perf_counter()
            rows = evaluate(kind, target, [_artifact(root, n, kind) for n in names], domain_data,
                            heldout_fraction=opts.get("heldout_fraction", 0.1), seed=opts.get("seed", 0),
                            progress=progress)
            manifest.heldout[kind] = {"key": key, "seconds": time.perf_counter() - t0,
                                      "rows": dict(zip(names, rows, strict=True))}
            manifest.save()
            say(f"held-out matrix ({kind}): {len(names)} drafters x {len(domains)} domains in "
                f"{manifest.heldout[kind]['seconds']:.0f} s")

    stages: dict[str, float] = {}
    for entry in manifest.entries.values():
        for stage, secs in entry.times.items():
            group = "train_s" if stage.startswith("train_") else stage
            stages[group] = stages.get(group, 0.0) + secs
    manifest.times = {**stages, **({"heldout_s": sum(h.get("seconds", 0.0) for h in manifest.heldout.values())}
                                   if manifest.heldout else {}), "total_s": time.perf_counter() - t_all}
    manifest.save()
    return manifest


def heldout_table(manifest: PoolManifest, kind: str) -> str | None:
    """The held-out matrix of one kind as a Markdown table: rows = drafters, columns = domains,
    cells = simulated MAT@5 (top-1 agreement); each specialist's own domain in bold."""
    block = manifest.heldout.get(kind)
    if not block or not block.get("rows"):
        return None
    rows: dict[str, dict[str, dict[str, float]]] = block["rows"]
    domains = list(dict.fromkeys(d for row in rows.values() for d in row))
    lines = ["| drafter | " + " | ".join(domains) + " |", "|---" * (len(domains) + 1) + "|"]
    for name, row in rows.items():
        cells = []
        for d in domains:
            v = row.get(d)
            text = "" if v is None else f"{v['mat_k5']:.2f} ({v['top1']:.2f})"
            cells.append(f"**{text}**" if d == name and text else text)
        lines.append(f"| {name}/{kind} | " + " | ".join(cells) + " |")
    n = {d: next(iter(rows.values())).get(d, {}).get("sequences") for d in domains}
    lines += ["", "MAT@5 (top-1 agreement) on held-out prompts; held-out sequences per domain: "
              + ", ".join(f"{d} {v}" for d, v in n.items())]
    margins = specialist_margins(manifest, kind)
    if margins:
        lines += ["Specialist minus generalist on the specialist's own domain (MAT@5, 95% paired bootstrap "
                  "interval over held-out sequences): " + ", ".join(
                      f"{d} {m['diff']:+.2f} [{m['lo']:+.2f}, {m['hi']:+.2f}]" for d, m in margins.items())]
    return "\n".join(lines)


def _resampled_mat(per_sequence: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """MAT = 1 + accepted / rounds of each resample (rows of ``idx``) of (accepted, rounds) rows."""
    return 1.0 + per_sequence[idx, 0].sum(1) / np.maximum(per_sequence[idx, 1].sum(1), 1.0)


def specialist_margins(manifest: PoolManifest, kind: str, *, level: float = 0.95, n_boot: int = 2000,
                       seed: int = 0) -> dict[str, dict[str, float]]:
    """Each specialist's held-out MAT@5 minus the generalist's on the specialist's own domain, with
    a paired percentile bootstrap interval: held-out sequences are resampled with replacement, the
    same ones for both drafters, and MAT = 1 + accepted / rounds is recomputed on each resample.
    An interval above 0 means the specialist wins at that level. Deterministic given ``seed``."""
    rows = (manifest.heldout.get(kind) or {}).get("rows", {})
    general = rows.get(GENERALIST)
    if not general:
        return {}
    rng = np.random.default_rng(seed)
    out: dict[str, dict[str, float]] = {}
    for name, row in rows.items():
        if name == GENERALIST or name not in row or name not in general:
            continue
        spec = np.asarray(row[name].get("per_sequence", []), dtype=float)
        gen = np.asarray(general[name].get("per_sequence", []), dtype=float)
        if spec.ndim != 2 or spec.shape != gen.shape or len(spec) == 0:
            continue
        idx = rng.integers(0, len(spec), size=(n_boot, len(spec)))
        diff = _resampled_mat(spec, idx) - _resampled_mat(gen, idx)
        lo, hi = np.quantile(diff, [(1 - level) / 2, (1 + level) / 2])
        out[name] = {"specialist": row[name]["mat_k5"], "generalist": general[name]["mat_k5"],
                     "diff": row[name]["mat_k5"] - general[name]["mat_k5"], "lo": float(lo), "hi": float(hi)}
    return out


# -- command (registered by cli.py as `adaspec build-pool`) ---------------------------------------
def _split_list(values: Sequence[str] | None) -> list[str]:
    return [v.strip() for item in (values or []) for v in item.split(",") if v.strip()]


def pool_command(
    domains: Annotated[list[str] | None, typer.Option("--domains", help="domains, comma-separated or repeated "
                       f"(default: all of {', '.join(DOMAINS)})")] = None,
    n_prompts: Annotated[str | None, typer.Option("--n-prompts", help="training prompts per domain: N for every "
                         "domain and/or DOMAIN=N overrides, comma-separated (default "
                         + ", ".join(f"{d} {n}" for d, n in DEFAULT_POOL_PROMPTS.items())
                         + f"; --quick: {QUICK['n_prompts']})")] = None,
    kinds: Annotated[list[str] | None, typer.Option("--kinds", help="drafter kinds to train, comma-separated: "
                     "feature-head, tiny-lm (default feature-head; 'none' = datastores only)")] = None,
    quick: Annotated[bool, typer.Option("--quick", help="minutes-scale smoke version: 8 prompts, 32 tokens, "
                                        "greedy only, 2 epochs, in a separate NAME-quick directory")] = False,
    model: Annotated[str, typer.Option("--model", "-m", help="target model")] = "smollm2",
    out: Annotated[str | None, typer.Option("--out", "-o", help="pool directory (default: the adaspec cache, "
                                            "pool/MODEL)")] = None,
    max_new_tokens: Annotated[int | None, typer.Option("--max-new-tokens", help="response length of the "
                              f"distilled data (default {DEFAULT_POOL_TOKENS})")] = None,
    temperature: Annotated[list[float] | None, typer.Option(
        "--temperature", "-t", help="distillation temperature, repeatable (default: 0 only; -t 0 -t 0.7 for "
        "MetaSD's mix, twice the time)")] = None,
    epochs: Annotated[int | None, typer.Option(help="training epochs of the generalist and of specialists trained "
                                               f"from scratch (default {DEFAULT_POOL_TRAIN_OPTS['epochs']})")] = None,
    no_generalist: Annotated[bool, typer.Option("--no-generalist", help="skip the generalist drafter")] = False,
    from_scratch: Annotated[bool, typer.Option("--from-scratch", help="train every specialist from scratch instead "
                                               "of fine-tuning the generalist on its domain")] = False,
    specialist_epochs: Annotated[int | None, typer.Option("--specialist-epochs", help="fine-tuning epochs of "
                                 f"each specialist (default {SPECIALIST_TRAIN_OPTS['epochs']})")] = None,
    retrain: Annotated[bool, typer.Option("--retrain", help="retrain drafters even if their data is unchanged")
                       ] = False,
    no_heldout: Annotated[bool, typer.Option("--no-heldout", help="skip the held-out matrix (every drafter "
                                             "scored on every domain's held-out prompts, ~3 min)")] = False,
    seed: Annotated[int, typer.Option(help="seed of prompts, sampling and training")] = 0,
    batch_size: Annotated[int, typer.Option("--batch-size", help="prompts per generate call")] = DEFAULT_BATCH_SIZE,
    threads: Annotated[int, typer.Option(help="torch threads (1 is fastest on a busy shared machine; try 2 "
                                         "when it is quiet)")] = 1,
) -> None:
    """Build the domain drafter pool: distil and index every domain, train a generalist, specialise it per domain."""
    from rich.console import Console
    from rich.table import Table

    from ..models import load_model, torch_threads
    from ..options import check_number, check_sampling, check_target, fail
    from ..progress import StageProgress

    err = Console(stderr=True)
    try:
        check_number("--threads", threads, low=1, integer=True)
        with torch_threads(threads):
            kind_list = _split_list(kinds) or ["feature-head"]
            if kind_list == ["none"]:
                kind_list = []
            train_opts: dict[str, Any] = dict(QUICK["train_opts"]) if quick else {}  # type: ignore[arg-type]
            if epochs is not None:
                train_opts["epochs"] = epochs
            specialist_opts: dict[str, Any] = dict(QUICK["specialist_opts"]) if quick else {}  # type: ignore[arg-type]
            if specialist_epochs is not None:
                specialist_opts["epochs"] = specialist_epochs
            default_counts = QUICK["n_prompts"] if quick else DEFAULT_POOL_PROMPTS
            counts = parse_prompt_counts(n_prompts, default_counts) if n_prompts else default_counts  # type: ignore[arg-type]
            check_pool_options(_split_list(domains) or DOMAINS, kind_list, counts)
            for option, value in (("--max-new-tokens", max_new_tokens), ("--epochs", epochs),
                                  ("--specialist-epochs", specialist_epochs), ("--batch-size", batch_size)):
                check_number(option, value, low=1, integer=True)
            check_sampling(temperature or [])
            check_target(model)
            err.print(f"loading {model} ...")
            target = load_model(model)
            root = Path(out) if out else default_pool_root(target, quick=quick)
            with StageProgress(err, remove_finished=True) as report:
                manifest = build_pool(
                    target, root, domains=_split_list(domains) or DOMAINS,
                    n_prompts=counts,  # type: ignore[arg-type]
                    kinds=kind_list, generalist=not no_generalist,
                    temperatures=temperature or (QUICK["temperatures"] if quick else DEFAULT_POOL_TEMPERATURES),  # type: ignore[arg-type]
                    max_new_tokens=max_new_tokens or (QUICK["max_new_tokens"] if quick else DEFAULT_POOL_TOKENS),  # type: ignore[arg-type]
                    batch_size=batch_size, seed=seed, train_opts=train_opts, specialise=not from_scratch,
                    specialist_opts=specialist_opts, retrain=retrain, heldout=not no_heldout, progress=report,
                    on_stage=report.message)
    except AdaspecError as exc:
        fail(exc)
    table = Table("entry", "samples", "output tokens", "distill s", "datastore s", "train s", "drafters")
    for name, e in manifest.entries.items():
        train_s = sum(v for k, v in e.times.items() if k.startswith("train_"))
        table.add_row(name, str(e.n_samples), str(e.n_output_tokens), f"{e.times.get('distill_s', 0):.0f}",
                      f"{e.times.get('datastore_s', 0):.1f}", f"{train_s:.0f}", ", ".join(e.specs))
    Console().print(table)
    for kind in manifest.heldout:
        text = heldout_table(manifest, kind)
        if text:
            print(f"\nheld-out matrix, {kind}:\n{text}\n")
    print(f"total {manifest.times.get('total_s', 0):.0f} s; manifest: {manifest.path}")
    print("drafter specs: " + " ".join(f"-d {s}" for s in manifest.specs()))
