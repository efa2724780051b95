"""How much of a draft tree is verified, and how deep it goes: the node budget against the
generation's running rate (``trees.nodes_worth_verifying``, ``CostModel.running_rate``), the
depth of model-free trees, the length policies' part (cost-model's gate, auto's objective) and
the request level of the candidate calibration. Policies without a model; the engine cases
on a tiny one."""

from __future__ import annotations

import random

import pytest

from adaspec.costs import CostModel
from adaspec.drafters import Draft
from adaspec.feedback import RoundFeedback
from adaspec.config import SamplingConfig
from adaspec.selection.auto import Plan
from adaspec.trees import nodes_worth_verifying
from conftest import flat_cost_curve, make_tiny_model
from rounds import draft_tree

from adaspec.round import Round

pytestmark = pytest.mark.usefixtures("torch_single_thread")

V = 16
#: 2-grams that recur with several continuations: suffix trees branch here
BRANCHY = [1, 2, 3, 4, 1, 2, 5, 1, 2, 3, 6, 1, 2, 3, 4, 7, 1, 2, 5, 6, 1, 2]


@pytest.fixture(autouse=True)
def _private_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("ADASPEC_CACHE", str(tmp_path))


def _curve(seconds):
    return flat_cost_curve(seconds)


# -- the node budget ------------------------------------------------------------------------------
def _random_case(rng: random.Random, max_nodes: int, spread: float):
    """Best-first scores, a verify curve with cliffs (not monotone) and a fixed overhead."""
    n = rng.randint(0, max_nodes)
    scores = sorted((rng.random() ** 2 for _ in range(n)), reverse=True)
    cost = [1.0] + [1.0 + rng.uniform(0.0, spread) for _ in range(n)]
    return n, scores, (lambda w, c=cost: c[w - 1]), rng.uniform(0.0, 0.2)


def test_the_rate_budget_maximises_tokens_minus_the_opportunity_cost_of_their_seconds():
    """Brute force over random best-first scores and cost curves with cliffs: the chosen m
    maximises E_m - R T_m; and at R = the best round rate (Dinkelbach's fixed point) it reaches
    that rate, i.e. the two objectives agree on the best round."""
    rng = random.Random(7)
    for _ in range(300):
        n, scores, verify, fixed = _random_case(rng, 9, 1.2)
        E = [1.0 + sum(scores[:m]) for m in range(n + 1)]
        T = [fixed + verify(m + 1) for m in range(n + 1)]
        rate = rng.uniform(0.3, 2.0)
        m = nodes_worth_verifying(scores, verify, fixed, rate)
        assert E[m] - rate * T[m] == pytest.approx(max(e - rate * t for e, t in zip(E, T)))
        best = max(e / t for e, t in zip(E, T))
        m_star = nodes_worth_verifying(scores, verify, fixed, best)
        assert E[m_star] / T[m_star] == pytest.approx(best)
        assert E[nodes_worth_verifying(scores, verify, fixed)] / T[nodes_worth_verifying(scores, verify, fixed)] \
            == pytest.approx(best)


def test_a_running_rate_drafts_fewer_weak_trees_and_more_of_strong_ones():
    cheap = [1.0, 1.2, 1.3, 1.5]
    weak = [0.25]
    # the round's own rate: 1.25 tokens in 1.2 s beats a plain step's 1 in 1 s -> draft
    assert nodes_worth_verifying(weak, _curve(cheap).cost) == 1
    # but the generation makes 1.5 tokens a second: 0.25 more tokens for 0.2 more s do not pay
    assert nodes_worth_verifying(weak, _curve(cheap).cost, rate=1.5) == 0
    strong = [0.9, 0.9, 0.2]
    # own rate: 2.8 / 1.3 = 2.15 > 3.0 / 1.5 = 2.0 -> stop at 2
    assert nodes_worth_verifying(strong, _curve(cheap).cost) == 2
    # a slower generation: the third node's 0.2 tokens for 0.2 s beat 0.5 tokens a second
    assert nodes_worth_verifying(strong, _curve(cheap).cost, rate=0.5) == 3
    assert nodes_worth_verifying(strong, lambda w: 0.0, rate=2.0) == 3  # no costs known: every node


def test_a_prefix_cut_grown_until_it_refuses_cuts_where_the_whole_tree_would():
    """``PrefixCut`` fed best-first scores: ``add`` gives ``nodes_worth_verifying``'s m, and
    ``offer`` refuses a node only when no longer prefix could win, so stopping there leaves the
    cut as over every node. Brute force over random scores and curves with cliffs, both
    objectives."""
    from adaspec.trees import PrefixCut

    rng = random.Random(11)
    stopped = 0
    for _ in range(2000):
        n, scores, verify, fixed = _random_case(rng, 12, 1.5)
        rate = rng.choice([None, rng.uniform(0.3, 2.0)])
        whole = nodes_worth_verifying(scores, verify, fixed, rate)
        full = PrefixCut.priced(verify, fixed, n, rate)
        for s in scores:
            full.add(s)
        assert full.best_m == whole
        cut = PrefixCut.priced(verify, fixed, n, rate)
        kept = [s for s in scores if cut.offer(s)]
        assert kept == scores[:len(kept)]  # a refusal is final
        stopped += cut.stopped
        assert nodes_worth_verifying(kept, verify, fixed, rate) == cut.best_m == whole
    assert stopped > 500  # the early stop is exercised
    assert PrefixCut.priced(lambda w: 0.0, 0.0, 3).offer(0.01)  # no costs known: every node


def test_model_free_trees_grown_under_the_cut_are_the_whole_trees_cut(monkeypatch):
    """The engine's model-free trees, grown until the cut refuses a node, equal the trees
    grown to the node limit and then cut (``nodes_worth_verifying``), round by round, with
    static and ``auto`` length policies, while expanding fewer nodes."""
    import adaspec.round as engine_mod
    from adaspec import SpeculativeEngine
    from adaspec.drafters.lookup import PromptLookupDrafter
    from adaspec.drafters.suffix import SuffixDrafter
    from adaspec.trees import PrefixCut

    model = make_tiny_model(seed=3, vocab=V, init_std=0.3, lm_head_scale=3.0)
    expanded = {True: 0, False: 0}  # candidate lists asked for, growing the whole tree or not
    grow_all = {"on": False}
    for cls in (SuffixDrafter, PromptLookupDrafter):
        def counting_keys(self, limit=None, orig=cls.candidate_keys):
            expanded[grow_all["on"]] += 1
            return orig(self, limit)

        monkeypatch.setattr(cls, "candidate_keys", counting_keys)
    orig = Round.draft_tree
    for drafters, selector in ((["suffix"], None), (["suffix", "prompt-lookup", "none"], "auto")):
        eng = SpeculativeEngine(model, drafters, selector=selector, k=4, tree=True, tree_nodes=12)
        eng.cost_model.curve = _curve([1.0 + 0.12 * w for w in range(32)])
        eng.cost_model.live = None  # the curve as given, not what the tiny model's forwards teach
        compared = []

        def both(rnd, row, index, cap, room, ctx):
            grow_all["on"] = True
            with monkeypatch.context() as m:  # the whole tree: every node offered is taken
                m.setattr(PrefixCut, "offer", lambda self, s: self.add(s) or True)
                whole = orig(rnd, row, index, cap, room, ctx)
            grow_all["on"] = False
            got = orig(rnd, row, index, cap, room, ctx)
            compared.append((None if whole is None else (whole.tokens, whole.parents),
                             None if got is None else (got.tokens, got.parents)))
            return got

        monkeypatch.setattr(Round, "draft_tree", both)
        for prompt in (BRANCHY * 2, BRANCHY[::-1] + BRANCHY):
            eng.generate(prompt, max_new_tokens=40)
        assert len(compared) > 20
        assert all(w == g for w, g in compared)
        assert any(g is not None and len(g[0]) for _, g in compared)
    assert expanded[False] < 0.8 * expanded[True]


def test_running_rate_prices_rounds_on_the_surface_and_decays():
    cm = CostModel(_curve([1.0, 1.5, 2.0]))
    cm.round_overhead_s = 0.25
    assert cm.running_rate() == pytest.approx(1 / 1.25)  # before any round: plain decoding's
    cm.rate_decay = 0.5
    cm.observe_round(3, 3, 0.5)  # 3 tokens, a width-3 forward priced 2.0 s, 0.5 s besides
    assert cm.running_rate() == pytest.approx(3 / 2.5)
    cm.observe_round(1, 1, 0.0)
    assert cm.running_rate() == pytest.approx((0.5 * 3 + 1) / (0.5 * 2.5 + 1.0))
    assert CostModel().running_rate() == 0.0  # nothing known: no opportunity cost


# -- depth and the chain path in the engine --------------------------------------------------------
def _engine(**kw):
    from adaspec import SpeculativeEngine

    model = make_tiny_model(seed=3, vocab=V, init_std=0.3, lm_head_scale=3.0)
    eng = SpeculativeEngine(model, ["suffix"], tree=True, **kw)
    eng.cost_model.curve = _curve([1.0] * 32)  # flat: the budget keeps every node
    eng.cost_model.live = None  # the curve as given, not what the tiny model's forwards teach
    return eng


def test_model_free_trees_are_as_deep_as_their_nodes_allow_whatever_the_cap():
    eng = _engine(k=2, tree_nodes=8)
    d = eng.drafters[0]
    ctx = BRANCHY * 3
    d.begin_request(ctx)
    tree = draft_tree(eng, 0, ctx, 2, 100)
    assert tree is not None and not tree.is_chain
    assert max(tree.depths) > 2 and max(tree.depths) <= 7 and len(tree) <= 8  # deeper than k=2
    shallow = draft_tree(eng, 0, ctx, 2, 3)  # 3 tokens left to generate
    assert max(shallow.depths) <= 3


def test_a_drafter_without_alternatives_drafts_its_chain_and_a_cut_tree_nothing(monkeypatch):
    from adaspec.drafters.suffix import SuffixDrafter

    import adaspec.round as engine_mod

    eng = _engine(k=3)
    d = eng.drafters[0]
    ctx = [5, 6, 7, 8, 9, 5, 6, 7]  # one continuation only: 8, 9, 5, ...
    d.begin_request(ctx)
    assert draft_tree(eng, 0, ctx, 3, 100) is None  # the chain path (cap 3 and decide)
    # a branching offer the budget cuts to nothing is a plain step, never the chain
    monkeypatch.setattr(engine_mod, "nodes_worth_verifying", lambda *a, **kw: 0)
    branching = []
    orig = SuffixDrafter.draft_tree

    def spy(self, *a, **kw):
        tree = orig(self, *a, **kw)
        branching.append(not tree.is_chain)
        return tree

    monkeypatch.setattr(SuffixDrafter, "draft_tree", spy)
    rounds = eng.generate(BRANCHY, max_new_tokens=12).stats.rounds
    drafted = [r.drafted for r in rounds if r.k_cap > 0]
    assert any(branching) and len(drafted) == len(branching)
    assert all(n == 0 for n, b in zip(drafted, branching) if b)


@pytest.mark.parametrize("selector", [None, "auto"])
def test_the_budget_prices_model_free_nodes_against_the_running_rate(monkeypatch, selector):
    """Every model-free tree's nodes are priced against the running rate: under static length
    policies, and under ``auto`` both in rounds it planned as chains and in rounds it planned
    as plain steps (``Round._plain_tree``)."""
    import adaspec.round as engine_mod

    seen = []  # (the round's planned cap, the rate the budget priced against)
    orig = engine_mod.nodes_worth_verifying
    from adaspec import SpeculativeEngine

    model = make_tiny_model(seed=3, vocab=V, init_std=0.3, lm_head_scale=3.0)
    drafters = ["suffix"] if selector is None else ["suffix", "none"]
    eng = SpeculativeEngine(model, drafters, selector=selector, k=4, tree=True)
    eng.cost_model.curve = _curve([1.0 + 0.01 * w for w in range(32)])
    eng.cost_model.live = None  # the curve as given, not what the tiny model's forwards teach
    plan = (lambda: eng.selector.controller.plan.k) if selector else (lambda: 4)
    monkeypatch.setattr(engine_mod, "nodes_worth_verifying", lambda *a, **kw: seen.append(
        (plan(), a[3] if len(a) > 3 else kw.get("rate"))) or orig(*a, **kw))
    eng.generate(BRANCHY * 2, max_new_tokens=40)
    assert seen and all(r is not None and r > 0 for _, r in seen)
    if selector is not None:
        assert {k == 0 for k, _ in seen} == {True, False}  # both kinds of rounds were priced


def test_auto_plain_steps_become_trees_that_pay_and_output_stays_ar(monkeypatch):
    """With trees, a round ``auto`` planned as a plain step verifies the first model-free
    drafter's tree when some prefix of it pays at the running rate (``Round._plain_tree``); the
    round is then recorded as that drafter's, and greedy output is AR's. Without trees, or
    with every prefix cut by the budget, those rounds stay plain steps."""
    import adaspec.round as engine_mod
    from adaspec import SpeculativeEngine

    model = make_tiny_model(seed=3, vocab=V, init_std=0.3, lm_head_scale=3.0)
    ar = SpeculativeEngine(model, ["none"]).generate(BRANCHY, max_new_tokens=40).token_ids

    def run(tree: bool):
        eng = SpeculativeEngine(model, ["suffix", "none"], selector="auto", tree=tree)
        eng.cost_model.curve = _curve([1.0 + 0.01 * w for w in range(32)])
        eng.cost_model.live = None  # the curve as given, not what the tiny model's forwards teach
        calls = []
        orig = Round._plain_tree
        monkeypatch.setattr(Round, "_plain_tree", lambda *a, **kw: calls.append(orig(*a, **kw)) or calls[-1])
        out = eng.generate(BRANCHY, max_new_tokens=40)
        return out, calls

    out, calls = run(True)
    assert out.token_ids == ar
    played = [t for t in calls if t is not None]
    assert played  # on a nearly flat curve, plain steps became trees
    drafted = [r for r in out.stats.rounds if r.drafter == "suffix" and r.drafted]
    assert len(drafted) >= len(played)
    out, calls = run(False)
    assert out.token_ids == ar and not calls
    monkeypatch.setattr(engine_mod, "nodes_worth_verifying", lambda *a, **kw: 0)
    out, calls = run(True)
    assert out.token_ids == ar and calls and not any(calls)


def test_under_auto_a_model_free_tree_is_cut_at_the_running_rate_whatever_the_plan():
    """``auto`` planned a chain: the drafter's tree replaces it, cut where its nodes stop
    paying at the generation's running rate (E_m - R (o + V(m + 1))), as under a static
    length policy; the plan's own rate plays no part (a tree's best-first nodes include the
    chain's). A flat curve keeps every node; a steep one cuts the tree to its chain's
    first tokens, or to nothing."""
    from adaspec import SpeculativeEngine

    model = make_tiny_model(seed=3, vocab=V, init_std=0.3, lm_head_scale=3.0)
    ctx = BRANCHY * 3
    cut = {}
    for selector in ("auto", "static"):
        eng = SpeculativeEngine(model, ["suffix", "none"], selector=selector, tree=True, tree_nodes=8)
        assert eng.length.plans_round_rate == (selector == "auto")
        if selector == "auto":  # a plan of a 2-token chain expected to run far faster than any tree
            eng.length.controller.plan = Plan(0, 2, 1e6)
        for name, curve in (("flat", [1.0] * 32), ("steep", [1.0 + 2.0 * w for w in range(32)])):
            eng.cost_model.curve = _curve(curve)
            eng.cost_model.live = None  # the curve as given, not what the tiny model's forwards teach
            d = eng.drafters[0]
            d.begin_request(ctx)
            tree = draft_tree(eng, 0, ctx, 2, 100)
            d.begin_request(ctx)
            whole = d.draft_tree(ctx, 7, 8)
            rate = eng.cost_model.running_rate()
            m = nodes_worth_verifying(whole.scores, eng.cost_model.verify_cost, eng.cost_model.round_overhead_s, rate)
            got = [] if tree is None else list(tree.tokens)
            assert got == list(whole.tokens[:m]) or (tree is None and whole.prefix(m).is_chain)
            cut[selector, name] = got
    assert cut["auto", "flat"] == cut["static", "flat"] and len(cut["auto", "flat"]) >= 2
    assert cut["auto", "steep"] == cut["static", "steep"]
    assert len(cut["auto", "steep"]) < len(cut["auto", "flat"])


# -- length policies with trees ---------------------------------------------------------------------
def _tree_feedback(drafter: int, nodes: int) -> RoundFeedback:
    return RoundFeedback(round=0, drafter=drafter, draft=Draft(tokens=[3, 4]), n_accepted=1,
                         emitted=[3, 5], k_cap=4, target_logits=None, sampling=SamplingConfig(),
                         gammas=[1.0, 0.0], tree_nodes=nodes)


def test_cost_model_leaves_tree_drafters_to_the_node_budget():
    """The rule's plain-step shortcut reads one acceptance number per model-free drafter: not
    for a drafter whose rounds are trees (their alternatives are the budget's to price), and
    tree rounds do not move the per-token estimate its ``decide`` uses for chains."""
    from adaspec.length.cost_rule import CostModelRule

    rule = CostModelRule(prior_acceptance=0.6)
    rule.costs = CostModel(_curve([1.0 + 0.8 * j for j in range(16)]))  # steep: a = 0.6 cannot pay
    rule.begin_request()
    rule.bind_drafters([False, False])
    assert rule.begin_round(0) == 0 and rule.begin_round(1) == 0
    rule.bind_trees([True, False])
    assert rule.begin_round(0) == rule.max_len and rule.begin_round(1) == 0
    before = rule.acceptance(0)
    rule.update(_tree_feedback(0, nodes=6))
    assert rule.acceptance(0) == before
    rule.update(_tree_feedback(0, nodes=0))  # a chain round still teaches it
    assert rule.acceptance(0) != before


def test_engine_tells_the_length_policy_which_drafters_draft_trees():
    from adaspec import SpeculativeEngine

    model = make_tiny_model(seed=0, vocab=V)
    for tree in (False, True):
        eng = SpeculativeEngine(model, ["suffix", "none"], selector="static", length="cost-model", tree=tree)
        assert eng.length._trees == [tree, False]


# -- the request level of the calibration --------------------------------------------------------
def test_request_calibration_follows_this_request_over_the_shared_estimate():
    from adaspec.drafters.indexed import CALIBRATION_WEIGHT, CandidateCalibration, RequestCalibration

    shared = CandidateCalibration({(1, 3, 0): 0.4}, default=0.1)
    req = RequestCalibration(shared)
    key, w = (1, 3, 0), CALIBRATION_WEIGHT
    assert req.estimate(key) == 0.4
    for hit in (False, False, False, True):
        req.observe(key, hit)
    p = shared.estimate(key)  # the shared counts learnt the same four trials
    assert p == pytest.approx((1 + w * 0.4) / (4 + w))
    assert req.estimate(key) == pytest.approx((1 + w * p) / (4 + w))  # this request: lower still
    req.clear()
    assert req.estimate(key) == p


def test_each_request_and_each_fork_twin_has_its_own_request_level():
    from adaspec.drafters.suffix import SuffixDrafter

    d = SuffixDrafter()
    d.begin_request(BRANCHY)
    tree = d.draft_tree(BRANCHY, 2, 8)
    d.catch_up(BRANCHY + [99, 98])  # nobody's candidate: every root candidate missed
    assert d.request_calibration.trials and not any(d.request_calibration.hits.values())
    key = next(iter(d.request_calibration.trials))
    assert d.request_calibration.estimate(key) < d.calibration.estimate(key)
    twin = d.fork()
    assert twin.calibration is d.calibration and not twin.request_calibration.trials
    assert twin.request_calibration.estimate(key) == d.calibration.estimate(key)
    d.begin_request(BRANCHY)
    assert not d.request_calibration.trials and len(tree) > 1


def test_the_shared_table_keeps_every_trial_of_the_request_level():
    from adaspec.drafters.suffix import SuffixDrafter

    d = SuffixDrafter()
    d.begin_request(BRANCHY)
    d.draft_tree(BRANCHY, 2, 8)
    d.catch_up(BRANCHY + [3])
    assert d.calibration.trials == d.request_calibration.trials
    assert d.calibration.hits == d.request_calibration.hits


def test_calibrated_scores_scale_each_nodes_own_probability():
    """c_i = c_parent min(1, q_i f), q_i = score_i / score_parent (EAGLE-2 scores are products)."""
    from adaspec.trees import DraftTree, calibrated_scores, node_trials

    tree = DraftTree([5, 6, 7, 8], [-1, -1, 0, 2], [0.8, 0.1, 0.4, 0.3])
    assert calibrated_scores(tree, 1.0) == pytest.approx(tree.scores)
    assert calibrated_scores(tree, 0.5) == pytest.approx([0.4, 0.05, 0.4 * 0.25, 0.4 * 0.25 * 0.375])
    assert calibrated_scores(tree, 2.0)[0] == 1.0  # a probability: at most 1
    # the root's children and the children of accepted nodes are trials; node 0 then 2 accepted
    hits, qs = node_trials(tree, [0, 2])
    assert hits == [1.0, 0.0, 1.0, 0.0] and qs == pytest.approx([0.8, 0.1, 0.5, 0.75])
    assert node_trials(tree, []) == ([0.0, 0.0], pytest.approx([0.8, 0.1]))


def test_dynamic_tree_drafts_a_level_only_while_it_may_pay():
    """``level_gain``: a level is drafted only while the frontier's scores sum to more (its
    children's scores sum to at most that); one child per node (a chain) is never cut."""
    import torch

    from adaspec.trees import dynamic_tree

    calls = []

    def step(frontier, nodes):
        calls.append(len(frontier))
        return torch.full((len(frontier), 8), 1.0 / 8)  # every token at q = 1/8

    root = torch.tensor([0.5, 0.3, 0.1, 0.1, 0.0, 0.0, 0.0, 0.0])
    deep = dynamic_tree(root, step, max_depth=4, max_nodes=40)
    assert len(calls) == 3 and max(deep.depths) == 4
    calls.clear()
    cut = dynamic_tree(root, step, max_depth=4, max_nodes=40, level_gain=1.5)  # root level sums to 1.0
    assert calls == [] and len(cut) == 4
    calls.clear()
    mid = dynamic_tree(root, step, max_depth=4, max_nodes=40, level_gain=0.3)  # level 2 sums to 0.5 (4 x 1/8)
    assert len(calls) == 1 and max(mid.depths) == 2
    calls.clear()
    chain = dynamic_tree(root, step, max_depth=4, max_nodes=40, branch=1, level_gain=10.0)
    assert len(calls) == 3 and chain.is_chain and len(chain) == 4


def test_dynamic_tree_expands_only_nodes_the_budget_verifies():
    """``budget``: a frontier node the engine's node budget would not verify is not expanded
    (its children could not be verified either), so no level is drafted for nothing; a budget
    that keeps every node changes nothing; a chain (one child per node) is never cut."""
    import torch

    from adaspec.trees import dynamic_tree

    calls: list[list[int]] = []
    seen: list[int] = []

    def step(frontier, nodes):
        calls.append([nodes[i].token for i in frontier])
        return torch.full((len(frontier), 8), 1.0 / 8)

    def keep(n):
        def budget(tree):
            seen.append(len(tree))
            return n
        return budget

    root = torch.tensor([0.5, 0.3, 0.1, 0.1, 0.0, 0.0, 0.0, 0.0])
    free = dynamic_tree(root, step, max_depth=3, max_nodes=40)
    free_calls, calls[:] = list(calls), []
    same = dynamic_tree(root, step, max_depth=3, max_nodes=40, budget=len)
    assert calls == free_calls and same == free
    calls.clear()
    one = dynamic_tree(root, step, max_depth=3, max_nodes=40, budget=keep(1))
    # only the best node (token 0, score 0.5) is verified: it alone is expanded, once; its
    # children (0.5 / 8) rank below the other root children, so the next level stops
    assert calls == [[0]] and max(one.depths) == 2 and seen == [4, 8]
    calls.clear()
    none = dynamic_tree(root, step, max_depth=3, max_nodes=40, budget=keep(0))
    assert calls == [] and len(none) == 4
    calls.clear()
    chain = dynamic_tree(root, step, max_depth=3, max_nodes=40, branch=1, budget=keep(0))
    assert len(calls) == 2 and chain.is_chain and len(chain) == 3


def test_engine_model_trees_are_not_drafted_past_their_verified_part():
    """The engine passes its node budget to a model drafter's tree (``dynamic_tree`` then
    expands only nodes it keeps): the same count as the final cut, from the same calibrated
    scores, verify curve, overhead and rate; on a tiny feature head it cuts some trees."""
    from adaspec import SpeculativeEngine
    from adaspec.trees import calibrated_scores

    from test_trees import V, _engine_drafters

    model = make_tiny_model(seed=0, vocab=V, init_std=0.3, lm_head_scale=3.0)
    loaded, drafters = _engine_drafters(model, ["feature-head"])
    eng = SpeculativeEngine(loaded, drafters, length="cost-model", tree=True)
    eng.cost_model.curve = _curve([1.0 + 0.05 * w for w in range(32)])
    eng.cost_model.live = None  # the curve as given, not what the tiny model's forwards teach
    budgets: list[tuple[int, int]] = []
    drafter = eng.drafters[0]
    orig = drafter.draft_tree

    def spy(*a, budget=None, **k):
        assert budget is not None

        def counted(tree):
            m = budget(tree)
            f = eng.tree_calibration.factor(id(drafter))
            assert m == nodes_worth_verifying(calibrated_scores(tree, f), eng.cost_model.verify_cost,
                                              eng.cost_model.round_overhead_s, eng.cost_model.running_rate())
            budgets.append((len(tree), m))
            return m
        return orig(*a, budget=counted, **k)

    drafter.draft_tree = spy
    eng.generate([1, 2, 3, 4, 5, 6], max_new_tokens=24)
    assert budgets and any(m < n for n, m in budgets)  # the budget cut somewhere


def test_model_drafter_trees_keep_to_the_node_limit_whatever_the_cap():
    """A length rule's cap is a bound (the cost-model rule's is 68): a model drafter's tree is
    at most ``tree_nodes`` nodes and as deep, not as deep as the cap."""
    from adaspec import SpeculativeEngine
    from conftest import make_tiny_model

    from test_trees import V, _engine_drafters

    model = make_tiny_model(seed=0, vocab=V, init_std=0.3, lm_head_scale=3.0)
    for kind in ("early-exit", "feature-head"):
        loaded, drafters = _engine_drafters(model, [kind])
        eng = SpeculativeEngine(loaded, drafters, k=40, tree=True, tree_nodes=6)
        eng.cost_model.curve = _curve([1.0] * 32)  # not this machine's measured widths: trees are drafted
        eng.cost_model.live = None  # the curve as given, not what the tiny model's forwards teach
        depths = []
        orig = drafters[0].draft_tree
        drafters[0].draft_tree = lambda *a, **kw: depths.append(a[1]) or orig(*a, **kw)
        res = eng.generate([1, 2, 3, 4, 1, 2, 5], max_new_tokens=30)
        nodes = [r.tree_nodes for r in res.stats.rounds]
        assert any(nodes) and max(nodes) <= 6, kind
        assert depths and max(depths) <= 6, kind
        assert eng.tree_calibration.sums.get(id(drafters[0])), kind  # its nodes' probabilities learnt
