"""The FastAPI application: OpenAI-compatible endpoints over one speculative engine.

``create_app(engine, ServeConfig(...))`` builds an app with its own scheduler, learnt state
and metrics registry (no module-level state); ``run_server`` serves it with uvicorn.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import signal
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from sse_starlette import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..batch import DEFAULT_PREFILL_CHUNK
from ..config import GenerationConfig, SamplingConfig
from ..engine import SpeculativeEngine, default_drafters  # noqa: F401 (re-exported by adaspec.serve)
from ..errors import AdaspecError
from ..length import build_length
from ..models import target_fingerprint
from ..selection import DEFAULT_SELECTOR as SELECTION_DEFAULT
from ..selection import build_selector
from .metrics import CONTENT_TYPE_LATEST, ServerMetrics
from .protocol import (MAX_STOP_STRINGS, MAX_TEMPERATURE, APIError, ChatRequest, CompletionRequest, AdaspecOptions,
                       bad_request, chunk_body, completion_body, new_id, parse_body, usage)
from .scheduler import (GATHER_S, BatchExecutor, Delta, Event, Failed, Finished, Job, Plan, QueueFull,
                        Scheduler, timeout_error)
from .state import LearntState

log = logging.getLogger(__name__)

#: tokens of earlier answers the default suffix drafter keeps for later requests
#: (``adaspec serve --suffix-store-tokens``; ~28 MB of index at this size)
SUFFIX_STORE_TOKENS = 131_072


def serve_drafters(backend: str, store_tokens: int = SUFFIX_STORE_TOKENS) -> list[str]:
    """The server's default drafters: the engine's (``default_drafters``), its ``suffix``
    drafter learning from every answer into one datastore all requests share (SuffixDecoding's
    global tree, Oliaro et al. 2024, as llama-server's n-gram pool across slots): a bounded
    store of the last ``store_tokens`` answer tokens, oldest answers evicted first
    (``SuffixDatastore``), in memory only (answers are never written to disk). ``store_tokens``
    0: each request drafts from its own text alone. Drafting never changes an answer (every
    draft is verified), so the store only changes speed."""
    if store_tokens < 0:
        raise AdaspecError(f"--suffix-store-tokens must be >= 0 (0: off), got {store_tokens}")
    return [f"suffix:learn=true,max_tokens={store_tokens}" if d == "suffix" and store_tokens else d
            for d in default_drafters(backend)]


#: the server's default configuration (``adaspec serve`` without -d/-s/-l) is the engine's
#: with the suffix drafter learning across requests (``serve_drafters``): ``auto`` (global
#: scope: it keeps learning across requests) picks the drafter among the model-free ones and
#: ``none``, and the length (``None`` length = auto's own)
DEFAULT_DRAFTERS = tuple(serve_drafters("transformers"))
DEFAULT_SELECTOR = SELECTION_DEFAULT
DEFAULT_LENGTH: str | None = None

Kind = Literal["chat", "text"]


@dataclass
class ServeConfig:
    """Server settings; the engine carries the model and the drafter pool."""

    model_id: str
    selector: str | None = DEFAULT_SELECTOR
    length: str | int | None = DEFAULT_LENGTH
    k: int = 5
    max_queue: int = 64
    timeout_s: float = 600.0
    state_file: Path | None = None
    save_every: int = 50
    default_max_tokens: int = 256
    shutdown_grace_s: float = 30.0
    max_batch: int = 1  # requests decoded together (continuous batching; 1: one at a time)
    prefix_cache: bool = True  # a request starts from the last one's shared prefix, where the backend can
    prefix_cache_tokens: int | None = None  # the prefix cache's size (None: the backend's default)
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK  # prompt tokens prefilled between two rounds (``BatchEngine``)
    gather_s: float = GATHER_S  # how long a starting batch waits for requests still being read (``Scheduler``)


class Server:
    """Everything one app owns: engine, learnt state, metrics, scheduler."""

    def __init__(self, engine: SpeculativeEngine, config: ServeConfig):
        self.engine, self.config = engine, config
        names = engine.drafter_names
        if len(set(names)) < len(names):
            log.warning("drafter names %s are not unique: the adaspec request field picks the first "
                        "of each name (give drafters a name=... parameter)", names)
        # served chats resend their history: reusing its KV makes a long chat's next turn cheap
        engine.target.prefix_cache = config.prefix_cache and engine.target.supports_prefix_cache
        if config.prefix_cache_tokens is not None:
            engine.target.prefix_cache_tokens = config.prefix_cache_tokens
        self.metrics = ServerMetrics()
        self.state = LearntState(shared=engine.cost_model, fingerprint={
            "model": target_fingerprint(engine.target), "drafters": names})
        self.executor = BatchExecutor(engine, self.state, self.metrics, config.timeout_s, config.max_batch,
                                      on_commit=self._maybe_save, prefill_chunk=config.prefill_chunk)
        self.scheduler = Scheduler(self.executor, config.max_queue, self.metrics, config.gather_s)

    # -- lifecycle ----------------------------------------------------------------------------
    @asynccontextmanager
    async def lifespan(self, app: FastAPI) -> AsyncIterator[None]:
        if self.config.state_file is not None:
            self.state.load(self.config.state_file)
        self.scheduler.start()
        yield
        await asyncio.to_thread(self.scheduler.stop, self.config.shutdown_grace_s)
        self.save()

    def save(self) -> None:
        if self.config.state_file is None:
            return
        try:
            self.state.save(self.config.state_file)
        except OSError as exc:
            log.warning("could not save the learnt state to %s: %s", self.config.state_file, exc)

    def _maybe_save(self) -> None:
        if self.config.save_every > 0 and self.state.since_save >= self.config.save_every:
            self.save()

    # -- planning -----------------------------------------------------------------------------
    def plan(self, req: ChatRequest | CompletionRequest, kind: Kind) -> Plan:
        """Check a request against the model and the pool; every problem is a 4xx APIError."""
        if req.model is not None and req.model != self.config.model_id:
            raise APIError(404, f"the model '{req.model}' does not exist: this server serves "
                                f"'{self.config.model_id}' (GET /v1/models)", param="model",
                           code="model_not_found")
        drafters, selector, length, k = self._policies(req.adaspec)
        prompt_ids = self._encode(req, kind)
        return Plan(prompt_ids, self._generation(req, len(prompt_ids), kind), drafters, selector,
                    length, k, endpoint=kind)

    def _policies(self, opts: AdaspecOptions | None) -> tuple[list[int], str | None, str | int | None, int]:
        names, cfg = self.engine.drafter_names, self.config
        if opts is None:
            return list(range(len(names))), cfg.selector, cfg.length, cfg.k
        chosen = opts.drafters or names
        unknown = [d for d in chosen if d not in names]
        if unknown or len(set(chosen)) < len(chosen):
            raise bad_request(f"adaspec.drafters {chosen} must be distinct names from the loaded pool "
                              f"{names}", param="adaspec.drafters", code="invalid_value")
        k = opts.k or cfg.k
        selector = opts.selector if opts.selector is not None else cfg.selector
        length = opts.length if opts.length is not None else (None if opts.k else cfg.length)
        for param, build in (("adaspec.selector", lambda: build_selector(selector)),
                             ("adaspec.length", lambda: build_length(length, k))):
            try:
                build()
            except AdaspecError as exc:
                raise bad_request(str(exc), param=param, code="invalid_value") from None
        return [names.index(d) for d in chosen], selector, length, k

    def _encode(self, req: ChatRequest | CompletionRequest, kind: Kind) -> list[int]:
        engine = self.engine
        try:
            if isinstance(req, ChatRequest):
                messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                            for m in req.messages]
                return engine.encode_prompt(messages)
            prompt = req.prompt
            if isinstance(prompt, list) and (not prompt or isinstance(prompt[0], str)):
                if len(prompt) != 1:
                    raise bad_request("send exactly one prompt per request (a string or a list of "
                                      "token ids)", param="prompt", code="invalid_value")
                prompt = prompt[0]
            return engine.encode_prompt(prompt, chat_template=False)
        except AdaspecError as exc:
            raise bad_request(str(exc), param="messages" if kind == "chat" else "prompt",
                              code="invalid_value") from None
        except APIError:
            raise
        except Exception as exc:  # noqa: BLE001 - e.g. a chat template that rejects the roles
            raise bad_request(f"could not build the prompt: {exc}", param="messages") from None

    def _generation(self, req: ChatRequest | CompletionRequest, n_prompt: int, kind: Kind) -> GenerationConfig:
        window = self.engine.target.context_window or 1 << 30
        prompt_param = "messages" if kind == "chat" else "prompt"
        if n_prompt >= window:
            raise bad_request(f"the prompt has {n_prompt} tokens but the model's context window is "
                              f"{window}: shorten it", param=prompt_param, code="context_length_exceeded")
        param, max_tokens = "max_tokens", req.max_tokens
        if isinstance(req, ChatRequest) and req.max_completion_tokens is not None:
            param, max_tokens = "max_completion_tokens", req.max_completion_tokens
        room = window - n_prompt
        if max_tokens is None:
            max_tokens = min(self.config.default_max_tokens, room)
        elif max_tokens <= 0:
            raise bad_request(f"{param} must be a positive integer, got {max_tokens}", param=param,
                              code="invalid_value")
        elif max_tokens > room:
            raise bad_request(f"the prompt ({n_prompt} tokens) plus {param}={max_tokens} exceeds the "
                              f"context window ({window}): ask for at most {room}", param=param,
                              code="context_length_exceeded")
        temperature = 1.0 if req.temperature is None else req.temperature
        top_p = 1.0 if req.top_p is None else req.top_p
        if not 0 <= temperature <= MAX_TEMPERATURE:
            raise bad_request(f"temperature must be in [0, {MAX_TEMPERATURE:g}] (OpenAI's bound; 0 = greedy), "
                              f"got {temperature}", param="temperature", code="invalid_value")
        if not 0 < top_p <= 1:
            raise bad_request(f"top_p must be in (0, 1], got {top_p}", param="top_p", code="invalid_value")
        if req.seed is not None and not 0 <= req.seed < 1 << 63:
            raise bad_request(f"seed must be in [0, 2^63), got {req.seed}", param="seed", code="invalid_value")
        stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
        if any(not s for s in stop):
            raise bad_request("stop strings must be non-empty", param="stop", code="invalid_value")
        if len(stop) > MAX_STOP_STRINGS:
            raise bad_request(f"at most {MAX_STOP_STRINGS} stop strings are allowed (OpenAI's bound), got "
                              f"{len(stop)}", param="stop", code="invalid_value")
        return GenerationConfig(max_new_tokens=max_tokens, stop=stop,
                                sampling=SamplingConfig(temperature, 0, top_p, req.seed))

    # -- serving ------------------------------------------------------------------------------
    async def complete(self, request: Request, body: type[ChatRequest] | type[CompletionRequest],
                       kind: Kind) -> Response:
        """Read, check and queue the request (inside ``Scheduler.incoming``: a batch that is
        starting waits for it), then answer it from its job's events."""
        try:
            with self.scheduler.incoming():
                req = parse_body(await request.body(), body)
                plan = self.plan(req, kind)
                job = Job(plan, asyncio.get_running_loop(), deadline=time.monotonic() + self.config.timeout_s)
                self.scheduler.submit(job)
        except QueueFull as full:
            self.metrics.requests.labels(kind, "rejected").inc()
            raise APIError(429, f"{full}: the server queues at most {self.config.max_queue} requests",
                           type="rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(full.retry_after)}) from None
        except APIError:
            self.metrics.requests.labels(kind, "invalid").inc()
            raise
        first = await self._next(job, request)
        if first is None:  # the client left while its request was queued
            return Response(status_code=499)
        if isinstance(first, Failed):
            raise first.error
        rid = new_id(kind)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return EventSourceResponse(self._events(job, first, kind, rid, include_usage),
                                       shutdown_grace_period=self.config.shutdown_grace_s)
        pieces: list[str] = []
        event: Event | None = first
        while isinstance(event, Delta):
            pieces.append(event.text)
            event = await self._next(job, request)
        if event is None:
            return Response(status_code=499)
        if isinstance(event, Failed):
            raise event.error
        return JSONResponse(completion_body(kind, rid, self.config.model_id, "".join(pieces),
                                            event.finish_reason, self._usage(job, event),
                                            self._stats(job.plan, event)))

    async def _next(self, job: Job, request: Request) -> Event | None:
        """The job's next event; None (and the job cancelled) if the client disconnects first,
        a timeout failure if the deadline passes first (e.g. still queued behind a long job)."""
        while True:
            try:
                return await asyncio.wait_for(job.events.get(), 0.25)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    job.cancel()
                    return None
                if time.monotonic() > job.deadline + 1.0:  # the worker reports it itself if it can
                    job.cancel()
                    return Failed(timeout_error(self.config.timeout_s))

    async def _events(self, job: Job, first: Event, kind: Kind, rid: str,
                      include_usage: bool) -> AsyncIterator[dict[str, str]]:
        """Server-sent events in OpenAI's chunk format, ending with ``[DONE]``."""
        model, created = self.config.model_id, int(time.time())

        def data(body: dict[str, Any]) -> dict[str, str]:
            return {"data": json.dumps(body, ensure_ascii=False)}

        try:
            if kind == "chat":
                yield data(chunk_body(kind, rid, model, created, role=True, text=""))
            event = first
            while True:
                if isinstance(event, Delta):
                    yield data(chunk_body(kind, rid, model, created, text=event.text))
                elif isinstance(event, Finished):
                    stats = self._stats(job.plan, event)
                    yield data(chunk_body(kind, rid, model, created, finish_reason=event.finish_reason,
                                          text=None if kind == "chat" else "", stats=stats))
                    if include_usage:
                        yield data(chunk_body(kind, rid, model, created, choices=False,
                                              use=self._usage(job, event)))
                    break
                else:  # Failed after the stream started (a timeout): an error event, as vLLM does
                    yield data(event.error.body())
                    break
                event = await job.events.get()
            yield {"data": "[DONE]"}
        finally:
            job.cancel()  # a no-op once finished; stops the engine if the client went away

    @staticmethod
    def _usage(job: Job, event: Finished) -> dict[str, Any]:
        return usage(len(job.plan.prompt_ids), event.completion_tokens, event.stats.cached_prompt_tokens)

    def _stats(self, plan: Plan, event: Finished) -> dict[str, Any]:
        """The request's adaspec statistics (the ``adaspec`` response field)."""
        s = event.stats
        counts = s.drafter_usage()
        total = sum(counts.values()) or 1
        return {"drafters": [self.engine.drafter_names[i] for i in plan.drafters],
                "selector": plan.selector, "length": plan.length, "k": plan.k,
                "drafter_shares": {name: n / total for name, n in counts.items()},
                "rounds": s.n_rounds, "drafted": s.drafted, "accepted": s.accepted,
                "mat": s.mat, "acceptance_rate": s.acceptance_rate, "stop_reason": s.stop_reason,
                "cached_prompt_tokens": s.cached_prompt_tokens,
                "queue_s": event.queue_s, "ttft_s": event.ttft_s, "generate_s": s.total_s,
                "tokens_per_s": s.tokens_per_s, "time_split_s": s.time_split}

    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": self.config.model_id, "object": "model", "created": 0, "owned_by": "adaspec",
            "context_window": self.engine.target.context_window,
            "adaspec": {"drafters": self.engine.drafter_names, "selector": self.config.selector,
                        "length": self.config.length, "k": self.config.k}}]}

    def health(self) -> dict[str, Any]:
        return {"status": "shutting_down" if self.scheduler.closing else "ok",
                "model": self.config.model_id, "queue": self.scheduler.waiting,
                "running": self.scheduler.running, "learnt": self.state.summary()}


def _error(status: int, message: str, type: str = "invalid_request_error", code: str | None = None,
           headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(APIError(status, message, type=type, code=code).body(), status_code=status,
                        headers=headers)


def create_app(engine: SpeculativeEngine, config: ServeConfig) -> FastAPI:
    """An app serving ``engine`` under ``config.model_id``."""
    server = Server(engine, config)
    app = FastAPI(title="adaspec", lifespan=server.lifespan)
    app.state.server = server

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", kind,
                      headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _error(400, f"invalid request: {exc.errors()[0].get('msg', exc)}")

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        log.error("unhandled error on %s", request.url.path, exc_info=exc)
        return _error(500, "internal server error: see the server log", "server_error", "internal_error")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await server.complete(request, ChatRequest, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await server.complete(request, CompletionRequest, "text")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return server.models()

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return server.health()

    @app.get("/metrics")
    async def metrics() -> Response:
        server.metrics.queue_length.set(server.scheduler.waiting)
        return Response(server.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


def freeze_startup_heap() -> int:
    """Move every object alive now (after the model loaded) out of the cyclic garbage
    collector's generations (``gc.freeze``), after one last collection; returns how many are
    frozen. Why: a loaded model leaves ~450,000 long-lived Python objects (torch, transformers,
    the tokenizer), and each full collection walked them all: 226-247 ms on an EPYC (Zen 4),
    on whichever thread allocated at that moment (the event loop or the engine), about twice in
    30 s of a 16-client burst load (the suffix store's answers keep adding survivors). Every
    stream stalled that long; a burst's first tokens then came after 360-400 ms instead of
    ~120. Frozen, a full collection takes 5-9 ms and only walks what serving made. The frozen
    objects are never freed, which is what a model's lifetime objects are anyway."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def run_server(engine: SpeculativeEngine, config: ServeConfig, host: str = "127.0.0.1",
               port: int = 8000, log_level: str = "info") -> None:
    """Serve until SIGINT / SIGTERM: stop accepting, let in-flight requests finish (up to the
    grace period), save the learnt state, return (exit code 0). The process's startup heap is
    frozen first (``freeze_startup_heap``)."""
    import uvicorn

    app = create_app(engine, config)
    freeze_startup_heap()
    uv = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                       timeout_graceful_shutdown=int(config.shutdown_grace_s) + 5))
    # uvicorn re-raises the signal it handled once it has shut down cleanly; with the default
    # SIGTERM action that would kill the process (exit -15) after a clean shutdown
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)
    try:
        uv.run()
    finally:
        signal.signal(signal.SIGTERM, previous)
