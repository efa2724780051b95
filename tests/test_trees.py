"""Draft trees: the tree type, tree verification on the transformers backend (mask, positions,
KV gather), exact acceptance (greedy identity, sampling chi-square) and trees from the
model-free drafters in the engine."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import adaspec.batch as batch_mod
from adaspec.errors import ConfigError
from adaspec.round import Round
from adaspec.models import as_loaded
from adaspec.trees import (DraftTree, nodes_worth_verifying, tree_attention_mask, tree_gammas,
                           verify_tree_greedy, verify_tree_sampling)
from conftest import chisquare_gof, flat_cost_curve, make_tiny_model, real_model_threads

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
    lg = torch.randn(4, V, generator=torch.Generator().manual_seed(0))
    lg[0, 5] = lg[1, 6] = 50.0
    lg[2, 8] = -50.0  # the third draft is rejected (an unseeded draw once made it the argmax)
    v = verify_greedy(lg, chain.tokens)
    t = verify_tree_greedy(lg, chain)
    assert (len(t.path), t.next_token) == (v.n_accepted, v.next_token) == (2, int(lg[2].argmax()))


def test_tree_gammas_are_the_target_mass_of_the_children():
    p = torch.softmax(torch.randn(len(TREE) + 1, V), -1)
    g = tree_gammas(p, TREE, [0, 1, 2])
    assert g[0] == pytest.approx(float(p[0, 5] + p[0, 9]))
    assert g[1] == pytest.approx(float(p[1, 6] + p[1, 2]))
    assert g[2] == pytest.approx(float(p[2, 1]))


# -- trees from the model-free drafters -----------------------------------------------------------
#: prompts whose n-grams recur with different continuations, so trees branch
BRANCHY = [1, 2, 3, 4, 1, 2, 5, 1, 2, 3, 6, 1, 2, 3, 4, 7, 1, 2, 5, 6, 1, 2]


def _rand_prompt(seed: int, n: int = 24, vocab: int = V) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    motif = torch.randint(1, vocab, (4,), generator=g).tolist()
    out = []
    while len(out) < n:  # a motif repeated with random interruptions: shared prefixes, varied continuations
        out += motif[: int(torch.randint(2, 5, (1,), generator=g))] + torch.randint(1, vocab, (1,), generator=g).tolist()
    return out[:n]


@pytest.mark.parametrize("drafter", ["suffix", "prompt-lookup"])
def test_drafter_trees_are_best_first_and_contain_the_chain(drafter):
    from adaspec.drafters import build_drafter

    d = build_drafter(drafter, None)
    d.begin_request(BRANCHY)
    chain = d.peek(BRANCHY, 5).tokens
    tree = d.draft_tree(BRANCHY, 5, 12)
    assert not tree.is_chain, "the test prompt must make the tree branch"
    assert all(tree.scores[i] <= (1.0 if p < 0 else tree.scores[p]) + 1e-12
               for i, p in enumerate(tree.parents))
    assert sorted(tree.scores, reverse=True) == tree.scores  # best-first: every prefix is a tree
    # the first branch followed from the root is the chain's first token
    assert tree.tokens[0] == chain[0]
    d.catch_up(BRANCHY)  # drafting left the index as it was
    assert d.peek(BRANCHY, 5).tokens == chain


def test_level_candidates_rank_by_level_then_frequency_with_their_buckets():
    from adaspec.drafters.indexed import candidate_key, level_candidates

    got = dict(level_candidates(5, [(5, [5, 5, 7]), (2, [5, 7, 9, 9])]))
    assert list(got) == [5, 7, 9]  # the chain's token first, then level by level, by frequency
    assert got[5] == (5, 2, 0) == candidate_key(5, 2, 3, False)  # 2/3 of the 5-token matches
    assert got[7] == (5, 1, 0)  # 1/3: share bucket [0.2, 0.5)
    assert got[9] == (2, 2, 1)  # first seen at the 2-token level, after a level without it
    assert candidate_key(24, 4, 4, False) == (16, 3, 0)  # a unanimous long match
    assert list(dict(level_candidates(7, [(3, []), (1, [8, 7, 8])]))) == [7, 8]


def test_candidate_calibration_is_a_beta_mean_learned_from_the_emitted_tokens():
    from adaspec.drafters.indexed import CALIBRATION_WEIGHT, CandidateCalibration
    from adaspec.drafters.suffix import SuffixDrafter

    cal = CandidateCalibration({(2, 3, 0): 0.5}, default=0.1)
    assert cal.estimate((2, 3, 0)) == 0.5 and cal.estimate((9, 9, 9)) == 0.1
    cal.observe((2, 3, 0), True)
    cal.observe((2, 3, 0), False)
    cal.observe((2, 3, 0), True)
    w = CALIBRATION_WEIGHT
    assert cal.estimate((2, 3, 0)) == pytest.approx((2 + w * 0.5) / (3 + w))

    d = SuffixDrafter()
    d.begin_request(BRANCHY)
    tree = d.draft_tree(BRANCHY, 3, 12)
    root = [tree.tokens[i] for i in tree.children()[0]]
    root_keys = dict(d.candidate_keys())  # the index is back at BRANCHY: the root's candidates
    assert set(root) <= set(root_keys)
    assert not d.calibration.trials  # nothing is settled before the target has spoken
    emitted = [root[1], 99]  # the target took the second root candidate, then a new token
    d.catch_up(BRANCHY + emitted)
    trials, hits = d.calibration.trials, d.calibration.hits
    # every root candidate is one trial (also those the budget might cut), the emitted one a hit
    assert sum(trials.values()) >= len(root_keys)
    assert hits[root_keys[root[1]]] >= 1 and sum(hits.values()) == 1  # 99 was nobody's candidate
    before = dict(trials)
    d.catch_up(BRANCHY + emitted + [3])  # settled once: later contexts add nothing
    assert d.calibration.trials == before


def test_calibrated_scores_order_the_tree_and_follow_the_evidence():
    from adaspec.drafters.suffix import SuffixDrafter

    d = SuffixDrafter()
    d.begin_request(BRANCHY)
    first = d.draft_tree(BRANCHY, 1, 8)
    keys = dict(d.candidate_keys())
    assert first.scores == [d.calibration.estimate(keys[t]) for t in first.tokens]
    # a bucket that keeps missing loses its estimate, one that keeps hitting gains
    loser, winner = keys[first.tokens[0]], keys[first.tokens[-1]]
    for _ in range(40):
        d.calibration.observe(loser, False)
        d.calibration.observe(winner, True)
    again = d.draft_tree(BRANCHY, 1, 8)
    if loser != winner:
        assert again.tokens[0] == first.tokens[-1]


def test_suffix_trees_offer_the_last_tokens_continuations_without_a_match():
    from adaspec.drafters.suffix import SuffixDrafter

    ctx = [1, 2, 3, 4, 2, 5, 6, 7, 8, 2]  # "2" recurs, but no 2-token suffix does
    d = SuffixDrafter()
    d.begin_request(ctx)
    assert d.peek(ctx, 5).tokens == []  # the chain has no match
    tree = d.draft_tree(ctx, 2, 6)
    assert [tree.tokens[i] for i in tree.children()[0]] == [5, 3]  # the 1-gram level, recent first
    assert 0 < tree.scores[0] < 0.5  # a weak, calibrated estimate the node budget can cut


def test_suffix_trees_read_the_datastores_1gram_level_below_the_requests():
    """With a datastore, its continuations of the last token are a level below the request's
    1-gram level (most frequent first), and after a token the request has not seen they are the
    root's candidates instead of the request's most frequent tokens; document ends never are."""
    from adaspec.drafters.suffix import SuffixDatastore, SuffixDrafter

    store = SuffixDatastore()
    store.add([30, 11, 5, 30, 12, 6, 30, 11, 7, 9])
    store.add([8, 30])  # 30 ends this document: no continuation
    d = SuffixDrafter(datastore=store)
    ctx = [4, 1, 9, 1, 7, 2, 30]  # 30 is new to the request; no 2-token suffix matches anywhere
    d.begin_request(ctx)
    assert d.peek(ctx, 5).tokens == []
    keys = d.candidate_keys()
    assert [t for t, _ in keys] == [11, 12]  # the datastore's 1-gram level: 11 twice, 12 once
    assert keys[0][1][0] == 1  # in a 1-gram bucket, not the frequency level's
    ctx2 = [30, 12, 3, 30]  # the request's own 1-gram level (12) comes first, then the datastore's
    d.begin_request(ctx2)
    d.catch_up(ctx2)
    assert [t for t, _ in d.candidate_keys()] == [12, 11]
    plain = SuffixDrafter()
    plain.begin_request(ctx)
    plain.catch_up(ctx)
    assert {key for _, key in plain.candidate_keys()} == {(0, 0, 0)}  # without one: the frequency level


@pytest.mark.parametrize("drafter", ["suffix", "prompt-lookup"])
def test_trees_offer_the_most_frequent_tokens_after_an_unseen_token(drafter):
    """After a token the request has not seen (no match at any level) the root's candidates
    are the request's most frequent tokens, ties most recent first, in the frequency bucket;
    the chain still has nothing to propose."""
    from adaspec.drafters import build_drafter
    from adaspec.drafters.indexed import frequent_candidates

    ctx = [4, 1, 9, 1, 7, 2, 4, 2, 1, 8, 2, 9, 30]  # 1 and 2 three times, 4 and 9 twice, 30 unseen
    d = build_drafter(drafter, None)
    d.begin_request(ctx)
    assert d.peek(ctx, 5).tokens == []
    tree = d.draft_tree(ctx, 2, 6)
    root = [tree.tokens[i] for i in tree.children()[0]]
    assert root == [2, 1, 9, 4]  # by count, then by the last occurrence (2 after 1, 9 after 4)
    assert dict(d.candidate_keys()) == dict.fromkeys(root, (0, 0, 0))
    assert all(0 < s <= 0.05 for s in tree.scores[:4])  # weak, so the node budget prices them
    d.catch_up(ctx)
    assert [t for t, _ in frequent_candidates(d._index, 2)] == [2, 1]


def test_frequent_tokens_follow_every_change_of_the_index():
    """``NgramIndex.frequent`` keeps its ranking between changes: after appends, a rollback to
    the same length with other tokens, and inside a look, it equals a ranking from scratch."""
    import random

    from adaspec.drafters.index import NgramIndex

    def brute(tokens, n):
        last = {}
        count = {}
        for i, t in enumerate(tokens[:-1]):  # a 1-gram is indexed once its continuation is known
            count[t] = count.get(t, 0) + 1
            last[t] = i + 1
        return sorted(count, key=lambda t: (-count[t], -last[t]))[:n]

    rng = random.Random(0)
    index = NgramIndex([2, 1])
    seq: list[int] = []
    for step in range(300):
        if step % 7 == 6 and len(seq) > 3:  # roll back, then grow again with other tokens
            cut = len(seq) - rng.randint(1, 3)
            seq = seq[:cut]
            index.truncate(cut)
        t = rng.randint(0, 12)
        seq.append(t)
        index.append(t)
        assert index.frequent(4) == brute(seq, 4)
        if step % 5 == 0:
            base = len(index)
            index.look_begin()
            extra = [rng.randint(0, 12) for _ in range(3)]
            for e in extra:
                index.look_append(e)
            assert index.frequent(4) == brute(seq + extra, 4)
            index.look_end(base)
            assert index.frequent(4) == brute(seq, 4)


def test_level_candidates_stop_reading_levels_once_known():
    """With a limit, levels after those that fill it change nothing (their tokens rank below),
    and each token's bucket is that of the first level it appears at."""
    from adaspec.drafters.indexed import candidate_key, level_candidates

    levels = [(4, [3, 5, 3]), (2, [5, 6, 7, 3]), (1, [8, 9, 9, 3, 2])]
    assert level_candidates(3, levels, 3) == level_candidates(3, levels[:2], 3)
    assert level_candidates(3, levels, 3) == [(3, candidate_key(4, 2, 3, False)),
                                              (5, candidate_key(4, 1, 3, False)),
                                              (6, candidate_key(2, 1, 4, True))]
    assert [t for t, _ in level_candidates(3, levels)] == [3, 5, 6, 7, 9, 8, 2]
    assert [t for t, _ in level_candidates(11, levels, 2)] == [3, 5]  # `first` without a match


class ChainOnly:
    """Patch: every tree node gets only its top candidate, so trees are chains."""

    @staticmethod
    def apply(monkeypatch):
        from adaspec.drafters.indexed import IndexedDrafter
        from adaspec.drafters.lookup import PromptLookupDrafter
        from adaspec.drafters.suffix import SuffixDrafter

        for cls in (PromptLookupDrafter, SuffixDrafter):  # the chain's proposal alone (none without one)
            orig = cls.candidate_keys
            monkeypatch.setattr(cls, "candidate_keys",
                                lambda self, limit=None, _o=orig: _o(self)[:1] if self.propose() is not None else [])
        return IndexedDrafter


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_tree_of_one_chain_is_the_chain_path(monkeypatch, temperature):
    from adaspec import SpeculativeEngine

    ChainOnly.apply(monkeypatch)
    model = make_tiny_model(seed=3, vocab=V, init_std=0.3, lm_head_scale=3.0)
    for drafter in ("suffix", "prompt-lookup"):
        runs = []
        for tree in (False, True):
            eng = SpeculativeEngine(model, [drafter], k=4, tree=tree)
            res = eng.generate(BRANCHY, max_new_tokens=30, temperature=temperature, seed=5)
            runs.append((res.token_ids, [(r.drafted, r.accepted, r.tree_nodes) for r in res.stats.rounds]))
        assert runs[0] == runs[1], drafter
        assert any(d for d, _, _ in runs[0][1])


def _flat_costs(eng):
    """Price every verify width alike, so the node budget keeps the calibrated trees whatever
    this machine's measured surface says (the exactness tests must really verify trees), and
    keep it so: not scaled by the live ratio the tiny model's forwards would teach."""
    eng.cost_model.curve = flat_cost_curve([1.0] * 16)
    eng.cost_model.live = None
    return eng


def _ar(model, prompt, n):
    from adaspec import SpeculativeEngine

    return SpeculativeEngine(model, []).generate(prompt, max_new_tokens=n).token_ids


@pytest.mark.parametrize("init_std", [0.02, 0.3])
def test_greedy_trees_are_identical_to_plain_decoding(init_std):
    from adaspec import SpeculativeEngine

    tree_rounds = 0
    for seed in range(3):
        model = make_tiny_model(seed=seed, vocab=V, init_std=init_std, lm_head_scale=3.0)
        for prompt in (BRANCHY, _rand_prompt(seed)):
            ar = _ar(model, prompt, 40)
            for drafters in (["suffix"], ["prompt-lookup"], None):  # None: auto over the defaults
                eng = _flat_costs(SpeculativeEngine(model, drafters, k=5, tree=True))
                res = eng.generate(prompt, max_new_tokens=40)
                assert res.token_ids == ar, (seed, init_std, drafters)
                tree_rounds += sum(r.tree_nodes > 1 for r in res.stats.rounds)
    assert tree_rounds > 20  # trees were really verified


def test_negative_control_engine_without_kv_gather_is_not_exact(monkeypatch):
    """The same greedy identity check fails when keep_path crops without gathering."""
    from adaspec import SpeculativeEngine
    from adaspec.models import LoadedModel

    monkeypatch.setattr(LoadedModel, "keep_path",
                        lambda self, state, start, rows: self.truncate(state, start + len(rows)))
    differ = 0
    for seed in range(3):
        model = make_tiny_model(seed=seed, vocab=V, init_std=0.3, lm_head_scale=3.0)
        for prompt in (BRANCHY, _rand_prompt(seed)):
            res = SpeculativeEngine(model, ["prompt-lookup"], k=5, tree=True).generate(prompt, max_new_tokens=40)
            differ += res.token_ids != _ar(model, prompt, 40)
    assert differ > 0


def test_tree_option_errors():
    from adaspec import SpeculativeEngine

    model = make_tiny_model(seed=0, vocab=V)
    with pytest.raises(ConfigError, match="tree_nodes"):
        SpeculativeEngine(model, ["suffix"], tree=True, tree_nodes=0)


# -- sampling: exactly the target's distribution ----------------------------------------------
SV = 12  # vocabulary of the chi-square tests (as tests/test_distribution.py)
#: the 2-gram (10, 2) continues with 11, 5 and 7: prompt lookup's and suffix's trees branch at the root
SAMPLING_PROMPT = [10, 2, 11, 10, 2, 5, 3, 10, 2, 7, 10, 2, 11, 4, 10, 2]


@pytest.mark.parametrize("drafter", ["prompt-lookup", "suffix", "recycle:top=3", "auto-plain"])
def test_tree_sampling_matches_the_exact_distribution(drafter, monkeypatch):
    """One-hot trees under sampling: chi-square goodness of fit of the first two tokens at
    ALPHA = 0.001 (3000 fixed seeds), as in tests/test_distribution.py. ``auto-plain``: the
    trees of ``auto``'s plain steps (``Round._plain_tree``), over prompt lookup, suffix and
    ``none`` whose looks are made to find nothing (so every round is planned plain)."""
    from adaspec import SpeculativeEngine
    from adaspec.config import SamplingConfig
    from adaspec.drafters.base import Peek
    from adaspec.drafters.indexed import IndexedDrafter
    from test_distribution import ALPHA, exact_distribution, run_engine

    model = make_tiny_model(seed=0, vocab=SV, init_std=0.2, lm_head_scale=1.5)
    if drafter == "auto-plain":
        monkeypatch.setattr(IndexedDrafter, "peek", lambda self, ctx, k: self.catch_up(ctx) or Peek([]))
        eng = _flat_costs(SpeculativeEngine(model, ["prompt-lookup", "suffix", "none"], selector="auto",
                                            tree=True))
        plain = []
        orig_plain = Round._plain_tree
        monkeypatch.setattr(Round, "_plain_tree", lambda *a, **kw: plain.append(orig_plain(*a, **kw)) or plain[-1])
    else:
        eng = _flat_costs(SpeculativeEngine(model, [drafter], k=3, tree=True))
    tree_rounds = []
    orig = batch_mod.accept_tree

    def spy(*a, **kw):
        out = orig(*a, **kw)
        tree_rounds.append(out[0].n)
        return out

    monkeypatch.setattr(batch_mod, "accept_tree", spy)
    runs = run_engine(eng, SAMPLING_PROMPT, 2, temperature=1.0)
    exact = exact_distribution(model, SAMPLING_PROMPT, SamplingConfig(temperature=1.0), 2)
    assert len(tree_rounds) > 1000 and 0 < sum(n > 0 for n in tree_rounds) < len(tree_rounds)
    if drafter == "auto-plain":
        assert sum(t is not None and not t.is_chain for t in plain) > 1000
    assert runs.counts[exact == 0].sum() == 0
    stat, pvalue, cells = chisquare_gof(runs.counts, exact)
    assert pvalue > ALPHA, f"{drafter}: chi-square {stat:.1f} over {cells} cells, p = {pvalue:.2e}"


def test_negative_control_tree_sampling_bug_is_detected(monkeypatch):
    """BUG: after a descent the next draw uses the root's row again (wrong row for deeper
    nodes): the same chi-square test rejects."""
    import adaspec.round as engine_mod
    from adaspec import SpeculativeEngine
    from adaspec.config import SamplingConfig
    from test_distribution import ALPHA, exact_distribution, run_engine

    def wrong_rows(p, tree, generator):
        return verify_tree_sampling(p[:1].expand(p.shape[0], -1), tree, generator)

    monkeypatch.setattr(engine_mod, "verify_tree_sampling", wrong_rows)
    model = make_tiny_model(seed=0, vocab=SV, init_std=0.2, lm_head_scale=1.5)
    eng = _flat_costs(SpeculativeEngine(model, ["prompt-lookup"], k=3, tree=True))
    runs = run_engine(eng, SAMPLING_PROMPT, 2, temperature=1.0)
    exact = exact_distribution(model, SAMPLING_PROMPT, SamplingConfig(temperature=1.0), 2)
    assert chisquare_gof(runs.counts, exact)[1] < ALPHA


# -- SmolLM2 (slow) -----------------------------------------------------------------------------
SMOL_PROMPTS = [
    "Fix the spelling in this sentence and return it: 'The comittee will discus the budjet on "
    "tuesday and every departement must send there report.'",
    "Write a Python function that checks whether a number is prime, with a docstring.",
    "Repeat this list exactly, one item per line: apples, pears, plums, apples, pears, figs.",
]


@pytest.mark.slow
@pytest.mark.parametrize("drafters", [["suffix"], ["prompt-lookup"], None, ["early-exit:layers=8"]],
                         ids=["suffix", "pld", "auto", "early-exit"])
def test_smollm2_greedy_trees_equal_plain_decoding(drafters, stock_smollm2, stock_greedy):
    """SmolLM2-135M fp32: greedy output with trees equals plain decoding (Hugging Face
    ``generate`` on the stock modules, ``conftest.stock_smollm2``) token for token (a difference
    is allowed only at a numeric near-tie, checked against the stock model's full forward). The
    converted model comes from the user's cache through the suite's private one (``conftest``)."""
    from adaspec import SpeculativeEngine, load_model
    from adaspec.exactness import check_tie_aware

    torch.set_num_threads(real_model_threads())
    smol = load_model("smollm2", weights="dense")  # the fp32 model (the quantized target: tests/test_quant.py)
    ar = SpeculativeEngine(smol, [])
    eng = _flat_costs(SpeculativeEngine(smol, drafters, k=5, tree=True))
    tree_rounds = accepted = 0
    for p in SMOL_PROMPTS:
        ids = ar.encode_prompt(p)
        ref = stock_greedy(ids, 64, ar.eos_ids())
        res = eng.generate(ids, max_new_tokens=64)
        tree_rounds += sum(r.tree_nodes > 1 for r in res.stats.rounds)
        accepted += res.stats.accepted
        if res.token_ids != ref:
            assert check_tie_aware(stock_smollm2.model, ids, res.token_ids).ok, (drafters, p)
    assert tree_rounds > 0 and accepted > 0


def test_tree_rounds_keep_the_target_features_of_feature_drafters():
    """With a feature head in the pool, tree rounds append the accepted path's hidden states:
    the buffer equals a full forward's, and the output stays plain decoding's."""
    from adaspec import SpeculativeEngine
    from adaspec.drafters import FeatureHeadDrafter
    from adaspec.drafters.feature_head import FeatureHead

    model = make_tiny_model(seed=4, vocab=V, init_std=0.3, lm_head_scale=3.0)
    target = as_loaded(model)
    head = FeatureHeadDrafter(FeatureHead(target, torch.arange(V)), name="fresh-head")
    eng = SpeculativeEngine(target, ["suffix", head], selector="round-robin", k=4, tree=True)
    res = eng.generate(BRANCHY, max_new_tokens=40)
    assert res.token_ids == _ar(model, BRANCHY, 40)
    assert any(r.tree_nodes > 1 for r in res.stats.rounds)
    full = BRANCHY + res.token_ids
    with torch.no_grad():
        h = model.model(input_ids=torch.tensor([full[:-1]])).last_hidden_state[0]
    torch.testing.assert_close(head._features.rows(), h, atol=1e-5, rtol=1e-4)


# -- trees from model drafters (EAGLE-2 dynamic trees) ---------------------------------------------
def _tiny_lm(target, vocab_ids):
    """A fresh tiny-LM drafter (1 layer, copied from the target) over a draft vocabulary subset."""
    from adaspec.drafters.tiny_lm import TinyLMDrafter, init_tiny_lm
    from adaspec.models import LoadedModel

    return TinyLMDrafter(LoadedModel(init_tiny_lm(target, layers=1), None, "tiny"), target.vocab_size,
                         torch.tensor(vocab_ids), name="tiny-lm")


def _fresh_head(target, vocab=None):
    """An untrained feature head; ``vocab``: its draft vocabulary (default: the target's)."""
    from adaspec.drafters import FeatureHeadDrafter
    from adaspec.drafters.feature_head import FeatureHead

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(7)
        vocab = torch.arange(target.vocab_size) if vocab is None else vocab
        return FeatureHeadDrafter(FeatureHead(target, vocab), name="fresh-head")


def model_drafters(target, kinds=("self", "early-exit", "tiny-lm", "feature-head")):
    """One drafter of every model kind for ``target`` (a LoadedModel), by kind."""
    from adaspec.drafters import build_drafter

    out = {}
    for kind in kinds:
        if kind == "tiny-lm":
            out[kind] = _tiny_lm(target, list(range(0, target.vocab_size, 2)))  # q = 0 on odd ids
        elif kind == "feature-head":
            out[kind] = _fresh_head(target)
        elif kind == "feature-head-subset":  # a reduced draft vocabulary, not in token order
            out[kind] = _fresh_head(target, torch.randperm(target.vocab_size,
                                                           generator=torch.Generator().manual_seed(3))[:12])
        else:
            out[kind] = build_drafter({"early-exit": "early-exit:layers=1"}.get(kind, kind), target)
    return out


def _features(target, ids):
    from adaspec.drafters.feature_head import FeatureBuffer

    buf = FeatureBuffer(target.model.config.hidden_size)
    with torch.no_grad():
        buf.append(target.model.model(input_ids=torch.tensor([ids[:-1]])).last_hidden_state[0])
    return buf


@torch.inference_mode()
def chain_q(drafter, context, path):
    """Brute force: the drafter's softmax q after ``context + path[:j]`` for every j, each from a
    fresh causal forward (model drafters) or a fresh head chain from real features."""
    from adaspec.drafters import FeatureHeadDrafter
    from adaspec.drafters.feature_head import scatter_full

    if isinstance(drafter, FeatureHeadDrafter):
        d = _fresh_head(drafter.head.target)
        d.head = drafter.head
        d.begin_request(context)
        d.bind_features(drafter._features)
        last, pos, out = d._feed_real(context, len(context) - 1)[-1], len(context) - 1, []
        for tok in [None, *path]:
            if tok is not None:
                last = d._run(last[None], [tok], pos)[-1]
                pos += 1
            sub_q = d._tree_q(d.head.subset_logits(last).float(), None)  # over the draft vocabulary
            out.append(scatter_full(sub_q, d.head.vocab, d._vocab_width, 0.0))
        return out
    rows = []
    for j in range(len(path) + 1):
        ids = torch.tensor([list(context) + list(path[:j])])
        if hasattr(drafter, "_base"):  # tiny LM: its draft vocabulary only
            h = drafter._base(input_ids=ids).last_hidden_state[0, -1]
            logits = scatter_full((h @ drafter._w.T).float(), drafter.vocab, drafter._vocab, float("-inf"))
        else:
            logits = drafter.model(input_ids=ids).logits[0, -1].float()
        rows.append(torch.softmax(logits, -1))
    return rows


def _drafted_tree(drafter, target, context, depth=4, nodes=12):
    drafter.begin_request(context)
    if getattr(drafter, "uses_target_features", False):
        drafter.bind_features(_features(target, context))
    drafter.catch_up(context)
    return drafter.draft_tree(context, depth, nodes)


MODEL_KINDS = ["self", "early-exit", "tiny-lm", "feature-head"]


@pytest.mark.parametrize("kind", MODEL_KINDS + ["feature-head-subset"])
def test_model_drafter_tree_scores_equal_chain_forwards_of_each_path(target, kind):
    """Brute-force reference for the drafter's batched level forwards (tree mask, depth
    positions): every node's score is the product of the q's of chain forwards along its path,
    its token is among the top tokens of its parent's q, and nodes are best-first (a head
    with a reduced vocabulary ranks its own columns: their token ids come from the subset)."""
    d = model_drafters(target, [kind])[kind]
    tree = _drafted_tree(d, target, PREFIX, depth=4, nodes=40)
    assert len(tree) > 16 and max(tree.depths) >= 3 and not tree.is_chain
    assert tree.scores == sorted(tree.scores, reverse=True)
    for i in range(len(tree)):
        path = [tree.tokens[j] for j in tree.path(i)]
        qs = chain_q(d, PREFIX, path)
        want = float(np.prod([float(q[t]) for q, t in zip(qs, path)]))
        assert tree.scores[i] == pytest.approx(want, rel=1e-4, abs=1e-7), (kind, i, path)
        parent_q = qs[len(path) - 1]
        assert float(parent_q[path[-1]]) >= float(torch.topk(parent_q, d.tree_branch).values[-1]) - 1e-6


def test_negative_control_drafter_levels_with_chain_positions_fail(target, monkeypatch):
    """BUG: tree nodes fed to the drafter at consecutive (chain) positions: the scores of nodes
    below depth 1 no longer equal the brute force."""
    from adaspec.drafters.model import ModelDrafter

    orig = ModelDrafter._forward_level
    monkeypatch.setattr(ModelDrafter, "_forward_level", lambda self, toks, pos, mask: orig(
        self, toks, [pos[0] + r for r in range(len(toks))], mask))
    d = model_drafters(target, ["self"])["self"]
    tree = _drafted_tree(d, target, PREFIX)
    bad = 0
    for i in range(len(tree)):
        path = [tree.tokens[j] for j in tree.path(i)]
        want = float(np.prod([float(q[t]) for q, t in zip(chain_q(d, PREFIX, path), path)]))
        bad += tree.scores[i] != pytest.approx(want, rel=1e-4, abs=1e-7)
    assert bad > 0


@pytest.mark.parametrize("kind", ["self", "early-exit", "tiny-lm"])
def test_drafter_kv_after_a_tree_round_equals_a_cache_of_the_accepted_tokens(target, kind):
    """After a tree round the drafter's catch-up keeps the accepted path's KV (gathered from
    the tree's slots) and feeds the rest: its cache equals one built from the accepted tokens,
    for paths through non-contiguous slots, a partly accepted path and a rejected root."""
    d = model_drafters(target, [kind])[kind]
    probe = _drafted_tree(d, target, PREFIX)
    deepest = max(range(len(probe)), key=lambda i: (probe.depths[i], -i))
    cases = [probe.path(deepest), probe.path(deepest)[:1], probe.path(len(probe) - 1), []]
    for path in cases:
        tree = _drafted_tree(d, target, PREFIX)
        assert tree == probe
        bonus = (max(tree.tokens) + 1) % V  # not a child of the path's end, or any token
        accepted = PREFIX + [tree.tokens[j] for j in path] + [bonus]
        d.catch_up(accepted)
        ref = d.lm.new_state()
        d.lm.forward(ref, accepted[:-1], keep=1)
        assert d.lm.state_length(d._cache) == len(accepted) - 1 == len(d._fed)
        for a, b in zip(d._cache.layers, ref.layers):
            torch.testing.assert_close(a.keys, b.keys, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(a.values, b.values, atol=1e-5, rtol=1e-5)


def test_negative_control_drafter_kv_without_gather_is_wrong(target, monkeypatch):
    """BUG: the drafter crops its tree entries without gathering: the cache check fails."""
    from adaspec.models import LoadedModel

    monkeypatch.setattr(LoadedModel, "keep_path",
                        lambda self, state, start, rows: self.truncate(state, start + len(rows)))
    d = model_drafters(target, ["self"])["self"]
    tree = _drafted_tree(d, target, PREFIX)
    path = tree.path(max(range(len(tree)), key=lambda i: tree.depths[i]))
    accepted = PREFIX + [tree.tokens[j] for j in path] + [0]
    d.catch_up(accepted)
    ref = d.lm.new_state()
    d.lm.forward(ref, accepted[:-1], keep=1)
    assert not all(torch.allclose(a.keys, b.keys, atol=1e-3) for a, b in zip(d._cache.layers, ref.layers))


def _engine_drafters(model, kinds):
    loaded = as_loaded(model)
    return loaded, list(model_drafters(loaded, kinds).values())


@pytest.mark.parametrize("init_std", [0.02, 0.3])
def test_greedy_model_drafter_trees_are_identical_to_plain_decoding(init_std):
    from adaspec import SpeculativeEngine

    for seed in range(2):
        model = make_tiny_model(seed=seed, vocab=V, init_std=init_std, lm_head_scale=3.0)
        for prompt in (BRANCHY, _rand_prompt(seed)):
            ar = _ar(model, prompt, 40)
            for kind in MODEL_KINDS:
                loaded, drafters = _engine_drafters(model, [kind])
                res = SpeculativeEngine(loaded, drafters, k=5, tree=True).generate(prompt, max_new_tokens=40)
                assert res.token_ids == ar, (seed, init_std, kind)
                assert sum(r.tree_nodes > 1 for r in res.stats.rounds) >= 3, kind
            loaded, drafters = _engine_drafters(model, MODEL_KINDS)  # auto over all of them
            res = SpeculativeEngine(loaded, drafters + ["suffix"], tree=True).generate(prompt, max_new_tokens=40)
            assert res.token_ids == ar, (seed, init_std, "auto")


@pytest.mark.parametrize("kind", MODEL_KINDS)
def test_a_model_drafter_tree_of_one_chain_is_the_chain_path(monkeypatch, kind):
    """Greedy: with one child per node the tree is the drafter's argmax chain, drafted and
    verified as the chain (same tokens, same drafted and accepted counts every round, so the
    drafter's state after tree rounds is the chain path's). Under sampling a model drafter's
    chain samples from q, so only greedy chains coincide."""
    from adaspec import SpeculativeEngine

    model = make_tiny_model(seed=0, vocab=V, init_std=0.3, lm_head_scale=3.0)
    runs = []
    for tree in (False, True):
        loaded, drafters = _engine_drafters(model, [kind])
        monkeypatch.setattr(drafters[0], "tree_branch", 1, raising=False)
        res = SpeculativeEngine(loaded, drafters, k=4, tree=tree).generate(BRANCHY, max_new_tokens=30)
        runs.append((res.token_ids, [(r.drafted, r.accepted) for r in res.stats.rounds]))
    assert runs[0] == runs[1]
    assert any(a for _, a in runs[0][1])
    assert kind == "self" or any(a < d for d, a in runs[0][1])  # the target's own drafts always pass


V3 = 8
PROMPT3 = [3, 7, 1, 1, 4]


@pytest.mark.parametrize("kind", ["model", "early-exit", "feature-head"])
def test_model_drafter_tree_sampling_matches_the_exact_distribution(kind, monkeypatch):
    """Model drafter trees under sampling (children = top tokens of q, one-hot rule): 3 tokens,
    so the first round drafts a 2-deep tree (a drafter level forward runs) and later rounds
    catch the drafter up on gathered KV; chi-square over all 8**3 triples at ALPHA = 0.001
    (3000 fixed seeds, sparse cells merged), as tests/test_distribution.py."""
    from adaspec import SpeculativeEngine
    from adaspec.config import SamplingConfig
    from adaspec.drafters import ModelDrafter
    from test_distribution import ALPHA, exact_distribution, run_engine

    model = make_tiny_model(seed=0, vocab=V3, init_std=0.2)
    loaded = as_loaded(model)
    if kind == "model":
        drafter = ModelDrafter(as_loaded(make_tiny_model(seed=123, vocab=V3, init_std=0.2, lm_head_scale=2.0)), V3)
    else:
        drafter = model_drafters(loaded, [kind])[kind]
    drafter.tree_branch = 2  # 2 of 8 tokens per node: rejections at every depth
    eng = _flat_costs(SpeculativeEngine(loaded, [drafter], k=3, tree=True))
    nodes = []
    orig = batch_mod.accept_tree
    monkeypatch.setattr(batch_mod, "accept_tree", lambda *a, **kw: (nodes.append(len(a[1].tree)), orig(*a, **kw))[1])
    runs = run_engine(eng, PROMPT3, 3, seed0=50_000, temperature=1.0)
    exact = exact_distribution(model, PROMPT3, SamplingConfig(temperature=1.0), 3)
    assert max(nodes) >= 3 and 0 < runs.accepted < runs.drafted
    assert runs.counts[exact == 0].sum() == 0
    stat, pvalue, cells = chisquare_gof(runs.counts, exact)
    assert pvalue > ALPHA, f"{kind}: chi-square {stat:.1f} over {cells} cells, p = {pvalue:.2e}"
    stat, pvalue, _ = chisquare_gof(runs.counts.sum(-1), exact.sum(-1))
    assert pvalue > ALPHA, f"{kind} first-two marginal: chi-square {stat:.1f}, p = {pvalue:.2e}"


def test_bench_runs_model_drafters_with_trees_side_by_side():
    """``adaspec bench --tree``: every configuration with a tree-capable drafter (model drafters
    included) gets its ``+tree`` twin right after it."""
    from adaspec.bench.runner import default_configs

    names = [c.name for c in default_configs(["early-exit:layers=8", "self", "suffix"], [5], ["auto"], tree=True)]
    for chain in ("early-exit:layers=8 k=5", "self k=5", "suffix k=5"):
        assert names[names.index(chain) + 1] == f"{chain} +tree"
    assert any(n.startswith("auto over") and n.endswith("+tree") for n in names)
