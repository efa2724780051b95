"""HedgeSpec (Not-a-Bandit, "Provably no-regret drafter selection"): full-information
drafter selection with Hedge-type learners, plus a cost-aware variant (ours).

Full information (Not-a-Bandit 3.2): after verification the engine prefills the verified
tokens into every drafter and reports, for each drafter i and each emitted position, the
acceptance probability gamma = 1 - TV(p, q_i) (p(y) for one-hot proposals, 0/1 under greedy
decoding) in ``feedback.counterfactual``. From one verified trajectory, Theorem 3 gives an
unbiased estimate of the accepted length any drafter would have had starting at any token:

    AcceptLength_{t,K} = sum_{k=1}^{K+1} k (1 - gamma_k) prod_{j<k} gamma_j,  gamma_{K+1} = 0
                       = 1 + gamma_1 + gamma_1 gamma_2 + ... + gamma_1 ... gamma_K   (telescoped)

so the problem is an experts (full-information) game, not a bandit.

Caveat (ours, checked by tests/test_selection_hedgespec.py): Theorem 3 is exact when the
acceptance probabilities do not depend on which token the target realised (e.g. fixed
per-depth probabilities, or 1 - TV equal in every context), but biased in general under
speculative sampling: given acceptance at depth j, the token x_j follows min(p, q)/gamma_j,
not p, so later gammas must be taken along the drafter's accepted branch. The proof replaces
P[x_{t+1:t+k-1} accepted | x_{<=t+k-1}] (which depends on the realised x_{t+k-1}) by the
token-averaged gamma. The unbiased version weights the prefix by the acceptance probability
of the realised token, alpha_j = min(1, q_j(x_j) / p_j(x_j)) (= 1[x_j = y_j] for a one-hot
proposal y_j):

    AcceptLength~_{t,K} = 1 + sum_{k=1}^{K} gamma_k prod_{j<k} alpha_j      (E[alpha_j | x_<j] = gamma_j)

``estimator="corrected"`` uses it, with the chosen drafter's realised acceptances as its
alphas and ``feedback.counterfactual_alpha`` (drafter -> alpha per emitted position, filled
by the engine's full-information evaluation) for the others; without that field it falls back to alpha = gamma for
the other drafters. The default is the paper's estimator.

Games (3.3, B.3). ``game="token"``: one loss vector per generated token t,
``f_t[i] = 1 - AcceptLength_{t,K}[i] / (K+1)`` (``loss="length"``, needs gammas at t..t+K-1)
or ``f_t[i] = 1 - gamma_t[i]`` (``loss="prob"``). ``game="chunk"``: one loss vector per round
over its m emitted positions, ``1 - AcceptLength_{h,m}/(m+1)`` or the mean of ``1 - gamma``.

Delayed feedback (B.1, Alg. 1 "QFI-D"): the length loss of token t is complete only once the
gammas at t..t+K-1 have arrived, over later rounds. Complete loss vectors are pushed, in token
order, onto a FIFO queue; before every decision the queue is drained into the base learner,
so each token's loss is applied exactly once and in order (the base learner sees a delay-free
stream in its own clock). The drafter is then sampled from the base learner's distribution
(B.1: sampling once per chunk has the same guarantee as per token).

Decisions where the paper is silent (documented, ours):
- The chosen drafter has no proposal at the bonus position when all its drafts were accepted
  (its gamma list is one shorter). The missing gamma is imputed with that drafter's running
  mean gamma (prior: the mean over all drafters, 0.5 before any data); if the drafter drafted
  nothing although the cap allowed it (e.g. the ``none`` drafter, prompt lookup without a
  match), the missing gamma is 0, as ``score()`` reports for positions with no proposal.
- ``K`` (the estimator depth) defaults to the largest ``feedback.k_cap`` seen (5 before any
  round), the same convention as UCBSpec's ``L``.
- Hybrid losses (B.5): the first ``hybrid_tokens`` tokens (default K, the delay of the length
  loss) use the acceptance-probability loss, available at once; later tokens the length loss.
  Only meaningful in the token game (both chunk losses are immediate); on by default since the
  paper used it.
- Skipping updates (B.5: "warm-up 6 rounds of full-information updates, then delayed batched
  feedback, 12 rounds per batch, with skipped updates, 6 tokens per update"): for the first
  ``warmup`` rounds every loss vector is applied before the next decision; afterwards the queue
  is drained only every ``batch`` rounds and only loss vectors at least ``every`` tokens after
  the last applied one are kept. Off by default: its purpose is to skip the evaluation phase,
  but this engine evaluates every drafter every round anyway, so it would only delay learning.
- ``scope="global"``: at a new request the incomplete windows of the last one are dropped (the
  next tokens do not continue them); complete losses and the learner's state are kept.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from ..costs import CostModel
from ..errors import ConfigError
from ..feedback import NO_CONTEXT, RoundContext, RoundFeedback
from ..persist import state_type
from .base import DrafterPolicy, SelectorCaps, sample_index

#: estimator depth before any round has been seen (NOTES: N_max = 5)
DEFAULT_K = 5
_E = math.e


# -- Theorem 3 ------------------------------------------------------------------------------
def counterfactual_accept_length(gammas: Sequence[float], K: int | None = None) -> float:
    """Not-a-Bandit Theorem 3: ``sum_{k=1}^{K+1} k (1 - gamma_k) prod_{j<k} gamma_j`` with
    ``gamma_{K+1} = 0``, an unbiased estimate of the accepted length (bonus / correction token
    included, in [1, K+1]) from the per-depth acceptance probabilities on one verified
    trajectory. Uses ``gammas[:K]`` (``K`` defaults to ``len(gammas)``)."""
    if K is None:
        K = len(gammas)
    if K < 0 or len(gammas) < K:
        raise ConfigError(f"need K >= 0 and at least K gammas, got K={K} and {len(gammas)} gammas")
    total, prefix = 0.0, 1.0
    for k in range(1, K + 2):
        g = float(gammas[k - 1]) if k <= K else 0.0
        total += k * (1.0 - g) * prefix
        prefix *= g
    return total


def corrected_accept_length(gammas: Sequence[float], alphas: Sequence[float],
                            K: int | None = None) -> float:
    """Unbiased counterfactual accepted length (ours, see the module docstring):
    ``1 + sum_{k=1}^{K} gamma_k prod_{j<k} alpha_j`` with alpha_j the acceptance probability of
    the realised token at depth j. Equals Theorem 3 when ``alphas == gammas``."""
    if K is None:
        K = len(gammas)
    if K < 0 or len(gammas) < K or len(alphas) < K - 1:
        raise ConfigError(f"need K >= 0, at least K gammas and K-1 alphas, got K={K}, "
                          f"{len(gammas)} gammas and {len(alphas)} alphas")
    total, prefix = 1.0, 1.0
    for k in range(K):
        total += prefix * float(gammas[k])
        if k + 1 < K:
            prefix *= float(alphas[k])
    return total


def _corrected_lengths(window: Sequence[Sequence[float]],
                       awindow: Sequence[Sequence[float]]) -> list[float]:
    """``corrected_accept_length`` for every arm, Horner form
    1 + (g1 + a1 (g2 + a2 (... + a_{K-1} gK)))."""
    acc = list(window[-1])
    for j in range(len(window) - 2, -1, -1):
        acc = [g + a * x for g, a, x in zip(window[j], awindow[j], acc)]
    return [1.0 + x for x in acc]


def _accept_lengths(window: Sequence[Sequence[float]]) -> list[float]:
    """Theorem 3 for every arm at once, in Horner form 1 + g1 (1 + g2 (1 + ... (1 + gK))),
    from a window of position vectors (rows = positions, columns = arms); same value as
    ``counterfactual_accept_length`` with fewer operations."""
    acc = [1.0] * len(window[0])
    for row in reversed(window):
        acc = [1.0 + g * a for g, a in zip(row, acc)]
    return acc


# -- base learners (full information, losses in [0, 1]) ---------------------------------------
@state_type
class BaseLearner:
    """A full-information learner over ``n`` experts: ``probs()`` and ``update(losses)``."""

    def __init__(self, n: int):
        if n < 1:
            raise ConfigError(f"a learner needs at least one expert, got {n}")
        self.n = n
        self.t = 0  # updates applied
        self._p = [1.0 / n] * n

    def probs(self) -> list[float]:
        """Distribution over experts for the next decision."""
        return self._p

    def update(self, losses: Sequence[float]) -> None:  # pragma: no cover - abstract
        raise NotImplementedError


@state_type
class Hedge(BaseLearner):
    """Hedge / exponential weights (Not-a-Bandit B.1 remarks): ``w_i <- w_i exp(-eta l_i)``.
    ``eta="auto"``: the anytime rate ``eta_t = sqrt(8 ln N / t)`` (Cesa-Bianchi & Lugosi 2006,
    Thm 2.3; the paper does not state its eta)."""

    def __init__(self, n: int, eta: float | str = "auto"):
        super().__init__(n)
        self.eta = eta
        self.cum = [0.0] * n

    def rate(self) -> float:
        """Learning rate used for the next prediction (after ``self.t`` updates)."""
        if self.eta == "auto":
            return math.sqrt(8.0 * math.log(self.n) / max(1, self.t))
        return float(self.eta)

    def update(self, losses: Sequence[float]) -> None:
        cum = self.cum
        for i in range(self.n):
            cum[i] += losses[i]
        self.t += 1
        eta, low = self.rate(), min(cum)
        w = [math.exp(-eta * (c - low)) for c in cum]
        s = sum(w)
        self._p = [x / s for x in w]


def normalhedge_scale(regrets: Sequence[float], guess: float | None = None,
                      rtol: float = 1e-12) -> float:
    """The NormalHedge scale c > 0 solving ``(1/N) sum_i exp([R_i]_+^2 / (2c)) = e``
    (Chaudhuri, Freund & Hsu 2009, Fig. 1). Needs some ``R_i > 0``.

    Solved for ``v = M^2 / (2c)`` (M = max R_+), which lies in ``[1, 1 + ln N]`` (the largest
    term alone is between e and e N at the root); the left side is convex and increasing in
    v, so Newton steps are taken inside a bisection bracket that shrinks every step (plain
    bisection whenever Newton would leave it): typically 3-5 iterations. ``guess`` warm-starts
    v (e.g. the previous solution)."""
    n = len(regrets)
    pos = [r * r for r in regrets if r > 0.0]
    m2 = max(pos)  # ValueError if no positive regret
    x = [r / m2 for r in pos]
    zeros = n - len(x)  # experts with R <= 0 contribute exp(0) = 1
    target = _E * n
    lo, hi = 1.0, 1.0 + math.log(n)
    v = hi if guess is None or not lo < guess < hi else guess
    exp = math.exp
    for _ in range(100):
        terms = [exp(xi * v) for xi in x]
        f = sum(terms) + zeros - target
        if f > 0.0:
            hi = v
        else:
            lo = v
        if abs(f) <= rtol * target or hi - lo <= rtol * hi:
            break
        df = sum([xi * ti for xi, ti in zip(x, terms)])
        step = v - f / df if df > 0.0 else lo
        v = step if lo < step < hi else 0.5 * (lo + hi)
    return m2 / (2.0 * v)


@state_type
class NormalHedge(BaseLearner):
    """NormalHedge (Chaudhuri et al. 2009; Not-a-Bandit 3.4 default, parameter-free):
    regrets ``R_i += l_A - l_i`` with ``l_A = <p, l>``, then ``p_i ∝ [R_i]_+ / c exp([R_i]_+^2
    / (2c))`` with c from ``normalhedge_scale``; uniform while no regret is positive."""

    def __init__(self, n: int):
        super().__init__(n)
        self.R = [0.0] * n
        self.c = math.inf
        self._v: float | None = None

    def update(self, losses: Sequence[float]) -> None:
        mix = sum([pi * li for pi, li in zip(self._p, losses)])
        R = self.R = [r + mix - li for r, li in zip(self.R, losses)]
        self.t += 1
        pos = [r for r in R if r > 0.0]
        if not pos:
            self.c, self._v, self._p = math.inf, None, [1.0 / self.n] * self.n
            return
        c = normalhedge_scale(R, self._v)
        self.c = c
        self._v = max(pos) ** 2 / (2.0 * c)
        # the common factor 1/c cancels; exponents are <= 1 + ln N at the root
        k = 0.5 / c
        w = [r * math.exp(r * r * k) if r > 0.0 else 0.0 for r in R]
        s = sum(w)
        self._p = [x / s for x in w]


@state_type
class AdaNormalHedge(BaseLearner):
    """AdaNormalHedge (Luo & Schapire 2015, Alg. 1, uniform prior; Not-a-Bandit D.5):
    ``Phi(R, C) = exp([R]_+^2 / (3C))``, ``w(R, C) = (Phi(R+1, C+1) - Phi(R-1, C+1)) / 2``,
    ``p_i ∝ w(R_i, C_i)`` with ``R_i += r_i``, ``C_i += |r_i|``, ``r_i = <p, l> - l_i``.
    Weights are computed in log space (``[R]_+^2 / 3C`` grows linearly with time)."""

    def __init__(self, n: int):
        super().__init__(n)
        self.R = [0.0] * n
        self.C = [0.0] * n

    @staticmethod
    def log_weight(R: float, C: float) -> float:
        """log w(R, C) (-inf when w = 0, i.e. R <= -1)."""
        a = max(R + 1.0, 0.0) ** 2 / (3.0 * (C + 1.0))
        b = max(R - 1.0, 0.0) ** 2 / (3.0 * (C + 1.0))
        if a <= b:
            return -math.inf
        return a + math.log1p(-math.exp(b - a)) - math.log(2.0)

    def update(self, losses: Sequence[float]) -> None:
        p, R, C, n = self._p, self.R, self.C, self.n
        mix = sum(p[i] * losses[i] for i in range(n))
        for i in range(n):
            r = mix - losses[i]
            R[i] += r
            C[i] += abs(r)
        self.t += 1
        lw = [self.log_weight(R[i], C[i]) for i in range(n)]
        top = max(lw)
        if top == -math.inf:
            self._p = [1.0 / n] * n
            return
        w = [math.exp(x - top) for x in lw]
        s = sum(w)
        self._p = [x / s for x in w]


LEARNERS: dict[str, Callable[..., BaseLearner]] = {
    "normalhedge": NormalHedge, "hedge": Hedge, "adanormalhedge": AdaNormalHedge}


# -- parameter checks -----------------------------------------------------------------------
def _as_bool(value: Any, what: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        return value.lower() in ("1", "true", "yes", "on")
    raise ConfigError(f"{what} must be true or false (1/0), got {value!r}: pass e.g. {what}=1")


def _as_int(value: Any, what: str, low: int, example: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value) \
            or value < low:
        raise ConfigError(f"{what} must be an integer >= {low}, got {value!r}: pass e.g. {example}")
    return int(value)


def _choice(value: Any, what: str, options: Sequence[str]) -> str:
    v = str(value).strip().lower()
    if v not in options:
        raise ConfigError(f"{what} must be one of {list(options)}, got {value!r}")
    return v


# -- HedgeSpec ------------------------------------------------------------------------------
class HedgeSpec(DrafterPolicy):
    """HedgeSpec (Not-a-Bandit 3.2-3.4, Alg. 1 QFI-D in B.1): full-information losses from the
    Theorem 3 estimator (or 1 - gamma), delayed through a FIFO queue, fed to NormalHedge /
    Hedge / AdaNormalHedge (D.5); the next drafter is sampled from the learner's weights.

    Args: ``learner`` normalhedge (default) | hedge | adanormalhedge; ``game`` token (default,
    3.3) | chunk (B.3); ``loss`` length (default) | prob; ``K`` estimator depth (0 = the
    largest k_cap seen, 5 before any round; alias ``k``); ``eta`` Hedge rate ("auto" = anytime
    sqrt(8 ln N / t)); ``hybrid`` (B.5, default on) with ``hybrid_tokens`` (0 = K); ``skip``
    (B.5, default off) with ``warmup=6``, ``batch=12``, ``every=6``; ``estimator`` paper
    (Theorem 3, default) | corrected (module docstring); ``seed``; ``scope``.
    """

    name = "hedgespec"
    caps = SelectorCaps(full_information=True)

    def __init__(self, learner: str = "normalhedge", game: str = "token", loss: str = "length",
                 K: int = 0, eta: float | str = "auto", hybrid: bool | int | str = True,
                 skip: bool | int | str = False, warmup: int = 6, batch: int = 12,
                 every: int = 6, hybrid_tokens: int = 0, estimator: str = "paper",
                 k: int | None = None, **kwargs: Any):
        super().__init__(**kwargs)
        self.learner = _choice(learner, "learner", tuple(LEARNERS))
        self.game = _choice(game, "game", ("token", "chunk"))
        self.loss = _choice(loss, "loss", ("length", "prob"))
        self.estimator = _choice(estimator, "estimator", ("paper", "corrected"))
        if k is not None:
            K = k
        self.K = _as_int(K, "K", 0, "K=5 (0 = read from the length cap)")
        if isinstance(eta, str):
            if eta.strip().lower() != "auto":
                raise ConfigError(f"eta must be a positive number or 'auto', got {eta!r}: "
                                  "pass e.g. eta=0.5")
            eta = "auto"
        elif isinstance(eta, bool) or not isinstance(eta, (int, float)) or not 0 < eta < math.inf:
            raise ConfigError(f"eta must be a positive number or 'auto', got {eta!r}: pass e.g. eta=0.5")
        self.eta: float | str = eta if eta == "auto" else float(eta)
        self.hybrid = _as_bool(hybrid, "hybrid")
        self.skip = _as_bool(skip, "skip")
        self.warmup = _as_int(warmup, "warmup", 0, "warmup=6")
        self.batch = _as_int(batch, "batch", 1, "batch=12")
        self.every = _as_int(every, "every", 1, "every=6")
        self.hybrid_tokens = _as_int(hybrid_tokens, "hybrid_tokens", 0, "hybrid_tokens=5")
        self.base: BaseLearner | None = None
        self._init_state()

    # -- state --------------------------------------------------------------------------
    def _init_state(self) -> None:
        n = self.n_arms
        self._max_cap = 0
        self._rounds = 0  # update() calls
        self._pending: list[list[float]] = []  # gamma vectors of tokens whose loss is incomplete
        self._pending_a: list[list[float]] = []  # their alpha vectors (estimator="corrected")
        self._next = 0  # token position of _pending[0]
        self._queue: list[tuple[int, list[float]]] = []  # complete (position, loss) vectors, FIFO
        self._flush_due = True
        self._last_kept: int | None = None
        self.n_applied = 0  # loss vectors fed to the base learner
        self._gsum, self._gcnt = [0.0] * n, [0] * n  # running gamma statistics for imputation

    def reset(self) -> None:
        n = self.n_arms
        self.base = Hedge(n, self.eta) if self.learner == "hedge" else LEARNERS[self.learner](n)
        self._init_state()

    def begin_request(self, drafter_names: Sequence[str]) -> None:
        before = self.base
        super().begin_request(drafter_names)
        if self.base is before and before is not None:  # global scope, learner kept
            self._next += len(self._pending)
            self._pending, self._pending_a = [], []

    @property
    def depth(self) -> int:
        """Estimator depth K in use (fixed, or the largest cap seen, 5 before any)."""
        if self.K:
            return self.K
        return self._max_cap if self._max_cap > 0 else DEFAULT_K

    def probabilities(self) -> list[float]:
        """The base learner's distribution after all feedback due so far has been applied."""
        self._need_arms()
        if self._flush_due:
            self._flush()
        return list(self.base.probs())

    # -- policy interface -----------------------------------------------------------------
    def select(self) -> int:
        self._need_arms()
        if self._flush_due:  # QFI-D predict phase: catch the learner up with arrived feedback
            self._flush()
        p = self.base.probs()
        return sample_index(self.rng, p)

    def update(self, feedback: RoundFeedback) -> None:
        if self.base is None:
            return
        m = len(feedback.emitted)
        if feedback.k_cap > self._max_cap:
            self._max_cap = feedback.k_cap
        self._rounds += 1
        self._observe(feedback, m)
        got = self._round_rows(feedback, m)
        if got is not None:
            rows, arows = got
            if self.game == "token":
                self._pending.extend(rows)
                if arows is not None:
                    self._pending_a.extend(arows)
                self._drain_pending()
            else:
                t0 = self._next
                self._next += m
                kind = "length" if self.loss == "length" else "prob"
                if rows and self._want(t0):
                    self._queue.append((t0, self._losses(rows, kind, arows)))
        if not self.skip or self._rounds <= self.warmup \
                or (self._rounds - self.warmup) % self.batch == 0:
            self._flush_due = True

    # -- internals --------------------------------------------------------------------------
    def _need_arms(self) -> None:
        if self.base is None or self.n_arms <= 0:
            raise ConfigError(f"selector {self.name!r} has no drafters: call begin_request(names) "
                              "with at least one drafter name first")

    def _observe(self, feedback: RoundFeedback, m: int) -> None:
        """Hook for subclasses (cost statistics); called once per round before the losses."""

    def _round_rows(self, fb: RoundFeedback, m: int
                    ) -> tuple[list[list[float]], list[list[float]] | None] | None:
        """Gamma of every drafter at each of the round's m emitted positions (rows = positions),
        with the chosen drafter's missing bonus-position gamma imputed (module docstring), and
        for ``estimator="corrected"`` the alphas (realised acceptance probabilities)."""
        n = self.n_arms
        cf = fb.counterfactual
        if cf is None:
            if n > 1:  # no full information (e.g. a bandit environment): nothing to learn
                return None
            cf = {fb.drafter: fb.chosen_gammas()}
        gsum, gcnt = self._gsum, self._gcnt
        cols: list[list[float]] = []
        for i in range(n):
            g = list(cf.get(i, ())[:m])
            gsum[i] += sum(g)
            gcnt[i] += len(g)
            cols.append(g)
        for i, g in enumerate(cols):
            if len(g) < m:
                if i == fb.drafter and fb.n_drafted == 0 and fb.k_cap > 0:
                    fill = 0.0  # asked to draft, proposed nothing: nothing can be accepted
                elif gcnt[i]:
                    fill = gsum[i] / gcnt[i]
                else:
                    tot = sum(gcnt)
                    fill = sum(gsum) / tot if tot else 0.5
                g.extend([fill] * (m - len(g)))
        rows = [list(row) for row in zip(*cols)]
        if self.estimator == "paper":
            return rows, None
        given = getattr(fb, "counterfactual_alpha", None) or {}
        acols: list[list[float]] = []
        for i, g in enumerate(cols):
            if i == fb.drafter:  # realised acceptances: 1 per accepted draft, 0 at the rejection
                n_acc, k = fb.n_accepted, fb.n_drafted
                a = ([1.0] * n_acc + ([0.0] if n_acc < k else []))[:m]
            else:
                a = list(given.get(i, g)[:m])
            if len(a) < m:
                a.extend(g[len(a):])  # imputed positions: E[alpha] = gamma
            acols.append(a)
        return rows, [list(row) for row in zip(*acols)]

    def _uses_prob(self, t: int) -> bool:
        if self.loss == "prob":
            return True
        return self.hybrid and t < (self.hybrid_tokens or self.depth)

    def _want(self, t: int) -> bool:
        """Skipping updates (B.5): after warm-up keep one loss vector per ``every`` tokens."""
        if not self.skip or self._rounds <= self.warmup:
            return True
        if self._last_kept is None or t >= self._last_kept + self.every:
            self._last_kept = t
            return True
        return False

    def _drain_pending(self) -> None:
        """Token game: turn every token whose loss is now complete into a loss vector, in order."""
        pending, K = self._pending, self.depth
        apending = self._pending_a if self.estimator == "corrected" else None
        used = 0
        while used < len(pending):
            t = self._next
            if self._uses_prob(t):
                if self._want(t):
                    self._queue.append((t, self._losses(pending[used:used + 1], "prob")))
            elif len(pending) - used >= K:
                if self._want(t):
                    awin = apending[used:used + K] if apending is not None else None
                    self._queue.append((t, self._losses(pending[used:used + K], "length", awin)))
            else:
                break
            used += 1
            self._next += 1
        if used:
            del pending[:used]
            if apending:
                del apending[:used]

    @staticmethod
    def _lengths(window: list[list[float]], awindow: list[list[float]] | None) -> list[float]:
        """Counterfactual accepted length of every arm over a window (Thm 3 or corrected)."""
        if awindow is None:
            return _accept_lengths(window)
        return _corrected_lengths(window, awindow)

    def _losses(self, window: list[list[float]], kind: str,
                awindow: list[list[float]] | None = None) -> list[float]:
        """Loss vector in [0, 1] from a window of gamma vectors: ``length`` ->
        1 - AcceptLength/(len+1) (3.3, B.3); ``prob`` -> mean of 1 - gamma."""
        if kind == "length":
            scale = 1.0 / (len(window) + 1)
            return [1.0 - scale * a for a in self._lengths(window, awindow)]
        if len(window) == 1:
            return [1.0 - g for g in window[0]]
        inv = 1.0 / len(window)
        return [1.0 - inv * sum(col) for col in zip(*window)]

    def _flush(self) -> None:
        base = self.base
        for _, losses in self._queue:
            base.update(losses)
        self.n_applied += len(self._queue)
        self._queue = []
        self._flush_due = False


# -- cost-aware HedgeSpec (ours) ------------------------------------------------------------
class CostAwareHedgeSpec(HedgeSpec):
    """Cost-aware HedgeSpec (ours, beyond the papers): HedgeSpec's full-information game with
    each drafter's counterfactual reward its estimated throughput

        r_i = AcceptLength_i (Thm 3) / T_i,
        T_i = draft_cost(i, d_i) + verify_cost(d_i + 1) + catch_up_cost(i, behind_i),

    where ``d_i = K * fill_i`` is the expected number of drafted tokens (``fill_i`` = running
    mean of drafted/k_cap when i was chosen; prior 1, or 0 for a drafter named ``none``, which
    drafts nothing: verify width 1, draft cost 0, all gammas 0, so r = 1/verify_cost(1)), and
    ``behind_i`` the tokens drafter i is behind (0 under full information: the evaluation phase
    prefills everyone). Costs come from ``self.costs`` (``caps.prices_rounds``; the engine's
    CostModel). A drafter never chosen has an unobserved, hence zero, draft cost: optimism
    that makes the learner try it once and then learn its cost.

    Normalisation into [0, 1]: ``loss_i = 1 - r_i / r_max`` with ``r_max = max_j A_j / T_j``,
    ``A_j`` the largest length the estimator can give arm j (window + 1; 1 for zero-width
    drafters), an upper bound of every r_i that depends on the costs only (not on the round's
    gammas). With equal costs this is exactly HedgeSpec's ``1 - AcceptLength/(K+1)``. If the
    verify cost is unknown (0), time is counted in target forwards (verify = 1, drafting free).
    Hybrid warm start: ``AcceptLength`` of the i.i.d. surrogate ``sum_{k<=K} gamma_t^k``
    (BanditSpec eq. (4)) instead of ``1 - gamma``. No regret guarantee for throughput is
    claimed (costs are estimated online)."""

    name = "cost-hedgespec"
    caps = replace(HedgeSpec.caps, prices_rounds=True)

    def __init__(self, **kwargs: Any):
        if str(kwargs.get("loss", "length")).lower() != "length":
            raise ConfigError("cost-hedgespec optimises throughput from the accepted-length "
                              "estimator: drop loss=... (only loss=length is supported)")
        super().__init__(**kwargs)
        self.costs: CostModel | None = None
        self._ctx = NO_CONTEXT  # the round the losses are priced in (``feedback.context``)

    def select(self, ctx: RoundContext | None = None) -> int:
        return super().select()

    def _init_state(self) -> None:
        super()._init_state()
        n = self.n_arms
        none = [name == "none" for name in self.arm_names] + [False] * (n - len(self.arm_names))
        self._fill_sum = [0.0 if z else 1.0 for z in none[:n]]  # prior: one pseudo-round
        self._fill_cnt = [1] * n
        self._behind = [0] * n
        self._scale_cache: dict[float, list[float]] = {}

    def _observe(self, feedback: RoundFeedback, m: int) -> None:
        self._scale_cache = {}
        self._ctx = feedback.context
        i = feedback.drafter
        if 0 <= i < self.n_arms and feedback.k_cap > 0:
            self._fill_sum[i] += min(1.0, feedback.n_drafted / feedback.k_cap)
            self._fill_cnt[i] += 1
        cf = feedback.counterfactual or {}
        for j in range(self.n_arms):
            self._behind[j] = 0 if (j == i or j in cf) else self._behind[j] + m

    def drafted(self, i: int) -> float:
        """Expected number of tokens drafter i drafts in a round (``K * fill_i``)."""
        return self.depth * self._fill_sum[i] / self._fill_cnt[i]

    def round_time(self, i: int) -> float:
        """Estimated seconds of a round with drafter i (or target forwards if costs unknown)."""
        c, ctx = self.costs, self._ctx
        d = self.drafted(i)
        v = self._verify(c, 1.0 + d, ctx) if c is not None else 0.0
        if v <= 0.0:
            return 1.0
        return max(1e-12, c.draft_cost(i, d, ctx) + v + c.catch_up_cost(i, self._behind[i], ctx))

    @staticmethod
    def _verify(c: CostModel, width: float, ctx: RoundContext = NO_CONTEXT) -> float:
        lo = math.floor(width)
        f = width - lo
        a = c.verify_cost(lo, ctx)
        return a if f < 1e-9 else (1.0 - f) * a + f * c.verify_cost(lo + 1, ctx)

    def _scales(self, top: float) -> list[float]:
        """``1 / (T_i r_max)`` for windows whose longest possible length is ``top`` (cached
        until the next round: the cost estimates change at most once per round)."""
        cached = self._scale_cache.get(top)
        if cached is None:
            n = self.n_arms
            times = [self.round_time(i) for i in range(n)]
            caps = [1.0 if self.drafted(i) <= 0.0 else top for i in range(n)]
            r_max = max(caps[i] / times[i] for i in range(n))
            cached = self._scale_cache[top] = [1.0 / (t * r_max) for t in times]
        return cached

    def _losses(self, window: list[list[float]], kind: str,
                awindow: list[list[float]] | None = None) -> list[float]:
        if kind == "length":
            scales = self._scales(float(len(window) + 1))
            lengths = self._lengths(window, awindow)
        else:  # hybrid surrogate: i.i.d. acceptance at the window's mean gamma
            depth = self.depth
            scales = self._scales(float(depth + 1))
            inv = 1.0 / len(window)
            lengths = [sum((inv * sum(col)) ** k for k in range(depth + 1)) for col in zip(*window)]
        # lengths >= 1 and scales > 0, so every loss is < 1; lengths <= caps, so >= 0
        return [max(0.0, 1.0 - a * c) for a, c in zip(lengths, scales)]


__all__ = ["HedgeSpec", "CostAwareHedgeSpec", "counterfactual_accept_length",
           "corrected_accept_length", "normalhedge_scale",
           "BaseLearner", "Hedge", "NormalHedge", "AdaNormalHedge", "LEARNERS"]
