"""Batched rows on llama.cpp (``backends.llamacpp.LlamaCppRows``): every row's inputs in one
``llama_batch`` with its own ``seq_id``, per-sequence removal of rejected drafts, rows joining
and leaving; greedy output per prompt against the same engine one request at a time (judged
with the backend's near-tie bound: llama.cpp's kernels are not batch-invariant), sampling
against the target's distribution. SmolLM2's GGUF file on llama.cpp (skipped without
llama-cpp-python)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from conftest import chisquare_gof, real_model_threads

from adaspec import SpeculativeEngine
from adaspec.batch import BatchEngine, measure_row_costs
from adaspec.errors import ConfigError
from adaspec.exactness import divergence_gap
from adaspec.models import embedded_gguf

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                                reason="llama-cpp-python is not installed")

PROMPTS = ["Repeat exactly: red, green, blue, red, green, blue, red, green,",
           "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return",
           "The capital of France is",
           "Count: 1, 2, 3, 4, 5, 6,",
           "Once upon a time",
           "List: apples, pears, plums, apples, pears,"]


def _target(**kw):
    from adaspec.backends.llamacpp import LlamaCppTarget, gguf_tokenizer

    path = embedded_gguf()
    kw = {"n_ctx": 4096, "n_seq_max": 12, **kw}
    return LlamaCppTarget(path, name="smollm2", tokenizer=gguf_tokenizer(path), threads=real_model_threads(), **kw)


@pytest.fixture(scope="module")
def llama():
    return _target()


def _ids(target, n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, 5000, (n,), generator=g).tolist()


def _margin_move(single: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
    """Per row, how far ``block`` moves the log-probability margin between ``single``'s two best
    tokens (nats)."""
    lp_s, lp_b = torch.log_softmax(single.double(), -1), torch.log_softmax(block.double(), -1)
    top2 = torch.topk(lp_s, 2, dim=-1).indices
    sign = torch.tensor([1.0, -1.0], dtype=torch.float64)
    return ((lp_s.gather(1, top2) @ sign) - (lp_b.gather(1, top2) @ sign)).abs()


def test_llamacpp_target_batches_its_rows(llama):
    from adaspec.backends.llamacpp import LlamaCppRows

    rows = llama.new_rows()
    assert isinstance(rows, LlamaCppRows) and rows.batched and len(rows) == 0
    assert llama.batching_problem() is None
    engine = SpeculativeEngine(llama, ["prompt-lookup"], k=3)
    from adaspec.batch import batching_problem

    assert batching_problem(engine) is None


@pytest.mark.parametrize("n_batch", [512, 6])
def test_forward_rows_of_several_widths_equal_each_rows_own_forward(n_batch):
    """Rows of widths 1, 3, 5 and 2 (one just prefilled, its first input the pending prompt
    token) in one batch, also split over several ``llama_decode`` calls (n_batch 6): logits
    [rows, 5, vocab], zero past a row's width, each row's within the near-tie bound of the same
    inputs on its own sequence; ``keep``/``end_round`` leave each sequence with its kept
    prefix, whose next forward matches a fresh sequence's."""
    target = _target(n_batch=n_batch, n_seq_max=6)
    prompts = [_ids(target, n, s) for n, s in ((9, 1), (20, 2), (4, 3), (13, 4))]
    inputs = [[prompts[0][-1]], [prompts[1][-1], *_ids(target, 2, 5)], [prompts[2][-1], *_ids(target, 4, 6)],
              [prompts[3][-1], 77]]
    rows = target.new_rows()
    for r, p in enumerate(prompts):
        s = target.new_state()
        if r == 0:
            target.prefill(s, p)  # the pending path: its row comes from the prompt's batch
        else:
            target.forward(s, p[:-1], keep=1)
        rows.join(s, len(p) - 1)
    logits = rows.forward(inputs)
    assert logits.shape == (4, 5, target.vocab_size)
    for r, x in enumerate(inputs):
        assert torch.all(logits[r, len(x):] == 0)
        own = target.new_state()
        try:
            target.forward(own, prompts[r][:-1], keep=1)
            want, _ = target.forward(own, x, keep=len(x))
        finally:
            target.release(own)
        assert float(_margin_move(want, logits[r, : len(x)]).max()) < target.near_tie_nats
        assert target.state_length(rows.state(r)) == len(prompts[r]) - 1 + len(x)
    kept = [1, 2, 5, 1]
    for r, k in enumerate(kept):
        rows.keep(r, k)
    rows.end_round()
    for r, k in enumerate(kept):
        s = rows.state(r)
        assert s.length == len(prompts[r]) - 1 + k and s.tokens == [*prompts[r][:-1], *inputs[r][:k]]
    nxt = [[11], [12, 13], [14], [15]]
    again = rows.forward(nxt)
    for r, k in enumerate(kept):
        fresh = target.new_state()
        try:
            target.forward(fresh, [*prompts[r][:-1], *inputs[r][:k]], keep=1)
            want, _ = target.forward(fresh, nxt[r], keep=len(nxt[r]))
        finally:
            target.release(fresh)
        assert float(_margin_move(want, again[r, : len(nxt[r])]).max()) < target.near_tie_nats
    rows.end_round()  # nothing kept: back to the kept prefixes
    assert [rows.state(r).length for r in range(4)] == [len(p) - 1 + k for p, k in zip(prompts, kept)]
    free = target.free_states()
    rows.leave([1, 2])
    assert len(rows) == 2 and target.free_states() == free + 2
    rows.release()
    assert target.free_states() == 6


def test_forward_rows_errors(llama):
    rows = llama.new_rows()
    s = llama.new_state()
    rows.join(s, 0)
    with pytest.raises(ConfigError, match="1 rows"):
        rows.forward([[1], [2]])
    with pytest.raises(ConfigError, match="at least one input token"):
        rows.forward([[]])
    with pytest.raises(RuntimeError, match="without a forward"):
        rows.keep(0, 1)
    rows.release()
    with pytest.raises(ConfigError, match="not a live sequence"):
        llama.forward_rows([s], [[1]])


def _judge(target, engine, prompt: str, reference: list[int], output: list[int]) -> tuple[int, float | None]:
    """Where ``output`` first differs from ``reference`` and the margin plain decoding saw there."""
    return divergence_gap(target, engine.encode_prompt(prompt, True), reference, output)


def _run_batch(batch: BatchEngine, prompts, budgets, **kw):
    ids = [batch.add(p, max_new_tokens=n, **kw) for p, n in zip(prompts, budgets)]
    outs = {i: [] for i in ids}
    order, widths = [], set()
    while len(batch):
        events = batch.step()
        assert len(batch.active) <= batch.max_batch
        if len(events) > 1:
            widths.add(tuple(sorted(ev.round.drafted for ev in events if ev.round is not None)))
        for ev in events:
            outs[ev.request].extend(ev.tokens)
            if ev.finished:
                order.append(ev.request)
                assert ev.result.token_ids == outs[ev.request]
    return ids, outs, order, widths


@pytest.mark.parametrize("config", ["pld-k4", "mixed"])
def test_batched_greedy_equals_one_at_a_time_up_to_near_ties(llama, config):
    """Five prompts through a batch of 3 (rows join as others finish, budgets differ): each
    output equals the engine's one-at-a-time output, or differs first where the two tokens'
    margin under plain decoding is within the backend's near-tie bound (printed). Drafts are
    proposed and accepted in batched rounds, of several widths in one round."""
    engine = SpeculativeEngine(llama, ["prompt-lookup", "suffix", "none"], selector="static",
                               k=4 if config == "pld-k4" else 3)
    per_request = {"pld-k4": [dict(drafters=[0], selector="static", k=4)] * 5,
                   "mixed": [dict(drafters=[0], selector="static", k=1), dict(drafters=[1], selector="static", k=5),
                             dict(drafters=[2], selector="static", k=1), dict(drafters=[0], selector="static", k=6),
                             dict(drafters=[1], selector="static", k=2)]}[config]
    budgets = [24, 8, 16, 12, 20]
    prompts = [PROMPTS[i] for i in (0, 1, 2, 3, 5)]
    refs = []
    for p, n, s in zip(prompts, budgets, per_request):
        refs.append(engine.with_policies(s["drafters"], selector=s["selector"], k=s["k"])
                    .generate(p, max_new_tokens=n).token_ids)
    batch = BatchEngine(engine, max_batch=3)
    ids = [batch.add(p, max_new_tokens=n, **s) for p, n, s in zip(prompts, budgets, per_request)]
    outs = {i: [] for i in ids}
    drafted = accepted = 0
    widths, finished = set(), []
    while len(batch):
        events = batch.step()
        assert len(batch.active) <= 3
        if len(events) > 1:
            widths.add(tuple(sorted({ev.round.drafted for ev in events if ev.round is not None})))
            drafted += sum(ev.round.drafted for ev in events if ev.round is not None)
            accepted += sum(ev.round.accepted for ev in events if ev.round is not None)
        for ev in events:
            outs[ev.request].extend(ev.tokens)
            if ev.finished:
                finished.append(ev.request)
    assert drafted > 0 and accepted > 0
    if config == "mixed":
        assert any(len(w) >= 2 for w in widths), widths
    assert finished[0] in ids[:3] and sorted(finished) == ids  # a row left, and the queue refilled it
    for i, p, ref in zip(ids, prompts, refs):
        at, gap = _judge(llama, engine, p, ref, outs[i])
        if gap is None:
            assert outs[i] == ref
        else:
            print(f"{config}: prompt {i} differs at token {at}, margin {gap:.4f} nats")
            assert gap <= llama.near_tie_nats, (i, at, gap)
    assert llama.free_states() >= 12 - 1  # every row's sequence back (one kept at most)


def _rows_read_the_next_rows_logits(monkeypatch) -> None:
    """BUG: every row of a batched llama.cpp forward is verified on the next row's logits."""
    from adaspec.backends.llamacpp import LlamaCppRows

    real = LlamaCppRows.forward
    monkeypatch.setattr(LlamaCppRows, "forward", lambda self, inputs: real(self, inputs).roll(1, dims=0))


def test_the_near_tie_judge_catches_rows_reading_other_rows(llama, monkeypatch):
    """The negative control of the greedy check: rows verified on another row's logits give
    outputs whose first difference lies far beyond the near-tie bound."""
    engine = SpeculativeEngine(llama, ["prompt-lookup"], selector="static", k=3)
    prompts = PROMPTS[:3]
    refs = [engine.generate(p, max_new_tokens=8).token_ids for p in prompts]
    _rows_read_the_next_rows_logits(monkeypatch)
    out = engine.generate_batch(prompts, max_new_tokens=8, max_batch=3)
    gaps = [_judge(llama, engine, p, ref, r.token_ids)[1] for p, ref, r in zip(prompts, refs, out)]
    assert any(g is not None and g > llama.near_tie_nats for g in gaps), gaps


def test_rows_join_and_leave_one_row_running_alone(llama):
    """A batch of 2 with budgets that make rows leave mid-run (and a lone row run on its own
    sequence between batched rounds): every sequence is released at the end."""
    engine = SpeculativeEngine(llama, ["prompt-lookup"], selector="static", k=4)
    before = llama.free_states()
    budgets = [3, 30, 6]
    batch = BatchEngine(engine, max_batch=2)
    ids, outs, order, _ = _run_batch(batch, PROMPTS[:3], budgets)
    assert order[0] == ids[0] and [len(outs[i]) for i in ids] == budgets
    assert llama.free_states() == before


@pytest.mark.slow
@pytest.mark.parametrize("bug", [None, "rows-read-other-rows"])
def test_batched_llamacpp_sampling_follows_the_target(llama, bug, monkeypatch):
    """The first sampled token (T=1) of rows whose drafts (prompt lookup, k=3) are verified in
    batches with greedy mates of another prompt follows the target's softmax after the prompt:
    chi-square at alpha 0.001 over 320 fixed seeds. The negative control (each row verified on
    the next row's logits: a mate's) must be rejected."""
    base = _ids(llama, 5, 7)
    prompt = base * 3 + base[:2]
    mate = _ids(llama, 12, 8)
    s = llama.new_state()
    try:
        logits, _ = llama.forward(s, prompt, keep=1)
    finally:
        llama.release(s)
    p = torch.softmax(logits[-1].double(), -1)
    if bug:
        _rows_read_the_next_rows_logits(monkeypatch)
    engine = SpeculativeEngine(llama, ["prompt-lookup"], k=3)
    counts = torch.zeros(llama.vocab_size, dtype=torch.float64)
    drafted, n = 0, 0
    for trial in range(80):
        batch = BatchEngine(engine, max_batch=8)
        ids = []
        for j in range(4):
            batch.add(mate, max_new_tokens=3)
            ids.append(batch.add(prompt, max_new_tokens=2, temperature=1.0, seed=100 * trial + j))
        first = {}
        while len(batch):
            for ev in batch.step():
                if ev.request in ids and ev.request not in first:
                    first[ev.request] = ev.tokens[0]
                    drafted += ev.round.drafted
        for i in ids:
            counts[first[i]] += 1
            n += 1
    assert drafted > 0
    top = torch.argsort(p, descending=True)[:20]
    obs = [*counts[top].tolist(), n - counts[top].sum().item()]
    exp = [*p[top].tolist(), 1 - p[top].sum().item()]
    _, pval, _ = chisquare_gof(obs, exp)
    if bug:
        assert pval < 1e-3
    else:
        assert pval > 1e-3


def test_row_cost_grid_through_the_batched_rows(llama):
    """The batch cost grid of a llama.cpp target is timed through its batched rows: a value per
    context, row count and width; more rows than free sequences is a clear error."""
    costs = measure_row_costs(llama, rows=[1, 3], widths=[1, 2], contexts=[16, 40], repeats=1, warmup=0)
    assert costs.rows == [1, 3] and costs.widths == [1, 2] and costs.contexts == [16, 40]
    assert all(t > 0 for per_rows in costs.seconds for per_w in per_rows for t in per_w)
    assert llama.free_states() >= 11
    with pytest.raises(ConfigError, match="needs 64 free KV states"):
        measure_row_costs(llama, rows=[64], widths=[1], contexts=[16])


def test_served_llamacpp_requests_share_rounds_and_answer_as_one_at_a_time(llama):
    """``adaspec serve --backend llama.cpp --max-batch 3`` (prefix cache off): five concurrent
    completions, some streamed, share batched rounds; each answer's tokens equal the engine's one
    request at a time, or differ first at a near-tie of plain decoding (printed)."""
    import asyncio
    import json

    import httpx
    from serving import serve_in_thread

    from adaspec.config import GenerationConfig
    from adaspec.serve import ServeConfig, create_app

    engine = SpeculativeEngine(llama, ["prompt-lookup", "suffix"], selector="round-robin", length=3)
    app = create_app(engine, ServeConfig(model_id="smollm2", selector="round-robin", length=3, k=3, max_batch=3,
                                         prefix_cache=False, state_file=None))
    prompts = [PROMPTS[i] for i in (0, 1, 3, 5, 2)]
    budgets = [20, 12, 16, 8, 10]
    executor = app.state.server.scheduler._batch
    sizes, tokens = [], {}
    step, deliver = executor.batch.step, executor._deliver

    def spy_step():
        sizes.append(len(executor.batch.active))
        return step()

    def spy_deliver(ev):
        tokens.setdefault(tuple(executor.live[ev.request].job.plan.prompt_ids), []).extend(ev.tokens)
        return deliver(ev)

    executor.batch.step, executor._deliver = spy_step, spy_deliver

    async def main(base):
        async with httpx.AsyncClient(base_url=base, timeout=600) as http:
            return await asyncio.gather(*[
                http.post("/v1/completions", json={"model": "smollm2", "prompt": p, "max_tokens": n,
                                                   "temperature": 0, "stream": i % 2 == 1})
                for i, (p, n) in enumerate(zip(prompts, budgets))])

    with serve_in_thread(app) as base:
        responses = asyncio.run(main(base))
    assert max(sizes) > 1 and max(sizes) <= 3
    for i, (resp, p, n) in enumerate(zip(responses, prompts, budgets)):
        assert resp.status_code == 200
        if i % 2 == 1:
            got = "".join(json.loads(line[6:])["choices"][0]["text"] for line in resp.text.splitlines()
                          if line.startswith("data: {"))
        else:
            got = resp.json()["choices"][0]["text"]
        ids = engine.encode_prompt(p, False)
        served = tokens[tuple(ids)]
        assert got == engine.decode(served)
        want = engine.generate(p, GenerationConfig(max_new_tokens=n, chat_template=False))
        at, gap = divergence_gap(llama, ids, want.token_ids, served)
        if gap is None:
            assert served == want.token_ids and got == want.text
        else:
            print(f"served prompt {i} differs at token {at}, margin {gap:.4f} nats")
            assert gap <= llama.near_tie_nats


SYSTEM = "You are a careful assistant. Answer in one short sentence, and never add anything else. "


def test_batched_requests_share_a_prefix_from_the_prefix_cache(llama):
    """With ``prefix_cache`` on, a request that joins a batch while others decode starts from a
    finished request's KV (their shared system prompt), as the kept prefix survives the batch's
    rounds; its answer equals the one a fresh engine gives, or differs first at a near-tie of
    plain decoding (the reused KV was computed in other batches). Off: nothing is reused."""
    engine = SpeculativeEngine(llama, ["prompt-lookup"], selector="static", k=3)
    prompts = [SYSTEM + "What colour is the sky?", "Count: 1, 2, 3, 4, 5, 6,", SYSTEM + "What colour is grass?"]
    budgets = [4, 30, 12]
    shared = len(engine.encode_prompt(SYSTEM, False))
    results = {}
    for cache in (False, True):
        llama.prefix_cache = cache
        try:
            batch = BatchEngine(engine, max_batch=2)
            ids = [batch.add(p, max_new_tokens=n, chat_template=False) for p, n in zip(prompts, budgets)]
            out = batch.run()
            results[cache] = [out[i] for i in ids]
        finally:
            llama.prefix_cache = False
            llama.drop_prefixes()
    assert [r.stats.cached_prompt_tokens for r in results[False]] == [0, 0, 0]
    on = results[True]
    assert on[0].stats.cached_prompt_tokens == 0 and shared - 2 <= on[2].stats.cached_prompt_tokens < len(on[2].prompt_ids)
    for p, n, r in zip(prompts, budgets, on):
        want = engine.generate(p, max_new_tokens=n, chat_template=False)
        at, gap = divergence_gap(llama, want.prompt_ids, want.token_ids, r.token_ids)
        if gap is not None:
            print(f"prefix cache on: {p!r} differs at token {at}, margin {gap:.4f} nats")
            assert gap <= llama.near_tie_nats


def test_a_full_kv_cache_frees_the_kept_prefixes_then_says_so():
    """The sequences share ``n_ctx`` cells: where a forward finds them full, the kept prefixes
    give way and it runs; where live states hold them, the error names the cause and the fix."""
    target = _target(n_ctx=256, n_seq_max=4, prefix_cache=True, prefix_cache_tokens=1000)
    ids = _ids(target, 400, 31)
    s = target.new_state()
    target.prefill(s, ids[:200])
    target.release(s)
    assert [len(p) for p in target.prefixes] == [200]
    s = target.new_state()
    logits, _ = target.forward(s, ids[200:300], keep=1)  # 200 kept + 100 > 256: the prefix goes
    assert target.prefixes == [] and s.length == 100
    rows = target.new_rows()
    rows.join(s, 100)
    other = target.new_state()
    target.forward(other, ids[300:400], keep=1)
    rows.join(other, 100)
    with pytest.raises(RuntimeError, match="KV cells that every sequence shares are full.*--max-batch"):
        rows.forward([ids[:40], ids[40:80]])  # 200 held + 80 > 256
    assert [rows.state(r).length for r in range(2)] == [100, 100]  # cut back to before the call
    target.prefix_cache = False
    rows.release()
