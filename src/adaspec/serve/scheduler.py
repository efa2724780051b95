"""The bounded request queue and the engine worker.

Handlers (on the event loop) turn a request into a ``Job`` and ``submit`` it; a full queue is
refused at once (429). One worker thread takes jobs in arrival order and hands them to the
``BatchExecutor``: up to ``max_batch`` jobs (``adaspec serve --max-batch N``; 1: one at a time)
decode together on a ``BatchEngine`` (continuous batching: a job joins when a row is free and
leaves when it ends), which sends ``Delta`` / ``Finished`` / ``Failed`` events back to each job's
asyncio queue. Cancellation (client gone) and the deadline are checked before every round and
act by request id, so a cancelled job stops within one round and a queued one is skipped.
A batch that is starting (no row has its first token yet) waits, up to ``GATHER_S``, for the
requests the handlers are still reading (``Scheduler.incoming``): a burst then starts in one
round instead of its first request's round followed by everyone else's.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from ..batch import DEFAULT_PREFILL_CHUNK, BatchEngine, BatchEvent
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

#: the longest a starting batch waits for requests still being read (``Scheduler.incoming``)
GATHER_S = 0.03


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


def timeout_error(seconds: float) -> APIError:
    return APIError(504, f"the request did not finish within the server's timeout of {seconds:g}s: "
                         "ask for fewer tokens or retry later", type="timeout_error", code="timeout")


def observe_request(metrics: ServerMetrics, stats: RequestStats, ttft: float, latency: float,
                    endpoint: str) -> None:
    """A finished request's counts and times into the server's metrics."""
    m = metrics
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
    """Serves up to ``max_batch`` jobs together on a ``BatchEngine`` (1: one at a time, drafting
    with the engine's own drafters): ``admit(job)`` when a row is free (None, or the job's
    outcome if it ended at once), ``step()`` one round (the outcomes of the jobs that ended).
    Learners are checked out of the learnt state per job and committed back when it ends.
    A cancelled or late job is dropped by its request id before the next round."""

    def __init__(self, engine: SpeculativeEngine, state: LearntState, metrics: ServerMetrics,
                 timeout_s: float, max_batch: int = 1, on_commit: Callable[[], None] | None = None,
                 prefill_chunk: int = DEFAULT_PREFILL_CHUNK):
        self.engine, self.state, self.metrics = engine, state, metrics
        self.timeout_s, self.on_commit = timeout_s, on_commit
        self.batch = BatchEngine(engine, max_batch=max_batch, prefill_chunk=prefill_chunk)
        self.live: dict[int, _Live] = {}

    @property
    def room(self) -> int:
        """Jobs that can be admitted now."""
        return self.batch.max_batch - len(self.batch)

    @property
    def starting(self) -> bool:
        """Whether no live job has its first token yet (a batch forming, not one running)."""
        return all(live.first is None for live in self.live.values())

    def admit(self, job: Job) -> str | None:
        plan = job.plan
        queue_s = time.monotonic() - job.arrived
        self.metrics.queue_wait.observe(queue_s)
        if job.cancelled.is_set():
            return "cancelled"
        if time.monotonic() > job.deadline:
            job.emit(Failed(timeout_error(self.timeout_s)))
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
        """Drop cancelled and late jobs (by request id), then one round; the jobs that ended."""
        ended: list[tuple[Job, str]] = []
        for rid, live in list(self.live.items()):
            outcome = "cancelled" if live.job.cancelled.is_set() else (
                "timeout" if time.monotonic() > live.job.deadline else "")
            if outcome:
                self.batch.cancel(rid)
                if outcome == "timeout":
                    live.job.emit(Failed(timeout_error(self.timeout_s)))
                self._commit(live.job.plan, live.learners, None)
                del self.live[rid]
                ended.append((live.job, outcome))
        if len(self.batch):
            with self.engine.target.request_scope():
                events = self.batch.step()
            for ev in events:
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
        observe_request(self.metrics, stats, ttft, time.monotonic() - job.arrived, job.plan.endpoint)
        job.emit(Finished(reason, stats.new_tokens, stats, live.queue_s, ttft))
        return job, "ok"

    def _commit(self, plan: Plan, learners: tuple[Any, Any], stats: RequestStats | None) -> None:
        for p in learners:  # back on the engine's cost model (the state file pickles it by reference)
            if p.caps.prices_rounds:
                p.costs = self.engine.cost_model
        self.state.commit(plan.key, learners, stats)
        if self.on_commit is not None:
            self.on_commit()

    def fail_all(self, error: APIError) -> list[Job]:
        """After an internal error: fail every live job and start over with an empty batch."""
        jobs = [live.job for live in self.live.values()]
        for rid, live in list(self.live.items()):
            self.batch.cancel(rid)  # frees its state
            self._commit(live.job.plan, live.learners, None)
            live.job.emit(Failed(error))
        self.live.clear()
        self.batch = BatchEngine(self.engine, max_batch=self.batch.max_batch, prefill_chunk=self.batch.prefill_chunk)
        return jobs

    def run(self, job: Job) -> str:
        """Serve ``job`` alone, to its end (tests, tools): its outcome (ok, cancelled, timeout, error)."""
        outcome = self.admit(job)
        if outcome is not None:
            return outcome
        while self.live:
            for done, outcome in self.step():
                if done is job:
                    return outcome
        return "ok"


class Scheduler:
    """A bounded FIFO of jobs in front of one worker thread that runs ``execute``. A job whose
    client leaves while it waits is taken out of the queue at once (its place is free)."""

    def __init__(self, executor: BatchExecutor, max_queue: int, metrics: ServerMetrics,
                 gather_s: float = GATHER_S):
        self._batch = executor
        self._gather_s = gather_s
        self._incoming = 0  # requests the handlers are reading (``incoming``)
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
        self._thread = threading.Thread(target=self._work, name="adaspec-engine", daemon=True)
        self._thread.start()

    @contextmanager
    def incoming(self) -> Iterator[None]:
        """Around a handler's reading, checking and ``submit`` of one request: while any is
        inside, a starting batch waits for it (up to ``gather_s``) before its first round."""
        with self._cond:
            self._incoming += 1
        try:
            yield
        finally:
            with self._cond:
                self._incoming -= 1
                self._cond.notify_all()

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

    def _reject_closing(self, job: Job) -> None:
        job.emit(Failed(APIError(503, "the server shut down before serving this request",
                                 type="server_error", code="shutting_down")))
        self._metrics.requests.labels(job.plan.endpoint, "rejected").inc()

    def _work(self) -> None:
        """Admit queued jobs while rows are free, then one round; until stopped and idle."""
        ex = self._batch
        assert ex is not None
        while True:
            with self._cond:
                while not self._jobs and not ex.live and not self._stop:
                    self._cond.wait()
                if not self._jobs and not ex.live:
                    return
                admitted = self._take(ex)
                end = time.monotonic() + self._gather_s
                while (self._incoming and ex.room > len(admitted) and ex.starting and not self._stop
                       and (left := end - time.monotonic()) > 0):
                    self._cond.wait(left)
                    admitted += self._take(ex, len(admitted))
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
                self._mean_s = 0.8 * self._mean_s + 0.2 * (time.monotonic() - job.arrived)
            self.running = len(ex.live)
            self._metrics.running.set(self.running)

    def _take(self, ex: BatchExecutor, taken: int = 0) -> list[Job]:
        """Queued jobs for the rows free beyond the ``taken`` ones (the lock held)."""
        jobs = []
        while self._jobs and ex.room > taken + len(jobs):
            jobs.append(self._jobs.popleft())
        return jobs

    def stop(self, timeout: float | None = None) -> None:
        """Refuse new jobs, end queued ones with 503, let the running one finish, join."""
        self.closing = True
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)
