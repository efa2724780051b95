"""llama.cpp in the bench: its peers (plain greedy and prompt lookup through llama-cpp-python),
exactness against them, failed peer runs, and ``adaspec bench --backend llama.cpp``.
Skipped when llama-cpp-python is not installed (the README's test command installs it)."""

from __future__ import annotations

import importlib.util

import pytest

from adaspec import SpeculativeEngine
from adaspec.bench.runner import BenchConfig, ConfigResult, PromptRecord, run_bench
from adaspec.bench.workloads import BenchPrompt
from adaspec.errors import ConfigError
from conftest import real_model_threads

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                                reason="llama-cpp-python is not installed")

REPEAT = ("The meeting is on Tuesday at noon in room 4. Please repeat the sentence exactly: "
          "The meeting is on Tuesday at noon in room 4.")


@pytest.fixture(scope="module")
def target():
    from adaspec.models import load_model

    return load_model("smollm2", backend="llama.cpp", threads=real_model_threads())


def test_parse_llamacpp_peers():
    from adaspec.bench.llamacpp_peer import parse_llamacpp_peer
    from adaspec.bench.peers import check_peer

    # flash attention: the target's unless given
    assert parse_llamacpp_peer("llama.cpp").flash_attn is None and not parse_llamacpp_peer("llama.cpp").pld
    assert parse_llamacpp_peer("llama.cpp:flash_attn=1").flash_attn is True
    spec = parse_llamacpp_peer("llama.cpp-pld:k=4,max_ngram=3,flash_attn=0")
    assert (spec.pld, spec.k, spec.max_ngram, spec.flash_attn) == (True, 4, 3, False)
    assert parse_llamacpp_peer("llama.cpp-pld").k == 10  # llama-cpp-python's default
    for bad, needle in [("llama.cpp:k=4", "allowed: flash_attn"), ("llama.cpp-pld:k=0", ">= 1"),
                        ("llama.cpp-pld:k=x", "not an integer"), ("llama.cpp:flash_attn=2", "0 or 1"),
                        ("vllm", "unknown peer")]:
        with pytest.raises(ConfigError, match=needle):
            check_peer(bad)


def test_hf_peers_are_refused_on_llamacpp(target):
    from adaspec.bench.peers import make_peer

    with pytest.raises(ConfigError, match="llama.cpp, llama.cpp-pld and llama-server"):
        make_peer(target, "hf-pld")


def test_peers_equal_adaspec_on_llamacpp(target):
    """llama.cpp's own greedy (plain and prompt lookup) and adaspec's AR and speculative runs on
    the llama.cpp backend give the same tokens (same kernels: the target's flash attention
    setting, the prompt in one batch); the plain peer runs one target evaluation per token."""
    from adaspec.bench.llamacpp_peer import LlamaCppPeer

    ar = SpeculativeEngine(target, [])
    ids = ar.encode_prompt(REPEAT)
    eos = ar.eos_ids()
    want = ar.generate(ids, max_new_tokens=24).token_ids
    plain = LlamaCppPeer(target, "llama.cpp")
    assert plain.flash_attn is target.flash_attn is False
    plain = plain.run(ids, 24, eos)
    assert plain.error is None and plain.token_ids == want
    assert plain.rounds == len(want) and plain.drafted == 0 and plain.prefill_tokens == len(ids)
    pld = LlamaCppPeer(target, "llama.cpp-pld:k=4").run(ids, 24, eos)
    assert pld.token_ids == want and pld.drafted > 0 and pld.rounds < len(want)
    for drafters in (["suffix"], None):
        assert SpeculativeEngine(target, drafters).generate(ids, max_new_tokens=24).token_ids == want


def test_a_failing_peer_run_is_recorded_not_raised(target, monkeypatch):
    from adaspec.bench.llamacpp_peer import LlamaCppPeer

    peer = LlamaCppPeer(target, "llama.cpp-pld")

    def broken(*args, **kwargs):
        yield 5
        raise ValueError("operands could not be broadcast together")

    monkeypatch.setattr(peer.llm, "generate", broken)
    run = peer.run([1, 2, 3], 8, {2})
    assert run.error == "ValueError: operands could not be broadcast together" and run.token_ids == [5]


def test_failed_prompts_leave_the_totals_and_the_speedup_compares_the_rest():
    recs = [PromptRecord("p", "a", "x", 0, tokens=10, seconds=1.0),
            PromptRecord("p", "b", "x", 1, tokens=3, seconds=0.1, error="ValueError: boom")]
    r = ConfigResult.total("p", recs)
    assert (r.prompts, r.tokens, r.seconds) == (1, 10, 1.0)
    assert r.failed == ["prompt b (x): ValueError: boom"] and r.failed_ids == {"b"}
    tie = PromptRecord("q", "a", "x", 0, tokens=10, seconds=1.0, identical=False, first_mismatch=4,
                       mismatch_gap=0.01)
    far = PromptRecord("q", "b", "x", 1, tokens=10, seconds=1.0, identical=False, first_mismatch=2,
                       mismatch_gap=1.5)
    q = ConfigResult.total("q", [tie, far])
    assert len(q.near_ties) == 1 and "gap 0.01 nats" in q.near_ties[0]
    assert len(q.mismatches) == 1 and "gap 1.5 nats" in q.mismatches[0]
    # past 256 cached tokens llama.cpp's kernels move margins more: the record carries that bound
    wide = PromptRecord("q", "c", "x", 2, tokens=10, seconds=1.0, identical=False, first_mismatch=300,
                        mismatch_gap=0.3, tie_nats=0.5)
    q = ConfigResult.total("q", [wide])
    assert len(q.near_ties) == 1 and "near-tie bound there: 0.5" in q.near_ties[0] and not q.mismatches


def test_bench_on_llamacpp(target):
    work = [BenchPrompt("r1", "summarization", [REPEAT]), BenchPrompt("r2", "qa", ["What is 2+2?"])]
    configs = [BenchConfig("AR (no drafter)", []), BenchConfig("suffix k=4", ["suffix"], k=4),
               BenchConfig("auto", ["prompt-lookup", "suffix"], selector="auto"),
               BenchConfig("llama.cpp", peer="llama.cpp"), BenchConfig("llama.cpp-pld", peer="llama.cpp-pld:k=4")]
    run = run_bench(target, configs, work, max_new_tokens=16, measure_costs=False, dtype="gguf")
    summary = run.summary()
    assert summary["backend"] == "llama.cpp" and summary["dtype"] == "gguf"
    for row in summary["overall"]:
        assert row["identical"] == 2 and not row["mismatches"] and not row["failed"], row
