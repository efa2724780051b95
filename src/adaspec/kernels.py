"""Small-batch linear layers for CPU decoding: the same product, through a faster BLAS call.

Decoding and verification multiply a few rows (1 token, or a draft block of 2-8) by large
weight matrices. On x86 CPUs with MKL, PyTorch's ``F.linear(x, W)`` takes a slow path for
these shapes: one row goes through a matrix-vector kernel and 2-4 rows through a GEMM that is
slower still (measured here on SmolLM2's 211 linear layers: 1 row 46 ms, 2 rows 76 ms, 3 rows
96 ms). Computing the same product as ``(W @ x.T).T`` streams the weights through another
kernel at about twice the bandwidth (1 row padded to 2: 22 ms, 2 rows 20 ms, 3 rows 30 ms,
8 rows 47 ms); from 9 rows on the two are level. ``scripts/linear_kernels.py`` measures it;
docs/kernels.md has the tables.

The result is the same product up to float rounding (the summation order differs), like any
change of BLAS kernel; greedy exactness is judged against the engine's own autoregressive
decoding, which uses the same kernels.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

#: the largest row count that takes the transposed product; from 9 rows on, the stock call
#: is as fast or faster (docs/kernels.md)
SMALL_BATCH_MAX = 8


def small_batch_pays(device: torch.device, dtype: torch.dtype) -> bool:
    """``load_model(linear="auto")``: the kernel where it was measured to pay, float32 on a CPU
    whose BLAS is MKL (docs/kernels.md); elsewhere PyTorch's own kernels."""
    return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkl.is_available()


def small_batch_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``linear`` takes the transposed product: float32 on CPU, no autograd, 1-8 rows."""
    rows = x.numel() // max(1, x.shape[-1])
    return (1 <= rows <= SMALL_BATCH_MAX and weight.device.type == "cpu" and weight.dtype == torch.float32
            and x.dtype == torch.float32 and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)))


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


def use_small_batch_linear(model: nn.Module) -> int:
    """Switch every plain ``nn.Linear`` in ``model`` to ``SmallBatchLinear`` in place (the
    class only: weights, hooks and state dict are untouched). Returns how many were switched."""
    n = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = SmallBatchLinear
            n += 1
    return n


def linear_mode(model: Any) -> str:
    """``"small-batch"`` if any of the model's linear layers uses ``SmallBatchLinear``, else ``"stock"``."""
    if isinstance(model, nn.Module) and any(type(m) is SmallBatchLinear for m in model.modules()):
        return "small-batch"
    return "stock"


@contextmanager
def stock_linears(model: nn.Module) -> Iterator[None]:
    """Run ``model`` with PyTorch's own linear kernels inside the block (e.g. a Hugging Face
    peer in the benchmark: what a user of plain transformers gets), then switch back."""
    switched = [m for m in model.modules() if type(m) is SmallBatchLinear]
    for m in switched:
        m.__class__ = nn.Linear
    try:
        yield
    finally:
        for m in switched:
            m.__class__ = SmallBatchLinear
