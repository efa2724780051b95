"""End-to-end exactness of speculative sampling on tiny models.

Speculative sampling must leave the output distribution equal to the target's processed
distribution (temperature, top-k, top-p applied exactly as ``adaspec.sampling.process_logits``
does), whatever the drafter. For a fixed prompt we compute the exact target distribution of the
first n generated tokens by enumerating all V**n continuations with model forwards, run
``SpeculativeEngine.generate`` with many seeds and compare the empirical distribution of the
generated n-tuples with a chi-square goodness-of-fit test at significance level
ALPHA = 0.001 (cells with expected count < 5 merged). Every test also checks that the drafter
was exercised (drafts proposed, some accepted and some rejected) so it cannot pass vacuously,
and that no token outside the target's support is ever emitted.

Seeds are fixed (``seed=s`` for s in a fixed range), so the tests are deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Sequence

import numpy as np
import pytest
import torch
from transformers import DynamicCache

from adaspec import SpeculativeEngine
from adaspec.config import SamplingConfig
from adaspec.costs import CostModel, VerifyCostCurve
from adaspec.drafters import ModelDrafter, PromptLookupDrafter
from adaspec.models import as_loaded
from adaspec.sampling import Verdict, process_logits, sample, verify_sampling
from conftest import chisquare_gof, make_tiny_model

pytestmark = pytest.mark.usefixtures("torch_single_thread")

ALPHA = 0.001  # significance level of every chi-square test in this file
N_RUNS = 3000  # generate() calls per configuration

V = 12  # vocabulary of the 2-token tests
# Tiny models with init std 0.2 (instead of HF's 0.02) attend sharply, so the next-token
# distribution depends strongly on the context (a stale or missing KV entry changes it a lot),
# and lm_head scale 1.5 makes it peaky: max next-token probability ~0.37 after PROMPT.
INIT_STD = 0.2
TARGET_SCALE = 1.5
PROMPT = [3, 7, 1, 9, 4]
# prompt-lookup: the 2-gram (10, 2) recurs, so the drafter proposes 11 (target p(11) ~ 0.37)
PLD_PROMPT = [10, 2, 11, 10, 2, 11, 10, 2]


@pytest.fixture(scope="module")
def target():
    return make_tiny_model(seed=0, vocab=V, init_std=INIT_STD, lm_head_scale=TARGET_SCALE)


@pytest.fixture(scope="module")
def bad_drafter_model():
    # a different random model, made peakier so that it is confidently wrong: 1 - TV(p, q) at
    # the first position is ~0.3-0.5, so acceptance and residual resampling both run a lot
    return make_tiny_model(seed=123, vocab=V, init_std=INIT_STD, lm_head_scale=5.0)


# -- helpers ----------------------------------------------------------------------------------
@torch.inference_mode()
def exact_distribution(model, prompt: Sequence[int], cfg: SamplingConfig, n_tokens: int) -> np.ndarray:
    """P(first ``n_tokens`` generated tokens = t_1..t_n) under ``cfg``, as an array [V]*n.

    Enumerates every prefix: step j runs one batched forward over the V**j prefixes of
    length j and multiplies in the processed next-token distribution.
    """
    vocab = model.config.vocab_size
    joint = np.ones(1, dtype=np.float64)
    prefixes = torch.empty(1, 0, dtype=torch.long)
    base = torch.tensor(list(prompt), dtype=torch.long)
    for _ in range(n_tokens):
        ids = torch.cat([base.expand(prefixes.shape[0], -1), prefixes], dim=1)
        logits = model(input_ids=ids).logits[:, -1, :]
        probs = process_logits(logits, cfg).double().numpy()  # [n_prefixes, V]
        joint = (joint[:, None] * probs).reshape(-1)
        prefixes = torch.cat([prefixes.repeat_interleave(vocab, dim=0),
                              torch.arange(vocab).repeat(prefixes.shape[0])[:, None]], dim=1)
    return joint.reshape((vocab,) * n_tokens)


@dataclass
class Runs:
    counts: np.ndarray  # [V]*n counts of generated n-tuples
    drafted: int
    accepted: int
    rounds: int


def run_engine(engine: SpeculativeEngine, prompt: Sequence[int], n_tokens: int, *,
               n_runs: int = N_RUNS, seed0: int = 0, **sampling) -> Runs:
    vocab = engine.target.vocab_size
    counts = np.zeros((vocab,) * n_tokens, dtype=np.int64)
    drafted = accepted = rounds = 0
    for s in range(seed0, seed0 + n_runs):
        res = engine.generate(list(prompt), max_new_tokens=n_tokens, seed=s, **sampling)
        assert len(res.token_ids) == n_tokens, res.token_ids
        assert res.stats.stop_reason == "max_new_tokens"
        counts[tuple(res.token_ids)] += 1
        drafted += res.stats.drafted
        accepted += res.stats.accepted
        rounds += res.stats.n_rounds
    return Runs(counts, drafted, accepted, rounds)


def check_exact(runs: Runs, exact: np.ndarray, what: str, bug: str | None = None) -> None:
    """Support check plus chi-square goodness of fit at level ALPHA; with ``bug`` (a negative
    control, see ``inject``) the same test must instead *reject* at level ALPHA. Also the check
    of the batched and served sampling tests (``tests/test_batch.py``, ``tests/test_serve_batch.py``)."""
    # the drafter was really used: drafts were proposed, and both branches of the rule ran
    assert runs.drafted > 0, f"{what}: the drafter never proposed anything"
    stat, pvalue, cells = chisquare_gof(runs.counts, exact)
    if bug is not None:
        assert pvalue < ALPHA, (
            f"negative control {bug!r} ({what}) was NOT detected: chi-square {stat:.1f} over {cells} "
            f"cells, p = {pvalue:.3g} >= alpha = {ALPHA}; the harness lacks power for this bug")
        return
    assert 0 < runs.accepted < runs.drafted, (
        f"{what}: accepted {runs.accepted} of {runs.drafted} drafts; need both accept and reject")
    outside = runs.counts[exact == 0].sum()
    assert outside == 0, f"{what}: {outside} outputs outside the target's support"
    assert pvalue > ALPHA, (
        f"{what}: chi-square {stat:.1f} over {cells} cells, p = {pvalue:.2e} < alpha = {ALPHA} "
        f"(acceptance {runs.accepted}/{runs.drafted})")


# -- negative controls: deliberately broken verifiers, drafters and caches ----------------------
# Each bug is injected into the engine and the *same* test (same seeds, same number of runs)
# must then reject exactness at level ALPHA: this shows that the harness can fail.
def _residual_from_p(p, drafts, q, generator):
    """BUG: after a rejection, the correction token is drawn from p instead of norm((p - q)+)."""
    v = verify_sampling(p, drafts, q, generator)
    if v.n_accepted < len(drafts):
        return Verdict(v.n_accepted, sample(p[v.n_accepted], generator))
    return v


def _bonus_from_wrong_row(p, drafts, q, generator):
    """BUG: when every draft is accepted, the bonus token is drawn from the last drafted
    position's row p[K-1] instead of p[K]."""
    v = verify_sampling(p, drafts, q, generator)
    if drafts and v.n_accepted == len(drafts):
        return Verdict(v.n_accepted, sample(p[len(drafts) - 1], generator))
    return v


def _no_crop(cache: DynamicCache, max_length: int) -> None:
    """BUG: the target's KV cache is not rolled back after a rejection (DynamicCache.crop
    does nothing; the class itself is patched: ``transformers`` may re-register its lazy
    module, so patching the ``transformers.DynamicCache`` attribute is not reliable)."""


class DenseQLookup(PromptLookupDrafter):
    """BUG: a model-free (deterministic) drafter that reports a dense uniform q instead of a
    one-hot one, so the verifier accepts with min(1, p(y) V) instead of p(y)."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab = vocab

    def draft(self, context, max_tokens, sampling, generator, decide, want_hidden=False):
        d = super().draft(context, max_tokens, sampling, generator, decide, want_hidden)
        if d.tokens:
            d.probs = torch.full((len(d.tokens), self.vocab), 1.0 / self.vocab)
        return d


BUGS = {"residual-from-p": ("adaspec.round.verify_sampling", _residual_from_p),
        "bonus-from-wrong-row": ("adaspec.round.verify_sampling", _bonus_from_wrong_row),
        "cache-not-rolled-back": (DynamicCache, "crop", _no_crop)}


def inject(bug: str | None, monkeypatch) -> None:
    """Patch the engine with a named bug (None: nothing; drafter bugs are built by the test)."""
    if bug in BUGS:
        monkeypatch.setattr(*BUGS[bug])


# -- sanity of the reference computation -------------------------------------------------------
def test_exact_distribution_is_a_distribution_and_uses_processing(target):
    cfg = SamplingConfig(temperature=1.0, top_k=5)
    exact = exact_distribution(target, PROMPT, cfg, 2)
    assert exact.shape == (V, V)
    assert exact.sum() == pytest.approx(1.0, abs=1e-5)  # float32 probabilities
    # top-k 5 on both positions: 5 first tokens, 5 second tokens after each
    assert (exact.sum(1) > 0).sum() == 5
    assert all((exact[a] > 0).sum() == 5 for a in range(V) if exact[a].sum() > 0)
    # the target is far from uniform ...
    assert exact.max() > 4.0 / (V * V)
    # ... and the second token depends strongly on the first (context-sensitive model), so a
    # wrong KV cache would change the pair distribution
    full = exact_distribution(target, PROMPT, SamplingConfig(temperature=1.0), 2)
    independent = np.outer(full.sum(1), full.sum(0))
    assert 0.5 * np.abs(full - independent).sum() > 0.1


def test_plain_sampling_matches_exact_distribution(target):
    """Baseline (no drafter): the reference computation and the engine agree.
    Chi-square test at alpha = 0.001."""
    engine = SpeculativeEngine(target, ["none"], k=4)
    cfg = SamplingConfig(temperature=1.0)
    exact = exact_distribution(target, PROMPT, cfg, 2)
    runs = run_engine(engine, PROMPT, 2, n_runs=1000, seed0=50_000, temperature=1.0)
    assert runs.drafted == 0
    stat, pvalue, cells = chisquare_gof(runs.counts, exact)
    assert pvalue > ALPHA, f"plain sampling: chi-square {stat:.1f} over {cells} cells, p = {pvalue:.2e}"


# -- (a) a deliberately bad model drafter -------------------------------------------------------
@pytest.mark.parametrize("bug", [None, "residual-from-p"])
def test_bad_model_drafter_is_exact(target, bad_drafter_model, bug, monkeypatch):
    """A different random model as drafter (dense q, acceptance ~0.5) at a high sampling
    temperature (1.5): the 2-token output distribution equals the target's.
    Chi-square test at alpha = 0.001 over 3000 seeds; the negative control (correction token
    drawn from p, not norm((p - q)+)) must be rejected at the same level."""
    inject(bug, monkeypatch)
    temperature = 1.5
    drafter = ModelDrafter(as_loaded(bad_drafter_model), V)
    engine = SpeculativeEngine(target, [drafter], k=4)
    cfg = SamplingConfig(temperature=temperature)
    exact = exact_distribution(target, PROMPT, cfg, 2)
    runs = run_engine(engine, PROMPT, 2, seed0=0, temperature=temperature)
    # max_new_tokens=2 caps the first round at 1 draft (the bonus is the second token)
    assert runs.drafted >= N_RUNS
    check_exact(runs, exact, f"bad model drafter, T={temperature}", bug)
    # the drafter is really bad: many rejections
    assert runs.accepted < 0.8 * runs.drafted


# -- (b) prompt lookup: one-hot proposals --------------------------------------------------------
@pytest.mark.parametrize("bug", [None, "dense-q-model-free", "bonus-from-wrong-row"])
def test_prompt_lookup_drafter_is_exact(target, bug, monkeypatch):
    """Prompt lookup (deterministic, one-hot q) on a prompt with repeats: the 2-token output
    distribution equals the target's. Chi-square test at alpha = 0.001 over 3000 seeds; the
    negative controls (the draft reported with a dense q; the bonus token drawn from the
    drafted position's row) must be rejected at the same level."""
    inject(bug, monkeypatch)
    drafter = DenseQLookup(V) if bug == "dense-q-model-free" else PromptLookupDrafter()
    engine = SpeculativeEngine(target, [drafter], k=4)
    cfg = SamplingConfig(temperature=1.0)
    exact = exact_distribution(target, PLD_PROMPT, cfg, 2)
    runs = run_engine(engine, PLD_PROMPT, 2, seed0=10_000, temperature=1.0)
    assert runs.drafted >= N_RUNS  # it proposes at every first round
    check_exact(runs, exact, "prompt lookup", bug)


# -- (c) temperature / top-p / top-k processing --------------------------------------------------
@pytest.mark.parametrize("sampling", [
    dict(temperature=0.7, top_p=0.9),
    dict(temperature=1.0, top_k=5),
], ids=["T0.7-top_p0.9", "T1.0-top_k5"])
def test_processed_sampling_is_exact(target, bad_drafter_model, sampling):
    """With temperature + top-p and temperature + top-k the output follows the *processed*
    target distribution (p and q are processed identically). Model drafter (dense q); the
    support is checked exactly and the distribution by a chi-square test at alpha = 0.001."""
    drafter = ModelDrafter(as_loaded(bad_drafter_model), V)
    engine = SpeculativeEngine(target, [drafter], k=3)
    cfg = SamplingConfig(**sampling)
    exact = exact_distribution(target, PROMPT, cfg, 2)
    # the processing really removes tokens, otherwise this would not test it
    assert (exact == 0).sum() > V
    runs = run_engine(engine, PROMPT, 2, seed0=20_000, **sampling)
    check_exact(runs, exact, f"processed sampling {sampling}")


def test_prompt_lookup_with_top_k_is_exact(target):
    """One-hot proposals with top-k: a proposal outside the top-k must always be rejected and
    the output follows the processed target. Chi-square test at alpha = 0.001."""
    engine = SpeculativeEngine(target, [PromptLookupDrafter()], k=2)
    sampling = dict(temperature=0.8, top_k=4)
    exact = exact_distribution(target, PLD_PROMPT, SamplingConfig(**sampling), 2)
    runs = run_engine(engine, PLD_PROMPT, 2, n_runs=1500, seed0=30_000, **sampling)
    assert runs.drafted > 0 and 0 < runs.accepted < runs.drafted
    stat, pvalue, cells = chisquare_gof(runs.counts, exact)
    assert runs.counts[exact == 0].sum() == 0
    assert pvalue > ALPHA, f"chi-square {stat:.1f} over {cells} cells, p = {pvalue:.2e}"


# -- multi-token blocks: K >= 2 drafts per round, cache rollback across rounds -------------------
V3 = 8
PROMPT3 = [3, 7, 1, 1, 4]


@pytest.mark.parametrize("drafter_kind, bug", [("model", None), ("prompt-lookup", None),
                                                ("prompt-lookup", "cache-not-rolled-back")])
def test_three_tokens_with_multi_token_blocks(drafter_kind, bug, monkeypatch):
    """max_new_tokens=3 lets the first round draft 2 tokens (k=3 capped by the budget), so the
    block rule, the target KV-cache crop after a rejection and the drafter's catch-up in later
    rounds all run. The exact distribution over all V**3 = 512 triples is compared by a
    chi-square test at alpha = 0.001 (sparse cells merged) over 3000 seeds. The negative
    control (the target's cache keeps the rejected drafts) must be rejected at that level."""
    inject(bug, monkeypatch)
    target = make_tiny_model(seed=0, vocab=V3, init_std=INIT_STD)
    if drafter_kind == "model":
        bad = make_tiny_model(seed=123, vocab=V3, init_std=INIT_STD, lm_head_scale=2.0)
        drafter = ModelDrafter(as_loaded(bad), V3)
        prompt = PROMPT3
    else:
        drafter = PromptLookupDrafter()
        prompt = [7, 3, 4, 7, 3, 4, 7, 3]  # proposes 4 (p ~0.57), then 7 (p ~0.16)
    engine = SpeculativeEngine(target, [drafter], k=3)
    cfg = SamplingConfig(temperature=1.0)
    exact = exact_distribution(target, prompt, cfg, 3)
    runs = run_engine(engine, prompt, 3, seed0=40_000, temperature=1.0)
    check_exact(runs, exact, f"3 tokens, {drafter_kind} drafter", bug)
    if bug is not None:
        return
    # blocks of 2 were drafted (more drafts than rounds that could draft at most 1)
    assert runs.drafted > N_RUNS
    # and marginals of the first two tokens agree too (a coarser, more powerful view)
    stat, pvalue, cells = chisquare_gof(runs.counts.sum(-1), exact.sum(-1))
    assert pvalue > ALPHA, f"first-two marginal: chi-square {stat:.1f}, p = {pvalue:.2e}"


class FixedCosts(CostModel):
    """A cost model with fixed numbers: a verify-cost curve with a cliff and a constant draft
    cost per token; the engine's measured round times are ignored, so the cost-model length
    policy decides the same way on every machine (no wall-clock input)."""

    CURVE = VerifyCostCurve(ks=[1, 2, 3, 4, 6, 8], seconds=[1.0, 1.1, 1.9, 1.2, 1.5, 2.4], context=16)

    def __init__(self):
        super().__init__(self.CURVE)
        self.draft_token_s = {0: 0.15}

    def observe(self, *args, **kwargs) -> None:
        pass


@pytest.mark.parametrize("length", ["max-confidence:threshold=0.5", "tapout:seed=1", "cost-model"])
def test_adaptive_length_policies_keep_the_distribution(length, monkeypatch):
    """A length policy only decides how many tokens to verify, never which ones are emitted:
    with an adaptive rule (its decisions depend on the drafter's q and on what it learnt) the
    3-token output distribution still equals the target's, chi-square at alpha = 0.001. The
    cost-model rule gets fixed costs (``FixedCosts``), not measured ones."""
    target = make_tiny_model(seed=0, vocab=V3, init_std=INIT_STD)
    bad = make_tiny_model(seed=123, vocab=V3, init_std=INIT_STD, lm_head_scale=2.0)
    monkeypatch.setattr("adaspec.engine.load_or_measure", lambda *a, **k: FixedCosts.CURVE)  # no timing
    engine = SpeculativeEngine(target, [ModelDrafter(as_loaded(bad), V3)], length=length)
    if length == "cost-model":
        engine.cost_model = engine.length.costs = FixedCosts()
    cfg = SamplingConfig(temperature=1.0)
    exact = exact_distribution(target, PROMPT3, cfg, 3)
    runs = run_engine(engine, PROMPT3, 3, seed0=50_000, temperature=1.0)
    check_exact(runs, exact, f"3 tokens, length policy {length}")


# -- longer outputs: drafter switching, catch-up and full-information evaluation ---------------
V6 = 5
N6 = 6  # generated tokens: 3-5 rounds per request, so switching and catch-up happen mid-request
N_RUNS6 = 1000
PROMPT6 = [1, 3, 2, 4, 1, 3, 2, 4, 1, 3]  # repeats: prompt lookup proposes from the first round


@pytest.mark.parametrize("selector", ["round-robin", "hedgespec"], ids=["switching+catch-up", "full-information"])
def test_six_tokens_with_switching_catch_up_and_full_information(selector):
    """Two drafters (a bad model drafter with dense q, and prompt lookup with one-hot q) over
    6 tokens (k=2, so 3+ rounds): round-robin switches drafter every round, so each drafter
    catches up on the tokens the other produced; hedgespec (full information) scores every
    other drafter on the verified tokens each round. The output distribution over all
    V**6 = 15625 sequences must equal the target's: chi-square tests at alpha = 0.001 on the
    joint distribution (sparse cells merged) and on each position's marginal (7 tests, so a
    family-wise level of at most 0.007 by Bonferroni), over 1000 fixed seeds."""
    target = make_tiny_model(seed=0, vocab=V6, init_std=0.3, lm_head_scale=2.0)
    bad = make_tiny_model(seed=7, vocab=V6, init_std=0.3, lm_head_scale=3.0)
    engine = SpeculativeEngine(target, [ModelDrafter(as_loaded(bad), V6), PromptLookupDrafter()],
                               selector=selector, k=2)
    exact = exact_distribution(target, PROMPT6, SamplingConfig(temperature=1.0), N6)
    runs = run_engine(engine, PROMPT6, N6, n_runs=N_RUNS6, seed0=60_000, temperature=1.0)
    check_exact(runs, exact, f"6 tokens, {selector}")
    assert runs.rounds >= 3 * N_RUNS6  # several rounds per request: switching happened
    for pos in range(N6):
        axes = tuple(a for a in range(N6) if a != pos)
        stat, pvalue, cells = chisquare_gof(runs.counts.sum(axis=axes), exact.sum(axis=axes))
        assert pvalue > ALPHA, f"{selector}: marginal of token {pos}: chi-square {stat:.1f}, p = {pvalue:.2e}"
