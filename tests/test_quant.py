"""adaspec.quant: the quantized GGUF target's kernels and layers.

References are code adaspec did not write: the ``gguf`` package's own quantizers and
dequantizers (``gguf.quants``), ``F.linear`` in float64 on the dequantized weights, PyTorch's
``scaled_dot_product_attention``. The kernel's two promises are checked bit for bit: every
supported type dequantizes exactly as gguf does, and an output row does not depend on the rows
computed with it (1..40 rows, one and two threads) nor on the masked keys next to it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from adaspec import quant
from adaspec.errors import ConfigError, ModelLoadError
from conftest import make_tiny_model

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType

#: the types the gguf package quantizes itself; the K-quants are written as random blocks
GGUF_QUANTIZES = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0)
RANDOM_BLOCKS = (Q.Q4_K, Q.Q5_K, Q.Q6_K)
FLOATS = (Q.F32, Q.F16, Q.BF16)
ALL_TYPES = (*FLOATS, *GGUF_QUANTIZES, *RANDOM_BLOCKS)


def make_blocks(qtype, rows: int, width: int, seed: int = 0) -> np.ndarray:
    """A [rows, row_bytes] uint8 tensor of ``qtype``: float data quantized by gguf where it can,
    random blocks (with finite, small fp16 scales) for the K-quants."""
    rng = np.random.default_rng(seed)
    if qtype in GGUF_QUANTIZES:
        data = rng.standard_normal((rows, width)).astype(np.float32)
        return gguf.quants.quantize(data, qtype).reshape(rows, -1).view(np.uint8)
    if qtype == Q.F32:
        return rng.standard_normal((rows, width)).astype(np.float32).view(np.uint8)
    if qtype == Q.F16:
        return rng.standard_normal((rows, width)).astype(np.float16).view(np.uint8)
    if qtype == Q.BF16:
        bits = rng.standard_normal((rows, width)).astype(np.float32).view(np.uint32) >> 16
        return bits.astype(np.uint16).view(np.uint8).reshape(rows, -1)
    elems, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, width // elems, size), dtype=np.uint8)

    def half(shape):
        return (rng.standard_normal(shape) * 0.01).astype(np.float16).view(np.uint8).reshape(*shape, 2)

    if qtype in (Q.Q4_K, Q.Q5_K):  # d, dmin
        raw[..., 0:2], raw[..., 2:4] = half(raw.shape[:2]), half(raw.shape[:2])
    else:  # Q6_K: d last
        raw[..., 208:210] = half(raw.shape[:2])
    return raw.reshape(rows, -1)


def reference_weights(blocks: np.ndarray, qtype, width: int) -> np.ndarray:
    """The gguf package's dequantization (bf16: the exact widening, gguf has no bf16 reader)."""
    if qtype == Q.BF16:
        return (blocks.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(-1, width)
    return gguf.quants.dequantize(blocks, qtype).reshape(-1, width).astype(np.float32)


def width_for(qtype) -> int:
    return 512 if qtype in RANDOM_BLOCKS else 96


@pytest.fixture(scope="module")
def ext():
    return quant.extension()


# -- dequantization and products against gguf ---------------------------------------------------
@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_dequantize_is_gguf_bit_for_bit(ext, qtype):
    width = width_for(qtype)
    blocks = make_blocks(qtype, 37, width)
    ref = reference_weights(blocks, qtype, width)
    got = quant.dequantize(torch.from_numpy(blocks.copy()), int(qtype), width).numpy()
    assert got.shape == ref.shape
    assert np.array_equal(got.view(np.uint32), ref.view(np.uint32)), f"{qtype.name}: not gguf's bits"
    rows = torch.tensor([36, 0, 5, 5])
    some = quant.dequantize(torch.from_numpy(blocks.copy()), int(qtype), width, rows).numpy()
    assert np.array_equal(some, ref[rows.numpy()])


def test_dequantize_check_has_power(ext):
    """Negative control: one flipped bit in a block changes the dequantized weights."""
    blocks = make_blocks(Q.Q4_K, 4, 256)
    ref = reference_weights(blocks, Q.Q4_K, 256)
    bad = blocks.copy()
    bad[2, 40] ^= 0x10  # a quant nibble of row 2
    got = quant.dequantize(torch.from_numpy(bad), int(Q.Q4_K), 256).numpy()
    assert not np.array_equal(got, ref) and np.array_equal(got[[0, 1, 3]], ref[[0, 1, 3]])


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_product_matches_float64_linear(ext, qtype):
    """The kernel's product is F.linear on gguf's dequantized weights up to float32 rounding."""
    width = width_for(qtype)
    blocks = make_blocks(qtype, 45, width, seed=1)
    w = torch.from_numpy(reference_weights(blocks, qtype, width)).double()
    bias = torch.randn(45)
    layer = quant.QuantLinear(torch.from_numpy(blocks.copy()), int(qtype), width, bias)
    x = torch.randn(3, 7, width)
    with torch.inference_mode():
        got = layer(x)
    ref = F.linear(x.double(), w, bias.double())
    assert got.shape == (3, 7, 45) and got.dtype == torch.float32
    tol = 1e-5 * (x.double().abs() @ w.abs().T).max().item()
    assert (got.double() - ref).abs().max().item() <= tol


def check_rows_invariant(mats, x: torch.Tensor, threads: int) -> torch.Tensor:
    """Every prefix of ``x``'s rows, and every row alone, gives the rows of the full product bit for
    bit on ``threads`` threads; returns the full product."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        full = mats.forward(x)[0]
        for m in range(1, x.shape[0] + 1):
            assert torch.equal(mats.forward(x[:m])[0], full[:m]), f"{m} rows"
            assert torch.equal(mats.forward(x[m - 1:m])[0], full[m - 1:m]), f"row {m - 1} alone"
    finally:
        torch.set_num_threads(before)
    return full


@pytest.mark.parametrize("qtype", (Q.Q4_1, Q.Q8_0, Q.Q4_K, Q.Q6_K, Q.Q5_0, Q.F32), ids=lambda t: t.name)
@pytest.mark.parametrize("threads", [1, 2])
def test_rows_are_batch_invariant(ext, qtype, threads):
    """Row r of a 40-row product equals the same row computed alone and in every shorter block,
    bit for bit (the in-register path for few rows, the panel path for more: both)."""
    width = width_for(qtype)
    blocks = torch.from_numpy(make_blocks(qtype, 70, width, seed=2).copy())
    mats = ext.QuantMatrices([blocks], [int(qtype)], [None], width)
    x = torch.randn(40, width)
    before = torch.get_num_threads()
    full = check_rows_invariant(mats, x, threads)
    torch.set_num_threads(1 if threads == 2 else 2)
    try:
        assert torch.equal(mats.forward(x)[0], full), "another thread count"
    finally:
        torch.set_num_threads(before)


INT8_TYPES = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K)


@pytest.mark.parametrize("qtype", INT8_TYPES, ids=lambda t: t.name)
def test_int8_product_is_within_activation_rounding(ext, qtype):
    """gguf-q8: 8-bit activations (per row and block of 32) and integer dot products; against
    float64 F.linear on gguf's dequantized weights the error is that of rounding the activations
    (|x| / 254 a value at most), measured against sum |w| |x|."""
    width = 512
    blocks = make_blocks(qtype, 45, width, seed=3)
    w = torch.from_numpy(reference_weights(blocks, qtype, width)).double()
    bias = torch.randn(45)
    mats = ext.QuantMatrices([torch.from_numpy(blocks.copy())], [int(qtype)], [bias], width, True)
    assert mats.int8
    x = torch.randn(6, width)
    got = mats.forward(x)[0].double()
    ref = F.linear(x.double(), w, bias.double())
    scale = (x.double().abs() @ w.abs().T).max().item()
    err = (got - ref).abs().max().item() / scale
    assert 1e-6 < err < 4e-3, err  # not the float32 path's ~1e-7, not more than 8-bit rounding


@pytest.mark.parametrize("qtype", (Q.Q4_1, Q.Q8_0, Q.Q4_K, Q.Q6_K), ids=lambda t: t.name)
@pytest.mark.parametrize("threads", [1, 2])
def test_int8_rows_are_batch_invariant(ext, qtype, threads):
    blocks = torch.from_numpy(make_blocks(qtype, 70, 512, seed=2).copy())
    check_rows_invariant(ext.QuantMatrices([blocks], [int(qtype)], [None], 512, True), torch.randn(40, 512), threads)


@pytest.mark.parametrize("qtype", INT8_TYPES, ids=lambda t: t.name)
def test_amx_tiles_give_the_vnni_bits(ext, qtype):
    """Where the CPU has AMX, inputs of many rows take the tile unit (TDPBSUD: the same integer
    sums as vpdpbusd, then the same float steps): every output bit equals the VNNI code's, for
    every type and row count, whichever unit a row group takes. Without AMX (this CPU or this
    build) the threshold changes nothing, which the same comparisons check."""
    blocks = torch.from_numpy(make_blocks(qtype, 50, 768, seed=4).copy())
    mats = ext.QuantMatrices([blocks], [int(qtype)], [torch.randn(50)], 768, True)
    x = torch.randn(40, 768)
    default = ext.amx_min_rows()
    try:
        ext.set_amx_min_rows(0)
        vnni = {m: mats.forward(x[:m])[0] for m in (1, 2, 5, 9, 12, 16, 17, 33, 40)}
        for threshold in (1, default):
            ext.set_amx_min_rows(threshold)
            assert ext.isa().endswith("-amx") == ext.has_amx()
            for m, want in vnni.items():
                assert torch.equal(mats.forward(x[:m])[0], want), (threshold, m)
    finally:
        ext.set_amx_min_rows(default)


def test_the_kernels_run_on_torchs_threads(ext):
    """The products and attention split their outputs over torch's threads: the kernel is built
    with OpenMP (without it ATen's header-only ``parallel_for`` runs on the calling thread, and
    a build without ``-fopenmp`` gives 1 here)."""
    before = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            assert ext.threads_used(64) == n
    finally:
        torch.set_num_threads(before)


def test_batch_invariance_check_has_power(ext):
    """Negative control: PyTorch's own F.linear is not row-invariant on these shapes, so the
    check above can fail (if this ever passes, the control no longer shows anything)."""
    torch.manual_seed(0)
    w = torch.randn(4096, 576)
    x = torch.randn(40, 576)
    full = F.linear(x, w)
    assert any(not torch.equal(F.linear(x[:m], w), full[:m]) for m in range(1, 41))


def test_several_matrices_in_one_call(ext):
    """q/k/v-style segments of different types and biases in one call equal their own calls."""
    parts = [(Q.Q4_K, 64), (Q.Q6_K, 32), (Q.Q8_0, 48)]
    blocks = [torch.from_numpy(make_blocks(t, n, 256, seed=i).copy()) for i, (t, n) in enumerate(parts)]
    biases = [torch.randn(n) if i != 1 else None for i, (_, n) in enumerate(parts)]
    both = ext.QuantMatrices(blocks, [int(t) for t, _ in parts], biases, 256)
    x = torch.randn(5, 256)
    outs = both.forward(x)
    for b, (t, n), bias, out in zip(blocks, parts, biases, outs):
        alone = ext.QuantMatrices([b], [int(t)], [bias], 256).forward(x)[0]
        assert out.shape == (5, n) and torch.equal(out, alone)


def test_layer_errors_are_clear(ext):
    with pytest.raises(RuntimeError, match="not a multiple of the block size"):
        ext.QuantMatrices([torch.zeros(4, 18, dtype=torch.uint8)], [int(Q.Q4_K)], [None], 32)
    with pytest.raises(RuntimeError, match="bytes a row"):
        ext.QuantMatrices([torch.zeros(4, 17, dtype=torch.uint8)], [int(Q.Q4_0)], [None], 32)
    with pytest.raises(RuntimeError, match="unsupported GGML type"):
        ext.QuantMatrices([torch.zeros(4, 84, dtype=torch.uint8)], [int(Q.Q2_K)], [None], 256)
    layer = quant.QuantLinear(torch.from_numpy(make_blocks(Q.Q8_0, 8, 64).copy()), int(Q.Q8_0), 64)
    with pytest.raises(RuntimeError, match="input width"):
        layer(torch.randn(2, 32))
    with pytest.raises(ModelLoadError, match="Q2_K.*--weights dense"):
        quant.check_type(int(Q.Q2_K), "tensor blk.0.ffn_up.weight")


def test_layer_under_autograd_takes_the_dequantized_weights(ext):
    blocks = torch.from_numpy(make_blocks(Q.Q4_0, 16, 64).copy())
    layer = quant.QuantLinear(blocks, int(Q.Q4_0), 64)
    x = torch.randn(3, 64, requires_grad=True)
    y = layer(x)
    y.sum().backward()
    w = quant.dequantize(blocks, int(Q.Q4_0), 64)
    assert torch.allclose(x.grad, w.sum(0).expand(3, -1))


# -- attention in a fixed order -------------------------------------------------------------------
def _causal(q_len: int, kv_len: int) -> torch.Tensor:
    return torch.arange(kv_len)[None, :] <= (kv_len - q_len + torch.arange(q_len))[:, None]


@pytest.mark.parametrize("length, d", [(45, 32), (50, 64), (37, 80)])
def test_attention_matches_sdpa_and_is_row_invariant(ext, length, d):
    """Rows alone equal their rows in a block; with 50 keys the block's rows see 44 to 50 keys, so a
    key summed alone (past the last whole block of 16 a row sees) is summed within a block of 16 by
    the block's longest row (AVX-512's tree): both must give the same bits. 80 = 5 chunks of 16."""
    torch.manual_seed(length)
    b, h, hk, q_len = 2, 6, 2, 7
    q, k, v = torch.randn(b, h, q_len, d), torch.randn(b, hk, length, d), torch.randn(b, hk, length, d)
    out = ext.attention(q, k, v, None, d ** -0.5)
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(h // hk, 1), v.repeat_interleave(h // hk, 1),
                                         attn_mask=_causal(q_len, length)).transpose(1, 2)
    assert out.shape == (b, q_len, h, d)
    assert (out - ref).abs().max().item() < 1e-5
    for i in range(q_len):  # a row alone on the keys it sees
        seen = length - q_len + i + 1
        alone = ext.attention(q[:, :, i:i + 1], k[:, :, :seen], v[:, :, :seen], None, d ** -0.5)
        assert torch.equal(alone[:, 0], out[:, i]), i
    # the same rows under explicit masks: -inf (bool) and finfo.min (the batch engine's)
    allowed = _causal(q_len, length)
    neg = torch.zeros(1, 1, q_len, length).masked_fill_(~allowed, float("-inf"))
    low = torch.zeros(b, 1, q_len, length).masked_fill_(~allowed, torch.finfo(torch.float32).min)
    assert torch.equal(ext.attention(q, k, v, neg, d ** -0.5), out)
    assert torch.equal(ext.attention(q, k, v, low, d ** -0.5), out)


@pytest.mark.parametrize("pad", [1, 5, 16, 38])
def test_attention_is_the_same_behind_padding_and_holes(ext, pad):
    """A row's keys placed behind ``pad`` masked columns of other content, with masked holes
    between them (a padded batch cache after rejected drafts), give the bits of the row alone on
    its keys: the softmax's sums must not depend on the columns the keys sit at."""
    torch.manual_seed(pad)
    h, hk, n, d, q_len = 6, 2, 45, 32, 3
    q, k, v = torch.randn(1, h, q_len, d), torch.randn(1, hk, n, d), torch.randn(1, hk, n, d)
    alone = ext.attention(q, k, v, None, d ** -0.5)
    holes = [3, 4, 20, 33]  # masked columns inserted after these keys
    cols, at = [], pad
    for j in range(n):
        cols.append(at)
        at += 2 if j in holes else 1
    width = at
    kk, vv = torch.randn(1, hk, width, d) * 3, torch.randn(1, hk, width, d) * 3  # junk where masked
    kk[:, :, cols], vv[:, :, cols] = k, v
    allowed = torch.zeros(q_len, width, dtype=torch.bool)
    allowed[:, cols] = _causal(q_len, n)
    mask = torch.zeros(1, 1, q_len, width).masked_fill_(~allowed, torch.finfo(torch.float32).min)
    assert torch.equal(ext.attention(q, kk, vv, mask, d ** -0.5), alone)


def test_attention_row_with_no_visible_key_is_zero(ext):
    q, k, v = torch.randn(1, 2, 1, 16), torch.randn(1, 2, 4, 16), torch.randn(1, 2, 4, 16)
    out = ext.attention(q, k, v, torch.full((1, 1, 1, 4), float("-inf")), 0.25)
    assert torch.equal(out, torch.zeros_like(out))


# -- a tiny quantized model, from a GGUF file written by the gguf package ----------------------------
def tiny_gguf_model(path: Path, qtype=Q.Q8_0, seed: int = 0, **kw):
    """A tiny Llama (``make_tiny_model``) written as a GGUF file of ``qtype`` tensors in the file's
    own row order (q/k permuted as llama.cpp stores them), its weights then set to what
    transformers loads from that file (gguf's dequantization, rows reordered back)."""
    from gguf import GGUFWriter
    from transformers.modeling_gguf_pytorch_utils import get_gguf_hf_weights_map

    model = make_tiny_model(seed=seed, **kw)
    processor = quant._tensor_processor(model, "llama")
    to_hf = get_gguf_hf_weights_map(model, processor)
    params = dict(model.named_parameters())
    writer = GGUFWriter(str(path), "llama")
    with torch.no_grad():
        for gname, hf in to_hf.items():
            if hf not in params or not gname.endswith(".weight"):
                continue
            w = params[hf].detach().float().numpy()
            if w.ndim == 1:
                writer.add_tensor(gname, w.astype(np.float32))
                continue
            order = quant._row_order(processor, gname, w.shape[0])  # hf row i = file row order[i]
            in_file = w[np.argsort(order)]
            blocks = gguf.quants.quantize(in_file, qtype)
            writer.add_tensor(gname, blocks, raw_dtype=qtype)
            loaded = gguf.quants.dequantize(blocks, qtype).reshape(w.shape)[order]
            params[hf].copy_(torch.from_numpy(np.ascontiguousarray(loaded)))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    """(dense model, the same model quantized from its GGUF file, the file)."""
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    dense = tiny_gguf_model(path, vocab=40, init_std=0.3, lm_head_scale=3.0)
    q = tiny_gguf_model(path.with_name("same.gguf"), vocab=40, init_std=0.3, lm_head_scale=3.0)
    quant.quantize_model(q, path)
    assert quant.fuse_layers(q) > 0
    quant.use_fixed_order_attention(q)
    return dense, q, path


@pytest.mark.slow
def test_export_hf_writes_the_dense_weights(tmp_path):
    """``export_hf`` (the vLLM path's Hugging Face directory) holds every weight of the dense
    model: exporting the default (quantized) target once wrote a directory whose layers vLLM
    filled with nothing, and served empty answers."""
    from transformers import AutoModelForCausalLM

    from adaspec.integrations.vllm import export_hf
    from adaspec.models import load_model

    out = export_hf("smollm2", tmp_path / "hf")
    saved = AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32).state_dict()
    dense = load_model("smollm2", weights="dense", linear="stock").model.state_dict()
    assert set(saved) == set(dense)
    assert all(torch.equal(saved[k], dense[k]) for k in dense)


def test_quantize_model_replaces_every_linear_and_the_embedding(tiny_pair):
    dense, q, _ = tiny_pair
    linears = [n for n, m in dense.named_modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(isinstance(q.get_submodule(n), quant.QuantLinear) for n in linears)
    assert isinstance(q.get_input_embeddings(), quant.QuantEmbedding)
    assert not any(isinstance(m, torch.nn.Linear) for m in q.modules())
    assert quant.quantized_of(q).summary() == f"Q8_0x{len(linears) + 1}"
    assert torch.equal(q.get_input_embeddings().weight, dense.get_input_embeddings().weight)
    for n in linears:
        assert torch.equal(q.get_submodule(n).weight, dense.get_submodule(n).weight), n


def test_quantized_model_computes_the_dense_model(tiny_pair):
    dense, q, _ = tiny_pair
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]])
    with torch.inference_mode():
        a, b = dense(input_ids=ids).logits, q(input_ids=ids).logits
    assert (a - b).abs().max().item() < 1e-4


def test_fused_decoder_layers_equal_their_modules_one_by_one(tiny_pair):
    """A decoder layer in one kernel call (the target's own cache) gives the bits of its fused
    modules run one by one (transformers' DynamicCache, which the one-call path does not take)."""
    from transformers import DynamicCache

    _, q, _ = tiny_pair
    assert all(type(layer).__name__.startswith("AdaspecFused") for layer in q.model.layers)
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.inference_mode():
        fast = quant.spare_capacity_cache(q.config)
        slow = DynamicCache(config=q.config)
        a = q(input_ids=ids[:, :5], cache=fast, use_cache=True).logits
        b = q(input_ids=ids[:, :5], cache=slow, use_cache=True).logits
        assert torch.equal(a, b)
        a = q(input_ids=ids[:, 5:], cache=fast, use_cache=True).logits
        b = q(input_ids=ids[:, 5:], cache=slow, use_cache=True).logits
    assert torch.equal(a, b)


@pytest.mark.parametrize("mode", ["gguf", "gguf-q8"])
def test_fused_stack_equals_transformers_forward_bit_for_bit(tiny_pair, tiny_q8, mode):
    """``FusedStack`` (the decoder stack without transformers' wrappers) gives the bits of
    transformers' forward over the same fused layers: one token, a verify block (the kernel's
    causal limit against transformers' mask), a prefix chunk, and the kept rows only."""
    q = tiny_pair[1] if mode == "gguf" else tiny_q8
    stack = quant.FusedStack.of(q)
    assert stack is not None
    ids = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7]
    with torch.inference_mode():
        mine, theirs = quant.spare_capacity_cache(q.config), quant.spare_capacity_cache(q.config)
        for chunk, keep in ((ids[:6], 1), (ids[6:7], 1), (ids[7:12], 5), (ids[12:], 0)):
            a = stack(mine, chunk, keep)
            b = q(input_ids=torch.tensor([chunk]), cache=theirs, use_cache=True, logits_to_keep=keep).logits[0]
            assert a.shape == b.shape and torch.equal(a, b), (chunk, keep)
        assert mine.get_seq_length() == theirs.get_seq_length() == len(ids)
        for x, y in zip(mine.layers, theirs.layers):
            assert torch.equal(x.keys, y.keys) and torch.equal(x.values, y.values)
        # where it does not apply, it says so (a cache of another kind, a long prefill)
        from transformers import DynamicCache

        assert stack(DynamicCache(config=q.config), ids, 1) is None
        quant.PREFILL_GEMM = "gemm"
        try:
            with quant.prefill_scope():
                assert stack(quant.spare_capacity_cache(q.config), list(range(quant.PREFILL_MIN_ROWS)), 1) is None
        finally:
            quant.PREFILL_GEMM = "kernel"


def test_fused_stack_is_refused_where_a_layer_is_not_fused(tiny_pair):
    from adaspec.models import as_loaded

    dense, q, _ = tiny_pair
    assert as_loaded(q).stack is not None
    assert as_loaded(dense).stack is None and quant.FusedStack.of(dense) is None


def test_quantize_model_refuses_a_file_of_another_model(tiny_pair, tmp_path):
    _, _, path = tiny_pair
    other = make_tiny_model(seed=5, vocab=40, init_std=0.3)
    with pytest.raises(ModelLoadError, match="does not dequantize to the weights.*--weights dense"):
        quant.quantize_model(other, path)


def test_tiny_target_verify_block_equals_one_token_forwards(tiny_pair):
    from adaspec.models import as_loaded

    _, q, _ = tiny_pair
    target = as_loaded(q)
    ids = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7]
    one = target.new_state()
    target.forward(one, ids[:6])
    rows = [target.forward(one, [t])[0][0] for t in ids[6:]]
    blk = target.new_state()
    target.forward(blk, ids[:6])
    block = target.forward(blk, ids[6:], keep=len(ids) - 6)[0]
    assert all(torch.equal(a, b) for a, b in zip(rows, block))


@pytest.fixture(scope="module")
def tiny_q8(tiny_pair):
    """The tiny model of ``tiny_pair`` in gguf-q8 mode (8-bit activations)."""
    _, _, path = tiny_pair
    q = tiny_gguf_model(path.with_name("q8.gguf"), vocab=40, init_std=0.3, lm_head_scale=3.0)
    quant.quantize_model(q, path, int8=True)
    quant.fuse_layers(q)
    quant.use_fixed_order_attention(q)
    assert quant.quantized_of(q).mode == "gguf-q8"
    return q


@pytest.mark.parametrize("mode", ["gguf", "gguf-q8"])
@pytest.mark.parametrize("drafter", ["prompt-lookup", "suffix", "recycle", "model"])
def test_greedy_speculative_equals_plain_decoding_on_a_quantized_target(tiny_pair, tiny_q8, tmp_path, drafter,
                                                                        mode):
    """Token-identical greedy output: every drafter against plain decoding, same quantized target."""
    from adaspec import SpeculativeEngine
    from adaspec.drafters import ModelDrafter
    from adaspec.models import as_loaded

    q = tiny_pair[1] if mode == "gguf" else tiny_q8
    target = as_loaded(q)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 3, 1, 4, 1, 5, 9, 2, 6, 3, 1]
    plain = SpeculativeEngine(target, ["none"], selector="static").generate(prompt, max_new_tokens=40)
    spec = drafter
    if drafter == "model":
        spec = ModelDrafter(as_loaded(make_tiny_model(seed=3, vocab=40, init_std=0.3)), 40)
    got = SpeculativeEngine(target, [spec], k=4).generate(prompt, max_new_tokens=40)
    assert got.token_ids == plain.token_ids
    assert got.stats.drafted > 0


@pytest.mark.parametrize("mode", ["gguf", "gguf-q8"])
def test_batched_rows_on_a_quantized_target_equal_one_at_a_time(tiny_pair, tiny_q8, mode, monkeypatch):
    """Continuous batching on the quantized target (one padded forward for every row, its
    spare-capacity cache merged, cropped and compacted by ``PaddedRows``) gives each prompt
    the tokens plain decoding gives it alone."""
    from adaspec import SpeculativeEngine
    from adaspec.models import as_loaded

    target = as_loaded(tiny_pair[1] if mode == "gguf" else tiny_q8)
    assert target.batching_problem() is None
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6, 3, 1, 4, 1, 5], [7, 7, 2, 7, 7, 2, 7], [9, 8, 1, 9, 8, 1, 9, 8, 1, 2, 3]]
    plain = SpeculativeEngine(target, ["none"], selector="static")
    alone = [plain.generate(p, max_new_tokens=24).token_ids for p in prompts]
    from adaspec.backends.transformers import PaddedRows

    rows_seen, real = [], PaddedRows.forward
    monkeypatch.setattr(PaddedRows, "forward", lambda self, inputs: rows_seen.append(len(inputs)) or real(self, inputs))
    engine = SpeculativeEngine(target, ["prompt-lookup", "suffix"], k=4)
    results = engine.generate_batch(prompts, max_new_tokens=24, max_batch=3)
    assert [r.token_ids for r in results] == alone
    assert max(rows_seen) == 3  # the rows did share forwards
    assert sum(r.stats.drafted for r in results) > 0


def test_padded_rows_rounds_equal_each_row_alone_bit_for_bit(tiny_pair):
    """Rounds of ``PaddedRows`` on the quantized target (rows joining with prompts of other
    lengths, so left padding; drafts of several widths partly kept, so holes; rows leaving;
    compactions) give every row's logits bit for bit as its own batch-1 state does: the
    batch-invariance greedy identity across concurrency rests on."""
    import random

    from adaspec.models import as_loaded

    target = as_loaded(tiny_pair[1])
    rng = random.Random(0)
    rows, alone = target.new_rows(), []
    checked = 0
    with torch.inference_mode():
        for _ in range(40):
            if not alone or (len(alone) < 4 and rng.random() < 0.3):
                prompt = [rng.randrange(40) for _ in range(rng.randrange(3, 90))]
                a, b = target.new_state(), target.new_state()
                target.prefill(a, prompt + [0])
                target.prefill(b, prompt + [0])
                rows.join(a, len(prompt))
                alone.append(b)
            inputs = [[rng.randrange(40) for _ in range(rng.randrange(1, 6))] for _ in alone]
            logits = rows.forward(inputs)
            for r, (state, ids) in enumerate(zip(alone, inputs)):
                before = target.state_length(state)
                assert torch.equal(logits[r, :len(ids)], target.forward(state, ids, keep=len(ids))[0]), r
                checked += len(alone) > 1
                kept = rng.randrange(1, len(ids) + 1)
                rows.keep(r, kept)
                target.truncate(state, before + kept)
            leaving = [r for r in range(len(alone)) if rng.random() < 0.05]
            rows.end_round(leaving)
            alone = [s for r, s in enumerate(alone) if r not in leaving]
    assert checked > 40 and rows.compactions > 0


def test_padded_rows_keep_their_buffers_and_never_write_the_prefix_cache(tiny_pair):
    """On the quantized target's spare-capacity cache: a prompt restored from the prefix cache
    reads the kept KV in place (no copy) and never writes it; joining rows are stacked into
    buffers with room, so the next forwards write in place (no copy of the batch cache); a row
    leaving moves the others down within the same buffers; and every row's KV stays what it
    holds alone."""
    from adaspec.models import as_loaded

    target = as_loaded(tiny_pair[1])
    prompts = [list(range(3, 20)), list(range(5, 30)), list(range(4, 12))]
    alone = []
    for p in prompts:  # each prompt's own state, prefilled without the prefix cache
        alone.append(target.new_state())
        target.prefill(alone[-1], p + [0])
    target.prefix_cache = True
    try:
        for p in prompts:
            target.prefill(target.new_state(), p + [0])
        store = {tuple(t): kv for t, kv in target._prefixes._entries}
        before = {t: [x.clone() for pair in kv for x in pair] for t, kv in store.items()}
        rows = target.new_rows()
        with torch.inference_mode():
            for p in prompts:
                state = target.new_state()
                assert target.prefill(state, p + [0]) == len(p)
                assert state.layers[0].keys.data_ptr() == store[tuple(p)][0][0].data_ptr()  # lent
                rows.join(state, len(p))
            buffers = None
            for step, leaving in enumerate([[], [], [1], []]):
                inputs = [[7 + r] for r in range(len(alone))]
                logits = rows.forward(inputs)
                for r, (state, ids) in enumerate(zip(alone, inputs)):
                    assert torch.equal(logits[r, :1], target.forward(state, ids, keep=1)[0]), (step, r)
                    rows.keep(r, 1)
                ptrs = [layer.keys.data_ptr() for layer in rows._cache.layers]
                assert buffers is None or ptrs == buffers, step  # written in place, a leave included
                buffers = ptrs
                rows.end_round(leaving)
                alone = [s for r, s in enumerate(alone) if r not in leaving]
        for t, kv in store.items():
            assert all(torch.equal(a, b) for a, b in zip(before[t], [x for pair in kv for x in pair])), t
    finally:
        target.prefix_cache = False


def test_a_prompt_gets_the_same_kv_however_it_is_fed(tiny_pair, monkeypatch):
    """With the default prefill (``PREFILL_GEMM = "kernel"``: the decoding kernels), a prompt
    prefilled whole, in the batch engine's pieces (``prefill_piece``) at any split, or after a
    prefix cache's kept prefix gives the same next logits bit for bit. Under ``"gemm"`` a
    piece still takes the kernels of ``prefill`` (the dense GEMM from ``PREFILL_MIN_ROWS``
    rows), while a plain ``forward`` of the same tokens gives other bits: the control that
    shows these checks can fail."""
    from adaspec.models import as_loaded

    target = as_loaded(tiny_pair[1])
    prompt = torch.randint(0, 40, (2 * quant.PREFILL_MIN_ROWS + 5,), generator=torch.Generator().manual_seed(0)).tolist()

    def next_logits(feed):
        state = target.new_state()
        feed(state)
        return target.forward(state, prompt[-1:], keep=1)[0]

    def pieces(*cuts):
        def feed(state):
            for a, b in zip((0, *cuts), (*cuts, len(prompt) - 1)):
                target.prefill_piece(state, prompt[a:b])
        return feed

    with torch.inference_mode():
        whole = next_logits(lambda st: target.prefill(st, prompt))
        assert torch.equal(next_logits(pieces(60)), whole)
        assert torch.equal(next_logits(pieces(17, 80, 81)), whole)
        target.prefix_cache = True
        try:
            target.prefill(target.new_state(), prompt[:40])  # keeps 39 tokens
            state = target.new_state()
            assert target.prefill(state, prompt) == 39
            assert torch.equal(target.forward(state, prompt[-1:], keep=1)[0], whole)
        finally:
            target.prefix_cache = False
            target.prefill(target.new_state(), [1, 2])  # (off: the kept prefixes go)
        monkeypatch.setattr(quant, "PREFILL_GEMM", "gemm")
        dense = next_logits(lambda st: target.prefill(st, prompt))
        piece = next_logits(lambda st: target.prefill_piece(st, prompt[:-1]))
        plain = next_logits(lambda st: target.forward(st, prompt[:-1], keep=1))
    assert torch.equal(piece, dense)
    assert not torch.equal(plain, dense)


@pytest.mark.parametrize("mode", ["gguf", "gguf-q8"])
def test_staggered_long_prompts_on_a_quantized_target_equal_one_at_a_time(tiny_pair, tiny_q8, mode):
    """Requests joining a running batch one by one, long prompts fed in pieces beside decoding
    rows (``prefill_chunk`` under the prompt lengths), give each prompt plain decoding's tokens."""
    from adaspec import SpeculativeEngine
    from adaspec.batch import BatchEngine
    from adaspec.models import as_loaded

    target = as_loaded(tiny_pair[1] if mode == "gguf" else tiny_q8)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 40, (n,), generator=g).tolist() for n in (9, 150, 30, 97, 140)]
    alone = [SpeculativeEngine(target, ["none"], selector="static").generate(p, max_new_tokens=16).token_ids
             for p in prompts]
    batch = BatchEngine(SpeculativeEngine(target, ["prompt-lookup", "suffix"], k=4), max_batch=3,
                        prefill_chunk=quant.PREFILL_MIN_ROWS + 16)
    ids, out = [], {}
    for p in prompts:
        ids.append(batch.add(p, max_new_tokens=16))
        for ev in batch.step():  # one step between arrivals: each prompt joins a running batch
            if ev.finished:
                out[ev.request] = ev.result.token_ids
    out.update({i: r.token_ids for i, r in batch.run().items()})
    assert [out[i] for i in ids] == alone


@pytest.mark.parametrize("mode", ["gguf", "gguf-q8"])
def test_draft_trees_on_a_quantized_target_equal_plain_decoding(tiny_pair, tiny_q8, mode):
    """Draft trees (a 4D mask into the fixed-order attention, KV gathered in the spare-capacity
    cache) give the quantized target's plain decoding token for token."""
    from adaspec import SpeculativeEngine
    from adaspec.models import as_loaded

    target = as_loaded(tiny_pair[1] if mode == "gguf" else tiny_q8)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 3, 1, 4, 1, 5, 9, 2, 6, 3, 1, 4, 1]
    plain = SpeculativeEngine(target, ["none"], selector="static").generate(prompt, max_new_tokens=40)
    got = SpeculativeEngine(target, ["prompt-lookup", "suffix"], k=4, tree=True).generate(prompt, max_new_tokens=40)
    assert got.token_ids == plain.token_ids
    assert sum(r.tree_nodes > 1 for r in got.stats.rounds) > 0 and got.stats.accepted > 0


def test_sampling_on_a_quantized_target_is_exact(tmp_path):
    """Speculative sampling on the quantized target keeps the target's distribution: chi-square
    against the exact two-token distribution (the suite's helpers, level 0.001)."""
    from test_distribution import ALPHA, check_exact, exact_distribution, run_engine

    from adaspec import SpeculativeEngine
    from adaspec.config import SamplingConfig
    from adaspec.drafters import ModelDrafter
    from adaspec.models import as_loaded

    q = tiny_gguf_model(tmp_path / "t.gguf", vocab=12, init_std=0.2, lm_head_scale=1.5)
    quant.quantize_model(q, tmp_path / "t.gguf")
    quant.fuse_layers(q)
    quant.use_fixed_order_attention(q)
    prompt = [3, 7, 1, 9, 4]
    cfg = SamplingConfig(temperature=1.0)
    exact = exact_distribution(q, prompt, cfg, 2)
    drafter = ModelDrafter(as_loaded(make_tiny_model(seed=123, vocab=12, init_std=0.2, lm_head_scale=5.0)), 12)
    engine = SpeculativeEngine(as_loaded(q), [drafter], k=2)
    runs = run_engine(engine, prompt, 2, n_runs=2000, temperature=1.0)
    check_exact(runs, exact, f"quantized target, model drafter (alpha {ALPHA})")


# -- options and errors ----------------------------------------------------------------------------
def test_check_weights_errors_name_the_fix():
    cpu = torch.device("cpu")
    ok = dict(gguf=True, device=cpu, dtype=None, linear="auto", backend="transformers")
    quant.check_weights("gguf", **ok)
    with pytest.raises(ConfigError, match="not one of auto, gguf, gguf-q8, dense"):
        quant.check_weights("int4", **ok)
    with pytest.raises(ConfigError, match="device is cuda.*--device cpu"):
        quant.check_weights("gguf", **(ok | {"device": torch.device("cuda")}))
    with pytest.raises(ConfigError, match="--dtype is bfloat16"):
        quant.check_weights("gguf", **(ok | {"dtype": torch.bfloat16}))
    with pytest.raises(ConfigError, match="--linear packed.*--weights dense"):
        quant.check_weights("gguf", **(ok | {"linear": "packed"}))
    with pytest.raises(ConfigError, match="not a .gguf file"):
        quant.check_weights("gguf", **(ok | {"gguf": False}))
    with pytest.raises(ConfigError, match="llama.cpp backend reads the GGUF file itself"):
        quant.check_weights("gguf", **(ok | {"backend": "llama.cpp"}))
    assert quant.auto_weights(**(ok | {"device": torch.device("cuda")})) == "dense"
    assert quant.auto_weights(**(ok | {"gguf": False})) == "dense"
    assert quant.auto_weights(**(ok | {"linear": "stock"})) == "dense"


def test_no_compiler_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv(quant.BUILD_ENV, str(tmp_path))
    monkeypatch.setenv("ADASPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CXX", "no-such-c++-compiler")
    quant.extension.cache_clear()
    try:
        with pytest.raises(ConfigError, match="need a C\\+\\+ compiler.*--weights dense"):
            quant.extension()
        ok = dict(gguf=True, device=torch.device("cpu"), dtype=None, linear="auto", backend="transformers")
        assert quant.auto_weights(**ok) == "dense"  # auto falls back, logged
    finally:
        quant.extension.cache_clear()


# -- SmolLM2's Q4_1 file (slow) -----------------------------------------------------------------------
SMOL_PROMPTS = [
    "Fix the spelling in this sentence and return it: 'The comittee will discus the budjet on tuesday.'",
    "Write a Python function that checks whether a number is prime, with a docstring.",
    "Repeat this list twice: apples, pears, plums, figs, dates.",
    "Tell me a short story about a fox and a crow.",
]
SMOL_NEW = 64


@pytest.fixture(scope="module")
def smol_q():
    from adaspec.models import load_model

    target = load_model("smollm2")  # auto: the file's own blocks on this CPU
    assert quant.quantized_of(target.model) is not None, "auto did not load the quantized target"
    return target


@pytest.fixture(scope="module")
def smol_plain(smol_q):
    """Plain decoding (AR) of each prompt on the quantized target: (prompt ids, tokens)."""
    from adaspec import SpeculativeEngine

    ar = SpeculativeEngine(smol_q, ["none"], selector="static")
    return [(ids, ar.generate(ids, max_new_tokens=SMOL_NEW).token_ids)
            for ids in (ar.encode_prompt(p) for p in SMOL_PROMPTS)]


@pytest.mark.slow
def test_smollm2_quantized_types_and_identity(smol_q):
    from adaspec.models import target_fingerprint

    found = quant.quantized_of(smol_q.model)
    assert found.summary() == "Q4_1x210,Q8_0x2"  # 210 linears, lm_head + embedding
    assert found.mode == ("gguf-q8" if quant.extension().has_vnni() else "gguf")
    assert f"weights={found.mode}[Q4_1x210,Q8_0x2]/{quant.kernel_isa()}" in smol_q.identity()
    assert target_fingerprint(smol_q)["weight_format"] == found.mode
    assert smol_q.vocab_size == 49152


@pytest.mark.slow
@pytest.mark.parametrize("drafters", [None, ["prompt-lookup"], ["suffix"], ["recycle"]],
                         ids=["auto-defaults", "prompt-lookup", "suffix", "recycle"])
def test_smollm2_quantized_greedy_equals_plain_decoding(smol_q, smol_plain, drafters):
    """auto (the engine's defaults) and each default drafter give the quantized target's own plain
    decoding token for token (exact: its kernels are batch-invariant)."""
    from adaspec import SpeculativeEngine

    engine = SpeculativeEngine(smol_q, drafters, k=5) if drafters else SpeculativeEngine(smol_q)
    drafted = 0
    for ids, ref in smol_plain:
        res = engine.generate(ids, max_new_tokens=SMOL_NEW)
        assert res.token_ids == ref, f"{drafters or 'auto'}: differs from plain decoding"
        drafted += res.stats.drafted
    assert drafted > 0


@pytest.mark.slow
def test_smollm2_quantized_is_the_dense_model_up_to_rounding(smol_q):
    """The quantized target's logits against the dense model's (the same file de-quantized by
    transformers, PyTorch's kernels): float rounding apart."""
    from adaspec.models import load_model

    dense = load_model("smollm2", weights="dense", linear="stock")
    exact = load_model("smollm2", weights="gguf")  # float activations (auto may take gguf-q8)
    ids = list(range(1000, 1200))
    a, _ = exact.forward(exact.new_state(), ids, keep=len(ids))
    b, _ = dense.forward(dense.new_state(), ids, keep=len(ids))
    assert (a - b).abs().max().item() < 2e-3
    assert (a.argmax(-1) == b.argmax(-1)).float().mean().item() > 0.99
    if quant.quantized_of(smol_q.model).mode == "gguf-q8":  # 8-bit activations: the same model, rounded
        c, _ = smol_q.forward(smol_q.new_state(), ids, keep=len(ids))
        assert (c.argmax(-1) == b.argmax(-1)).float().mean().item() > 0.9


@pytest.mark.slow
def test_smollm2_quantized_against_llama_cpp(smol_q, smol_plain):
    """End to end against llama.cpp on the same file (plain greedy decoding on adaspec's llama.cpp
    backend, llama-cpp-python with the settings that run on this CPU): llama.cpp quantizes
    activations to 8 bits for its dot products, so the two greedy outputs may part at a near-tie;
    every divergence is reported with its margin on the quantized target, which must be a near-tie
    by llama.cpp's own bound (exactness.NEAR_TIE_NATS_LLAMACPP)."""
    pytest.importorskip("llama_cpp")
    from adaspec import SpeculativeEngine
    from adaspec.exactness import NEAR_TIE_NATS_LLAMACPP, divergence_gap
    from adaspec.models import load_model
    from conftest import real_model_threads

    llama = load_model("smollm2", backend="llama.cpp", threads=real_model_threads())
    ar = SpeculativeEngine(llama, ["none"], selector="static")
    report = []
    for ids, ours in smol_plain:
        theirs = ar.generate(ids, max_new_tokens=SMOL_NEW).token_ids
        at, gap = divergence_gap(smol_q, ids, ours, theirs)
        report.append((len(ids), at, None if gap is None else round(gap, 4)))
        if gap is not None:
            assert gap <= NEAR_TIE_NATS_LLAMACPP, f"llama.cpp parts at token {at} with a margin of {gap:.3f} nats"
    print("\nllama.cpp vs the quantized target (prompt tokens, first divergence, margin in nats):", report)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["x86-64-v3", "x86-64"])
def test_portable_builds_give_the_same_bits(ext, arch, tmp_path, monkeypatch):
    """The AVX2 build (x86-64-v3, what an AVX2-only EPYC compiles with -march=native) and the plain
    C++ build (x86-64) compute every type's dequantization, product and attention bit for bit as
    this machine's native build: one reduction order in all of them.

    Each is compiled afresh (an empty cache) in a process that cannot import
    ``torch.utils.cpp_extension`` itself: the build runs in a child interpreter (in this suite's
    workers, importing it in process once failed in setuptools' distutils shim)."""
    import platform
    import sys

    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("x86-64 builds")
    monkeypatch.setenv("ADASPEC_CACHE", str(tmp_path))
    monkeypatch.delenv(quant.BUILD_ENV, raising=False)
    monkeypatch.setitem(sys.modules, "torch.utils.cpp_extension", None)  # an import here raises
    other = quant.extension.__wrapped__(arch)
    assert (tmp_path / "kernels" / f"adaspec_quant_{quant.kernel_key(arch)}").is_dir()
    assert other.isa() == ("avx2" if arch == "x86-64-v3" else "generic")
    x = torch.randn(9, 512)
    for qtype in ALL_TYPES:
        blocks = torch.from_numpy(make_blocks(qtype, 33, 512, seed=7).copy())
        assert torch.equal(ext.dequantize(blocks, int(qtype), 512), other.dequantize(blocks, int(qtype), 512))
        for rows in (1, 3, 9):
            a = ext.QuantMatrices([blocks], [int(qtype)], [None], 512).forward(x[:rows])[0]
            b = other.QuantMatrices([blocks], [int(qtype)], [None], 512).forward(x[:rows])[0]
            assert torch.equal(a, b), (qtype.name, rows)
        if qtype in INT8_TYPES:  # 8-bit activations: VNNI here, plain C++ integer sums there
            for rows in (1, 9):
                a = ext.QuantMatrices([blocks], [int(qtype)], [None], 512, True).forward(x[:rows])[0]
                b = other.QuantMatrices([blocks], [int(qtype)], [None], 512, True).forward(x[:rows])[0]
                assert torch.equal(a, b), (qtype.name, "int8", rows)
    q, k, v = torch.randn(1, 4, 5, 64), torch.randn(1, 2, 30, 64), torch.randn(1, 2, 30, 64)
    assert torch.equal(ext.attention(q, k, v, None, 0.125), other.attention(q, k, v, None, 0.125))
