"""The exactness checkers of ``adaspec.exactness`` (the references of the bf16, batched, tree and
llama.cpp tests), each against a computation written here and each with a negative control: an
output from a speculative engine whose verifier accepts a wrong token
(``adaspec.round.verify_greedy`` patched) must be reported beyond the bound."""

from __future__ import annotations

import pytest
import torch

from conftest import make_tiny_model

from adaspec import SpeculativeEngine
from adaspec.drafters import ModelDrafter
from adaspec.exactness import (NEAR_TIE_NATS, NEAR_TIE_NATS_LLAMACPP, TieCheck, check_tie_aware, divergence_gap,
                               greedy_reference, tie_check)
from adaspec.models import LoadedModel, as_loaded
from adaspec.sampling import Verdict, verify_greedy

pytestmark = pytest.mark.usefixtures("torch_single_thread")

V = 32
PROMPT = [3, 9, 14, 3, 9, 27, 5]
N = 24


@pytest.fixture(scope="module")
def target():
    """Peaky and context-sensitive: a wrong token lies nats below the argmax."""
    return make_tiny_model(0, V, init_std=0.3, lm_head_scale=4.0)


@torch.inference_mode()
def _argmax_loop(model, prompt: list[int], n: int, eos: int | None = None) -> list[int]:
    """Greedy decoding by full forwards without a KV cache (no ``generate``)."""
    seq, out = list(prompt), []
    for _ in range(n):
        tok = int(model(input_ids=torch.tensor([seq])).logits[0, -1].argmax())
        out.append(tok)
        seq.append(tok)
        if tok == eos:
            break
    return out


def _accept_first_draft(target_logits, drafts):
    """BUG: the first draft of every round is accepted whatever the target's argmax."""
    if not drafts:
        return verify_greedy(target_logits, drafts)
    rest = verify_greedy(target_logits[1:], drafts[1:])
    return Verdict(rest.n_accepted + 1, rest.next_token)


def _wrong_acceptance_output(target, monkeypatch) -> list[int]:
    """Greedy output of an engine whose verifier accepts every round's first draft, drafted by
    another random model (which disagrees with the target at most positions)."""
    monkeypatch.setattr("adaspec.round.verify_greedy", _accept_first_draft)
    drafter = ModelDrafter(as_loaded(make_tiny_model(1, V, init_std=0.3, lm_head_scale=4.0)), V)
    res = SpeculativeEngine(target, [drafter], k=2).generate(PROMPT, max_new_tokens=N)
    assert res.stats.drafted > 0 and res.stats.accepted > 0
    return res.token_ids


# -- greedy_reference -------------------------------------------------------------------------------
def test_greedy_reference_is_plain_argmax_decoding(target):
    """``greedy_reference`` (HF ``generate``) equals argmax decoding by full forwards; with an
    EOS id it stops there, the EOS kept. Control: a model with one layer's weights changed gives
    another continuation, so the comparison can fail."""
    want = _argmax_loop(target, PROMPT, N)
    assert greedy_reference(target, PROMPT, N) == want and len(set(want)) > 2
    eos = want[5]
    assert greedy_reference(target, PROMPT, N, eos_token_id=eos) == want[:want.index(eos) + 1]
    other = make_tiny_model(0, V, init_std=0.3, lm_head_scale=4.0)
    with torch.no_grad():
        other.model.layers[0].mlp.down_proj.weight.mul_(-1.0)
    assert greedy_reference(other, PROMPT, N) != want


# -- tie_check --------------------------------------------------------------------------------------
def test_tie_check_counts_exact_ties_and_violations():
    """Row j judges token j: the argmax is exact, a token within the bound a tie, one beyond it a
    violation; every non-argmax position is a divergence with its gap in nats."""
    logits = torch.tensor([[2.0, 0.0, -1.0],    # argmax 0
                           [1.0, 1.0 - 0.03, -5.0],  # 1 is 0.03 nats below 0: a tie
                           [0.0, 3.0, 0.0]])    # 0 is 3 nats below 1: a violation
    got = tie_check(logits, [0, 1, 0], max_gap=0.05)
    assert (got.ok, got.n_tokens, got.n_exact, got.n_ties) == (False, 3, 1, 1)
    assert [j for j, _ in got.violations] == [2] and got.violations[0][1] == pytest.approx(3.0)
    assert [j for j, _ in got.divergences] == [1, 2]
    assert got.divergences[0][1] == pytest.approx(0.03, abs=1e-6)
    control = tie_check(logits, [0, 2, 1], 0.05)  # token 2 at row 1 is 6 nats below the argmax
    assert not control.ok and control.n_ties == 0 and [j for j, _ in control.violations] == [1]
    assert tie_check(logits, [0, 0, 1], 0.05) == TieCheck(True, 3, 3, 0)
    # one bound per position: the 3-nat gap passes under a bound of 3.5 at that position only
    assert tie_check(logits, [0, 1, 0], [0.05, 0.05, 3.5]).ok
    assert not tie_check(logits, [0, 1, 0], [0.05, 0.01, 3.5]).ok
    assert tie_check(logits[:0], [], 0.05) == TieCheck(True, 0, 0, 0)
    with pytest.raises(ValueError, match="one logits row per output token"):
        tie_check(logits, [0, 1], 0.05)
    with pytest.raises(ValueError, match="2 bounds for 3 tokens"):
        tie_check(logits, [0, 1, 0], [0.05, 0.05])


# -- check_tie_aware --------------------------------------------------------------------------------
def test_check_tie_aware_passes_plain_greedy_output(target):
    check = check_tie_aware(target, PROMPT, greedy_reference(target, PROMPT, N))
    assert check.ok and (check.n_tokens, check.n_exact, check.n_ties) == (N, N, 0) and not check.divergences


def test_check_tie_aware_accepts_an_exact_tie_and_judges_every_position():
    """A model in which two tokens have the same embedding and output rows has exact ties:
    emitting the other of the two (the argmax takes the lower id) is a tie (gap 0) at every
    position where it happens, not only at the first."""
    model = make_tiny_model(0, V, init_std=0.3, lm_head_scale=4.0)
    out = greedy_reference(model, PROMPT, N)
    a = max((t for t in set(out) if t < V - 1), key=out.count)
    b = max(t for t in range(a + 1, V) if t not in out and t not in PROMPT)
    with torch.no_grad():
        model.lm_head.weight[b] = model.lm_head.weight[a]
        model.model.embed_tokens.weight[b] = model.model.embed_tokens.weight[a]
    swapped = [b if t == a else t for t in out]  # the same continuation: a and b are one token
    assert greedy_reference(model, PROMPT, N) == out and out.count(a) >= 2
    check = check_tie_aware(model, PROMPT, swapped)
    assert check.ok and check.n_ties == out.count(a) and check.n_exact == N - out.count(a)
    assert [j for j, _ in check.divergences] == [j for j, t in enumerate(out) if t == a]
    assert all(g == pytest.approx(0.0, abs=1e-6) for _, g in check.divergences)


def test_check_tie_aware_rejects_an_engine_that_accepts_wrong_tokens(target, monkeypatch):
    """Negative control: the output of a verifier that accepts every round's first draft has
    tokens a whole margin below the argmax; the checker reports them, beyond both bounds."""
    wrong = _wrong_acceptance_output(target, monkeypatch)
    assert wrong != greedy_reference(target, PROMPT, N)
    check = check_tie_aware(target, PROMPT, wrong)
    assert not check.ok and check.violations
    assert max(g for _, g in check.violations) > NEAR_TIE_NATS_LLAMACPP
    assert check.violations == [(j, g) for j, g in check.divergences if g > NEAR_TIE_NATS]


# -- divergence_gap ---------------------------------------------------------------------------------
class _OneTokenForwards(LoadedModel):
    """The transformers backend declared not batch-invariant, recording its forwards' widths."""

    batch_invariant = False

    def __post_init__(self) -> None:
        super().__post_init__()
        self.widths: list[int] = []
        self.live = 0

    def new_state(self):
        self.live += 1
        return super().new_state()

    def release(self, state) -> None:
        self.live -= 1

    def forward(self, state, ids, keep=1, hidden=False):
        self.widths.append(len(ids))
        return super().forward(state, ids, keep, hidden)


def _logp_after(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, -1].double(), -1)


def test_divergence_gap_measures_the_first_difference(target):
    ref = greedy_reference(target, PROMPT, N)
    backend = as_loaded(target)
    assert divergence_gap(backend, PROMPT, ref, ref) == (N, None)
    assert divergence_gap(backend, PROMPT, ref, ref[:10]) == (10, None)  # a prefix: length only
    lp = _logp_after(target, PROMPT + ref[:6])
    near = int(torch.topk(lp, 2).indices[1])  # the runner-up at position 6
    at, gap = divergence_gap(backend, PROMPT, ref, [*ref[:6], near, *ref[7:]])
    assert at == 6 and gap == pytest.approx(float(lp[ref[6]] - lp[near]), abs=1e-4)
    # control: the least likely token there is far beyond every bound
    far = int(lp.argmin())
    at, gap = divergence_gap(backend, PROMPT, ref, [*ref[:6], far])
    assert at == 6 and gap > NEAR_TIE_NATS_LLAMACPP and gap == pytest.approx(float(lp[ref[6]] - lp[far]), abs=1e-4)


def test_divergence_gap_follows_plain_decoding_where_blocks_differ(target):
    """On a backend that is not batch-invariant the gap comes from the path plain decoding took:
    ``prefill``, then one token at a time (no block forward), and the state is released."""
    ref = greedy_reference(target, PROMPT, N)
    backend = _OneTokenForwards(target, None, "one-token")
    lp = _logp_after(target, PROMPT + ref[:5])
    other = int(torch.topk(lp, 3).indices[2])
    at, gap = divergence_gap(backend, PROMPT, ref, [*ref[:5], other])
    assert at == 5 and gap == pytest.approx(float(lp[ref[5]] - lp[other]), abs=1e-4)
    assert backend.widths == [len(PROMPT) - 1] + [1] * 6 and backend.live == 0


def test_divergence_gap_flags_an_engine_that_accepts_wrong_tokens(target, monkeypatch):
    """Negative control: the first difference of a wrong-acceptance output from plain decoding
    lies beyond the bound."""
    ref = greedy_reference(target, PROMPT, N)
    wrong = _wrong_acceptance_output(target, monkeypatch)
    at, gap = divergence_gap(as_loaded(target), PROMPT, ref, wrong)
    assert at < N and gap is not None and gap > NEAR_TIE_NATS_LLAMACPP
