"""The target backend interface, tested with the same cases on both implementations: a tiny
Hugging Face model (transformers) and SmolLM2's GGUF file on llama.cpp (skipped when
llama-cpp-python is not installed; the README's test command installs it)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from conftest import chisquare_gof, make_tiny_model, real_model_threads

from adaspec import SpeculativeEngine
from adaspec.backends import TargetBackend, check_backend
from adaspec.errors import AdaspecError, ConfigError, PromptError
from adaspec.exactness import NEAR_TIE_NATS, NEAR_TIE_NATS_LLAMACPP, divergence_gap
from adaspec.models import as_loaded, embedded_gguf, load_model

HAVE_LLAMA = importlib.util.find_spec("llama_cpp") is not None
needs_llama = pytest.mark.skipif(not HAVE_LLAMA, reason="llama-cpp-python is not installed")
LLAMA_SEQS = 4


@pytest.fixture(scope="module")
def llama() -> TargetBackend:
    if not HAVE_LLAMA:
        pytest.skip("llama-cpp-python is not installed")
    from adaspec.backends.llamacpp import LlamaCppTarget

    return LlamaCppTarget(embedded_gguf(), name="smollm2", threads=real_model_threads(), n_ctx=2048, n_seq_max=LLAMA_SEQS)


@pytest.fixture(scope="module")
def llama_fa() -> TargetBackend:
    """SmolLM2 on llama.cpp with flash attention on (off is the CPU default)."""
    if not HAVE_LLAMA:
        pytest.skip("llama-cpp-python is not installed")
    from adaspec.backends.llamacpp import LlamaCppTarget

    return LlamaCppTarget(embedded_gguf(), name="smollm2", threads=real_model_threads(), n_ctx=2048,
                          n_seq_max=2, flash_attn=True)


@pytest.fixture(scope="module")
def tiny() -> TargetBackend:
    return as_loaded(make_tiny_model(3, 64, init_std=0.3, lm_head_scale=3.0))


@pytest.fixture(params=["transformers", "llama.cpp"])
def backend(request) -> TargetBackend:
    return request.getfixturevalue("tiny" if request.param == "transformers" else "llama")


def _ids(backend: TargetBackend, n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    hi = min(backend.vocab_size, 5000)  # SmolLM2: ordinary word pieces
    return torch.randint(100 if hi > 1000 else 1, hi, (n,), generator=g).tolist()


def test_backend_names():
    assert check_backend("llamacpp") == "llama.cpp" and check_backend("HF") == "transformers"
    with pytest.raises(ConfigError, match="unknown backend"):
        check_backend("onnx")


def test_forward_keep_rows_match_one_token_forwards(backend):
    """``keep`` rows of one forward are the logits of each position (as one-token forwards
    give them, up to the kernels' numerics: same argmax, close values)."""
    ids = _ids(backend, 12)
    a = backend.new_state()
    b = backend.new_state()
    try:
        block, _ = backend.forward(a, ids, keep=4)
        assert block.shape == (4, backend.vocab_size)
        assert backend.state_length(a) == 12
        rows = [backend.forward(b, ids[:9], keep=1)[0][-1]]
        rows += [backend.forward(b, [t], keep=1)[0][-1] for t in ids[9:12]]
        single = torch.stack(rows)
        assert torch.equal(block.argmax(-1), single.argmax(-1))
        # quantized batched kernels differ: by up to ~0.6 in a logit without flash attention
        tol = 1e-4 if backend.backend == "transformers" else 1.0
        assert (block.float() - single.float()).abs().max() < tol
    finally:
        backend.release(a)
        backend.release(b)


def test_truncate_keeps_the_prefix_exactly(backend):
    """After truncating to n tokens, a forward gives what a state holding only those n tokens
    gives: bit for bit against a state whose n tokens came from a forward of the same width
    (followed by other tokens, truncated alike), and within float rounding against a fresh
    state of n tokens. (A 10-token forward need not compute the first 6 tokens' keys bit for
    bit as a 6-token one: on an AVX2-only EPYC, 2026-11-29, fp32 GEMMs of 10 and 6 rows
    differed by 6e-6.)"""
    ids, more = _ids(backend, 10, 1), _ids(backend, 3, 2)
    other = ids[:6] + [(t + 1) % backend.vocab_size for t in ids[6:]]  # the same 6, then others
    a, b, c = backend.new_state(), backend.new_state(), backend.new_state()
    try:
        backend.forward(a, ids, keep=1)
        backend.truncate(a, 6)
        assert backend.state_length(a) == 6
        backend.truncate(a, 8)  # truncating past the end is a no-op
        assert backend.state_length(a) == 6
        got, _ = backend.forward(a, more, keep=3)
        backend.forward(b, other, keep=1)
        backend.truncate(b, 6)
        same_width, _ = backend.forward(b, more, keep=3)
        assert torch.equal(got, same_width)  # tokens 7-10 differed: none of them is left
        backend.forward(c, ids[:6], keep=1)
        fresh, _ = backend.forward(c, more, keep=3)
        torch.testing.assert_close(got, fresh, rtol=1e-5, atol=1e-5)
    finally:
        for state in (a, b, c):
            backend.release(state)


def test_states_are_independent(backend):
    """Interleaved forwards on two states do not see each other's tokens."""
    x, y = _ids(backend, 8, 3), _ids(backend, 8, 4)
    a, b = backend.new_state(), backend.new_state()
    try:
        backend.forward(a, x[:4])
        backend.forward(b, y[:4])
        la, _ = backend.forward(a, x[4:], keep=1)
        lb, _ = backend.forward(b, y[4:], keep=1)
        c = backend.new_state()
        try:
            ref, _ = backend.forward(c, x[:4])
            ref, _ = backend.forward(c, x[4:], keep=1)
        finally:
            backend.release(c)
        assert torch.equal(la, ref) and not torch.equal(la, lb)
    finally:
        backend.release(a)
        backend.release(b)


def test_eos_vocab_and_window(backend):
    assert backend.vocab_size > 0 and backend.context_window and backend.context_window > 0
    eos = backend.eos_ids()
    assert eos == backend.model_eos_ids() | ({int(backend.tokenizer.eos_token_id)}
                                             if getattr(backend.tokenizer, "eos_token_id", None) is not None
                                             else set())
    if backend.backend == "llama.cpp":
        assert 2 in eos  # SmolLM2's <|im_end|>


def test_engine_rejects_prompts_past_the_window(backend):
    window = backend.context_window
    engine = SpeculativeEngine(backend, [])
    with pytest.raises(PromptError, match="context window"):
        engine.generate([5] * window, max_new_tokens=4)
    with pytest.raises(PromptError, match="lower max_new_tokens"):
        engine.generate([5] * (window - 2), max_new_tokens=4)


@pytest.mark.parametrize("drafters", [["prompt-lookup"], ["suffix"], None, ["self"]])
def test_speculative_greedy_equals_plain_decoding(backend, drafters):
    """Greedy speculative output equals plain decoding on the same backend: token for token on
    transformers (fp32), and on llama.cpp too unless a difference sits at a numeric near-tie."""
    base = _ids(backend, 6, 5)
    prompt = base * 3 + base[:2]  # repetitive: prompt lookup and suffix draft
    ar = SpeculativeEngine(backend, []).generate(prompt, max_new_tokens=24)
    spec = SpeculativeEngine(backend, drafters, k=4).generate(prompt, max_new_tokens=24)
    if spec.token_ids != ar.token_ids:
        assert backend.backend == "llama.cpp"
        at, gap = divergence_gap(backend, prompt, ar.token_ids, spec.token_ids)
        assert gap is not None and gap <= backend.near_tie_nats, (at, gap)
    if drafters is not None:
        assert spec.stats.drafted > 0


def _single_and_block_rows(backend: TargetBackend, prompt: list[int], more: list[int]):
    """Rows of ``[prompt[-1], *more]`` after ``prefill(prompt)``: one token at a time, and in one block."""
    rows = []
    for block in (1, len(more) + 1):
        s = backend.new_state()
        try:
            backend.prefill(s, prompt)
            seq, out = [prompt[-1], *more], []
            for j in range(0, len(seq), block):
                out.append(backend.forward(s, seq[j:j + block], keep=len(seq[j:j + block]))[0])
            rows.append(torch.cat(out))
        finally:
            backend.release(s)
    return rows


def test_backend_numerics_flags():
    assert as_loaded(make_tiny_model()).batch_invariant and as_loaded(make_tiny_model()).near_tie_nats == NEAR_TIE_NATS
    if HAVE_LLAMA:
        from adaspec.backends.llamacpp import LlamaCppTarget

        assert not LlamaCppTarget.batch_invariant and LlamaCppTarget.near_tie_nats == NEAR_TIE_NATS_LLAMACPP
        # bit-identical up to 256 tokens: only float-rounding ties there
        assert LlamaCppTarget.BATCH_INVARIANT_TOKENS == 256


def test_llamacpp_near_tie_bound_by_length(llama_fa, llama):
    """With flash attention, bit-identical blocks up to 256 tokens: only float-rounding ties
    there. Without it (the CPU default), the kernel-noise bound at every length."""
    assert llama_fa.near_tie_nats_at(256) == NEAR_TIE_NATS
    assert llama_fa.near_tie_nats_at(257) == NEAR_TIE_NATS_LLAMACPP
    assert llama.near_tie_nats_at(50) == NEAR_TIE_NATS_LLAMACPP


def test_llamacpp_short_sequence_bound_is_probed_per_model(llama_fa, llama, monkeypatch):
    """The float-rounding bound up to 256 tokens holds only for a context whose short blocks
    equal one-token forwards (SmolLM2's Q4_1 with flash attention: probed, true). Kernels that
    differ there (flash attention off; Qwen2.5-Coder's Q4_K_M) get the kernel-noise bound at
    every length; the probe holds no sequence afterwards."""
    free = llama_fa.free_states()
    assert llama_fa.short_blocks_invariant() and llama_fa.free_states() == free
    assert not llama.short_blocks_invariant()
    monkeypatch.setattr(llama_fa, "_short_invariant", False)
    assert llama_fa.near_tie_nats_at(100) == NEAR_TIE_NATS_LLAMACPP


def test_llamacpp_flash_attention_is_off_on_the_cpu_by_default(llama, llama_fa):
    """Off by default on a CPU (ggml's flash attention made forwards past ~128 cached tokens
    slower here), on when asked; the setting is part of the identity the cost grid is cached
    under, and a value that is not a bool is refused."""
    from adaspec.backends.llamacpp import LlamaCppTarget

    assert llama.flash_attn is False and llama.identity().endswith("|fa=off")
    assert llama_fa.flash_attn is True and llama_fa.identity().endswith("|fa=on")
    with pytest.raises(ConfigError, match="flash_attn must be True, False or None"):
        LlamaCppTarget(embedded_gguf(), threads=1, n_ctx=64, n_seq_max=1, flash_attn="on")


def test_llamacpp_blocks_without_flash_attention_move_logits_within_the_bound(llama):
    """Without flash attention a verify block's rows are not the one-token rows bit for bit, at
    any length, but they move the margin of the two best tokens less than the near-tie bound
    (``tools/llamacpp_numerics.py --flash-attn off``)."""
    ids = _ids(llama, 120, 11)
    single, block = _single_and_block_rows(llama, ids[:100], ids[100:108])  # 9 wide (measured: 0.37)
    assert not torch.equal(single, block)
    _same_argmax_up_to_near_ties(llama, single, block)
    assert _margin_move(single, block).max() < llama.near_tie_nats


@pytest.mark.slow
def test_llamacpp_qwen_q4_k_m_blocks_are_not_invariant_at_short_lengths():
    """Measured (``tools/llamacpp_numerics.py --model qwen2.5-coder-1.5b``): on the fetched
    Q4_K_M file a verify block moves logits under 256 tokens, and the probe sees it."""
    if not HAVE_LLAMA:
        pytest.skip("llama-cpp-python is not installed")
    from adaspec.artifacts import fetched_gguf
    from adaspec.errors import ModelLoadError

    try:
        path = fetched_gguf("qwen2.5-coder-0.5b")
    except ModelLoadError:
        pytest.skip("qwen2.5-coder-0.5b is not fetched (adaspec fetch qwen2.5-coder-0.5b)")
    from adaspec.backends.llamacpp import LlamaCppTarget

    target = LlamaCppTarget(path, threads=2, n_ctx=512, n_seq_max=2)  # numerics as at 2 threads
    assert not target.short_blocks_invariant() and target.near_tie_nats_at(50) == NEAR_TIE_NATS_LLAMACPP


def test_llamacpp_blocks_equal_one_token_forwards_only_up_to_256_cells():
    """Pins llama.cpp's numerics with flash attention behind ``batch_invariant = False``: a
    verify block gives the rows of one-token forwards bit for bit while the KV cache holds at
    most 256 cells, and other numbers past that (split-KV flash attention for one query),
    within the near-tie bound. When
    a llama.cpp release makes them equal, this fails: the flag and the threshold can go. On 2
    threads, as users run it here (on one thread both kinds of forward give the same numbers)."""
    if not HAVE_LLAMA:
        pytest.skip("llama-cpp-python is not installed")
    from adaspec.backends.llamacpp import LlamaCppTarget

    llama = LlamaCppTarget(embedded_gguf(), name="smollm2", threads=2, n_ctx=2048, n_seq_max=2,
                           flash_attn=True)
    ids = _ids(llama, 320, 11)
    single, block = _single_and_block_rows(llama, ids[:200], ids[200:205])
    assert torch.equal(single, block)
    single, block = _single_and_block_rows(llama, ids[:300], ids[300:305])
    assert not torch.equal(single, block) and torch.equal(single.argmax(-1), block.argmax(-1))
    assert _margin_move(single, block).max() < llama.near_tie_nats


def test_divergence_gap_is_the_margin_plain_decoding_saw(llama):
    """On llama.cpp the gap at a difference is computed along the reference's own path (prompt,
    then one token at a time), not by one forward that would take other kernels."""
    ids = _ids(llama, 300, 12)
    prompt, ref = ids[:290], ids[290:296]
    other = [*ref[:3], (ref[3] + 1) % llama.vocab_size]
    at, gap = divergence_gap(llama, prompt, ref, other)
    single, _ = _single_and_block_rows(llama, prompt, ref[:3])
    lp = torch.log_softmax(single[-1].float(), -1)
    assert at == 3 and gap == pytest.approx(abs(float(lp[ref[3]] - lp[other[3]])), abs=1e-6)


def test_llamacpp_requests_run_torch_on_one_thread(llama):
    """While a request runs on llama.cpp, torch uses one thread (its spinning pool would take
    llama.cpp's cores); the caller's setting is restored afterwards, also when streams nest."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        engine = SpeculativeEngine(llama, ["prompt-lookup"], k=3)
        seen = []
        engine.generate(_ids(llama, 12, 13), max_new_tokens=6, on_tokens=lambda _: seen.append(torch.get_num_threads()))
        assert seen and set(seen) == {1} and torch.get_num_threads() == 2
        with llama.request_scope():  # nested scopes (interleaved streams): the last one restores
            with llama.request_scope():
                assert torch.get_num_threads() == 1
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_release_frees_a_sequence_and_stale_states_are_refused(llama):
    states = [llama.new_state() for _ in range(LLAMA_SEQS)]
    with pytest.raises(ConfigError, match="in use"):
        llama.new_state()
    llama.release(states[0])
    llama.release(states[0])  # twice is harmless
    with pytest.raises(ConfigError, match="not a live sequence"):
        llama.forward(states[0], [5])
    fresh = llama.new_state()
    assert llama.state_length(fresh) == 0
    for s in [fresh, *states[1:]]:
        llama.release(s)


def test_llamacpp_forward_errors(llama):
    s = llama.new_state()
    try:
        with pytest.raises(ConfigError, match="keep"):
            llama.forward(s, [5, 6], keep=3)
        with pytest.raises(ConfigError, match="exceed"):
            llama.forward(s, [5] * (llama.context_window + 1))
        with pytest.raises(ConfigError, match="hidden states"):
            llama.forward(s, [5], hidden=True)
    finally:
        llama.release(s)


@pytest.fixture
def kept(llama):
    """The module's llama.cpp target with ``prefix_cache`` on for one test (off again after,
    with nothing kept)."""
    llama.prefix_cache = True
    try:
        yield llama
    finally:
        llama.prefix_cache = False
        llama.drop_prefixes()


def test_llamacpp_prefix_cache_starts_the_next_prompt_from_the_kept_kv(kept):
    """A released state's KV is kept; the next prompt that shares its prefix copies those cells
    and feeds only the rest (the state's tokens follow forwards, truncation and the pending
    prompt token), and its next row is the one a fresh prefill gives."""
    llama, ids = kept, _ids(kept, 120, 21)
    free = llama.free_states()
    s = llama.new_state()
    assert llama.prefill(s, ids[:60]) == 0
    llama.forward(s, ids[59:70], keep=11)
    llama.truncate(s, 66)  # ids[66:70] rejected
    llama.forward(s, ids[66:68], keep=1)
    assert s.tokens == ids[:68] and s.length == 68
    llama.release(s)
    assert llama.prefixes == [ids[:68]] and llama.free_states() == free  # a kept prefix gives way

    s = llama.new_state()
    try:
        assert llama.prefill(s, ids[:90]) == 68 and llama.prefixes == [ids[:68]]  # still kept for others
        assert s.tokens == ids[:90] and s.length == 89 and s.pending is not None
        row = llama.forward(s, [ids[89]], keep=1)[0][-1].clone()
    finally:
        llama.release(s)
    # the same batches on a fresh state, nothing kept: bit for bit the same row. (A fresh
    # prefill of all 90 tokens in one batch computes other numbers on llama.cpp's quantized
    # kernels: up to ~0.3 apart on these random ids, as its own server's cache_prompt does.)
    llama.prefix_cache = False
    llama.drop_prefixes()
    s = llama.new_state()
    try:
        llama.forward(s, ids[:60], keep=1)
        llama.forward(s, ids[60:70], keep=1)
        llama.truncate(s, 66)
        llama.forward(s, ids[66:68], keep=1)
        assert torch.equal(llama.forward(s, ids[68:90], keep=1)[0][-1], row)
    finally:
        llama.release(s)


def test_llamacpp_prefix_cache_keeps_prefixes_by_lru_within_its_size(kept):
    """Released states' prefixes are kept whole, least recently used first: a prompt reuses the
    longest one it shares (all but its last token at most), which becomes the most recent; one
    that a newer prefix extends is dropped; past ``prefix_cache_tokens`` the oldest go (the last
    released stays); a new state takes a kept prefix's sequence when none is free; off, nothing
    kept is used or kept."""
    llama, ids = kept, _ids(kept, 200, 22)
    size = llama.prefix_cache_tokens
    llama.prefix_cache_tokens = 100
    try:
        a, b, c = ids[:30], ids[30:70], ids[70:110]
        for p in (a, b):
            s = llama.new_state()
            llama.prefill(s, p)
            llama.release(s)
        assert llama.prefixes == [a, b]
        s = llama.new_state()
        assert llama.prefill(s, a[:20] + c) == 20 and llama.prefixes == [b, a]  # a: now the most recent
        llama.release(s)  # a[:20] + c shares 20 with a: both kept, b (oldest) over the size
        assert llama.prefixes == [a, a[:20] + c]
        s = llama.new_state()
        assert llama.prefill(s, a + [7, 8]) == 30  # the whole of a
        llama.release(s)
        assert llama.prefixes == [a[:20] + c, a + [7, 8]]  # a + [7, 8] extends a: a dropped
        s = llama.new_state()
        assert llama.prefill(s, ids[150:]) == 0  # nothing shared
        llama.forward(s, ids[199:] + [5, 6], keep=1)  # forwards keep the prefixes
        assert len(llama.prefixes) == 2
        llama.release(s)
        assert llama.prefixes == [a + [7, 8], ids[150:] + [5, 6]]  # 60 + 32 + 52 > 100: the oldest went
        states = [llama.new_state() for _ in range(llama.free_states())]  # every sequence wanted
        assert llama.prefixes == [] and llama.free_states() == 0
        for st in states:
            llama.release(st)  # empty states: nothing to keep
        assert llama.prefixes == [] and llama.free_states() == len(states)
        s = llama.new_state()
        llama.prefill(s, a)
        llama.release(s)
        llama.prefix_cache = False
        s = llama.new_state()
        assert llama.prefill(s, a) == 0 and llama.prefixes == []  # off: nothing kept is used
        llama.release(s)
        assert llama.prefixes == []  # nor is anything kept
    finally:
        llama.prefix_cache_tokens = size


def test_llamacpp_engine_reports_cached_prompt_tokens(kept):
    """A chat's next turn starts from the previous turn's KV: the engine reports the reused
    tokens, and the answer is the one a fresh engine gives (greedy)."""
    from adaspec.backends.llamacpp import gguf_tokenizer

    engine = SpeculativeEngine(kept, ["prompt-lookup"], k=3)
    engine.encode_prompt = lambda prompt, chat_template=True: list(  # the fixture has no tokenizer
        gguf_tokenizer(embedded_gguf()).apply_chat_template(prompt, add_generation_prompt=True,
                                                            tokenize=True, return_dict=False))
    engine.decode = lambda ids: ""
    chat = [{"role": "user", "content": "List three colours of the rainbow."}]
    a = engine.generate(chat, max_new_tokens=16)
    assert a.stats.cached_prompt_tokens == 0
    answer = gguf_tokenizer(embedded_gguf()).decode(a.token_ids, skip_special_tokens=True)
    chat += [{"role": "assistant", "content": answer}, {"role": "user", "content": "And two more?"}]
    b = engine.generate(chat, max_new_tokens=16)
    assert len(a.prompt_ids) <= b.stats.cached_prompt_tokens < len(b.prompt_ids)
    assert b.stats.to_dict()["cached_prompt_tokens"] == b.stats.cached_prompt_tokens
    kept.prefix_cache = False
    kept.drop_prefixes()
    fresh = engine.generate(chat, max_new_tokens=16)
    assert fresh.stats.cached_prompt_tokens == 0
    # the reused KV was computed in other batches than a fresh prefill's: the answers agree up
    # to a numeric near-tie of llama.cpp's kernels (measured: they part at token 11, 0.1 nats apart)
    at, gap = divergence_gap(kept, fresh.prompt_ids, fresh.token_ids, b.token_ids)
    assert gap is None or gap < kept.near_tie_nats, (at, gap)


@needs_llama
def test_llamacpp_fingerprint_names_the_gguf(llama, tiny):
    """A state file or trained artifact is matched against ``target_fingerprint``: on llama.cpp
    it comes from the GGUF (shapes, size, a hash of its head), never from a HF config."""
    from adaspec.models import FINGERPRINT_KEYS, target_fingerprint

    fp = target_fingerprint(llama)
    assert set(FINGERPRINT_KEYS) <= set(fp) and fp["model_type"] == "gguf"
    assert (fp["vocab_size"], fp["hidden_size"], fp["num_hidden_layers"]) == (49152, 576, 30)
    assert fp["weights"].endswith(f"-{embedded_gguf().stat().st_size}") and fp == target_fingerprint(llama)
    assert target_fingerprint(tiny)["model_type"] != "gguf"


class _Run:
    """A stand-in for ``subprocess.run`` in ``amx_kernels_run``: exits with ``rc`` (0: after the
    child's forward ran), counts calls."""

    def __init__(self, rc: int):
        self.rc, self.calls = rc, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return type("Done", (), {"returncode": self.rc, "stdout": b"forward ran" if self.rc == 0 else b""})()


@needs_llama
@pytest.mark.parametrize("rc, works, cached", [(-11, False, True), (0, True, True), (3, False, False)])
def test_amx_kernels_are_tried_in_a_child_once_per_build_and_model(monkeypatch, tmp_path, rc, works, cached):
    """GCC <= 12.2 miscompiles llama.cpp's AMX tile configuration (the forward dies with SIGSEGV):
    where the build has AMX kernels, a child process tries a batched forward of the model first;
    killed by a signal, the model loads without the AMX repacking (backend and peers alike), else
    with llama.cpp's defaults. The verdict is cached per build and model file; a child that fails
    otherwise gives no verdict (not cached, AMX left off). Builds without AMX never try."""
    import subprocess

    from adaspec.backends import llamacpp as lc

    L = lc.import_llama_cpp()
    monkeypatch.setenv("ADASPEC_CACHE", str(tmp_path / "cache"))
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    run = _Run(rc)
    monkeypatch.setattr(subprocess, "run", run)
    default = L.llama_cpp.llama_model_default_params
    monkeypatch.setattr(L, "llama_print_system_info", lambda: b"AVX2 = 1 | AMX_INT8 = 1 | REPACK = 1")
    assert lc.amx_kernels_run(L, model) is works and run.calls == 1
    assert lc.model_params(L, model).use_extra_bufts is works
    with lc.safe_model_params(L, model):
        assert L.llama_cpp.llama_model_default_params().use_extra_bufts is works
    assert L.llama_cpp.llama_model_default_params is default
    assert run.calls == (1 if cached else 3)
    model.write_bytes(b"GGUF2")  # another model file: tried again
    lc.amx_kernels_run(L, model)
    assert run.calls == (2 if cached else 4)
    monkeypatch.setattr(L, "llama_print_system_info", lambda: b"AVX2 = 1 | REPACK = 1")
    assert lc.model_params(L, model).use_extra_bufts and not lc.uses_amx(L, model)
    assert run.calls == (2 if cached else 4)
    assert default().use_extra_bufts  # llama.cpp's own default


@needs_llama
@pytest.mark.slow
def test_amx_probe_survives_a_crashing_build(tmp_path, monkeypatch):
    """On SmolLM2's GGUF the child's verdict is a bool whatever the build does (on Debian 12's
    GCC 12.2 build on a CPU with AMX, the child dies with SIGSEGV and this process goes on), and
    a target loaded after it runs greedy decoding either way."""
    from adaspec.backends import llamacpp as lc

    L = lc.import_llama_cpp()
    monkeypatch.setenv("ADASPEC_CACHE", str(tmp_path))
    assert isinstance(lc.amx_kernels_run(L, embedded_gguf()), bool)
    target = lc.LlamaCppTarget(embedded_gguf(), threads=real_model_threads(), n_ctx=256)
    assert target.amx == lc.uses_amx(L, embedded_gguf())
    assert ("|amx" in target.identity()) == target.amx
    state = target.new_state()
    assert target.forward(state, [1, 2, 3, 4], keep=4)[0].shape[0] == 4


_TORCH_AMX_BETWEEN_FORWARDS = """
import sys, torch
from adaspec.backends.llamacpp import LlamaCppTarget
from adaspec.bench.llamacpp_peer import LlamaCppPeer
from adaspec.models import embedded_gguf
target = LlamaCppTarget(embedded_gguf(), threads=2, n_ctx=256)
peer = LlamaCppPeer(target, "llama.cpp")
ids = list(range(100, 140))
first = (target.forward(target.new_state(), ids, keep=1)[0], peer.run(ids, 4, set()).token_ids)
a = torch.randn(256, 256, dtype=torch.bfloat16)
(a @ a).sum()  # oneDNN's AMX kernel on this thread, which releases the tiles after it
again = (target.forward(target.new_state(), ids, keep=1)[0], peer.run(ids, 4, set()).token_ids)
assert torch.equal(first[0], again[0]) and first[1] == again[1]
print("amx" if target.amx else "no amx")
"""


@needs_llama
@pytest.mark.slow
def test_llamacpp_forwards_survive_torch_amx_kernels_between_them():
    """ggml configures the AMX tiles once per thread; PyTorch's oneDNN releases them after a
    bfloat16 matmul, so a llama.cpp forward on a thread where torch ran one since died with
    SIGILL. With the AMX kernels on, the backend's forwards and the peers' evaluations run on a
    thread of their own: run in a child, a crash fails this test instead of the suite's worker."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _TORCH_AMX_BETWEEN_FORWARDS], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert done.stdout.strip() in ("amx", "no amx")


@needs_llama
def test_llamacpp_objects_with_amx_compute_on_one_thread(monkeypatch):
    """With the AMX kernels, every llama.cpp load, context and decode of the process (the
    target's and a peer's) runs on one thread, never the caller's (``LlamaThread``): with a
    thread per object libgomp throttled its spin-waits and every forward, adaspec's and the
    peer's, ran 1.5x slower. Any build: the AMX verdict is faked, the repacking is llama.cpp's."""
    import threading

    import llama_cpp

    from adaspec.backends import llamacpp as lc
    from adaspec.bench.llamacpp_peer import LlamaCppPeer

    # the verdict alone is faked: the weights load as the real verdict says (a build whose AMX
    # kernels crash, as GCC 12.2's do, keeps them off and runs the test on its AVX-512 kernels)
    import adaspec.bench.llamacpp_peer as peer_module

    monkeypatch.setattr(lc, "uses_amx", lambda L, path: True)
    monkeypatch.setattr(peer_module, "uses_amx", lambda L, path: True)
    seen: dict[str, set[int]] = {}
    for name in ("llama_model_load_from_file", "llama_init_from_model", "llama_decode"):
        real = getattr(llama_cpp.llama_cpp, name)

        def record(*args, _real=real, _name=name):
            seen.setdefault(_name, set()).add(threading.get_ident())
            return _real(*args)

        for module in (llama_cpp, llama_cpp.llama_cpp):  # the package re-exports the bindings
            monkeypatch.setattr(module, name, record)
    target = lc.LlamaCppTarget(embedded_gguf(), threads=2, n_ctx=256, n_seq_max=1)
    peer = LlamaCppPeer(target, "llama.cpp")
    assert target.amx and target._decoder is peer._decoder is not None
    ids = list(range(100, 120))
    target.forward(target.new_state(), ids, keep=1)
    assert len(peer.run(ids, 3, set()).token_ids) == 3
    threads = set().union(*seen.values())
    assert set(seen) == {"llama_model_load_from_file", "llama_init_from_model", "llama_decode"}, seen
    assert len(threads) == 1 and threading.get_ident() not in threads, seen
    # and the caller's idle OpenMP workers (from torch's work on it) are released before each
    # request and peer run: alive, they throttled that thread's team (12 -> 43-71 ms a step)
    released = []
    monkeypatch.setattr(lc, "release_own_openmp_threads", lambda: released.append("release"))
    with target.request_scope():
        with target.request_scope():  # nested scopes release once
            pass
    assert released == ["release"]
    peer.run(ids, 1, set())
    assert released == ["release", "release"]


def test_llama_thread_is_one_per_process_and_refuses_a_forked_copy(monkeypatch):
    """``llama_thread`` gives every caller the same thread, runs calls on it (inline when already
    there, exceptions passed on), none without AMX, and a forked child gets a new one, while a
    model loaded before the fork gets a clear error instead of a submit that would hang."""
    import threading

    from adaspec.backends import llamacpp as lc

    monkeypatch.setattr(lc, "_LLAMA_THREAD", lc._LLAMA_THREAD)  # the process's thread, restored after
    t = lc.llama_thread(True)
    assert t is lc.llama_thread(True) and lc.llama_thread(False) is None
    there = t.run(threading.get_ident)
    assert there != threading.get_ident() and t.run(lambda: t.run(threading.get_ident)) == there
    with pytest.raises(ZeroDivisionError):
        t.run(lambda: 1 / 0)
    monkeypatch.setattr(lc.os, "getpid", lambda: t.pid + 1)
    with pytest.raises(ConfigError, match="forked"):
        t.run(threading.get_ident)
    fresh = lc.llama_thread(True)
    assert fresh is not t and fresh.run(threading.get_ident) != threading.get_ident()
    fresh._pool.shutdown()  # the test's own thread: not left behind


@needs_llama
def test_load_model_checks_llamacpp_options(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match="not one: pass a .gguf"):
        load_model(str(tmp_path), backend="llama.cpp")  # a directory: no GGUF
    with pytest.raises(ConfigError, match="dtype"):
        load_model("smollm2", backend="llama.cpp", dtype="bfloat16")
    with pytest.raises(ConfigError, match="CPU only"):
        load_model("smollm2", backend="llama.cpp", device="mps")
    with pytest.raises(ConfigError, match="threads= is for the llama.cpp backend"):
        load_model("smollm2", threads=2)


def test_cli_checks_backend_before_loading(tmp_path):
    from adaspec.cli.options import check_target

    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(AdaspecError, match="--backend llama.cpp runs GGUF files"):
        check_target(str(tmp_path), backend="llama.cpp")
    with pytest.raises(AdaspecError, match="--dtype is not an option"):
        check_target("smollm2", dtype="float32", backend="llama.cpp")
    with pytest.raises(AdaspecError, match="unknown backend"):
        check_target("smollm2", backend="tensorrt")


def test_torch_weight_drafters_are_refused_on_llamacpp(llama):
    from adaspec.drafters import build_drafter

    with pytest.raises(ConfigError, match="--backend transformers"):
        build_drafter("early-exit:layers=4", llama)


def test_llamacpp_cost_surface(llama):
    from adaspec.costs import measure_verify_surface

    surface = measure_verify_surface(llama, contexts=(16, 64), ks=(1, 2, 4), repeats=1)
    assert surface.contexts == [16, 64] and all(s > 0 for row in surface.seconds for s in row)
    assert len(surface.prefill_seconds) == 2
    assert llama.identity().startswith("llama.cpp|")
    assert llama._free_ids and len(llama._free_ids) == LLAMA_SEQS  # every grid state was released


def test_cost_surface_with_fewer_free_states_than_contexts(llama):
    """llama.cpp's states share one KV pool, so the grid measures one state at a time (here
    with 1 free sequence for 3 contexts), and every state goes back to the pool."""
    from adaspec.costs import measure_verify_surface

    held = [llama.new_state() for _ in range(LLAMA_SEQS - 1)]
    try:
        assert llama.free_states() == 1
        surface = measure_verify_surface(llama, contexts=(8, 16, 32), ks=(1, 3), repeats=1)
        assert surface.contexts == [8, 16, 32] and all(s > 0 for row in surface.seconds for s in row)
        assert all(p > 0 for p in surface.prefill_seconds) and llama.free_states() == 1
    finally:
        for s in held:
            llama.release(s)


@pytest.mark.slow
def test_llamacpp_sampling_is_exact(llama):
    """Speculative sampling on llama.cpp emits tokens distributed as the target's softmax: the
    first token after a prompt that prompt lookup drafts from (one-hot drafts, rejection rule),
    chi-square against the target's own distribution at that position (significance 0.001)."""
    base = _ids(llama, 5, 7)
    prompt = base * 3 + base[:2]
    s = llama.new_state()
    try:
        logits, _ = llama.forward(s, prompt, keep=1)
    finally:
        llama.release(s)
    p = torch.softmax(logits[-1].double(), -1)
    engine = SpeculativeEngine(llama, ["prompt-lookup"], k=3)
    n = 400
    counts = torch.zeros(llama.vocab_size, dtype=torch.float64)
    drafted = 0
    for seed in range(n):
        r = engine.generate(prompt, max_new_tokens=2, temperature=1.0, seed=seed)  # drafts 1
        counts[r.token_ids[0]] += 1
        drafted += r.stats.drafted
    assert drafted > 0
    top = torch.argsort(p, descending=True)[:20]
    obs = [*counts[top].tolist(), n - counts[top].sum().item()]
    exp = [*p[top].tolist(), 1 - p[top].sum().item()]
    _, pval, _ = chisquare_gof(obs, exp)
    assert pval > 1e-3


def _margin_move(single: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
    """Per row, how far ``block`` moves the log-probability margin between ``single``'s two
    best tokens (nats): what the near-tie bound has to cover."""
    lp_s, lp_b = torch.log_softmax(single.double(), -1), torch.log_softmax(block.double(), -1)
    top2 = torch.topk(lp_s, 2, dim=-1).indices
    sign = torch.tensor([1.0, -1.0], dtype=torch.float64)
    return ((lp_s.gather(1, top2) @ sign) - (lp_b.gather(1, top2) @ sign)).abs()


def _same_argmax_up_to_near_ties(backend: TargetBackend, a: torch.Tensor, b: torch.Tensor) -> None:
    """Rows of the same positions from forwards of other widths: the same argmax, except (on
    llama.cpp, whose kernels differ between widths) where the two best tokens of ``a`` are
    within the backend's near-tie bound of each other."""
    lp = torch.log_softmax(a.double(), -1)
    top2 = torch.topk(lp, 2, dim=-1).values
    for i in range(a.shape[0]):
        if int(a[i].argmax()) != int(b[i].argmax()):
            assert backend.backend == "llama.cpp" and float(top2[i, 0] - top2[i, 1]) < backend.near_tie_nats


def test_prefill_then_first_round_rows(backend):
    """``prefill`` + a forward that starts with the prompt's last token give that token's row
    and the drafts' rows, as one forward over the whole sequence's tail would."""
    prompt, drafts = _ids(backend, 9, 8), _ids(backend, 3, 9)
    a, b = backend.new_state(), backend.new_state()
    try:
        backend.prefill(a, prompt)
        assert backend.state_length(a) == len(prompt) - 1
        got, _ = backend.forward(a, [prompt[-1], *drafts], keep=4)
        assert backend.state_length(a) == len(prompt) + 3
        backend.forward(b, prompt, keep=1)
        want, _ = backend.forward(b, drafts, keep=3)
        assert got.shape == (4, backend.vocab_size)
        _same_argmax_up_to_near_ties(backend, got[1:], want)
        backend.truncate(a, len(prompt) - 1)  # back to before the last prompt token
        again, _ = backend.forward(a, [prompt[-1]], keep=1)
        _same_argmax_up_to_near_ties(backend, again, got[:1])
    finally:
        backend.release(a)
        backend.release(b)


@pytest.mark.parametrize("target", ["smollm2", Path("models/x.gguf"), 42, object()])
def test_engine_given_no_loaded_model_names_the_fix(target):
    """A model name (or anything but a loaded model) passed where a loaded one goes: a clear
    error naming from_pretrained / load_model, not an AttributeError from deep inside."""
    with pytest.raises(ConfigError, match="from_pretrained"):
        SpeculativeEngine(target, ["prompt-lookup"])
    with pytest.raises(ConfigError, match="from_pretrained"):
        as_loaded(target)
