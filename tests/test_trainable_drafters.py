"""Trainable drafters (EAGLE-style feature head, tiny distilled LM): training, file format,
engine integration (target features), exactness under greedy decoding and sampling.

Everything runs on tiny random Llamas; the distilled sets are written to tmp directories from
the target's own greedy outputs, as ``adaspec distill`` would.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import chisquare_gof, make_tiny_model

from adaspec import SpeculativeEngine
from adaspec.config import SamplingConfig
from adaspec.training.drafters import (EVAL_K, _decode_path, _precompute, _read_distilled, _trainer_from_file,
                                      checkpoint_path, draft_vocabulary, iid_mat, train_drafter)
from adaspec.drafters import Decision, FeatureHeadDrafter, TinyLMDrafter, build_drafter
from adaspec.drafters.feature_head import FeatureBuffer, FeatureHead, TargetFeatureForward
from adaspec.errors import AdaspecError, ConfigError, ModelLoadError
from adaspec.models import as_loaded, target_fingerprint
from adaspec.sampling import process_logits

VOCAB = 64
MAX_NEW = 24
KINDS = ["feature-head", "tiny-lm"]


def _target(seed: int = 0, vocab: int = VOCAB, init_std: float = 0.3, scale: float = 2.0):
    return as_loaded(make_tiny_model(seed, vocab, init_std=init_std, lm_head_scale=scale), name=f"tiny{seed}")


_GREEDY: dict[tuple, list[int]] = {}


@torch.no_grad()
def _greedy(target, prompt: list[int], n: int = MAX_NEW) -> list[int]:
    """Plain greedy decoding with a KV cache (the reference; faster than HF generate here)."""
    from transformers import DynamicCache

    key = (id(target.model), tuple(prompt), n)
    if key not in _GREEDY:
        cache = DynamicCache(config=target.model.config)
        out: list[int] = []
        feed = list(prompt)
        for _ in range(n):
            logits = target.model(input_ids=torch.tensor([feed]), **{target.cache_kw: cache}, use_cache=True).logits
            feed = [int(logits[0, -1].argmax())]
            out.append(feed[0])
        _GREEDY[key] = out
    return _GREEDY[key]


def _write_distilled(path: Path, target, prompts: list[list[int]], n: int = MAX_NEW, domain: str = "toy") -> Path:
    path.mkdir(parents=True, exist_ok=True)
    rows = [{"prompt_id": f"p{i}", "temperature": 0.0, "seed": 0, "prompt_ids": p, "output_ids": _greedy(target, p, n)}
            for i, p in enumerate(prompts)]
    meta = {"format": "adaspec.distill/1", "target": target_fingerprint(target), "domain": domain,
            "temperatures": [0.0], "max_new_tokens": n, "created": "2025-01-01T00:00:00", "n_samples": len(rows)}
    (path / "meta.json").write_text(json.dumps(meta))
    (path / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _prompts(count: int, seed: int, vocab: int = VOCAB, length: int = 6) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (length,), generator=g).tolist() for _ in range(count)]


@pytest.fixture(scope="module")
def target():
    return _target(0)


@pytest.fixture(scope="module")
def data(target, tmp_path_factory) -> Path:
    return _write_distilled(tmp_path_factory.mktemp("distilled"), target, _prompts(24, seed=1))


@pytest.fixture(scope="module")
def trained(target, data, tmp_path_factory) -> dict[str, Path]:
    """One feature head file and one tiny-LM directory, trained briefly (kept checkpoints)."""
    root = tmp_path_factory.mktemp("drafters")
    out = {}
    for kind, name in (("feature-head", "head.pt"), ("tiny-lm", "tiny")):
        out[kind] = root / name
        train_drafter(kind, target, [data], out[kind], epochs=25, lr=3e-3, batch_tokens=256, vocab_size=48,
                      layers=1, keep_checkpoint=True)
    return out


def _train_prompts(data: Path) -> list[list[int]]:
    return [s.prompt_ids for s in _read_distilled(data)]


# -- data, vocabulary, estimates ----------------------------------------------------------------
def test_draft_vocabulary_ranks_by_frequency_and_forces_eos():
    seqs = [[5, 5, 5, 2, 2, 9], [7]]
    assert draft_vocabulary(seqs, 2, 16).tolist() == [2, 5]  # 5 (x3), 2 (x2), sorted by id
    assert draft_vocabulary(seqs, 2, 16, always=[15]).tolist() == [5, 15]  # forced first
    assert draft_vocabulary(seqs, 3, 16).tolist() == [2, 5, 7]  # 7 and 9 tie: lower id first
    assert draft_vocabulary(seqs, 10, 16, fill=False).tolist() == [2, 5, 7, 9]  # only tokens that occur
    # the fill: unseen ids in id (BPE merge) order after every seen one, up to the size
    assert draft_vocabulary(seqs, 6, 16).tolist() == [0, 1, 2, 5, 7, 9]
    assert draft_vocabulary(seqs, 6, 16, always=[15]).tolist() == [0, 2, 5, 7, 9, 15]
    assert draft_vocabulary(seqs, 16, 16).tolist() == list(range(16))  # V' >= V: everything
    with pytest.raises(ConfigError, match="draft vocabulary size"):
        draft_vocabulary(seqs, 0, 16)


def test_decode_path_walks_the_rounds_of_greedy_speculative_decoding():
    # prompt of 3 tokens, 7 generated (ids 3..9): the first round drafts token 3
    assert _decode_path({}, 3, 10, 5) == (0, 7)  # nothing accepted: one round per token, as AR
    assert _decode_path({3: 5, 9: 5}, 3, 10, 5) == (5, 2)  # 3..7 accepted + the target's 8; then 9
    assert _decode_path({3: 2, 6: 9}, 3, 10, 5) == (5, 2)  # 3,4 (+5); 6..8 capped to leave 9 to the target
    assert _decode_path({3: 1, 4: 0, 5: 5}, 3, 10, 5) == (5, 2)  # no round starts at 4


@pytest.mark.parametrize("kind", KINDS)
def test_held_out_estimate_equals_a_live_greedy_run(kind, target, trained, data):
    """The training report's simulated MAT walks the engine's rounds: on the target's own greedy
    text, each sequence's (accepted drafts, rounds) equals a live engine run at k = 5."""
    trainer = _trainer_from_file(kind, target, Path(trained[kind]))
    samples = _read_distilled(data, target)[:6]
    seqs = _precompute(target, samples, trainer.vocab if kind == "tiny-lm" else trainer.head.vocab,
                       features=kind == "feature-head", sub_logits=False, progress=None, stage="")
    sim = trainer.evaluate(seqs, 256)
    engine = SpeculativeEngine(target, [f"{kind}:path={trained[kind]}"], k=EVAL_K)
    live = []
    for s in samples:
        res = engine.generate(s.prompt_ids, max_new_tokens=len(s.output_ids))
        assert res.token_ids == s.output_ids
        live.append((res.stats.accepted, len(res.stats.rounds)))
    assert [tuple(p) for p in sim.per_sequence] == live
    assert sum(a for a, _ in live) > 0


def test_iid_mat():
    assert iid_mat(0.0) == 1.0 and iid_mat(1.0) == 6.0
    assert iid_mat(0.5) == pytest.approx(sum(0.5 ** i for i in range(6)))


def test_distilled_reader_tags_domains_and_checks_the_target(target, data, tmp_path):
    samples = _read_distilled(data, target)
    assert len(samples) == 24 and samples[0].domain == "toy"
    with pytest.raises(ModelLoadError, match="built for target"):
        _read_distilled(data, _target(1))
    with pytest.raises(AdaspecError, match="not a distilled set"):
        _read_distilled(tmp_path)


# -- training -------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_training_decreases_loss_and_reports(kind, target, data, tmp_path):
    out = tmp_path / ("h.pt" if kind == "feature-head" else "lm")
    seen: list[str] = []
    rep = train_drafter(kind, target, [data], out, epochs=12, lr=3e-3, batch_tokens=256, vocab_size=48, layers=1,
                        progress=lambda stage, done, total: seen.append(stage))
    first, last = rep.epochs[0], rep.epochs[-1]
    assert len(rep.epochs) == 12 and rep.stopped == "epochs"
    assert last.train_loss < 0.7 * first.train_loss
    assert rep.heldout_sequences >= 1 and rep.train_sequences + rep.heldout_sequences == 24
    assert 0.0 <= last.val_top1 <= 1.0 and 1.0 <= last.val_mat_k5 <= 6.0
    assert last.iid_mat_k5 == pytest.approx(iid_mat(last.val_top1))
    assert rep.draft_vocab <= 48 and rep.params > 0
    assert any(s.startswith("target features") for s in seen) and any(s.startswith("epoch") for s in seen)
    assert out.exists() and not checkpoint_path(out).exists()  # completed: checkpoint removed
    assert "top-1 agreement" in rep.summary()


def test_tiny_lm_with_kl_term_and_prompt_loss(target, data, tmp_path):
    rep = train_drafter("tiny-lm", target, [data], tmp_path / "kl", epochs=6, lr=3e-3, batch_tokens=256,
                        vocab_size=48, layers=1, kl_weight=0.5, prompt_loss=True)
    plain = train_drafter("tiny-lm", target, [data], tmp_path / "ce", epochs=1, lr=3e-3, batch_tokens=256,
                          vocab_size=48, layers=1)
    assert rep.epochs[-1].train_loss < rep.epochs[0].train_loss
    assert rep.train_positions > plain.train_positions  # the prompt positions are trained on too
    assert TinyLMDrafter.load(tmp_path / "kl", target).training["settings"]["kl_weight"] == 0.5


def _weights(kind: str, path: Path, target) -> dict[str, torch.Tensor]:
    if kind == "feature-head":
        return torch.load(path, weights_only=True)["state_dict"]
    return TinyLMDrafter.load(path, target).model.state_dict()


@pytest.mark.parametrize("kind", KINDS)
def test_training_is_deterministic_and_resumes_exactly(kind, target, data, tmp_path):
    kw = dict(epochs=3, lr=3e-3, batch_tokens=128, vocab_size=48, checkpoint_every=2, layers=1)
    train_drafter(kind, target, [data], tmp_path / "a", **kw)
    part = train_drafter(kind, target, [data], tmp_path / "b", max_steps=5, **kw)
    assert part.stopped == "max_steps" and part.epochs[-1].partial
    assert checkpoint_path(tmp_path / "b").exists()
    resumed = train_drafter(kind, target, [data], tmp_path / "b", **kw)
    assert resumed.resumed_at_step == 5 and resumed.stopped == "epochs"
    a, b = _weights(kind, tmp_path / "a", target), _weights(kind, tmp_path / "b", target)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # a checkpoint left by an interrupted run is not resumed with other settings
    train_drafter(kind, target, [data], tmp_path / "b", max_steps=1, **kw)
    with pytest.raises(ConfigError, match="other settings.*lr"):
        train_drafter(kind, target, [data], tmp_path / "b", **{**kw, "lr": 1e-2})


def test_training_rejects_bad_settings(target, data, tmp_path):
    with pytest.raises(ConfigError, match="kind"):
        train_drafter("medusa", target, [data], tmp_path / "x")
    with pytest.raises(ConfigError, match="at least one distilled set"):
        train_drafter("tiny-lm", target, [], tmp_path / "x")
    with pytest.raises(ConfigError, match="heldout_fraction"):
        train_drafter("tiny-lm", target, [data], tmp_path / "x", heldout_fraction=1.5)
    with pytest.raises(ModelLoadError, match="built for target"):  # data distilled from another target
        train_drafter("tiny-lm", _target(1), [data], tmp_path / "x")


# -- file format ------------------------------------------------------------------------------------
def test_feature_head_file_holds_the_trained_weights_and_round_trips(target, trained, tmp_path):
    path = trained["feature-head"]
    blob = torch.load(path, weights_only=True)
    assert blob["format"] == "adaspec.feature-head/1" and blob["target"] == target_fingerprint(target)
    # only the head's own weights: no embedding or LM head of the target
    assert not any("embed" in k or "lm_head" in k for k in blob["state_dict"])
    ckpt = torch.load(checkpoint_path(path), weights_only=True)["model"]
    assert all(torch.equal(ckpt[k], v) for k, v in blob["state_dict"].items())
    a = FeatureHead.load(path, target)
    a.save(tmp_path / "copy.pt")
    b = FeatureHead.load(tmp_path / "copy.pt", target)
    assert torch.equal(a.vocab, b.vocab)
    for (ka, va), (kb, vb) in zip(a.net.state_dict().items(), b.net.state_dict().items()):
        assert ka == kb and torch.equal(va, vb)
    _same_proposals(target, [FeatureHeadDrafter(a), FeatureHeadDrafter(b)])


def test_feature_head_follows_its_targets_linear_kernels(trained):
    """A head on a small-batch target drafts with the small-batch kernel (adaspec.kernels), one on
    a stock target with PyTorch's, one on a packed target with that target's timed small-row plan
    (its layers and its output matrix: the target's own layer for the full vocabulary, a packed
    slice otherwise); all stay exact (greedy output = plain decoding)."""
    from adaspec.kernels import PackedLinear, SmallBatchLinear, follow_plan, use_small_batch_linear

    stock_target, fast_target, packed_target = _target(0), _target(0), _target(0)
    use_small_batch_linear(fast_target.model)
    plan = ("stock", "packed", "transposed")
    if torch.backends.mkldnn.is_available():
        follow_plan(packed_target.model, plan)  # as load_model's packing and timing would leave it
    cases = [(stock_target, False, None), (fast_target, True, None)]
    if torch.backends.mkldnn.is_available():
        cases.append((packed_target, True, plan))
    for t, small, want_plan in cases:
        head = FeatureHead.load(trained["feature-head"], t)
        assert head.small_batch is small and head.small_plan == want_plan
        assert any(type(m) is SmallBatchLinear for m in head.net.modules()) is (small and want_plan is None)
        if want_plan is not None:
            layers = [m for m in head.net.modules() if isinstance(m, PackedLinear)]
            assert layers and all(m.small_plan == want_plan for m in layers)
            assert head._lm.small_plan == want_plan
            if head.full_vocab:
                assert head._lm is t.model.get_output_embeddings()
            with torch.inference_mode():
                for rows in (1, 2, 3, 5):
                    x = torch.randn(rows, head.hidden_size)
                    torch.testing.assert_close(head.subset_logits(x), F.linear(x, head.lm_weight, head.lm_bias),
                                               rtol=1e-5, atol=1e-5)
        plain = SpeculativeEngine(t, ["none"]).generate(_prompts(1, seed=2)[0], max_new_tokens=MAX_NEW)
        got = SpeculativeEngine(t, [FeatureHeadDrafter(head)], k=4).generate(_prompts(1, seed=2)[0],
                                                                             max_new_tokens=MAX_NEW)
        assert got.token_ids == plain.token_ids


def test_packed_linear_over_shared_tensors_follows_its_plan():
    """``kernels.packed_linear`` wraps existing tensors without copying them and computes
    ``F.linear`` on every small-row kernel its plan may name."""
    from adaspec.kernels import SMALL_KINDS, packed_linear

    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(40, 16, generator=g), torch.randn(40, generator=g)
    for kind in SMALL_KINDS:
        layer = packed_linear(w, b, (kind, kind, kind))
        assert layer.weight.data_ptr() == w.data_ptr() and not layer.weight.requires_grad
        with torch.inference_mode():
            for rows in (1, 2, 3, 4, 9):
                x = torch.randn(rows, 16, generator=g)
                torch.testing.assert_close(layer(x), F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_tiny_lm_directory_round_trips(target, trained, tmp_path):
    from adaspec.drafters.tiny_lm import read_tiny_lm_meta, save_tiny_lm

    path = trained["tiny-lm"]
    meta = read_tiny_lm_meta(path)
    assert meta["format"] == "adaspec.tiny-lm/1" and meta["target"] == target_fingerprint(target)
    assert (path / "config.json").is_file()
    a = TinyLMDrafter.load(path, target)
    ckpt = torch.load(checkpoint_path(path), weights_only=True)["model"]
    state = a.model.state_dict()
    assert all(torch.equal(ckpt[k], state[k]) for k in ckpt)
    save_tiny_lm(a.model, target, a.vocab, tmp_path / "copy", meta["training"])
    b = TinyLMDrafter.load(tmp_path / "copy", target)
    _same_proposals(target, [a, b])


def _same_proposals(target, drafters) -> None:
    results = []
    for d in drafters:
        eng = SpeculativeEngine(target, [d], k=4)
        res = [eng.generate(p, max_new_tokens=MAX_NEW) for p in _prompts(3, seed=1)]
        results.append([([r.drafted for r in x.stats.rounds], [r.accepted for r in x.stats.rounds], x.token_ids)
                        for x in res])
    assert all(r == results[0] for r in results)


@pytest.mark.parametrize("kind", KINDS)
def test_loading_against_another_target_is_a_clear_error(kind, trained):
    other = _target(1)
    with pytest.raises(ModelLoadError, match="built for target 'tiny0'.*weights"):
        build_drafter(f"{kind}:path={trained[kind]}", other)


def test_drafter_specs(target, trained, tmp_path):
    d = build_drafter(f"feature-head:path={trained['feature-head']},name=fh", target)
    assert isinstance(d, FeatureHeadDrafter) and d.name == "fh" and d.uses_target_features
    t = build_drafter(f"tiny-lm:path={trained['tiny-lm']}", target)
    assert isinstance(t, TinyLMDrafter) and not getattr(t, "uses_target_features", False)
    assert t.name == f"tiny-lm:{trained['tiny-lm'].parent.name}/tiny"  # DIR/NAME: unique in a pool layout
    with pytest.raises(AdaspecError, match="feature-head:path=FILE"):
        build_drafter("feature-head", target)
    with pytest.raises(AdaspecError, match="tiny-lm:path=DIR"):
        build_drafter("tiny-lm:", target)
    with pytest.raises(ModelLoadError, match="not found"):
        build_drafter(f"feature-head:path={tmp_path / 'nope.pt'}", target)
    with pytest.raises(ModelLoadError, match="not found"):
        build_drafter(f"tiny-lm:path={tmp_path / 'nope'}", target)
    with pytest.raises(ModelLoadError, match="no adaspec-drafter.json"):
        build_drafter(f"tiny-lm:path={tmp_path}", target)
    with pytest.raises(ModelLoadError, match="not a feature-head file"):
        torch.save({"format": "x"}, tmp_path / "x.pt")
        build_drafter(f"feature-head:path={tmp_path / 'x.pt'}", target)
    with pytest.raises(AdaspecError, match="unknown parameter"):
        build_drafter(f"feature-head:path={trained['feature-head']},k=3", target)


# -- target features in the engine ------------------------------------------------------------------
def test_feature_forward_logits_identical_to_plain_forward(target):
    from transformers import DynamicCache

    fwd = TargetFeatureForward(target.model)
    assert fwd.split
    ids = [3, 9, 1, 44, 17, 5, 60, 2]
    c1, c2 = DynamicCache(config=target.model.config), DynamicCache(config=target.model.config)
    for chunk, keep in ((ids[:5], 1), (ids[5:], 3), ([7], 1)):
        x = torch.tensor([chunk])
        with torch.no_grad():
            ref = target.model(input_ids=x, **{target.cache_kw: c1}, use_cache=True, logits_to_keep=keep).logits
        got, hidden = fwd(x, c2, keep)
        assert torch.equal(got, ref) and hidden.shape == (1, len(chunk), 32)


def test_feature_forward_falls_back_when_the_forward_is_not_lm_head_of_h():
    model = make_tiny_model(0, VOCAB, init_std=0.3)

    class Scaled(type(model)):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = out.logits * 0.5
            return out

    model.__class__ = Scaled
    fwd = TargetFeatureForward(model)
    assert not fwd.split
    x = torch.tensor([[1, 2, 3, 4]])
    logits, hidden = fwd(x, None, 2)
    with torch.no_grad():
        assert torch.equal(logits, model(input_ids=x, logits_to_keep=2).logits)
        assert torch.allclose(hidden, model.model(input_ids=x).last_hidden_state)


def test_feature_buffer_grows_and_checks_ranges():
    buf = FeatureBuffer(4, capacity=2)
    buf.append(torch.ones(3, 4))
    buf.append(torch.zeros(1, 4))
    assert len(buf) == 4 and buf.rows(2, 4).tolist() == [[1.0] * 4, [0.0] * 4]
    with pytest.raises(AdaspecError, match="buffer holds 4"):
        buf.rows(0, 5)


class _SpyHead(FeatureHeadDrafter):
    """Checks the engine's feature buffer at every call: it covers all tokens but the newest."""

    def __init__(self, head):
        super().__init__(head, name="spy")
        self.calls = 0

    def catch_up(self, context):  # the first use ingests the prompt, maybe long after it was seen
        assert len(self._features) >= len(context) - 1
        super().catch_up(context)

    def draft(self, context, *args, **kwargs):
        assert len(self._features) == len(context) - 1
        self.calls += 1
        return super().draft(context, *args, **kwargs)

    def score(self, context, verified, sampling):
        assert len(self._features) == len(context) + len(verified) - 1
        self.calls += 1
        return super().score(context, verified, sampling)


@pytest.mark.parametrize("selector", [None, "hedgespec", "round-robin"])
def test_feature_buffer_matches_a_full_forward(target, trained, data, selector):
    spy = _SpyHead(FeatureHead.load(trained["feature-head"], target))
    pool = [spy] if selector is None else ["prompt-lookup", spy, f"tiny-lm:path={trained['tiny-lm']}"]
    engine = SpeculativeEngine(target, pool, selector=selector, k=3)
    for prompt in _train_prompts(data)[:2] + [[7]]:
        res = engine.generate(prompt, max_new_tokens=MAX_NEW)
        assert res.token_ids == _greedy(target, prompt)
        full = prompt + res.token_ids
        with torch.no_grad():
            h = target.model.model(input_ids=torch.tensor([full[:-1]])).last_hidden_state[0]
        assert len(spy._features) == len(full) - 1
        torch.testing.assert_close(spy._features.rows(), h, atol=1e-5, rtol=1e-4)
    assert spy.calls > 0


def test_no_feature_work_without_a_feature_drafter(target):
    engine = SpeculativeEngine(target, ["prompt-lookup"], k=3)
    engine.generate([1, 2, 3], max_new_tokens=5)
    assert engine._feature_forward is None


# -- exactness ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("length", [1, 3, 6, "hf-heuristic", "max-confidence:threshold=0.5", "svip"])
@pytest.mark.parametrize("kind", KINDS)
def test_greedy_output_equals_autoregressive(kind, length, target, trained, data):
    engine = SpeculativeEngine(target, [f"{kind}:path={trained[kind]}"], length=length)
    accepted = 0
    for prompt in _train_prompts(data)[:3] + _prompts(2, seed=99) + [[5]]:
        res = engine.generate(prompt, max_new_tokens=MAX_NEW)
        assert res.token_ids == _greedy(target, prompt), (kind, length, prompt)
        accepted += res.stats.accepted
    assert accepted > 0  # the drafter was really used (prompts it was trained on)


@pytest.mark.parametrize("kind", KINDS)
def test_score_equals_first_draft_token_of_a_fresh_drafter(kind, target, trained, data):
    """Full-information proposals (teacher forced) equal what the drafter drafts first from each
    prefix, also when it was used for drafting before (cache roll-back paths)."""
    prompt = _train_prompts(data)[0]
    full = prompt + _greedy(target, prompt)
    with torch.no_grad():
        h = target.model.model(input_ids=torch.tensor([full])).last_hidden_state[0]

    def fresh(upto: int):
        d = build_drafter(f"{kind}:path={trained[kind]}", target)
        buf = FeatureBuffer(32)
        buf.append(h[: upto - 1])
        if isinstance(d, FeatureHeadDrafter):
            d.bind_features(buf)
        d.begin_request(full[:upto])
        return d, buf

    greedy = SamplingConfig()
    n0 = len(prompt)
    d, buf = fresh(len(full))
    d.begin_request(prompt)
    d.draft(full[:n0], 4, greedy, None, lambda step: Decision.CONTINUE)  # leaves drafted cache entries
    scored = d.score(full[:n0], full[n0: n0 + 6], greedy).probs.argmax(-1).tolist()
    scored += d.score(full[: n0 + 6], full[n0 + 6: n0 + 9], greedy).probs.argmax(-1).tolist()
    expect = []
    for m in range(n0, n0 + 9):
        f, _ = fresh(m)
        expect.append(f.draft(full[:m], 1, greedy, None, lambda step: Decision.CONTINUE).tokens[0])
    assert scored == expect


@pytest.mark.parametrize("kind", KINDS)
def test_sampling_proposals_lie_in_the_draft_vocabulary(kind, target, trained, data):
    engine = SpeculativeEngine(target, [f"{kind}:path={trained[kind]}"], k=4)
    d = engine.drafters[0]
    vocab = (d.head.vocab if kind == "feature-head" else d.vocab).tolist()
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[vocab] = False
    seen = []
    original = d.draft

    def recording(*args, **kwargs):
        out = original(*args, **kwargs)
        seen.append(out)
        return out

    d.draft = recording
    for s in range(3):
        res = engine.generate(_train_prompts(data)[s], max_new_tokens=12, temperature=0.8, top_p=0.95, seed=s)
        assert len(res.token_ids) == 12
    drafts = [x for x in seen if x.tokens]
    assert drafts
    for x in drafts:
        assert set(x.tokens) <= set(vocab)
        assert torch.allclose(x.probs.sum(-1), torch.ones(len(x.tokens)), atol=1e-5)
        assert float(x.probs[:, outside].abs().sum()) == 0.0


def _exact_two_tokens(model, prompt, cfg) -> np.ndarray:
    vocab = model.config.vocab_size
    with torch.no_grad():
        first = process_logits(model(input_ids=torch.tensor([prompt])).logits[0, -1], cfg).double()
        ids = torch.tensor([prompt + [t] for t in range(vocab)])
        second = process_logits(model(input_ids=ids).logits[:, -1], cfg).double()
    return (first[:, None] * second).numpy()


def test_sampling_is_exact_with_a_reduced_vocabulary(tmp_path):
    """Feature head: 2-token outputs follow the target's distribution (chi-square over 1500 seeds,
    alpha = 0.001) although q covers only 8 of the 12 tokens. (The tiny LM samples through
    ModelDrafter, whose exactness tests/test_distribution.py covers.)"""
    kind = "feature-head"
    v = 12
    tgt = as_loaded(make_tiny_model(0, v, init_std=0.2, lm_head_scale=1.5), name="v12")
    data = _write_distilled(tmp_path / "d", tgt, _prompts(16, seed=3, vocab=v), n=16)
    out = tmp_path / ("h.pt" if kind == "feature-head" else "lm")
    train_drafter(kind, tgt, [data], out, epochs=15, lr=3e-3, batch_tokens=256, vocab_size=8, layers=1)
    engine = SpeculativeEngine(tgt, [f"{kind}:path={out}"], k=3)
    prompt = [3, 7, 1, 9, 4]
    exact = _exact_two_tokens(tgt.model, prompt, SamplingConfig(temperature=1.0))
    counts = np.zeros((v, v))
    drafted = accepted = 0
    for s in range(1500):
        res = engine.generate(prompt, max_new_tokens=2, temperature=1.0, seed=s)
        counts[tuple(res.token_ids)] += 1
        drafted += res.stats.drafted
        accepted += res.stats.accepted
    assert 0 < accepted < drafted
    stat, p, cells = chisquare_gof(counts.ravel(), exact.ravel())
    assert p > 0.001, f"chi-square {stat:.1f} over {cells} cells, p = {p:.2e}"


def test_train_drafter_command(target, data, tmp_path):
    import typer
    from typer.testing import CliRunner

    from adaspec.training.drafters import train_drafter_command

    model_dir = tmp_path / "target"
    target.model.save_pretrained(model_dir)
    app = typer.Typer()
    app.command("train-drafter")(train_drafter_command)
    app.command("other")(lambda: None)  # a multi-command app, as in adaspec.cli
    out = tmp_path / "cli-head.pt"
    res = CliRunner().invoke(app, ["train-drafter", "--kind", "feature-head", "--data", str(data), "--out", str(out),
                                   "--model", str(model_dir), "--epochs", "2", "--vocab-size", "48",
                                   "--batch-tokens", "256", "--json", str(tmp_path / "r.json")])
    assert res.exit_code == 0, res.output
    assert "top-1 agreement" in res.output and f"feature-head:path={out}" in res.output
    assert json.loads((tmp_path / "r.json").read_text())["kind"] == "feature-head"
    assert isinstance(build_drafter(f"feature-head:path={out}", target), FeatureHeadDrafter)
    res = CliRunner().invoke(app, ["train-drafter", "--kind", "eagle", "--data", str(data), "--out", str(out),
                                   "--model", str(model_dir)])
    assert res.exit_code == 2 and "kind" in res.output


# -- fine-tuning and the feature cache -------------------------------------------------------------
def _weights(kind: str, path: Path, target) -> dict[str, torch.Tensor]:
    if kind == "feature-head":
        return FeatureHead.load(path, target).net.state_dict()
    return TinyLMDrafter.load(path, target).model.state_dict()


@pytest.mark.parametrize("kind", KINDS)
def test_init_from_starts_from_a_trained_drafter(kind, target, data, trained, tmp_path):
    out = tmp_path / ("ft.pt" if kind == "feature-head" else "ft")
    report = train_drafter(kind, target, [data], out, epochs=1, lr=1e-9, batch_tokens=256, vocab_size=32,
                           layers=1, init_from=trained[kind])
    assert report.settings["init_from"] == str(trained[kind])
    fresh = tmp_path / ("fresh.pt" if kind == "feature-head" else "fresh")
    train_drafter(kind, target, [data], fresh, epochs=1, lr=1e-9, batch_tokens=256, vocab_size=32, layers=1)
    start, tuned, scratch = (_weights(kind, p, target) for p in (trained[kind], out, fresh))
    assert all(torch.allclose(tuned[k], start[k], atol=1e-6) for k in start)  # lr ~ 0: still the source
    assert not all(torch.allclose(scratch[k], start[k], atol=1e-3) for k in start)


def test_init_from_refuses_another_shape_or_target(target, data, trained, tmp_path):
    with pytest.raises(ConfigError, match="another shape"):
        train_drafter("tiny-lm", target, [data], tmp_path / "t2", epochs=1, layers=2, init_from=trained["tiny-lm"])
    other = _target(3)
    other_data = _write_distilled(tmp_path / "other", other, _prompts(4, seed=2))
    with pytest.raises(ModelLoadError, match="trained for|another|target"):
        train_drafter("feature-head", other, [other_data], tmp_path / "h.pt", epochs=1,
                      init_from=trained["feature-head"])


def test_target_features_are_computed_once_per_set(target, tmp_path, monkeypatch):
    from adaspec.training.drafters import FEATURES_FILE

    d = _write_distilled(tmp_path / "d", target, _prompts(6, seed=5))
    train_drafter("feature-head", target, [d], tmp_path / "a.pt", epochs=2, batch_tokens=256, vocab_size=32)
    assert (d / FEATURES_FILE).is_file()
    calls: list[int] = []
    real = TargetFeatureForward.__call__

    def counting(self, *args, **kwargs):
        calls.append(1)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(TargetFeatureForward, "__call__", counting)
    train_drafter("feature-head", target, [d], tmp_path / "b.pt", epochs=2, batch_tokens=256, vocab_size=32)
    assert calls == []  # every row came from the cache, and training is the same
    a, b = (FeatureHead.load(tmp_path / n, target).net.state_dict() for n in ("a.pt", "b.pt"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    other = _target(4)  # a cache made by another target is never used
    other_d = _write_distilled(tmp_path / "o", other, _prompts(3, seed=6))
    (other_d / FEATURES_FILE).write_bytes((d / FEATURES_FILE).read_bytes())
    train_drafter("feature-head", other, [other_d], tmp_path / "c.pt", epochs=1, batch_tokens=256, vocab_size=32)
    assert len(calls) == 3


def test_heldout_split_is_per_domain_so_a_generalist_holds_out_what_each_specialist_does():
    from adaspec.training.drafters import DistilledSample, _split

    def samples(domain: str, n: int) -> list[DistilledSample]:
        return [DistilledSample(f"{domain}-{i}", t, 0, [1], [2], domain) for i in range(n) for t in (0.0, 0.7)]

    code, math = samples("code", 30), samples("math", 20)
    union = code + math
    _, held_union = _split(union, 0.1, seed=3)
    _, held_code = _split(code, 0.1, seed=3)
    _, held_math = _split(math, 0.1, seed=3)
    ids = {(union[i].domain, union[i].prompt_id, union[i].temperature) for i in held_union}
    assert ids == {(s.domain, s.prompt_id, s.temperature) for s in [code[i] for i in held_code] + [math[i] for i in
                                                                                                  held_math]}
    assert len({p for _, p, _ in ids}) == 5  # 3 of 30 code prompts, 2 of 20 math ones, both samples of each
    assert _split(code, 0.1, seed=4)[1] != held_code
