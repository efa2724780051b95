"""Training-free draft-length rules: Hugging Face's heuristic schedule and TapOut's arms.

``HFHeuristic`` sets a per-round cap (+2 after a fully accepted round, -1 otherwise).
The threshold rules (TapOut Table 1 / A.1) look at the drafter's distribution q of every
drafted token and stop the block when q is uncertain.

Decisions shared by every threshold rule (the papers are silent on most of them):

* **The triggering token is kept** (``Decision.STOP``): TapOut Algorithm 1 samples x_i,
  appends it to X and only then asks the arm whether to stop (lines 3-6), so the uncertain
  token is verified too. (AdaEDL as first published checks *before* drafting, which would
  be ``DISCARD``; we follow TapOut for all arms.) The drafter forward for that token is
  already paid, and on this CPU one more verify row costs almost nothing.
* **Which q**: ``step.probs`` (the processed q the token was sampled from) when sampling;
  under greedy decoding ``softmax(step.logits)`` (temperature 1). A drafter over a vocabulary
  subset also gives q on it (``support_probs`` / ``support_logits``): the statistics are
  computed there (``stats_probs``), live and when recording alike.
* **Entropy** is in nats, with 0 log 0 = 0 (top-k / top-p zeros).
* **Cap**: ``max_len`` (TapOut 4: 128 for dynamic methods, "a proxy for unbounded"); the
  engine further caps every round at the remaining token budget.
* **Model-free drafters** (prompt lookup, suffix: ``probs`` and ``logits`` both None) give
  no distribution to measure, so the rules draft until ``max_len_model_free`` tokens
  (default 16) or until the drafter has no proposal, whichever comes first.
* **Precomputed statistics**: a step with no ``probs``/``logits`` but ``stats`` (a recorded
  model drafter replayed by ``adaspec.replay``) is judged on those numbers, which
  ``stats_of`` computes with the same formulas as the live path, so decisions are identical.
"""

from __future__ import annotations

import math
from abc import abstractmethod

import torch

from ..drafters.base import Decision, DraftStep, StepStats
from ..errors import ConfigError
from ..feedback import RoundFeedback
from .base import LengthCaps, LengthPolicy

#: TapOut 4: "the max draft length is set to 128 tokens as a proxy for unbounded draft lengths"
TAPOUT_MAX_LEN = 128


# -- parameter checks ----------------------------------------------------------------------
def check_int(name: str, value: object, lo: int = 1) -> int:
    """An integer parameter >= lo (ConfigError otherwise)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ConfigError(f"{name} must be an integer >= {lo}, got {value!r}: e.g. {name}={max(lo, 16)}")
    return value


def check_float(name: str, value: object, lo: float = -math.inf, hi: float = math.inf,
                example: float | None = None) -> float:
    """A finite number in [lo, hi] (ConfigError otherwise)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or not lo <= value <= hi:
        where = f"in [{lo}, {hi}]" if math.isfinite(lo) and math.isfinite(hi) else (
            f">= {lo}" if math.isfinite(lo) else f"<= {hi}" if math.isfinite(hi) else "finite")
        hint = f": e.g. {example}" if example is not None else ""
        raise ConfigError(f"{name} must be a number {where}, got {value!r}{hint}")
    return float(value)


# -- the drafter distribution ----------------------------------------------------------------
def drafter_probs(step: DraftStep) -> torch.Tensor | None:
    """q of a drafted token: processed probs (sampling) or softmax of the raw logits (greedy);
    None for model-free drafters."""
    if step.probs is not None:
        return step.probs
    if step.logits is not None:
        return torch.softmax(step.logits.float(), dim=-1)
    return None


def stats_probs(step: DraftStep) -> torch.Tensor | None:
    """The q that statistics are computed on: on the drafter's support when it gives one
    (the same top-1, top-2 and entropy, q being 0 elsewhere), else ``drafter_probs``."""
    if step.support_probs is not None:
        return step.support_probs
    if step.support_logits is not None:
        return torch.softmax(step.support_logits.float(), dim=-1)
    return drafter_probs(step)


def entropy(q: torch.Tensor) -> float:
    """Shannon entropy of q in nats (0 log 0 = 0; a dot product is 2x faster than xlogy)."""
    return float(-torch.dot(q, q.clamp_min(1e-38).log()))


def top2(q: torch.Tensor) -> tuple[float, float]:
    """The two largest probabilities of q (the second is 0 for a one-token vocabulary);
    two max passes are 2x faster than topk on a 49k vocabulary."""
    i = int(q.argmax())
    p1 = float(q[i])
    if q.numel() < 2:
        return p1, 0.0
    rest = q.clone()
    rest[i] = -1.0
    return p1, float(rest.max())


def stats_of(q: torch.Tensor) -> StepStats:
    """All statistics the rules read, computed eagerly from q (for recording a trace)."""
    p1, p2 = top2(q)
    return StepStats(top1=p1, top2=p2, entropy=entropy(q))


class _LazyStats:
    """Statistics of a live q, each computed on first use (a rule reads one or two of them),
    with the same formulas as ``stats_of`` so live and replayed decisions agree bit for bit."""

    __slots__ = ("q", "_top1", "_top2", "_entropy")

    def __init__(self, q: torch.Tensor):
        self.q = q
        self._top1: float | None = None
        self._top2: float | None = None
        self._entropy: float | None = None

    @property
    def top1(self) -> float:
        if self._top1 is None:
            self._top1 = float(self.q.max())  # the same value as top2(q)[0]
        return self._top1

    @property
    def top2(self) -> float:
        if self._top2 is None:
            self._top1, self._top2 = top2(self.q)
        return self._top2

    @property
    def entropy(self) -> float:
        if self._entropy is None:
            self._entropy = entropy(self.q)
        return self._entropy


QStats = StepStats | _LazyStats


def step_stats(step: DraftStep) -> QStats | None:
    """Statistics of the step's q: from ``probs``/``logits`` when present (live), else the
    precomputed ``step.stats`` (replay); None for model-free drafters."""
    q = stats_probs(step)
    if q is not None:
        return _LazyStats(q)
    return step.stats


def step_confidence(step: DraftStep) -> float | None:
    """max_x q(x) of a drafted token (from q or from precomputed stats); None if model-free."""
    s = step_stats(step)
    return None if s is None else s.top1


# -- HF heuristic --------------------------------------------------------------------------
class HFHeuristic(LengthPolicy):
    """Hugging Face assisted generation's ``num_assistant_tokens_schedule="heuristic"``:
    +2 after a round whose drafts were all accepted, else -1 (min 1).

    ``initial=5`` is HF's ``num_assistant_tokens`` from when "heuristic" was HF's default
    schedule (transformers < 4.45); transformers 5.x defaults to a *constant* 20 tokens plus
    ``assistant_confidence_threshold=0.4`` instead. HF compares accepted with the number of
    candidates actually drafted, as here. Choices beyond HF (one assistant there): one
    counter per drafter; a round with no drafts (model-free drafter had no proposal) leaves
    the counter unchanged; the counter is capped at ``max_len``. HF's "heuristic" keeps the
    counter across generate calls (``scope="global"``, the default here);
    ``scope="request"`` is HF's "heuristic_transient".
    """

    name = "hf-heuristic"
    caps = LengthCaps(shares_interleaved=True)

    def __init__(self, initial: int = 5, max_len: int = TAPOUT_MAX_LEN, seed: int | None = 0,
                 scope: str = "global"):
        super().__init__(seed=seed, scope=scope)
        self.max_len = check_int("max_len", max_len)
        self.initial = min(check_int("initial", initial), self.max_len)
        self.k: dict[int, int] = {}

    def reset(self) -> None:
        self.k = {}

    def begin_round(self, drafter: int) -> int:
        return self.k.get(drafter, self.initial)

    def update(self, feedback: RoundFeedback) -> None:
        if feedback.n_drafted == 0:
            return
        k = self.k.get(feedback.drafter, self.initial)
        k = k + 2 if feedback.n_accepted == feedback.n_drafted else k - 1
        self.k[feedback.drafter] = max(1, min(self.max_len, k))


# -- threshold rules on q ------------------------------------------------------------------
class DistributionRule(LengthPolicy):
    """Base of TapOut's arms (Table 1): draft up to ``max_len`` and stop (keeping the token)
    as soon as ``stop_on(stats of q, index)`` says the drafter is uncertain."""

    #: (lo, hi, example) of the threshold parameter, checked at construction, and its name
    threshold_range: tuple[float, float, float] = (-math.inf, math.inf, 0.5)
    threshold_name: str = "threshold"

    def __init__(self, threshold: float, max_len: int = TAPOUT_MAX_LEN,
                 max_len_model_free: int = 16, seed: int | None = 0, scope: str = "request"):
        super().__init__(seed=seed, scope=scope)
        lo, hi, ex = self.threshold_range
        self.threshold = check_float(self.threshold_name, threshold, lo, hi, ex)
        self.max_len = check_int("max_len", max_len)
        self.max_len_model_free = check_int("max_len_model_free", max_len_model_free)
        self.drafter = 0

    def begin_round(self, drafter: int) -> int:
        self.drafter = drafter
        return self.max_len

    def decide(self, step: DraftStep) -> Decision:
        s = step_stats(step)
        if s is None:  # model-free: nothing to measure
            return Decision.STOP if step.index + 1 >= self.max_len_model_free else Decision.CONTINUE
        return Decision.STOP if self.should_stop(s, step.index) else Decision.CONTINUE

    def should_stop(self, q: torch.Tensor | QStats, index: int) -> bool:
        """True if the block should end after the token drafted from q (0-based ``index``);
        ``q`` is the distribution or its statistics."""
        return self.stop_on(_LazyStats(q) if isinstance(q, torch.Tensor) else q, index)

    @abstractmethod
    def stop_on(self, s: QStats, index: int) -> bool:
        """``should_stop`` on the statistics of q."""


class MaxConfidence(DistributionRule):
    """TapOut Table 1 / A.1 "Confidence": stop when max_x q(x) < h (h = 0.8)."""

    name = "max-confidence"
    threshold_range = (0.0, 1.0, 0.8)

    def __init__(self, threshold: float = 0.8, **kwargs):
        super().__init__(threshold, **kwargs)

    def stop_on(self, s: QStats, index: int) -> bool:
        return s.top1 < self.threshold


class SVIPEntropy(DistributionRule):
    """SVIP (Zhang et al. 2025) as in TapOut Table 1 / A.1: stop when sqrt(H(q)) > h (h = 0.6)."""

    name = "svip"
    threshold_range = (0.0, math.inf, 0.6)

    def __init__(self, threshold: float = 0.6, **kwargs):
        super().__init__(threshold, **kwargs)

    def stop_on(self, s: QStats, index: int) -> bool:
        return math.sqrt(s.entropy) > self.threshold


class SVIPDifference(DistributionRule):
    """TapOut A.1 SVIP-Difference: stop when sqrt(H(q_t)) - sqrt(H(q_{t-1})) > h (h = 0.2), a
    spike in uncertainty between consecutive drafted tokens. The difference needs a previous
    token of the same block, so the first drafted token never triggers it (paper silent)."""

    name = "svip-diff"
    threshold_range = (-math.inf, math.inf, 0.2)

    def __init__(self, threshold: float = 0.2, **kwargs):
        super().__init__(threshold, **kwargs)
        self._prev: float | None = None

    def begin_round(self, drafter: int) -> int:
        self._prev = None
        return super().begin_round(drafter)

    def stop_on(self, s: QStats, index: int) -> bool:
        cur = math.sqrt(s.entropy)
        prev, self._prev = (self._prev if index > 0 else None), cur
        return prev is not None and cur - prev > self.threshold


class LogitMargin(DistributionRule):
    """TapOut Table 1 / A.1 Logit Margin: stop when q(x1) - q(x2) < h for the top-2 tokens
    (h = 0.2; despite the name the margin is between probabilities)."""

    name = "logit-margin"
    threshold_range = (0.0, 1.0, 0.2)

    def __init__(self, threshold: float = 0.2, **kwargs):
        super().__init__(threshold, **kwargs)

    def stop_on(self, s: QStats, index: int) -> bool:
        p2 = s.top2  # first: computes both top probabilities in one go
        return s.top1 - p2 < self.threshold


class AdaEDL(DistributionRule):
    """AdaEDL (Agrawal et al. 2024) as in TapOut Table 1 / A.1: stop when
    1 - sqrt(gamma * H(q)) < lambda_t (an approximate lower bound on the token's acceptance
    probability), with lambda_t learnt online after every round (TapOut A.1):

        r_t = n_acc / n_drafted
        accept_rate <- beta1 * accept_rate + (1 - beta1) * r_t
        lambda <- beta2 * lambda + (1 - beta2) * (lambda + eps * sign(alpha - s_t))

    TapOut leaves the hyperparameters open. Defaults gamma = 0.2, beta1 = 0.5, beta2 = 0.9,
    eps = 0.01, alpha = 0.9 are AdaEDL's own (its Sec. 3.1, as reported by two independent
    reimplementations; the paper itself was not available here); AdaEDL does not fix lambda_0
    (it sweeps 0.3-0.9): ``lambda0 = 0.5``. Choices where the papers are silent:
    ``signal="smoothed"`` uses s_t = accept_rate (why else track it), ``"raw"`` the literal
    A.1 s_t = r_t; accept_rate starts at alpha; lambda is clamped to [0, 1] (a threshold on
    a probability bound) and kept per drafter; rounds of model-free drafters (no entropy
    measured) or with no drafts do not update it.
    """

    name = "adaedl"
    threshold_range = (0.0, 1.0, 0.5)
    threshold_name = "lambda0"

    def __init__(self, lambda0: float = 0.5, gamma: float = 0.2, alpha: float = 0.9,
                 beta1: float = 0.5, beta2: float = 0.9, eps: float = 0.01,
                 signal: str = "smoothed", **kwargs):
        super().__init__(lambda0, **kwargs)
        self.gamma = check_float("gamma", gamma, 0.0, math.inf, 0.2)
        self.alpha = check_float("alpha", alpha, 0.0, 1.0, 0.9)
        self.beta1 = check_float("beta1", beta1, 0.0, 1.0, 0.5)
        self.beta2 = check_float("beta2", beta2, 0.0, 1.0, 0.9)
        self.eps = check_float("eps", eps, 0.0, 1.0, 0.01)
        if signal not in ("smoothed", "raw"):
            raise ConfigError(f"signal must be 'smoothed' or 'raw', got {signal!r}")
        self.signal = signal
        self.lam: dict[int, float] = {}
        self.accept_rate: dict[int, float] = {}
        self._measured = False

    def reset(self) -> None:
        self.lam, self.accept_rate = {}, {}

    def lambda_of(self, drafter: int) -> float:
        return self.lam.get(drafter, self.threshold)

    def begin_round(self, drafter: int) -> int:
        self._measured = False
        return super().begin_round(drafter)

    def stop_on(self, s: QStats, index: int) -> bool:
        self._measured = True
        return 1.0 - math.sqrt(self.gamma * s.entropy) < self.lambda_of(self.drafter)

    def update(self, feedback: RoundFeedback) -> None:
        if not self._measured or feedback.n_drafted == 0:
            return
        d = feedback.drafter
        r = feedback.n_accepted / feedback.n_drafted
        ar = self.beta1 * self.accept_rate.get(d, self.alpha) + (1.0 - self.beta1) * r
        self.accept_rate[d] = ar
        s = ar if self.signal == "smoothed" else r
        sign = (self.alpha > s) - (self.alpha < s)
        lam = self.lambda_of(d)
        lam = self.beta2 * lam + (1.0 - self.beta2) * (lam + self.eps * sign)
        self.lam[d] = min(1.0, max(0.0, lam))
