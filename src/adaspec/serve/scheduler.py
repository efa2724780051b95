"""The bounded request queue and the engine worker.

Handlers (on the event loop) turn a request into a ``Job`` and ``submit`` it; a full queue is
refused at once (429). One worker thread takes jobs in arrival order and hands each to an
executor, which runs the engine and sends ``Delta`` / ``Finished`` / ``Failed`` events back to
the job's asyncio queue. Cancellation (client gone) and the deadline are checked after every
round, so a cancelled job stops within one round and a queued one is skipped.

With ``max_batch > 1`` (``adaspec serve --max-batch N``) the worker runs a ``BatchExecutor``
instead: up to N jobs decode together on a ``BatchEngine`` (continuous batching: a job joins
when a row is free and leaves when it ends), with the same events, cancellation and deadlines,
checked before every batched round.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..batch import BatchEngine, BatchEvent
from ..config import GenerationConfig
from ..engine import SpeculativeEngine
from ..errors import AdaspecError
from ..kernels import release_openmp_threads
from ..metrics import RequestStats
from .metrics import ServerMetrics
from .output import TextAssembler
from .protocol import FINISH_REASONS, APIError
from .state import ConfigKey, LearntState

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Plan:
    """A validated request: what the engine needs to serve it."""

    prompt_ids: list[int]
    config: GenerationConfig
    drafters: list[int]  # indices into the engine's loaded drafters
    selector: str | None
    length: str | int | None
    k: int
    endpoint: str = "chat"

    @property
    def key(self) -> ConfigKey:
        return (tuple(map(str, self.drafters)), str(self.selector), str(self.length), self.k)


@dataclass(frozen=True)
class Delta:
    text: str


@dataclass(frozen=True)
class Finished:
    finish_reason: str
    completion_tokens: int
    stats: RequestStats
    queue_s: float
    ttft_s: float


@dataclass(frozen=True)
class Failed:
    error: APIError


Event = Delta | Finished | Failed


@dataclass(eq=False)
class Job:
    """One request in flight: its plan, its event queue and its cancel flag."""

    plan: Plan
    loop: asyncio.AbstractEventLoop
    deadline: float  # time.monotonic() after which the job is abandoned
    arrived: float = field(default_factory=time.monotonic)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    on_cancel: Callable[[Job], None] | None = None  # set by the scheduler while the job waits

    def emit(self, event: Event) -> None:
        """Thread-safe: deliver an event to the handler's loop."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    def cancel(self) -> None:
        self.cancelled.set()
        if self.on_cancel is not None:
            self.on_cancel(self)


class QueueFull(Exception):
    """The queue is at its bound; ``retry_after`` seconds is a fair guess for a retry."""

    def __init__(self, retry_after: int):
        super().__init__(f"the request queue is full: retry in {retry_after}s")
        self.retry_after = retry_after


class _Abort(Exception):
    """Raised inside the engine's token callback to stop a cancelled or late request."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def timeout_error(seconds: float) -> APIError:
    return APIError(504, f"the request did not finish within the server's timeout of {seconds:g}s: "
                         "ask for fewer tokens or retry later", type="timeout_error", code="timeout")


class EngineExecutor:
    """Runs one job on the engine with the configuration's learners checked out of the state."""

    def __init__(self, engine: SpeculativeEngine, state: LearntState, metrics: ServerMetrics,
                 timeout_s: float, on_commit: Callable[[], None] | None = None):
        self.engine, self.state, self.metrics = engine, state, metrics
        self.timeout_s = timeout_s
        self.on_commit = on_commit

    def __call__(self, job: Job) -> str:
        """Serve ``job``; returns its outcome for the metrics (ok, cancelled, timeout, error)."""
        plan = job.plan
        started = time.monotonic()
        queue_s = started - job.arrived
        self.metrics.queue_wait.observe(queue_s)
        if job.cancelled.is_set():
            return "cancelled"
        if started > job.deadline:
            job.emit(Failed(timeout_error(self.timeout_s)))
            return "timeout"
        text = TextAssembler(self.engine.decode, plan.config.stop)
        first: list[float] = []

        def on_tokens(chunk: list[int]) -> None:
            if not first:
                first.append(time.monotonic())
            delta = text.push(chunk)
            if delta:
                job.emit(Delta(delta))
            if job.cancelled.is_set():
                raise _Abort("cancelled")
            if time.monotonic() > job.deadline:
                raise _Abort("timeout")

        def build() -> tuple[Any, Any]:
            view = self.engine.with_policies(plan.drafters, selector=plan.selector,
                                             length=plan.length, k=plan.k)
            return view.selector, view.length

        selector, length = self.state.checkout(plan.key, build)
        view = self.engine.with_policies(plan.drafters, selector=selector, length=length, k=plan.k)
        stats: RequestStats | None = None
        try:
            result = view.generate(plan.prompt_ids, plan.config, on_tokens=on_tokens)
            stats = result.stats
        except _Abort as stop:
            if stop.reason == "timeout":
                job.emit(Failed(timeout_error(self.timeout_s)))
            return stop.reason
        except AdaspecError as exc:
            job.emit(Failed(APIError(400, str(exc), param="adaspec")))
            return "error"
        finally:
            self.state.commit(plan.key, (selector, length), stats)
            if self.on_commit is not None:
                self.on_commit()
        rest = text.finish()
        if rest:
            job.emit(Delta(rest))
        reason = "stop" if text.stopped else FINISH_REASONS.get(stats.stop_reason, "stop")
        ttft = (first[0] if first else time.monotonic()) - job.arrived
        self._observe(stats, ttft, time.monotonic() - job.arrived, plan.endpoint)
        job.emit(Finished(reason, stats.new_tokens, stats, queue_s, ttft))
        return "ok"

    def _observe(self, stats: RequestStats, ttft: float, latency: float, endpoint: str) -> None:
        m = self.metrics
        m.prompt_tokens.inc(stats.prompt_tokens)
        m.cached_prompt_tokens.inc(stats.cached_prompt_tokens)
        m.completion_tokens.inc(stats.new_tokens)
        if stats.n_rounds:
            m.mat.observe(stats.mat)
        if stats.drafted:
            m.acceptance.observe(stats.acceptance_rate)
        for name, n in stats.drafter_usage().items():
            m.drafter_rounds.labels(name).inc(n)
        m.ttft.observe(ttft)
        m.latency.labels(endpoint).observe(latency)
        if stats.new_tokens > 1:
            m.tpot.observe((latency - ttft) / (stats.new_tokens - 1))


@dataclass(eq=False)
class _Live:
    """A job decoding in the batch: its text, learners and first-token time."""

    job: Job
    text: TextAssembler
    learners: tuple[Any, Any]
    queue_s: float
    first: float | None = None


class BatchExecutor:
    """Serves up to ``max_batch`` jobs together on a ``BatchEngine``: ``admit(job)`` when a row
    is free (None, or the job's outcome if it ended at once), ``step()`` one batched round
    (the outcomes of the jobs that ended); learners are checked out per job, as one at a time."""

    def __init__(self, engine: SpeculativeEngine, state: LearntState, metrics: ServerMetrics,
                 timeout_s: float, max_batch: int, on_commit: Callable[[], None] | None = None):
        self.one = EngineExecutor(engine, state, metrics, timeout_s, on_commit)  # its metrics and errors
        self.engine, self.state, self.metrics = engine, state, metrics
        self.batch = BatchEngine(engine, max_batch=max_batch)
        self.live: dict[int, _Live] = {}

    @property
    def room(self) -> int:
        """Jobs that can be admitted now."""
        return self.batch.max_batch - len(self.batch)

    def admit(self, job: Job) -> str | None:
        plan = job.plan
        queue_s = time.monotonic() - job.arrived
        self.metrics.queue_wait.observe(queue_s)
        if job.cancelled.is_set():
            return "cancelled"
        if time.monotonic() > job.deadline:
            job.emit(Failed(timeout_error(self.one.timeout_s)))
            return "timeout"

        def build() -> tuple[Any, Any]:
            view = self.engine.with_policies(plan.drafters, selector=plan.selector, length=plan.length, k=plan.k)
            return view.selector, view.length

        learners = self.state.checkout(plan.key, build)
        try:
            rid = self.batch.add(plan.prompt_ids, plan.config, drafters=plan.drafters, selector=learners[0],
                                 length=learners[1], k=plan.k)
        except AdaspecError as exc:
            self._commit(plan, learners, None)
            job.emit(Failed(APIError(400, str(exc), param="adaspec")))
            return "error"
        self.live[rid] = _Live(job, TextAssembler(self.engine.decode, plan.config.stop), learners, queue_s)
        return None

    def step(self) -> list[tuple[Job, str]]:
        """Drop cancelled and late jobs, then one batched round; the jobs that ended."""
        ended: list[tuple[Job, str]] = []
        for rid, live in list(self.live.items()):
            outcome = "cancelled" if live.job.cancelled.is_set() else (
                "timeout" if time.monotonic() > live.job.deadline else "")
            if outcome:
                self.batch.cancel(rid)
                if outcome == "timeout":
                    live.job.emit(Failed(timeout_error(self.one.timeout_s)))
                self._commit(live.job.plan, live.learners, None)
                del self.live[rid]
                ended.append((live.job, outcome))
        for ev in self.batch.step():
            done = self._deliver(ev)
            if done is not None:
                ended.append(done)
        return ended

    def _deliver(self, ev: BatchEvent) -> tuple[Job, str] | None:
        live = self.live[ev.request]
        if ev.tokens:
            live.first = live.first or time.monotonic()
            delta = live.text.push(ev.tokens)
            if delta:
                live.job.emit(Delta(delta))
        if not ev.finished:
            return None
        del self.live[ev.request]
        job, stats = live.job, ev.result.stats
        self._commit(job.plan, live.learners, stats)
        rest = live.text.finish()
        if rest:
            job.emit(Delta(rest))
        reason = "stop" if live.text.stopped else FINISH_REASONS.get(stats.stop_reason, "stop")
        ttft = (live.first or time.monotonic()) - job.arrived
        self.one._observe(stats, ttft, time.monotonic() - job.arrived, job.plan.endpoint)
        job.emit(Finished(reason, stats.new_tokens, stats, live.queue_s, ttft))
        return job, "ok"

    def _commit(self, plan: Plan, learners: tuple[Any, Any], stats: RequestStats | None) -> None:
        for p in learners:  # back on the engine's cost model (the state file pickles it by reference)
            if getattr(p, "wants_costs", False):
                p.costs = self.engine.cost_model
        self.state.commit(plan.key, learners, stats)
        if self.one.on_commit is not None:
            self.one.on_commit()

    def fail_all(self, error: APIError) -> list[Job]:
        """After an internal error: fail every live job and start over with an empty batch."""
        jobs = [live.job for live in self.live.values()]
        for live in list(self.live.values()):
            self._commit(live.job.plan, live.learners, None)
            live.job.emit(Failed(error))
        self.live.clear()
        self.batch = BatchEngine(self.engine, max_batch=self.batch.max_batch)
        return jobs


class Scheduler:
    """A bounded FIFO of jobs in front of one worker thread that runs ``execute``. A job whose
    client leaves while it waits is taken out of the queue at once (its place is free)."""

    def __init__(self, execute: Callable[[Job], str], max_queue: int, metrics: ServerMetrics,
                 batch: BatchExecutor | None = None):
        self._execute = execute
        self._batch = batch
        self._max = max_queue
        self._jobs: deque[Job] = deque()
        self._cond = threading.Condition()
        self._metrics = metrics
        self._thread: threading.Thread | None = None
        self._mean_s = 1.0  # running mean of service time, for Retry-After
        self._stop = False
        self.closing = False
        self.running = 0

    @property
    def waiting(self) -> int:
        return len(self._jobs)

    def start(self) -> None:
        """Start the engine thread. The thread that loaded the model (this one) releases its
        OpenMP workers first: the engine thread then computes without sharing the CPUs with
        them (``kernels.release_openmp_threads``: a SmolLM2 step 65-80 ms -> 32 ms)."""
        release_openmp_threads()
        work = self._work if self._batch is None else self._work_batch
        self._thread = threading.Thread(target=work, name="adaspec-engine", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        """Queue ``job``; raises ``QueueFull`` when the bound is reached."""
        if self.closing:
            raise APIError(503, "the server is shutting down: retry on another instance",
                           type="server_error", code="shutting_down")
        with self._cond:
            if len(self._jobs) >= self._max:
                raise QueueFull(max(1, round(self._mean_s * (len(self._jobs) + 1))))
            self._jobs.append(job)
            job.on_cancel = self._discard
            self._metrics.queue_length.set(len(self._jobs))
            self._cond.notify()

    def _discard(self, job: Job) -> None:
        with self._cond:
            if job in self._jobs:
                self._jobs.remove(job)
                self._metrics.queue_length.set(len(self._jobs))
                self._metrics.requests.labels(job.plan.endpoint, "cancelled").inc()

    def _next(self) -> Job | None:
        with self._cond:
            while not self._jobs and not self._stop:
                self._cond.wait()
            if not self._jobs:
                return None
            job = self._jobs.popleft()
            self._metrics.queue_length.set(len(self._jobs))
            return job

    def _work(self) -> None:
        while (job := self._next()) is not None:
            if self.closing:
                self._reject_closing(job)
                continue
            self.running = 1
            self._metrics.running.set(1)
            t0 = time.monotonic()
            try:
                outcome = self._execute(job)
            except Exception:  # noqa: BLE001 - a bug must fail one request, not the worker
                log.exception("request failed")
                job.emit(Failed(APIError(500, "internal error while generating: see the server log",
                                         type="server_error", code="internal_error")))
                outcome = "error"
            self._mean_s = 0.8 * self._mean_s + 0.2 * (time.monotonic() - t0)
            self.running = 0
            self._metrics.running.set(0)
            self._metrics.requests.labels(job.plan.endpoint, outcome).inc()

    def _reject_closing(self, job: Job) -> None:
        job.emit(Failed(APIError(503, "the server shut down before serving this request",
                                 type="server_error", code="shutting_down")))
        self._metrics.requests.labels(job.plan.endpoint, "rejected").inc()

    def _work_batch(self) -> None:
        """Admit queued jobs while rows are free, then one batched round; until stopped and idle."""
        ex = self._batch
        assert ex is not None
        while True:
            with self._cond:
                while not self._jobs and not ex.live and not self._stop:
                    self._cond.wait()
                if not self._jobs and not ex.live:
                    return
                admitted = []
                while self._jobs and ex.room > 0:
                    admitted.append(self._jobs.popleft())
                self._metrics.queue_length.set(len(self._jobs))
            ended: list[tuple[Job, str]] = []
            try:
                for job in admitted:
                    if self.closing:
                        self._reject_closing(job)
                        continue
                    outcome = ex.admit(job)
                    if outcome is not None:
                        ended.append((job, outcome))
                ended += ex.step()
            except Exception:  # noqa: BLE001 - a bug must fail the batch's requests, not the worker
                log.exception("batched round failed")
                error = APIError(500, "internal error while generating: see the server log",
                                 type="server_error", code="internal_error")
                ended += [(job, "error") for job in ex.fail_all(error)]
            for job, outcome in ended:
                self._metrics.requests.labels(job.plan.endpoint, outcome).inc()
            self.running = len(ex.live)
            self._metrics.running.set(self.running)

    def stop(self, timeout: float | None = None) -> None:
        """Refuse new jobs, end queued ones with 503, let the running one finish, join."""
        self.closing = True
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)
