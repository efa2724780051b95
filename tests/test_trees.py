"""Draft trees: the tree type, tree verification on the transformers backend (mask, positions,
KV gather), exact acceptance (greedy identity, sampling chi-square) and trees from the
model-free drafters in the engine."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from adaspec.errors import ConfigError
from adaspec.models import as_loaded
from adaspec.trees import (DraftTree, nodes_worth_verifying, tree_attention_mask, tree_gammas,
                           verify_tree_greedy, verify_tree_sampling)
from conftest import chisquare_gof, make_tiny_model

pytestmark = pytest.mark.usefixtures("torch_single_thread")

V = 16
PREFIX = [3, 7, 1, 9, 4, 11, 2]
#: a tree with branches at the root and below, nodes in mixed depth order:
#:   root -> 5 -> 6 -> 8
#:        -> 9 -> 1
#:   5 -> 2, 6 -> 3
TREE = DraftTree(tokens=[5, 9, 6, 1, 2, 8, 3], parents=[-1, -1, 0, 1, 0, 2, 2])


@pytest.fixture(autouse=True)
def _private_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("ADASPEC_CACHE", str(tmp_path))


def tiny_qwen(seed: int = 0):
    """A tiny randomly initialised Qwen2 model (bias on q/k/v, unlike Llama)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      initializer_range=0.3, tie_word_embeddings=False, use_sliding_window=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(cfg)
    return model.eval()


def models():
    return {"llama": make_tiny_model(seed=1, vocab=V, init_std=0.3, lm_head_scale=2.0),
            "qwen2": tiny_qwen(seed=1)}


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def target(request):
    return as_loaded(models()[request.param])


@torch.inference_mode()
def chain_logits(loaded, ids):
    """Reference: a plain causal forward over ``ids`` (no cache): logits at every position."""
    return loaded.model(input_ids=torch.tensor([ids])).logits[0]


def prefilled(loaded, ids):
    state = loaded.new_state()
    loaded.forward(state, ids, keep=1)
    return state


# -- the tree type ------------------------------------------------------------------------------
def test_tree_type_checks_parents_and_siblings():
    assert TREE.depths == [1, 1, 2, 2, 2, 3, 3]
    assert TREE.path(5) == [0, 2, 5] and TREE.children()[0] == [0, 1]
    assert DraftTree.chain([4, 5, 6]).is_chain and not TREE.is_chain
    assert TREE.prefix(3).tokens == [5, 9, 6]
    with pytest.raises(ConfigError, match="parent"):
        DraftTree([1, 2], [-1, 1])
    with pytest.raises(ConfigError, match="siblings"):
        DraftTree([1, 1], [-1, -1])
    vis = TREE.visibility()
    assert vis[6].tolist() == [True, True, False, True, False, False, True, False]  # root, 5, 6, 8
    mask = tree_attention_mask(TREE, 4, torch.float32)
    assert mask.shape == (1, 1, 8, 12) and (mask[0, 0, :, :4] == 0).all()


def test_node_budget_maximises_tokens_per_second():
    flat = lambda w: 1.0 + 0.01 * w  # noqa: E731 -- nearly flat verify cost: keep every useful node
    assert nodes_worth_verifying([0.9, 0.5, 0.3, 0.2], flat) == 4
    steep = lambda w: float(w)  # noqa: E731 -- each node costs a full forward: only sure nodes pay
    assert nodes_worth_verifying([0.9, 0.5, 0.3], steep) == 0
    half = lambda w: 1.0 + 0.5 * (w - 1)  # noqa: E731
    assert nodes_worth_verifying([1.0, 1.0, 0.1], half) == 2
    cliff = lambda w: {1: 1.0, 2: 2.0, 3: 2.0, 4: 1.2}.get(w, 1.2)  # noqa: E731 -- width 4 is cheap
    assert nodes_worth_verifying([0.3, 0.2, 0.1], cliff) == 3
    assert nodes_worth_verifying([0.5, 0.5], lambda w: 0.0) == 2  # no costs known: all nodes


# -- tree verification on the transformers backend --------------------------------------------
def test_tree_logits_equal_chain_forwards_of_each_path(target):
    """Brute-force reference: node i's logits equal a causal forward over prefix + its path."""
    state = prefilled(target, PREFIX[:-1])
    logits, _ = target.forward_tree(state, PREFIX[-1], TREE)
    assert logits.shape == (len(TREE) + 1, V)
    ref_root = chain_logits(target, PREFIX)[-1]
    torch.testing.assert_close(logits[0], ref_root, atol=1e-5, rtol=1e-5)
    for i in range(len(TREE)):
        path = [TREE.tokens[j] for j in TREE.path(i)]
        ref = chain_logits(target, PREFIX + path)[-1]
        torch.testing.assert_close(logits[i + 1], ref, atol=1e-5, rtol=1e-5)


def test_kv_after_acceptance_equals_a_cache_of_the_accepted_tokens(target):
    """keep_path gathers the accepted path's KV; a further forward gives the same logits as a
    cache built from the accepted tokens."""
    start = len(PREFIX) - 1
    for node in (5, 4, 3, 1):  # a path through non-contiguous rows, a middle node, a second branch
        state = prefilled(target, PREFIX[:-1])
        target.forward_tree(state, PREFIX[-1], TREE)
        path = TREE.path(node)
        target.keep_path(state, start, [0, *(j + 1 for j in path)])
        accepted = PREFIX + [TREE.tokens[j] for j in path]
        ref = prefilled(target, accepted)
        assert target.state_length(state) == target.state_length(ref) == len(accepted)
        for a, b in zip(state.layers, ref.layers):
            torch.testing.assert_close(a.keys, b.keys, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(a.values, b.values, atol=1e-5, rtol=1e-5)
        nxt = [6, 0, 13]
        got, _ = target.forward(state, nxt, keep=3)
        torch.testing.assert_close(got, chain_logits(target, accepted + nxt)[-3:], atol=1e-5, rtol=1e-5)


def test_negative_control_without_gather_or_tree_positions_fails(target, monkeypatch):
    """Injected bugs must be caught: cropping without the gather, and chain position ids."""
    start = len(PREFIX) - 1
    state = prefilled(target, PREFIX[:-1])
    target.forward_tree(state, PREFIX[-1], TREE)
    path = TREE.path(5)  # rows 1, 3, 6: not contiguous
    target.truncate(state, start + 1 + len(path))  # the bug: crop only
    accepted = PREFIX + [TREE.tokens[j] for j in path]
    got, _ = target.forward(state, [6], keep=1)
    assert not torch.allclose(got, chain_logits(target, accepted + [6])[-1:], atol=1e-3)

    monkeypatch.setattr(DraftTree, "position_offsets", lambda self: list(range(len(self) + 1)))
    state = prefilled(target, PREFIX[:-1])
    logits, _ = target.forward_tree(state, PREFIX[-1], TREE)
    path = [TREE.tokens[j] for j in TREE.path(5)]
    assert not torch.allclose(logits[6], chain_logits(target, PREFIX + path)[-1], atol=1e-3)


def test_unsupported_attention_and_backend_give_clear_errors():
    model = make_tiny_model(seed=0, vocab=V)
    loaded = as_loaded(model)
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ConfigError, match="attn_implementation='sdpa'"):
        loaded.forward_tree(loaded.new_state(), 1, TREE)
    from adaspec.backends.base import TargetBackend

    with pytest.raises(ConfigError, match="not implemented on the .* backend"):
        TargetBackend.forward_tree(loaded, None, 1, TREE)


def test_eager_attention_takes_the_tree_mask():
    model = make_tiny_model(seed=2, vocab=V, init_std=0.3)
    model.config._attn_implementation = "eager"
    loaded = as_loaded(model)
    state = prefilled(loaded, PREFIX[:-1])
    logits, _ = loaded.forward_tree(state, PREFIX[-1], TREE)
    path = [TREE.tokens[j] for j in TREE.path(6)]
    torch.testing.assert_close(logits[7], chain_logits(loaded, PREFIX + path)[-1], atol=1e-5, rtol=1e-5)


# -- exact acceptance ----------------------------------------------------------------------------
def test_greedy_tree_verdict_is_the_longest_argmax_path():
    logits = torch.full((len(TREE) + 1, V), -5.0)
    want = {0: 5, 1: 6, 3: 3}  # root -> 5 -> 6 -> 3 (node 6); at node 6 the target says 12
    for row, tok in want.items():
        logits[row, tok] = 5.0
    logits[7, 12] = 5.0
    verdict = verify_tree_greedy(logits, TREE)
    assert verdict.path == [0, 2, 6] and verdict.next_token == 12 and verdict.rows == [0, 1, 3, 7]
    # a chain-shaped tree gives the chain verifier's answer
    from adaspec.sampling import verify_greedy

    chain = DraftTree.chain([5, 6, 8])
    lg = torch.randn(4, V)
    lg[0, 5] = lg[1, 6] = 50.0
    v = verify_greedy(lg, chain.tokens)
    t = verify_tree_greedy(lg, chain)
    assert (len(t.path), t.next_token) == (v.n_accepted, v.next_token) == (2, int(lg[2].argmax()))


def test_tree_gammas_are_the_target_mass_of_the_children():
    p = torch.softmax(torch.randn(len(TREE) + 1, V), -1)
    g = tree_gammas(p, TREE, [0, 1, 2])
    assert g[0] == pytest.approx(float(p[0, 5] + p[0, 9]))
    assert g[1] == pytest.approx(float(p[1, 6] + p[1, 2]))
    assert g[2] == pytest.approx(float(p[2, 1]))
