"""TapOut (bandit over stopping rules) and LengthUCB (BanditSpec 6.2 over draft lengths).

Model-free tests drive the policies by hand: ``play_round`` plays one round of the engine's
protocol (begin_round, decide per drafted token, update) where the outcome of every draft
position is fixed in advance and written into the token id (1 = would be accepted, 0 = would
be rejected), so stub rules can be "informed" or not. The integration tests check that greedy
output is unchanged on tiny random Llamas.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from adaspec import SpeculativeEngine
from adaspec.config import SamplingConfig
from adaspec.drafters import (
    Decision,
    Draft,
    DraftStep,
    ModelDrafter,
    PromptLookupDrafter,
)
from adaspec.errors import ConfigError
from adaspec.feedback import RoundFeedback
from adaspec.length import LengthPolicy, build_length
from adaspec.length.bandit import LengthUCB
from adaspec.length.rules import (
    AdaEDL,
    LogitMargin,
    MaxConfidence,
    SVIPDifference,
    SVIPEntropy,
)
from adaspec.length.tapout import ArmStats, TapOut
from adaspec.models import as_loaded

SAMPLING = SamplingConfig(temperature=1.0)


def feedback(tokens, n_accepted, k_cap=None, round_s=0.0, drafter=0) -> RoundFeedback:
    tokens = list(tokens)
    return RoundFeedback(round=0, drafter=drafter, draft=Draft(tokens=tokens),
                         n_accepted=n_accepted, emitted=[0] * (n_accepted + 1),
                         k_cap=len(tokens) if k_cap is None else k_cap, target_logits=None,
                         sampling=SAMPLING, gammas=[0.5] * len(tokens), verify_s=round_s)


def play_round(policy: LengthPolicy, outcomes, drafter: int = 0) -> RoundFeedback:
    """One engine round; ``outcomes[j]`` says whether draft position j would be accepted."""
    cap = policy.begin_round(drafter)
    tokens: list[int] = []
    for j in range(min(cap, len(outcomes))):
        tok = 1 if outcomes[j] else 0
        verdict = policy.decide(DraftStep(j, tok))
        if verdict is Decision.DISCARD:
            break
        tokens.append(tok)
        if verdict is Decision.STOP:
            break
    n = 0
    while n < len(tokens) and tokens[n] == 1:
        n += 1
    fb = feedback(tokens, n, k_cap=cap)
    policy.update(fb)
    return fb


def simulate(policy: TapOut, rounds: int, accept: float = 0.8, seed: int = 0) -> list[int]:
    """Rounds with i.i.d. acceptance ``accept`` per position; returns the sequence-level arms."""
    rng = np.random.default_rng(seed)
    policy.begin_request()
    arms = []
    for _ in range(rounds):
        play_round(policy, (rng.random(policy.max_len) < accept).tolist())
        arms.append(policy._arm)
    return arms


# -- stub rules ----------------------------------------------------------------------------------
class StopAt(LengthPolicy):
    """Stops after the k-th drafted token."""

    def __init__(self, k: int, **kwargs):
        super().__init__(**kwargs)
        self.k, self.name = k, f"stop-at-{k}"

    def begin_round(self, drafter: int) -> int:
        return 128

    def decide(self, step: DraftStep) -> Decision:
        return Decision.STOP if step.index + 1 >= self.k else Decision.CONTINUE


class Informed(LengthPolicy):
    """Knows the future: stops exactly at the first token that will be rejected."""

    name = "informed"

    def begin_round(self, drafter: int) -> int:
        return 128

    def decide(self, step: DraftStep) -> Decision:
        return Decision.STOP if step.token == 0 else Decision.CONTINUE


class Always(LengthPolicy):
    def __init__(self, verdict: Decision, **kwargs):
        super().__init__(**kwargs)
        self.verdict, self.name = verdict, f"always-{verdict.value}"

    def begin_round(self, drafter: int) -> int:
        return 128

    def decide(self, step: DraftStep) -> Decision:
        return self.verdict


class Recorder(Always):
    """Counts the calls TapOut forwards."""

    def __init__(self, verdict: Decision = Decision.CONTINUE):
        super().__init__(verdict)
        self.calls = {"begin_request": 0, "begin_round": 0, "decide": 0, "update": 0}

    def begin_request(self) -> None:
        self.calls["begin_request"] += 1
        super().begin_request()

    def begin_round(self, drafter: int) -> int:
        self.calls["begin_round"] += 1
        return 3

    def decide(self, step: DraftStep) -> Decision:
        self.calls["decide"] += 1
        return self.verdict

    def update(self, fb: RoundFeedback) -> None:
        self.calls["update"] += 1


# -- construction --------------------------------------------------------------------------------
def test_default_arms_are_the_table1_rules_with_their_thresholds():
    pol = TapOut()
    assert pol.name == "tapout" and pol.max_len == 128 and pol.alpha == 0.5
    assert [type(a) for a in pol.arms] == [MaxConfidence, SVIPEntropy, SVIPDifference,
                                           LogitMargin, AdaEDL]
    assert [a.threshold for a in pol.arms[:4]] == [0.8, 0.6, 0.2, 0.2]  # AdaEDL: learnt lambda
    assert all(a.scope == "request" for a in pol.arms)
    assert all(a.scope == "global" for a in TapOut(scope="global").arms)
    assert TapOut(arms="svip+adaedl").arm_names == ["svip", "adaedl"]
    assert build_length(pol) is pol


@pytest.mark.parametrize("kwargs", [
    {"level": "chunk"}, {"algo": "exp3"}, {"alpha": 1.5}, {"alpha": -0.1}, {"max_len": 0},
    {"max_len": 2.5}, {"ts_var": 0.0}, {"token_reward": "foo"}, {"arms": []},
    {"arms": "svip+nope"}, {"arms": [object()]}, {"scope": "forever"},
])
def test_tapout_bad_parameters_raise_config_error(kwargs):
    with pytest.raises(ConfigError):
        TapOut(**kwargs)


@pytest.mark.parametrize("kwargs", [{"L": 0}, {"L": 2.5}, {"L": "x"}, {"delta": 0.0},
                                    {"delta": 1.5}, {"explore": 0}, {"scope": "x"}])
def test_length_ucb_bad_parameters_raise_config_error(kwargs):
    with pytest.raises(ConfigError):
        LengthUCB(**kwargs)


# -- reward and statistics on hand cases ---------------------------------------------------------
def test_blended_reward_hand_cases():
    pol = TapOut(arms=[StopAt(1)])
    # |Y| = 2 accepted of |X| = 4 drafted, gamma = max_len = 128
    assert pol.reward(feedback([1, 2, 3, 4], 2)) == pytest.approx(0.5 * 2 / 128 + 0.5 * 2 / 4)
    pol = TapOut(arms=[StopAt(1)], alpha=0.25, max_len=8)
    assert pol.reward(feedback([1, 2, 3, 4], 2)) == pytest.approx(0.25 * 2 / 8 + 0.75 * 2 / 4)
    pol = TapOut(arms=[StopAt(1)], max_len=4)
    assert pol.reward(feedback([1, 2, 3, 4], 4)) == pytest.approx(1.0)
    assert pol.reward(feedback([1, 2, 3, 4], 0)) == 0.0
    assert pol.reward(feedback([], 0)) == 0.0
    # alpha = 1 is the paper's r_simple = |Y| / gamma
    assert TapOut(arms=[StopAt(1)], alpha=1.0, max_len=8).reward(feedback([1, 2, 3], 3)) == 3 / 8


def test_sequence_round_updates_the_chosen_arm_only():
    pol = TapOut(arms=[StopAt(3), StopAt(1)], max_len=16)
    pol.begin_request()
    fb = play_round(pol, [True, True, False, True])  # round 1: arm 0 (untried first)
    assert (fb.n_drafted, fb.n_accepted) == (3, 2)
    assert pol.seq.n == [1, 0] and pol.seq.s[0] == pytest.approx(0.5 * 2 / 16 + 0.5 * 2 / 3)
    fb = play_round(pol, [True, True, False, True])  # round 2: arm 1
    assert (fb.n_drafted, fb.n_accepted) == (1, 1)
    assert pol.seq.n == [1, 1] and pol.seq.s[1] == pytest.approx(0.5 / 16 + 0.5)
    assert pol.values() == [pytest.approx(pol.seq.s[0]), pytest.approx(pol.seq.s[1])]


def test_sequence_round_without_decisions_is_not_learnt_and_discard_scores_zero():
    pol = TapOut(arms=[Always(Decision.DISCARD)])
    pol.begin_request()
    pol.begin_round(0)
    pol.update(feedback([], 0))  # drafter had no proposal: the rule was never asked
    assert pol.seq.t == 0
    play_round(pol, [True, True])  # the rule discarded the first token: empty draft
    assert pol.seq.n == [1] and pol.seq.s == [0.0]


def test_ucb1_and_ucb_tuned_indices_hand_case():
    st = ArmStats(3)
    for arm, r in [(0, 1.0), (0, 0.0), (1, 0.5), (0, 1.0), (1, 0.7)]:
        st.add(arm, r)
    assert st.n == [3, 2, 0] and st.t == 5
    assert st.mean(0) == pytest.approx(2 / 3) and st.var(0) == pytest.approx(2 / 9)
    assert st.var(1) == pytest.approx(0.01)
    lt = math.log(5)
    u1 = st.ucb1()
    assert u1[0] == pytest.approx(2 / 3 + math.sqrt(2 * lt / 3))
    assert u1[1] == pytest.approx(0.6 + math.sqrt(2 * lt / 2))
    assert u1[2] == math.inf
    ut = st.ucb_tuned()
    v0 = 2 / 9 + math.sqrt(2 * lt / 3)  # > 1/4: capped
    assert v0 > 0.25 and ut[0] == pytest.approx(2 / 3 + math.sqrt(lt / 3 * 0.25))
    v1 = 0.01 + math.sqrt(2 * lt / 2)
    assert ut[1] == pytest.approx(0.6 + math.sqrt(lt / 2 * min(0.25, v1)))
    rng = np.random.default_rng(0)
    assert st.select("ucb1", rng, False, 0.25) == 2  # unplayed arm first
    st.add(2, 0.0)
    lt = math.log(6)
    expect = int(np.argmax([2 / 3 + math.sqrt(2 * lt / 3), 0.6 + math.sqrt(lt), 0 + math.sqrt(2 * lt)]))
    assert st.select("ucb1", rng, False, 0.25) == expect == 1
    # UCB-Tuned on a low-variance arm explores less: tie-free hand case
    st2 = ArmStats(2)
    for r in [0.6, 0.6, 0.6, 0.6]:
        st2.add(0, r)
    for r in [0.0, 1.0]:
        st2.add(1, r)
    lt = math.log(6)
    t0 = 0.6 + math.sqrt(lt / 4 * min(0.25, 0.0 + math.sqrt(2 * lt / 4)))
    t1 = 0.5 + math.sqrt(lt / 2 * min(0.25, 0.25 + math.sqrt(2 * lt / 2)))
    assert st2.ucb_tuned() == [pytest.approx(t0), pytest.approx(t1)]
    assert st2.select("ucb-tuned", rng, False, 0.25) == (0 if t0 > t1 else 1)


def test_thompson_posteriors_hand_case():
    st = ArmStats(2)
    for r in [1.0, 1.0, 0.0, 1.0]:
        st.add(0, r)
    # Gaussian, prior N(0.5, v) = one pseudo-observation: mean (0.5 + S)/(N+1), var v/(N+1)
    m, sd = st.gaussian_posterior(0.25)
    assert m.tolist() == pytest.approx([3.5 / 5, 0.5])
    assert sd.tolist() == pytest.approx([math.sqrt(0.25 / 5), math.sqrt(0.25)])
    # Beta-Bernoulli, uniform prior: Beta(1 + successes, 1 + failures)
    a, b = st.beta_posterior()
    assert a.tolist() == [4.0, 1.0] and b.tolist() == [2.0, 1.0]
    # selection is the argmax of one posterior draw per arm from the policy's rng
    r1, r2 = np.random.default_rng(7), np.random.default_rng(7)
    assert st.select("thompson", r1, True, 0.25) == int(np.argmax(r2.beta(a, b)))
    assert st.select("thompson", r1, False, 0.25) == int(np.argmax(r2.normal(m, sd)))
    # a clearly better arm is (almost) always drawn
    st3 = ArmStats(2)
    for _ in range(200):
        st3.add(0, 1.0)
        st3.add(1, 0.0)
    rng = np.random.default_rng(1)
    assert all(st3.select("thompson", rng, b, 0.25) == 0 for b in (True, False) for _ in range(50))


def test_token_level_rewards_decisions_per_position():
    # arm 0 always continues, arm 1 stops; UCB1 plays arm 0 first at every new position
    pol = TapOut(level="token", arms=[Always(Decision.CONTINUE), Informed()], max_len=8)
    pol.begin_request()
    fb = play_round(pol, [True, True, False, True, True, True, True, True, True])
    # arm 0 at positions 0..7 (all new): drafts up to the cap, positions 0,1 accepted
    assert (fb.n_drafted, fb.n_accepted) == (8, 2)
    assert [p.n for p in pol.positions] == [[1, 0]] * 8
    # decision reward: continue is right iff the token was accepted
    assert [p.s[0] for p in pol.positions] == [1, 1, 0, 0, 0, 0, 0, 0]
    fb = play_round(pol, [True, False, True])  # arm 1 everywhere it is untried
    assert (fb.n_drafted, fb.n_accepted) == (2, 1)
    # position 0: informed continues on an accepted token (1); position 1: stops on a reject (1)
    assert pol.positions[0].n == [1, 1] and pol.positions[0].s[1] == 1.0
    assert pol.positions[1].n == [1, 1] and pol.positions[1].s[1] == 1.0
    assert pol.positions[2].n == [1, 0]  # never reached in round 2

    lit = TapOut(level="token", arms=[Always(Decision.STOP), Informed()], max_len=8,
                 token_reward="accepted")
    lit.begin_request()
    play_round(lit, [False, True])  # arm 0 stops at a rejected token
    play_round(lit, [True, False])  # pos 0: arm 1 continues on an accepted token; pos 1: arm 0
    # literal reward: 1{token accepted}, whatever the decision
    assert lit.positions[0].s == [0.0, 1.0]


def test_decide_and_forwarding_to_arms():
    recs = [Recorder(), Recorder()]
    pol = TapOut(arms=recs, max_len=6)
    pol.begin_request()
    assert pol.begin_round(0) == 6  # TapOut's cap, not the arms' (3)
    for j in range(4):
        pol.decide(DraftStep(j, 1))
    pol.update(feedback([1, 1, 1, 1], 4))
    assert [r.calls for r in recs] == [
        {"begin_request": 1, "begin_round": 1, "decide": 4, "update": 1},
        {"begin_request": 1, "begin_round": 1, "decide": 0, "update": 1}]
    recs = [Recorder(), Recorder(), Recorder()]
    tok = TapOut(level="token", arms=recs, max_len=6)
    tok.begin_request()
    tok.begin_round(0)
    for j in range(4):
        tok.decide(DraftStep(j, 1))
    tok.update(feedback([1, 1, 1, 1], 4))
    assert all(r.calls["decide"] == 4 and r.calls["update"] == 1 for r in recs)
    assert sum(tok.pulls) == 4


# -- learning ------------------------------------------------------------------------------------
@pytest.mark.parametrize("algo", ["ucb1", "ucb-tuned", "thompson"])
def test_sequence_bandit_converges_to_the_better_rule(algo):
    # i.i.d. acceptance 0.8: E[r_blend] = 0.221 (stop after 8), 0.403 (stop after 1), 0.066 (40)
    pol = TapOut(algo=algo, arms=[StopAt(8), StopAt(1), StopAt(40)], seed=0)
    arms = simulate(pol, 1000)
    late = arms[500:]
    share = late.count(1) / len(late)
    assert share > 0.8, (algo, share, pol.seq.n)
    vals = pol.values()
    assert max(range(3), key=vals.__getitem__) == 1
    assert vals[1] == pytest.approx(0.403, abs=0.02)


@pytest.mark.parametrize("algo", ["ucb1", "ucb-tuned", "thompson"])
def test_token_bandit_converges_to_the_informed_rule(algo):
    pol = TapOut(level="token", algo=algo, seed=0,
                 arms=[Always(Decision.CONTINUE), Informed(), Always(Decision.STOP)], max_len=16)
    simulate(pol, 600, accept=0.8)
    first = pol.positions[0]
    assert first.n[1] / first.t > 0.8, (algo, first.n)
    assert first.mean(1) == 1.0  # at position 0 the informed rule is always right
    vals = pol.values()  # later positions: after an earlier arm's mistake nothing is accepted
    assert vals[1] == max(vals) > 0.9


def test_tapout_is_deterministic_given_seed_and_scope_controls_reset():
    def run(seed, level):
        pol = TapOut(level=level, algo="thompson", seed=seed,
                     arms=[StopAt(8), StopAt(1), StopAt(3)], max_len=16)
        simulate(pol, 150)
        return pol.pulls, [p.n for p in pol.positions], pol.seq.n

    for level in ("sequence", "token"):
        assert run(3, level) == run(3, level)
        assert run(3, level) != run(4, level)

    for scope, kept in (("global", True), ("request", False)):
        pol = TapOut(scope=scope, arms=[StopAt(1), StopAt(2)])
        simulate(pol, 20)
        assert pol.seq.t == 20
        pol.begin_request()
        assert pol.seq.t == (20 if kept else 0)


def _length_env(policy: LengthUCB, rounds: int, seed: int = 0, accept: float = 0.8):
    """Throughput env: i.i.d. acceptance, drafting 0.05 s/token, a verify-cost cliff between
    3 and 4 verified rows (gamma 2 -> 3), 5% timing noise. Returns the chosen lengths."""
    rng = np.random.default_rng(seed)
    verify = [1.0, 1.0, 1.05, 2.0, 2.05, 2.1]
    chosen = []
    policy.begin_request()
    for _ in range(rounds):
        g = policy.begin_round(0)
        assert policy.decide(DraftStep(0, 1)) is Decision.CONTINUE
        ok = rng.random(g) < accept
        n = int(np.argmin(ok)) if not ok.all() else g
        secs = (0.05 * g + verify[g]) * (1 + 0.05 * rng.standard_normal())
        fb = feedback([1] * g, n, k_cap=g, round_s=secs)
        policy.update(fb)
        chosen.append(g)
    return chosen


def test_length_ucb_finds_the_throughput_best_length_before_a_cost_cliff():
    # expected tokens/s: 1.0, 1.71, 2.12 (gamma=2), 1.37, 1.49
    pol = LengthUCB()
    assert pol.name == "ucbspec-length" and pol.n_arms == 5
    chosen = _length_env(pol, 4000)
    assert chosen[:5] == [0, 1, 2, 3, 4]  # round-robin first (Alg. 8 lines 4-5)
    late = chosen[-1000:]
    assert pol.best() == 2
    assert late.count(2) / len(late) > 0.6, [late.count(g) for g in range(5)]
    assert 0 < min(pol.means()) and max(pol.means()) <= 1.0
    assert chosen == _length_env(LengthUCB(), 4000)  # deterministic


def test_length_ucb_credits_the_capped_length_and_scope():
    pol = LengthUCB(L=4)
    pol.begin_request()
    assert pol.begin_round(0) == 0
    pol.update(feedback([], 0, k_cap=0, round_s=0.5))
    assert pol.counts == [1, 0, 0, 0, 0] and pol.max_throughput == pytest.approx(2.0)
    assert pol.begin_round(0) == 1
    pol.update(feedback([1], 1, k_cap=1, round_s=0.5))  # 2 tokens in 0.5 s
    assert pol.counts == [1, 1, 0, 0, 0] and pol.max_throughput == pytest.approx(4.0)
    assert pol.means()[:2] == [pytest.approx(0.5), pytest.approx(1.0)]
    assert pol.begin_round(0) == 2
    pol.update(feedback([1], 1, k_cap=1, round_s=0.5))  # budget capped the round at 1 token
    assert pol.counts == [1, 2, 0, 0, 0]
    pol.update(feedback([1], 1, k_cap=1, round_s=0.0))  # no timing: ignored
    assert pol.t == 3
    # radius of UCBSpec for rewards in [0, 1]: 1/2 sqrt((1+n)/n^2 (1 + 2 log(K t^2 sqrt(1+n)/delta)))
    cr = 0.5 * math.sqrt(3 / 4 * (1 + 2 * math.log(5 * 9 * math.sqrt(3) / 0.5)))
    assert pol.ucb()[1] == pytest.approx(1.0 + cr)
    pol.begin_request()
    assert pol.t == 0
    g = LengthUCB(scope="global")
    _length_env(g, 10)
    g.begin_request()
    assert g.t == 10


# -- integration: greedy output unchanged --------------------------------------------------------
def _tiny(seed: int, head_scale: float = 1.0) -> LlamaForCausalLM:
    cfg = LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(cfg).eval()
    if head_scale != 1.0:  # peakier drafter distributions, so the rules stop at varied places
        with torch.no_grad():
            model.lm_head.weight.mul_(head_scale)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


@pytest.fixture(scope="module")
def models():
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield _tiny(0), _tiny(1, head_scale=40.0)
    torch.set_num_threads(prev)


PROMPT = [3, 5, 7, 9, 11, 2, 4, 3, 5, 7]


@pytest.fixture(scope="module")
def reference(models):
    target, _ = models
    with torch.no_grad():
        out = target.generate(torch.tensor([PROMPT]), do_sample=False, max_new_tokens=30)
    return out[0, len(PROMPT):].tolist()


@pytest.mark.parametrize("make", [
    lambda: TapOut(level="sequence", algo="ucb1"),
    lambda: TapOut(level="sequence", algo="thompson", seed=1),
    lambda: TapOut(level="token", algo="thompson", seed=2),
    lambda: TapOut(level="token", algo="ucb-tuned"),
    lambda: LengthUCB(),
], ids=["seq-ucb1", "seq-ts", "token-ts", "token-ucbt", "ucbspec-length"])
def test_greedy_output_unchanged(models, reference, make):
    target, draft_model = models
    policy = make()
    drafter = ModelDrafter(as_loaded(draft_model), 32)
    engine = SpeculativeEngine(target, [drafter], length=policy)
    for _ in range(2):  # a second request on the same engine (policy state carried or reset)
        result = engine.generate(PROMPT, max_new_tokens=30)
        assert result.token_ids == reference
    rounds = result.stats.rounds
    assert sum(r.emitted for r in rounds) == 30
    if isinstance(policy, TapOut):
        assert all(r.k_cap <= 128 for r in rounds)
        drafted = {r.drafted for r in rounds}
        assert len(drafted) > 1, drafted  # the rules stopped at different places
        if policy.level == "sequence":  # the last round (cap 0: budget) consults no rule
            assert policy.seq.t == sum(1 for r in rounds if r.k_cap > 0) == len(rounds) - 1
        else:
            assert policy.positions[0].t == sum(1 for r in rounds if r.k_cap > 0)
    else:
        assert {r.k_cap for r in rounds} <= set(range(5))
        assert policy.t == len(rounds)


def test_tapout_runs_in_sampling_mode_and_with_a_model_free_drafter(models):
    target, draft_model = models
    pol = TapOut(level="token", algo="thompson", seed=0)
    engine = SpeculativeEngine(target, [ModelDrafter(as_loaded(draft_model), 32)], length=pol)
    res = engine.generate(PROMPT, max_new_tokens=20, temperature=1.0, seed=5)
    assert len(res.token_ids) == 20 and pol.positions[0].t > 0
    pol = TapOut(level="sequence")
    engine = SpeculativeEngine(target, [PromptLookupDrafter()], length=pol)
    res = engine.generate(PROMPT, max_new_tokens=20)
    assert len(res.token_ids) == 20
