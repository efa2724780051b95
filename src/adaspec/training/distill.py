"""Self-distillation data and domain retrieval datastores.

MetaSD F.1 trains each specialised drafter on the target's own responses to task prompts,
sampled greedily and at a few temperatures. This module

* runs the target over a prompt set, batched with left padding, and stores the responses as
  token ids with the target's fingerprint (format ``adaspec.distill/1``, below), resumably,
* builds REST-style suffix datastores (He et al. 2024) from those responses.

The training prompts of each domain come from ``adaspec.training_prompts``.

Format ``adaspec.distill/1``: a directory with

* ``meta.json``: ``{"format": "adaspec.distill/1", "target": target_fingerprint(target),
  "domain": str, "temperatures": [float], "max_new_tokens": int, "created": ISO time,
  "n_samples": int}``
* ``samples.jsonl``: one line per response, ``{"prompt_id": str, "temperature": float,
  "seed": int, "prompt_ids": [int], "output_ids": [int]}``; ``output_ids`` hold no padding
  and end after the first EOS (kept), or at ``max_new_tokens``.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import os
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import torch
import typer

from ..errors import AdaspecError, ConfigError, ModelLoadError, PromptError, PromptSetChangedError
from ..models import LoadedModel, check_fingerprint, target_fingerprint
from .prompts import DOMAINS, domain_prompts

log = logging.getLogger(__name__)

DISTILL_FORMAT = "adaspec.distill/1"
DEFAULT_TEMPERATURES: tuple[float, ...] = (0.0, 0.7)
#: rows per ``generate`` call. SmolLM2-135M, fp32, 1 thread, busy shared 2-core machine, 64 new
#: tokens: 7.6 / 18.2 / 25.5 / 36.3 tokens/s at batch 1 / 4 / 8 / 16; with 128 tokens 38.6 at 8,
#: 49.7 at 16 and 50.6 at 32 (decoding becomes compute-bound near 16 rows)
DEFAULT_BATCH_SIZE = 16
#: progress(stage, done, total)
Progress = Callable[[str, int, int], None]
#: a prompt: text (the chat template is applied), chat messages, or token ids
PromptInput = str | list[int] | list[dict[str, str]]


def read_prompt_file(path: str | Path) -> list[tuple[str, PromptInput]]:
    """Prompts from a file: JSON lines with ``text`` or ``turns`` (and ``id`` or ``question_id``),
    or plain text with one prompt per line. Only the first turn of a multi-turn prompt is used
    (later turns depend on the target's own earlier answers)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise PromptError(f"prompt file not found: {path}: pass a .jsonl or .txt file")
    lines = path.read_text(encoding="utf-8").splitlines()
    out: list[tuple[str, PromptInput]] = []
    if path.suffix.lower() in (".jsonl", ".json"):
        for i, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as exc:
                raise PromptError(f"{path}:{i}: not valid JSON ({exc}): one JSON object per line") from exc
            if not isinstance(row, dict):
                raise PromptError(f"{path}:{i}: expected a JSON object with 'text' or 'turns'")
            pid = str(row.get("id", row.get("question_id", f"{path.stem}-{i:04d}")))
            text = row.get("text")
            if text is None and isinstance(row.get("turns"), list) and row["turns"]:
                text = row["turns"][0]
            if not isinstance(text, str) or not text.strip():
                raise PromptError(f"{path}:{i}: needs a non-empty 'text' or 'turns' list of strings")
            out.append((pid, text))
    else:
        out = [(f"{path.stem}-{i:04d}", line.strip()) for i, line in enumerate(lines, 1) if line.strip()]
    if not out:
        raise PromptError(f"{path} holds no prompts")
    return out


# =============================================================================================
# The distilled-set format
# =============================================================================================
@dataclass
class Sample:
    """One target response: the prompt's and the response's token ids and how it was sampled."""

    prompt_id: str
    temperature: float
    seed: int
    prompt_ids: list[int]
    output_ids: list[int]

    @property
    def key(self) -> tuple[str, float, int]:
        return (self.prompt_id, float(self.temperature), int(self.seed))

    def to_json(self) -> str:
        return json.dumps({"prompt_id": self.prompt_id, "temperature": float(self.temperature),
                           "seed": int(self.seed), "prompt_ids": self.prompt_ids,
                           "output_ids": self.output_ids}, separators=(",", ":"))


@dataclass
class DistilledSet:
    """A loaded distilled directory: ``meta.json`` and the samples in file order."""

    path: Path
    meta: dict[str, Any]
    samples: list[Sample] = field(default_factory=list)

    @property
    def domain(self) -> str:
        return str(self.meta["domain"])

    @property
    def target(self) -> dict[str, Any]:
        return dict(self.meta["target"])

    @property
    def n_output_tokens(self) -> int:
        return sum(len(s.output_ids) for s in self.samples)

    def check_target(self, target: LoadedModel) -> None:
        """Raise ``ModelLoadError`` unless ``target`` is the model the responses came from."""
        check_fingerprint(self.target, target, f"distilled set {self.path}")


def _bad(path: Path, msg: str) -> AdaspecError:
    return AdaspecError(f"{path}: {msg}")


def _read_meta(path: Path) -> dict[str, Any]:
    meta_file = path / "meta.json"
    if not meta_file.is_file():
        raise AdaspecError(f"{path} is not a distilled set (no meta.json): create it with `adaspec distill`")
    try:
        meta = json.loads(meta_file.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise _bad(meta_file, f"not valid JSON ({exc}): delete the directory and distill again") from exc
    if not isinstance(meta, dict) or meta.get("format") != DISTILL_FORMAT:
        got = meta.get("format") if isinstance(meta, dict) else None
        raise _bad(meta_file, f"format {got!r}, expected {DISTILL_FORMAT!r}: distill again with this adaspec")
    for key, kind in (("target", dict), ("domain", str), ("temperatures", list), ("max_new_tokens", int),
                      ("created", str), ("n_samples", int)):
        if not isinstance(meta.get(key), kind):
            raise _bad(meta_file, f"field {key!r} is missing or not a {kind.__name__}: distill again")
    return meta


def _parse_sample(row: Any) -> Sample:
    if not isinstance(row, dict):
        raise ValueError("not a JSON object")
    ids, out = row["prompt_ids"], row["output_ids"]
    for name, seq in (("prompt_ids", ids), ("output_ids", out)):
        if not isinstance(seq, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                for t in seq):
            raise ValueError(f"{name} must be a list of token ids")
    if not ids:
        raise ValueError("prompt_ids is empty")
    if not isinstance(row["prompt_id"], str) or isinstance(row["seed"], bool) or not isinstance(row["seed"], int):
        raise ValueError("prompt_id must be a string and seed an integer")
    return Sample(row["prompt_id"], float(row["temperature"]), int(row["seed"]), ids, out)


def _read_samples(path: Path, *, repair: bool) -> list[Sample]:
    """Samples of ``samples.jsonl``. Lines are written whole, newline included, so a last line
    without its newline is a torn write (a crash): with ``repair`` it is cut off with a warning
    (its sample is regenerated), otherwise it is an error."""
    file = path / "samples.jsonl"
    if not file.is_file():
        return []
    raw = file.read_bytes()
    complete = raw.rfind(b"\n") + 1  # bytes up to the last newline are whole lines
    samples: list[Sample] = []
    for i, line in enumerate(raw[:complete].split(b"\n")[:-1], 1):
        if not line.strip():
            continue
        try:
            samples.append(_parse_sample(json.loads(line)))
        except (ValueError, KeyError, TypeError) as exc:
            raise _bad(file, f"line {i}: bad sample ({exc}): the file is corrupt, distill again") from exc
    if raw[complete:].strip():
        if not repair:
            raise _bad(file, "the last line is incomplete (an interrupted run): rerun `adaspec distill` with "
                             "the same arguments to repair and finish it")
        log.warning("%s: dropping a torn last line (an interrupted write); its sample is regenerated", file)
        with open(file, "r+b") as fh:
            fh.truncate(complete)
    return samples


def load_distilled(path: str | Path, target: LoadedModel | None = None) -> DistilledSet:
    """Load and validate a distilled set; with ``target``, refuse data from another model."""
    path = Path(path).expanduser()
    meta = _read_meta(path)
    if target is not None:
        check_fingerprint(meta["target"], target, f"distilled set {path}")
    if not (path / "samples.jsonl").is_file():
        raise AdaspecError(f"{path} has no samples.jsonl: rerun `adaspec distill` with the same arguments")
    samples = _read_samples(path, repair=False)
    if len(samples) != meta["n_samples"]:
        raise AdaspecError(f"{path}: meta.json counts {meta['n_samples']} samples but samples.jsonl holds "
                           f"{len(samples)} (the run was interrupted): rerun `adaspec distill` with the same "
                           "arguments to finish it")
    seen: set[tuple[str, float, int]] = set()
    for s in samples:
        if s.key in seen:
            raise AdaspecError(f"{path}: sample {s.key} appears twice: the set is corrupt, distill again")
        seen.add(s.key)
    return DistilledSet(path, meta, samples)


def _write_meta(path: Path, meta: dict[str, Any]) -> None:
    tmp = path / "meta.json.tmp"
    tmp.write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, path / "meta.json")


# =============================================================================================
# Generation
# =============================================================================================
@dataclass
class DistillRun:
    """What one ``distill`` call did (the set itself is on disk)."""

    path: Path
    n_samples: int  # in the set after the run
    new_samples: int
    new_tokens: int  # output tokens generated by this run
    skipped: int  # samples already present (resume)
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0


def _eos_ids(target: LoadedModel) -> set[int]:
    from ..engine import SpeculativeEngine

    return SpeculativeEngine(target, ["none"]).eos_ids()


def _encode(target: LoadedModel, prompts: Sequence[tuple[str, PromptInput]], chat_template: bool) -> list[list[int]]:
    from ..engine import SpeculativeEngine

    engine = SpeculativeEngine(target, ["none"])
    out = []
    for pid, prompt in prompts:
        try:
            out.append(engine.encode_prompt(prompt, chat_template))
        except PromptError as exc:
            raise PromptError(f"prompt {pid!r}: {exc}") from None
    return out


def _cut(row: Sequence[int], eos: set[int]) -> list[int]:
    """Response tokens up to and including the first EOS (the rest is padding)."""
    out: list[int] = []
    for t in row:
        out.append(int(t))
        if t in eos:
            break
    return out


_NON_NEUTRAL = ("min_p", "top_h", "suppress_tokens", "begin_suppress_tokens", "bad_words_ids", "sequence_bias",
                "exponential_decay_length_penalty", "forced_bos_token_id", "forced_eos_token_id")


@torch.inference_mode()
def generate_batch(target: LoadedModel, prompt_ids: Sequence[Sequence[int]], temperature: float,
                   max_new_tokens: int, *, seed: int = 0, eos: set[int] | None = None,
                   pad_id: int | None = None) -> list[list[int]]:
    """The target's responses to a batch of tokenised prompts with one ``model.generate`` call:
    left padding and an attention mask; greedy (``temperature`` 0) or plain temperature sampling
    (no top-k / top-p / repetition penalty, so the data follow the distribution the engine
    verifies). Batched fp32 greedy decoding can differ from unbatched greedy decoding in rare
    near-ties (padding changes the kernels' reduction order): harmless for training data.
    """
    from transformers import GenerationConfig

    eos = _eos_ids(target) if eos is None else eos
    if pad_id is None:
        tok_pad = getattr(target.tokenizer, "pad_token_id", None) if target.tokenizer is not None else None
        pad_id = tok_pad if tok_pad is not None else (min(eos) if eos else 0)
    width = max(len(p) for p in prompt_ids)
    device = target.device
    ids = torch.tensor([[pad_id] * (width - len(p)) + list(p) for p in prompt_ids], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids], device=device)
    model_gc = getattr(target.model, "generation_config", None)
    active = [k for k in _NON_NEUTRAL if getattr(model_gc, k, None) not in (None, [], {})]
    if active:
        log.warning("the model's generation config sets %s, which generate() applies to distillation: "
                    "clear them for data that follow the target's plain distribution", ", ".join(active))
    sample = temperature > 0
    gc = GenerationConfig(do_sample=sample, temperature=temperature if sample else None,
                          top_k=0 if sample else None, top_p=1.0 if sample else None,
                          typical_p=1.0 if sample else None, repetition_penalty=1.0, no_repeat_ngram_size=0,
                          max_new_tokens=max_new_tokens, min_new_tokens=0, num_beams=1,
                          pad_token_id=pad_id, eos_token_id=sorted(eos) if eos else None)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        out = target.model.generate(input_ids=ids, attention_mask=mask, generation_config=gc)
    return [_cut(row, eos) for row in out[:, width:].tolist()]


def _batch_seed(seed: int, temperature: float, ids: Sequence[str]) -> int:
    return zlib.crc32(f"{seed}|{temperature}|{'|'.join(ids)}".encode())


def distill_run(target: LoadedModel, prompts: Sequence[tuple[str, PromptInput]], out_dir: str | Path, *,
                domain: str, temperatures: Sequence[float] = DEFAULT_TEMPERATURES,
                samples_per_temperature: int = 1, max_new_tokens: int = 128,
                batch_size: int = DEFAULT_BATCH_SIZE, seed: int = 0, chat_template: bool = True,
                progress: Progress | None = None) -> DistillRun:
    """``distill``, returning what the run did (samples, tokens, time) as well as the path."""
    t0 = time.perf_counter()
    out = Path(out_dir).expanduser()
    temps = [float(t) for t in temperatures]
    if not temps or any(not (t >= 0 and t == t) for t in temps) or len(set(temps)) != len(temps):
        raise ConfigError(f"temperatures must be distinct numbers >= 0 (0 = greedy), got {list(temperatures)}")
    for name, v in (("samples_per_temperature", samples_per_temperature), ("max_new_tokens", max_new_tokens),
                    ("batch_size", batch_size)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"distill: {name} must be an integer >= 1, got {v!r}")
    if not isinstance(domain, str) or not domain.strip():
        raise ConfigError("distill: give the set a domain name, e.g. --domain code")
    if not prompts:
        raise PromptError("distill: no prompts given")
    pids = [p for p, _ in prompts]
    if len(set(pids)) != len(pids):
        dup = sorted({p for p in pids if pids.count(p) > 1})[:5]
        raise PromptError(f"distill: duplicate prompt ids {dup}: give every prompt its own id")
    encoded = _encode(target, prompts, chat_template)
    window = target.context_window
    for pid, ids in zip(pids, encoded):
        if window is not None and len(ids) + max_new_tokens > window:
            raise PromptError(f"prompt {pid!r} has {len(ids)} tokens, which with max_new_tokens={max_new_tokens} "
                              f"exceeds the context window ({window}): shorten it or lower --max-new-tokens")

    fingerprint = target_fingerprint(target)
    out.mkdir(parents=True, exist_ok=True)
    existing: list[Sample] = []
    if (out / "meta.json").is_file():
        meta = _read_meta(out)
        check_fingerprint(meta["target"], target, f"the distilled set in {out}")
        if meta["domain"] != domain:
            raise ConfigError(f"{out} holds domain {meta['domain']!r}, not {domain!r}: use another --out")
        if meta["max_new_tokens"] != max_new_tokens:
            raise ConfigError(f"{out} was distilled with max_new_tokens={meta['max_new_tokens']}, not "
                              f"{max_new_tokens}: use the same value to resume, or another --out")
        existing = _read_samples(out, repair=True)
        meta["temperatures"] = list(dict.fromkeys([*map(float, meta["temperatures"]), *temps]))
    elif (out / "samples.jsonl").is_file():
        raise AdaspecError(f"{out} has samples.jsonl but no meta.json: delete it or use another --out")
    else:
        meta = {"format": DISTILL_FORMAT, "target": fingerprint, "domain": domain, "temperatures": temps,
                "max_new_tokens": max_new_tokens, "created": _dt.datetime.now(_dt.timezone.utc).isoformat(
                    timespec="seconds"), "n_samples": 0}
    by_id = dict(zip(pids, encoded))
    done: set[tuple[str, float, int]] = set()
    for s in existing:
        if s.prompt_id in by_id and s.prompt_ids != by_id[s.prompt_id]:
            raise PromptSetChangedError(f"{out}: prompt {s.prompt_id!r} encodes differently than when it was distilled "
                              "(the prompt set, tokenizer or chat-template setting changed): use another --out")
        done.add(s.key)
    meta["n_samples"] = len(existing)
    _write_meta(out, meta)

    # work: (temperature, sample seed) groups, prompts sorted by length (less padding)
    work: list[tuple[float, int, list[int]]] = []
    for t in temps:
        for k in range(1 if t == 0 else samples_per_temperature):
            todo = [i for i in range(len(prompts)) if (pids[i], t, seed + k) not in done]
            todo.sort(key=lambda i: (len(encoded[i]), i))
            for b in range(0, len(todo), batch_size):
                work.append((t, seed + k, todo[b: b + batch_size]))
    total = sum(len(w[2]) for w in work)
    requested = sum(len(prompts) * (1 if t == 0 else samples_per_temperature) for t in temps)
    eos = _eos_ids(target)
    n_new = n_tokens = 0
    stage = f"distilling {domain}"
    if progress is not None:
        progress(stage, 0, total)
    with open(out / "samples.jsonl", "a", encoding="utf-8") as fh:
        for t, s_seed, idx in work:
            outputs = generate_batch(target, [encoded[i] for i in idx], t, max_new_tokens,
                                     seed=_batch_seed(s_seed, t, [pids[i] for i in idx]), eos=eos)
            for i, o in zip(idx, outputs):
                fh.write(Sample(pids[i], t, s_seed, encoded[i], o).to_json() + "\n")
                n_tokens += len(o)
            fh.flush()
            os.fsync(fh.fileno())
            n_new += len(idx)
            meta["n_samples"] = len(existing) + n_new
            _write_meta(out, meta)
            if progress is not None:
                progress(stage, n_new, total)
    return DistillRun(out, len(existing) + n_new, n_new, n_tokens, requested - total,
                      time.perf_counter() - t0)


def distill(target: LoadedModel, prompts: Sequence[tuple[str, PromptInput]], out_dir: str | Path, *,
            domain: str, temperatures: Sequence[float] = DEFAULT_TEMPERATURES, samples_per_temperature: int = 1,
            max_new_tokens: int = 128, batch_size: int = DEFAULT_BATCH_SIZE, seed: int = 0,
            chat_template: bool = True, progress: Progress | None = None) -> Path:
    """Write the target's responses to ``prompts`` (``(id, text | messages | token ids)``) into the
    distilled set ``out_dir`` (format ``adaspec.distill/1``) and return its path.

    Each prompt is answered greedily (temperature 0, once) and ``samples_per_temperature`` times
    at every other temperature (MetaSD F.1), batched ``batch_size`` prompts per ``generate``
    call. Resumable: samples already in the set, keyed by (prompt id, temperature, seed), are
    skipped; every batch is appended and flushed, so a crash loses at most one batch. Resuming
    with another target, domain or ``max_new_tokens`` is an error. Sampled responses depend on
    the batch they were drawn in (one RNG stream per batch), so a resumed run is a valid sample
    but not bit-identical to an uninterrupted one.
    """
    return distill_run(target, prompts, out_dir, domain=domain, temperatures=temperatures,
                       samples_per_temperature=samples_per_temperature, max_new_tokens=max_new_tokens,
                       batch_size=batch_size, seed=seed, chat_template=chat_template, progress=progress).path


# =============================================================================================
# Domain retrieval datastores (REST style)
# =============================================================================================
@dataclass
class DatastoreInfo:
    path: Path
    documents: int
    tokens: int
    sources: list[str]


def build_datastore(distilled_dirs: Sequence[str | Path], out_file: str | Path, max_tokens: int = 1_000_000, *,
                    min_match: int = 2, target: LoadedModel | None = None) -> Path:
    """Write a suffix-drafter datastore (``suffix:datastore=FILE``) of the responses in the
    distilled sets; return its path.

    Responses only, not prompts: the drafter should propose what the *target* writes, the
    live request's own prompt is matched anyway, and our templated training prompts (with the
    chat template's system preamble) would add near-duplicate text that never occurs in
    held-out requests. Every sample is one document (EOS kept, so ends of answers are drafted
    too); samples of several temperatures weight frequent continuations. All sets must come from
    one target (and from ``target`` when given). Exceeding ``max_tokens`` is an error, not an
    eviction: raise it or use fewer sets.
    """
    return build_datastore_info(distilled_dirs, out_file, max_tokens, min_match=min_match, target=target).path


def build_datastore_info(distilled_dirs: Sequence[str | Path], out_file: str | Path, max_tokens: int = 1_000_000,
                         *, min_match: int = 2, target: LoadedModel | None = None) -> DatastoreInfo:
    """``build_datastore`` returning the document and token counts as well."""
    from ..drafters.suffix import SuffixDatastore

    if not distilled_dirs:
        raise ConfigError("build_datastore needs at least one distilled set")
    sets = [load_distilled(d, target) for d in distilled_dirs]
    first = sets[0]
    for ds in sets[1:]:
        keys = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "weights")
        if any(ds.target.get(k) != first.target.get(k) for k in keys):
            raise ModelLoadError(f"distilled sets {first.path} and {ds.path} come from different targets: "
                                 "a datastore serves one target, build one per target")
    docs = [s.output_ids for ds in sets for s in ds.samples if len(s.output_ids) > min_match]
    n_tokens = sum(len(d) for d in docs)
    if n_tokens > max_tokens:
        raise ConfigError(f"the responses hold {n_tokens} tokens, more than max_tokens={max_tokens}: raise "
                          "max_tokens or build from fewer sets")
    store = SuffixDatastore(min_match=min_match, max_tokens=max_tokens)
    for doc in docs:
        store.add(doc)
    out = Path(out_file).expanduser()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    store.save(tmp)
    # record where the datastore comes from in its header line (the loader ignores extra keys)
    lines = tmp.read_text(encoding="utf-8").split("\n", 1)
    header = json.loads(lines[0])
    header.update({"target": first.target, "sources": [str(ds.path) for ds in sets],
                   "domains": sorted({ds.domain for ds in sets}), "documents": len(docs), "tokens": n_tokens})
    tmp.write_text(json.dumps(header) + "\n" + (lines[1] if len(lines) > 1 else ""), encoding="utf-8")
    os.replace(tmp, out)
    return DatastoreInfo(out, len(docs), n_tokens, [str(ds.path) for ds in sets])


# =============================================================================================
# Commands (registered by cli.py)
# =============================================================================================
def distill_command(
    domain: Annotated[str, typer.Option("--domain", help=f"training domain: {', '.join(DOMAINS)} (or a "
                                        "name for --prompts)")] = "code",
    n: Annotated[int, typer.Option("--n", "-n", help="number of generated domain prompts")] = 120,
    out: Annotated[str | None, typer.Option("--out", "-o", help="output directory (default: the adaspec cache, "
                                            "distill/MODEL/DOMAIN)")] = None,
    temperature: Annotated[list[float] | None, typer.Option("--temperature", "-t", help="sampling temperature, "
                           "repeatable (0 = greedy); default 0 and 0.7")] = None,
    prompts: Annotated[str | None, typer.Option("--prompts", help="prompt file instead of the generated "
                       "domain prompts: .jsonl with id/text or turns, or .txt with one prompt per line")] = None,
    model: Annotated[str, typer.Option("--model", "-m", help="target model")] = "smollm2",
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", help="response length cap")] = 128,
    samples: Annotated[int, typer.Option("--samples", help="samples per non-zero temperature")] = 1,
    batch_size: Annotated[int, typer.Option("--batch-size", help="prompts per generate call")] = DEFAULT_BATCH_SIZE,
    seed: Annotated[int, typer.Option(help="seed of the prompts and of sampling")] = 0,
    no_chat_template: Annotated[bool, typer.Option("--no-chat-template", help="feed prompts as raw text")] = False,
    threads: Annotated[int, typer.Option(help="torch threads (1 is fastest on a busy shared machine)")] = 1,
) -> None:
    """Generate self-distillation data: the target's responses to a domain's prompts (resumable)."""
    from rich.console import Console

    from ..options import check_number, check_sampling, check_target, fail
    from ..progress import StageProgress
    from ..models import cache_dir, load_model, torch_threads

    err = Console(stderr=True)
    try:
        check_number("--n", n, low=1, integer=True)
        check_number("--max-new-tokens", max_new_tokens, low=1, integer=True)
        check_number("--samples", samples, low=1, integer=True)
        check_number("--batch-size", batch_size, low=1, integer=True)
        check_number("--threads", threads, low=1, integer=True)
        check_sampling(temperature or [])
        check_target(model)
        with torch_threads(threads):
            chosen = read_prompt_file(prompts) if prompts else domain_prompts(domain, n, seed)
            folder = Path(out) if out else cache_dir() / "distill" / Path(model).name / domain
            err.print(f"loading {model} ...")
            target = load_model(model)
            with StageProgress(err) as report:
                run = distill_run(target, chosen, folder, domain=domain,
                                  temperatures=temperature or DEFAULT_TEMPERATURES, samples_per_temperature=samples,
                                  max_new_tokens=max_new_tokens, batch_size=batch_size, seed=seed,
                                  chat_template=not no_chat_template, progress=report)
    except AdaspecError as exc:
        fail(exc)
    print(f"{run.path}: {run.n_samples} samples ({run.new_samples} new, {run.skipped} already there); "
          f"{run.new_tokens} tokens in {run.seconds:.1f} s ({run.tokens_per_s:.1f} tokens/s)")


def datastore_command(
    data: Annotated[list[str], typer.Argument(help="distilled set directories")],
    out: Annotated[str, typer.Option("--out", "-o", help="datastore file (.jsonl)")],
    max_tokens: Annotated[int, typer.Option("--max-tokens", help="size bound of the datastore")] = 1_000_000,
    min_match: Annotated[int, typer.Option("--min-match", help="shortest suffix match")] = 2,
) -> None:
    """Build a suffix-drafter datastore from distilled sets (use it with -d suffix:datastore=FILE)."""
    from ..options import check_number, check_path, fail

    try:
        check_number("--max-tokens", max_tokens, low=1, integer=True)
        check_number("--min-match", min_match, low=1, integer=True)
        for d in data:
            check_path("DATA", d, "dir", "pass a directory written by `adaspec distill`")
        info = build_datastore_info(data, out, max_tokens, min_match=min_match)
    except AdaspecError as exc:
        fail(exc)
    print(f"{info.path}: {info.documents} documents, {info.tokens} tokens; use it with "
          f"-d suffix:datastore={info.path}")
