"""The small-batch linear kernel (``adaspec.kernels``): the same product as ``F.linear`` up to
float rounding, on every row count and shape the engine sends, with the stock path kept where
it applies (gradients, other dtypes, many rows); and decoding with it stays exact."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import make_tiny_model

from adaspec import SpeculativeEngine
from adaspec.errors import ConfigError
from adaspec.kernels import (SMALL_BATCH_MAX, SmallBatchLinear, linear, linear_mode, small_batch_applies,
                             stock_linears, use_small_batch_linear)
from adaspec.models import as_loaded, check_linear


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 17])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_equals_f_linear(rows, bias):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(48, 24, generator=g)
    b = torch.randn(48, generator=g) if bias else None
    x = torch.randn(1, rows, 24, generator=g)
    with torch.inference_mode():
        got = linear(x, w, b)
    want = F.linear(x, w, b)
    assert got.shape == want.shape == (1, rows, 48)
    assert got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_linear_keeps_leading_dimensions():
    w = torch.randn(7, 5)
    x = torch.randn(2, 3, 5)  # 6 rows: the transposed product
    assert small_batch_applies(x, w)
    torch.testing.assert_close(linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_dispatch_rule():
    w = torch.randn(4, 3)
    assert small_batch_applies(torch.randn(SMALL_BATCH_MAX, 3), w)
    assert not small_batch_applies(torch.randn(SMALL_BATCH_MAX + 1, 3), w)  # stock is as fast there
    assert not small_batch_applies(torch.randn(2, 3, dtype=torch.bfloat16), w.bfloat16())  # fp32 only
    wg = w.clone().requires_grad_()
    assert not small_batch_applies(torch.randn(2, 3), wg)  # training keeps autograd's own path
    with torch.no_grad():
        assert small_batch_applies(torch.randn(2, 3), wg)


def test_gradients_flow_through_the_stock_path():
    layer = nn.Linear(6, 4)
    use_small_batch_linear(layer)
    x = torch.randn(2, 6, requires_grad=True)
    layer(x).sum().backward()
    assert x.grad is not None and layer.weight.grad is not None


def test_switch_keeps_parameters_and_state_dict_and_is_reversible():
    model = make_tiny_model(0, 32)
    before = copy.deepcopy(model.state_dict())
    n = use_small_batch_linear(model)
    assert n == sum(1 for m in model.modules() if isinstance(m, nn.Linear)) > 0
    assert linear_mode(model) == "small-batch"
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    with stock_linears(model):
        assert linear_mode(model) == "stock"
        assert not any(type(m) is SmallBatchLinear for m in model.modules())
    assert linear_mode(model) == "small-batch"
    assert use_small_batch_linear(model) == 0  # already switched


def test_model_logits_match_stock_on_every_block_width():
    model = make_tiny_model(3, 32, init_std=0.3)
    stock = copy.deepcopy(model)
    use_small_batch_linear(model)
    ids = torch.randint(1, 32, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        for width in (1, 2, 3, 5, 8, 12):
            a = model(ids[:, :width]).logits
            b = stock(ids[:, :width]).logits
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("spec", [["none"], ["prompt-lookup"], ["suffix"], ["prompt-lookup", "suffix", "none"]])
@pytest.mark.parametrize("tree", [False, True])
def test_greedy_decoding_with_the_kernel_equals_hf_generate(spec, tree):
    """Exactness with the kernel: the engine's output equals stock HF greedy generate."""
    model = make_tiny_model(0, 32, init_std=0.3, lm_head_scale=3.0)
    prompt = [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3]
    with torch.no_grad():
        want = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=40)[0, len(prompt):].tolist()
    use_small_batch_linear(model)
    engine = SpeculativeEngine(as_loaded(model), spec, k=4, tree=tree)
    assert engine.generate(prompt, max_new_tokens=40).token_ids == want


def test_batch_engine_with_the_kernel_equals_hf_generate():
    model = make_tiny_model(0, 32, init_std=0.3, lm_head_scale=3.0)
    prompts = [[1, 2, 3, 4, 1, 2, 3], [5, 6, 7, 5, 6, 7, 5], [9, 9, 9]]
    with torch.no_grad():
        want = [model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=24)[0, len(p):].tolist()
                for p in prompts]
    use_small_batch_linear(model)
    engine = SpeculativeEngine(as_loaded(model), ["prompt-lookup"], k=3)
    got = engine.generate_batch(prompts, max_new_tokens=24)
    assert [r.token_ids for r in got] == want


def test_linear_option_is_checked():
    check_linear("auto")
    check_linear("stock")
    with pytest.raises(ConfigError, match="not one of auto, small-batch, stock"):
        check_linear("fast")
    with pytest.raises(ConfigError, match="llama.cpp backend computes with its own"):
        check_linear("stock", "llama.cpp")


def test_identity_names_the_kernels():
    """Cost surfaces are cached per identity: a stock and a small-batch target are two entries."""
    model = make_tiny_model(0, 32)
    stock_id = as_loaded(model).identity()
    use_small_batch_linear(model)
    assert as_loaded(model).identity() != stock_id
    assert as_loaded(model).identity().endswith("linear=small-batch")


def test_auto_uses_the_kernel_only_where_it_was_measured_to_pay():
    from adaspec.models import small_batch_pays

    cpu = torch.device("cpu")
    assert small_batch_pays(cpu, torch.float32) == torch.backends.mkl.is_available()
    assert not small_batch_pays(cpu, torch.bfloat16)
    assert not small_batch_pays(torch.device("cuda"), torch.float32)
