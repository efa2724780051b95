"""Slow real-model tests on the embedded SmolLM2-135M-Instruct, dense (fp32 and bf16): the file
de-quantized as transformers loads it, against transformers' own ``generate`` (the quantized
target, ``weights="gguf"``, is tested in test_quant.py).

The references are decoded with stock transformers modules (``conftest.stock_smollm2``: no
adaspec kernels), the engine runs on what ``load_model`` loads (adaspec's kernels). Run with
``pytest --run-slow`` (the README's test command does).
"""

from __future__ import annotations

import copy

import pytest
import torch

from adaspec import SpeculativeEngine, load_model
from adaspec.exactness import check_tie_aware
from adaspec.models import LoadedModel

pytestmark = pytest.mark.slow

PROMPTS = [
    "Fix the spelling in this sentence and return it: 'The comittee will discus the budjet on "
    "tuesday and every departement must send there report.'",
    "Write a Python function that checks whether a number is prime, with a docstring.",
    "Tell me a short story about a fox and a crow.",
]
N_NEW = 48


@pytest.fixture(scope="module")
def smol() -> LoadedModel:
    return load_model("smollm2", weights="dense")


@pytest.fixture(scope="module")
def references(smol, stock_greedy):
    """(prompt ids, Hugging Face ``generate``'s greedy continuation on the stock model) per prompt."""
    eng = SpeculativeEngine(smol, [])
    return [(ids, stock_greedy(ids, N_NEW, eng.eos_ids())) for ids in map(eng.encode_prompt, PROMPTS)]


@pytest.mark.parametrize("drafter", ["none", "prompt-lookup", "suffix", "self", "early-exit:layers=8"])
def test_greedy_equals_hf_generate(smol, references, drafter):
    eng = SpeculativeEngine(smol, [drafter], k=5)
    drafted = accepted = 0
    for ids, ref in references:
        res = eng.generate(ids, max_new_tokens=N_NEW)
        assert res.token_ids == ref, f"{drafter}: SD output differs from model.generate"
        drafted, accepted = drafted + res.stats.drafted, accepted + res.stats.accepted
    if drafter != "none":  # none: plain decoding through the engine, the baseline
        assert drafted > 0 and accepted > 0


def test_sampling_runs_and_is_reproducible(smol):
    """A seed reproduces the answer when the policies do not read the clock (here UCBSpec);
    auto and the cost-aware policies choose from measured times (README, on seeds)."""
    eng = SpeculativeEngine(smol, ["prompt-lookup", "suffix"], selector="ucbspec", k=4)
    a = eng.generate(PROMPTS[0], max_new_tokens=32, temperature=0.8, top_p=0.95, seed=7)
    b = eng.generate(PROMPTS[0], max_new_tokens=32, temperature=0.8, top_p=0.95, seed=7)
    assert a.token_ids == b.token_ids and len(a.token_ids) > 0


def test_bf16_is_tie_aware_exact(smol, stock_smollm2):
    """bf16 is not batch-invariant, so compare with the tie-aware checker instead of equality,
    against the stock model in bf16."""
    bf = LoadedModel(copy.deepcopy(smol.model).to(torch.bfloat16), smol.tokenizer, "smollm2-bf16")
    stock = copy.deepcopy(stock_smollm2.model).to(torch.bfloat16)
    eng = SpeculativeEngine(bf, ["prompt-lookup"], k=5)
    drafted = 0
    for p in PROMPTS[:2]:
        res = eng.generate(p, max_new_tokens=N_NEW)
        check = check_tie_aware(stock, res.prompt_ids, res.token_ids, max_gap=0.1)
        assert check.ok, f"tokens far from the argmax: {check.violations}"
        drafted += res.stats.drafted
    assert drafted > 0


@pytest.mark.parametrize("selector", ["ucbspec", "exp3spec", "metasd-ucb:reward=bd", "sh", "thompson",
                                      "hedgespec", "cost-ucb", "cost-hedgespec"])
def test_greedy_unchanged_by_drafter_policies(smol, references, selector):
    eng = SpeculativeEngine(smol, ["prompt-lookup", "suffix", "none"], selector=selector, k=4)
    ids, ref = references[0]
    res = eng.generate(ids, max_new_tokens=N_NEW)
    assert res.token_ids == ref
    assert res.stats.drafted > 0 and res.stats.accepted > 0  # the spelling fix copies from the prompt


@pytest.mark.parametrize("length", ["hf-heuristic", "cost-model", "ucbspec-length", "tapout",
                                    "adaedl"])
def test_greedy_unchanged_by_length_policies(smol, references, length):
    eng = SpeculativeEngine(smol, ["early-exit:layers=8", "prompt-lookup"], length=length,
                            selector="round-robin")
    ids, ref = references[1]
    res = eng.generate(ids, max_new_tokens=N_NEW)
    assert res.token_ids == ref
    assert res.stats.drafted > 0 and res.stats.accepted > 0
