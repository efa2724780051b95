"""The token-recycling drafter (``drafters.recycle``): its table, chains, trees and exactness."""

from __future__ import annotations

import pytest
import torch

from conftest import chisquare_gof, make_tiny_model

from adaspec import SpeculativeEngine
from adaspec.batch import BatchEngine
from adaspec.config import SamplingConfig
from adaspec.drafters import Decision, RecycleDrafter, build_drafter
from adaspec.drafters.recycle import RECYCLED
from adaspec.errors import AdaspecError, ConfigError

V = 12


def _logits(rows: list[list[int]]) -> torch.Tensor:
    """Logits rows whose ranking is each list's order (first = highest)."""
    out = torch.zeros(len(rows), V)
    for i, ranked in enumerate(rows):
        for r, t in enumerate(ranked):
            out[i, t] = 10.0 - r
    return out


def test_the_table_keeps_each_inputs_top_tokens_from_its_last_verify():
    d = RecycleDrafter(top=3)
    d.observe_target([5, 7], _logits([[1, 2, 3, 4], [8, 9, 10]]))
    assert d.table == {5: [1, 2, 3], 7: [8, 9, 10]}
    d.observe_target([5], _logits([[6, 1, 2]]))  # the last verify of a token wins
    assert d.table[5] == [6, 1, 2]
    d.observe_target([3, 4, 5], _logits([[0, 1, 2]]))  # fewer rows than inputs: only those
    assert 3 in d.table and 4 not in d.table and d.table[5] == [6, 1, 2]


def test_chains_walk_the_table_and_stop_at_a_token_never_verified():
    d = RecycleDrafter()
    d.observe_target([4], _logits([[6, 9]]))  # top 1: the argmax alone
    assert d.table[4] == [6]
    d.observe_target([4, 1, 2], _logits([[1, 9], [2, 8], [11, 0]]))
    d.begin_request([3, 4])
    assert d.peek([3, 4], 5).tokens == [1, 2, 11]  # 4 -> 1 -> 2 -> 11, 11 never an input
    assert d.peek([3, 4, 7], 5).tokens == []  # 7 never verified: nothing
    draft = d.draft([3, 4], 2, SamplingConfig(), None, lambda step: Decision.CONTINUE)
    assert draft.tokens == [1, 2]
    d.catch_up([3, 4])
    assert d.peek([3, 4], 5).tokens == [1, 2, 11]  # drafting left the index as it was


def test_tree_candidates_are_the_row_ranked_with_calibrated_scores():
    d = RecycleDrafter(top=4)
    d.observe_target([4], _logits([[1, 2, 3, 5]]))
    d.begin_request([4])
    d.catch_up([4])
    assert d.candidate_keys() == [(1, (RECYCLED, 0, 0)), (2, (RECYCLED, 1, 0)), (3, (RECYCLED, 2, 0)),
                                  (5, (RECYCLED, 3, 0))]
    tree = d.draft_tree([4], 3, 6)
    root = [tree.tokens[i] for i in tree.children()[0]]
    assert root[0] == 1 and set(root) <= {1, 2, 3, 5}
    prior = RecycleDrafter.CALIBRATION_PRIOR
    assert tree.scores[0] == pytest.approx(prior[(RECYCLED, 0, 0)])  # rank 0's calibrated estimate
    assert sorted(tree.scores, reverse=True) == tree.scores  # best-first
    d.catch_up([4, 2])  # the target emitted rank 1: settles the root's candidates
    est = d.request_calibration.estimate
    assert est((RECYCLED, 1, 0)) > prior[(RECYCLED, 1, 0)] and est((RECYCLED, 0, 0)) < prior[(RECYCLED, 0, 0)]


def test_spec_options_and_errors():
    assert build_drafter("recycle", None).top == 1
    assert build_drafter("recycle:top=2", None).top == 2
    with pytest.raises(ConfigError, match="1 <= top <= 16"):
        build_drafter("recycle:top=0", None)
    with pytest.raises(AdaspecError, match="allowed: top"):
        build_drafter("recycle:depth=2", None)


def test_forks_share_the_table():
    d = RecycleDrafter(top=2)
    twin = d.fork()
    twin.observe_target([3], _logits([[4, 5]]))
    assert d.table[3][:2] == [4, 5]


@pytest.mark.parametrize("tree", [False, True])
def test_engine_feeds_the_table_and_stays_greedy_exact(tree):
    """The engine gives the drafter every verified row; its drafts (chains and trees) are
    then accepted where the target agrees, and the output is plain greedy decoding's."""
    model = make_tiny_model(seed=0, vocab=V, init_std=0.3)
    prompt = [3, 7, 1, 9, 4, 3, 7]
    ar = SpeculativeEngine(model, ["none"]).generate(prompt, max_new_tokens=40).token_ids
    eng = SpeculativeEngine(model, ["recycle:top=3" if tree else "recycle"], k=4, tree=tree)
    first = eng.generate(prompt, max_new_tokens=40)
    assert first.token_ids == ar
    assert len(eng.drafters[0].table) > 3
    again = eng.generate(prompt, max_new_tokens=40)  # the table is kept across requests
    assert again.token_ids == ar
    rounds = again.stats.rounds
    assert sum(r.accepted for r in rounds) > 0 and sum(r.drafted - r.accepted for r in rounds) >= 0
    assert len(rounds) < 40  # it drafted accepted tokens


def test_auto_with_recycle_is_greedy_exact_and_plays_it():
    model = make_tiny_model(seed=0, vocab=V, init_std=0.3)
    prompt = [3, 7, 1, 9, 4, 3, 7]
    ar = SpeculativeEngine(model, ["none"]).generate(prompt, max_new_tokens=40).token_ids
    eng = SpeculativeEngine(model, ["prompt-lookup", "suffix", "recycle", "none"], selector="auto")
    outs = [eng.generate(prompt, max_new_tokens=40) for _ in range(3)]
    assert all(o.token_ids == ar for o in outs)
    assert any(r.drafter == "recycle" and r.drafted for o in outs for r in o.stats.rounds)


def test_batched_rows_feed_the_table_and_stay_exact():
    model = make_tiny_model(seed=0, vocab=V, init_std=0.3)
    prompts = [[3, 7, 1, 9, 4], [2, 5, 8, 2, 5], [1, 1, 6, 0, 3]]
    eng = SpeculativeEngine(model, ["recycle"], k=3)
    ref = [SpeculativeEngine(model, ["none"]).generate(p, max_new_tokens=20).token_ids for p in prompts]
    batch = BatchEngine(eng, max_batch=3)
    ids = [batch.add(p, max_new_tokens=20) for p in prompts]
    out = batch.run()
    assert [out[i].token_ids for i in ids] == ref
    assert len(eng.drafters[0].table) > 3


def test_sampling_with_recycled_chains_matches_the_exact_distribution():
    """Chi-square goodness of fit of the first two tokens at ALPHA = 0.001 over 3000 fixed
    seeds (as tests/test_distribution.py): the table changes between runs, only from earlier
    runs' verified rows, so every draft is a function of the past and one-hot q is exact."""
    from test_distribution import ALPHA, N_RUNS, PROMPT, exact_distribution, run_engine

    model = make_tiny_model(seed=0, vocab=V, init_std=0.2, lm_head_scale=1.5)
    eng = SpeculativeEngine(model, ["recycle"], k=3)
    runs = run_engine(eng, PROMPT, 2, seed0=70_000, temperature=1.0)
    exact = exact_distribution(model, PROMPT, SamplingConfig(temperature=1.0), 2)
    assert runs.drafted >= N_RUNS // 2 and 0 < runs.accepted < runs.drafted
    assert runs.counts[exact == 0].sum() == 0
    stat, pvalue, cells = chisquare_gof(runs.counts, exact)
    assert pvalue > ALPHA, f"chi-square {stat:.1f} over {cells} cells, p = {pvalue:.2e}"


def test_a_trace_records_recycled_chains_from_the_paths_rows_and_replays():
    """The recorder gives the drafter each path position's row after drafting there (as a live
    round verifies after drafting): its chains are empty until a token recurs, then follow the
    target; replay of a static recycle configuration reproduces live greedy decoding's tokens."""
    from adaspec.bench.replay import replay
    from adaspec.bench.trace import record_trace

    model = make_tiny_model(seed=0, vocab=V, init_std=0.3)
    prompts = [[3, 7, 1, 9, 4, 3, 7, 1], [2, 5, 8, 2, 5, 8, 2]]
    trace = record_trace(model, ["recycle"], prompts, 30, max_draft=6)
    track = trace.prompts[0].tracks[0]
    assert track.lengths[0] == 0  # the first position: no token verified yet
    assert (track.lengths > 0).sum() > 10 and track.accepted.sum() > 0
    got = replay(trace, "static", None, k=3, drafters=["recycle"])
    live = SpeculativeEngine(model, ["recycle"], k=3)
    for i, p in enumerate(prompts):
        mine = [r for r in got.rounds if r.prompt == i]
        assert sum(r.emitted for r in mine) == len(live.generate(p, max_new_tokens=30).token_ids)
    assert sum(r.accepted for r in got.rounds) > 0  # recycled chains were played and accepted


def test_default_arms_include_recycle_where_verify_blocks_are_cheap():
    """On PyTorch (transformers) recycle is one of auto's default arms; on llama.cpp, whose
    verify blocks cost 1.2-1.7x a step, it is not (its tokens do not pay there)."""
    from adaspec.engine import DEFAULT_DRAFTERS, default_drafters

    assert "recycle" in default_drafters("transformers") == DEFAULT_DRAFTERS
    assert "recycle" not in default_drafters("llama.cpp")
    assert [d for d in default_drafters("llama.cpp")] == [d for d in DEFAULT_DRAFTERS if d != "recycle"]


@pytest.mark.parametrize("batched", [False, True])
def test_a_rounds_scores_never_read_its_own_rows(batched, monkeypatch):
    """Full-information scoring (here HedgeSpec's) asks each drafter what it would have proposed
    at the round's verified positions. Had the recycle table taken the round's rows first, its
    first proposal there would be the target's own argmax after the context's last token,
    i.e. the first verified token, every time. The engines feed the table after scoring, so
    the first scored proposal misses in some rounds (greedy, a context-sensitive model)."""
    first: list[bool] = []
    score = RecycleDrafter.score

    def spy(self, context, verified, sampling):
        out = score(self, context, verified, sampling)
        if out.tokens and out.tokens[0] >= 0:
            first.append(out.tokens[0] == verified[0])
        return out

    monkeypatch.setattr(RecycleDrafter, "score", spy)
    model = make_tiny_model(seed=0, vocab=V, init_std=0.3)
    prompts = [[3, 7, 1, 9, 4, 3, 7], [2, 5, 8, 2, 5, 11, 0], [1, 1, 6, 0, 3, 1, 1, 6], [4, 9, 2, 4, 9, 7, 5]]
    eng = SpeculativeEngine(model, ["prompt-lookup", "recycle"], selector="hedgespec")
    if batched:  # one row at a time: another row's rows may overwrite a token's entry in between
        for p in prompts:
            batch = BatchEngine(eng, max_batch=1)
            batch.add(p, max_new_tokens=128)
            batch.run()
    else:
        for p in prompts:
            eng.generate(p, max_new_tokens=128)
    assert len(first) > 5
    assert not all(first), "recycle's scored proposals read the round's own rows"
