"""Unit tests of adaspec.sampling: logit processing and the speculative verification step.

The statistical tests use fixed ``torch.Generator`` seeds, so they are deterministic. Rates are
compared with their analytic value within 4 standard errors; distributions are compared by a
chi-square goodness-of-fit test at significance level ALPHA = 0.001.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from adaspec.config import SamplingConfig
from adaspec.sampling import (Verdict, acceptance_probability, process_logits, sample,
                              verify_greedy, verify_sampling)
from conftest import chisquare_gof

pytestmark = pytest.mark.usefixtures("torch_single_thread")

ALPHA = 0.001  # significance level of every chi-square test in this file
N_TRIALS = 20_000


def _cfg(temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> SamplingConfig:
    return SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p)


def _dist(*values: float) -> torch.Tensor:
    t = torch.tensor(values, dtype=torch.float64)
    return (t / t.sum()).float()


# Fixed analytic distributions over V = 6 tokens (p: target, q: drafter).
P = _dist(0.30, 0.25, 0.20, 0.12, 0.08, 0.05)
Q = _dist(0.05, 0.10, 0.15, 0.20, 0.20, 0.30)
P_BONUS = _dist(0.10, 0.10, 0.40, 0.20, 0.15, 0.05)
P2 = _dist(0.05, 0.40, 0.05, 0.30, 0.10, 0.10)
Q2 = _dist(0.25, 0.25, 0.10, 0.10, 0.20, 0.10)


def _tv(p: torch.Tensor, q: torch.Tensor) -> float:
    return 0.5 * float((p.double() - q.double()).abs().sum())


def _assert_rate(successes: int, n: int, expected: float, what: str) -> None:
    """Empirical rate within 4 standard errors of the analytic one."""
    se = math.sqrt(max(expected * (1 - expected), 1e-12) / n)
    rate = successes / n
    assert abs(rate - expected) <= 4 * se + 1e-12, (
        f"{what}: empirical {rate:.4f} vs analytic {expected:.4f} (4 SE = {4 * se:.4f})")


def _assert_follows(samples: list[int], probs: torch.Tensor, what: str) -> None:
    """Chi-square goodness of fit of ``samples`` to ``probs`` at level ALPHA."""
    assert samples, f"{what}: no samples"
    counts = np.bincount(np.asarray(samples), minlength=probs.numel())
    stat, pvalue, cells = chisquare_gof(counts, probs.double().numpy())
    assert pvalue > ALPHA, (
        f"{what}: chi-square {stat:.1f} over {cells} cells, p = {pvalue:.2e} < {ALPHA}; "
        f"counts {counts.tolist()} vs expected {(probs.double().numpy() * len(samples)).round(1).tolist()}")


# -- process_logits -------------------------------------------------------------------------
class TestProcessLogits:
    def test_temperature_scales_logits(self):
        logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, 0.0], [0.3, -0.2, 1.5, 0.0, 2.2]])
        for t in (0.25, 0.7, 1.0, 2.5):
            out = process_logits(logits, _cfg(temperature=t))
            torch.testing.assert_close(out, torch.softmax(logits / t, dim=-1))

    def test_temperature_one_is_softmax_and_input_untouched(self):
        logits = torch.randn(3, 7, generator=torch.Generator().manual_seed(0))
        before = logits.clone()
        out = process_logits(logits, _cfg())
        torch.testing.assert_close(out, torch.softmax(logits, -1))
        assert torch.equal(logits, before)

    def test_greedy_config_is_rejected(self):
        with pytest.raises(ValueError):
            process_logits(torch.zeros(4), SamplingConfig(temperature=0.0))

    @pytest.mark.parametrize("k", [1, 2, 3, 7, 9])
    def test_top_k_keeps_exactly_the_k_largest(self, k):
        g = torch.Generator().manual_seed(k)
        logits = torch.randn(4, 10, generator=g)  # continuous values: no ties
        out = process_logits(logits, _cfg(temperature=0.8, top_k=k))
        top = torch.topk(logits, k, dim=-1).indices
        for row in range(logits.shape[0]):
            kept = set(torch.nonzero(out[row] > 0).flatten().tolist())
            assert kept == set(top[row].tolist())
            # inside the kept set, the distribution is the renormalised tempered softmax
            ref = torch.softmax(logits[row, top[row]] / 0.8, dim=-1)
            torch.testing.assert_close(out[row, top[row]], ref)

    @pytest.mark.parametrize("k", [0, 10, 50])
    def test_top_k_disabled_or_wider_than_vocab(self, k):
        logits = torch.randn(2, 10, generator=torch.Generator().manual_seed(3))
        torch.testing.assert_close(process_logits(logits, _cfg(top_k=k)), torch.softmax(logits, -1))

    @pytest.mark.parametrize("top_p", [0.05, 0.3, 0.5, 0.77, 0.9, 0.99])
    def test_top_p_keeps_the_smallest_prefix_reaching_top_p(self, top_p):
        g = torch.Generator().manual_seed(int(top_p * 1000))
        logits = 2.0 * torch.randn(5, 12, generator=g)
        out = process_logits(logits, _cfg(top_p=top_p))
        probs = torch.softmax(logits.double(), -1)
        for row in range(logits.shape[0]):
            sp, order = torch.sort(probs[row], descending=True)
            cum = torch.cumsum(sp, 0)
            # make sure the case is not a floating-point tie at the boundary
            assert torch.all((cum - top_p).abs() > 1e-6)
            m = int((cum < top_p).sum()) + 1  # smallest m with cum[m-1] >= top_p
            m = min(m, len(sp))
            assert cum[m - 1] >= top_p and (m == 1 or cum[m - 2] < top_p)
            expected_kept = set(order[:m].tolist())
            kept = set(torch.nonzero(out[row] > 0).flatten().tolist())
            assert kept == expected_kept, f"row {row}: kept {sorted(kept)}, expected {sorted(expected_kept)}"
            idx = order[:m]
            torch.testing.assert_close(out[row, idx].double(), sp[:m] / sp[:m].sum(),
                                       rtol=1e-5, atol=1e-6)

    def test_top_p_always_keeps_the_most_likely_token(self):
        logits = torch.tensor([5.0, 1.0, 0.0, -1.0])
        out = process_logits(logits, _cfg(top_p=1e-6))
        assert out.tolist() == [1.0, 0.0, 0.0, 0.0]

    def test_top_k_then_top_p_on_the_renormalised_distribution(self):
        # top-k first (like HF): top_p is measured on the renormalised top-k distribution
        logits = torch.log(torch.tensor([0.40, 0.25, 0.15, 0.10, 0.06, 0.04]))
        out = process_logits(logits, _cfg(top_k=3, top_p=0.75))
        # top-3 renormalised: .40/.80=.5, .25/.80=.3125, .15/.80=.1875 -> cum .5, .8125 >= .75
        kept = torch.nonzero(out > 0).flatten().tolist()
        assert kept == [0, 1]
        torch.testing.assert_close(out[:2], torch.tensor([0.40, 0.25]) / 0.65)

    @pytest.mark.parametrize("cfg", [
        _cfg(), _cfg(temperature=0.3), _cfg(temperature=1.7, top_k=4),
        _cfg(temperature=0.9, top_p=0.6), _cfg(temperature=0.7, top_k=8, top_p=0.85)])
    def test_rows_sum_to_one_for_any_batch_shape(self, cfg):
        logits = 3 * torch.randn(2, 3, 16, generator=torch.Generator().manual_seed(1))
        out = process_logits(logits, cfg)
        assert out.shape == logits.shape
        assert out.dtype == torch.float32
        assert torch.all(out >= 0)
        torch.testing.assert_close(out.sum(-1), torch.ones(2, 3))
        # batched processing equals row-by-row processing
        for i in range(2):
            for j in range(3):
                torch.testing.assert_close(out[i, j], process_logits(logits[i, j], cfg))

    def test_half_precision_logits_become_float32(self):
        logits = torch.randn(2, 9, generator=torch.Generator().manual_seed(2)).half()
        out = process_logits(logits, _cfg(top_k=4))
        assert out.dtype == torch.float32
        torch.testing.assert_close(out.sum(-1), torch.ones(2))


# -- acceptance_probability -------------------------------------------------------------------
class TestAcceptanceProbability:
    def test_dense_is_sum_of_min_and_one_minus_tv(self):
        a = acceptance_probability(P, Q, token=None)
        assert a == pytest.approx(float(torch.minimum(P, Q).sum()), abs=1e-6)
        assert a == pytest.approx(1 - _tv(P, Q), abs=1e-6)

    def test_dense_ignores_token_and_is_symmetric(self):
        assert acceptance_probability(P, Q, token=3) == pytest.approx(acceptance_probability(Q, P, None))

    def test_identical_and_disjoint(self):
        assert acceptance_probability(P, P.clone(), None) == pytest.approx(1.0, abs=1e-6)
        p = _dist(1, 1, 0, 0)
        q = _dist(0, 0, 1, 1)
        assert acceptance_probability(p, q, None) == 0.0

    @pytest.mark.parametrize("tok", range(6))
    def test_one_hot_is_p_of_token(self, tok):
        assert acceptance_probability(P, None, tok) == pytest.approx(float(P[tok]))
        # a dense one-hot q gives the same value
        onehot = torch.zeros(6)
        onehot[tok] = 1.0
        assert acceptance_probability(P, onehot, None) == pytest.approx(float(P[tok]))

    def test_no_proposal_is_zero(self):
        assert acceptance_probability(P, None, None) == 0.0
        assert acceptance_probability(P, None, -1) == 0.0


# -- verify_greedy --------------------------------------------------------------------------
class TestVerifyGreedy:
    LOGITS = torch.tensor([
        [0.0, 3.0, 1.0, 0.0],   # argmax 1
        [2.0, 0.0, 1.0, 0.0],   # argmax 0
        [0.0, 0.0, 0.0, 5.0],   # argmax 3
        [0.0, 0.0, 4.0, 1.0],   # argmax 2 (bonus position)
    ])

    def test_all_accepted_gives_bonus_argmax_of_last_row(self):
        assert verify_greedy(self.LOGITS, [1, 0, 3]) == Verdict(3, 2)

    @pytest.mark.parametrize("drafts, expected", [
        ([2, 0, 3], Verdict(0, 1)),  # first mismatch at 0: correction = argmax row 0
        ([1, 3, 3], Verdict(1, 0)),
        ([1, 0, 0], Verdict(2, 3)),
        ([1, 2, 3], Verdict(1, 0)),  # later drafts that happen to match do not count
    ])
    def test_first_mismatch(self, drafts, expected):
        assert verify_greedy(self.LOGITS, drafts) == expected

    def test_no_drafts(self):
        assert verify_greedy(self.LOGITS[:1], []) == Verdict(0, 1)

    def test_shorter_block(self):
        assert verify_greedy(self.LOGITS[:2], [1]) == Verdict(1, 0)
        assert verify_greedy(self.LOGITS[:2], [3]) == Verdict(0, 1)


# -- verify_sampling: deterministic edge cases ----------------------------------------------------
class TestVerifySamplingEdges:
    def test_no_drafts_samples_from_p(self):
        g = torch.Generator().manual_seed(0)
        out = [verify_sampling(P[None], [], None, g) for _ in range(4000)]
        assert all(v.n_accepted == 0 for v in out)
        _assert_follows([v.next_token for v in out], P, "no drafts")

    def test_q_equal_p_always_accepts(self):
        g = torch.Generator().manual_seed(1)
        p = torch.stack([P, P_BONUS])
        for _ in range(2000):
            y = sample(P, g)
            v = verify_sampling(p, [y], P[None].clone(), g)
            assert v.n_accepted == 1

    def test_zero_target_probability_always_rejects(self):
        p_row = _dist(0.5, 0.5, 0.0, 0.0)
        q_row = _dist(0.25, 0.25, 0.25, 0.25)
        p = torch.stack([p_row, p_row])
        g = torch.Generator().manual_seed(2)
        for _ in range(500):
            v = verify_sampling(p, [3], q_row[None], g)
            assert v.n_accepted == 0 and v.next_token in (0, 1)
            v = verify_sampling(p, [2], None, g)
            assert v.n_accepted == 0 and v.next_token in (0, 1)

    def test_one_hot_rejection_never_resamples_the_draft(self):
        p = torch.stack([P, P_BONUS])
        g = torch.Generator().manual_seed(3)
        for _ in range(2000):
            v = verify_sampling(p, [0], None, g)
            if v.n_accepted == 0:
                assert v.next_token != 0

    def test_dense_rejection_only_resamples_where_p_exceeds_q(self):
        p = torch.stack([P, P_BONUS])
        allowed = set(torch.nonzero(P > Q).flatten().tolist())
        g = torch.Generator().manual_seed(4)
        for _ in range(3000):
            y = sample(Q, g)
            v = verify_sampling(p, [y], Q[None], g)
            if v.n_accepted == 0:
                assert v.next_token in allowed

    def test_fixed_generator_is_reproducible(self):
        p = torch.stack([P, P2, P_BONUS])
        q = torch.stack([Q, Q2])
        runs = []
        for _ in range(2):
            g = torch.Generator().manual_seed(123)
            runs.append([verify_sampling(p, [sample(Q, g), sample(Q2, g)], q, g) for _ in range(200)])
        assert runs[0] == runs[1]


# -- verify_sampling: against analytic distributions -------------------------------------------
class TestVerifySamplingDistribution:
    """Monte Carlo checks of exact speculative sampling (N_TRIALS trials each, fixed seeds):
    acceptance rates within 4 standard errors of the analytic value, output distributions by a
    chi-square goodness-of-fit test at significance level ALPHA = 0.001."""

    def test_single_step_dense_q(self):
        """K=1, draft y ~ q: P(accept) = 1 - TV(p, q); output token ~ p; bonus ~ p_bonus.
        Chi-square tests at alpha = 0.001."""
        g = torch.Generator().manual_seed(2024)
        p = torch.stack([P, P_BONUS])
        q = Q[None]
        accepted, outputs, bonuses, corrections = 0, [], [], []
        for _ in range(N_TRIALS):
            y = sample(Q, g)
            v = verify_sampling(p, [y], q, g)
            assert v.n_accepted in (0, 1)
            if v.n_accepted == 1:
                accepted += 1
                outputs.append(y)
                bonuses.append(v.next_token)
            else:
                outputs.append(v.next_token)
                corrections.append(v.next_token)
        _assert_rate(accepted, N_TRIALS, 1 - _tv(P, Q), "acceptance rate")
        _assert_follows(outputs, P, "output token")
        _assert_follows(bonuses, P_BONUS, "bonus token after acceptance")
        residual = torch.clamp(P - Q, min=0)
        _assert_follows(corrections, residual / residual.sum(), "correction token ~ norm((p-q)+)")

    def test_single_step_one_hot_q(self):
        """K=1, deterministic draft y (q=None): P(accept) = p(y); output ~ p (alpha = 0.001)."""
        p = torch.stack([P, P_BONUS])
        for y in (0, 3, 5):
            g = torch.Generator().manual_seed(100 + y)
            accepted, outputs = 0, []
            for _ in range(N_TRIALS // 2):
                v = verify_sampling(p, [y], None, g)
                if v.n_accepted == 1:
                    accepted += 1
                    outputs.append(y)
                else:
                    outputs.append(v.next_token)
            _assert_rate(accepted, N_TRIALS // 2, float(P[y]), f"acceptance of one-hot draft {y}")
            _assert_follows(outputs, P, f"output with one-hot draft {y}")

    def test_block_of_two_dense(self):
        """K=2 with position-independent p1, p2, p3 and q1, q2: the first emitted token ~ p1,
        the second (when the first draft is accepted) ~ p2, the bonus ~ p3; the number of
        accepted drafts follows (1-a1, a1(1-a2), a1 a2). Chi-square tests at alpha = 0.001."""
        g = torch.Generator().manual_seed(7)
        p = torch.stack([P, P2, P_BONUS])
        q = torch.stack([Q, Q2])
        a1, a2 = 1 - _tv(P, Q), 1 - _tv(P2, Q2)
        n_counts = [0, 0, 0]
        first, second, bonus = [], [], []
        for _ in range(N_TRIALS):
            drafts = [sample(Q, g), sample(Q2, g)]
            v = verify_sampling(p, drafts, q, g)
            n_counts[v.n_accepted] += 1
            emitted = [*drafts[: v.n_accepted], v.next_token]
            first.append(emitted[0])
            if v.n_accepted >= 1:
                second.append(emitted[1])
            if v.n_accepted == 2:
                bonus.append(emitted[2])
        _assert_follows(first, P, "first emitted token")
        _assert_follows(second, P2, "second emitted token")
        _assert_follows(bonus, P_BONUS, "bonus token")
        expected_n = torch.tensor([1 - a1, a1 * (1 - a2), a1 * a2])
        _assert_follows([0] * n_counts[0] + [1] * n_counts[1] + [2] * n_counts[2], expected_n,
                        "number of accepted drafts")
        _assert_rate(n_counts[1] + n_counts[2], N_TRIALS, a1, "first draft accepted")

    def test_block_of_two_one_hot(self):
        """K=2 deterministic drafts: first emitted ~ p1, second ~ p2 (alpha = 0.001)."""
        g = torch.Generator().manual_seed(8)
        p = torch.stack([P, P2, P_BONUS])
        drafts = [1, 3]
        first, second = [], []
        n_counts = [0, 0, 0]
        for _ in range(N_TRIALS):
            v = verify_sampling(p, drafts, None, g)
            n_counts[v.n_accepted] += 1
            emitted = [*drafts[: v.n_accepted], v.next_token]
            first.append(emitted[0])
            if v.n_accepted >= 1:
                second.append(emitted[1])
        _assert_follows(first, P, "first emitted token")
        _assert_follows(second, P2, "second emitted token")
        _assert_rate(n_counts[2], N_TRIALS, float(P[1] * P2[3]), "both drafts accepted")


# -- verify_sampling: q(y) = 0 and an all-zero residual ---------------------------------------------
Q_ZERO = _dist(0.0, 0.45, 0.35, 0.0, 0.2, 0.0)  # a processed drafter q (e.g. top-k) with zeros where p > 0


class TestVerifySamplingZeros:
    """Edge cases of the rule. Chi-square tests at significance level ALPHA = 0.001."""

    def test_q_with_zeros_still_gives_p(self):
        """Drafts come from a q that is 0 on half the vocabulary (where p > 0): those tokens can
        only come from the residual norm((p - q)+), and the output must still follow p."""
        g = torch.Generator().manual_seed(11)
        p = torch.stack([P, P_BONUS])
        outputs, corrections = [], []
        for _ in range(N_TRIALS // 2):
            y = sample(Q_ZERO, g)
            v = verify_sampling(p, [y], Q_ZERO[None], g)
            outputs.append(y if v.n_accepted else v.next_token)
            if not v.n_accepted:
                corrections.append(v.next_token)
        _assert_follows(outputs, P, "output with a q that has zeros")
        residual = torch.clamp(P - Q_ZERO, min=0)
        _assert_follows(corrections, residual / residual.sum(), "correction ~ norm((p - q)+)")
        assert {0, 3, 5} <= set(corrections)  # the tokens q never proposes do appear

    def test_draft_with_zero_q(self):
        """A draft y with q(y) = 0 (which an exact drafter never proposes): with p(y) > 0 the ratio
        is +inf and y is accepted (the limit of min(1, p/q)); with p(y) = 0 too the ratio is NaN
        and y is rejected, the correction coming from the residual, never y itself."""
        g = torch.Generator().manual_seed(12)
        p = torch.stack([P, P_BONUS])
        for _ in range(200):
            assert verify_sampling(p, [0], Q_ZERO[None], g).n_accepted == 1
        p_row = _dist(0.0, 0.5, 0.3, 0.2, 0.0, 0.0)
        q_row = _dist(0.0, 0.2, 0.2, 0.2, 0.2, 0.2)
        for _ in range(200):
            v = verify_sampling(torch.stack([p_row, P_BONUS]), [0], q_row[None], g)
            assert v.n_accepted == 0 and v.next_token in (1, 2, 3)

    def test_all_zero_residual_falls_back_to_p(self):
        """If p <= q everywhere at a rejected position (only possible through rounding, forced
        here with a sub-normalised p = q / 2), the residual is all zero: the correction is drawn
        from p renormalised, with no division by zero and no NaN."""
        g = torch.Generator().manual_seed(13)
        p = torch.stack([0.5 * Q, P_BONUS])
        corrections = []
        for _ in range(N_TRIALS // 2):
            y = sample(Q, g)
            v = verify_sampling(p, [y], Q[None], g)
            if not v.n_accepted:
                corrections.append(v.next_token)
        assert len(corrections) > N_TRIALS // 8  # rejection probability 1/2
        _assert_follows(corrections, Q, "fallback correction ~ norm(p)")


def test_row_argmax_equals_torchs_on_ties_views_and_dtypes():
    """The numpy path of greedy verification picks what torch.argmax picks (first maximum)."""
    from adaspec.sampling import row_argmax
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 50, generator=g)
    x[2, 7] = x[2, 30] = x[2].max() + 1.0  # a tie: the first index wins
    x[4] = 0.0
    for t in (x, x[1:5], x[:, ::2], x.half(), x.double(), x.bfloat16(), x.T.contiguous().T):
        assert row_argmax(t) == t.argmax(-1).tolist()
    with torch.inference_mode():
        y = torch.randn(3, 50, generator=g)
        assert row_argmax(y) == y.argmax(-1).tolist()
