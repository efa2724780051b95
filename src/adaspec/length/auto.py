"""``auto``: one controller that picks the drafter *and* the draft length from the time per
token each choice would cost on this machine (ours, beyond the papers).

Objective. The papers' learners maximise accepted length (BanditSpec, MetaSD, HedgeSpec), but
on a CPU a longer verify block costs more, and a drafter whose drafts are rejected more often
wastes verify width: the drafter with the higher acceptance length can be the slower one.
``auto`` scores every (drafter d, cap k) by expected tokens per second of the round,

    rate_d(k) = E_d(k) / T_d(k)
    E_d(k)    = 1 + h_d a_d sum_{j<k} c_d^j                     expected emitted tokens
    T_d(k)    = o + h_d (D_d(k) + V(k+1)) + (1 - h_d) V(1)      expected seconds

with h_d the probability that d has a proposal at the round's first position (model-free
drafters often have none), a_d the probability that its first token is accepted given a
proposal, c_d that token j+1 is accepted given token j was (a two-state Markov chain, which
captures the long copy runs of prompt lookup and suffix matching that a single i.i.d.
acceptance rate smears out), D_d(k) its drafting seconds for k tokens, V(w) the target's
verify cost for a block of w tokens at the round's cache length (the measured surface,
``costs.CostModel.verify_cost``) and o the
engine's per-round overhead. The round plays ``argmax_{d, k} rate_d(k)``, with k = 0 (a plain
decoding step, rate 1 / (o + V(1))) always available: drafting stops where it does not pay,
and because every k up to ``max_k`` is priced, a cap never stops inside a verify-cost cliff
when a longer block is cheaper per expected token (the joint length of the issue).

Model drafters' blocks (``confidence_stop=1``, default). The plan is blind to how sure a
drafter is of each token; a drafter that reports q (a model drafter drafting a chain) gets cap
``max_k`` and ``AutoLength.decide`` stops its block with the cost-model rule's test on auto's
costs: go on after token k iff rate(k+m) > rate(k) for some m, rate(k) = E_k / (o + D(k) +
V(k+1)), E_k = 1 + sum_{i<=k} prod_{j<=i} a_j, a_j = min(1, max q_j f_d), f_d learnt online
(``length.cost_rule.BlockRate``, ``ConfidenceCalibration``; docs/drafters-and-policies.md).

Looking first (``peek=1``, default). A model-free drafter's proposal is a table lookup, so the
engine asks each of them for the first ``peek_depth`` tokens of its block before the choice
(``Drafter.peek``) and reuses the chosen one's block as the draft (a cap past a block cut at
the depth is drafted again). For those drafters h is then known (1 if it proposed, 0 if not),
k is capped at the block's length if the drafter had no more, and drafting is already paid
(the engine counts the looking in the round overhead o, which the cost model learns). a and c
are conditioned on what the blocks show, the context ``rel:m`` (``peek_context``): whether the
drafter proposes alone, agrees with another's first token or disagrees, and the bucket of the
match length behind its first token (``MATCH_BUCKETS``; SuffixDecoding's score: on the mixed
suite suffix's first token is accepted 54% after a 2-token match, 99% after a 24-token one).
Agreement counts only across drafter families (``bind_families``): a suffix drafter over a
datastore proposes what plain suffix matching does whenever the request holds the longest
match, so agreeing with it is no evidence.

Skipping looks that do not pay (``look_share``, off by default). Looking and planning cost
~0.2 ms a round: 0.3% of a PyTorch SmolLM2 forward, 3% of a llama.cpp one, where most rounds
are plain steps. With ``look_share`` > 0, after j looks in a row planned a plain step, the next
min(2^(j-1) - 1, s) rounds are plain steps without looking, s the fewest skips that bring the
look's measured seconds (``CostModel.look_s``) to ``look_share`` of a plain round o + V(1) on
average (at most ``MAX_LOOK_SKIP``); a look that drafts starts over. At 0.005: s = 0 on
PyTorch; on llama.cpp policy time halves (1.4% -> 0.8%), but skipped rounds miss copies and
two benches came out level (``LOOK_SHARE``).

Feedback. A looked-at drafter is scored on its own block for free (``peek_chain``: 1 while the
block matches the emitted tokens, then 0, censored at the shorter), so when every drafter can
be looked at the engine's scoring is off (``AutoSelector.full_information``); ``none`` is never
scored. Unbiased under sampling too: an emitted token is distributed as the target's p
(speculative sampling, Leviathan et al. 2023, Thm 1) and a block token is a function of the
prefix, so P(emitted_j = b_j | prefix) = p_j(b_j), the one-hot acceptance probability. Drafters
that cannot be looked at (model drafters) are scored on the verified tokens by the engine
(full information, Not-a-Bandit 3.2: ``feedback.counterfactual`` holds their acceptance
probability gamma at every emitted position, ``counterfactual_alpha`` the acceptance of the
realised token), every ``model_eval_every`` rounds (skipped evaluation, Not-a-Bandit B.5),
an interval that doubles (up to 2^``MAX_EVAL_BACKOFF`` times) while their best plan keeps
losing to the round's choice, and learn from their own rounds in between. A model drafter is
scored every round and not played until ``MODEL_WARMUP`` first tokens are scored
(``trusted``): scoring costs its forward, playing it on the prior's optimism a wider verify.

Estimator and censoring. From one drafter's gammas g_1..g_m and realised acceptances
alpha_1..alpha_m along a verified chain, the counts are (fractional under sampling):

    proposal:   1 trial, success 1[proposed at position 1]
    first:      1 trial if proposed, success g_1
    continue:   for j >= 2, trial alpha_{j-1}, success alpha_{j-1} g_j

i.e. the maximum-likelihood estimate of the Markov chain from the observed transitions. A
chain is observed only up to the round's last emitted token (the chosen drafter's only up to
its cap, a looked-at one's up to the look's depth): those runs are right-censored, and
censoring only removes transitions that were never observed, so the transition estimate stays
consistent; counting a censored run as "ended" (the naive run-length average) would bias c_d
low. tests/test_selection_auto.py checks both on a simulated chain.

Levels and warm start. Counts live at four levels, each the Beta prior of the next, worth
``prior_weight`` (w) trials: p_level = (s_level + w p_parent) / (t_level + w). Global per
drafter (kept across requests with ``scope="global"``, default, decayed by ``global_decay``;
before any data (h, a, c) = (0.5, 0.5, 0.7)), the request's per drafter (decayed by
``request_decay`` per round, so the estimate follows the prompt), global per (drafter,
context), the request's per (drafter, context).

Lower bound. The plan uses every probability lowered by z = ``shrink`` posterior standard
deviations, p_plan = max(0, p - z_e sqrt(p (1 - p) / (n + 1))), n = w + this request's trials
(of the drafter, or of the context): the global counts set the mean, but a request may differ
from the average one by as much as a prior worth w trials says, so only its own evidence
narrows the bound. z_e = z e / (e + w), e = the drafter's trials so far (global and this
request's): a cold start (a fresh engine, e.g. one ``adaspec generate``) plans on the prior's
mean, since no estimate has been picked for being lucky yet (with the full z from the first
round, a fresh engine never drafted on 3 of 4 short SmolLM2 prompts, and drafted once in 13
rounds where the old controller reached 2.6 tokens a round). Choosing among many noisy estimates picks the optimistic ones (the
optimizer's curse, Smith & Winkler 2006), and on a steep verify curve (llama.cpp: one drafted
token pays only if a > 0.83) a context that looked good by chance costs more than plain
decoding. It needs full information (the counts keep coming whatever is chosen): with bandit
feedback the plan uses the means (``shrink`` 0), else a drafter whose bound fell below paying
would never be tried again.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import partial
from typing import Any, NamedTuple

from ..drafters.base import Decision, DraftStep
from ..errors import ConfigError
from ..feedback import NO_CONTEXT, RoundContext, RoundFeedback
from ..persist import state_type
from .base import LengthCaps, LengthPolicy
from .cost_rule import BlockRate, ConfidenceCalibration
from .rules import step_confidence

#: a model drafter whose plan keeps losing is scored every model_eval_every x 2^j rounds, j <= this
MAX_EVAL_BACKOFF = 5
#: a model drafter whose plan keeps losing rests from planning (is not priced, so not chosen)
#: for up to this many rounds, 2^(j-1) - 1 after j losses in a row, unless new evidence comes
#: (``AutoController.choose``): six pool heads priced every round were ~40% of planning
MAX_PLAN_REST = 7
#: a model drafter is scored every round, and not played, until it has this many scored first
#: tokens (full feedback only): scoring costs a forward of the drafter, playing it on the
#: prior's optimism a wider verify (``AutoController.trusted``)
MODEL_WARMUP = 4
#: prior of (h, a, c) before any data, see the module docstring
DEFAULT_PRIOR = (0.5, 0.5, 0.7)
NONE_NAMES = ("none",)
#: while looking finds nothing worth drafting, looks (peeks and planning) may be skipped so
#: that they cost at most this share of a plain round (``AutoController.looks``; option
#: ``look_share``). Off by default: 0.005 halved auto's policy time on llama.cpp, but the
#: rounds it skipped missed copies (MAT 1.44 -> 1.35) and two benches came out level (+-0.7%)
LOOK_SHARE = 0.0
#: ... skipping at most this many rounds in a row
MAX_LOOK_SKIP = 8
#: scoring trusted model drafters on rounds they did not play may cost at most this share of
#: the wall time (``CostModel.eval_share``; option ``eval_share``): past it their scores are
#: skipped (Not-a-Bandit B.5). With the default SmolLM2 pool's six feature heads scoring
#: took several percent of the wall time without a budget; with one, under 1%, at the same speed
EVAL_SHARE = 0.005


@state_type
class DecayClock:
    """Rounds seen by one level of counts (a request's, or the global one), and its per-round
    decay: counts decay lazily, by keep^(rounds since they were last touched), so a round
    ticks one clock instead of multiplying every count of every context."""

    __slots__ = ("keep", "now")

    def __init__(self, keep: float = 1.0):
        self.keep, self.now = float(keep), 0


@state_type
class ChainCounts:
    """Discounted success / trial counts of one drafter's acceptance chain: (proposal, first,
    continue), decayed by its level's ``DecayClock`` (none: never decayed)."""

    __slots__ = ("_s", "_t", "clock", "stamp")

    def __init__(self, s: Sequence[float] | None = None, t: Sequence[float] | None = None,
                 clock: DecayClock | None = None):
        self._s = list(s) if s is not None else [0.0, 0.0, 0.0]
        self._t = list(t) if t is not None else [0.0, 0.0, 0.0]
        self.clock = clock
        self.stamp = clock.now if clock is not None else 0

    def _sync(self) -> None:
        c = self.clock
        if c is not None and c.now != self.stamp:
            f = c.keep ** (c.now - self.stamp)
            s, t = self._s, self._t  # in place, unrolled: this runs for every count every round
            s[0] *= f
            s[1] *= f
            s[2] *= f
            t[0] *= f
            t[1] *= f
            t[2] *= f
            self.stamp = c.now

    @property
    def s(self) -> list[float]:
        self._sync()
        return self._s

    @s.setter
    def s(self, value: Sequence[float]) -> None:
        self._sync()
        self._s = list(value)

    @property
    def t(self) -> list[float]:
        self._sync()
        return self._t

    @t.setter
    def t(self, value: Sequence[float]) -> None:
        self._sync()
        self._t = list(value)

    def __repr__(self) -> str:
        return f"ChainCounts(s={self.s}, t={self.t})"

    def observe(self, gammas: Sequence[float], alphas: Sequence[float], proposed: bool | None) -> None:
        """Add one chain observed from a round's first emitted position (module docstring)."""
        self.add(chain_counts(gammas, alphas, proposed))

    def add(self, delta: tuple[float, float, float, float, float, float]) -> None:
        """Add ``chain_counts``' (s0, t0, s1, t1, s2, t2) (one chain counted at every level)."""
        self._sync()
        s, t = self._s, self._t
        s[0] += delta[0]
        t[0] += delta[1]
        s[1] += delta[2]
        t[1] += delta[3]
        s[2] += delta[4]
        t[2] += delta[5]

    def estimate(self, prior: Sequence[float], weight: float) -> tuple[float, float, float]:
        """(h, a, c): Beta-style means with ``prior`` worth ``weight`` trials."""
        self._sync()
        s, t = self._s, self._t
        return ((s[0] + weight * prior[0]) / (t[0] + weight), (s[1] + weight * prior[1]) / (t[1] + weight),
                (s[2] + weight * prior[2]) / (t[2] + weight))


def chain_counts(gammas: Sequence[float], alphas: Sequence[float],
                 proposed: bool | None) -> tuple[float, float, float, float, float, float]:
    """One chain's successes and trials (s0, t0, s1, t1, s2, t2) of (proposal, first,
    continue), from its gammas and realised acceptances (module docstring, "Estimator")."""
    s0 = t0 = s1 = t1 = s2 = t2 = 0.0
    if proposed is not None:
        t0, s0 = 1.0, 1.0 if proposed else 0.0
        if not proposed:
            return s0, t0, s1, t1, s2, t2
    if gammas:
        t1, s1 = 1.0, float(gammas[0])
        for j in range(1, len(gammas)):
            w = float(alphas[j - 1]) if j - 1 < len(alphas) else float(gammas[j - 1])
            if w <= 0.0:
                break
            t2 += w
            s2 += w * float(gammas[j])
    return s0, t0, s1, t1, s2, t2


def lower_bound(p: float, n: float, z: float) -> float:
    """Posterior mean ``p`` of a Beta with ``n`` pseudo-trials lowered by ``z`` posterior
    standard deviations sqrt(p (1 - p) / (n + 1)): a choice among noisy estimates picks the
    optimistic ones (the optimizer's curse, Smith & Winkler 2006), so plan on a lower bound."""
    return max(0.0, p - z * (p * (1.0 - p) / (n + 1.0)) ** 0.5)


def verify_floor(widths: Sequence[float]) -> list[float]:
    """floor[w] = min(widths[w:]): the cheapest verify of a block at least w wide (a lower
    bound on what any longer cap costs, ``AutoController.best_k``)."""
    floor = list(widths)
    for w in range(len(floor) - 2, -1, -1):
        floor[w] = min(floor[w], floor[w + 1])
    return floor


def expected_tokens(h: float, a: float, c: float, k: int) -> float:
    """E(k) = 1 + h a (1 + c + ... + c^(k-1)): emitted tokens of a round with cap k."""
    if k <= 0:
        return 1.0
    geo = k if c >= 1.0 else (1.0 - c ** k) / (1.0 - c)
    return 1.0 + h * a * geo


@state_type
class Plan(NamedTuple):
    """The controller's choice for a round (a tuple: one is built per drafter per round)."""

    drafter: int
    k: int
    rate: float  # expected tokens per second


@state_type
class AutoController:
    """The shared state of ``auto``: per-drafter chain counts, costs and the round's plan.

    Pure and deterministic: no randomness, no clock; costs come from ``self.costs`` (the
    engine's ``CostModel``; without one every block costs 1 and drafting 0).
    """

    def __init__(self, max_k: int = 16, prior_weight: float = 8.0, request_decay: float = 0.98,
                 global_decay: float = 0.999, model_eval_every: int = 4, scope: str = "global",
                 objective: str = "time", shrink: float = 1.0):
        if not isinstance(shrink, (int, float)) or isinstance(shrink, bool) or not 0.0 <= shrink <= 10.0:
            raise ConfigError(f"shrink must be a number in [0, 10], got {shrink!r}: pass e.g. shrink=1 "
                              "(posterior standard deviations; 0 plans on the posterior means)")
        if objective not in ("time", "length"):
            raise ConfigError(f"objective must be 'time' or 'length', got {objective!r}: 'length' maximises "
                              "the expected accepted length (the papers' objective, for ablations)")
        if isinstance(max_k, bool) or not isinstance(max_k, int) or not 1 <= max_k <= 64:
            raise ConfigError(f"max_k must be an integer in 1..64, got {max_k!r}: pass e.g. max_k=16")
        for name, v in (("request_decay", request_decay), ("global_decay", global_decay)):
            if not isinstance(v, (int, float)) or not 0.0 < v <= 1.0:
                raise ConfigError(f"{name} must be in (0, 1], got {v!r}: pass e.g. {name}=0.98")
        if not isinstance(prior_weight, (int, float)) or not prior_weight > 0:
            raise ConfigError(f"prior_weight must be > 0, got {prior_weight!r}: pass e.g. prior_weight=8")
        if isinstance(model_eval_every, bool) or not isinstance(model_eval_every, int) or model_eval_every < 1:
            raise ConfigError(f"model_eval_every must be an integer >= 1, got {model_eval_every!r}")
        if scope not in ("request", "global"):
            raise ConfigError(f"scope must be 'request' or 'global', got {scope!r}")
        self.max_k, self.prior_weight = max_k, float(prior_weight)
        self.request_decay, self.global_decay = float(request_decay), float(global_decay)
        self.model_eval_every, self.scope, self.objective = model_eval_every, scope, objective
        self.costs: Any = None  # adaspec.costs.CostModel, set by the engine (prices_rounds)
        #: the round being planned (``choose``; the engine's ``RoundContext``): where costs are read
        self.ctx = NO_CONTEXT
        self.names: list[str] = []
        self.is_model: list[bool] = []
        self._models: list[int] = []
        self._free: list[int] = []
        #: per drafter, its family (``drafters.drafter_family``; ``bind_families``): agreement
        #: in the peek contexts counts only across families
        self.families: list[str] = []
        #: the two levels' decay clocks (a batch shares the global one with the global counts)
        self.global_clock, self.request_clock = DecayClock(global_decay), DecayClock(request_decay)
        #: per model drafter: how many of its evaluations in a row found its plan losing
        self.eval_losses: dict[int, int] = {}
        self.global_counts: list[ChainCounts] = []
        self.request_counts: list[ChainCounts] = []
        self.rounds = 0
        self.plan: Plan | None = None
        #: this round's block of every drafter the engine let us look at (peek), and the
        #: context of each (``peek_context``): what its estimates are conditioned on
        self.peeked: dict[int, list[int]] = {}
        self.contexts: dict[int, str] = {}
        self.global_ctx: list[dict[str, ChainCounts]] = []
        self.request_ctx: list[dict[str, ChainCounts]] = []
        #: score looked-at drafters on their blocks instead of the engine's evaluation
        self.learn_from_peeks = True
        #: scored first tokens a model drafter needs before it is played (``trusted``), and
        #: per drafter the first tokens scored so far (kept with the global counts)
        self.model_warmup = 0
        self.first_scored: dict[int, int] = {}
        #: tokens the engine shows of each block (a block this long may go on)
        self.peek_depth = max_k
        #: plan on estimates lowered by this many posterior standard deviations
        self.shrink = float(shrink)
        #: looking rounds in a row that planned a plain step, and plain steps left to take
        #: without looking (``looks``); ``skipping``: this round is one of them
        self.idle_looks = 0
        self.skip_left = 0
        self.skipping = False
        self._looked = False
        #: looks may cost this share of a plain round on average (0: look every round)
        self.look_share = LOOK_SHARE
        #: the round's plan fixed by a batch's joint width (``commit``), played by ``choose``
        self.forced: Plan | None = None
        #: trusted model drafters are scored only while scoring costs at most this share of
        #: the wall time (``EVAL_SHARE``; 1: no budget)
        self.eval_share = EVAL_SHARE
        #: per model drafter: plans lost in a row, and the round it is priced again (``choose``)
        self.plan_losses: dict[int, int] = {}
        self.rest_until: dict[int, int] = {}

    # -- lifecycle --------------------------------------------------------------------------
    def begin_request(self, names: Sequence[str], is_model: Sequence[bool] | None = None) -> None:
        names = list(names)
        if self.scope == "request" or names != self.names:
            self.names = names
            self.global_counts = [ChainCounts(clock=self.global_clock) for _ in names]
            self.global_ctx = [{} for _ in names]
            self.eval_losses = {}
            self.first_scored = {}
        self.is_model = list(is_model) if is_model is not None else [False] * len(names)
        #: model drafters, and the model-free ones but ``none`` (``to_score``)
        self._models = [d for d, m in enumerate(self.is_model) if m]
        self._free = [d for d, n in enumerate(names) if not self.is_model[d] and n not in NONE_NAMES]
        #: the first ``none`` drafter (a plain step's), or None
        self._none = next((d for d, n in enumerate(names) if n in NONE_NAMES), None)
        self.request_counts = [ChainCounts(clock=self.request_clock) for _ in names]
        self.request_ctx = [{} for _ in names]
        self.rounds = 0
        self.plan = None
        self.peeked, self.contexts = {}, {}
        self.idle_looks = self.skip_left = 0
        self.skipping = self._looked = False
        self.forced = None
        self.plan_losses, self.rest_until = {}, {}

    # -- estimates and costs ----------------------------------------------------------------
    def estimate(self, d: int, context: str | None = None) -> tuple[float, float, float]:
        """(h, a, c) of drafter ``d`` for this request (module docstring, "Estimator"): the
        request's counts on the global estimate; with a peek ``context``, the global and then
        the request's counts of that context on top; each probability lowered to its
        posterior ``shrink``-sigma lower bound."""
        w = self.prior_weight
        glob_c, req_c = self.global_counts[d], self.request_counts[d]
        est = req_c.estimate(glob_c.estimate(DEFAULT_PRIOR, w), w)
        gt, n = glob_c._t, req_c._t  # synced by estimate; n: this request's evidence (+ w below)
        if context is not None:
            g = self.global_ctx[d].get(context)
            if g is not None:
                est = g.estimate(est, w)
            r = self.request_ctx[d].get(context)
            if r is not None:
                est = r.estimate(est, w)
            n = r._t if r is not None else (0.0, 0.0, 0.0)
        if self.shrink <= 0.0:
            return est
        # the curse is of estimates from data: a cold start (no trials yet) plans on the prior's
        # mean, and the bound comes in as trials do (z e / (e + w), e = trials behind it)
        z, rt = self.shrink, req_c._t
        return (lower_bound(est[0], w + n[0], z * (gt[0] + rt[0]) / (gt[0] + rt[0] + w)),
                lower_bound(est[1], w + n[1], z * (gt[1] + rt[1]) / (gt[1] + rt[1] + w)),
                lower_bound(est[2], w + n[2], z * (gt[2] + rt[2]) / (gt[2] + rt[2] + w)))

    def _cost_fns(self) -> tuple[Callable[[int], float], Callable[[int, int], float], float]:
        c, ctx = self.costs, self.ctx
        if c is None or self.objective == "length":  # unit costs: the rate is the expected length
            return (lambda w: 1.0), (lambda d, n: 0.0), 0.0
        return (partial(c.verify_cost, ctx=ctx), partial(c.draft_cost, ctx=ctx),
                float(getattr(c, "round_overhead_s", 0.0) or 0.0))

    def shared_state(self) -> list[Any]:
        """What per-request copies share with this controller (``round.fork_policies``): its
        global counts and their clock, with ``scope=global``."""
        if self.scope != "global":
            return []
        return [self.global_counts, self.global_ctx, self.global_clock]

    def best_k(self, d: int, verify: Callable[[int], float] | None = None,
               draft: Callable[[int, int], float] | None = None, overhead: float | None = None,
               floor: Sequence[float] | None = None) -> Plan:
        """The cap k in 0..max_k that maximises rate_d(k) (k = 0: a plain decoding step).
        ``floor[w]``: min V(w') over w' >= w (``verify_floor``); with it the search stops once
        no longer cap can beat the best so far (E(k') < 1 + h a / (1 - c), T(k') >= o + miss +
        h (D(k) + floor[k + 1]) for k' >= k: drafting more tokens never costs less, as in every
        cost model here): a drafter that does not pay is priced in a few steps, not max_k."""
        if verify is None or draft is None or overhead is None:
            verify, draft, overhead = self._cost_fns()
        v1 = verify(1)
        best_rate = 1.0 / max(overhead + v1, 1e-12)
        if self.names[d] in NONE_NAMES or not self.trusted(d):
            return Plan(d, 0, best_rate)
        top = self.max_k
        if d in self.peeked:  # its proposal is known: h is 0 or 1, k <= its length, drafting done
            block = len(self.peeked[d])
            if not block:  # it proposes nothing: a plain step, no estimate needed
                return Plan(d, 0, best_rate)
            _, a, c = self.estimate(d, self.contexts.get(d))
            h = 1.0
            if block < self.peek_depth:  # the drafter has no more: k <= its length
                top = min(top, block)
            if top <= block:
                draft = (lambda _d, _n: 0.0)
            else:  # a look cut at the depth: the drafter continues it past its end
                full = draft
                draft = (lambda _d, n: 0.0 if n <= block else full(_d, n - block))
        else:
            h, a, c = self.estimate(d)
        miss = (1.0 - h) * (v1 + draft(d, 0))
        ha, run, geo = h * a, 1.0, 0.0  # E(k) = 1 + h a (1 + c + ... + c^(k-1)), summed as k grows
        best_k = 0
        bound = floor is not None and c < 1.0
        for k in range(1, top + 1):
            dk = draft(d, k)
            # the best any cap >= k could do, drafting never cheaper for more tokens (1e-9: rounding)
            if bound and (1.0 + ha * (geo + run / (1.0 - c))) <= best_rate * (1.0 - 1e-9) * max(
                    overhead + miss + h * (dk + floor[k + 1]), 1e-12):
                break
            geo += run
            run *= c
            rate = (1.0 + ha * geo) / max(overhead + h * (dk + verify(k + 1)) + miss, 1e-12)
            if rate > best_rate:
                best_k, best_rate = k, rate
        return Plan(d, best_k, best_rate)

    def trusted(self, d: int) -> bool:
        """May drafter ``d`` be played? A model drafter only once scored on ``model_warmup``
        first tokens (``MODEL_WARMUP`` with full feedback, else 0): before that its plan is
        the prior's mean, and on the pool's heads that mean (h a = 0.25) planned drafting
        where they were accepted 10-15% of the time (0.95x auto without them)."""
        return (self.model_warmup <= 0 or d >= len(self.is_model) or not self.is_model[d]
                or self.first_scored.get(d, 0) >= self.model_warmup)

    def looks(self) -> bool:
        """Should the engine show this round's blocks (peek)? Not while skipping: after j
        looking rounds in a row planned a plain step, the next min(2^(j-1) - 1, s) rounds are
        plain steps taken without looking or planning, s = the fewest skips that bring the
        look's seconds (``CostModel.look_s``: peeks and planning, measured) down to
        ``look_share`` (``LOOK_SHARE``) of a plain round, o + V(1), on average: 0 on PyTorch's SmolLM2 (0.2 ms
        of 55), 5 on llama.cpp's (0.2 ms of 7). A drafter that proposes again waits at most
        s rounds to be seen."""
        return self.skip_left == 0

    def _max_skip(self) -> int:
        look = float(getattr(self.costs, "look_s", 0.0) or 0.0)
        if look <= 0.0 or self.look_share <= 0.0 or self.objective != "time":
            return 0
        verify, _, overhead = self._cost_fns()
        plain = overhead + verify(1)
        if plain <= 0.0:
            return 0
        return max(0, min(MAX_LOOK_SKIP, math.ceil(look / (self.look_share * plain)) - 1))

    def choose(self, ctx: RoundContext | None = None) -> Plan:
        """The round's (drafter, cap): the best rate over every drafter and cap. A plain step
        (k = 0) goes to the ``none`` drafter if there is one, else to the best drafter, which
        is then scored like the others (the engine evaluates a chosen drafter that drafted
        nothing). While skipping looks (``looks``): ``none``, unplanned. ``ctx``: the round's
        ``RoundContext`` (where its costs are read; kept for the round's later questions)."""
        if ctx is not None:
            self.ctx = ctx
        looked, self._looked = self._looked, False
        self.skipping = self.skip_left > 0
        if self.skipping:
            self.skip_left -= 1
            self.peeked, self.contexts = {}, {}
            self.plan = Plan(self._none, 0, 0.0)  # skipping follows plain steps: there is a none
            return self.plan
        plans: list[Plan] | None = None
        if self.forced is not None:  # a batch chose this round's width for every row (``commit``)
            best, self.forced = self.forced, None
        else:
            verify, draft, overhead = self._cost_fns()
            need = self._plan_width()
            row = getattr(self.costs, "verify_row", None) if self.objective == "time" else None
            if row is not None:  # V(w) at this round's context, once, as wide as a plan can go
                widths = row(need + 1, self.ctx)
            else:
                widths = [0.0] + [verify(w) for w in range(1, need + 2)]
            if need == 0 and self._none is not None:  # nothing can draft: a plain step, unplanned
                best = Plan(self._none, 0, 1.0 / max(overhead + widths[1], 1e-12))  # best_k's rate
            else:
                floor = verify_floor(widths)
                rest = self.rest_until
                plans = [self.best_k(d, widths.__getitem__, draft, overhead, floor) for d in range(len(self.names))
                         if not rest or rest.get(d, 0) <= self.rounds]
                best = max(plans, key=lambda p: (p.rate, p.k))
        if best.k == 0 and self._none is not None and best.drafter != self._none:
            best = Plan(self._none, 0, best.rate)
        if plans is not None:
            self._rest_losers(plans, best)
        if looked and best.k == 0 and self.names[best.drafter] in NONE_NAMES:
            self.idle_looks += 1
            self.skip_left = min(2 ** (self.idle_looks - 1) - 1, self._max_skip())
        else:
            self.idle_looks = 0
        self.plan = best
        return best

    def _plan_width(self) -> int:
        """The widest cap ``best_k`` may plan this round (its ``top``) over the drafters
        ``choose`` prices: 0 when each is ``none``, rests or proposed nothing, ``max_k`` when
        one was not looked at. The verify row is read this wide only: a round of short or empty
        blocks (most of them where nothing is copied) prices a few widths, not ``max_k``."""
        need, peeked, rest, depth, top = 0, self.peeked, self.rest_until, self.peek_depth, self.max_k
        for d, name in enumerate(self.names):
            if name in NONE_NAMES or (rest and rest.get(d, 0) > self.rounds):
                continue
            block = peeked.get(d)
            if block is None:
                return top
            n = len(block)
            if n >= depth:  # a look cut at the depth: the drafter may go on to max_k
                return top
            if n > need:
                need = min(n, top)
        return need

    def _rest_losers(self, plans: Sequence[Plan], best: Plan) -> None:
        """Model drafters (not looked at) whose plan lost this round rest from planning: after
        j losses in a row, the next min(2^(j-1), ``MAX_PLAN_REST`` + 1) - 1 rounds. Their
        estimates move only with the counts' decay until they are scored or played again
        (``observe`` ends the rest), and a pool of heads that do not pay was ~40% of the
        planning time. A plan that drafts and wins ends the losses; the round's best plan is
        never rested (with only model drafters and no ``none``, a plain step is theirs)."""
        is_model, losses = self.is_model, self.plan_losses
        for p in plans:
            d = p.drafter
            if d >= len(is_model) or not is_model[d] or d in self.peeked:
                continue
            if d == best.drafter:  # never rested: a round always has a plan to play
                if best.k > 0:
                    losses.pop(d, None)
                continue
            j = losses[d] = losses.get(d, 0) + 1
            self.rest_until[d] = self.rounds + min(2 ** (j - 1), MAX_PLAN_REST + 1)

    def block_curve(self) -> list[tuple[float, int, int]] | None:
        """For a batch's joint width (``batch.BatchEngine``): per cap k in 0..max_k, the best
        drafter's expected emitted tokens E_d(k) = 1 + a (1 + c + ... + c^(k'-1)), k' = min(k,
        its block) (the module docstring's E_d(k) with h = 1: the block is known), as
        (E, drafter, k'). Only when every block is free this round (the drafters
        were looked at, or propose nothing; ``none``): None when a drafter would spend drafting
        time (a model drafter, or one that cannot be looked at), the round skips its look, or the
        objective is not time."""
        if self.skip_left > 0 or self.objective != "time" or not self._looked:
            return None
        plain = next((d for d, n in enumerate(self.names) if n in NONE_NAMES), None)
        curve: list[tuple[float, int, int]] = [(1.0, 0 if plain is None else plain, 0)] * (self.max_k + 1)
        for d, name in enumerate(self.names):
            if name in NONE_NAMES:
                continue
            if (d < len(self.is_model) and self.is_model[d]) or d not in self.peeked:
                return None
            block = self.peeked[d]
            if not block or not self.trusted(d):
                continue
            _, a, c = self.estimate(d, self.contexts.get(d))
            top = min(len(block), self.max_k)
            for k in range(1, self.max_k + 1):
                e = expected_tokens(1.0, a, c, min(k, top))
                if e > curve[k][0]:
                    curve[k] = (e, d, min(k, top))
        return curve

    def commit(self, k: int) -> None:
        """Play cap ``k`` (and the drafter ``block_curve`` gave for it) this round."""
        curve = self.block_curve()
        if curve is None:
            raise ValueError("commit() needs a block_curve() this round")
        _, d, cap = curve[max(0, min(k, self.max_k))]
        self.forced = Plan(d, cap, 0.0)  # priced for the batch, not per row: no rate of its own

    def observe_proposals(self, blocks: dict[int, Any]) -> None:
        """This round's blocks (``drafters.base.Peek``, or token lists) of the drafters that can
        be looked at for free, and the context each drafter's estimate is conditioned on
        (``peek_context``)."""
        self.peeked = {d: getattr(b, "tokens", b) for d, b in blocks.items()}  # read, never changed
        self._looked = True
        fams = self.families if self.families and len(self.families) == len(self.names) else None
        self.contexts = {d: peek_context(d, self.peeked, getattr(blocks[d], "match", 0), fams)
                         for d, b in self.peeked.items() if b}

    def cap_for(self, d: int) -> int:
        if self.plan is not None and self.plan.drafter == d:
            return self.plan.k
        return self.best_k(d).k

    def evaluate(self, d: int) -> bool:
        """Score drafter ``d`` on this round's verified tokens? ``none``: never (it proposes
        nothing); looked-at drafters: no, their blocks are scored for free (``peek_chain``);
        other model-free ones: always; model drafters: every ``model_eval_every`` rounds
        (Not-a-Bandit B.5), each on its own rounds (staggered by its index, so that a pool of
        heads is not scored all in one round), and only while scoring has cost at most
        ``eval_share`` of the wall time (``CostModel.eval_share``)."""
        if self.names[d] in NONE_NAMES or (self.learn_from_peeks and d in self.peeked):
            return False
        if self.skipping and not self.is_model[d]:  # not looked at this round: seen at the next look
            return False
        if not self.is_model[d] or not self.trusted(d):
            return True
        losses = self.eval_losses.get(d, 0)
        if (self.rounds + d) % (self.model_eval_every * 2 ** min(losses, MAX_EVAL_BACKOFF)):
            return False
        if self.eval_share < 1.0 and float(getattr(self.costs, "eval_share", 0.0) or 0.0) > self.eval_share:
            return False  # over the scoring budget: skipped, not counted as a loss
        # the interval doubles each time d's best plan loses to the round's choice, and is
        # back to model_eval_every once it would have won or drafts: a pool of heads that
        # never pay is scored every 128 rounds, not every 4 (each score is a forward of the head)
        plan = self.plan
        if plan is not None and plan.drafter != d:
            mine = self.best_k(d)  # its best is a plain step, or slower than the choice: it lost
            self.eval_losses[d] = losses + 1 if mine.k == 0 or mine.rate < plan.rate else 0
        return True

    def to_score(self, chosen: int, score_chosen: bool = False) -> list[int]:
        """The drafters to score this round, in index order: those ``evaluate`` admits, the
        chosen one only with ``score_chosen`` (it drafted nothing with a zero cap). One call a
        round: a model-free drafter is admitted unless it is ``none``, looked at or skipped
        (``evaluate``'s answer for it, without the call); model drafters ask ``evaluate``."""
        peeked = self.peeked if self.learn_from_peeks else {}
        out = [] if self.skipping else [d for d in self._free if d not in peeked and (d != chosen or score_chosen)]
        if self._models:
            out += [d for d in self._models if (d != chosen or score_chosen) and self.evaluate(d)]
            out.sort()
        return out

    # -- learning -----------------------------------------------------------------------------
    def observe(self, fb: RoundFeedback) -> None:
        self.request_clock.now += 1  # every count decays by its level's keep per round (lazily)
        self.global_clock.now += 1
        if fb.n_drafted > 0:  # a drafter that drafts is winning: back to scoring it every few rounds
            self.eval_losses.pop(fb.drafter, None)
        levels = ((self.request_ctx, self.request_clock), (self.global_ctx, self.global_clock))
        for d, gammas, alphas, proposed in self._chains(fb, self.peeked if self.learn_from_peeks else {}):
            self.rest_until.pop(d, None)  # new evidence: priced again next round
            delta = chain_counts(gammas, alphas, proposed)  # counted once, added at every level
            self.request_counts[d].add(delta)
            self.global_counts[d].add(delta)
            if gammas:
                self.first_scored[d] = self.first_scored.get(d, 0) + 1
            ctx = self.contexts.get(d)
            if ctx is not None:
                for level, clock in levels:
                    counts = level[d].get(ctx)
                    if counts is None:
                        counts = level[d][ctx] = ChainCounts(clock=clock)
                    counts.add(delta)
        self.rounds += 1

    @staticmethod
    def _chains(fb: RoundFeedback, peeked: dict[int, list[int]] | None = None):
        """(drafter, gammas, alphas, proposed at the first position or None if unknown) for
        every drafter the round observed. The chosen drafter's chain is its draft (censored at
        its cap); when it drafted nothing with a zero cap the engine scored it like the others.
        A looked-at drafter the engine did not score is scored on its block (``peek_chain``)."""
        cf, ca = fb.counterfactual or {}, fb.counterfactual_alpha or {}
        proposed = fb.counterfactual_proposed or {}
        chosen = fb.drafter
        drafted = chosen not in ca and (fb.n_drafted > 0 or fb.k_cap > 0)
        if chosen not in ca:
            if fb.n_drafted > 0:
                yield chosen, fb.chosen_gammas(), [1.0] * fb.n_accepted, True
            elif fb.k_cap > 0:  # allowed to draft, proposed nothing
                yield chosen, [], [], False
        for d, gam in cf.items():
            if d == chosen and d not in ca:
                continue
            props = proposed.get(d)
            yield d, gam, ca.get(d, gam), (bool(props[0]) if props else None)
        for d, block in (peeked or {}).items():
            if d in cf or (d == chosen and drafted):
                continue
            g = peek_chain(block, fb.emitted)
            yield d, g, g, bool(block)


def peek_chain(block: Sequence[int], emitted: Sequence[int]) -> list[float]:
    """A looked-at block scored on the round's emitted tokens: 1 while it matches, then 0, up to
    the shorter of the two (censored). Unbiased for the acceptance chain under sampling too:
    an emitted token is distributed as the target's p (speculative sampling's guarantee) and a
    block token is a function of the prefix, so P(emitted_j = block_j | prefix) = p_j(block_j),
    the one-hot acceptance probability (Leviathan et al. 2023, Thm 1)."""
    out: list[float] = []
    for b, e in zip(block, emitted):
        out.append(1.0 if b == e else 0.0)
        if b != e:
            break
    return out


#: match-length buckets (lower edges): longer matches are rarer, so buckets widen (measured on
#: the mixed suite, suffix: first-token acceptance 0.54 at 2, 0.74 at 5-7, 0.87 at 8-11,
#: 0.92 at 12-23, 0.99 at 24, its longest match)
MATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24)


def match_bucket(match: int) -> int:
    """The lower edge of ``match``'s bucket in ``MATCH_BUCKETS``."""
    return MATCH_BUCKETS[max(bisect_right(MATCH_BUCKETS, match) - 1, 0)]


#: ``peek_context``'s names, ``_CONTEXT_NAMES[rel][match]`` for matches up to the last bucket's
#: edge (a name is read for every looked-at block each round: not formatted each time)
_CONTEXT_NAMES = {rel: [rel] + [f"{rel}:{match_bucket(m)}" for m in range(1, MATCH_BUCKETS[-1] + 1)]
                  for rel in ("alone", "agree", "disagree")}


def peek_context(d: int, blocks: dict[int, list[int]], match: int = 0,
                 families: Sequence[str] | None = None) -> str:
    """What drafter ``d``'s block says about its chance, given the other looked-at blocks:
    ``alone`` (no other drafter proposes), ``agree`` (another proposes the same first token) or
    ``disagree``, and the bucket of the context match behind it (``:m``, ``match_bucket``; a
    longer suffix match is more often right: SuffixDecoding's score). One overall acceptance
    estimate would be biased in every one of these cases (measured on the mixed suite: prompt
    lookup's first token was accepted 24% of the time alone, 5% against suffix, 77% agreeing).
    With ``families`` (``drafters.drafter_family``) only drafters of another family count: a
    suffix drafter over a datastore proposes what plain suffix matching does whenever the
    request's own text holds the longest match, so their agreement is no evidence."""
    mine = blocks[d][0]
    fam = families[d] if families is not None else None
    others = [b[0] for j, b in blocks.items() if j != d and b and (fam is None or families[j] != fam)]
    rel = "alone" if not others else "agree" if mine in others else "disagree"
    names = _CONTEXT_NAMES[rel]
    return names[min(max(match, 0), len(names) - 1)]


def check_share(name: str, value: object, example: str) -> None:
    """A share of time (``look_share``, ``eval_share``): a number in [0, 1], else a clear error."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise ConfigError(f"{name} must be a number in [0, 1], got {value!r}: e.g. {example}")


def check_confidence_stop(value: object) -> bool:
    if value not in (0, 1, True, False):
        raise ConfigError(f"confidence_stop must be 0 or 1, got {value!r}: pass confidence_stop=1 to stop a "
                          "model drafter's block on its confidence, 0 to draft the planned cap")
    return bool(value)


class SharedCosts:
    """``costs`` (set by the engine: ``caps.prices_rounds``) is the controller's, whichever view gets it."""

    controller: AutoController

    @property
    def costs(self) -> Any:
        return self.controller.costs

    @costs.setter
    def costs(self, value: Any) -> None:
        self.controller.costs = value


class AutoLength(SharedCosts, LengthPolicy):
    """``--length auto``: the cap of the controller's plan for the chosen drafter. Paired with
    ``--selector auto`` it shares its controller; alone it learns from the chosen drafter's own
    rounds (bandit feedback).

    A drafter that reports q (a model drafter drafting a chain; ``confidence_stop=1``) gets
    ``max_k`` and the block stops token by token: after token k it goes on iff some m has
    rate(k+m) > rate(k), rate(k) = E_k / (o + D(k) + V(k+1)), E_k = 1 + sum_{i<=k} prod_{j<=i} a_j,
    a_j = min(1, max q_j * f_d) (``BlockRate`` and ``ConfidenceCalibration``: the cost-model
    rule's test and calibration, priced on auto's costs). Model-free drafters: the plan's cap."""

    name = "auto"
    caps = LengthCaps(plans_round_rate=True, prices_rounds=True, forks_sharing=True)

    def __init__(self, max_k: int = 16, prior_weight: float = 8.0, request_decay: float = 0.98,
                 global_decay: float = 0.999, scope: str = "global", seed: int | None = 0,
                 controller: AutoController | None = None, confidence_stop: int | bool = 1):
        super().__init__(seed=seed, scope=scope)
        self.shared = controller is not None
        # alone it learns from its own rounds only (bandit feedback): planning on a lower bound
        # would never draft again once it stops, so it plans on the means (shrink=0)
        self.controller = controller or AutoController(max_k, prior_weight, request_decay, global_decay,
                                                       scope=scope, shrink=0.0)
        self.confidence_stop = check_confidence_stop(confidence_stop)
        #: model drafters' q -> acceptance, learnt online as the cost-model rule learns it
        self.confidence = ConfidenceCalibration()
        self._is_model: list[bool] | None = None
        self._trees: list[bool] = []
        self._drafter, self._confs, self._rate = 0, [], None
        self.caps = replace(type(self).caps, follows_selector=self.shared,
                            forks_sharing=self.controller.scope == "global")

    def bind(self, drafters: Sequence[Any], trees: Sequence[bool]) -> None:
        self.bind_drafters([d.runs_model for d in drafters])
        self.bind_trees(trees)

    def shared_state(self) -> list[Any]:
        return self.controller.shared_state()

    def bind_drafters(self, is_model: Sequence[bool]) -> None:
        """Which drafters run a network (the engine and replay tell): their chains report q."""
        self._is_model = list(is_model)

    def bind_trees(self, trees: Sequence[bool]) -> None:
        """Which drafters draft trees (the engine tells): a tree's tokens are not decided one
        by one, so they keep the plan's cap (a model drafter's tree is as deep as the cap, a
        model-free one's as its nodes allow: ``SpeculativeEngine._draft_tree``)."""
        self._trees = list(trees)

    def _reports_q(self, d: int) -> bool:
        """Will ``decide`` see drafter ``d``'s q token by token?"""
        is_model = self._is_model if self._is_model is not None else self.controller.is_model
        tree = d < len(self._trees) and self._trees[d]
        return d < len(is_model) and bool(is_model[d]) and not tree

    def begin_request(self) -> None:
        c = self.controller
        if c.scope == "request":
            self.confidence = ConfidenceCalibration()
        if not self.shared:  # alone: one arm per drafter index, names learnt lazily
            c.plan = None
            c.request_counts = [ChainCounts(clock=c.request_clock) for _ in c.names]
            c.request_ctx = [{} for _ in c.names]
            if self.scope == "request":
                c.global_counts = [ChainCounts(clock=c.global_clock) for _ in c.names]
                c.global_ctx = [{} for _ in c.names]

    def _ensure(self, d: int) -> None:
        c = self.controller
        while len(c.names) <= d:
            c.names.append(f"#{len(c.names)}")
            c.is_model.append(False)
            c.global_counts.append(ChainCounts(clock=c.global_clock))
            c.request_counts.append(ChainCounts(clock=c.request_clock))
            c.global_ctx.append({})
            c.request_ctx.append({})

    def begin_round(self, drafter: int, ctx: RoundContext | None = None) -> int:
        if not self.shared:
            self._ensure(drafter)
        c = self.controller
        if ctx is not None:
            c.ctx = ctx
        cap = c.cap_for(drafter)
        self._drafter, self._confs, self._rate = drafter, [], None
        if cap > 0 and self.confidence_stop and self._reports_q(drafter):
            # q decides the block's length: the plan (h, a, c per drafter, blind to q) only
            # decides whether to draft; the cap is max_k, a bound
            cap = c.max_k
            verify, draft, overhead = c._cost_fns()
            d0 = draft(drafter, 0)
            self._rate = BlockRate(draft(drafter, 1) - d0, verify, base=overhead + d0, horizon=cap, limit=cap)
        return cap

    def plain_rate(self) -> float | None:
        """The plan's rate when it is a plain step (a batch's committed plan has none)."""
        plan = self.controller.plan
        if plan is None or plan.k > 0 or plan.rate <= 0.0:
            return None
        return plan.rate

    def decide(self, step: DraftStep) -> Decision:
        conf = step_confidence(step) if self._rate is not None else None
        if conf is None:  # model-free drafters: the plan's cap
            return Decision.CONTINUE
        self._confs.append(conf)
        return self._rate.step(step.index, self.confidence.acceptance(self._drafter, conf))

    def update(self, feedback: RoundFeedback) -> None:
        if self._confs and feedback.n_drafted > 0 and feedback.drafter == self._drafter:
            self.confidence.observe(feedback.drafter, feedback.chosen_gammas(), self._confs)
        if not self.shared:
            self.controller.observe(feedback)
