"""A GGUF target computed from the file's own quantized blocks: weight-only quantized linear layers
for CPU decoding and verification, batch-invariant by construction.

``load_model(spec, weights="gguf")`` (the default ``"auto"`` on a CPU) loads a GGUF model as
transformers does and then replaces every linear layer, the tied output projection included,
with a ``QuantLinear`` over the tensor's blocks as the file stores them (Q4_0, Q4_1, Q5_0, Q5_1,
Q8_0, Q4_K, Q5_K, Q6_K, F16, BF16, F32; rows reordered where transformers reorders them, never
re-quantized), and the token embedding with a ``QuantEmbedding`` that dequantizes the rows it looks
up. A C++ kernel (``csrc/quant.cpp``, compiled on first use with ``torch.utils.cpp_extension``
into ``$ADASPEC_CACHE/kernels``, ``-O3 -march=native``: AVX-512, AVX2 or plain C++ by the CPU)
dequantizes each weight block once, in registers or into a per-thread panel, and applies it to
every input row.

Numerics (docs/kernels.md): a weight is dequantized to float32 exactly as the ``gguf`` package's
own dequantizer computes it (for every supported type the value ``d * q`` is exact in float32 and
``d * q + m``, ``(d * sc) * q - dmin * m`` are rounded once, as there); each output is the sum of
``w * x`` over its row in a fixed order, sixteen float32 lanes by fused multiply-add in increasing
k and the lanes summed as a fixed tree, whatever the number of rows and threads (threads split
the outputs, never a sum). A row's logits are therefore bit-identical alone, in a verify block and
in a batch, and greedy speculative output equals plain decoding on this target token for token.
Compared with ``F.linear`` on the dequantized weights the products differ by float rounding only
(another summation order).

Prefill takes the same kernels by default (``PREFILL_GEMM = "kernel"``), so a prompt's KV is the
same whole, in the batch engine's pieces and after a prefix cache's kept prefix. With
``PREFILL_GEMM = "gemm"``, inside ``prefill_scope()`` (the transformers backend's ``prefill``) a
forward of at least ``PREFILL_MIN_ROWS`` rows runs each layer as a float32 GEMM on its weights
dequantized for that call; verify blocks and batches never take it, whatever their row count.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import importlib.util
import logging
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .artifacts import cache_dir
from .errors import ConfigError, ModelLoadError

log = logging.getLogger(__name__)

#: the C++ source of the kernels (package data)
KERNEL_SOURCE = Path(__file__).parent / "csrc" / "quant.cpp"
#: compiler flags: the CPU's own vector ISA; no implicit contraction (every FMA in the source is explicit)
BASE_FLAGS = ("-O3", "-ffp-contract=off")


def openmp_flags() -> tuple[str, ...]:
    """``-fopenmp`` where the compiler is GCC or Clang on Linux: ATen's ``parallel_for`` is a
    header template whose threads exist only when the extension itself is compiled with OpenMP
    (without it every product and attention call ran on one thread, whatever
    ``torch.get_num_threads()`` said). The library is torch's own ``libgomp.so.1``, already
    loaded, so the extension shares torch's thread pool and thread count."""
    return ("-fopenmp",) if platform.system() == "Linux" else ()
#: GGML tensor types the kernel computes (``gguf.GGMLQuantizationType`` values)
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
#: ``load_model(weights=...)`` / ``--weights`` values: ``gguf`` float32 activations (the dequantized
#: model, exactly), ``gguf-q8`` 8-bit activations with integer dot products (as llama.cpp computes)
WEIGHT_MODES = ("auto", "gguf", "gguf-q8", "dense")
#: the quantized modes
GGUF_MODES = ("gguf", "gguf-q8")
#: with ``prefill_scope`` active and ``PREFILL_GEMM == "gemm"``, forwards of at least this many
#: rows take the dense path
PREFILL_MIN_ROWS = 64
#: the prefill path: ``"kernel"`` (the default: a prompt takes the batch-invariant kernels of
#: decoding, so its KV does not depend on how it was fed: whole, in pieces, or after a kept
#: prefix) or ``"gemm"`` (from ``PREFILL_MIN_ROWS`` rows each layer dequantized for the call,
#: ``F.linear``, and SDPA attention: a prompt's KV then depends on the pieces it was fed in)
PREFILL_GEMM = "kernel"
#: environment variable: where compiled kernels are built (default ``$ADASPEC_CACHE/kernels``);
#: the test suite points it at one folder per machine, reused across sessions
BUILD_ENV = "ADASPEC_KERNELS_BUILD"


# -- the compiled extension ------------------------------------------------------------------------
def arch_flags(arch: str = "native") -> tuple[str, ...]:
    """``-march=ARCH`` on x86-64 and ARM Linux (``native``: this CPU's ISA; ``x86-64-v3``: AVX2
    without AVX-512; ``x86-64``: the plain C++ path), nothing elsewhere."""
    if platform.machine().lower() in ("x86_64", "amd64", "aarch64", "arm64") and platform.system() != "Darwin":
        return (f"-march={arch}",)
    return ()


def _compiler() -> str:
    return os.environ.get("CXX", "c++")


@functools.cache
def _compiler_version(cxx: str) -> str:
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30)
        return out.stdout.splitlines()[0] if out.stdout else ""
    except (OSError, subprocess.SubprocessError):
        return ""


def kernel_key(arch: str = "native") -> str:
    """The compiled kernel's key: its source, the compiler and flags, torch, Python and the
    machine (``-march=native`` code is this CPU's; ``kernels.machine_identity``)."""
    from .kernels import machine_identity

    flags = (*BASE_FLAGS, *openmp_flags(), *arch_flags(arch))
    ident = "|".join([hashlib.sha256(KERNEL_SOURCE.read_bytes()).hexdigest(), " ".join(flags),
                      _compiler_version(_compiler()), torch.__version__, sys.version.split()[0],
                      machine_identity(torch.device("cpu"))])
    return hashlib.sha256(ident.encode()).hexdigest()[:16]


def _build_roots() -> list[Path]:
    """Where a compiled kernel is looked for, in order; it is built in the first."""
    roots = [Path(os.environ[BUILD_ENV])] if os.environ.get(BUILD_ENV) else []
    return [*roots, cache_dir() / "kernels"]


def _import_built(name: str, so: Path) -> Any:
    spec = importlib.util.spec_from_file_location(name, so)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {so}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_build_lock = threading.Lock()

#: ``torch.utils.cpp_extension.load`` in a fresh interpreter (argv: name, source, build folder, flags)
_COMPILE = ("import sys; from torch.utils import cpp_extension; "
            "cpp_extension.load(name=sys.argv[1], sources=[sys.argv[2]], build_directory=sys.argv[3], "
            "extra_cflags=sys.argv[4:], extra_ldflags=[f for f in sys.argv[4:] if f == '-fopenmp'], verbose=False)")


def _compile(name: str, build: Path, flags: list[str], cxx: str) -> None:
    """Compile the kernel into ``build`` in a child interpreter, not this process: importing
    ``cpp_extension`` imports setuptools, whose distutils shim fails with an AssertionError in
    a process where something imported the standard library's distutils first (seen in the test
    suite), and a failed build must not leave half-imported modules behind."""
    proc = subprocess.run([sys.executable, "-c", _COMPILE, name, str(KERNEL_SOURCE), str(build), *flags],
                          capture_output=True, text=True, cwd=build)  # (a pybuilddir.txt in the cwd breaks it too)
    if proc.returncode != 0 or not (build / f"{name}.so").is_file():
        raise ConfigError(f"compiling the quantized GGUF kernels failed ({(proc.stderr or proc.stdout).strip()[-600:]}): "
                          f"check the C++ compiler ({cxx}), or use --weights dense")


@functools.cache
def extension(arch: str = "native") -> Any:
    """The kernel module, compiled once per machine (about a minute on two cores) and imported
    from the cache afterwards. A clear ``ConfigError`` when it cannot be built (no C++ compiler,
    no ninja): the fix, or ``--weights dense``."""
    name = f"adaspec_quant_{kernel_key(arch)}"
    for root in _build_roots():
        so = root / name / f"{name}.so"
        if so.is_file():
            try:
                return _import_built(name, so)
            except ImportError as exc:  # a broken build: build it again below
                log.warning("ignoring the compiled kernel %s: %s", so, exc)
    cxx = _compiler()
    if shutil.which(cxx) is None:
        raise ConfigError(f"the quantized GGUF kernels need a C++ compiler ({cxx!r} not found): install one "
                          "(Debian/Ubuntu: apt-get install g++; macOS: xcode-select --install), or load the "
                          "model with dense weights (--weights dense, load_model(..., weights='dense'))")
    if shutil.which("ninja") is None:
        raise ConfigError("the quantized GGUF kernels are compiled with ninja, which is not installed: "
                          "pip install ninja, or use --weights dense")
    build = _build_roots()[0] / name
    with _build_lock:
        build.mkdir(parents=True, exist_ok=True)
        log.warning("compiling adaspec's quantized kernels once for this machine (~1 min on 2 cores) "
                    "into %s", build)
        t0 = time.perf_counter()
        _compile(name, build, [*BASE_FLAGS, *openmp_flags(), *arch_flags(arch)], cxx)
        module = _import_built(name, build / f"{name}.so")
        log.warning("compiled the quantized kernels in %.0f s (%s)", time.perf_counter() - t0, module.isa())
    return module


def kernel_isa() -> str:
    """The vector code the compiled kernel runs here: ``avx512``, ``avx2`` or ``generic``."""
    return str(extension().isa())


# -- types -------------------------------------------------------------------------------------------
def type_id(name: str) -> int:
    from gguf import GGMLQuantizationType

    return int(GGMLQuantizationType[name])


def type_name(qtype: int) -> str:
    from gguf import GGMLQuantizationType

    try:
        return GGMLQuantizationType(int(qtype)).name
    except ValueError:
        return f"type {qtype}"


def check_type(qtype: int, what: str) -> None:
    """A clear error for a tensor type the kernels do not compute."""
    name = type_name(qtype)
    if name not in SUPPORTED_TYPES:
        raise ModelLoadError(f"{what} is stored as {name}, which adaspec's quantized kernels do not compute "
                             f"(they take {', '.join(SUPPORTED_TYPES)}): load the model with --weights dense")


def row_bytes(qtype: int, in_features: int) -> int:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    elems, size = GGML_QUANT_SIZES[GGMLQuantizationType(int(qtype))]
    if in_features % elems or in_features % 32:
        raise ModelLoadError(f"a {type_name(qtype)} row of {in_features} weights is not whole 32-weight blocks "
                             f"of {elems}: load the model with --weights dense")
    return in_features // elems * size


# -- prefill mode -------------------------------------------------------------------------------------
_prefill = threading.local()


@contextlib.contextmanager
def prefill_scope() -> Iterator[None]:
    """Forwards inside this block (on this thread) are a prompt's prefill: from
    ``PREFILL_MIN_ROWS`` rows on, each layer may run as a dense GEMM (``PREFILL_GEMM``)."""
    before = getattr(_prefill, "on", False)
    _prefill.on = True
    try:
        yield
    finally:
        _prefill.on = before


def in_prefill() -> bool:
    """Whether a prefill takes the dense path now: inside ``prefill_scope`` with ``PREFILL_GEMM``
    ``"gemm"``."""
    return PREFILL_GEMM == "gemm" and bool(getattr(_prefill, "on", False))


# -- layers -----------------------------------------------------------------------------------------
class QuantLinear(nn.Module):
    """``y = x W^T + b`` with ``W`` in a GGUF tensor's blocks (``blocks``: uint8 ``[out, row_bytes]``,
    one row of blocks per output). Float32 CPU inputs without autograd run the kernel; anything
    else (a gradient through ``x``) runs ``F.linear`` on the dequantized weight, the same values.
    ``weight`` is that dequantized weight, made on each access (drafters that copy or slice the
    target's output matrix read it once)."""

    def __init__(self, blocks: torch.Tensor, qtype: int, in_features: int, bias: torch.Tensor | None = None,
                 int8: bool = False):
        super().__init__()
        self.in_features, self.out_features, self.qtype = int(in_features), int(blocks.shape[0]), int(qtype)
        #: 8-bit activations and integer dot products (``weights="gguf-q8"``) for the types that have them
        self.int8 = bool(int8)
        self.register_buffer("blocks", blocks.contiguous(), persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().float().contiguous(), requires_grad=False)
        self._mats = _matrices([self])

    @property
    def weight(self) -> torch.Tensor:
        return dequantize(self.blocks, self.qtype, self.in_features)

    def __getstate__(self) -> dict[str, Any]:
        """Copies and pickles leave the compiled kernel's handle out; the copy makes its own."""
        state = self.__dict__.copy()
        state.pop("_mats", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._mats = _matrices([self])

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, type={type_name(self.qtype)}, "
                f"bias={self.bias is not None}, int8={self.int8}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // max(1, self.in_features)
        if (x.dtype != torch.float32 or x.device.type != "cpu"
                or (torch.is_grad_enabled() and x.requires_grad)):
            return F.linear(x, self.weight.to(x.device, x.dtype), self.bias)
        if rows >= PREFILL_MIN_ROWS and in_prefill():
            return F.linear(x, self.weight, self.bias)
        return self._mats.forward(x)[0]


class QuantEmbedding(nn.Module):
    """A token embedding in a GGUF tensor's blocks: a lookup dequantizes the rows it reads (the
    same values as ``dequantize``). ``weight``: the whole table, dequantized on each access."""

    def __init__(self, blocks: torch.Tensor, qtype: int, embedding_dim: int, padding_idx: int | None = None):
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.qtype = int(blocks.shape[0]), int(embedding_dim), int(qtype)
        self.padding_idx = padding_idx
        self.register_buffer("blocks", blocks.contiguous(), persistent=False)

    @property
    def weight(self) -> torch.Tensor:
        return dequantize(self.blocks, self.qtype, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, type={type_name(self.qtype)}"

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1).cpu()
        out = dequantize(self.blocks, self.qtype, self.embedding_dim, flat)
        return out.reshape(*ids.shape, self.embedding_dim).to(ids.device)


def dequantize(blocks: torch.Tensor, qtype: int, in_features: int, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The float32 weights of a block tensor ``[N, row_bytes]`` (``rows``: only these), computed
    as the gguf package's dequantizer computes them."""
    return extension().dequantize(blocks, int(qtype), int(in_features), rows)


# -- attention -----------------------------------------------------------------------------------------
#: the attention implementation ``use_fixed_order_attention`` registers with transformers
FIXED_ORDER_ATTENTION = "adaspec_fixed_order"


def fixed_order_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                          is_causal: bool | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention interface, computed by the kernel's fixed-order attention
    (``csrc/quant.cpp``: each query row's scores, softmax and weighted sum in an order that does
    not depend on how many rows or which masked keys come with it), so a verify block's rows equal
    one-token forwards bit for bit. Grouped-query heads read their shared keys in place. A prompt's
    prefill (``prefill_scope``) and what the kernel does not cover (dropout, soft-capping,
    position biases, sliding windows) take transformers' SDPA attention."""
    from .kernels import sdpa_gqa_attention

    if ((in_prefill() and query.shape[0] * query.shape[2] >= PREFILL_MIN_ROWS) or dropout
            or kwargs.get("softcap") is not None or kwargs.get("position_bias") is not None
            or kwargs.get("sliding_window") is not None or query.dtype != torch.float32
            or query.device.type != "cpu"):
        return sdpa_gqa_attention(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  is_causal=is_causal, **kwargs)
    mask = attention_mask
    if mask is not None:
        mask = mask[..., : key.shape[-2]]
        if mask.dtype == torch.bool:
            mask = torch.zeros(mask.shape, dtype=torch.float32).masked_fill_(~mask, float("-inf"))
    scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
    return extension().attention(query, key, value, mask, scale), None


def use_fixed_order_attention(model: nn.Module) -> None:
    """Switch ``model`` (a quantized target) to ``FIXED_ORDER_ATTENTION``, registered with
    transformers' attention and mask interfaces (the mask is SDPA's)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(FIXED_ORDER_ATTENTION, fixed_order_attention)
    AttentionMaskInterface.register(FIXED_ORDER_ATTENTION, sdpa_mask)
    model.set_attn_implementation(FIXED_ORDER_ATTENTION)


# -- a KV cache written in place ------------------------------------------------------------------------
#: positions a ``SpareCapacityLayer`` grows by at least (and by half its length beyond that)
KV_GROWTH = 256


def spare_capacity_layer_class() -> type:
    """``SpareCapacityLayer``: transformers' ``DynamicLayer`` whose keys and values are views of
    buffers with room to grow, so that a forward writes its new entries in place instead of
    concatenating the whole cache (a copy of every layer's keys and values per forward: at 512
    cached tokens SmolLM2 copies 24 MB a step, a sizeable share of a quantized step). Rolling
    back (``crop``) shortens the views; the next forward overwrites what was dropped. Whoever
    replaces ``keys`` / ``values`` with tensors of their own (the batch engine merging rows) is
    followed: the next update copies them into a new buffer."""
    from transformers.cache_utils import DynamicLayer

    class SpareCapacityLayer(DynamicLayer):
        _kbuf: torch.Tensor | None = None
        _vbuf: torch.Tensor | None = None

        def _in_buffer(self, n: int) -> bool:
            kb, keys = self._kbuf, self.keys
            if kb is None or keys is None or keys.dim() != 4:
                return False
            length = keys.shape[-2]
            return (keys.data_ptr() == kb.data_ptr() and keys.stride() == kb.stride()
                    and keys.shape[:2] == kb.shape[:2] and length + n <= kb.shape[-2]
                    and self.values.data_ptr() == self._vbuf.data_ptr() and self.values.stride() == self._vbuf.stride())

        def reserve(self, like: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor, int]:
            """(key buffer, value buffer, cached length) with room for ``n`` more entries shaped like
            ``like`` ([B, heads, *, D]); ``advance(n)`` then makes them part of the cache."""
            if not self.is_initialized:
                self.lazy_initialization(like, like)
            length = self.keys.shape[-2] if self.keys is not None and self.keys.dim() == 4 else 0
            if not self._in_buffer(n):
                b, h, _, d = like.shape
                cap = length + n + max(KV_GROWTH, (length + n) // 2)
                kb, vb = like.new_empty(b, h, cap, d), like.new_empty(b, h, cap, d)
                if length:
                    kb[..., :length, :].copy_(self.keys)
                    vb[..., :length, :].copy_(self.values)
                self._kbuf, self._vbuf = kb, vb
            return self._kbuf, self._vbuf, length

        def advance(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
            length = (self.keys.shape[-2] if self.keys is not None and self.keys.dim() == 4 else 0) + n
            self.keys, self.values = self._kbuf[..., :length, :], self._vbuf[..., :length, :]
            return self.keys, self.values

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
                   **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
            n = key_states.shape[-2]
            kb, vb, length = self.reserve(key_states, n)
            kb[..., length:length + n, :].copy_(key_states)
            vb[..., length:length + n, :].copy_(value_states)
            return self.advance(n)

        def hold(self, kbuf: torch.Tensor, vbuf: torch.Tensor, length: int) -> None:
            """Take buffers ``[B, heads, capacity, D]`` whose first ``length`` positions are the
            cache (the batch engine's merged rows): the next forwards write into their room."""
            if not self.is_initialized:
                self.lazy_initialization(kbuf, vbuf)
            self._kbuf, self._vbuf = kbuf, vbuf
            self.keys, self.values = kbuf[..., :length, :], vbuf[..., :length, :]

        def lend(self, keys: torch.Tensor, values: torch.Tensor) -> None:
            """Read ``keys`` / ``values`` (another owner's, e.g. the prefix cache's) without a copy:
            they are never written, since the next update copies them into a buffer of its own."""
            if not self.is_initialized:
                self.lazy_initialization(keys, values)
            self._kbuf = self._vbuf = None
            self.keys, self.values = keys, values

        def batch_select_indices(self, indices: torch.Tensor) -> None:
            """Keep the rows ``indices`` (increasing), moved down within the buffers: a copy of
            the rows behind the first dropped one, and the room kept (transformers' own selects
            into new tensors, which the next forward copies again)."""
            keep = indices.tolist()
            if not self._in_buffer(0) or keep != sorted(keep):
                self._kbuf = self._vbuf = None
                super().batch_select_indices(indices)
                return
            length = self.keys.shape[-2]
            for i, j in enumerate(keep):  # j >= i: a source row is read before it is overwritten
                if i != j:
                    self._kbuf[i].copy_(self._kbuf[j])
                    self._vbuf[i].copy_(self._vbuf[j])
            self._kbuf, self._vbuf = self._kbuf[:len(keep)], self._vbuf[:len(keep)]
            self.keys, self.values = self._kbuf[..., :length, :], self._vbuf[..., :length, :]

        def reset(self) -> None:
            self._kbuf = self._vbuf = None
            super().reset()

    return SpareCapacityLayer


_layer_class: type | None = None


def spare_capacity_cache(config: Any) -> Any:
    """A ``DynamicCache`` for ``config`` whose full-attention layers are ``SpareCapacityLayer``s
    (sliding-window layers stay transformers' own)."""
    global _layer_class
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    if _layer_class is None:
        _layer_class = spare_capacity_layer_class()
    plan = _cache_plans.get(id(config))
    if plan is None or plan[0] is not config:  # reading the config's layer types costs ~1 ms a cache
        template = DynamicCache(config=config)
        plan = (config, [None if type(layer) is DynamicLayer else layer for layer in template.layers])
        _cache_plans[id(config)] = plan
    cache = DynamicCache()
    cache.layer_class_to_replicate = None  # as DynamicCache(config=...) leaves it: every layer is there
    cache.layers = [_layer_class() if layer is None else copy.deepcopy(layer) for layer in plan[1]]
    return cache


#: per model config (by id, the config kept to check it): its cache's layers, None for a full-attention one
_cache_plans: dict[int, tuple[Any, list[Any]]] = {}


def is_spare_capacity(layer: Any) -> bool:
    """Whether ``layer`` is a ``SpareCapacityLayer`` (``hold``, ``lend``)."""
    return _layer_class is not None and type(layer) is _layer_class


# -- fused decoder steps ---------------------------------------------------------------------------------
#: attention classes whose forward ``fuse_layers`` replaces (projections, rotary, cache, attention)
FUSED_ATTENTION = ("LlamaAttention", "MistralAttention", "Qwen2Attention")
_fused_classes: dict[type, type] = {}


def _subclass(base: type, forward: Any, prefix: str) -> type:
    if base not in _fused_classes:
        _fused_classes[base] = type(f"{prefix}{base.__name__}", (base,), {"forward": forward, "__module__": __name__,
                                                                           "__doc__": forward.__doc__})
    return _fused_classes[base]


def _fused_attention_forward(self: Any, hidden_states: torch.Tensor, position_embeddings: Any = None,
                             attention_mask: torch.Tensor | None = None, cache: Any = None,
                             past_key_values: Any = None, **kwargs: Any) -> tuple[torch.Tensor, Any]:
    """The attention of a Llama / Qwen2 / Mistral decoder layer with its three projections in one
    kernel call and the rotary embedding in one step (the same values as transformers' forward:
    the rotary products and sums are rounded as there)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    cache = cache if cache is not None else past_key_values
    b, t = hidden_states.shape[:2]
    d = self.head_dim
    if hidden_states.dtype != torch.float32 or (torch.is_grad_enabled() and hidden_states.requires_grad):
        q, k, v = self.q_proj(hidden_states), self.k_proj(hidden_states), self.v_proj(hidden_states)
    else:
        q, k, v = self._adaspec_qkv.forward(hidden_states)
    cos, sin = position_embeddings
    ext = extension()
    q, k = ext.rope(q, cos, sin, d), ext.rope(k, cos, sin, d)
    v = v.view(b, t, -1, d).transpose(1, 2)
    if cache is not None:
        k, v = cache.update(k, v, self.layer_idx, kwargs=kwargs)
    impl = self.config._attn_implementation
    attend = ALL_ATTENTION_FUNCTIONS.get_interface(impl, _eager_attention(self))
    extra = {"sliding_window": self.sliding_window} if hasattr(self, "sliding_window") else {}
    out, weights = attend(self, q, k, v, attention_mask, dropout=0.0 if not self.training else self.attention_dropout,
                          scaling=self.scaling, **extra, **kwargs)
    return self.o_proj(out.reshape(b, t, -1)), weights


def _eager_attention(module: nn.Module) -> Any:
    return getattr(sys.modules[type(module).__mro__[1].__module__], "eager_attention_forward", None)


def _fused_mlp_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    """``down(silu(gate(x)) * up(x))`` with gate and up in one kernel call."""
    if x.dtype != torch.float32 or (torch.is_grad_enabled() and x.requires_grad):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
    gate, up = self._adaspec_gate_up.forward(x)
    return self.down_proj(F.silu(gate, inplace=True).mul_(up))


def _rmsnorm_forward(self: Any, hidden_states: torch.Tensor) -> torch.Tensor:
    """RMSNorm in one kernel step (the mean of squares in a fixed order)."""
    if hidden_states.dtype != torch.float32 or (torch.is_grad_enabled() and hidden_states.requires_grad):
        return type(self).__mro__[1].forward(self, hidden_states)
    return extension().rmsnorm(hidden_states, self.weight, float(self.variance_epsilon))


#: decoder layer classes ``fuse_layers`` runs as one kernel call (``DecoderLayer`` in csrc/quant.cpp)
FUSED_DECODER = ("LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer")


def _fused_decoder_forward(self: Any, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                           position_ids: torch.Tensor | None = None, cache: Any = None, past_key_values: Any = None,
                           use_cache: bool | None = False, position_embeddings: Any = None,
                           **kwargs: Any) -> torch.Tensor:
    """A decoder layer in one kernel call: the same steps and kernels as its fused modules one by
    one (norm, q/k/v, rotary, attention, o, norm, gate/up, SiLU, down, residuals), the new keys and
    values written into the cache's buffers (``SpareCapacityLayer.reserve``). Prefill
    (``prefill_scope``), gradients, other attention implementations and other caches take the
    modules one by one."""
    cache = cache if cache is not None else past_key_values
    attn = self.self_attn
    layer = cache.layers[attn.layer_idx] if cache is not None and attn.layer_idx < len(cache.layers) else None
    b, t = hidden_states.shape[:2]
    if (layer is None or not hasattr(layer, "reserve") or (in_prefill() and b * t >= PREFILL_MIN_ROWS)
            or hidden_states.dtype != torch.float32
            or (torch.is_grad_enabled() and hidden_states.requires_grad)
            or attn.config._attn_implementation != FIXED_ORDER_ATTENTION
            or getattr(attn, "sliding_window", None) is not None or kwargs.get("output_attentions")):
        return type(self).__mro__[1].forward(self, hidden_states, attention_mask=attention_mask,
                                             position_ids=position_ids, cache=cache, use_cache=use_cache,
                                             position_embeddings=position_embeddings, **kwargs)
    mask = attention_mask
    if mask is not None and mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=torch.float32).masked_fill_(~mask, float("-inf"))
    like = hidden_states.new_empty(b, self._adaspec_kv_heads, 0, attn.head_dim)
    kbuf, vbuf, length = layer.reserve(like, t)
    if mask is not None:
        mask = mask[..., : length + t]
    cos, sin = position_embeddings
    out = self._adaspec_layer.forward(hidden_states, mask, cos, sin, kbuf, vbuf, length)
    layer.advance(t)
    return out


#: causal LM classes whose forward is embed -> decoder layers -> norm -> head, nothing else
#: (``FusedStack`` runs them without transformers' wrappers)
FUSED_STACK = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


class FusedStack:
    """A quantized causal LM whose every decoder layer is one kernel call (``fuse_layers``), run
    as gpt-fast runs a model: the embedding, the rotary table, each layer's ``DecoderLayer``
    call on the cache's own buffers, the final norm and the head on the kept rows, without
    transformers' model wrappers (its mask building, output records and per-module hooks: 1.0-1.3
    ms of a 7 ms SmolLM2 decode step on a 2-core EPYC).

    The same kernels in the same order as ``_fused_decoder_forward`` under transformers' forward,
    so the same bits (tested): a block's rows see their earlier keys through the attention
    kernel's causal limit, which equals transformers' causal mask bit for bit (masked keys add
    nothing in the kernel's fixed order), and the norm and head are row-wise, so norming only the
    kept rows changes nothing. ``__call__`` returns None where it does not apply (a prefill
    chunk, a cache that is not a ``spare_capacity_cache``): the caller then runs transformers'
    forward."""

    def __init__(self, model: nn.Module):
        inner = model.model
        self.embed, self.rotary, self.norm = inner.embed_tokens, inner.rotary_emb, inner.norm
        self.head = model.get_output_embeddings()
        self.layers = [(layer._adaspec_layer, layer._adaspec_kv_heads, layer.self_attn.head_dim)
                       for layer in inner.layers[: model.config.num_hidden_layers]]

    @classmethod
    def of(cls, model: nn.Module) -> FusedStack | None:
        """The stack of ``model``, or None where some part is not fused (then transformers runs it)."""
        inner = getattr(model, "model", None)
        layers = getattr(inner, "layers", None)
        if (type(model).__name__ not in FUSED_STACK or not layers
                or not all(hasattr(layer, "_adaspec_layer") for layer in layers)  # fuse_layers fused them whole
                or any(getattr(layer.self_attn, "sliding_window", None) is not None for layer in layers)
                or type(getattr(inner, "norm", None)).forward is not _rmsnorm_forward
                or not isinstance(getattr(inner, "embed_tokens", None), QuantEmbedding)
                or model.config._attn_implementation != FIXED_ORDER_ATTENTION):
            return None
        return cls(model)

    def __call__(self, cache: Any, ids: Sequence[int], keep: int = 1) -> torch.Tensor | None:
        """Logits ``[keep, vocab]`` of the last ``keep`` of ``ids`` (0: all) after ``cache``'s
        tokens, the new keys and values written into it; None where the stack does not apply."""
        t = len(ids)
        kv = getattr(cache, "layers", None)
        if (t == 0 or (in_prefill() and t >= PREFILL_MIN_ROWS) or kv is None or len(kv) < len(self.layers)
                or not hasattr(kv[0], "reserve")):
            return None
        x = self.embed(torch.tensor([list(ids)]))
        past = int(cache.get_seq_length())
        cos, sin = self.rotary(x, torch.arange(past, past + t).unsqueeze(0))
        likes: dict[tuple[int, int], torch.Tensor] = {}  # the shape a layer's KV takes, made once a call
        for (layer, kv_heads, head_dim), state in zip(self.layers, kv):
            like = likes.get((kv_heads, head_dim))
            if like is None:
                like = likes[(kv_heads, head_dim)] = x.new_empty(1, kv_heads, 0, head_dim)
            kbuf, vbuf, length = state.reserve(like, t)
            x = layer.forward(x, None, cos, sin, kbuf, vbuf, length)
            state.advance(t)
        if 0 < keep < t:
            x = x[:, t - keep:]
        return self.head(self.norm(x))[0]


def _matrices(layers: list[QuantLinear]) -> Any:
    """One kernel object computing ``layers`` (sharing their input) in one call."""
    return extension().QuantMatrices([m.blocks for m in layers], [m.qtype for m in layers], [m.bias for m in layers],
                                     layers[0].in_features, layers[0].int8)


def fuse_layers(model: nn.Module) -> int:
    """Switch a quantized model's attention (Llama, Qwen2, Mistral: ``FUSED_ATTENTION``), SiLU
    MLPs and RMSNorms to forwards with fewer steps (the class only, as ``kernels`` does for linear
    layers; parameters and state dict untouched): q/k/v in one kernel call and the rotary
    embedding in one step, gate and up in one call, each norm one step. Returns how many modules
    were switched."""
    n = 0
    for module in model.modules():
        name = type(module).__name__
        proj = [getattr(module, p, None) for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
        if name in FUSED_ATTENTION and all(isinstance(p, QuantLinear) for p in proj):
            module._adaspec_qkv = _matrices(proj[:3])
            module.__class__ = _subclass(type(module), _fused_attention_forward, "AdaspecFused")
            n += 1
            continue
        mlp = [getattr(module, p, None) for p in ("gate_proj", "up_proj", "down_proj")]
        if (all(isinstance(p, QuantLinear) for p in mlp)
                and type(getattr(module, "act_fn", None)).__name__ in ("SiLU", "SiLUActivation")
                and mlp[0].in_features == mlp[1].in_features):
            module._adaspec_gate_up = _matrices(mlp[:2])
            module.__class__ = _subclass(type(module), _fused_mlp_forward, "AdaspecFused")
            n += 1
            continue
        if (name.endswith("RMSNorm") and isinstance(getattr(module, "weight", None), torch.Tensor)
                and hasattr(module, "variance_epsilon") and type(module).forward is not _rmsnorm_forward):
            module.__class__ = _subclass(type(module), _rmsnorm_forward, "Adaspec")
            n += 1
    for module in model.modules():  # whole layers whose parts were all fused above
        attn, mlp = getattr(module, "self_attn", None), getattr(module, "mlp", None)
        norms = [getattr(module, a, None) for a in ("input_layernorm", "post_attention_layernorm")]
        if (type(module).__name__ in FUSED_DECODER and hasattr(attn, "_adaspec_qkv")
                and hasattr(mlp, "_adaspec_gate_up") and all(type(m).forward is _rmsnorm_forward for m in norms)):
            heads = attn.q_proj.out_features // attn.head_dim
            kv_heads = attn.k_proj.out_features // attn.head_dim
            module._adaspec_kv_heads = kv_heads
            module._adaspec_layer = extension().DecoderLayer(
                attn._adaspec_qkv, _matrices([attn.o_proj]), mlp._adaspec_gate_up, _matrices([mlp.down_proj]),
                norms[0].weight.detach().contiguous(), float(norms[0].variance_epsilon),
                norms[1].weight.detach().contiguous(), float(norms[1].variance_epsilon),
                heads, kv_heads, attn.head_dim, float(attn.scaling))
            module.__class__ = _subclass(type(module), _fused_decoder_forward, "AdaspecFused")
            n += 1
    return n


# -- converting a loaded model ------------------------------------------------------------------------
@dataclass
class QuantizedTensors:
    """What ``quantize_model`` replaced (module name -> GGML type name) and in which mode."""

    types: dict[str, str]
    mode: str = "gguf"

    def summary(self) -> str:
        """Counts per type, e.g. ``Q4_1x210,Q8_0x1``."""
        counts: dict[str, int] = {}
        for t in self.types.values():
            counts[t] = counts.get(t, 0) + 1
        return ",".join(f"{t}x{n}" for t, n in sorted(counts.items()))


def _tensor_processor(model: nn.Module, arch: str) -> Any:
    """transformers' GGUF tensor processor for ``arch`` (the same row reordering it applied when it
    dequantized the file, e.g. Llama's q/k head permutation)."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    return TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=model.config.to_dict())


def _row_order(processor: Any, name: str, rows: int) -> Any:
    """The permutation of a tensor's rows transformers applied on load (identity for most)."""
    import numpy as np

    ids = np.arange(rows, dtype=np.int64).reshape(rows, 1)
    out = processor.process(weights=ids, name=name)
    return np.asarray(out.weights).reshape(rows)


def _gguf_blocks(tensor: Any) -> tuple[torch.Tensor, int, int]:
    """(blocks [rows, row_bytes] uint8, GGML type id, row width) of a 2-D GGUF tensor."""
    import numpy as np

    qtype = int(tensor.tensor_type)
    width, rows = int(tensor.shape[0]), int(tensor.shape[1])
    raw = np.ascontiguousarray(np.asarray(tensor.data)).view(np.uint8).reshape(rows, -1)
    return torch.from_numpy(raw.copy()), qtype, width


def _set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, module)


def quantize_model(model: nn.Module, gguf_path: Path, check_rows: int = 4, int8: bool = False) -> QuantizedTensors:
    """Replace ``model``'s linear layers and token embedding (a transformers model loaded from the
    GGUF file ``gguf_path``) with ``QuantLinear`` / ``QuantEmbedding`` over the file's blocks, in
    place. Each replaced tensor's dequantized rows (``check_rows`` of them, spread over the
    tensor) must equal the loaded weights bit for bit: a wrong name map or row order is an error,
    never a different model. Linear layers with no tensor in the file (none in the models
    adaspec ships) keep their float32 weights, run by the same kernel (type F32)."""
    import numpy as np
    from gguf import GGUFReader
    from transformers.modeling_gguf_pytorch_utils import get_gguf_hf_weights_map

    reader = GGUFReader(str(gguf_path))
    arch_field = reader.fields.get("general.architecture")
    arch = bytes(arch_field.parts[arch_field.data[0]]).decode() if arch_field is not None else ""
    processor = _tensor_processor(model, arch)
    to_hf = get_gguf_hf_weights_map(model, processor)
    tensors = {t.name: t for t in reader.tensors}
    by_param: dict[str, Any] = {hf: tensors[g] for g, hf in to_hf.items() if g in tensors}

    embed = model.get_input_embeddings()
    head = model.get_output_embeddings()
    names = {id(m): n for n, m in model.named_modules()}
    embed_name = names.get(id(embed))
    head_name = names.get(id(head))
    types: dict[str, str] = {}
    shared: dict[str, tuple[torch.Tensor, int, int]] = {}

    def blocks_for(param_name: str, weight: torch.Tensor) -> tuple[torch.Tensor, int, int]:
        if param_name in shared:
            return shared[param_name]
        tensor = by_param[param_name]
        check_type(int(tensor.tensor_type), f"tensor {tensor.name} of {gguf_path.name}")
        blocks, qtype, width = _gguf_blocks(tensor)
        if (blocks.shape[0], width) != tuple(weight.shape):
            raise ModelLoadError(f"tensor {tensor.name} of {gguf_path.name} is {blocks.shape[0]}x{width}, and "
                                 f"{param_name} is {tuple(weight.shape)}: load the model with --weights dense")
        row_bytes(qtype, width)
        order = _row_order(processor, tensor.name, blocks.shape[0])
        if not np.array_equal(order, np.arange(len(order))):
            blocks = blocks[torch.from_numpy(order)].contiguous()
        pick = torch.linspace(0, blocks.shape[0] - 1, steps=min(check_rows, blocks.shape[0])).long()
        got = dequantize(blocks, qtype, width, pick)
        if not torch.equal(got, weight.detach()[pick].float().cpu()):
            raise ModelLoadError(f"tensor {tensor.name} of {gguf_path.name} does not dequantize to the weights "
                                 f"transformers loaded for {param_name} (a name map or row order adaspec does "
                                 "not know for this architecture): load the model with --weights dense")
        shared[param_name] = (blocks, qtype, width)
        return shared[param_name]

    tied = head is not None and embed is not None and head.weight is embed.weight
    embed_param = f"{embed_name}.weight" if embed_name is not None else None
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear):
            continue
        param = f"{name}.weight"
        if name == head_name and param not in by_param and tied and embed_param in by_param:
            param = embed_param
        bias = module.bias.detach() if module.bias is not None else None
        if param in by_param:
            blocks, qtype, width = blocks_for(param, module.weight)
        else:  # not in the file: the loaded float32 weights, as an F32 "block" tensor
            w = module.weight.detach().float().contiguous()
            blocks, qtype, width = w.view(torch.uint8).reshape(w.shape[0], -1).clone(), type_id("F32"), w.shape[1]
        _set_module(model, name, QuantLinear(blocks, qtype, width, bias, int8=int8))
        types[name] = type_name(qtype)
    if embed_param is not None and embed_param in by_param and isinstance(embed, nn.Embedding):
        blocks, qtype, width = blocks_for(embed_param, embed.weight)
        _set_module(model, embed_name, QuantEmbedding(blocks, qtype, width, embed.padding_idx))
        types[embed_name] = type_name(qtype)
    model._adaspec_quantized = QuantizedTensors(types, "gguf-q8" if int8 else "gguf")
    return model._adaspec_quantized


def quantized_of(model: Any) -> QuantizedTensors | None:
    """What ``quantize_model`` replaced in ``model`` (None: a dense model)."""
    return getattr(model, "_adaspec_quantized", None)


def weights_mode(model: Any) -> str:
    """The target identity's weight format: ``"dense"``, or ``"MODE[TYPES]/ISA"`` for a quantized
    model, e.g. ``gguf-q8[Q4_1x210,Q8_0x2]/avx512`` (the cost grids are measured and cached apart)."""
    q = quantized_of(model)
    if q is None:
        return "dense"
    return f"{q.mode}[{q.summary()}]/{kernel_isa()}"


def check_weights(weights: str, *, gguf: bool, device: torch.device, dtype: torch.dtype | None,
                  linear: str, backend: str) -> None:
    """``weights`` is one of ``WEIGHT_MODES`` and, for ``"gguf"``, can run: a GGUF model on the
    transformers backend on a CPU, float32, with the quantized kernels instead of ``--linear``'s."""
    if weights not in WEIGHT_MODES:
        raise ConfigError(f"weights {weights!r} (--weights) is not one of {', '.join(WEIGHT_MODES)}: 'auto' computes "
                          "a GGUF model on a CPU from its quantized blocks and other models densely, 'gguf' always "
                          "from the blocks with float32 activations, 'gguf-q8' with 8-bit activations (as llama.cpp), "
                          "'dense' de-quantizes the file to float32 (adaspec.quant)")
    if weights not in GGUF_MODES:
        if weights != "auto" and backend != "transformers":
            raise ConfigError(f"weights {weights!r} chooses the transformers backend's weights, and the {backend} "
                              "backend computes with its own: drop --weights")
        return
    if backend != "transformers":
        raise ConfigError(f"--weights {weights} is the transformers backend's quantized target; the {backend} "
                          "backend reads the GGUF file itself: drop --weights")
    if not gguf:
        raise ConfigError(f"--weights {weights} computes from a GGUF file's quantized blocks, and this model is not "
                          "a .gguf file: use --weights dense (or auto)")
    if device.type != "cpu":
        raise ConfigError(f"--weights {weights} runs adaspec's CPU kernels, and the device is {device}: use "
                          "--device cpu, or --weights dense on this device")
    if dtype is not None and dtype != torch.float32:
        raise ConfigError(f"--weights {weights} computes float32 activations and outputs on the file's blocks, and "
                          f"--dtype is {str(dtype).replace('torch.', '')}: drop --dtype, or use --weights dense")
    if linear != "auto":
        raise ConfigError(f"--linear {linear} chooses the kernels of dense float32 weights, and --weights {weights} "
                          "runs the quantized kernels: drop --linear, or use --weights dense")


def auto_weights(*, gguf: bool, device: torch.device, dtype: torch.dtype | None, linear: str, backend: str) -> str:
    """What ``weights="auto"`` loads for a GGUF model on the transformers backend on a CPU, float32,
    ``--linear auto``, where the kernel compiles: ``"gguf-q8"`` where its integer dot products run
    AVX-512 VNNI, ``"gguf"`` elsewhere (docs/kernels.md: both faster than the dense model at every
    row count measured); ``"dense"`` otherwise (a failed compile is logged, not raised: the dense
    model still works)."""
    if not (gguf and backend == "transformers" and device.type == "cpu" and linear == "auto"
            and (dtype is None or dtype == torch.float32)):
        return "dense"
    try:
        ext = extension()
    except ConfigError as exc:
        log.warning("computing the GGUF model densely: %s", exc)
        return "dense"
    return "gguf-q8" if ext.has_vnni() else "gguf"

