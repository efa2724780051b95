"""Continuous batching (``adaspec.batch``): exactness per row, the request lifecycle, the padded
cache with holes, and the batch cost surface, on tiny fp32 models."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from conftest import chisquare_gof, flat_cost_curve, make_tiny_model, word_tokenizer

from adaspec import SpeculativeEngine
from adaspec.backends.transformers import batch_attention_mask
from adaspec.batch import BatchEngine
from adaspec.drafters import NoDrafter
from adaspec.costs import BatchCosts, CostModel, VerifyCostSurface
from adaspec.feedback import RoundContext
from adaspec.errors import ConfigError
from adaspec.round import Round, drafting_can_pay
from adaspec.selection.auto import AutoSelector


VOCAB = 24
WORDS = [f"w{i:02d}" for i in range(VOCAB)]
#: drafter configurations of the exactness matrix (specs, selector, k)
CONFIGS = {
    "none": (["none"], None, 4),
    "pld-k6": (["prompt-lookup"], None, 6),
    "suffix-k3": (["suffix"], None, 3),
    "auto": (["prompt-lookup", "suffix", "none"], "auto", 5),
}


def _prompts(n: int = 7, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = (5, 17, 9, 1, 30, 40, 3, 12, 21, 2)[:n]
    out = [torch.randint(0, VOCAB, (m,), generator=g).tolist() for m in lengths]
    out[2] = [3, 4, 5, 6, 3, 4, 5, 6, 3, 4, 5]  # a copy-friendly prompt: long drafts are accepted
    return out


@pytest.fixture(scope="module")
def model():
    """Sharp attention (std 0.3), peaky outputs: repetitive continuations, so drafts of several
    lengths are accepted, and a wrong position or a stale KV column changes the argmax."""
    return make_tiny_model(seed=2, vocab=VOCAB, init_std=0.3, lm_head_scale=6)


@pytest.fixture(scope="module")
def soft_model():
    """Flatter outputs for the sampling tests (many first tokens have mass)."""
    return make_tiny_model(seed=3, vocab=VOCAB, init_std=0.3, lm_head_scale=1.5)


def _engine(model, name: str, **kw) -> SpeculativeEngine:
    specs, selector, k = CONFIGS[name]
    return SpeculativeEngine(model, specs, selector=selector, k=k, **kw)


# -- exactness -----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(CONFIGS))
def test_batched_greedy_equals_unbatched(model, name):
    engine = _engine(model, name)
    prompts = _prompts()
    ref = [engine.generate(p, max_new_tokens=40).token_ids for p in prompts]
    batch = BatchEngine(engine, max_batch=3, prefill_chunk=8)
    ids = [batch.add(p, max_new_tokens=40) for p in prompts]
    out = batch.run()
    assert [out[i].token_ids for i in ids] == ref
    assert all(out[i].stats.stop_reason == "max_new_tokens" for i in ids)
    # and through the convenience API, all rows at once
    assert [r.token_ids for r in engine.generate_batch(prompts, max_new_tokens=40)] == ref


def test_mixed_draft_lengths_in_one_round(model):
    """Rows with their own configurations (plain, k=1, k=3, k=7, auto) in one batch: some round
    verifies rows of different widths, and every row is still exact."""
    engine = SpeculativeEngine(model, ["prompt-lookup", "suffix", "none"], selector="auto")
    prompts = _prompts(5)
    setups = [dict(drafters=[2], selector="static"), dict(drafters=[0], selector="static", k=1),
              dict(drafters=[0], selector="static", k=3), dict(drafters=[1], selector="static", k=7), {}]
    refs = []
    for p, s in zip(prompts, setups):
        view = engine.with_policies(s.get("drafters"), selector=s.get("selector"), length=s.get("length"),
                                    k=s.get("k", 5)) if s else engine
        refs.append(view.generate(p, max_new_tokens=30).token_ids)
    batch = BatchEngine(engine, max_batch=5)
    ids = [batch.add(p, max_new_tokens=30, **s) for p, s in zip(prompts, setups)]
    widths_seen, outs = set(), {i: [] for i in ids}
    while len(batch):
        events = batch.step()
        drafted = {ev.round.drafted for ev in events if ev.round is not None}
        if len(events) > 1:
            widths_seen.add(tuple(sorted(drafted)))
        for ev in events:
            outs[ev.request].extend(ev.tokens)
    assert [outs[i] for i in ids] == refs
    assert any(len(w) >= 3 for w in widths_seen), widths_seen  # 3+ different draft lengths at once


def test_rows_join_and_leave(model):
    engine = _engine(model, "pld-k6")
    prompts = _prompts(5)
    budgets = [3, 25, 8, 30, 12]
    refs = [engine.generate(p, max_new_tokens=n).token_ids for p, n in zip(prompts, budgets)]
    batch = BatchEngine(engine, max_batch=2)
    ids = [batch.add(p, max_new_tokens=n) for p, n in zip(prompts, budgets)]
    assert batch.active == [] and batch.pending == ids
    outs: dict[int, list[int]] = {i: [] for i in ids}
    order, finished = [], []
    while len(batch):
        for ev in batch.step():
            outs[ev.request].extend(ev.tokens)
            if ev.finished:
                finished.append(ev.request)
                assert ev.stop_reason == "max_new_tokens" and ev.result.token_ids == outs[ev.request]
        assert len(batch.active) <= 2
        for i in batch.active:
            if i not in order:
                order.append(i)
        if batch.active:
            assert batch.row_kv(batch.active[0])  # the cache is consistent with the rows
    assert [outs[i] for i in ids] == refs
    assert finished[0] == ids[0]  # the shortest leaves first, and the next one joins its row
    assert order == ids


class _Recording(NoDrafter):
    """Records when requests begin and end on it (forks share the log)."""

    name = "recording"

    def __init__(self, log: list):
        self.log = log

    def begin_request(self, prompt_ids):
        self.log.append(("begin", list(prompt_ids)))

    def end_request(self, output):
        self.log.append(("end",))

    def fork(self):
        return _Recording(self.log)


@pytest.mark.parametrize("max_batch", [1, 2])
def test_a_queued_request_begins_when_it_leaves_the_queue(model, max_batch):
    """A request's drafters and policies begin when it gets a row, after the requests before it
    ended: at ``max_batch=1`` the engine's own drafters serve one request at a time, and a request
    begun at admission would draft on a later request's prompt (its lookups on the wrong text,
    0.82x the speed) and start ``auto`` before the others taught it anything."""
    log: list = []
    engine = SpeculativeEngine(model, [_Recording(log)], k=2)
    prompts = _prompts(3)
    engine.generate_batch(prompts, max_new_tokens=4, max_batch=max_batch)
    begins = [i for i, e in enumerate(log) if e[0] == "begin"]
    ends = [i for i, e in enumerate(log) if e[0] == "end"]
    assert [log[i][1] for i in begins] == prompts
    # the request past the batch's rows begins after one before it ended
    assert begins[max_batch] > ends[0]
    if max_batch == 1:
        assert [e[0] for e in log] == ["begin", "end"] * 3


def test_cancel_frees_the_row(model):
    engine = _engine(model, "suffix-k3")
    prompts = _prompts(4)
    ref3 = engine.generate(prompts[2], max_new_tokens=20).token_ids
    batch = BatchEngine(engine, max_batch=2)
    ids = [batch.add(p, max_new_tokens=20) for p in prompts]
    batch.step()
    batch.step()
    assert batch.active == ids[:2]
    assert batch.cancel(ids[0]) and ids[0] not in batch.active
    assert batch.cancel(ids[3])  # a queued one
    assert not batch.cancel(ids[0]) and not batch.cancel(999)
    events = batch.step()  # the freed row is refilled at once
    assert ids[2] in batch.active and {ev.request for ev in events} <= {ids[1], ids[2]}
    out = batch.run()
    assert set(out) == {ids[1], ids[2]} and out[ids[2]].token_ids == ref3


def test_eos_in_one_row_only(model):
    prompts = _prompts(3)
    plain = SpeculativeEngine(model, ["prompt-lookup"], k=4)
    refs = [plain.generate(p, max_new_tokens=30).token_ids for p in prompts]
    eos = next(t for t in refs[0][3:] if t not in refs[1] and t not in refs[2])
    model.generation_config.eos_token_id = eos
    try:
        engine = SpeculativeEngine(model, ["prompt-lookup"], k=4)
        out = engine.generate_batch(prompts, max_new_tokens=30)
    finally:
        model.generation_config.eos_token_id = None
    cut = refs[0].index(eos) + 1
    assert out[0].token_ids == refs[0][:cut] and out[0].stats.stop_reason == "eos"
    assert [o.token_ids for o in out[1:]] == refs[1:]
    assert all(o.stats.stop_reason == "max_new_tokens" for o in out[1:])


def test_stop_strings_per_row(model):
    tok = word_tokenizer(WORDS)
    engine = SpeculativeEngine(model, ["suffix"], k=5, tokenizer=tok)
    prompts = _prompts(3)
    refs = [engine.generate(p, max_new_tokens=30).token_ids for p in prompts]
    stops = [[tok.decode(refs[0][6:8])], [], [tok.decode(refs[2][10:11]), "zzz"]]
    expected = [engine.generate(p, max_new_tokens=30, stop=s).token_ids for p, s in zip(prompts, stops)]
    batch = BatchEngine(engine, max_batch=3)
    ids = [batch.add(p, max_new_tokens=30, stop=s) for p, s in zip(prompts, stops)]
    out = batch.run()
    assert [out[i].token_ids for i in ids] == expected
    assert [out[i].stats.stop_reason for i in ids] == ["stop_string", "max_new_tokens", "stop_string"]
    assert len(expected[0]) <= 8 and len(expected[2]) <= 11


# -- sampling ------------------------------------------------------------------------------------
def test_sampling_does_not_depend_on_batch_mates(soft_model):
    """Per-request generators: a seeded sampling request with fixed policies emits the same
    tokens alone and in a batch with greedy and sampling mates of other drafters and policies.
    (Adaptive policies may choose differently in a batch, where blocks are priced differently:
    the output is then the same in distribution, not token for token.)"""
    engine = SpeculativeEngine(soft_model, ["prompt-lookup", "suffix", "none"], selector="auto")
    prompts = _prompts(4)
    own = dict(drafters=[0], selector="static", k=4)
    view = engine.with_policies([0], selector="static", k=4)
    alone = [view.generate(prompts[2], max_new_tokens=15, temperature=1.0, seed=s).token_ids
             for s in range(4)]
    batch = BatchEngine(engine, max_batch=8)
    ids = [batch.add(prompts[2], max_new_tokens=15, temperature=1.0, seed=s, **own) for s in range(4)]
    batch.add(prompts[0], max_new_tokens=20)
    batch.add(prompts[1], max_new_tokens=9, temperature=0.7, seed=99)
    batch.add(prompts[3], max_new_tokens=12, temperature=1.3, top_k=5, seed=7, drafters=[1],
              selector="static", k=6)
    out = batch.run()
    assert [out[i].token_ids for i in ids] == alone
    assert sum(r.accepted for i in ids for r in out[i].stats.rounds) > 0  # drafts were accepted


def test_sampling_first_tokens_follow_the_target(soft_model):
    """Chi-square (alpha = 0.001, fixed seeds): the first token of a sampled row whose drafts are
    verified in mixed batches follows the target's distribution after the prompt."""
    prompt = [3, 4, 5, 6, 3, 4, 5, 6, 3, 4, 5]  # prompt lookup proposes [6, 3, ...]
    with torch.inference_mode():
        logits = soft_model(torch.tensor([prompt])).logits[0, -1].float()
    probs = torch.softmax(logits, -1).tolist()
    engine = SpeculativeEngine(soft_model, ["prompt-lookup"], k=4)
    mates = _prompts(3)
    counts = [0] * VOCAB
    drafted = 0
    for trial in range(60):
        batch = BatchEngine(engine, max_batch=8)
        ids = [batch.add(prompt, max_new_tokens=3, temperature=1.0, seed=1000 * trial + j) for j in range(5)]
        batch.add(mates[trial % 3], max_new_tokens=4)  # greedy mate
        batch.add(mates[(trial + 1) % 3], max_new_tokens=5, temperature=0.8, seed=trial)
        first = {}
        while len(batch):
            for ev in batch.step():
                if ev.request in ids and ev.request not in first:
                    first[ev.request] = ev.tokens[0]
                    drafted += ev.round.drafted
        for i in ids:
            counts[first[i]] += 1
    assert drafted > 100  # the first position was verified against drafts, not plainly sampled
    stat, p_value, cells = chisquare_gof(counts, probs)
    assert cells >= 3
    assert p_value > 1e-3, (stat, p_value, counts)


#: rows of different lengths, each a repeat that prompt lookup drafts from (vocabulary 8)
BATCH_SAMPLING_PROMPTS = [[7, 3, 4, 7, 3, 4, 7, 3], [1, 6, 2, 1, 6, 2, 1, 6, 2, 1], [5, 0, 5, 0, 5]]


def _rows_read_the_next_rows_logits(monkeypatch) -> None:
    """BUG: every row of a batched forward is verified on the next row's logits (the padded
    forward of the transformers backend's rows, ``PaddedRows.forward``, patched)."""
    from adaspec.backends.transformers import PaddedRows

    real = PaddedRows.forward
    monkeypatch.setattr(PaddedRows, "forward", lambda self, inputs: real(self, inputs).roll(1, dims=0))


@pytest.mark.parametrize("bug", [None, "rows-read-other-rows"])
def test_batched_sampling_follows_the_target_over_three_tokens(bug, monkeypatch):
    """``generate_batch`` of three prompts of different lengths (padding, holes), 3 sampled tokens
    a row (T=1; prompt lookup, k=3: the first round drafts 2, so the block rule and the rollback
    of rejected columns run): each row's joint distribution of its 3 tokens equals the target's
    exact one, computed by enumeration (``test_distribution.exact_distribution``), chi-square at
    ALPHA = 0.001 over 600 fixed seeds per row (3 rows: family-wise at most 0.003). The negative
    control (each row verified on the next row's logits) must be rejected on every row."""
    from test_distribution import Runs, check_exact, exact_distribution

    from adaspec.config import SamplingConfig

    if bug:
        _rows_read_the_next_rows_logits(monkeypatch)
    vocab, n_runs = 8, 600
    target = make_tiny_model(seed=0, vocab=vocab, init_std=0.2)
    engine = SpeculativeEngine(target, ["prompt-lookup"], k=3)
    runs = [Runs(np.zeros((vocab,) * 3, dtype=np.int64), 0, 0, 0) for _ in BATCH_SAMPLING_PROMPTS]
    for seed in range(n_runs):
        out = engine.generate_batch(BATCH_SAMPLING_PROMPTS, max_new_tokens=3, temperature=1.0, seed=seed)
        for r, res in zip(runs, out):
            r.counts[tuple(res.token_ids)] += 1
            r.drafted, r.accepted, r.rounds = (r.drafted + res.stats.drafted, r.accepted + res.stats.accepted,
                                               r.rounds + res.stats.n_rounds)
    for i, (r, prompt) in enumerate(zip(runs, BATCH_SAMPLING_PROMPTS)):
        exact = exact_distribution(target, prompt, SamplingConfig(temperature=1.0), 3)
        check_exact(r, exact, f"batched row {i}", bug)


# -- chunked prefill, the cache ------------------------------------------------------------------
def test_prefill_is_chunked_while_others_decode(model):
    engine = _engine(model, "pld-k6")
    short, long_prompt = _prompts(6)[2], _prompts(6)[5]  # 11 and 40 tokens
    ref = engine.generate(long_prompt, max_new_tokens=10).token_ids
    batch = BatchEngine(engine, max_batch=4, prefill_chunk=8)
    first = batch.add(short, max_new_tokens=60)
    batch.step()  # one chunk of the 10 tokens prefilled (chunk 8), not yet active
    assert batch.active == [] and batch.pending == [first]
    batch.step()
    assert batch.active == [first]
    late = batch.add(long_prompt, max_new_tokens=10)
    progress = []
    for _ in range(5):  # 39 tokens to prefill: 8 per step, the other row advances every step
        events = batch.step()
        assert [ev.request for ev in events if ev.tokens][:1] == [first]
        progress.append(batch._joining.prefilled if batch._joining is not None else 39)
    assert progress == [8, 16, 24, 32, 39] and late in batch.active
    out = batch.run()
    assert out[late].token_ids == ref


def test_short_prompts_join_together_within_the_prefill_budget(model):
    engine = _engine(model, "none")
    prompts = _prompts(6)  # 5, 17, 11, 1, 30, 40 tokens: 4 + 16 + 10 + 0 = 30 to prefill, then 29, then 39
    batch = BatchEngine(engine, max_batch=8, prefill_chunk=32)
    ids = [batch.add(p, max_new_tokens=5) for p in prompts]
    fed = []
    forward = engine.target.forward

    def counting(state, tokens, keep=1, hidden=False):
        if len(tokens) > 1 or len(batch.states) == 0 or state is not batch.states._cache:
            fed.append(len(tokens))
        return forward(state, tokens, keep, hidden)

    engine.target.forward = counting
    try:
        batch.step()
        assert batch.active == ids[:4] and fed == [4, 16, 10]  # four prompts joined in one step
        batch.step()  # the 5th whole (29 did not fit the 2 left in step 1); the 6th's first piece
        assert batch.active == ids[:5] and batch.pending == ids[5:] and fed[3:] == [29]  # (32) waits
        assert batch._joining.prefilled == 0
        batch.step()
        assert fed[4:] == [32] and batch._joining.prefilled == 32
        batch.step()
        assert fed[5:] == [7] and batch.active == ids
    finally:
        del engine.target.forward


def test_a_long_prompt_goes_in_the_same_pieces_at_every_concurrency(model):
    """A prompt longer than ``prefill_chunk`` is fed in pieces of ``prefill_chunk`` tokens from
    its start whatever else joins in the same steps: the KV it gets (and on a target whose
    kernels depend on the row count, its greedy answer) does not depend on the load."""
    engine = _engine(model, "pld-k6")
    long_prompt, others = _prompts(6)[5], _prompts(6)[:3]  # 40 tokens; 5, 17, 11 before it
    ref = engine.generate(long_prompt, max_new_tokens=12).token_ids
    for before in ([], others):
        pieces, real = [], engine.target.prefill_piece
        engine.target.prefill_piece = lambda state, ids: pieces.append(len(ids)) or real(state, ids)
        try:
            batch = BatchEngine(engine, max_batch=4, prefill_chunk=16)
            for p in before:
                batch.add(p, max_new_tokens=12)
            late = batch.add(long_prompt, max_new_tokens=12)
            out = batch.run()
        finally:
            del engine.target.prefill_piece
        assert pieces == [16, 16, 7], (before, pieces)
        assert out[late].token_ids == ref


def test_kv_after_rollback_equals_a_fresh_cache(model):
    """After rounds with rejected drafts (holes), merges and a compaction, every row's valid
    columns hold the KV a batch-1 prefill of its tokens gives."""
    engine = _engine(model, "pld-k6")
    batch = BatchEngine(engine, max_batch=4, compact_fraction=100.0)  # no automatic compaction
    for p in _prompts(4):
        batch.add(p, max_new_tokens=50)
    for _ in range(12):
        batch.step()
    valid = batch.states.valid
    assert valid.shape[1] > int(valid.sum(1).max())  # there are holes

    def check() -> None:
        for req in batch._rows:
            fresh = engine.target.new_state()
            engine.target.forward(fresh, req.tokens[:-1], keep=1)
            for (k, v), layer in zip(batch.row_kv(req.id), fresh.layers):
                assert torch.allclose(k, layer.keys[0], atol=1e-5)
                assert torch.allclose(v, layer.values[0], atol=1e-5)

    check()
    batch.compact()
    valid = batch.states.valid
    assert valid.shape[1] == int(valid.sum(1).max())
    check()


def test_mask_lets_padding_queries_see_themselves():
    valid = torch.tensor([[True, False, True], [False, False, False]])
    mask = batch_attention_mask(valid, [3, 1], 3, torch.float32)[:, 0] == 0
    assert mask.shape == (2, 3, 6)
    assert mask[0].tolist() == [[True, False, True, True, False, False],
                                [True, False, True, True, True, False],
                                [True, False, True, True, True, True]]
    # row 1 has one real query (sees its new column) and two padding queries (themselves only)
    assert mask[1].tolist() == [[False, False, False, True, False, False],
                                [False, False, False, False, True, False],
                                [False, False, False, False, False, True]]


def test_configuration_errors(model):
    engine = _engine(model, "none")
    with pytest.raises(ConfigError, match="max_batch"):
        BatchEngine(engine, max_batch=0)
    with pytest.raises(ConfigError, match="tree=False"):
        BatchEngine(SpeculativeEngine(model, ["prompt-lookup"], tree=True))
    from adaspec.drafters import Drafter

    class Unforkable(NoDrafter):
        name = "unforkable"
        fork = Drafter.fork

    with pytest.raises(ConfigError, match="drafter per request"):
        BatchEngine(SpeculativeEngine(model, [Unforkable()])).add([1, 2, 3])


# -- batch costs ---------------------------------------------------------------------------------
def _synthetic(compute: float = 1e-3, per_width: float = 0.0) -> BatchCosts:
    """V = 10 ms + compute x rows x width + 1 us x context (+ per_width x (width - 1)): memory-bound
    at one row, compute-bound at many (with per_width > 0 a wider forward never pays)."""
    rows, widths, contexts = [1, 2, 4, 8, 16, 32], [1, 2, 4, 8], [100, 500]
    sec = [[[0.01 + compute * r * w + 1e-6 * c + per_width * (w - 1) for w in widths] for r in rows]
            for c in contexts]
    return BatchCosts(contexts, rows, widths, sec)


def test_batch_costs_interpolate_and_price_the_margin():
    costs = _synthetic()
    v = lambda r, w, c: 0.01 + 1e-3 * r * w + 1e-6 * c  # noqa: E731 - the exact (linear) surface
    for r, w, c in [(1, 1, 100), (3, 3, 300), (8, 5, 250), (20, 7, 499), (32, 8, 100)]:
        assert costs.cost(r, w, c) == pytest.approx(v(r, w, c))
    assert costs.cost(2, 12, 100) == pytest.approx(v(2, 12, 100))  # extrapolated along width
    assert costs.cost(2, 1, 50) == pytest.approx(v(2, 1, 100))  # below the grid: first context
    assert costs.cost(4, 0, 100) == 0.0
    r, c = 8, 100
    assert costs.row_cost(r, 1, c) == pytest.approx(v(r, 1, c) / r)
    assert costs.row_cost(r, 4, c) == pytest.approx(v(r, 1, c) / r + v(r, 4, c) - v(r, 1, c))
    with pytest.raises(ConfigError):
        BatchCosts([1], [1, 2], [1], [[[1.0]]])

    model = CostModel(VerifyCostSurface([100], [1, 2, 4], [[0.01, 0.0101, 0.0102]]))
    model.batch = costs
    one = RoundContext(cache_len=100, batch_columns=100)
    assert model.verify_cost(4, one) == pytest.approx(0.0102)  # one row: the batch-1 surface
    assert model.verify_cost(4, replace(one, rows=8)) == pytest.approx(costs.row_cost(8, 4, 100))


def test_rows_draft_less_as_the_batch_grows_compute_bound():
    """``auto`` priced by the batch: it drafts at one row (memory-bound: a wider forward is
    nearly free) and plays plain steps in a large compute-bound batch."""
    costs = _synthetic(compute=2e-3)
    model = CostModel(VerifyCostSurface([100], [1, 2, 4, 8], [[0.01, 0.0101, 0.0102, 0.0104]]))
    model.batch = costs
    selector = AutoSelector()
    selector.costs = model
    selector.begin_request(["prompt-lookup", "none"])
    caps = {}
    for rows in (1, 2, 32):
        caps[rows] = selector.controller.choose(RoundContext(cache_len=100, rows=rows, batch_columns=100)).k
    assert caps[1] > 0 and caps[32] == 0 and caps[1] >= caps[2] >= caps[32]


def test_rows_skip_planning_where_no_block_can_pay(model, monkeypatch):
    """In a compute-bound batch where even a fully accepted block cannot pay, cost-aware rows
    take plain steps without asking their policies; a static-k row still drafts (the user
    asked for k); the output stays the target's; a one-row batch plans as usual."""
    engine = _engine(model, "auto")
    batch = BatchEngine(engine, max_batch=4, batch_costs=_synthetic(compute=5e-2, per_width=2e-2))
    batch._wants_costs = True
    auto_ids = [batch.add(p, max_new_tokens=10) for p in _prompts(3)]
    static_id = batch.add(_prompts(3)[2], max_new_tokens=10, drafters=[0], selector="static",
                          length="static", k=3)
    planned: list[int] = []
    real_plan = Round.plan_row
    monkeypatch.setattr(Round, "plan_row", lambda rnd, row, look=None, ctx=None: planned.append(row.id)
                        or real_plan(rnd, row, look, ctx))
    results = batch.run()
    assert planned and set(planned) == {static_id}  # only the static row was planned
    assert any(r.drafted for r in results[static_id].stats.rounds)
    plain = SpeculativeEngine(model, [])
    for i, p in zip(auto_ids, _prompts(3)):
        assert all(r.drafter == "none" and r.drafted == 0 for r in results[i].stats.rounds)
        assert results[i].token_ids == plain.generate(p, max_new_tokens=10).token_ids
    assert batch.cost_model.batch is not None
    assert drafting_can_pay(batch.cost_model, 1)  # one row: the batch price does not apply


def test_requests_share_auto_global_counts_but_not_request_state(model):
    """Per-request copies of ``auto``: what the batch's requests learn reaches the engine's global
    counts (as sequential requests do); request counts and plans stay per request."""
    engine = _engine(model, "auto")
    ctl = engine.selector.controller
    batch = BatchEngine(engine, max_batch=4)
    before = sum(c.t[1] for c in ctl.global_counts)
    ids = [batch.add(p, max_new_tokens=12) for p in _prompts(4)]
    batch.step()
    batch.step()
    views = [r.parts for r in batch._rows]
    assert len({id(v.selector) for v in views}) == len(views)
    assert all(v.selector.controller.global_counts is ctl.global_counts for v in views)
    assert all(v.selector.controller.request_counts is not ctl.request_counts for v in views)
    assert len({id(d) for v in views for d in v.drafters}) == 3 * len(views)  # forked drafters
    batch.run()
    assert sum(c.t[1] for c in ctl.global_counts) > before
    assert len(ids) == 4


def test_batched_greedy_passes_the_tie_aware_check_on_a_flat_model():
    """On a weakly context-sensitive model (near-uniform attention, std 0.02) fp32 batched
    forwards may flip numeric near-ties; every batched token must still be the target's argmax
    or within ``NEAR_TIE_NATS`` of it, teacher-forced on the output (``exactness``)."""
    from adaspec.exactness import NEAR_TIE_NATS, check_tie_aware

    flat = make_tiny_model(seed=4, vocab=VOCAB, lm_head_scale=10)
    engine = _engine(flat, "auto")
    prompts = _prompts(6, seed=1)
    out = engine.generate_batch(prompts, max_new_tokens=30, max_batch=4)
    for p, r in zip(prompts, out):
        check = check_tie_aware(flat, p, r.token_ids, max_gap=NEAR_TIE_NATS)
        assert check.ok and check.n_tokens == 30, check.violations


# -- the joint batch width -----------------------------------------------------------------------
def test_block_curve_gives_each_cap_its_best_drafter_and_commit_plays_it():
    """``AutoController.block_curve``: per cap, the best looked-at drafter's expected tokens,
    flat past its block; ``commit`` makes the round's plan that cap (cold start: the prior's
    means a = 0.5, c = 0.7)."""
    sel = AutoSelector()
    ctl = sel.controller
    sel.begin_request(["prompt-lookup", "suffix", "none"])
    assert sel.block_curve() is None  # nothing looked at yet
    sel.observe_proposals({0: [5, 6, 7], 1: [9]})
    curve = sel.block_curve()
    assert curve[0] == (1.0, 2, 0)  # a plain step: none
    assert curve[1][0] == pytest.approx(1.5) and curve[1][2] == 1
    assert curve[2] == (pytest.approx(1 + 0.5 * 1.7), 0, 2)  # suffix's block ends at 1
    assert curve[3] == curve[16] == (pytest.approx(1 + 0.5 * (1 + 0.7 + 0.49)), 0, 3)
    sel.commit(6)
    assert sel.select() == 0 and ctl.cap_for(0) == 3  # its whole block, not past it
    sel.observe_proposals({0: [], 1: []})
    sel.commit(4)
    assert sel.select() == 2 and ctl.cap_for(2) == 0  # no block: a plain step
    model_sel = AutoSelector()
    model_sel.bind_drafters([False, True, False])
    model_sel.begin_request(["prompt-lookup", "tiny-lm", "none"])
    model_sel.observe_proposals({0: [5, 6]})
    assert model_sel.block_curve() is None  # a model drafter would spend drafting time


def test_joint_width_maximises_the_batch_rate():
    """W maximises sum_r E_r(W - 1) / (R o + V(W)), at least the other rows' widest block."""
    from adaspec.batch import joint_width

    curves = [[1.0, 1.9, 2.7, 2.7], [1.0, 1.2, 1.3]]
    flat = lambda w: 0.010  # noqa: E731 - widening is free: the widest useful block
    assert joint_width(curves, 2, 1, 0.0, flat) == 3
    steep = lambda w: 0.010 * w  # noqa: E731 - widening costs a full step per token
    assert joint_width(curves, 2, 1, 0.0, steep) == 1
    mid = lambda w: 0.010 + 0.004 * (w - 1)  # noqa: E731
    rates = {w: (curves[0][min(w - 1, 3)] + curves[1][min(w - 1, 2)]) / mid(w) for w in range(1, 5)}
    assert joint_width(curves, 2, 1, 0.0, mid) == max(rates, key=rates.get)
    assert joint_width(curves, 3, 4, 0.0, steep) == 4  # another row drafts 3 tokens anyway
    assert joint_width([], 2, 2, 0.0, flat) == 2


def _shared_widening(rows=(1, 2, 4, 8, 16, 32), widths=(1, 2, 4, 8), contexts=(100, 500)) -> BatchCosts:
    """V = 10 ms + 2 ms per extra column, whatever the rows: widening is the batch's, not a row's."""
    sec = [[[0.010 + 0.002 * (w - 1) for w in widths] for _ in rows] for _ in contexts]
    return BatchCosts(list(contexts), list(rows), list(widths), sec)


def test_batched_auto_rows_draft_together_where_each_alone_would_not(model, monkeypatch):
    """A width the batch pays once: priced alone (its share of a plain step, 2.5 ms, plus the
    whole widening, 2 ms a token) no row's block pays; priced jointly the rows draft together,
    every row up to the one width, and stay exact. The costs are the test's alone: live timings
    (drafting, looks, overheads) are not fed to the cost model and the engine's own rounds are
    priced on a fixed curve, not this machine's measured one (with them, a loaded CI machine
    once planned one draft alone)."""
    for observer in ("observe", "observe_overhead", "observe_look", "observe_round", "observe_eval"):
        monkeypatch.setattr(CostModel, observer, lambda self, *a, **kw: None)
    engine = _engine(model, "auto")
    engine.cost_model.curve = flat_cost_curve([0.0025 * (1 + 0.05 * (k - 1)) for k in range(1, 17)])
    prompts = _prompts(4)
    ref = [engine.generate(p, max_new_tokens=24).token_ids for p in prompts]

    def run(joint: bool) -> tuple[dict, list]:
        batch = BatchEngine(engine, max_batch=4, batch_costs=_shared_widening())
        if not joint:  # every row plans alone on its row price (the rule before the joint width)
            monkeypatch.setattr(batch.round, "_joint_plans", lambda rows, cm, ctxs: [batch.round.plan_row(r, ctx=c) for r, c in zip(rows, ctxs)])
        widths, real = [], batch.states.forward
        monkeypatch.setattr(batch.states, "forward", lambda inputs: widths.append(sorted(len(x) for x in inputs))
                            or real(inputs))
        ids = [batch.add(p, max_new_tokens=24) for p in prompts]
        out = batch.run()
        assert [out[i].token_ids for i in ids] == ref
        return {i: out[i] for i in ids}, widths

    alone, _ = run(joint=False)
    assert sum(r.drafted for res in alone.values() for r in res.stats.rounds) == 0
    joint, widths = run(joint=True)
    assert sum(r.drafted for res in joint.values() for r in res.stats.rounds) > 0
    assert any(len(w) == 4 and w[-1] > 1 for w in widths)


def test_a_round_of_mostly_first_tokens_is_plain(model):
    """Rows that join together get their first tokens from a plain forward, not from a joint
    width's wide one (a burst's time to the first token: without the rule the two copy-friendly
    rows draft 3 here, auto's cold start, a = 0.5), while a row that joins a running batch alone
    is planned with the others (its first token drafted for), and every row stays exact."""
    engine = SpeculativeEngine(model, ["prompt-lookup", "none"], selector="auto")
    copy, other = _prompts(3)[2], _prompts(3)[1]
    plain = SpeculativeEngine(model, [])
    ref = {tuple(p): plain.generate(p, max_new_tokens=24).token_ids for p in (copy, other)}
    batch = BatchEngine(engine, max_batch=4, batch_costs=_shared_widening())
    widths, real = [], batch.states.forward
    batch.states.forward = lambda inputs: widths.append([len(x) for x in inputs]) or real(inputs)
    prompts = [copy, copy, other]
    ids = [batch.add(p, max_new_tokens=24) for p in prompts]
    batch.step()
    assert widths == [[1, 1, 1]]  # three first tokens: a plain forward
    batch.step()
    prompts.append(copy)
    ids.append(batch.add(copy, max_new_tokens=24))
    batch.step()
    assert len(widths[-1]) == 4 and widths[-1][-1] > 1  # one of four joining: drafted with the others
    out = batch.run()
    assert [out[i].token_ids for i in ids] == [ref[tuple(p)] for p in prompts]


@pytest.mark.parametrize("margin", [100.0, 1.0])
def test_a_batch_no_row_alone_can_draft_in_probes_the_joint_width(model, monkeypatch, margin):
    """Where no row's block pays at its row price (a plain step's 1/R share, 2.5 ms here, plus
    the whole widening, 3 ms a token) but blocks pay together (every row drafting), the batch
    takes plain steps without asking the rows' policies and plans jointly every
    ``JOINT_PROBE_EVERY``-th round (a probe). A probe drafts only where its width's expected
    rate is ``JOINT_MARGIN`` times the plain batch's (never at 100: probes only, spaced
    evenly); one that drafts (at 1) takes every row to the one width, and the next round is
    planned jointly too. Outputs stay the target's either way."""
    import adaspec.round as round_mod

    for observer in ("observe", "observe_overhead", "observe_look", "observe_round", "observe_eval"):
        monkeypatch.setattr(CostModel, observer, lambda self, *a, **kw: None)
    monkeypatch.setattr(round_mod, "JOINT_MARGIN", margin)
    engine = _engine(model, "auto")
    engine.cost_model.curve = flat_cost_curve([0.0025 * (1 + 0.05 * (k - 1)) for k in range(1, 17)])
    engine.cost_model.round_overhead_s = 0.0
    prompts = [_prompts(3)[2]] * 4  # copy-friendly: every row has a block
    ref = SpeculativeEngine(model, []).generate(prompts[0], max_new_tokens=20).token_ids
    steep = BatchCosts([100, 500], [1, 2, 4, 8], [1, 2, 4, 8],
                       [[[0.010 + 0.003 * (w - 1) for w in (1, 2, 4, 8)] for _ in range(4)] for _ in range(2)])
    batch = BatchEngine(engine, max_batch=4, batch_costs=steep)
    assert not drafting_can_pay(batch.cost_model, 4) and drafting_can_pay(batch.cost_model, 4, joint=True)
    joint_rounds, widths = [], []
    real_joint, real_forward = batch.round._joint_plans, batch.states.forward
    monkeypatch.setattr(batch.round, "_joint_plans", lambda rows, cm, ctxs, margin=None: joint_rounds.append(
        len(widths)) or real_joint(rows, cm, ctxs, margin))
    monkeypatch.setattr(batch.states, "forward", lambda inputs: widths.append(sorted(len(x) for x in inputs))
                        or real_forward(inputs))
    ids = [batch.add(p, max_new_tokens=20) for p in prompts]
    out = batch.run()
    assert all(out[i].token_ids == ref for i in ids)
    drafted = [i for i, w in enumerate(widths) if w[-1] > 1]
    assert set(drafted) <= set(joint_rounds)  # plain rounds between probes draft nothing
    assert all(widths[i] == [widths[i][-1]] * 4 for i in drafted)  # every row to the one width
    if margin > 10:
        assert not drafted and len(joint_rounds) >= 2
        assert joint_rounds[0] == round_mod.JOINT_PROBE_EVERY - 1
        assert all(b - a == round_mod.JOINT_PROBE_EVERY for a, b in zip(joint_rounds, joint_rounds[1:]))
    else:
        assert drafted and all(i + 1 in joint_rounds for i in drafted if i + 1 < len(widths))


def test_joint_width_sampling_first_tokens_follow_the_target(soft_model):
    """Chi-square (alpha = 0.001, fixed seeds): sampled ``auto`` rows whose blocks the batch's
    joint width decides (a shared widening, so the rows draft together) emit first tokens
    distributed as the target's after the prompt. Each sampled row joins a running batch of
    three alone (a round of mostly first tokens is plain: ``Round.plan``)."""
    prompt = [3, 4, 5, 6, 3, 4, 5, 6, 3, 4, 5]
    with torch.inference_mode():
        logits = soft_model(torch.tensor([prompt])).logits[0, -1].float()
    probs = torch.softmax(logits, -1).tolist()
    counts, drafted = [0] * VOCAB, 0
    for trial in range(80):  # a fresh engine each time: auto's cold start drafts (a = 0.5)
        engine = SpeculativeEngine(soft_model, ["prompt-lookup", "none"], selector="auto")
        batch = BatchEngine(engine, max_batch=4, batch_costs=_shared_widening())
        for j in range(3):  # the running rows
            batch.add(prompt, max_new_tokens=64, temperature=1.0, seed=1000 * trial + 100 + j)
        batch.step()
        first = {}
        for j in range(4):
            sampled = batch.add(prompt, max_new_tokens=3, temperature=1.0, seed=1000 * trial + j)
            while sampled not in first:
                for ev in batch.step():
                    if ev.request == sampled and ev.tokens:
                        first[sampled] = ev.tokens[0]
                        drafted += ev.round.drafted > 0
            counts[first[sampled]] += 1
    assert drafted > 40, drafted  # the joint width drafted for the first position of many rows (70 of 320 here)
    stat, p_value, cells = chisquare_gof(counts, probs)
    assert cells >= 3
    assert p_value > 1e-3, (stat, p_value, counts)


def test_the_batch_grid_is_measured_once_for_the_rows_the_batch_can_hold(model, monkeypatch, tmp_path, caplog):
    """The first batched round of a cost-aware batch measures the batch grid over the row counts
    a batch of ``max_batch`` prices (``batch_grid_rows``: 1, 2, 4 for 3), says so in the log (no
    progress display shows it), and caches it: a second batch of that size reads it."""
    import adaspec.batch as batch_mod
    from adaspec.costs import batch_grid_rows

    assert batch_grid_rows(1) == [1] and batch_grid_rows(2) == [1, 2] and batch_grid_rows(3) == [1, 2, 4]
    assert batch_grid_rows(8) == [1, 2, 4, 8] and batch_grid_rows(9) == [1, 2, 4, 8, 16]
    monkeypatch.setenv("ADASPEC_CACHE", str(tmp_path))
    asked = []

    def measure(target, rows, widths, contexts, progress=None):
        asked.append(list(rows))
        return _synthetic() if progress is None else pytest.fail("the engine shows no progress display")

    monkeypatch.setattr(batch_mod, "measure_batch_costs", measure)
    for _ in range(2):
        batch = BatchEngine(_engine(model, "auto"), max_batch=3)
        for p in _prompts(3):
            batch.add(p, max_new_tokens=4)
        with caplog.at_level("WARNING", logger="adaspec.costs"):
            batch.run()
        assert batch.cost_model.batch is not None
    assert asked == [[1, 2, 4]]  # measured once, then read from the cache
    assert caplog.text.count("measuring the batch verify costs of this model on this machine, once") == 1


def test_measuring_the_batch_grid_reports_progress(model, monkeypatch, tmp_path, caplog):
    """``load_or_measure_batch(progress=...)``: a call before the first cell and after each cache
    length and row count, and no log line (the caller shows the progress)."""
    from adaspec.batch import load_or_measure_batch

    monkeypatch.setenv("ADASPEC_CACHE", str(tmp_path))
    calls = []
    with caplog.at_level("WARNING", logger="adaspec.costs"):
        grid = load_or_measure_batch(SpeculativeEngine(model, ["none"]).target, rows=[1, 2], widths=[1, 3],
                                     contexts=[6, 12], progress=lambda done, total: calls.append((done, total)))
    assert calls == [(0, 4), (1, 4), (2, 4), (3, 4), (4, 4)]
    assert grid.rows == [1, 2] and grid.widths == [1, 3] and len(grid.seconds) == 2
    assert "measuring" not in caplog.text
    assert len(list((tmp_path / "costs").glob("batch-*.json"))) == 1


# -- model drafters in batches --------------------------------------------------------------------
def _model_drafter(model, seed: int = 11):
    """A noisy copy of the target as a draft model: its drafts are accepted in part."""
    import copy

    from adaspec.drafters import ModelDrafter
    from adaspec.models import as_loaded

    noisy = copy.deepcopy(model)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for p in noisy.parameters():
            p.add_(0.02 * torch.randn_like(p))
    return ModelDrafter(as_loaded(noisy), VOCAB, name="noisy")


@pytest.mark.parametrize("selector", [None, "round-robin"])
def test_model_drafters_batch_with_greedy_output_unchanged(model, selector):
    """A model drafter forks a KV state per request (weights shared): in a batch each row drafts
    with its own, and every row's greedy output is its unbatched output, drafts accepted."""
    drafters = [_model_drafter(model)] + (["prompt-lookup", "none"] if selector else [])
    engine = SpeculativeEngine(model, drafters, selector=selector, k=4)
    prompts = _prompts(5)
    ref = [engine.generate(p, max_new_tokens=24).token_ids for p in prompts]
    batch = BatchEngine(engine, max_batch=3, prefill_chunk=8)
    ids = [batch.add(p, max_new_tokens=24) for p in prompts]
    out = batch.run()
    assert [out[i].token_ids for i in ids] == ref
    noisy = [r for i in ids for r in out[i].stats.rounds if r.drafter == "noisy"]
    assert noisy and sum(r.drafted for r in noisy) > 0 and sum(r.accepted for r in noisy) > 0


def test_model_drafter_sampling_in_batches_follows_the_target(soft_model):
    """Chi-square (alpha = 0.001, fixed seeds): the first token of sampled rows drafted by a model
    drafter (dense q: the rejection sampler's residual path) in a batch follows the target."""
    prompt = [3, 4, 5, 6, 3, 4, 5, 6, 3, 4, 5]
    with torch.inference_mode():
        probs = torch.softmax(soft_model(torch.tensor([prompt])).logits[0, -1].float(), -1).tolist()
    engine = SpeculativeEngine(soft_model, [_model_drafter(soft_model)], k=3)
    counts, drafted = [0] * VOCAB, 0
    for trial in range(50):
        batch = BatchEngine(engine, max_batch=8)
        ids = [batch.add(prompt, max_new_tokens=2, temperature=1.0, seed=1000 * trial + j) for j in range(6)]
        first = {}
        while len(batch):
            for ev in batch.step():
                if ev.request not in first and ev.tokens:
                    first[ev.request] = ev.tokens[0]
                    drafted += ev.round.drafted
        for i in ids:
            counts[first[i]] += 1
    assert drafted > 100
    stat, p_value, cells = chisquare_gof(counts, probs)
    assert cells >= 3 and p_value > 1e-3, (stat, p_value, counts)


# -- the transformers backend's prefix cache ---------------------------------------------------------
def test_prefix_cache_starts_a_prompt_from_the_longest_kept_prefix(model):
    """``prefix_cache`` on the transformers backend: a prompt sent again reuses all but its last
    token, with the next logits a fresh prefill gives bit for bit; one sharing a prefix reuses
    that prefix, and a prompt it holds is not copied into it again; turned off, nothing is
    reused and the kept prefixes go."""
    target = SpeculativeEngine(model, ["none"], selector="static").target
    assert target.supports_prefix_cache and not target.prefix_cache
    a = _prompts(6)[5]  # 40 tokens
    b = a[:25] + [(a[25] + 1) % VOCAB, 2, 3, 4, 5]  # shares 25 tokens

    def next_logits(prompt):
        state = target.new_state()
        reused = target.prefill(state, prompt)
        return reused, target.forward(state, prompt[-1:], keep=1)[0]

    _, fresh_a = next_logits(a)
    _, fresh_b = next_logits(b)
    target.prefix_cache = True
    try:
        assert target.cached_prefix(a) == 0
        assert next_logits(a)[0] == 0 and target.prefixes == [a[:-1]]
        assert target.cached_prefix(a) == 39 and target.cached_prefix(b) == 25
        store, copies = target._prefixes, []
        keep = store.keep
        store.keep = lambda *args: copies.append(args[0]) or keep(*args)
        reused, again = next_logits(a)
        assert reused == 39 and torch.equal(again, fresh_a)
        assert copies == []  # a prompt the store holds is not copied into it again
        del store.keep
        reused, shared = next_logits(b)
        assert reused == 25 and torch.allclose(shared, fresh_b, atol=1e-5)
        assert target.prefixes == [a[:-1], b[:-1]]
    finally:
        target.prefix_cache = False
    assert next_logits(a)[0] == 0 and target.prefixes == []


def test_prefix_cache_keeps_prefixes_by_lru_within_its_size(model):
    """Kept prefixes: one a newer prompt extends is dropped, one that holds a newer prompt only
    moves to the end, and past ``prefix_cache_tokens`` the least recently used go (the newest
    always stays)."""
    target = SpeculativeEngine(model, ["none"], selector="static").target
    target.prefix_cache, target.prefix_cache_tokens = True, 50
    p = [list(range(i, i + 21)) for i in (0, 1, 2)]  # 20 tokens kept a prompt
    for prompt in p:
        target.prefill(target.new_state(), prompt)
    assert target.prefixes == [p[1][:-1], p[2][:-1]]  # 60 > 50: the oldest went
    target.prefill(target.new_state(), p[1][:11])  # held by p[1]'s entry: it becomes the newest
    assert target.prefixes == [p[2][:-1], p[1][:-1]]
    longer = p[2] + [7] * 10
    target.prefill(target.new_state(), longer)  # extends p[2]: that entry goes
    assert target.prefixes == [p[1][:-1], longer[:-1]]
    target.prefix_cache_tokens = 10
    target.prefill(target.new_state(), p[0])
    assert target.prefixes == [p[0][:-1]]  # over the size alone: kept
    target.prefix_cache = False


def test_batched_rows_start_from_the_prefix_cache(model):
    """In the batch engine a prompt that shares a kept prefix computes only the rest (a long
    one whose rest fits a piece goes whole), reports the reused tokens, and answers as a fresh
    run does on this fp32 model."""
    engine = _engine(model, "pld-k6")
    system = _prompts(6)[5] + _prompts(6)[4]  # 70 tokens: over prefill_chunk
    prompts = [system + [3, 4, 5], system + [6, 7], system + [8]]
    ref = [engine.generate(p, max_new_tokens=12).token_ids for p in prompts]
    engine.target.prefix_cache = True
    try:
        batch = BatchEngine(engine, max_batch=3, prefill_chunk=32)
        ids = [batch.add(p, max_new_tokens=12) for p in prompts]
        out = batch.run()
    finally:
        engine.target.prefix_cache = False
    assert [out[i].token_ids for i in ids] == ref
    assert [out[i].stats.cached_prompt_tokens for i in ids] == [0, 70, 70]
