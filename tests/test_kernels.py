"""adaspec's linear kernels (``adaspec.kernels``): the transposed product (``small-batch``) and
prepacked oneDNN weights (``packed``) compute the same product as ``F.linear`` up to float
rounding, on every row count and shape the engine sends, with the stock path kept where it
applies (gradients, other dtypes); a packed weight follows changes of the weight; and decoding
with either stays exact."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import make_tiny_model

from adaspec import SpeculativeEngine
from adaspec.errors import ConfigError
from adaspec.kernels import (GQA_ATTENTION, PACKED_MIN_ROWS, SMALL_BATCH_MAX, SMALL_KINDS, PackedLinear,
                             SmallBatchLinear, linear,
                             linear_mode, small_batch_applies, small_rows_mode, stock_kernels, tune_small_rows,
                             use_gqa_attention, use_small_batch_linear)
from adaspec.models import as_loaded, check_linear, small_rows_plan


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


needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch without oneDNN")
KERNELS = [False, pytest.param(True, marks=needs_onednn)]  # use_small_batch_linear(packed=...)


@needs_onednn
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 8, 9, 16, 17, 40])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_layer_equals_f_linear(rows, bias):
    g = torch.Generator().manual_seed(rows)
    layer = nn.Linear(24, 48, bias=bias)
    use_small_batch_linear(layer, packed=True)
    assert type(layer) is PackedLinear and layer._packed is not None  # packed when switched
    x = torch.randn(2, rows, 24, generator=g)  # leading dimensions kept, 2 * rows rows
    with torch.inference_mode():
        got = layer(x)
    want = F.linear(x, layer.weight, layer.bias)
    assert got.shape == want.shape == (2, rows, 48)
    assert got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with torch.inference_mode():  # a non-contiguous input (a transposed view) is the same product
        xt = torch.randn(24, rows + 2, generator=g).t()
        torch.testing.assert_close(layer(xt), F.linear(xt, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)


@needs_onednn
@pytest.mark.parametrize("kind", SMALL_KINDS)
@pytest.mark.parametrize("bias", [False, True])
def test_every_small_rows_kernel_equals_f_linear(kind, bias):
    """``small_plan``: 1-3 rows on each kernel (the packed matmul pads 1-2 rows with zero rows
    and cuts the pad off), more rows on the packed matmul, all the same product."""
    g = torch.Generator().manual_seed(len(kind))
    layer = nn.Linear(24, 48, bias=bias)
    use_small_batch_linear(layer, packed=True)
    layer.small_plan = (kind,) * 3
    for rows in (1, 2, 3, 5):
        for shape in ((rows, 24), (1, rows, 24)):
            x = torch.randn(*shape, generator=g)
            with torch.inference_mode():
                got = layer(x)
            assert got.shape == (*shape[:-1], 48) and got.is_contiguous()
            torch.testing.assert_close(got, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    with torch.inference_mode():
        assert layer(torch.randn(0, 24)).shape == (0, 48)


@needs_onednn
@pytest.mark.parametrize("fast", [("stock", "transposed", "packed"), ("packed", "stock", "transposed"),
                                  ("transposed", "packed", "stock")])
def test_tune_small_rows_keeps_the_fastest_kernel_per_row_count(monkeypatch, fast):
    """Each row count gets the kernel that is fastest on the timed forward of that many tokens."""
    import time as time_mod

    model = make_tiny_model(0, 32)
    use_small_batch_linear(model, packed=True)
    real = PackedLinear.forward

    def forward(self, x):
        n = x.numel() // x.shape[-1]
        if n <= 3 and self.small_plan[n - 1] != fast[n - 1]:  # the other kernels sleep 2 ms a layer
            time_mod.sleep(0.002)
        return real(self, x)

    monkeypatch.setattr(PackedLinear, "forward", forward)
    assert tune_small_rows(model, reps=2) == fast
    assert all(m.small_plan == fast for m in model.modules() if isinstance(m, PackedLinear))
    assert small_rows_mode(model) == ",".join(fast)
    assert tune_small_rows(make_tiny_model(0, 32)) is None  # nothing packed: nothing to tune
    assert small_rows_mode(make_tiny_model(0, 32)) == "none"


@needs_onednn
def test_the_small_rows_plan_is_timed_once_per_model_shape_and_machine(monkeypatch, tmp_path, caplog):
    """A second load of the same shape on the same machine reads the cached plan instead of
    timing the kernels again (the timed pick flips near a tie, and with it the cost grids'
    keys); another machine, another shape, ``refresh`` or an unreadable file time them."""
    import adaspec.models as models_mod

    monkeypatch.setenv("ADASPEC_CACHE", str(tmp_path))
    picks = iter([("stock", "transposed", "packed"), ("packed", "packed", "stock"), ("transposed",) * 3,
                  ("stock",) * 3, ("packed",) * 3])
    timed = []

    def tune(model, reps=2):
        plan = next(picks)
        timed.append(plan)
        for m in model.modules():
            if isinstance(m, PackedLinear):
                m.small_plan = plan
        return plan

    monkeypatch.setattr(models_mod, "tune_small_rows", tune)

    def packed(hidden=32):
        model = make_tiny_model(0, hidden)
        use_small_batch_linear(model, packed=True)
        return model

    first = packed()
    assert small_rows_plan(first) == ("stock", "transposed", "packed") and len(timed) == 1
    files = list((tmp_path / "kernels").glob("*.json"))
    assert len(files) == 1
    again = packed()
    assert small_rows_plan(again) == ("stock", "transposed", "packed") and len(timed) == 1  # read, not timed
    assert small_rows_mode(again) == "stock,transposed,packed"
    assert as_loaded(again).identity() == as_loaded(first).identity()  # so the cost grids' keys agree
    assert small_rows_plan(packed(hidden=48)) == ("packed", "packed", "stock") and len(timed) == 2  # other shapes
    assert small_rows_plan(packed(), refresh=True) == ("transposed",) * 3 and len(timed) == 3
    assert small_rows_plan(packed()) == ("transposed",) * 3 and len(timed) == 3  # the refreshed plan is kept
    files[0].write_text('{"plan": ["fastest", "stock", "stock"]}')
    with caplog.at_level("WARNING", logger="adaspec.models"):
        assert small_rows_plan(packed()) == ("stock",) * 3 and len(timed) == 4
    assert "unreadable kernel plan" in caplog.text
    monkeypatch.setattr(models_mod, "machine_identity", lambda device: "cpu:another|AVX512|cores=2")
    assert small_rows_plan(packed()) == ("packed",) * 3 and len(timed) == 5  # another machine: timed there
    assert small_rows_plan(make_tiny_model(0, 32)) is None and len(timed) == 5  # nothing packed


@needs_onednn
@pytest.mark.parametrize("kind", SMALL_KINDS)
def test_greedy_decoding_with_each_small_rows_kernel_equals_hf_generate(kind):
    model = make_tiny_model(0, 32, init_std=0.3, lm_head_scale=3.0)
    prompt = [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3]
    with torch.no_grad():
        want = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=40)[0, len(prompt):].tolist()
    use_small_batch_linear(model, packed=True)
    for m in model.modules():
        if isinstance(m, PackedLinear):
            m.small_plan = (kind,) * 3
    for tree in (False, True):
        engine = SpeculativeEngine(as_loaded(model), ["prompt-lookup", "suffix", "none"], k=4, tree=tree)
        assert engine.generate(prompt, max_new_tokens=40).token_ids == want
    batch = SpeculativeEngine(as_loaded(model), ["prompt-lookup"], k=3)
    assert batch.generate_batch([prompt, [7, 8, 9]], max_new_tokens=24)[0].token_ids == want[:24]
    assert f"|small_rows={kind},{kind},{kind}|" in as_loaded(model).identity()


@needs_onednn
def test_packed_weight_follows_changes_of_the_weight():
    """A pack is a copy: an in-place update (optimizer step, load_state_dict) or a new weight
    tensor must not leave a stale one behind."""
    layer = nn.Linear(16, 8)
    use_small_batch_linear(layer, packed=True)
    x = torch.randn(PACKED_MIN_ROWS + 2, 16)
    with torch.no_grad():
        layer.weight.add_(1.0)  # in place: the version counter moves
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
        layer.load_state_dict({"weight": torch.randn(8, 16), "bias": torch.zeros(8)})
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
        layer.weight = nn.Parameter(torch.randn(8, 16))  # a new tensor
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
        layer.weight.data = torch.randn(8, 16)  # the same parameter, new storage
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
        packed = layer.pack()
        assert layer.pack() is packed  # unchanged weight: the pack is reused, not made again
    layer.double()
    xd = torch.randn(5, 16, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(layer(xd), F.linear(xd, layer.weight, layer.bias))


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


@pytest.mark.parametrize("packed", KERNELS)
def test_gradients_flow_through_the_stock_path(packed):
    layer = nn.Linear(6, 4)
    use_small_batch_linear(layer, packed=packed)
    for rows in (2, 5):
        x = torch.randn(rows, 6, requires_grad=True)
        layer(x).sum().backward()
        assert x.grad is not None and layer.weight.grad is not None
        torch.testing.assert_close(x.grad, layer.weight.sum(0).expand(rows, 6).detach())


@pytest.mark.parametrize("packed", KERNELS)
def test_switch_keeps_parameters_and_state_dict_and_is_reversible(packed):
    model = make_tiny_model(0, 32)
    before = copy.deepcopy(model.state_dict())
    n = use_small_batch_linear(model, packed=packed)
    mode = "packed" if packed else "small-batch"
    assert n == sum(1 for m in model.modules() if isinstance(m, nn.Linear)) > 0
    assert linear_mode(model) == mode
    assert model.state_dict().keys() == before.keys()  # the pack is not state
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    with stock_kernels(model):
        assert linear_mode(model) == "stock"
        assert not any(isinstance(m, SmallBatchLinear) for m in model.modules())
    assert linear_mode(model) == mode
    assert use_small_batch_linear(model) == 0  # already switched


@pytest.mark.parametrize("packed", KERNELS)
def test_model_logits_match_stock_on_every_block_width(packed):
    model = make_tiny_model(3, 32, init_std=0.3)
    stock = copy.deepcopy(model)
    use_small_batch_linear(model, packed=packed)
    ids = torch.randint(1, 32, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        for width in (1, 2, 3, 5, 8, 12, 20):
            a = model(ids[:, :width]).logits
            b = stock(ids[:, :width]).logits
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("spec", [["none"], ["prompt-lookup"], ["suffix"], ["prompt-lookup", "suffix", "none"]])
@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("packed", KERNELS)
def test_greedy_decoding_with_the_kernel_equals_hf_generate(spec, tree, packed):
    """Exactness with the kernel: the engine's output equals stock HF greedy generate."""
    model = make_tiny_model(0, 32, init_std=0.3, lm_head_scale=3.0)
    prompt = [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3]
    with torch.no_grad():
        want = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=40)[0, len(prompt):].tolist()
    use_small_batch_linear(model, packed=packed)
    engine = SpeculativeEngine(as_loaded(model), spec, k=4, tree=tree)
    assert engine.generate(prompt, max_new_tokens=40).token_ids == want


@pytest.mark.parametrize("packed", KERNELS)
def test_batch_engine_with_the_kernel_equals_hf_generate(packed):
    model = make_tiny_model(0, 32, init_std=0.3, lm_head_scale=3.0)
    prompts = [[1, 2, 3, 4, 1, 2, 3], [5, 6, 7, 5, 6, 7, 5], [9, 9, 9]]
    with torch.no_grad():
        want = [model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=24)[0, len(p):].tolist()
                for p in prompts]
    use_small_batch_linear(model, packed=packed)
    engine = SpeculativeEngine(as_loaded(model), ["prompt-lookup"], k=3)
    got = engine.generate_batch(prompts, max_new_tokens=24)
    assert [r.token_ids for r in got] == want


def test_linear_option_is_checked():
    check_linear("auto")
    check_linear("stock")
    check_linear("small-batch")
    with pytest.raises(ConfigError, match="not one of auto, packed, small-batch, stock"):
        check_linear("fast")
    with pytest.raises(ConfigError, match="llama.cpp backend computes with its own"):
        check_linear("stock", "llama.cpp")


def test_identity_names_the_kernels():
    """Cost surfaces are cached per identity: a stock and a small-batch target are two entries."""
    model = make_tiny_model(0, 32)
    stock_id = as_loaded(model).identity()
    use_small_batch_linear(model)
    assert as_loaded(model).identity() != stock_id
    assert "|linear=small-batch|" in as_loaded(model).identity()
    if torch.backends.mkldnn.is_available():
        packed = make_tiny_model(0, 32)
        use_small_batch_linear(packed, packed=True)
        assert "|linear=packed|" in as_loaded(packed).identity()
    sdpa_id = as_loaded(model).identity()
    assert use_gqa_attention(model)
    assert as_loaded(model).identity() == sdpa_id.replace("attention=sdpa", f"attention={GQA_ATTENTION}") != sdpa_id


def test_auto_uses_the_kernel_only_where_it_was_measured_to_pay():
    from adaspec.kernels import packed_pays, small_batch_pays

    cpu = torch.device("cpu")
    assert small_batch_pays(cpu, torch.float32) == torch.backends.mkl.is_available()
    assert packed_pays(cpu, torch.float32) == (torch.backends.mkl.is_available()
                                               and torch.backends.mkldnn.is_available())
    assert not packed_pays(cpu, torch.bfloat16)
    assert not packed_pays(torch.device("cuda"), torch.float32)
    assert not small_batch_pays(cpu, torch.bfloat16)
    assert not small_batch_pays(torch.device("cuda"), torch.float32)


@pytest.mark.parametrize("mode", ["auto", "packed", "small-batch", "stock"])
def test_load_model_installs_the_chosen_kernels(tmp_path, mode):
    from adaspec.kernels import packed_pays, small_batch_pays
    from adaspec.models import load_model

    if mode == "packed" and not torch.backends.mkldnn.is_available():
        pytest.skip("torch without oneDNN")
    make_tiny_model(0, 32).save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path), linear=mode)
    cpu = torch.device("cpu")
    want = mode if mode != "auto" else ("packed" if packed_pays(cpu, torch.float32) else
                                        "small-batch" if small_batch_pays(cpu, torch.float32) else "stock")
    assert linear_mode(loaded.model) == want
    assert f"|linear={want}|" in loaded.identity()
    assert loaded.model.config._attn_implementation == GQA_ATTENTION


@needs_onednn
def test_packed_model_copies_and_pickles():
    """deepcopy (e.g. a bf16 copy of a loaded target) and torch.save of a packed model work; the
    copy packs its own weights and computes the same product."""
    import io
    import pickle

    model = make_tiny_model(0, 32)
    use_small_batch_linear(model, packed=True)
    twin = copy.deepcopy(model)
    assert linear_mode(twin) == "packed"
    ids = torch.randint(1, 32, (1, 6), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        torch.testing.assert_close(twin(ids).logits, model(ids).logits)
    buf = io.BytesIO()
    torch.save(model, buf)
    assert pickle.loads(pickle.dumps(model)) is not None
    half = copy.deepcopy(model).to(torch.bfloat16)  # other dtypes take the stock path
    with torch.inference_mode():
        assert half(ids).logits.dtype == torch.bfloat16


def test_release_openmp_threads_then_compute_on_two_threads():
    """The server's engine thread starts after the loading thread releases its OpenMP pool
    (``serve.scheduler.Scheduler.start``); compute stays correct on both threads after it, and
    with PyTorch's OpenMP backend the runtime accepts the call."""
    import threading

    from adaspec.kernels import release_openmp_threads

    layer = nn.Linear(64, 32)
    use_small_batch_linear(layer, packed=torch.backends.mkldnn.is_available())
    x = torch.randn(5, 64)
    with torch.inference_mode():
        want = F.linear(x, layer.weight, layer.bias)
        layer(x)
    released = release_openmp_threads()
    if "parallel backend: OpenMP" in torch.__config__.parallel_info():
        assert released
    got = {}

    def work():
        with torch.inference_mode():
            got["thread"] = layer(x)

    t = threading.Thread(target=work)
    t.start()
    t.join()
    with torch.inference_mode():
        got["main"] = layer(x)  # the calling thread computes again: a new pool
    for v in got.values():
        torch.testing.assert_close(v, want, rtol=1e-5, atol=1e-5)


# -- attention: grouped-query SDPA under a mask (kernels.GQA_ATTENTION) ----------------------------


def _gqa_and_stock(init_std: float = 0.3):
    """A tiny grouped-query model (4 query heads on 2 key/value heads) on ``GQA_ATTENTION`` and
    a copy of it on transformers' ``sdpa``."""
    model = make_tiny_model(3, 32, init_std=init_std, lm_head_scale=3.0)
    assert model.config._attn_implementation == "sdpa" and model.config.num_key_value_heads < 4
    stock = copy.deepcopy(model)
    assert use_gqa_attention(model) and model.config._attn_implementation == GQA_ATTENTION
    return model, stock


def test_gqa_attention_runs_its_own_path_and_equals_sdpa_on_cached_blocks(monkeypatch):
    """Blocks of 1-12 tokens on a cache of 17 (a mask, several queries): the logits equal
    transformers' SDPA path, and the blocks of 2 or more went through ``enable_gqa``."""
    model, stock = _gqa_and_stock()
    calls = []
    real = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        calls.append(kwargs.get("enable_gqa", False))
        return real(*args, **kwargs)

    ids = torch.randint(1, 32, (1, 30), generator=torch.Generator().manual_seed(1))
    a_model, b_model = as_loaded(model), as_loaded(stock)
    for width in (1, 2, 3, 5, 8, 12):
        outs = []
        for loaded in (a_model, b_model):
            state = loaded.new_state()
            loaded.forward(state, ids[0, :17].tolist())
            calls.clear()
            with monkeypatch.context() as m:
                m.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
                outs.append(loaded.forward(state, ids[0, 17:17 + width].tolist(), keep=width)[0])
            if loaded is a_model and width > 1:
                assert calls and all(calls), "a masked block did not take the grouped kernel"
        assert torch.equal(outs[0], outs[1])


def test_gqa_attention_equals_sdpa_for_trees_and_padded_batches():
    from adaspec.trees import DraftTree

    model, stock = _gqa_and_stock()
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    tree = DraftTree(tokens=[4, 5, 6, 7, 8], parents=[-1, 0, 0, 1, 3])
    outs = []
    for m in (model, stock):
        loaded = as_loaded(m)
        state = loaded.new_state()
        loaded.forward(state, prompt)
        outs.append(loaded.forward_tree(state, 10, tree)[0])
    assert torch.equal(outs[0], outs[1])
    # a padded batch: left padding under a 4D mask, as the batch engine sends it
    ids = torch.tensor([[0, 0, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    with torch.inference_mode():
        a = model(input_ids=ids, attention_mask=mask).logits
        b = stock(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(a[:, 2:], b[:, 2:])


@pytest.mark.parametrize("tree", [False, True])
def test_greedy_decoding_on_gqa_attention_equals_hf_generate(tree):
    model, stock = _gqa_and_stock()
    prompt = [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3]
    with torch.no_grad():
        want = stock.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=40)[0, len(prompt):].tolist()
    engine = SpeculativeEngine(as_loaded(model), ["prompt-lookup", "suffix", "none"], k=4, tree=tree)
    assert engine.generate(prompt, max_new_tokens=40).token_ids == want
    batch = SpeculativeEngine(as_loaded(model), ["prompt-lookup"], k=3)
    assert [r.token_ids for r in batch.generate_batch([prompt, [7, 8, 9]], max_new_tokens=24)][0] == want[:24]


def test_gqa_attention_is_installed_only_over_sdpa_on_cpu_and_stock_kernels_restores_it():
    eager = make_tiny_model(0, 32)
    eager.set_attn_implementation("eager")
    assert not use_gqa_attention(eager) and eager.config._attn_implementation == "eager"
    model = make_tiny_model(0, 32)
    use_small_batch_linear(model)
    assert use_gqa_attention(model)
    with stock_kernels(model):
        assert model.config._attn_implementation == "sdpa" and linear_mode(model) == "stock"
    assert model.config._attn_implementation == GQA_ATTENTION and linear_mode(model) == "small-batch"
    with stock_kernels(model, attention=False):
        assert model.config._attn_implementation == GQA_ATTENTION and linear_mode(model) == "stock"


def test_the_engine_frees_its_threads_openmp_pool_after_building_and_after_each_request(monkeypatch):
    """On a CPU, the transformers backend releases the calling thread's OpenMP pool after every
    request (``LoadedModel.request_scope``) and the engine after building (loading computes):
    a request on another thread then does not share the CPUs with an idle pool (measured:
    23.5 -> 36.3 tokens/s on a worker thread). The thread-local release is GNU libgomp's
    only (``release_own_openmp_threads``), and compute stays correct after it."""
    import threading

    import adaspec.engine as engine_mod
    import adaspec.kernels as kernels
    import adaspec.backends.transformers as models
    from adaspec import SpeculativeEngine
    from conftest import make_tiny_model

    calls = []
    monkeypatch.setattr(models, "release_own_openmp_threads", lambda: calls.append("request"))
    monkeypatch.setattr(engine_mod, "release_own_openmp_threads", lambda: calls.append("build"))
    eng = SpeculativeEngine(make_tiny_model(seed=1), ["suffix"], k=3)
    assert calls == ["build"]
    want = eng.generate([1, 2, 3, 1, 2], max_new_tokens=6).token_ids
    assert calls == ["build", "request"]
    got = {}
    t = threading.Thread(target=lambda: got.setdefault("worker", eng.generate([1, 2, 3, 1, 2], max_new_tokens=6)))
    t.start()
    t.join()
    assert got["worker"].token_ids == want and calls[-1] == "request"
    pause, gnu = kernels._omp_pause()
    assert kernels.release_own_openmp_threads() == (gnu and pause is not None)
    assert eng.generate([1, 2, 3, 1, 2], max_new_tokens=6).token_ids == want
