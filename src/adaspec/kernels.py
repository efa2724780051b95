"""Linear layers and attention for CPU decoding: the same products, through faster kernels than
PyTorch's and transformers' defaults.

Decoding and verification multiply a few rows (1 token, or a draft block of 2-16) by large
weight matrices. On x86 CPUs with MKL, PyTorch's ``F.linear(x, W)`` takes a slow path for
these shapes: one row goes through a matrix-vector kernel and 2-4 rows through a GEMM that is
slower still. Two faster paths, each the same product up to float rounding:

- the *transposed product* ``(W @ x.T).T`` streams the weights through another MKL kernel at
  about twice the bandwidth (no extra memory): ``SmallBatchLinear``, ``linear="small-batch"``;
- oneDNN's matmul on a copy of the weights *prepacked* once in its blocked layout
  (``torch.ops.mkldnn._reorder_linear_weight``, as torch.compile's CPU freezing does for
  dynamic shapes) is faster still from 3 rows to hundreds, at the price of a second copy of the weights:
  ``PackedLinear``, ``linear="packed"`` (the default on CPU float32), which runs 1-3 rows on
  whichever of the transposed product, the packed matmul and ``F.linear`` a timed forward finds
  fastest for the model on this CPU (``tune_small_rows``: MKL's ``F.linear`` is the slowest for
  one row on some CPUs, the fastest on a Xeon with AMX).

docs/results.md ("Linear kernels") has the measurements. The result is the
same product up to float rounding (the summation order differs), like any change of BLAS
kernel; greedy exactness is judged against the engine's own autoregressive decoding, which
uses the same kernels.

Attention: for a block of several queries with a mask (verification, trees, padded batches),
transformers' SDPA path copies every layer's keys and values once per query-head group
(``repeat_kv``) because masked grouped-query attention falls back to a slow kernel on CUDA. On
the CPU, PyTorch's flash kernel takes the mask and the grouping together (``enable_gqa``):
``GQA_ATTENTION``, installed on CPU models by ``load_model`` (``use_gqa_attention``), saves
those copies (docs/results.md, "Grouped attention").
"""

from __future__ import annotations

import contextlib
import functools
import os
import platform
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

#: the largest row count that takes the transposed product; from 9 rows on, the stock call
#: is as fast or faster (docs/kernels.md)
SMALL_BATCH_MAX = 8
#: ``PackedLinear``: up to this many rows take the transposed product, from the next one on the
#: prepacked oneDNN matmul (2 rows: 21 against 28 ms; 3 rows: 29 against 23 ms; docs/kernels.md)
PACKED_MIN_ROWS = 3
#: the batch-size hint the weights are packed for (oneDNN picks its blocking from it; one pack
#: serves every row count: 16 was as fast as or faster than 1, 8 and 64 from 3 rows to 64)
PACK_ROWS_HINT = 16


def small_batch_pays(device: torch.device, dtype: torch.dtype) -> bool:
    """``load_model(linear="auto")``: the kernel where it was measured to pay, float32 on a CPU
    whose BLAS is MKL (docs/kernels.md); elsewhere PyTorch's own kernels."""
    return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkl.is_available()


def packed_pays(device: torch.device, dtype: torch.dtype) -> bool:
    """``load_model(linear="auto")``: prepacked oneDNN weights where the small-batch path pays and
    torch has oneDNN (``torch.backends.mkldnn``)."""
    return small_batch_pays(device, dtype) and torch.backends.mkldnn.is_available()


def auto_linear(device: torch.device, dtype: torch.dtype) -> str:
    """The kernels ``load_model(linear="auto")`` installs: ``"packed"``, ``"small-batch"`` or ``"stock"``."""
    return "packed" if packed_pays(device, dtype) else "small-batch" if small_batch_pays(device, dtype) else "stock"


def _cpu_inference(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """float32 on CPU without autograd: where the faster paths apply (training keeps autograd's)."""
    return (weight.device.type == "cpu" and weight.dtype == torch.float32 and x.dtype == torch.float32
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)))


def small_batch_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``linear`` takes the transposed product: float32 on CPU, no autograd, 1-8 rows."""
    rows = x.numel() // max(1, x.shape[-1])
    return 1 <= rows <= SMALL_BATCH_MAX and _cpu_inference(x, weight)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, as ``(weight @ x.T).T`` for 1-8 float32 rows on CPU.

    One row is padded to two (a copy of itself): the two-row product is the fast one."""
    if not small_batch_applies(x, weight):
        return F.linear(x, weight, bias)
    width = x.shape[-1]
    rows = x.reshape(-1, width)
    n = rows.shape[0]
    if n == 1:
        rows = torch.cat((rows, rows))
    out = torch.mm(weight, rows.t())[:, :n].t().contiguous()
    if bias is not None:
        out += bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


class SmallBatchLinear(nn.Linear):
    """An ``nn.Linear`` whose forward is ``kernels.linear``: same parameters, same state dict."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class PackedLinear(SmallBatchLinear):
    """An ``nn.Linear`` computing float32 rows on a CPU (no autograd) by oneDNN's matmul on
    prepacked weights (``pack``), except 1-3 rows, which take the kernel its ``small_plan`` names
    (``tune_small_rows`` times them per model and machine). The pack is a plain attribute, outside
    the state dict, and is made again when the weight changes (its version counter: an optimizer
    step, ``load_state_dict``) or is replaced; off the CPU or float32 the layer computes
    ``F.linear``."""

    _packed: torch.Tensor | None = None
    #: what the pack was made from: the weight (a weak reference), its data pointer and version
    _packed_from: tuple[Any, int, int] | None = None

    def pack(self) -> torch.Tensor:
        """The weight in oneDNN's layout, made on first use and kept while the weight is the same
        tensor, at the same address, unmodified (``_version``: in-place writes count)."""
        w = self.weight
        src = self._packed_from
        if (self._packed is None or src is None or src[0]() is not w or src[1] != w.data_ptr()
                or src[2] != w._version):
            with torch.no_grad():
                self._packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), PACK_ROWS_HINT)
            self._packed_from = (weakref.ref(w), w.data_ptr(), w._version)
        return self._packed

    def __getstate__(self) -> dict[str, Any]:
        """Copies and pickles leave the pack out (an opaque oneDNN tensor and a weak reference
        cannot be copied); the copy packs its own weight on first use."""
        state = self.__dict__.copy()
        state.pop("_packed", None)
        state.pop("_packed_from", None)
        return state

    #: the kernel for 1, 2 and 3 rows (``SMALL_KINDS``; more rows take the packed matmul):
    #: ``tune_small_rows`` sets it per model, since the fastest differs by weight shape and by
    #: CPU (SmolLM2's one-token step: transposed 34 ms, padded 44 on the first machine measured,
    #: where MKL's ``F.linear`` is slow; on a Xeon with AMX ``F.linear`` 63 ms, transposed 98,
    #: padded 96)
    small_plan: tuple[str, ...] = ("transposed", "transposed", "packed")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        width = x.shape[-1]
        n = x.numel() // max(1, width)
        if n == 0 or not _cpu_inference(x, self.weight):
            return F.linear(x, self.weight, self.bias)
        kind = self.small_plan[n - 1] if n <= len(self.small_plan) else "packed"
        if kind == "stock":
            return F.linear(x, self.weight, self.bias)
        if kind == "transposed":
            return linear(x, self.weight, self.bias)
        rows = x.reshape(n, width)
        if n < PACKED_MIN_ROWS:
            rows = torch.cat((rows, rows.new_zeros(PACKED_MIN_ROWS - n, width)))
        out = torch.ops.mkldnn._linear_pointwise(rows.contiguous(), self.pack(), self.bias, "none", [], "")
        return out[:n].reshape(*x.shape[:-1], self.weight.shape[0])


#: the kernels a ``PackedLinear`` can run 1-3 rows on: the transposed product, the packed matmul
#: (1-2 rows padded with zero rows to ``PACKED_MIN_ROWS``) and PyTorch's own ``F.linear``
SMALL_KINDS = ("transposed", "packed", "stock")


def machine_identity(device: torch.device) -> str:
    """The hardware a measurement ran on, for the keys of the cost grids and kernel plans
    cached on disk: the GPU's name on CUDA, else the CPU's model name, vector ISA and core
    count. A cache directory shared between
    machines (a cluster's home directory, a VM moved to another host) must not price one
    CPU's forwards with another's grid (a cache directory shared between machines)."""
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    name = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as fh:
            name = next((line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")), name)
    return f"cpu:{name}|{torch.backends.cpu.get_cpu_capability()}|cores={os.cpu_count()}"


def tune_small_rows(model: nn.Module, reps: int = 5) -> tuple[str, ...] | None:
    """Time forwards of 1, 2 and 3 tokens of ``model`` with its ``PackedLinear`` layers running
    that many rows on each of ``SMALL_KINDS``, interleaved (``reps`` each after a warm-up), and
    keep the fastest per row count (``PackedLinear.small_plan``). Which one wins depends on the
    weights' shapes and on the CPU's BLAS (docs/kernels.md), hence a measurement per model. Returns the plan, None when the model has no packed layer on
    a CPU. ``load_model`` times once per model shape and machine (``models.small_rows_plan``
    caches the plan), so ``reps`` can be 5: where one row's kernels are near a tie, fewer
    timings a kernel flip the pick from one process to the next."""
    layers = tunable_layers(model)
    if not layers:
        return None
    plan = list(PackedLinear.small_plan)
    best = {(n, kind): float("inf") for n in range(1, len(plan) + 1) for kind in SMALL_KINDS}
    with torch.inference_mode():
        for rep in range(reps + 1):
            for n, kind in best:
                ids = torch.ones((1, n), dtype=torch.long)
                plan[n - 1] = kind
                for m in layers:
                    m.small_plan = tuple(plan)
                t0 = time.perf_counter()
                model(input_ids=ids, use_cache=False)
                if rep:  # the first round warms every path up
                    best[(n, kind)] = min(best[(n, kind)], time.perf_counter() - t0)
    chosen = tuple(min(SMALL_KINDS, key=lambda kind: best[(n, kind)]) for n in range(1, len(plan) + 1))
    set_small_plan(model, chosen)
    return chosen


def tunable_layers(model: nn.Module) -> list[PackedLinear]:
    """``model``'s ``PackedLinear`` layers that ``tune_small_rows`` times: float32, on a CPU."""
    return [m for m in model.modules() if isinstance(m, PackedLinear)
            and m.weight.device.type == "cpu" and m.weight.dtype == torch.float32]


def set_small_plan(module: nn.Module, plan: tuple[str, ...]) -> None:
    """Run 1, 2 and 3 rows of ``module``'s packed layers on ``plan``'s kernels."""
    for m in module.modules():
        if isinstance(m, PackedLinear):
            m.small_plan = tuple(plan)


def small_plan_of(model: Any) -> tuple[str, ...] | None:
    """The ``small_plan`` of ``model``'s packed layers (``tune_small_rows``), None without any."""
    if isinstance(model, nn.Module):
        for m in model.modules():
            if isinstance(m, PackedLinear):
                return m.small_plan
    return None


def small_rows_mode(model: Any) -> str:
    """The kernels ``model``'s packed layers run 1, 2 and 3 rows on, e.g. ``"stock,stock,packed"``;
    ``"none"`` without packed layers."""
    plan = small_plan_of(model)
    return "none" if plan is None else ",".join(plan)


def follow_plan(module: nn.Module, plan: tuple[str, ...]) -> int:
    """Switch ``module``'s plain linear layers to ``PackedLinear`` with ``plan`` as their small-row
    kernels (a drafter running beside a target: the target's timed plan, not a second timing;
    the fastest kernel depends on the CPU and on the width, which a head shares with its target).
    Returns how many layers were switched."""
    n = use_small_batch_linear(module, packed=True)
    set_small_plan(module, plan)
    return n


def packed_linear(weight: torch.Tensor, bias: torch.Tensor | None, plan: tuple[str, ...]) -> PackedLinear:
    """A ``PackedLinear`` over existing tensors (shared, not copied; no gradient) computing with
    ``plan`` for 1-3 rows, e.g. a head's output matrix: a slice of its target's."""
    layer = PackedLinear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    layer.weight = nn.Parameter(weight.detach(), requires_grad=False)
    if bias is not None:
        layer.bias = nn.Parameter(bias.detach(), requires_grad=False)
    layer.small_plan = plan
    return layer


#: the attention implementation name ``use_gqa_attention`` registers with transformers
GQA_ATTENTION = "adaspec_sdpa_gqa"


def sdpa_gqa_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                       is_causal: bool | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention, except that several queries under a mask attend to the
    grouped keys and values in the kernel (``enable_gqa``) instead of through a copy repeated
    per group; every other case is transformers' own ``sdpa_attention_forward``."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if (getattr(module, "num_key_value_groups", 1) == 1 or attention_mask is None or query.shape[2] == 1
            or kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                         scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def use_gqa_attention(model: nn.Module) -> bool:
    """Switch a CPU model on transformers' ``"sdpa"`` attention to ``GQA_ATTENTION`` (registered
    with transformers' attention and mask interfaces, the mask being SDPA's). Returns whether it
    switched: other attention implementations, and models off the CPU (where masked grouped
    attention in SDPA is slower, per transformers), are left as they are."""
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) != "sdpa" or not hasattr(model, "set_attn_implementation"):
        return False
    if any(p.device.type != "cpu" for p in model.parameters()):
        return False
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(GQA_ATTENTION, sdpa_gqa_attention)
    AttentionMaskInterface.register(GQA_ATTENTION, sdpa_mask)
    model.set_attn_implementation(GQA_ATTENTION)
    return True


def release_openmp_threads() -> bool:
    """Free the calling thread's OpenMP worker pool (OpenMP 5.0 ``omp_pause_resource_all``), so
    that the thread that computes next does not share the CPUs with this one's idle workers.

    With PyTorch's GNU OpenMP, a second thread's parallel regions run at about half speed while
    the first thread's pool exists: a SmolLM2 step took 33 ms on the thread that loaded the
    model, 65-80 ms on a server's engine thread, and 32 ms there after this call from the
    loading thread. The runtime makes a new pool if the calling thread computes again. Returns
    whether an OpenMP runtime accepted the call (False: none found, or not OpenMP)."""
    pause, _ = _omp_pause()
    return pause is not None and pause(2) == 0  # omp_pause_hard


def release_own_openmp_threads() -> bool:
    """``release_openmp_threads`` where that is safe while other threads compute: with GNU
    libgomp (PyTorch's wheels), whose pause frees the calling thread's own pool only and is
    refused inside a parallel region; a no-op with other runtimes (Intel's or LLVM's may pause
    the whole runtime). The transformers backend calls it after every request
    (``LoadedModel.request_scope``): a request generated on a web app's worker thread ran at
    23.5 tokens/s after one on the main thread, 36.3 with it; the next request's pool costs
    ~0.1 ms to make again (an 8-token request 222 ms with and without)."""
    pause, gnu = _omp_pause()
    return gnu and pause is not None and pause(2) == 0


@functools.cache
def _omp_pause() -> tuple[Any, bool]:
    """(``omp_pause_resource_all`` of PyTorch's OpenMP runtime, or None; whether that runtime
    is GNU libgomp alone), looked up once per process."""
    if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return None, False
    import ctypes
    from pathlib import Path

    found = {pat: sorted(str(p) for p in (Path(torch.__file__).parent / "lib").glob(pat))
             for pat in ("libgomp*.so*", "libiomp5*", "libomp*")}
    gnu = bool(found["libgomp*.so*"]) and not found["libiomp5*"] and not found["libomp*"]
    for name in [None, *found["libgomp*.so*"], *found["libiomp5*"], *found["libomp*"]]:
        try:
            fn = getattr(ctypes.CDLL(name), "omp_pause_resource_all", None)
        except (OSError, TypeError):  # no such library; CDLL(None) where the platform has no global handle
            continue
        if fn is not None:
            fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
            return fn, gnu
    return None, False


def use_small_batch_linear(model: nn.Module, packed: bool = False) -> int:
    """Switch every plain ``nn.Linear`` in ``model`` to ``SmallBatchLinear`` (``packed``:
    ``PackedLinear``, packing each weight now) in place (the class only: parameters, hooks and
    state dict are untouched). Returns how many were switched."""
    cls = PackedLinear if packed else SmallBatchLinear
    n = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = cls
            n += 1
            if packed and module.weight.device.type == "cpu" and module.weight.dtype == torch.float32:
                module.pack()
    return n


def linear_mode(model: Any) -> str:
    """``"packed"`` or ``"small-batch"`` by the model's switched linear layers, else ``"stock"``."""
    if isinstance(model, nn.Module):
        kinds = {type(m) for m in model.modules()}
        if PackedLinear in kinds:
            return "packed"
        if SmallBatchLinear in kinds:
            return "small-batch"
    return "stock"


@contextmanager
def stock_kernels(model: nn.Module, attention: bool = True) -> Iterator[None]:
    """Run ``model`` with PyTorch's own linear kernels and (``attention``) transformers' own SDPA
    attention inside the block (e.g. a Hugging Face peer in the benchmark: what a user of plain
    transformers gets), then switch back."""
    switched = [(m, type(m)) for m in model.modules() if type(m) in (SmallBatchLinear, PackedLinear)]
    gqa = attention and getattr(getattr(model, "config", None), "_attn_implementation", None) == GQA_ATTENTION
    for m, _ in switched:
        m.__class__ = nn.Linear
    if gqa:
        model.set_attn_implementation("sdpa")
    try:
        yield
    finally:
        for m, cls in switched:
            m.__class__ = cls
        if gqa:
            model.set_attn_implementation(GQA_ATTENTION)
