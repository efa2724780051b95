"""Prometheus metrics of one server (own registry per app: no process-global state)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401  (re-exported for the app)

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
MAT_BUCKETS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0, 5.0, 8.0)
RATE_BUCKETS = tuple(i / 10 for i in range(11))


class ServerMetrics:
    """Requests, tokens, MAT / acceptance, drafter choices, queue and latency."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("adaspec_requests", "Requests by endpoint and outcome",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("adaspec_prompt_tokens", "Prompt tokens processed", registry=r)
        self.cached_prompt_tokens = Counter("adaspec_cached_prompt_tokens",
                                            "Prompt tokens whose KV came from the prefix cache", registry=r)
        self.completion_tokens = Counter("adaspec_completion_tokens", "Tokens generated", registry=r)
        self.mat = Histogram("adaspec_request_mat", "Mean accepted tokens per target forward, per request",
                             buckets=MAT_BUCKETS, registry=r)
        self.acceptance = Histogram("adaspec_request_acceptance_rate", "Draft acceptance rate, per request",
                                    buckets=RATE_BUCKETS, registry=r)
        self.drafter_rounds = Counter("adaspec_drafter_rounds", "Rounds drafted by each drafter",
                                      ["drafter"], registry=r)
        self.queue_length = Gauge("adaspec_queue_length", "Requests waiting for the engine", registry=r)
        self.running = Gauge("adaspec_requests_running", "Requests being generated", registry=r)
        self.queue_wait = self._latency("adaspec_queue_wait_seconds", "Time from arrival to the engine")
        self.ttft = self._latency("adaspec_time_to_first_token_seconds", "Time from arrival to the first token")
        self.latency = self._latency("adaspec_request_latency_seconds", "Time from arrival to the last token",
                                     ["endpoint"])
        self.tpot = self._latency("adaspec_time_per_output_token_seconds",
                                  "Mean time between tokens after the first, per request")

    def _latency(self, name: str, doc: str, labels: tuple[str, ...] | list[str] = ()) -> Histogram:
        return Histogram(name, doc, labels, buckets=LATENCY_BUCKETS, registry=self.registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)
