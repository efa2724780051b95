"""Drafter building blocks: n-gram index, prompt lookup, suffix matching, datastore, specs."""

from __future__ import annotations

import json
import random

import pytest
import torch
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

from conftest import make_tiny_model, word_tokenizer

from adaspec import SpeculativeEngine
from adaspec.config import SamplingConfig
from adaspec.drafters import (DRAFTER_NAMES, Decision, ModelDrafter, NoDrafter, PromptLookupDrafter,
                              SuffixDatastore, SuffixDrafter, build_drafter, check_same_vocabulary)
from adaspec.drafters.index import NgramIndex
from adaspec.errors import (AdaspecError, ConfigError, UnknownNameError,
                            VocabularyMismatchError)
from adaspec.models import LoadedModel, as_loaded

VOCAB = 32
GREEDY = SamplingConfig()


def _tiny_model(seed: int = 0, vocab: int = VOCAB, max_pos: int = 512) -> LlamaForCausalLM:
    """A tiny randomly initialised Llama (deterministic for a given seed)."""
    return make_tiny_model(seed, vocab, max_positions=max_pos)


def _word_tokenizer(words: list[str]) -> PreTrainedTokenizerFast:
    return word_tokenizer(words)


@pytest.fixture(scope="module")
def target() -> LoadedModel:
    return as_loaded(_tiny_model(0))


def _fresh_index(sizes, tokens) -> NgramIndex:
    idx = NgramIndex(sizes)
    idx.extend(tokens)
    return idx


def _same(a: NgramIndex, b: NgramIndex) -> None:
    assert a.tokens == b.tokens
    assert a.maps == b.maps


# -- NgramIndex ---------------------------------------------------------------------------------
def test_index_maps_positions_of_continuations():
    idx = _fresh_index([1, 2], [4, 5, 4, 5, 6])
    assert idx.sizes == (2, 1)
    assert idx.continuations((4,)) == [1, 3]  # oldest first
    assert idx.continuations((4, 5)) == [2, 4]
    assert idx.continuations((6,)) == []  # continuation unknown: not indexed
    assert idx.continuations((5, 6)) == []
    assert len(idx) == 5


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("sizes", [(1,), (1, 2, 3), (2, 4)])
def test_index_truncate_equals_fresh_build(seed, sizes):
    rng = random.Random(seed)
    seq = [rng.randrange(4) for _ in range(60)]  # small alphabet: many repeated n-grams
    idx = _fresh_index(sizes, seq)
    for cut in sorted({rng.randrange(61) for _ in range(8)} | {0, 60}, reverse=True):
        idx.truncate(cut)
        _same(idx, _fresh_index(sizes, seq[:cut]))
    idx.extend(seq)
    _same(idx, _fresh_index(sizes, seq))


@pytest.mark.parametrize("seed", range(5))
def test_index_sync_round_trips(seed):
    rng = random.Random(100 + seed)
    sizes = (1, 2, 3)
    a = [rng.randrange(5) for _ in range(40)]
    idx = _fresh_index(sizes, a)
    trusted = len(a)
    for _ in range(10):
        cut = rng.randrange(len(a) + 1)
        b = a[:cut] + [rng.randrange(5) for _ in range(rng.randrange(15))]
        common = 0
        while common < min(len(a), len(b)) and a[common] == b[common]:
            common += 1
        trusted = idx.sync(b, min(trusted, common))
        assert trusted == len(b)
        _same(idx, _fresh_index(sizes, b))
        a = b


def test_index_sync_without_trust_and_clear():
    idx = _fresh_index([1, 2], [1, 2, 3, 4])
    assert idx.sync([1, 2, 9], 0) == 3
    _same(idx, _fresh_index([1, 2], [1, 2, 9]))
    assert idx.sync([1, 2, 9, 4, 4], 3) == 5
    _same(idx, _fresh_index([1, 2], [1, 2, 9, 4, 4]))
    idx.clear()
    _same(idx, NgramIndex([1, 2]))


@pytest.mark.parametrize("sizes", [[], [0], [0, 2]])
def test_index_rejects_bad_sizes(sizes):
    with pytest.raises(ValueError):
        NgramIndex(sizes)


# -- helpers for model-free drafters ------------------------------------------------------------
def _propose(drafter, context):
    drafter.begin_request(context)
    drafter.catch_up(context)
    return drafter.propose()


def _draft(drafter, context, n, decide=lambda step: Decision.CONTINUE):
    drafter.begin_request(context)
    return drafter.draft(context, n, GREEDY, None, decide).tokens


# -- prompt lookup ------------------------------------------------------------------------------
def test_prompt_lookup_takes_most_recent_match_and_continues_it():
    ctx = [1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3]
    assert _propose(PromptLookupDrafter(), ctx) == 7  # not 9: the most recent occurrence wins
    assert _draft(PromptLookupDrafter(), ctx, 3) == [7, 5, 1]


def test_prompt_lookup_prefers_longest_ngram():
    ctx = [4, 5, 6, 8, 9, 6, 2, 4, 5, 6]
    assert _propose(PromptLookupDrafter(max_ngram=3), ctx) == 8  # (4, 5, 6) -> 8
    assert _propose(PromptLookupDrafter(max_ngram=2), ctx) == 8  # (5, 6) -> 8
    assert _propose(PromptLookupDrafter(max_ngram=1), ctx) == 2  # (6,) most recently -> 2


def test_prompt_lookup_without_match_proposes_nothing():
    assert _propose(PromptLookupDrafter(), [1, 2, 3, 4]) is None
    assert _draft(PromptLookupDrafter(), [1, 2, 3, 4], 5) == []
    assert _propose(PromptLookupDrafter(), []) is None
    # min_ngram=2: the unigram (1,) matches but is too short
    assert _propose(PromptLookupDrafter(max_ngram=3, min_ngram=2), [1, 2, 1]) is None
    assert _propose(PromptLookupDrafter(max_ngram=3, min_ngram=1), [1, 2, 1]) == 2


def test_prompt_lookup_draft_respects_decisions():
    ctx = [1, 2, 3, 4, 5, 1, 2]
    assert _draft(PromptLookupDrafter(), ctx, 10)[:3] == [3, 4, 5]
    stop_at_2 = lambda step: Decision.STOP if step.index == 1 else Decision.CONTINUE  # noqa: E731
    assert _draft(PromptLookupDrafter(), ctx, 10, stop_at_2) == [3, 4]
    discard_2 = lambda step: Decision.DISCARD if step.index == 2 else Decision.CONTINUE  # noqa: E731
    assert _draft(PromptLookupDrafter(), ctx, 10, discard_2) == [3, 4]
    seen = []

    def record(step):
        seen.append((step.index, step.token, step.probs))
        return Decision.CONTINUE

    assert _draft(PromptLookupDrafter(), ctx, 2, record) == [3, 4]
    assert seen == [(0, 3, None), (1, 4, None)]


def test_prompt_lookup_rolls_back_rejected_drafts():
    d = PromptLookupDrafter()
    ctx = [1, 2, 3, 4, 5, 1, 2]
    d.begin_request(ctx)
    assert d.draft(ctx, 3, GREEDY, None, lambda s: Decision.CONTINUE).tokens == [3, 4, 5]
    # the target accepted only the first draft and corrected the second
    new_ctx = ctx + [3, 9]
    d.catch_up(new_ctx)
    _same(d._index, _fresh_index(range(1, 4), new_ctx))
    assert d.propose() == _propose(PromptLookupDrafter(), new_ctx)


def test_prompt_lookup_score_is_teacher_forced_proposals():
    ctx = [1, 2, 3, 4, 5, 1, 2]
    verified = [3, 4, 9, 1, 2]
    d = PromptLookupDrafter()
    d.begin_request(ctx)
    props = d.score(ctx, verified, GREEDY)
    assert props.probs is None
    expect = [_propose(PromptLookupDrafter(), ctx + verified[:m]) for m in range(len(verified))]
    assert props.tokens == [-1 if p is None else p for p in expect]
    assert props.tokens[:2] == [3, 4]
    _same(d._index, _fresh_index(range(1, 4), ctx + verified))


@pytest.mark.parametrize("lo,hi", [(0, 3), (3, 2), (-1, 1)])
def test_prompt_lookup_bad_ngram_range(lo, hi):
    with pytest.raises(ConfigError, match="min_ngram <= max_ngram"):
        PromptLookupDrafter(max_ngram=hi, min_ngram=lo)


def test_no_drafter_proposes_nothing():
    d = NoDrafter()
    d.begin_request([1, 2])
    assert d.draft([1, 2], 5, GREEDY, None, lambda s: Decision.CONTINUE).tokens == []
    assert d.score([1, 2], [3, 4, 5], GREEDY).tokens == [-1, -1, -1]


# -- suffix drafter -----------------------------------------------------------------------------
def test_suffix_prefers_longest_match_over_most_recent():
    ctx = [1, 7, 8, 3, 9, 7, 8, 4, 1, 7, 8]
    # (7, 8) is followed by 3 (after 1, 7, 8: a 3-token match) and, more recently, by 4
    assert _propose(SuffixDrafter(min_match=2), ctx) == 3
    assert _propose(PromptLookupDrafter(max_ngram=2), ctx) == 4
    assert _propose(PromptLookupDrafter(max_ngram=3), ctx) == 3


def test_suffix_picks_most_frequent_among_equally_long_matches():
    ctx = [5, 7, 8, 1, 6, 7, 8, 1, 2, 7, 8, 3, 9, 7, 8]
    assert _propose(SuffixDrafter(min_match=2), ctx) == 1  # 1 twice, 3 once (but most recent)
    tie = [5, 7, 8, 1, 2, 7, 8, 3, 9, 7, 8]
    assert _propose(SuffixDrafter(min_match=2), tie) == 3  # tie: most recent


def test_suffix_min_match_and_max_candidates():
    ctx = [1, 7, 8, 3, 9, 7, 8, 4, 1, 7, 8]
    assert _propose(SuffixDrafter(min_match=3), ctx) == 3
    assert _propose(SuffixDrafter(min_match=3), [2, 7, 8, 3, 9, 7, 8]) is None
    assert _propose(SuffixDrafter(min_match=2), [1, 2]) is None
    assert _propose(SuffixDrafter(min_match=2), [1]) is None
    # only the most recent candidate is examined: the longer, older match is not seen
    assert _propose(SuffixDrafter(min_match=2, max_candidates=1), ctx) == 4


def test_suffix_uses_datastore_longest_match_and_ties_prefer_context():
    store = SuffixDatastore(min_match=2)
    store.add([9, 7, 8, 4, 0])
    d = SuffixDrafter(min_match=2, datastore=store)
    # context match (7, 8) -> 3 has length 2; the datastore matches (9, 7, 8) -> 4
    assert _propose(d, [6, 7, 8, 3, 9, 7, 8]) == 4
    # equally long matches in context and datastore: the context wins the tie
    assert _propose(d, [6, 7, 8, 3, 5, 7, 8]) == 3
    # nothing in the context: the datastore alone
    assert _propose(d, [2, 9, 7, 8]) == 4
    # a document boundary never continues a match
    assert _propose(d, [4, 0]) is None


def _reference_proposal(d: SuffixDrafter) -> int | None:
    """The definition ``propose`` implements: the most frequent continuation among the longest
    of ``_found``'s matches, ties to the first listed."""
    found = d._found()
    if not found:
        return None
    best = max(ln for ln, _ in found)
    return SuffixDrafter._top([t for ln, t in found if ln == best])


@pytest.mark.parametrize("seed", range(4))
def test_suffix_fast_proposal_equals_the_definition(seed):
    """``propose`` reads the datastore's cached hits and extends only those with the
    context's token before the key: on random text over a small vocabulary (many ties, long
    and short matches, document ends, few candidates kept), it proposes what the plain scan
    of every match does, at every position, and after the datastore changes."""
    rng = random.Random(seed)
    store = SuffixDatastore(min_match=2)
    for _ in range(20):
        store.add([rng.randrange(6) for _ in range(rng.randrange(3, 40))])
    for d in (SuffixDrafter(min_match=2, datastore=store), SuffixDrafter(min_match=2, max_match=4, datastore=store),
              SuffixDrafter(min_match=2, max_candidates=5, datastore=store), SuffixDrafter(min_match=2)):
        for _ in range(2):
            ctx = [rng.randrange(6) for _ in range(120)]
            d.begin_request(ctx[:1])
            for n in range(1, len(ctx)):
                d.catch_up(ctx[:n])
                assert d.propose() == _reference_proposal(d), (n, d.describe())
            store.add(ctx[:30])  # the cache starts over


def _indexed_reference_peek(d, ctx: list[int], depth: int) -> list[int]:
    """A look as drafting does it: each proposal appended to the index before the next."""
    d.catch_up(ctx)
    out = []
    for _ in range(depth):
        tok = d.propose()
        if tok is None:
            break
        out.append(tok)
        d._index.append(tok)
    return out


@pytest.mark.parametrize("seed", range(3))
def test_peek_equals_indexed_proposals_and_leaves_the_index_as_the_context(seed):
    """``peek`` keeps its tokens off the index (``NgramIndex.base``): at every position of
    random text over a small vocabulary (matches inside the look itself, ties, a datastore),
    its block equals proposing token by token with each token indexed, and the index it
    leaves is the one built from the context alone."""
    rng = random.Random(seed)
    store = SuffixDatastore(min_match=2)
    for _ in range(10):
        store.add([rng.randrange(3) for _ in range(rng.randrange(3, 40))])
    makers = [lambda: PromptLookupDrafter(), lambda: PromptLookupDrafter(max_ngram=4, min_ngram=2),
              lambda: SuffixDrafter(min_match=2), lambda: SuffixDrafter(min_match=2, max_match=4),
              lambda: SuffixDrafter(min_match=2, datastore=store),
              # few candidates: the look's own hits push older ones out of the window
              lambda: SuffixDrafter(min_match=2, max_candidates=3), lambda: SuffixDrafter(min_match=1, max_candidates=2)]
    for make in makers:
        d, ref = make(), make()
        ctx = [rng.randrange(3) for _ in range(90)]
        d.begin_request(ctx[:1])
        looked = 0
        for n in range(1, len(ctx)):
            ref.begin_request(ctx[:1])
            got = d.peek(ctx[:n], 6).tokens
            assert got == _indexed_reference_peek(ref, ctx[:n], 6), (n, d.describe())
            fresh = NgramIndex(d._index.sizes)
            fresh.extend(ctx[:n])
            _same(d._index, fresh)
            looked += len(got) > 1
        assert looked > 20  # the looks went on past their first token


def _indexed_reference_tree(d, ctx: list[int], depth: int, nodes: int):
    """``IndexedDrafter.draft_tree`` as it was before its looks: each expanded path added to
    the index (``extend``) and rolled back (``truncate``)."""
    import heapq
    import itertools

    from adaspec.drafters.indexed import TREE_BRANCH
    from adaspec.trees import DraftTree

    d.catch_up(ctx)
    index, base = d._index, len(d._index)
    tokens, parents, scores, heap, order, offered = [], [], [], [], itertools.count(), {}
    est = d.request_calibration.estimate

    def expand(node, score, path):
        index.truncate(base)
        index.extend(path)
        offered[path] = cands = d.candidate_keys()[:TREE_BRANCH]
        for tok, key in cands:
            heapq.heappush(heap, (-score * est(key), next(order), node, tok, path))

    expand(-1, 1.0, ())
    while heap and len(tokens) < nodes:
        neg, _, parent, tok, path = heapq.heappop(heap)
        tokens.append(tok)
        parents.append(parent)
        scores.append(-neg)
        if len(path) + 1 < depth:
            expand(len(tokens) - 1, -neg, (*path, tok))
    index.truncate(base)
    return DraftTree(tokens, parents, scores), offered


@pytest.mark.parametrize("seed", range(3))
def test_draft_tree_equals_indexed_expansion_and_leaves_the_index_as_the_context(seed):
    """``draft_tree`` reads each expanded path as a look (never indexed): at every position of
    random text over a small vocabulary (branching matches, matches inside a path, unseen
    tokens whose candidates are the most frequent ones, a datastore, a shared index), its tree
    and its offered candidates equal those of indexing every path, and the index it leaves is
    the one built from the context alone."""
    from adaspec.drafters.indexed import share_indexes

    rng = random.Random(seed)
    store = SuffixDatastore(min_match=2)  # with tokens the requests never hold (7, 8): paths
    for _ in range(10):                   # through them end in the frequency level
        store.add([rng.randrange(9) for _ in range(rng.randrange(3, 40))])
    makers = [lambda: [PromptLookupDrafter()], lambda: [PromptLookupDrafter(max_ngram=4, min_ngram=2)],
              lambda: [SuffixDrafter(min_match=2)], lambda: [SuffixDrafter(min_match=1, max_candidates=3)],
              lambda: [SuffixDrafter(min_match=2, datastore=store)],
              lambda: [PromptLookupDrafter(), SuffixDrafter(min_match=2, datastore=store)]]  # one index
    for make in makers:
        ds, refs = make(), make()
        share_indexes(ds)
        share_indexes(refs)
        vocab = 4 + rng.randrange(3)  # 5 and 6: tokens unseen so far, frequency candidates
        ctx = [rng.randrange(vocab) for _ in range(70)]
        for d in ds:
            d.begin_request(ctx[:1])
        branched = 0
        for n in range(1, len(ctx)):
            for d, ref in zip(ds, refs):
                ref.begin_request(ctx[:1])
                ref.request_calibration = d.request_calibration  # the same estimates
                depth, nodes = 1 + n % 5, 1 + n % 15
                got = d.draft_tree(ctx[:n], depth, nodes)
                want, offered = _indexed_reference_tree(ref, ctx[:n], depth, nodes)
                assert (got.tokens, got.parents, got.scores) == (want.tokens, want.parents, want.scores), (
                    n, d.describe())
                assert d._offered == (n, offered)
                fresh = NgramIndex(d._index.sizes)
                fresh.extend(ctx[:n])
                _same(d._index, fresh)
                d._offered = None  # not settled: the estimates stay those of both
                branched += len(set(got.parents)) < len(got.parents)
        assert branched > 20  # trees, not chains


def test_suffix_bad_parameters():
    with pytest.raises(AdaspecError, match="min_match <= max_match"):
        SuffixDrafter(min_match=3, max_match=2)
    with pytest.raises(AdaspecError, match="min_match"):
        SuffixDrafter(min_match=3, datastore=SuffixDatastore(min_match=2))


# -- datastore ----------------------------------------------------------------------------------
def test_datastore_save_load_round_trip(tmp_path):
    store = SuffixDatastore(min_match=2, max_tokens=500)
    docs = [[1, 2, 3, 4], [5, 6, 7], [1, 2, 9, 9, 9]]
    for doc in docs:
        store.add(doc)
    store.add([3, 3])  # too short to continue any match: ignored
    assert store.docs == docs
    assert len(store) == sum(map(len, docs))
    path = tmp_path / "store.jsonl"
    store.save(path)
    header = json.loads(path.read_text().splitlines()[0])
    assert header["max_tokens"] == 500
    loaded = SuffixDatastore.load(path)
    assert loaded.docs == store.docs
    assert loaded.max_tokens == 500
    assert len(loaded) == len(store)
    _same(loaded.index, store.index)
    assert SuffixDatastore.load(path, max_tokens=1000).max_tokens == 1000


def test_datastore_paths_expand_the_home_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    store = SuffixDatastore()
    store.add([1, 2, 3, 4])
    store.save(tmp_path / "store.jsonl")
    assert SuffixDatastore.load("~/store.jsonl").docs == [[1, 2, 3, 4]]


def test_datastore_load_errors(tmp_path):
    with pytest.raises(AdaspecError, match="not found"):
        SuffixDatastore.load(tmp_path / "missing.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text("[1, 2, 3]\n{\"not\": \"a list\"}\n")
    with pytest.raises(AdaspecError, match=r"bad.jsonl:2: expected a JSON list"):
        SuffixDatastore.load(bad)
    plain = tmp_path / "plain.jsonl"  # no header line is fine
    plain.write_text("[1, 2, 3]\n\n[4, 5, 6]\n")
    assert SuffixDatastore.load(plain).docs == [[1, 2, 3], [4, 5, 6]]


def test_datastore_bounded_size_evicts_oldest():
    store = SuffixDatastore(min_match=2, max_tokens=20)
    docs = [[i, i + 1, i + 2, i + 3, i, i + 1, i + 2, i + 3] for i in range(0, 30, 5)]  # 8 tokens each
    for doc in docs:
        store.add(doc)
        assert len(store) <= store.max_tokens
        assert len(store) == sum(map(len, store.docs))
    assert store.evicted_tokens == sum(map(len, docs)) - len(store) > 0
    assert store.docs == docs[len(docs) - len(store.docs):]  # oldest went first
    fresh = SuffixDatastore(min_match=2, max_tokens=20)
    for doc in store.docs:
        fresh.add(doc)
    _same(store.index, fresh.index)


def test_datastore_keeps_newest_document_that_fits():
    store = SuffixDatastore(min_match=2, max_tokens=10)
    store.add([1, 2, 3, 4, 5])
    store.add([6, 7, 8, 9, 10, 11, 12, 13])  # 8 <= max_tokens: should replace the older one
    assert store.docs == [[6, 7, 8, 9, 10, 11, 12, 13]]


def test_datastore_rejects_too_large_document_and_bad_bound():
    store = SuffixDatastore(min_match=2, max_tokens=10)
    with pytest.raises(AdaspecError, match="raise max_tokens or split"):
        store.add(list(range(11)))
    assert store.docs == [] and len(store) == 0
    store.add(list(range(10)))  # exactly the bound fits
    assert len(store) == 10
    with pytest.raises(AdaspecError, match="max_tokens must be >= 1"):
        SuffixDatastore(max_tokens=0)


def test_suffix_learn_adds_outputs_via_end_request():
    store = SuffixDatastore(min_match=2)
    d = SuffixDrafter(min_match=2, datastore=store, learn=True)
    d.end_request([1, 2, 3, 4])
    assert store.docs == [[1, 2, 3, 4]]
    d_off = SuffixDrafter(min_match=2, datastore=store, learn=False)
    d_off.end_request([5, 6, 7])
    assert store.docs == [[1, 2, 3, 4]]
    # a later request benefits from what was learned
    assert _propose(d, [9, 2, 3]) == 4


def test_suffix_learn_keeps_the_tail_of_an_answer_longer_than_the_store():
    """A learning store never fails the request that ends: an answer longer than the whole store
    keeps its last ``max_tokens`` tokens (a plain ``add`` of it is an error)."""
    store = SuffixDatastore(min_match=2, max_tokens=4)
    d = SuffixDrafter(min_match=2, datastore=store, learn=True)
    d.end_request([1, 2, 3, 4, 5, 6])
    assert store.docs == [[3, 4, 5, 6]]
    with pytest.raises(AdaspecError, match="does not fit a datastore of max_tokens=4"):
        store.add([1, 2, 3, 4, 5, 6])


def test_suffix_learn_through_the_engine(target):
    engine = SpeculativeEngine(target, ["suffix:learn=true"], k=3)
    drafter = engine.drafters[0]
    assert isinstance(drafter, SuffixDrafter) and drafter.learn
    assert len(drafter.datastore) == 0
    r1 = engine.generate([1, 2, 3, 4, 5], max_new_tokens=12)
    assert drafter.datastore.docs == [r1.token_ids]
    r2 = engine.generate([9, 8, 7], max_new_tokens=10)
    assert drafter.datastore.docs == [r1.token_ids, r2.token_ids]


def test_suffix_corpus_and_datastore_specs(tmp_path, target):
    words = [f"w{i:02d}" for i in range(VOCAB)]
    tok = _word_tokenizer(words)
    tgt = LoadedModel(model=target.model, tokenizer=tok, name="tiny")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("w01 w02 w03 w04\n\nw05 w06 w07\n\n\n")
    d = build_drafter(f"suffix:corpus={corpus}", tgt)
    assert d.datastore.docs == [[1, 2, 3, 4], [5, 6, 7]]
    path = tmp_path / "ds.jsonl"
    d.datastore.save(path)
    d2 = build_drafter(f"suffix:datastore={path},min_match=2,max_tokens=100", tgt)
    assert d2.datastore.docs == d.datastore.docs and d2.datastore.max_tokens == 100
    # named after their data, so a pool's datastores are told apart in reports; one family
    assert (d.name, d2.name, build_drafter("suffix", tgt).name) == ("suffix:corpus", "suffix:ds", "suffix")
    assert d.family == d2.family == "suffix"
    with pytest.raises(AdaspecError, match="not both"):
        build_drafter(f"suffix:datastore={path},corpus={corpus}", tgt)
    with pytest.raises(AdaspecError, match="tokenizer"):
        build_drafter(f"suffix:corpus={corpus}", target)  # the target has no tokenizer


# -- spec parsing -------------------------------------------------------------------------------
def test_build_drafter_specs(target):
    d = build_drafter("prompt-lookup:max_ngram=4,min_ngram=2", target)
    assert isinstance(d, PromptLookupDrafter) and (d.min_ngram, d.max_ngram) == (2, 4)
    d = build_drafter("  PLD:max-ngram = 5 , min-ngram=2", target)
    assert isinstance(d, PromptLookupDrafter) and (d.min_ngram, d.max_ngram) == (2, 5)
    d = build_drafter("suffix:min_match=3,max_match=9,max_candidates=4", target)
    assert isinstance(d, SuffixDrafter)
    assert (d.min_match, d.max_match, d.max_candidates, d.datastore) == (3, 9, 4, None)
    assert isinstance(build_drafter("none", target), NoDrafter)
    s = build_drafter("self", target)
    assert isinstance(s, ModelDrafter) and s.name == "self" and s.model is target.model
    inst = PromptLookupDrafter()
    assert build_drafter(inst, target) is inst


@pytest.mark.parametrize("spec", ["foo", "lookup", "model-x", "ngram:n=3"])
def test_build_drafter_unknown_name_lists_valid_names(target, spec):
    with pytest.raises(UnknownNameError) as info:
        build_drafter(spec, target)
    for name in DRAFTER_NAMES:
        assert name in str(info.value)


@pytest.mark.parametrize("spec", ["", "   "])
def test_build_drafter_empty_spec(target, spec):
    with pytest.raises(UnknownNameError, match="prompt-lookup"):
        build_drafter(spec, target)


@pytest.mark.parametrize("spec,match", [
    ("prompt-lookup:foo=1", r"unknown parameter.*foo.*allowed: max_ngram, min_ngram"),
    ("suffix:bogus=2", r"unknown parameter.*bogus"),
    ("self:k=2", r"unknown parameter"),
    ("none:x=1", r"unknown parameter"),
    ("prompt-lookup:max_ngram", r"write key=value"),
    ("prompt-lookup:max_ngram=abc", r"max_ngram='abc' is not a valid int"),
    ("suffix:learn=maybe", r"learn='maybe'"),
    ("model:", r"model drafter needs a model.*model:HF_ID"),
    ("MODEL:", r"model drafter needs a model"),
])
def test_build_drafter_bad_specs(target, spec, match):
    with pytest.raises(AdaspecError, match=match):
        build_drafter(spec, target)


def test_build_drafter_model_from_directory(tmp_path, target):
    _tiny_model(seed=3).save_pretrained(tmp_path / "same")
    _tiny_model(seed=3, vocab=48).save_pretrained(tmp_path / "wider")
    d = build_drafter(f"model:{tmp_path / 'same'}", target)
    assert isinstance(d, ModelDrafter) and d.name == f"model:{tmp_path / 'same'}"
    with pytest.raises(VocabularyMismatchError, match="48 output tokens.*32"):
        build_drafter(f"model:{tmp_path / 'wider'}", target)


# -- vocabulary checks --------------------------------------------------------------------------
def test_vocabulary_mismatch_by_size_without_tokenizers(target):
    wide = LoadedModel(model=_tiny_model(seed=2, vocab=48), tokenizer=None, name="wide")
    with pytest.raises(VocabularyMismatchError, match="use a drafter with the target's tokenizer"):
        check_same_vocabulary(target, wide)
    with pytest.raises(VocabularyMismatchError):
        check_same_vocabulary(wide, target)
    same = LoadedModel(model=_tiny_model(seed=2), tokenizer=None, name="same")
    check_same_vocabulary(target, same)  # no error
    assert isinstance(ModelDrafter(same, target.vocab_size), ModelDrafter)


def test_vocabulary_mismatch_with_tokenizers(target):
    tok_a = _word_tokenizer([f"w{i:02d}" for i in range(VOCAB)])
    tok_a2 = _word_tokenizer([f"w{i:02d}" for i in range(VOCAB)])
    tok_b = _word_tokenizer([f"x{i:02d}" for i in range(VOCAB)])
    swapped = [f"w{i:02d}" for i in range(VOCAB)]
    swapped[3], swapped[4] = swapped[4], swapped[3]
    tok_c = _word_tokenizer(swapped)
    m = _tiny_model(seed=2)
    tgt = LoadedModel(model=target.model, tokenizer=tok_a, name="target")
    check_same_vocabulary(tgt, LoadedModel(model=m, tokenizer=tok_a2, name="ok"))
    for tok, n_diff in ((tok_b, 32), (tok_c, 2)):
        drafter = LoadedModel(model=m, tokenizer=tok, name="other")
        with pytest.raises(VocabularyMismatchError) as info:
            check_same_vocabulary(tgt, drafter)
        msg = str(info.value)
        assert f"{n_diff} differ" in msg
        assert "same model family/tokenizer" in msg and "prompt-lookup" in msg


def test_wider_drafter_logits_are_aligned_and_output_stays_exact(target):
    """Same tokenizer, but the drafter's output layer is padded wider: extra ids are dropped."""
    wide = LoadedModel(model=_tiny_model(seed=5, vocab=48), tokenizer=None, name="wide")
    drafter = ModelDrafter(wide, target.vocab_size)
    prompt = [1, 2, 3, 4, 1, 2, 3]
    with torch.no_grad():
        ref = target.model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=20)
    engine = SpeculativeEngine(target, [drafter], k=3)
    result = engine.generate(prompt, max_new_tokens=20)
    assert result.token_ids == ref[0, len(prompt):].tolist()
    assert result.stats.drafted > 0
    drafter.begin_request(prompt)
    props = drafter.score(prompt, result.token_ids[:5], GREEDY)
    assert props.probs.shape == (5, VOCAB)


@pytest.mark.parametrize("make", [lambda: SuffixDrafter(), lambda: PromptLookupDrafter()])
def test_indexed_draft_proposes_lazily_and_equals_the_cut_peek(make):
    """``draft`` asks the policy after each token and proposes no more than it keeps (+1 for a
    dropped one); its tokens equal ``apply_decisions`` over the whole ``peek``."""
    from adaspec.drafters.base import apply_decisions
    ctx = [1, 2, 3, 4, 5, 6, 7, 1, 2, 3, 4, 5, 6, 7, 1, 2, 3]
    for stop_at, verdict in ((0, Decision.DISCARD), (0, Decision.STOP), (2, Decision.STOP), (3, Decision.DISCARD)):
        def decide(step, stop_at=stop_at, verdict=verdict):
            return verdict if step.index == stop_at else Decision.CONTINUE
        d = make()
        calls = []
        propose = d.propose
        d.propose = lambda: calls.append(1) or propose()
        got = d.draft(ctx, 8, SamplingConfig(), None, decide).tokens
        ref = make()
        want = apply_decisions(ref.peek(ctx, 8).tokens, decide)
        assert got == want and len(calls) == stop_at + 1
        # the index holds only the kept tokens: a second round continues from them
        assert d.peek(ctx + got, 4).tokens == make().peek(ctx + got, 4).tokens


@pytest.mark.parametrize("seed", range(3))
def test_a_shared_index_gives_each_drafter_what_its_own_index_does(seed):
    """``share_indexes``: prompt lookup and two suffix drafters on one request index look,
    draft, draft trees and score exactly as each does on its own index, whatever the order of
    the calls in a round (each syncs the index to its context from its own trusted length)."""
    from adaspec.drafters.indexed import share_indexes
    rng = random.Random(seed)
    store = SuffixDatastore(min_match=2)
    for _ in range(8):
        store.add([rng.randrange(4) for _ in range(rng.randrange(3, 30))])

    def make():
        return [PromptLookupDrafter(), SuffixDrafter(min_match=2), SuffixDrafter(min_match=2, datastore=store),
                PromptLookupDrafter(max_ngram=4, min_ngram=2)]
    shared, own = make(), make()
    share_indexes(shared)
    assert len({id(d._index) for d in shared}) == 1 and len({id(d._index) for d in own}) == 4
    ctx = [rng.randrange(4) for _ in range(6)]
    for d in shared + own:
        d.begin_request(ctx)
    keep_all = lambda step: Decision.CONTINUE  # noqa: E731
    for _ in range(80):
        new = [rng.randrange(4) for _ in range(rng.randint(1, 4))]
        for j in rng.sample(range(4), 4):
            op = rng.choice(["peek", "draft", "score", "tree", "none"])
            got = []
            for d in (shared[j], own[j]):
                if op == "peek":
                    got.append(d.peek(ctx, 4).tokens)
                elif op == "draft":
                    got.append(d.draft(ctx, 5, GREEDY, None, keep_all).tokens)
                elif op == "score":
                    got.append(d.score(ctx, new, GREEDY).tokens)
                elif op == "tree":
                    t = d.draft_tree(ctx, 4, 8)
                    got.append((t.tokens, t.parents))
            assert op == "none" or got[0] == got[1], (op, j)
        ctx = ctx + new
