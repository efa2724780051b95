"""SpecDec++: acceptance head, stop rule (Alg. 1), head files, and the training pipeline (4.4)."""

from __future__ import annotations

import copy
import math
import random

import pytest
import torch
from conftest import make_tiny_model

from adaspec import SpeculativeEngine
from adaspec.config import SamplingConfig
from adaspec.drafters import Decision, DraftStep, ModelDrafter
from adaspec.errors import AdaspecError, ConfigError
from adaspec.training.specdecpp_head import (HeadTrainConfig, acceptance_targets, bernoulli_kl, mix_tokens,
                               split_prompts, train_head, weighted_bce)
from adaspec.length import LENGTH_POLICIES, build_length
from adaspec.length.specdecpp import (AcceptanceHead, SpecDecPPPolicy, drafter_info,
                                      load_head, save_head)
from adaspec.models import as_loaded

LN2 = math.log(2.0)


# -- loss, metric, mixing ----------------------------------------------------------------------
def test_weighted_bce_by_hand():
    # P_hat = sigmoid(0) = 0.5 on an accepted token, sigmoid(ln 3) = 0.75 on a rejected one:
    # (1 * 1 * ln 2 + 6 * 1 * ln 4) / (1 + 6) = 13 ln 2 / 7
    logits = torch.tensor([0.0, math.log(3.0)])
    loss = weighted_bce(logits, torch.tensor([1.0, 0.0]), w_rej=6.0)
    assert float(loss) == pytest.approx(13 * LN2 / 7, rel=1e-6)
    # soft target 0.5 at P_hat 0.5: (0.5 ln 2 + 6 * 0.5 ln 2) / (0.5 + 3) = ln 2
    assert float(weighted_bce(torch.tensor([0.0]), torch.tensor([0.5]), 6.0)) == pytest.approx(LN2)
    # w_rej = 1 is the plain mean BCE
    plain = torch.nn.functional.binary_cross_entropy_with_logits(logits, torch.tensor([0.3, 0.9]))
    assert float(weighted_bce(logits, torch.tensor([0.3, 0.9]), 1.0)) == pytest.approx(float(plain))


def test_bernoulli_kl_by_hand():
    kl = bernoulli_kl(torch.tensor([1.0, 0.5, 0.0, 0.3]),
                      torch.tensor([0.0, math.log(3.0), -50.0, math.log(0.3 / 0.7)]))
    expected = [LN2, 0.5 * math.log(4 / 3), 0.0, 0.0]
    assert kl.tolist() == pytest.approx(expected, abs=1e-6)


def test_token_mixing_takes_r_target_tokens():
    n = 20000
    x, y = torch.arange(n), -torch.arange(1, n + 1)
    z, from_target = mix_tokens(x, y, 0.15, torch.Generator().manual_seed(0))
    assert abs(float(from_target.float().mean()) - 0.15) < 0.01
    assert torch.equal(z[from_target], x[from_target]) and torch.equal(z[~from_target], y[~from_target])
    z2, m2 = mix_tokens(x, y, 0.15, torch.Generator().manual_seed(0))
    assert torch.equal(z, z2) and torch.equal(from_target, m2)
    z0, m0 = mix_tokens(x, y, 0.0, torch.Generator().manual_seed(0))
    assert not m0.any() and torch.equal(z0, y)


def test_acceptance_targets_min_p_over_q():
    t_logits = torch.log(torch.tensor([[0.2, 0.5, 0.3], [0.6, 0.3, 0.1]]))
    d_logits = torch.log(torch.tensor([[0.5, 0.4, 0.1], [0.1, 0.1, 0.8]]))
    y, p = acceptance_targets(t_logits, d_logits, SamplingConfig())  # greedy: argmax match
    assert y.tolist() == [0, 2] and p.tolist() == [0.0, 0.0]
    y, p = acceptance_targets(t_logits, t_logits, SamplingConfig())
    assert p.tolist() == [1.0, 1.0]
    y, p = acceptance_targets(t_logits, d_logits, SamplingConfig(temperature=1.0),
                              torch.Generator().manual_seed(0))
    pt, pd = t_logits.exp(), d_logits.exp()
    for i, tok in enumerate(y.tolist()):
        assert float(p[i]) == pytest.approx(min(1.0, float(pt[i, tok] / pd[i, tok])), rel=1e-5)


# -- the stop rule (Algorithm 1) ---------------------------------------------------------------
def _probe_head(hidden: int = 4) -> AcceptanceHead:
    """D = 0 head whose predicted acceptance is sigmoid(hidden[0])."""
    head = AcceptanceHead(hidden, depth=0)
    with torch.no_grad():
        head.out.weight.zero_()
        head.out.weight[0, 0] = 1.0
        head.out.bias.zero_()
    return head


def _e(p: float, hidden: int = 4) -> torch.Tensor:
    v = torch.zeros(hidden)
    v[0] = math.log(p / (1 - p))
    return v


def test_stop_rule_on_hand_made_probabilities():
    pol = SpecDecPPPolicy(head=_probe_head(), h=0.7, max_len=20)
    pol.begin_request()
    assert pol.begin_round(0) == 20
    # step 0 carries e_0 (last verified token): not scored, even if it predicts rejection
    assert pol.decide(DraftStep(0, 1, hidden=_e(0.01))) is Decision.CONTINUE
    assert pol.predicted_rejection == 0.0
    # predicted acceptances of y_1..y_4: 0.9, 0.8, 0.5, 0.8 -> 1 - prod = .1, .28, .64, .712
    decisions = [pol.decide(DraftStep(i, 1, hidden=_e(p)))
                 for i, p in enumerate([0.9, 0.8, 0.5, 0.8], 1)]
    assert decisions == [Decision.CONTINUE] * 3 + [Decision.STOP]
    assert pol.predicted_rejection == pytest.approx(0.712)
    # a new round starts from P_hat = 1 again
    pol.begin_round(0)
    assert pol.decide(DraftStep(0, 1, hidden=_e(0.5))) is Decision.CONTINUE
    assert pol.decide(DraftStep(1, 1, hidden=_e(0.5))) is Decision.CONTINUE  # 0.5 <= 0.7
    assert pol.decide(DraftStep(2, 1, hidden=_e(0.5))) is Decision.STOP  # 0.75 > 0.7
    # h = 0: stop as soon as one candidate has been scored (two candidates kept)
    pol0 = SpecDecPPPolicy(head=_probe_head(), h=0.0)
    pol0.begin_round(0)
    assert [pol0.decide(DraftStep(i, 1, hidden=_e(0.99))) for i in range(2)] == [
        Decision.CONTINUE, Decision.STOP]


def test_model_free_drafters_use_static_fallback():
    pol = SpecDecPPPolicy(head=_probe_head(), max_len=20, fallback_k=3)
    pol.begin_round(0)
    assert [pol.decide(DraftStep(i, 1)) for i in range(3)] == [
        Decision.CONTINUE, Decision.CONTINUE, Decision.STOP]
    assert SpecDecPPPolicy(head=_probe_head(), max_len=2, fallback_k=5).fallback_k == 2


@pytest.mark.parametrize("params", [{"head": None}, {"head": ""}, {"h": 1.5}, {"h": -0.1},
                                    {"max_len": 0}, {"fallback_k": 0}, {"max_len": 2.5}])
def test_bad_parameters(params):
    kwargs = {"head": _probe_head(), **params}
    with pytest.raises(ConfigError):
        SpecDecPPPolicy(**kwargs)


# -- head files --------------------------------------------------------------------------------
def test_head_file_round_trip_and_mismatch(tmp_path):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        head = AcceptanceHead(32, depth=2)
    head.set_input_stats(torch.randn(50, 32) * 3 + 1)
    drafter = as_loaded(make_tiny_model(1), name="tiny-drafter")
    path = save_head(tmp_path / "sub" / "head.pt", head, drafter_info(drafter), {"w_rej": 6.0})
    loaded = load_head(path, drafter=drafter)
    assert loaded.drafter == {"name": "tiny-drafter", "hidden_size": 32, "vocab_size": 32}
    assert loaded.training == {"w_rej": 6.0} and loaded.head.depth == 2
    x = torch.randn(7, 32)
    assert torch.allclose(loaded.head(x), head(x))

    wide = as_loaded(make_tiny_model(1, hidden=48, intermediate=96), name="wide")
    with pytest.raises(AdaspecError, match=r"hidden size 32.*'wide' has hidden size 48.*train-head"):
        load_head(path, drafter=wide)
    pol = SpecDecPPPolicy(head=str(path))
    pol.begin_round(0)
    with pytest.raises(AdaspecError, match="hidden size 48"):
        pol.decide(DraftStep(1, 3, hidden=torch.zeros(48)))
    with pytest.raises(AdaspecError, match="not found"):
        load_head(tmp_path / "missing.pt")
    torch.save({"something": 1}, tmp_path / "other.pt")
    with pytest.raises(AdaspecError, match="not an adaspec acceptance head"):
        SpecDecPPPolicy(head=str(tmp_path / "other.pt"))


# -- the pipeline end to end -------------------------------------------------------------------
def _pair(noise: float = 0.02):
    target = make_tiny_model(0, init_std=0.2)
    drafter = copy.deepcopy(target)  # a perturbed copy: agrees with the target part of the time
    with torch.no_grad():
        g = torch.Generator().manual_seed(5)
        for p in drafter.parameters():
            p.add_(torch.randn(p.shape, generator=g) * noise)
    return target, drafter


def _prompts(n: int = 12, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 32) for _ in range(rng.randrange(3, 10))] for _ in range(n)]


def _hf_greedy(model, prompt, n):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n)
    return out[0, len(prompt):].tolist()


def test_pipeline_trains_saves_and_runs_in_the_engine(tmp_path, monkeypatch):
    target, drafter = _pair()
    cfg = HeadTrainConfig(prompts=_prompts(), max_new_tokens=40, epochs=6, lr=3e-3, seed=0)
    path = tmp_path / "head.pt"
    res = train_head(as_loaded(target), as_loaded(drafter, name="perturbed"), cfg, out=path)
    assert res.path == path and path.is_file()
    assert res.n_train > 200 and res.n_eval > 20 and len(res.history) == cfg.epochs + 1
    assert res.history[-1].train_loss < 0.9 * res.history[0].train_loss  # the head learns
    assert all(math.isfinite(e.eval_kl) and e.eval_kl >= 0 for e in res.history)
    assert 0.05 < res.mean_acceptance < 0.95
    # about r = 15% of the response tokens were target tokens (and gave no examples)
    meta = load_head(path, drafter=as_loaded(drafter, name="perturbed"))
    assert abs(meta.training["n_target_tokens"] / meta.training["n_response_tokens"] - 0.15) < 0.05
    assert meta.drafter["name"] == "perturbed" and meta.training["temperature"] == 0.0

    # deterministic given the seed
    res2 = train_head(as_loaded(target), as_loaded(drafter), cfg)
    assert res2.history[-1].train_loss == pytest.approx(res.history[-1].train_loss, rel=1e-6)

    # the engine loads it and stays exact under greedy decoding
    prompt = [5, 9, 3, 17]
    engine = SpeculativeEngine(target, [ModelDrafter(as_loaded(drafter), 32)],
                               length=SpecDecPPPolicy(head=str(path)))
    out = engine.generate(prompt, max_new_tokens=48)
    assert out.token_ids == _hf_greedy(target, prompt, 48)
    drafted = [r.drafted for r in out.stats.rounds]
    assert max(drafted) <= 20 and any(2 <= d < 20 for d in drafted)

    # built from a spec string once registered (the registry entry is added in length/__init__)
    monkeypatch.setitem(LENGTH_POLICIES, "specdecpp", SpecDecPPPolicy)
    pol = build_length(f"specdecpp:head={path},h=0.5,max_len=8")
    assert isinstance(pol, SpecDecPPPolicy) and (pol.h, pol.max_len) == (0.5, 8)


def test_self_drafter_head_drafts_to_the_cap(tmp_path):
    """Drafter == target: every draft is accepted (P = 1), so the head never stops drafting."""
    target = make_tiny_model(0, init_std=0.2)
    loaded = as_loaded(target)
    cfg = HeadTrainConfig(prompts=_prompts(6, seed=1), max_new_tokens=16, epochs=2)
    res = train_head(loaded, loaded, cfg, out=tmp_path / "self.pt")
    assert res.mean_acceptance == 1.0
    engine = SpeculativeEngine(loaded, [ModelDrafter(loaded, 32)],
                               length=SpecDecPPPolicy(head=str(tmp_path / "self.pt"), max_len=6))
    out = engine.generate([3, 1, 4, 1, 5], max_new_tokens=30)
    assert out.token_ids == _hf_greedy(target, [3, 1, 4, 1, 5], 30)
    assert [r.drafted for r in out.stats.rounds[:4]] == [6, 6, 6, 6]


def test_early_exit_drafter_head(tmp_path):
    """The early-exit drafter (target's first layer) is the SmolLM2 use case: head trained on
    it, then used by the engine with the ``early-exit:layers=1`` drafter spec."""
    from adaspec.drafters import early_exit_model

    target = make_tiny_model(0, init_std=0.2)
    loaded = as_loaded(target)
    cfg = HeadTrainConfig(prompts=_prompts(6, seed=2), max_new_tokens=24, epochs=3)
    res = train_head(loaded, early_exit_model(loaded, 1), cfg, out=tmp_path / "ee.pt")
    assert res.history[-1].train_loss <= res.history[0].train_loss
    assert load_head(tmp_path / "ee.pt").drafter["hidden_size"] == 32
    engine = SpeculativeEngine(loaded, ["early-exit:layers=1"],
                               length=SpecDecPPPolicy(head=str(tmp_path / "ee.pt")))
    out = engine.generate([2, 7, 1, 8], max_new_tokens=30)
    assert out.token_ids == _hf_greedy(target, [2, 7, 1, 8], 30)
    assert all(1 <= r.drafted <= 20 for r in out.stats.rounds[:-1])


def test_pipeline_sampling_mode_targets():
    target, drafter = _pair(0.05)
    cfg = HeadTrainConfig(prompts=_prompts(4), max_new_tokens=12, epochs=1, temperature=1.0,
                          top_k=20)
    res = train_head(as_loaded(target), as_loaded(drafter), cfg)
    assert 0.0 < res.mean_acceptance < 1.0  # soft targets min(1, p/q)
    assert res.history[-1].eval_kl >= 0.0


def test_pipeline_input_errors():
    target = as_loaded(make_tiny_model(0))
    with pytest.raises(ConfigError, match="at least 2 prompts"):
        train_head(target, target, HeadTrainConfig(prompts=[[1, 2, 3]]))
    with pytest.raises(ConfigError, match="needs prompts"):
        train_head(target, target, HeadTrainConfig())
    with pytest.raises(ConfigError, match="mix_ratio"):
        HeadTrainConfig(mix_ratio=1.0)
    with pytest.raises(ConfigError, match="w_rej"):
        HeadTrainConfig(w_rej=0)
    assert split_prompts(10, 0.2, 0)[1] == split_prompts(10, 0.2, 0)[1]
    assert len(split_prompts(2, 0.9, 0)[0]) == 1


# -- the CLI on tiny models saved to disk -------------------------------------------------------
def test_cli_train_head(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from typer.testing import CliRunner

    from adaspec.cli import app

    words = [f"w{i:02d}" for i in range(32)]
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk)
    target, drafter = _pair()
    for name, model in (("target", target), ("drafter", drafter)):
        model.save_pretrained(tmp_path / name)
        tok.save_pretrained(tmp_path / name)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(" ".join(words[(3 * i + j) % 31 + 1] for j in range(5))
                                 for i in range(6)) + "\n\n")
    out = tmp_path / "cli-head.pt"
    result = CliRunner().invoke(app, [
        "train-head", "--model", str(tmp_path / "target"), "--drafter",
        f"model:{tmp_path / 'drafter'}", "--prompts", str(prompts), "--out", str(out),
        "--epochs", "2", "--max-new-tokens", "12", "--w-rej", "3", "--depth", "1", "--seed", "1"])
    assert result.exit_code == 0, result.output
    assert "eval KL" in result.output and out.is_file()
    meta = load_head(out)
    assert meta.head.depth == 1 and meta.training["w_rej"] == 3.0 and meta.training["seed"] == 1
    ee = CliRunner().invoke(app, [
        "train-head", "--model", str(tmp_path / "target"), "--drafter", "early-exit:layers=1",
        "--prompts", str(prompts), "--out", str(out), "--epochs", "1", "--max-new-tokens", "8"])
    assert ee.exit_code == 0, ee.output
    assert load_head(out).drafter["name"].endswith("[:1 layers]")
    bad = CliRunner().invoke(app, ["train-head", "--model", str(tmp_path / "target"),
                                   "--drafter", "prompt-lookup", "--out", str(out)])
    assert bad.exit_code == 2 and "model:REF" in bad.output
