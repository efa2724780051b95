"""Ours, beyond the papers: stop drafting when one more token no longer pays for itself on
this machine's measured costs (SpecDec++ Theorem 4.3 with a non-flat verify cost)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from ..drafters.base import Decision, DraftStep
from ..feedback import NO_CONTEXT, RoundContext, RoundFeedback
from ..persist import state_type
from .base import LengthCaps, LengthPolicy
from .rules import TAPOUT_MAX_LEN, check_float, check_int, step_confidence


#: a model drafter whose drafting does not pay drafts one token anyway (a probe) after 4^j plain
#: steps in a row (j: probes since it last paid), at most this many, so its estimates can change
MAX_PROBE_GAP = 64


class CostModelRule(LengthPolicy):
    """Draft while the expected accepted tokens per second of the round still rise.

    SpecDec++ eq. (3.1)-(3.2) writes the total time as t_draft N_draft + t_target N_target,
    and Theorem 4.3 says: stop once P(at least one drafted token is rejected) exceeds a
    threshold set by the draft and target costs. Here the target cost is not one constant:
    a forward over w tokens costs V(w), measured at the round's cache length L
    (``costs.verify_cost``, the surface V(w, L); on this CPU V(2..3) is 1.5-2x V(1) while
    V(5..9) is only 1.2-1.4x, and V grows faster with w on a long cache, where the rule
    therefore drafts shorter blocks), and drafting costs d seconds per token
    (``costs.draft_cost``). After the k-th drafted token, with a_i the estimated acceptance
    probability of token i given that tokens < i were accepted and P_k = prod_{i<=k} a_i:

        E_k = 1 + sum_{i<=k} P_i        expected emitted tokens if we verify now (bonus incl.)
        T_k = k d + V(k+1)              seconds of the round (verify width k+1)
        rate(k) = E_k / T_k             tokens per second: eq. (5.1) is its inverse, latency

    Drafting m more tokens, each with acceptance a (the current token's, assuming
    persistence) gives E_{k+m} = E_k + P_k (a + ... + a^m) and T_{k+m} = T_k + m d +
    V(k+m+1) - V(k+1). We continue iff some m in 1..horizon has rate(k+m) > rate(k): with
    m = 1 and flat V this is P_k a T_k > E_k d, i.e. stop when
    P(at least one rejection) = 1 - P_k >= 1 - E_k d / (a T_k) -- Theorem 4.3's form, a
    threshold that rises to 1 as drafting gets cheap. Looking up to ``horizon`` tokens ahead
    (not just one) lets the rule draft through a cost cliff (V(3) > V(4)) instead of stopping
    inside it. If stopping, the current token is dropped (``DISCARD``) when verifying
    without it is faster per token: E_{k-1} / (k d + V(k)) > rate(k) (its draft time is
    sunk either way).

    Acceptance estimates: model drafters use the top probability of q (processed q when
    sampling, softmax of the logits when greedy) times a per-drafter calibration factor
    (discounted sum of observed gammas / sum of predicted ones, prior 1); model-free
    drafters (no q) use a per-drafter discounted mean of the observed gammas
    (``feedback.chosen_gammas()``: realised 0/1 under greedy, p(y) or 1 - TV under sampling),
    starting from ``prior_acceptance``.

    Costs: with a measured surface, V is the surface at the round's cache length and d the
    marginal seconds of one more drafted token (``costs.draft_cost``: the drafter's measured
    function if the cost model has one, else the engine's observed seconds per
    drafted token (``draft_prior`` x V(1) until the drafter has been observed). Without a
    surface V is a linear fit of the observed verify times per width (a cliff is then only seen
    once measured), and without any cost model (no engine) V = 1 and d = ``draft_prior``.
    Catch-up time is not counted (it is paid whatever the length).

    A plain step before drafting: a model-free drafter's estimate is one number, so when
    ``decide`` would drop its first token the round drafts nothing (``begin_round`` returns 0).
    A model drafter's first token costs a forward before ``decide`` sees its q, so the round
    is a plain step when drafting would not beat one even with every token accepted as its
    first tokens have been (the calibrated mean of their top q, ``first_acceptance``): on
    llama.cpp a 0.5B draft model of a 1.5B target costs about a target step per token, and
    drafting its first token every round made the rule 0.67x plain decoding. Such a drafter
    still drafts one token after 1, 4, 16, 64 plain steps in a row (``MAX_PROBE_GAP``), so
    that its estimates follow the text (one token is all a probe needs: its first q).
    """

    name = "cost-model"
    caps = LengthCaps(prices_rounds=True)

    def __init__(self, max_len: int = TAPOUT_MAX_LEN, horizon: int = 16,
                 prior_acceptance: float = 0.6, prior_weight: float = 4.0, decay: float = 0.95,
                 draft_prior: float = 0.1, min_gain: float = 0.0, seed: int | None = 0,
                 scope: str = "request"):
        super().__init__(seed=seed, scope=scope)
        self.max_len = check_int("max_len", max_len)
        self.horizon = check_int("horizon", horizon)
        self.prior_acceptance = check_float("prior_acceptance", prior_acceptance, 0.0, 1.0, 0.6)
        self.prior_weight = check_float("prior_weight", prior_weight, 1e-6, math.inf, 4.0)
        self.decay = check_float("decay", decay, 0.0, 1.0, 0.95)
        self.draft_prior = check_float("draft_prior", draft_prior, 0.0, math.inf, 0.1)
        self.min_gain = check_float("min_gain", min_gain, 0.0, math.inf, 0.0)
        self.costs = None  # set by the engine (adaspec.costs.CostModel)
        self._model_free: list[bool] | None = None  # per drafter, from ``bind_drafters``
        self._trees: list[bool] = []  # per drafter: its rounds draft trees (``bind_trees``)
        self.reset()
        self.begin_round(0)

    # -- learnt state --------------------------------------------------------------------
    def reset(self) -> None:
        #: model drafters: q -> acceptance (``ConfidenceCalibration``, shared with ``auto``)
        self.confidence = ConfidenceCalibration(self.prior_weight, self.decay)
        #: model-free drafters: drafter -> [discounted sum of gammas, discounted count]
        self.acceptance_sums: dict[int, list[float]] = {}
        #: model drafters: drafter -> [discounted sum of first tokens' top q, discounted count]
        self.first_conf: dict[int, list[float]] = {}
        #: model drafters that do not pay: plain steps in a row, and probes since they last paid
        self._plain_run: dict[int, int] = {}
        self._probes: dict[int, int] = {}

    def calibration(self, drafter: int) -> float:
        """Observed / predicted acceptance of a model drafter (1 before any feedback)."""
        return self.confidence.factor(drafter)

    def acceptance(self, drafter: int) -> float:
        """Estimated per-token acceptance of a model-free drafter."""
        g, n = self.acceptance_sums.get(drafter, (0.0, 0.0))
        return (g + self.prior_acceptance * self.prior_weight) / (n + self.prior_weight)

    def first_acceptance(self, drafter: int) -> float | None:
        """A model drafter's expected first-token acceptance: the calibrated discounted mean of
        its first tokens' top q (None before it has drafted)."""
        sums = self.first_conf.get(drafter)
        if sums is None or sums[1] <= 0.0:
            return None
        return self.confidence.acceptance(drafter, sums[0] / sums[1])

    def _drafting_pays(self, drafter: int, draft_s: float, verify: Callable[[int], float]) -> bool:
        """Would a block beat a plain step (rate 1 / V(1)), every token accepted at the
        drafter's ``first_acceptance`` (looking ``horizon`` tokens ahead, as ``decide``)?"""
        a = self.first_acceptance(drafter)
        if a is None:
            return True
        plain, e, p = (1.0 + self.min_gain) / verify(1), 1.0, 1.0
        for m in range(1, min(self.horizon, self.max_len) + 1):
            p *= a
            e += p
            if e / (m * draft_s + verify(m + 1)) > plain:
                return True
        return False

    # -- costs ---------------------------------------------------------------------------
    def _cost_functions(self, drafter: int, ctx: RoundContext = NO_CONTEXT) -> tuple[float, Callable[[int], float]]:
        """(seconds per drafted token, verify cost of a width) in consistent units, in the
        round's context."""
        c = self.costs
        if c is not None and c.surface is not None:
            verify = partial(c.verify_cost, ctx=ctx)  # at the round's cache length
        elif c is not None and c.verify_width_s:
            verify = _linear_fit(c.verify_width_s)
        else:
            return self.draft_prior, lambda w: 1.0
        if c.knows(drafter):  # marginal seconds of one more token
            return c.draft_cost(drafter, 1, ctx) - c.draft_cost(drafter, 0, ctx), verify
        return self.draft_prior * verify(1), verify

    # -- the round -----------------------------------------------------------------------
    def bind(self, drafters: Sequence[Any], trees: Sequence[bool]) -> None:
        self.bind_drafters([d.runs_model for d in drafters])
        self.bind_trees(trees)

    def bind_drafters(self, is_model: Sequence[bool]) -> None:
        """Which drafters run a network (the engine and replay tell every policy that asks)."""
        self._model_free = [not m for m in is_model]

    def bind_trees(self, trees: Sequence[bool]) -> None:
        """Which drafters draft trees (the engine tells, with ``tree=True``)."""
        self._trees = list(trees)

    def _tree(self, drafter: int) -> bool:
        return drafter < len(self._trees) and self._trees[drafter]

    def begin_round(self, drafter: int, ctx: RoundContext | None = None) -> int:
        """The round's cap (priced in the round's context ``ctx``); 0 (a plain step, nothing drafted or looked up) when the drafter is
        model-free and ``decide`` would drop its first token anyway: its acceptance estimate is
        one number per drafter, so that verdict is known before any token is proposed. Not for
        a drafter that drafts trees: one number says nothing about a tree's alternatives, and
        the engine's node budget prices them (a plain step when none pays)."""
        draft_s, verify = self._cost_functions(drafter, NO_CONTEXT if ctx is None else ctx)

        def block() -> BlockRate:
            return BlockRate(draft_s, verify, horizon=self.horizon, limit=self.max_len, min_gain=self.min_gain)

        self._drafter, self._confs, self._rate = drafter, [], block()
        free = self._model_free
        if free is None or drafter >= len(free) or self._tree(drafter):
            return self.max_len
        if free[drafter]:
            return 0 if block().step(0, self.acceptance(drafter)) is Decision.DISCARD else self.max_len
        if self._drafting_pays(drafter, draft_s, verify):
            self._plain_run[drafter] = self._probes[drafter] = 0
            return self.max_len
        run = self._plain_run.get(drafter, 0) + 1
        probes = self._probes.get(drafter, 0)
        if run <= min(4 ** probes, MAX_PROBE_GAP):
            self._plain_run[drafter] = run
            return 0
        self._plain_run[drafter], self._probes[drafter] = 0, probes + 1  # a probe: its first q
        return 1

    def decide(self, step: DraftStep) -> Decision:
        conf = step_confidence(step)  # max q(x), from q or from a trace's recorded statistics
        if conf is None:
            a = self.acceptance(self._drafter)
        else:
            self._confs.append(conf)
            a = self.confidence.acceptance(self._drafter, conf)
            if step.index == 0:
                sums = self.first_conf.setdefault(self._drafter, [0.0, 0.0])
                sums[0] = self.decay * sums[0] + conf
                sums[1] = self.decay * sums[1] + 1.0
        return self._rate.step(step.index, a)

    def update(self, feedback: RoundFeedback) -> None:
        # the estimates price chains (``decide``); a tree round's accepted path is not one's
        if feedback.n_drafted == 0 or feedback.tree_nodes:
            return
        gammas = feedback.chosen_gammas()
        d, keep = feedback.drafter, self.decay
        if self._confs:
            self.confidence.observe(d, gammas, self._confs)
        else:
            g, n = self.acceptance_sums.get(d, (0.0, 0.0))
            self.acceptance_sums[d] = [keep * g + sum(gammas), keep * n + len(gammas)]


@state_type
class ConfidenceCalibration:
    """A model drafter's acceptance given its confidence, learned online (the cost-model
    rule's estimate; ``auto`` shares it): a token drafted with top probability max q is
    accepted with probability

        a(q) = min(1, max q * f_d),   f_d = (G_d + w) / (C_d + w)

    G_d and C_d the drafter's discounted sums of observed gammas and of predicted confidences
    over its verified tokens up to the first rejection (each round's sums are multiplied by
    ``decay`` before adding), w = ``prior_weight`` (f_d = 1 before any feedback)."""

    def __init__(self, prior_weight: float = 4.0, decay: float = 0.95):
        self.prior_weight, self.decay = prior_weight, decay
        #: drafter -> [discounted sum of gammas, of predicted confidences]
        self.sums: dict[int, list[float]] = {}

    def factor(self, drafter: int) -> float:
        """f_d: observed / predicted acceptance (1 before any feedback)."""
        g, c = self.sums.get(drafter, (0.0, 0.0))
        return (g + self.prior_weight) / (c + self.prior_weight)

    def acceptance(self, drafter: int, conf: float) -> float:
        return min(1.0, conf * self.factor(drafter))

    def observe(self, drafter: int, gammas: Sequence[float], confs: Sequence[float]) -> None:
        """A round's chosen-drafter gammas (``feedback.chosen_gammas()``) against the
        confidences ``decide`` saw; tokens past the shorter of the two do not count."""
        n = min(len(gammas), len(confs))
        g, c = self.sums.get(drafter, (0.0, 0.0))
        self.sums[drafter] = [self.decay * g + sum(gammas[:n]), self.decay * c + sum(confs[:n])]


@state_type
class BlockRate:
    """A round's expected tokens per second as its block grows, and the cost-model rule's
    verdict after each drafted token (``auto`` shares it for drafters that report q).

    After the k-th token, with a_i the acceptance estimate of token i and P_k = prod a_i:
    E_k = 1 + sum_{i<=k} P_i, T_k = base + k d + V(k+1), rate(k) = E_k / T_k (``base``: the
    round's time that does not grow with the block, 0 in the cost-model rule, the per-round
    overhead in ``auto``). CONTINUE iff some m in 1..min(horizon, limit - k) has
    rate(k+m) > rate(k) (1 + min_gain), the m tokens ahead accepted at a_k each (persistence):
    looking ahead drafts through a verify-cost cliff. Else DISCARD the k-th token when
    verifying without it is faster per token (E_{k-1} / (base + k d + V(k)), its drafting
    sunk), else STOP."""

    def __init__(self, per_token: float, verify: Callable[[int], float], base: float = 0.0,
                 horizon: int = 16, limit: int = TAPOUT_MAX_LEN, min_gain: float = 0.0):
        self.per_token, self._verify_fn, self.base = per_token, verify, base
        self.horizon, self.limit, self.min_gain = horizon, limit, min_gain
        self.p_all = 1.0  # P_k: probability that every token drafted so far is accepted
        self.expected = 1.0  # E_k
        self._vcache: dict[int, float] = {}

    def verify(self, width: int) -> float:
        v = self._vcache.get(width)
        if v is None:
            v = self._vcache[width] = float(self._verify_fn(width))
        return v

    def step(self, index: int, a: float) -> Decision:
        """Token ``index`` (0-based) was drafted with acceptance estimate ``a``: the verdict."""
        self.p_all *= a
        self.expected += self.p_all
        return self.decide(index + 1, a)

    def decide(self, k: int, a_next: float) -> Decision:
        d, e, p, base = self.per_token, self.expected, self.p_all, self.base
        v_now = self.verify(k + 1)
        t_now = base + d * k + v_now
        rate_stop = e / t_now
        rate_drop = (e - p) / (base + d * k + self.verify(k))
        best = max(rate_stop, rate_drop) * (1.0 + self.min_gain)
        gain, pm = 0.0, p
        for m in range(1, min(self.horizon, self.limit - k) + 1):
            pm *= a_next
            gain += pm
            if (e + gain) / (t_now + m * d + self.verify(k + m + 1) - v_now) > best:
                return Decision.CONTINUE
        return Decision.DISCARD if rate_drop > rate_stop else Decision.STOP


def _linear_fit(table: dict[int, float]) -> Callable[[int], float]:
    """Least-squares V(w) = a + b w over observed (width, seconds), b >= 0, floored at the
    cheapest observation (one width observed: flat)."""
    ws, ts = list(table), list(table.values())
    floor = min(ts)
    n = len(ws)
    mw, mt = sum(ws) / n, sum(ts) / n
    var = sum((w - mw) ** 2 for w in ws)
    b = max(0.0, sum((w - mw) * (t - mt) for w, t in zip(ws, ts)) / var) if var > 0 else 0.0
    a = mt - b * mw
    return lambda w: max(floor, a + b * w)
