"""Greedy speculative decoding must reproduce plain greedy decoding token for token.

Every drafter, several draft lengths and several prompts are compared with Hugging Face's
own ``model.generate(do_sample=False)`` on tiny randomly initialised Llamas, twice: with HF's
initialisation (std 0.02, weakly context-sensitive) and with std 0.3 (``conftest.INIT_STDS``),
whose argmax depends on the context, so a position-id, rollback or catch-up bug changes the
output. Every case also checks that the drafter was exercised (``_check_drafting``): drafts
proposed and some accepted, or, where a case cannot have them, why (``NO_ACCEPTS``), so that no
case passes as plain decoding.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM

from conftest import INIT_STDS, make_tiny_model

from adaspec import SpeculativeEngine
from adaspec.drafters import ModelDrafter, PromptLookupDrafter
from adaspec.models import as_loaded
from adaspec.selection import DrafterPolicy

VOCAB = 32
MAX_NEW = 40


def _random_prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB, (n,), generator=g).tolist()


PROMPTS = {
    "repetitive": [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3],
    "random": _random_prompt(12, seed=123),
    "constant": [5] * 6,
    "single": [7],
}
DRAFTERS = ["none", "prompt-lookup", "suffix", "recycle", "self", "model-other", "model-near"]
#: cases whose drafts are all rejected, and why; every other case (but ``none``, which proposes
#: nothing: the plain-decoding baseline) must have drafts accepted
NO_ACCEPTS = {
    "model-other": "another random model agrees with the target only by chance (1 in 32 a token): "
                   "it exercises the rejection path; model-near has the accepted drafts",
    ("suffix", "std0.3", "random"): "the std-0.3 target's continuation of this random prompt repeats "
                                    "none of the suffixes the drafter matches",
}


@pytest.fixture(scope="module")
def target(init_std) -> LlamaForCausalLM:
    return make_tiny_model(0, VOCAB, init_std=init_std)


@pytest.fixture(scope="module")
def other(init_std) -> LlamaForCausalLM:
    """A different random model with the same vocabulary (a drafter that mostly disagrees)."""
    return make_tiny_model(1, VOCAB, init_std=init_std)


@pytest.fixture(scope="module")
def near(init_std) -> LlamaForCausalLM:
    """The target with 30% noise on every weight: a model drafter that agrees with the target at
    some positions and not at others, so its own KV cache is rolled back mid-block."""
    model = make_tiny_model(0, VOCAB, init_std=init_std)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(5)
        for p in model.parameters():
            p.add_(torch.randn_like(p) * p.std() * 0.3)
    return model


@pytest.fixture(scope="module")
def reference(target):
    """Plain greedy continuations from Hugging Face generate, per prompt name."""
    cache: dict[str, list[int]] = {}

    def get(name: str) -> list[int]:
        if name not in cache:
            prompt = PROMPTS[name]
            with torch.no_grad():
                out = target.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=MAX_NEW)
            cache[name] = out[0, len(prompt):].tolist()
            assert len(cache[name]) == MAX_NEW
        return cache[name]

    return get


def _drafter(spec: str, other: LlamaForCausalLM, near: LlamaForCausalLM | None = None):
    if spec == "model-other":
        return ModelDrafter(as_loaded(other), VOCAB)
    if spec == "model-near":
        return ModelDrafter(as_loaded(near), VOCAB)
    return spec


def _std_name(init_std: float) -> str:
    return next(name for name, std in INIT_STDS.items() if std == init_std)


def _check_drafting(stats, drafter: str, case: tuple[str, ...]) -> None:
    """The drafter proposed drafts, and some were accepted (or ``NO_ACCEPTS`` says why none were,
    and then the rejections ran)."""
    if drafter == "none":
        assert stats.drafted == 0  # the baseline: plain decoding through the engine
        return
    assert stats.drafted > 0, f"{case}: the drafter never proposed anything"
    if drafter in NO_ACCEPTS or case in NO_ACCEPTS:
        assert stats.accepted < stats.drafted, f"{case}: expected rejections"
    else:
        assert stats.accepted > 0, f"{case}: {stats.drafted} drafts proposed, none accepted"


@pytest.mark.parametrize("prompt_name", list(PROMPTS))
@pytest.mark.parametrize("k", [1, 2, 4, 7])
@pytest.mark.parametrize("drafter", DRAFTERS)
def test_greedy_matches_hf_generate(target, other, near, reference, init_std, drafter, k, prompt_name):
    engine = SpeculativeEngine(target, [_drafter(drafter, other, near)], k=k)
    result = engine.generate(PROMPTS[prompt_name], max_new_tokens=MAX_NEW)
    assert result.token_ids == reference(prompt_name)
    _check_drafting(result.stats, drafter, (drafter, _std_name(init_std), prompt_name))
    assert result.prompt_ids == PROMPTS[prompt_name]
    stats = result.stats
    assert stats.new_tokens == MAX_NEW
    assert stats.stop_reason == "max_new_tokens"
    assert all(r.drafted <= k for r in stats.rounds)
    assert sum(r.emitted for r in stats.rounds) == MAX_NEW


def test_self_drafter_accepts_everything(target, reference):
    """A drafter identical to the target is always right under greedy decoding."""
    engine = SpeculativeEngine(target, ["self"], k=4)
    result = engine.generate(PROMPTS["random"], max_new_tokens=MAX_NEW)
    assert result.token_ids == reference("random")
    assert result.stats.acceptance_rate == 1.0
    assert result.stats.n_rounds == MAX_NEW // 5  # 4 drafts + 1 bonus per round


def test_no_drafters_is_plain_decoding(target, reference):
    engine = SpeculativeEngine(target, [], k=3)
    assert engine.drafter_names == ["none"]
    result = engine.generate(PROMPTS["repetitive"], max_new_tokens=MAX_NEW)
    assert result.token_ids == reference("repetitive")
    assert result.stats.n_rounds == MAX_NEW


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_engine_reuse_across_requests_stays_exact(target, other, near, reference, drafter):
    engine = SpeculativeEngine(target, [_drafter(drafter, other, near)], k=4)
    order = ["repetitive", "random", "repetitive", "constant", "random", "single"]
    drafted = accepted = 0
    for name in order:
        result = engine.generate(PROMPTS[name], max_new_tokens=MAX_NEW)
        assert result.token_ids == reference(name), f"request {name!r} diverged"
        drafted, accepted = drafted + result.stats.drafted, accepted + result.stats.accepted
    assert (drafted > 0) == (drafter != "none")
    assert accepted > 0 or drafter in ("none", "model-other")


def test_engine_reuse_with_varying_lengths(target, reference):
    """Shorter and longer requests interleaved on one engine (stale drafter state must not leak)."""
    engine = SpeculativeEngine(target, ["self", "prompt-lookup"], k=7)
    accepted = 0
    for n in (3, MAX_NEW, 1, 17, MAX_NEW):
        result = engine.generate(PROMPTS["random"], max_new_tokens=n)
        assert result.token_ids == reference("random")[:n]
        accepted += result.stats.accepted
    assert accepted > 0


class Alternate(DrafterPolicy):
    """Switches drafter every round: 0, 1, 0, 1, ..."""

    name = "alternate"

    def begin_request(self, drafter_names):
        super().begin_request(drafter_names)
        self.t = 0

    def select(self) -> int:
        return self.t % self.n_arms

    def update(self, feedback) -> None:
        self.t += 1


@pytest.mark.parametrize("pair", [("self", "prompt-lookup"), ("model-other", "suffix"),
                                  ("prompt-lookup", "self"), ("self", "model-other")])
@pytest.mark.parametrize("prompt_name", ["repetitive", "random"])
def test_switching_drafters_stays_exact_and_records_catch_up(target, other, reference, init_std, pair,
                                                             prompt_name):
    drafters = [_drafter(s, other) for s in pair]
    engine = SpeculativeEngine(target, drafters, selector=Alternate(), k=4)
    names = engine.drafter_names
    result = engine.generate(PROMPTS[prompt_name], max_new_tokens=MAX_NEW)
    assert result.token_ids == reference(prompt_name)
    assert result.stats.drafted > 0
    rejecting = [s in NO_ACCEPTS or (s, _std_name(init_std), prompt_name) in NO_ACCEPTS for s in pair]
    assert result.stats.accepted > 0 or all(rejecting), "no draft accepted"

    rounds = result.stats.rounds
    assert len(rounds) >= 3
    assert [r.drafter for r in rounds] == [names[i % 2] for i in range(len(rounds))]
    assert rounds[0].catch_up_tokens == 0
    for prev, cur in zip(rounds, rounds[1:]):
        # the switched-to drafter missed exactly the tokens emitted in the previous round
        assert cur.catch_up_tokens == prev.emitted > 0
        assert cur.catch_up_s > 0
    assert result.stats.to_dict()["catch_up_tokens"] == sum(r.emitted for r in rounds[:-1])
    assert result.stats.time_split["catch_up"] > 0
    assert result.stats.drafter_prefill_s > 0
    assert result.stats.drafter_usage() == {names[0]: (len(rounds) + 1) // 2,
                                            names[1]: len(rounds) // 2}


class FullInfoRecorder(DrafterPolicy):
    """Round-robin over all drafters, recording the counterfactual feedback."""

    name = "full-info-recorder"
    full_information = True

    def begin_request(self, drafter_names):
        super().begin_request(drafter_names)
        self.t = 0
        self.log: list[tuple[int, list[int], dict[int, list[float]] | None]] = []

    def select(self) -> int:
        return self.t % self.n_arms

    def update(self, feedback) -> None:
        cf = None if feedback.counterfactual is None else {
            j: list(g) for j, g in feedback.counterfactual.items()}
        self.log.append((feedback.drafter, list(feedback.emitted), cf))
        self.t += 1


@pytest.mark.parametrize("prompt_name", ["repetitive", "random"])
def test_full_information_counterfactuals(target, other, reference, prompt_name):
    specs = ["prompt-lookup", "self", "none", "suffix", "model-other"]
    policy = FullInfoRecorder()
    engine = SpeculativeEngine(target, [_drafter(s, other) for s in specs], selector=policy, k=4)
    prompt = PROMPTS[prompt_name]
    result = engine.generate(prompt, max_new_tokens=MAX_NEW)
    assert result.token_ids == reference(prompt_name)
    assert result.stats.drafted > 0 and result.stats.accepted > 0

    i_lookup, i_self, i_none, i_other = 0, 1, 2, 4
    assert len(policy.log) == result.stats.n_rounds
    context = list(prompt)
    self_checked = other_checked = 0
    for chosen, emitted, cf in policy.log:
        assert cf is not None
        assert set(cf) == set(range(len(specs)))
        own = cf.pop(chosen)  # the chosen drafter: 1 per accepted draft, 0 for a rejected one
        assert own in ([1.0] * (len(emitted) - 1), [1.0] * (len(emitted) - 1) + [0.0]) or (
            own == [] and chosen == i_none), (chosen, own)
        for j, gammas in cf.items():
            assert len(gammas) == len(emitted)
            assert all(g in (0.0, 1.0) for g in gammas), (j, gammas)
        if i_self in cf:
            assert cf[i_self] == [1.0] * len(emitted)
            self_checked += 1
        if i_none in cf:
            assert cf[i_none] == [0.0] * len(emitted)
        if i_lookup in cf:
            # teacher-forced prompt-lookup proposals on the same prefixes, from a fresh drafter
            fresh = PromptLookupDrafter()
            expect = []
            for m in range(len(emitted)):
                prefix = context + emitted[:m]
                fresh.begin_request(prefix)
                fresh.catch_up(prefix)
                expect.append(1.0 if fresh.propose() == emitted[m] else 0.0)
            assert cf[i_lookup] == expect
        if i_other in cf:
            # the other model's greedy choice at each verified position (full forward);
            # only positions with a clear top-1 margin are compared (no float near-ties)
            with torch.no_grad():
                logits = other(torch.tensor([context + emitted[:-1]])).logits[0, len(context) - 1:]
            top2 = logits.topk(2, dim=-1).values
            for m in range(len(emitted)):
                if top2[m, 0] - top2[m, 1] > 1e-4:
                    assert cf[i_other][m] == float(int(logits[m].argmax()) == emitted[m])
                    other_checked += 1
        context += emitted
    assert context == prompt + result.token_ids
    assert self_checked > 0 and other_checked > 0

    rounds = result.stats.rounds
    # every drafter is brought up to date by the evaluation, so nothing is left to catch up
    assert all(r.catch_up_tokens == 0 for r in rounds)
    assert all(r.eval_s > 0 for r in rounds)
    assert result.stats.time_split["evaluation"] > 0


def test_greedy_scoring_never_computes_the_target_softmax(target, other, reference, monkeypatch):
    """Greedy scores compare argmaxes: scoring every drafter (model-free and a model) on every
    round never reads the target's softmax over the vocabulary (``RoundFeedback.target_probs``,
    ~70 us a round on SmolLM2), and gives the same gammas as above."""
    from adaspec.feedback import RoundFeedback

    def no_softmax(self):
        raise AssertionError("greedy scoring computed the target's softmax")

    monkeypatch.setattr(RoundFeedback, "target_probs", property(no_softmax))
    policy = FullInfoRecorder()
    specs = ["prompt-lookup", "suffix", "model-other"]
    engine = SpeculativeEngine(target, [_drafter(s, other) for s in specs], selector=policy, k=4)
    result = engine.generate(PROMPTS["repetitive"], max_new_tokens=MAX_NEW)
    assert result.token_ids == reference("repetitive")
    assert result.stats.drafted > 0 and result.stats.accepted > 0
    assert all(cf is not None and set(cf) == {0, 1, 2} for _, _, cf in policy.log)


def test_full_information_single_drafter_gets_no_counterfactual(target, reference):
    policy = FullInfoRecorder()
    engine = SpeculativeEngine(target, ["prompt-lookup"], selector=policy, k=4)
    result = engine.generate(PROMPTS["repetitive"], max_new_tokens=MAX_NEW)
    assert result.token_ids == reference("repetitive")
    assert result.stats.drafted > 0 and result.stats.accepted > 0
    assert all(cf is None for _, _, cf in policy.log)


class AlphaRecorder(FullInfoRecorder):
    def update(self, feedback) -> None:
        self.alphas = getattr(self, "alphas", [])
        self.alphas.append((feedback.drafter, list(feedback.emitted),
                            dict(feedback.counterfactual_alpha or {})))
        super().update(feedback)


def test_full_information_alphas_of_realised_tokens(target, reference):
    """alpha_j = 1[proposal == emitted token] under greedy: 1 for the target itself, 0 for none."""
    policy = AlphaRecorder()
    engine = SpeculativeEngine(target, ["self", "none", "prompt-lookup"], selector=policy, k=3)
    prompt = PROMPTS["repetitive"]
    result = engine.generate(prompt, max_new_tokens=MAX_NEW)
    assert result.token_ids == reference("repetitive")
    assert result.stats.drafted > 0 and result.stats.accepted > 0
    for chosen, emitted, alphas in policy.alphas:
        assert set(alphas) == {0, 1, 2} - {chosen}
        if 0 in alphas:
            assert alphas[0] == [1.0] * len(emitted)
        if 1 in alphas:
            assert alphas[1] == [0.0] * len(emitted)
