"""``adaspec serve --max-batch N``: concurrent requests decoded together on a tiny model give the
answers of plain decoding; cancellation and deadlines stop a batched job within one round."""

from __future__ import annotations

import asyncio
import signal

import httpx
import numpy as np
import pytest

from serving import free_port, serve_in_thread, start_cli_server, wait_until_up
from test_serve_load import _load, expected  # noqa: F401 - the load test's prompts and answers
from test_serve import (TEXT, _InlineLoop, assert_stopped_within_one_round, model_dir,  # noqa: F401
                        reference)  # the same tiny model fixtures and checks

from adaspec.batch import BatchEngine
from adaspec.config import GenerationConfig
from adaspec.engine import SpeculativeEngine
from adaspec.models import load_model
from adaspec.serve import ServeConfig, create_app
from adaspec.serve.metrics import ServerMetrics
from adaspec.serve.scheduler import BatchExecutor, Delta, Failed, Finished, Job, Plan
from adaspec.serve.state import LearntState


MODEL = "tiny"


def test_concurrent_requests_are_batched_and_exact(model_dir, reference):
    engine = SpeculativeEngine(load_model(model_dir), ["prompt-lookup", "suffix"],
                               selector="ucbspec:scope=global", length=4)
    app = create_app(engine, ServeConfig(model_id=MODEL, selector="ucbspec:scope=global", length=4, k=4,
                                         max_batch=4))
    prompts = [f"w0{i} w1{i} w0{i} w1{i} w0{i}" for i in range(1, 7)]
    budgets = [12, 5, 20, 9, 16, 3]
    batch_sizes = []
    executor = app.state.server.scheduler._batch
    step = executor.batch.step

    def spy():
        batch_sizes.append(len(executor.batch.active))
        return step()

    executor.batch.step = spy

    async def main(base):
        async with httpx.AsyncClient(base_url=base, timeout=60) as http:
            calls = [http.post("/v1/completions", json={"model": MODEL, "prompt": p, "max_tokens": n,
                                                        "temperature": 0, "stream": i % 2 == 1})
                     for i, (p, n) in enumerate(zip(prompts, budgets))]
            return await asyncio.gather(*calls)

    with serve_in_thread(app) as base:
        responses = asyncio.run(main(base))
    for i, (resp, p, n) in enumerate(zip(responses, prompts, budgets)):
        assert resp.status_code == 200
        want = reference.generate(p, GenerationConfig(max_new_tokens=n, chat_template=False)).text
        if i % 2 == 1:  # streamed: concatenate the chunks
            import json
            chunks = [json.loads(line[6:]) for line in resp.text.splitlines()
                      if line.startswith("data: {")]
            got = "".join(c["choices"][0]["text"] for c in chunks)
        else:
            got = resp.json()["choices"][0]["text"]
        assert got == want, i
    assert max(batch_sizes) > 1  # requests really shared rounds
    assert max(batch_sizes) <= 4


@pytest.mark.parametrize("what", ["cancel", "timeout"])
def test_batched_cancel_and_timeout_stop_within_one_round(model_dir, what):
    engine = SpeculativeEngine(load_model(model_dir), ["prompt-lookup", "suffix"])
    executor = BatchExecutor(engine, LearntState(engine.cost_model), ServerMetrics(), timeout_s=7, max_batch=2)
    ids = engine.encode_prompt(TEXT, chat_template=False)
    plan = Plan(ids, GenerationConfig(max_new_tokens=40), [0, 1], "round-robin", 2, 2, "text")
    target = None

    def after(event):
        if isinstance(event, Delta):
            if what == "cancel":
                target.cancel()
            else:
                target.deadline = 0.0

    loop = _InlineLoop(after)
    target = Job(plan, loop, deadline=1e18)
    other_loop = _InlineLoop(lambda e: None)
    other = Job(Plan(ids, GenerationConfig(max_new_tokens=6), [0], None, 2, 2, "text"), other_loop, deadline=1e18)
    assert executor.admit(target) is None and executor.admit(other) is None
    ended = []
    while executor.live:
        ended += executor.step()
    outcomes = {id(job): outcome for job, outcome in ended}
    assert outcomes[id(target)] == ("cancelled" if what == "cancel" else "timeout")
    assert outcomes[id(other)] == "ok"
    assert_stopped_within_one_round(loop.events, what)
    assert isinstance(other_loop.events[-1], Finished)  # the batch mate finishes normally
    assert executor.batch.active == [] and len(executor.batch) == 0


def test_load_with_max_batch_8_gets_exact_answers(model_dir, expected, tmp_path):
    """The load test of ``adaspec serve`` (streaming openai clients, every answer equal to its
    greedy text, clean SIGTERM) against ``--max-batch 8`` with the default drafters and ``auto``."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = start_cli_server(model_dir, port, tmp_path / "state.json", "--max-batch", "8",
                            cache=tmp_path / "cache")
    try:
        wait_until_up(proc, base, timeout=300)
        running: list[float] = []

        async def load_and_watch():
            task = asyncio.create_task(_load(base, clients=32, requests=256))
            async with httpx.AsyncClient(base_url=base, timeout=60) as http:
                while not task.done():
                    text = (await http.get("/metrics")).text
                    running.extend(float(line.split()[-1]) for line in text.splitlines()
                                   if line.startswith("adaspec_requests_running "))
                    await asyncio.sleep(0.05)
            return await task

        done, errors = asyncio.run(load_and_watch())
        assert not errors and len(done) == 256
        assert max(running) > 1  # requests were decoded together
        for o in done:
            assert o.finish_reason == "length" and o.text == expected[o.index], o
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0


def test_serve_batches_by_default_where_the_engine_can(model_dir):
    """``adaspec serve`` without --max-batch: 16 rows with model-free and model drafters (a model
    drafter forks a KV state per request); one request at a time with a drafter that cannot fork
    (said, not failed); an explicit N > 1 there is an error."""
    from adaspec.cli import SERVE_BATCH, serve_batch_size
    from adaspec.drafters import Drafter, NoDrafter
    from adaspec.errors import AdaspecError

    class Unforkable(NoDrafter):
        name = "unforkable"
        fork = Drafter.fork

    target = load_model(model_dir)
    assert serve_batch_size(SpeculativeEngine(target), None) == SERVE_BATCH == 16
    assert serve_batch_size(SpeculativeEngine(target), 3) == 3
    assert serve_batch_size(SpeculativeEngine(target, ["self"]), None) == SERVE_BATCH
    unforkable = SpeculativeEngine(target, [Unforkable()])
    assert serve_batch_size(unforkable, None) == 1
    assert serve_batch_size(unforkable, 1) == 1
    with pytest.raises(AdaspecError, match=r"--max-batch 4: drafter 'unforkable' cannot draft for several requests"):
        serve_batch_size(unforkable, 4)


def test_serve_measures_the_batch_grid_before_it_listens(model_dir, monkeypatch, tmp_path, capsys):
    """``adaspec serve`` measures the batch cost grid its cost-aware policies price batched rounds
    with before it listens, with progress (not in the first round two requests share), over
    the rows ``--max-batch`` allows; nothing without batching or without a policy that prices."""
    import adaspec.batch as batch_mod
    from adaspec.cli import measure_batch_grid

    monkeypatch.setenv("ADASPEC_CACHE", str(tmp_path))
    asked = []
    real = batch_mod.measure_batch_costs

    def measure(target, rows, widths, contexts, progress=None):
        asked.append(list(rows))
        return real(target, rows, widths[:2], contexts[:1], repeats=1, warmup=0, progress=progress)

    monkeypatch.setattr(batch_mod, "measure_batch_costs", measure)
    target = load_model(model_dir)
    measure_batch_grid(SpeculativeEngine(target, ["prompt-lookup"], k=3), 4)  # a static k prices nothing
    measure_batch_grid(SpeculativeEngine(target), 1)
    assert asked == []
    engine = SpeculativeEngine(target)  # auto
    measure_batch_grid(engine, 3)
    assert asked == [[1, 2, 4]]
    assert "measuring the batch cost grid (once)" in capsys.readouterr().err
    assert len(list((tmp_path / "costs").glob("batch-*.json"))) == 1
    batch = BatchEngine(engine, max_batch=3)  # the server's batch finds it: no second measurement
    for p in ([1, 2, 3, 4], [5, 6, 7], [1, 2, 3]):
        batch.add(p, max_new_tokens=3)
    batch.run()
    assert asked == [[1, 2, 4]] and batch.cost_model.batch is not None
    measure_batch_grid(engine, 3)
    assert asked == [[1, 2, 4]]


# -- sampling through the server: the joint distribution of several tokens ------------------------
SAMPLING_WORDS = [f"w{i:02d}" for i in range(8)]
#: prompts of different lengths that prompt lookup drafts from (token ids of SAMPLING_WORDS)
SERVED_PROMPTS = [[7, 3, 4, 7, 3, 4, 7, 3], [1, 6, 2, 1, 6, 2, 1, 6, 2, 1], [5, 0, 5, 0, 5]]
SERVED_SAMPLING = {"temperature": 0.8, "top_p": 0.95}


def _served_sampling_counts(max_batch: int, n_seeds: int):
    """Completions of every prompt for seeds 0..n_seeds-1 (the three prompts of a seed sent
    together), 3 tokens each, from a live server on a tiny 8-word model with prompt lookup at
    k=3; per prompt, the counts of the 3-token outputs and the drafts proposed and accepted."""
    from conftest import make_tiny_model, word_tokenizer
    from test_distribution import Runs

    from adaspec.models import as_loaded

    model = make_tiny_model(seed=0, vocab=len(SAMPLING_WORDS), init_std=0.2)
    tok = word_tokenizer(SAMPLING_WORDS)
    engine = SpeculativeEngine(as_loaded(model, tok, "tiny8"), ["prompt-lookup"], k=3)
    app = create_app(engine, ServeConfig(model_id=MODEL, selector="static", length=3, k=3, max_batch=max_batch))
    batch_sizes = []
    if max_batch > 1:
        executor = app.state.server.scheduler._batch
        step = executor.batch.step
        executor.batch.step = lambda: batch_sizes.append(len(executor.batch.active)) or step()

    async def main(base):
        async with httpx.AsyncClient(base_url=base, timeout=60) as http:
            out = []
            for first in range(0, n_seeds, 4):  # 12 requests in flight: 4 seeds of each prompt
                calls = [http.post("/v1/completions", json={"model": MODEL, "prompt": p, "max_tokens": 3,
                                                            "seed": seed, **SERVED_SAMPLING})
                         for seed in range(first, min(first + 4, n_seeds)) for p in SERVED_PROMPTS]
                done = await asyncio.gather(*calls)
                out += [done[j:j + len(SERVED_PROMPTS)] for j in range(0, len(done), len(SERVED_PROMPTS))]
            return out

    with serve_in_thread(app) as base:
        answers = asyncio.run(main(base))
    runs = [Runs(np.zeros((len(SAMPLING_WORDS),) * 3, dtype=np.int64), 0, 0, 0) for _ in SERVED_PROMPTS]
    for group in answers:
        for r, resp in zip(runs, group):
            assert resp.status_code == 200, resp.text
            body = resp.json()
            ids = tok.convert_tokens_to_ids(body["choices"][0]["text"].split())
            assert len(ids) == 3 and body["usage"]["completion_tokens"] == 3
            r.counts[tuple(ids)] += 1
            stats = body["adaspec"]
            r.drafted += stats["drafted"]
            r.accepted += stats["accepted"]
    return model, runs, batch_sizes


@pytest.mark.parametrize("max_batch, bug", [(1, None), (3, None), (3, "sampling-params-dropped"),
                                            (3, "rows-read-other-rows")])
def test_served_sampling_follows_the_target_over_three_tokens(max_batch, bug, monkeypatch):
    """``adaspec serve`` (one request at a time, and ``--max-batch 3`` with 12 requests in flight):
    the 3 sampled tokens of each prompt (T=0.8, top-p 0.95, 300 fixed seeds) follow the target's
    processed distribution, computed by enumeration, chi-square at ALPHA = 0.001 per prompt (3
    prompts: family-wise at most 0.003), drafts proposed, accepted and rejected. Negative
    controls, each rejected at ALPHA on every prompt with the same seeds: a server that samples
    at T=1 without top-p whatever the request says; batched rows verified on the next row's
    logits."""
    from test_batch import _rows_read_the_next_rows_logits
    from test_distribution import check_exact, exact_distribution

    from adaspec.config import SamplingConfig

    if bug == "rows-read-other-rows":
        _rows_read_the_next_rows_logits(monkeypatch)
    elif bug == "sampling-params-dropped":
        monkeypatch.setattr("adaspec.serve.app.SamplingConfig",
                            lambda temperature, top_k, top_p, seed: SamplingConfig(1.0, top_k, 1.0, seed))
    model, runs, batch_sizes = _served_sampling_counts(max_batch, 300)
    if max_batch > 1:
        assert max(batch_sizes) > 1  # requests shared rounds
    for i, (r, prompt) in enumerate(zip(runs, SERVED_PROMPTS)):
        exact = exact_distribution(model, prompt, SamplingConfig(**SERVED_SAMPLING), 3)
        assert (exact == 0).any()  # top-p removes tokens: the support is checked too
        check_exact(r, exact, f"served prompt {i}, max_batch {max_batch}", bug)


def test_the_default_suffix_drafter_learns_across_batched_requests(model_dir, reference):
    """``serve_drafters``: every request's suffix drafter (a fork) drafts from one store of the
    earlier answers, so a repeated request drafts its answer from the first one's (a rounds
    count a store-less server does not reach), and every answer stays greedy's; 0 tokens: the
    engine's default drafters, no store."""
    from adaspec.drafters.suffix import SuffixDrafter
    from adaspec.engine import default_drafters
    from adaspec.errors import AdaspecError
    from adaspec.serve import serve_drafters

    assert serve_drafters("transformers", 0) == list(default_drafters("transformers"))
    assert "suffix:learn=true,max_tokens=1000" in serve_drafters("transformers", 1000)
    with pytest.raises(AdaspecError, match="--suffix-store-tokens must be >= 0"):
        serve_drafters("transformers", -1)
    prompt, n = "w03 w17 w09 w21 w30 w05", 24
    want = reference.generate(prompt, GenerationConfig(max_new_tokens=n, chat_template=False)).text

    def serve(store_tokens):
        specs = [d for d in serve_drafters("transformers", store_tokens) if d.startswith("suffix")]
        engine = SpeculativeEngine(load_model(model_dir), specs, selector="static", length=4)
        app = create_app(engine, ServeConfig(model_id=MODEL, selector="static", length=4, k=4, max_batch=4,
                                             prefill_chunk=3))  # the prompt in pieces
        assert app.state.server.scheduler._batch.batch.prefill_chunk == 3

        async def main(base):
            async with httpx.AsyncClient(base_url=base, timeout=60) as http:
                async def ask():
                    return await http.post("/v1/completions", json={"model": MODEL, "prompt": prompt,
                                                                    "max_tokens": n, "temperature": 0})
                first = await asyncio.gather(ask(), ask())  # batched together: neither has learnt yet
                return [*first, await ask()]

        with serve_in_thread(app) as base:
            out = [r.json() for r in asyncio.run(main(base))]
        assert all(o["choices"][0]["text"] == want for o in out)
        return engine.drafters[0], [o["adaspec"]["rounds"] for o in out]

    drafter, rounds = serve(1000)
    assert isinstance(drafter, SuffixDrafter) and drafter.learn and len(drafter.datastore.docs) == 3
    plain, plain_rounds = serve(0)
    assert plain.datastore is None and plain_rounds[2] == plain_rounds[0]
    assert rounds[:2] == plain_rounds[:2] and rounds[2] <= n // 5 + 2 < plain_rounds[2]


@pytest.mark.parametrize("gather_s", [5.0, 0.0])
def test_a_starting_batch_waits_for_requests_being_read(model_dir, gather_s):
    """A batch with no first token yet waits (up to ``gather_s``) for a request a handler is still
    reading: the two start in one round. The control, ``gather_s=0``: the first request steps
    alone while the second is read."""
    import time

    from adaspec.serve.scheduler import Scheduler

    engine = SpeculativeEngine(load_model(model_dir), ["prompt-lookup"])
    executor = BatchExecutor(engine, LearntState(engine.cost_model), ServerMetrics(), timeout_s=60, max_batch=4)
    first_rounds: list[int] = []
    step = executor.step

    def spy():
        if not first_rounds:
            first_rounds.append(len(executor.live))
        return step()

    executor.step = spy
    scheduler = Scheduler(executor, max_queue=8, metrics=ServerMetrics(), gather_s=gather_s)
    loop = asyncio.new_event_loop()
    ids = engine.encode_prompt(TEXT, chat_template=False)

    def job():
        return Job(Plan(ids, GenerationConfig(max_new_tokens=6), [0], "round-robin", 2, 2, "text"), loop,
                   deadline=1e18)

    a, b = job(), job()
    scheduler.start()
    try:
        with scheduler.incoming():  # b is being read while a is queued
            scheduler.submit(a)
            time.sleep(0.3)
            assert first_rounds == ([] if gather_s else [1])
            scheduler.submit(b)
        give_up = time.monotonic() + 60
        for j in (a, b):
            got = []
            while not any(isinstance(e, Finished) for e in got):
                assert time.monotonic() < give_up and not any(isinstance(e, Failed) for e in got), got
                loop.run_until_complete(asyncio.sleep(0.01))
                while not j.events.empty():
                    got.append(j.events.get_nowait())
    finally:
        scheduler.stop(10)
        loop.close()
    assert first_rounds == ([2] if gather_s else [1])
