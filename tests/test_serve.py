"""adaspec serve on a tiny model: the official openai client against a live loopback server,
every bad input's status and error JSON, the queue, cancellation, metrics and the state file."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import openai
import pytest

from serving import save_tiny_chat_model, serve_in_thread, wait_for

from adaspec.config import GenerationConfig
from adaspec.engine import SpeculativeEngine
from adaspec.models import load_model
from adaspec.serve import ServeConfig, create_app
from adaspec.serve.output import TextAssembler
from adaspec.serve.protocol import APIError
from adaspec.serve.scheduler import BatchExecutor, Delta, Failed, Finished, Job, Plan
from adaspec.serve.state import LearntState
from adaspec.serve.metrics import ServerMetrics
from adaspec.selection import build_selector
from adaspec.length import build_length

MODEL = "tiny"
CHAT = [{"role": "system", "content": "w05 w06"}, {"role": "user", "content": "w01 w02 w03 w01 w02 w03 w01"}]
TEXT = "w07 w08 w09 w07 w08 w09 w07"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"))


@pytest.fixture(scope="module")
def reference(model_dir):
    """Plain autoregressive decoding of the same model (its own copy: no sharing with the server)."""
    return SpeculativeEngine(load_model(model_dir), [])


def make_app(model_dir, state_file=None, **overrides):
    engine = SpeculativeEngine(load_model(model_dir), ["prompt-lookup", "suffix"],
                               selector="ucbspec:scope=global", length=4)
    config = ServeConfig(model_id=MODEL, selector="ucbspec:scope=global", length=4, k=4,
                         state_file=state_file, **overrides)
    return create_app(engine, config)


@pytest.fixture(scope="module")
def live(model_dir, tmp_path_factory):
    """(base URL, app) of a server on a free 127.0.0.1 port for the whole module."""
    state = tmp_path_factory.mktemp("state") / "state.json"
    app = make_app(model_dir, state, save_every=3)
    with serve_in_thread(app) as base:
        yield base, app


@pytest.fixture
def client(live):
    return openai.OpenAI(base_url=f"{live[0]}/v1", api_key="unused", max_retries=0, timeout=60)


def expected(reference, prompt, n, chat=True):
    return reference.generate(prompt, GenerationConfig(max_new_tokens=n, chat_template=chat))


# -- the openai client ----------------------------------------------------------------------------
def test_chat_greedy_equals_generate_with_usage_and_stats(client, reference):
    want = expected(reference, CHAT, 24)
    resp = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24, temperature=0)
    choice = resp.choices[0]
    assert choice.message.content == want.text and choice.finish_reason == "length"
    assert resp.usage.prompt_tokens == len(want.prompt_ids)
    assert resp.usage.completion_tokens == 24 == len(want.token_ids)
    assert resp.usage.total_tokens == len(want.prompt_ids) + 24
    stats = resp.model_extra["adaspec"]
    assert resp.usage.prompt_tokens_details.cached_tokens == stats["cached_prompt_tokens"] < len(want.prompt_ids)
    assert stats["drafters"] == ["prompt-lookup", "suffix"] and stats["rounds"] >= 1
    assert abs(sum(stats["drafter_shares"].values()) - 1) < 1e-9
    assert stats["mat"] == pytest.approx(24 / stats["rounds"])
    assert set(stats["time_split_s"]) >= {"prefill", "target_forward", "drafting"}


def test_a_repeated_chat_starts_from_the_prefix_cache(client, reference):
    """The server's prefix cache (on by default, the transformers backend's ``PrefixStore``): a
    chat sent again takes every prompt token but the last from the first one's KV, says so in
    its usage, and answers with the same text as a fresh run."""
    chat = [{"role": "user", "content": "w05 w06 w07 w05 w06 w07 w05 w06 w07 w05 w06 w09"}]
    want = expected(reference, chat, 16)
    first = client.chat.completions.create(model=MODEL, messages=chat, max_tokens=16, temperature=0)
    again = client.chat.completions.create(model=MODEL, messages=chat, max_tokens=16, temperature=0)
    assert first.choices[0].message.content == again.choices[0].message.content == want.text
    assert again.usage.prompt_tokens_details.cached_tokens == len(want.prompt_ids) - 1
    assert again.model_extra["adaspec"]["cached_prompt_tokens"] == len(want.prompt_ids) - 1


def test_chat_stream_concatenates_to_the_non_streamed_text(client, reference):
    want = expected(reference, CHAT, 30)
    stream = client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=30,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    pieces = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(pieces) == want.text and sum(1 for p in pieces if p) > 1
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 30
    assert chunks[-1].usage.prompt_tokens == len(want.prompt_ids)


@pytest.mark.parametrize("prompt", [TEXT, [TEXT], "tokens"])
def test_completions_stream_and_not(client, reference, prompt):
    want = expected(reference, TEXT, 20, chat=False)
    if prompt == "tokens":
        prompt = want.prompt_ids
    resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0)
    assert resp.choices[0].text == want.text and resp.usage.completion_tokens == 20
    assert resp.usage.prompt_tokens == len(want.prompt_ids)
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_stop_strings_are_cut_in_both_modes(client, reference):
    words = expected(reference, TEXT, 20, chat=False).text.split()
    stop = f"{words[3]} {words[4]}"
    want = " ".join(words).split(stop)[0]
    resp = client.completions.create(model=MODEL, prompt=TEXT, max_tokens=20, temperature=0, stop=[stop, "zz"])
    assert resp.choices[0].text == want and resp.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model=MODEL, prompt=TEXT, max_tokens=20, temperature=0,
                                            stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_sampling_and_the_adaspec_field(client, reference):
    resp = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=16, temperature=0.8,
                                          top_p=0.9, seed=3)
    assert resp.usage.completion_tokens == 16 and resp.choices[0].message.content
    pick = {"drafters": ["suffix"], "selector": "static", "length": 3}
    resp = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=16, temperature=0,
                                          extra_body={"adaspec": pick})
    stats = resp.model_extra["adaspec"]
    assert stats["drafters"] == ["suffix"] and set(stats["drafter_shares"]) == {"suffix"}
    assert stats["selector"] == "static" and stats["length"] == 3
    assert resp.choices[0].message.content == expected(reference, CHAT, 16).text


def test_models_health_and_metrics(live, client):
    base, _ = live
    assert [m.id for m in client.models.list().data] == [MODEL]
    client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5, temperature=0)
    health = httpx.get(f"{base}/health").json()
    assert health["status"] == "ok" and health["learnt"]["requests"] >= 1
    text = httpx.get(f"{base}/metrics").text
    for name in ("adaspec_requests_total", "adaspec_completion_tokens_total", "adaspec_request_mat_bucket",
                 "adaspec_request_acceptance_rate_bucket", "adaspec_drafter_rounds_total",
                 "adaspec_queue_length", "adaspec_request_latency_seconds_bucket",
                 "adaspec_time_to_first_token_seconds_bucket"):
        assert name in text, name
    ok = [ln for ln in text.splitlines() if ln.startswith('adaspec_requests_total{endpoint="chat",status="ok"}')]
    assert ok and float(ok[0].split()[-1]) >= 1


# -- errors -----------------------------------------------------------------------------------------
def _msgs(**kw):
    return {"model": MODEL, "messages": [{"role": "user", "content": "w01 w02"}], **kw}


LONG = " ".join(["w01"] * 600)
BAD = [
    ("chat", b"{not json", 400, None),
    ("chat", b"[1, 2]", 400, None),
    ("chat", {"model": MODEL}, 400, "messages"),
    ("chat", {"model": MODEL, "messages": []}, 400, "messages"),
    ("chat", {"model": MODEL, "messages": "w01"}, 400, "messages"),
    ("chat", {"model": MODEL, "messages": [{"role": "wizard", "content": "w01"}]}, 400, "messages.0.role"),
    ("chat", {"model": MODEL, "messages": [{"role": "user", "content": 5}]}, 400, "messages.0.content"),
    ("chat", _msgs(model="gpt-9"), 404, "model"),
    ("chat", _msgs(messages=[{"role": "user", "content": LONG}]), 400, "messages"),
    ("chat", _msgs(max_tokens=0), 400, "max_tokens"),
    ("chat", _msgs(max_completion_tokens=-3), 400, "max_completion_tokens"),
    ("chat", _msgs(max_tokens=10_000), 400, "max_tokens"),
    ("chat", _msgs(max_tokens="5"), 400, "max_tokens"),
    ("chat", _msgs(temperature=-0.5), 400, "temperature"),
    ("chat", _msgs(temperature="hot"), 400, "temperature"),
    ("chat", _msgs(temperature=2.5), 400, "temperature"),  # OpenAI's bound: [0, 2]
    ("text", {"model": MODEL, "prompt": "w01", "temperature": 2.01}, 400, "temperature"),
    ("chat", _msgs(top_p=0), 400, "top_p"),
    ("chat", _msgs(top_p=1.5), 400, "top_p"),
    ("chat", _msgs(n=2), 400, "n"),
    ("chat", _msgs(logprobs=True), 400, "logprobs"),
    ("chat", _msgs(stop=[""]), 400, "stop"),
    ("chat", _msgs(stop=["a", "b", "c", "d", "e"]), 400, "stop"),  # OpenAI's bound: at most 4
    ("text", {"model": MODEL, "prompt": "w01", "stop": ["w1", "w2", "w3", "w4", "w5"]}, 400, "stop"),
    ("chat", _msgs(stream="yes"), 400, "stream"),
    ("chat", _msgs(adaspec={"turbo": True}), 400, "adaspec.turbo"),
    ("chat", _msgs(adaspec={"drafters": ["eagle"]}), 400, "adaspec.drafters"),
    ("chat", _msgs(adaspec={"selector": "nope"}), 400, "adaspec.selector"),
    ("chat", _msgs(adaspec={"length": "static:k=0"}), 400, "adaspec.length"),
    ("chat", _msgs(adaspec={"selector": "static:arm=1", "drafters": ["suffix"]}), 400, "adaspec"),
    ("text", {"model": MODEL, "prompt": ""}, 400, "prompt"),
    ("text", {"model": MODEL, "prompt": ["w01", "w02"]}, 400, "prompt"),
    ("text", {"model": MODEL, "prompt": [1, 99]}, 400, "prompt"),
    ("text", {"model": MODEL, "prompt": LONG}, 400, "prompt"),
    ("text", {"model": MODEL, "prompt": "w01", "logprobs": 2}, 400, "logprobs"),
]


@pytest.mark.parametrize("endpoint,body,status,param", BAD)
def test_bad_input_gets_openai_error_json(live, endpoint, body, status, param):
    url = f"{live[0]}/v1/{'chat/completions' if endpoint == 'chat' else 'completions'}"
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    resp = httpx.post(url, content=content, headers={"content-type": "application/json"}, timeout=60)
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param and "Traceback" not in resp.text


def test_unknown_routes_and_methods_are_openai_errors(live):
    for resp, status in ((httpx.get(f"{live[0]}/v1/nothing"), 404),
                         (httpx.get(f"{live[0]}/v1/chat/completions"), 405)):
        assert resp.status_code == status and set(resp.json()["error"]) == {"message", "type", "param", "code"}


def test_openai_client_raises_its_typed_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-9", messages=CHAT)
    with pytest.raises(openai.BadRequestError, match="n=3"):
        client.chat.completions.create(model=MODEL, messages=CHAT, n=3)


def test_sampling_bounds_are_openais(client):
    """temperature in [0, 2] and at most 4 stop strings, as OpenAI's API: past them a 400 whose
    message names the bound; the bounds themselves are served."""
    with pytest.raises(openai.BadRequestError, match=r"temperature must be in \[0, 2\].*got 2.5"):
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, temperature=2.5)
    with pytest.raises(openai.BadRequestError, match="at most 4 stop strings are allowed.*got 5"):
        client.completions.create(model=MODEL, prompt=TEXT, max_tokens=4, stop=["a", "b", "c", "d", "e"])
    resp = client.completions.create(model=MODEL, prompt=TEXT, max_tokens=4, temperature=2.0, seed=1,
                                     stop=["zz1", "zz2", "zz3", "zz4"])
    assert resp.usage.completion_tokens == 4


# -- queue, cancellation, timeout ------------------------------------------------------------------
class Gate:
    """Wraps the executor's admission so that jobs wait for ``open`` (deterministic queueing)."""

    def __init__(self, app):
        self.scheduler = app.state.server.scheduler
        executor = app.state.server.executor
        self.inner, self.event, self.started = executor.admit, threading.Event(), []
        executor.admit = self

    def __call__(self, job):
        self.started.append(job)
        self.event.wait(60)
        return self.inner(job)

    async def hold(self, http, body):
        """Send a request and wait until it holds the worker; returns its task."""
        task = asyncio.create_task(http.post("/v1/chat/completions", json=body))
        await asyncio.to_thread(wait_for, lambda: self.started, 30, "the first job to start")
        return task


def run_gated(model_dir, scenario, **overrides):
    """Run ``scenario(http, gate)`` against a live gated server; returns (app, its result)."""
    app = make_app(model_dir, **overrides)
    gate = Gate(app)

    async def main(base):
        async with httpx.AsyncClient(base_url=base, timeout=60) as http:
            return await scenario(http, gate)

    with serve_in_thread(app) as base:
        return app, asyncio.run(main(base))


def test_full_queue_answers_429_and_a_gone_client_frees_its_slot(model_dir, reference):
    body = _msgs(max_tokens=6, temperature=0)

    async def scenario(http, gate):
        first = await gate.hold(http, body)
        # the queue (1 place) takes a streaming request whose client then goes away
        gone = asyncio.create_task(http.post("/v1/chat/completions", json={**body, "stream": True}))
        await asyncio.to_thread(wait_for, lambda: gate.scheduler.waiting == 1, 30, "a queued job")
        full = await http.post("/v1/chat/completions", json=body)
        assert full.status_code == 429 and int(full.headers["retry-after"]) >= 1
        assert full.json()["error"]["code"] == "queue_full"
        queued = gate.scheduler._jobs[0]
        gone.cancel()  # closes its connection
        await asyncio.to_thread(wait_for, lambda: gate.scheduler.waiting == 0, 30,
                                "the disconnect to free the queue place")
        assert queued.cancelled.is_set()
        again = asyncio.create_task(http.post("/v1/chat/completions", json=body))  # takes the place
        gate.event.set()
        assert (await first).status_code == 200
        nxt = await again
        assert nxt.status_code == 200
        assert nxt.json()["choices"][0]["message"]["content"] == expected(reference, body["messages"], 6).text
        return queued

    app, queued = run_gated(model_dir, scenario, max_queue=1)
    assert queued.events.empty()  # skipped: never generated, nothing sent
    metrics = app.state.server.metrics.render().decode()
    assert 'adaspec_requests_total{endpoint="chat",status="cancelled"} 1.0' in metrics
    assert 'adaspec_requests_total{endpoint="chat",status="rejected"} 1.0' in metrics


def test_a_client_leaving_mid_stream_cancels_its_generation(live, client, reference):
    base, app = live
    metrics = app.state.server.metrics

    def cancelled():
        return metrics.requests.labels("chat", "cancelled")._value.get()

    before = cancelled()
    with httpx.Client(base_url=base, timeout=60) as http:
        with http.stream("POST", "/v1/chat/completions",
                         json=_msgs(max_tokens=480, temperature=0, stream=True)) as resp:
            next(resp.iter_lines())
    wait_for(lambda: cancelled() == before + 1, 60, "the stream's generation to be cancelled")
    resp = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=0)
    assert resp.choices[0].message.content == expected(reference, CHAT, 8).text


def test_requests_past_the_timeout_get_504(model_dir):
    body = _msgs(max_tokens=4, temperature=0)

    async def scenario(http, gate):
        first = await gate.hold(http, body)
        late = await http.post("/v1/chat/completions", json={**body, "stream": True})  # queued
        gate.event.set()
        return await first, late

    _, (first, late) = run_gated(model_dir, scenario, timeout_s=0.5)
    for resp in (first, late):
        assert resp.status_code == 504 and resp.json()["error"]["code"] == "timeout"


class _InlineLoop:
    """Stands in for the event loop: delivers a job's events at once, then calls ``after``."""

    def __init__(self, after):
        self.events, self.after = [], after

    def call_soon_threadsafe(self, fn, event):
        self.events.append(event)
        self.after(event)


def _job(engine, loop, deadline=1e18, n=40):
    ids = engine.encode_prompt(TEXT, chat_template=False)
    plan = Plan(ids, GenerationConfig(max_new_tokens=n), [0, 1], "round-robin", 2, 2, "text")
    return Job(plan, loop, deadline=deadline)


@pytest.mark.parametrize("what", ["cancel", "timeout"])
def test_cancel_and_timeout_stop_within_one_round(model_dir, what):
    engine = SpeculativeEngine(load_model(model_dir), ["prompt-lookup", "suffix"])
    executor = BatchExecutor(engine, LearntState(engine.cost_model), ServerMetrics(), timeout_s=7)
    job = None

    def after(event):
        if what == "cancel":
            job.cancel()
        else:
            job.deadline = 0.0

    loop = _InlineLoop(after)
    job = _job(engine, loop)
    outcome = executor.run(job)
    assert outcome == ("cancelled" if what == "cancel" else "timeout")
    assert_stopped_within_one_round(loop.events, what)


def assert_stopped_within_one_round(events, what):
    """One delta (the round that was running), then nothing but a 504 for a timeout."""
    deltas = [e for e in events if isinstance(e, Delta)]
    assert len(deltas) == 1
    if what == "timeout":
        assert isinstance(events[-1], Failed) and events[-1].error.status == 504
    else:
        assert not any(isinstance(e, (Finished, Failed)) for e in events)


def test_a_late_queued_job_is_answered_504_without_running(model_dir):
    engine = SpeculativeEngine(load_model(model_dir), ["prompt-lookup"])
    executor = BatchExecutor(engine, LearntState(engine.cost_model), ServerMetrics(), timeout_s=7)
    loop = _InlineLoop(lambda e: None)
    assert executor.run(_job(engine, loop, deadline=0.0)) == "timeout"
    assert len(loop.events) == 1 and loop.events[0].error.status == 504


# -- learnt state ----------------------------------------------------------------------------------
def test_learners_carry_over_as_private_copies():
    state = LearntState()
    key = (("0", "1", "2"), "round-robin:scope=global", "None", 5)

    def build():
        return build_selector("round-robin:scope=global"), build_length(None, 5)

    sel, length = state.checkout(key, build)
    sel.begin_request(["a", "b", "c"])
    for arm in (0, 1):
        assert sel.select() == arm
        sel.update(None)  # round-robin ignores the feedback, it counts rounds
    state.commit(key, (sel, length), None)
    again, _ = state.checkout(key, build)
    assert again is not sel
    again.begin_request(["a", "b", "c"])
    assert again.select() == 2  # the global cycle continues in the next request


def test_state_file_round_trip_and_fresh_start_on_bad_files(tmp_path, caplog):
    state = LearntState(fingerprint={"m": 1})
    key = (("0",), "ucbspec:scope=global", "4", 4)
    sel = build_selector("ucbspec:scope=global")
    sel.begin_request(["a", "b"])
    state.commit(key, (sel, build_length(4)), None)
    path = tmp_path / "s.json"
    state.save(path)
    restored = LearntState(fingerprint={"m": 1})
    assert restored.load(path) and restored.summary()["configurations"] == 1
    assert not LearntState(fingerprint={"m": 2}).load(path)  # another model: ignored
    path.write_text("{ corrupt")
    assert not LearntState(fingerprint={"m": 1}).load(path)
    assert not LearntState().load(tmp_path / "missing.json")
    # a pickle that would run code is refused
    import base64
    import pickle

    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    data = json.loads(json.dumps(state.to_json()))
    data["version"] = 2  # the pickled learners of earlier servers, still read (and migrated)
    data["learners"] = base64.b64encode(pickle.dumps([(key, Evil())])).decode()
    path.write_text(json.dumps(data))
    assert not LearntState(fingerprint={"m": 1}).load(path)
    assert "refusing to load builtins.print" in caplog.text


def test_state_is_saved_every_n_requests_and_restored(model_dir, tmp_path, reference):
    path = tmp_path / "state.json"
    app = make_app(model_dir, path, save_every=2)
    with serve_in_thread(app) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
        for _ in range(2):
            client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, temperature=0)
        wait_for(path.exists, 30, "the periodic save")
        assert json.loads(path.read_text())["totals"]["requests"] == 2
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, temperature=0)
    assert json.loads(path.read_text())["totals"]["requests"] == 3  # saved at shutdown
    app2 = make_app(model_dir, path)
    with serve_in_thread(app2) as base:
        assert httpx.get(f"{base}/health").json()["learnt"]["requests"] == 3
    path.write_text("garbage")
    with serve_in_thread(make_app(model_dir, path)) as base:  # corrupt: a warning, a fresh start
        assert httpx.get(f"{base}/health").json()["learnt"]["requests"] == 0


# -- streamed text ---------------------------------------------------------------------------------
def test_text_assembler_holds_back_possible_stops_and_broken_utf8():
    pieces = {1: "ab", 2: "c", 3: "\ufffd", 4: "d"}

    def decode(ids):
        text = "".join(pieces[i] for i in ids)
        return text.replace("\ufffdd", "é")  # tokens 3+4 are one character

    t = TextAssembler(decode, stop=["cd", "xyz"])
    assert t.push([1]) == ""  # "ab": the last 2 chars could start a stop string
    assert t.push([2]) == "a"
    assert t.push([3]) == ""  # incomplete character
    assert t.push([4]) == "b"
    assert t.finish() == "cé" and t.text == "abcé" and not t.stopped
    t = TextAssembler(lambda ids: "".join(pieces[i] for i in ids if i != 3), stop=["cd"])
    out = t.push([1]) + t.push([2]) + t.push([4]) + t.finish()
    assert out == "ab" and t.stopped


def test_api_error_body_shape():
    assert APIError(429, "slow down", type="rate_limit_error", code="queue_full").body() == {
        "error": {"message": "slow down", "type": "rate_limit_error", "param": None, "code": "queue_full"}}


def test_bench_serve_drives_a_live_server(live):
    from adaspec.bench.serve_load import markdown, percentile, run_level
    from adaspec.bench.workloads import BenchPrompt

    prompts = [BenchPrompt.single("copy", "w01 w02 w03 w01 w02"), BenchPrompt.single("other", "w09 w04")]
    result = asyncio.run(run_level(f"{live[0]}/v1", MODEL, prompts, concurrency=2, requests=4, max_tokens=6))
    assert result.requests == 4 and result.tokens == 24 and result.tokens_per_s > 0
    assert 0 <= result.ttft_p50 <= result.ttft_p95 and 0 <= result.itl_p50 <= result.itl_p95
    assert result.mat is not None and result.mat >= 1
    assert markdown("tiny", [result]).count("\n") == 2
    assert percentile([1.0, 2.0, 3.0], 50) == 2.0 and percentile([4.0], 95) == 4.0


def test_bench_serve_cycles_over_every_prompt_of_a_file(live, tmp_path, monkeypatch):
    """A file's prompts all take part unless --per-category says otherwise (one per category is
    the built-in suites' default only), and the command names the workload's size."""
    from typer.testing import CliRunner

    import adaspec.bench.serve_load as serve_load
    from adaspec.bench.serve_load import LevelResult
    from adaspec.cli import app

    seen: list[list[str]] = []

    async def fake_level(url, model, prompts, concurrency, requests, max_tokens):
        seen.append([p.id for p in prompts])
        return LevelResult(concurrency, requests, 1, 1.0, *[0.01] * 6, None)

    monkeypatch.setattr(serve_load, "run_level", fake_level)
    suite = tmp_path / "mine.jsonl"
    suite.write_text("\n".join(json.dumps({"question_id": f"q{i}", "category": "qa", "turns": [f"w0{i + 1} w02"]})
                               for i in range(3)))
    base = ["bench-serve", "--url", f"{live[0]}/v1", "--model", MODEL, "-c", "1"]
    for extra, ids, said in (([], ["q0", "q1", "q2"], "3 prompts (all)"),
                             (["--per-category", "2"], ["q0", "q1"], "2 prompts (2 per category)")):
        seen.clear()
        res = CliRunner().invoke(app, [*base, "--suite", str(suite), *extra])
        assert res.exit_code == 0, res.output
        assert said in res.output and seen[-1] == ids
    seen.clear()
    res = CliRunner().invoke(app, [*base, "--suite", "math+qa"])
    assert res.exit_code == 0 and "2 prompts (1 per category)" in res.output and len(seen[-1]) == 2
    res = CliRunner().invoke(app, [*base, "--suite", str(suite), "--per-category", "-1"])
    assert res.exit_code == 2 and "--per-category must be >= 0" in res.output


def test_the_server_process_freezes_its_startup_heap_before_serving(model_dir, monkeypatch):
    """``run_server`` moves the loaded model's objects out of the collector's generations
    before uvicorn serves (a full collection walked ~450,000 of them for ~230 ms, stalling every
    stream); the objects that serving makes are still collected."""
    import gc

    import uvicorn

    from adaspec.serve import run_server

    seen = {}

    def fake_run(self):
        seen["frozen"] = gc.get_freeze_count()
        seen["garbage_collected"] = _cycle_is_collected()

    def _cycle_is_collected():
        import weakref

        class Node:
            pass
        a, b = Node(), Node()
        a.other, b.other = b, a
        probe = weakref.ref(a)
        del a, b
        gc.collect()
        return probe() is None

    gc.unfreeze()
    assert gc.get_freeze_count() == 0  # the control: nothing frozen before
    monkeypatch.setattr(uvicorn.Server, "run", fake_run)
    engine = SpeculativeEngine(load_model(model_dir), [])
    try:
        run_server(engine, ServeConfig(model_id=MODEL), port=8765)
    finally:
        gc.unfreeze()
    assert seen["frozen"] > 1000 and seen["garbage_collected"]
