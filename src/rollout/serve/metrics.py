"""Prometheus metrics of one server (its own registry, so several servers can live in one process)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "rollout_requests",
            "HTTP requests by endpoint and status code.",
            ["endpoint", "status"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "rollout_prompt_tokens", "Prompt tokens of finished requests.", registry=r
        )
        self.generated_tokens = Counter("rollout_generated_tokens", "Tokens generated.", registry=r)
        self.rejected = Counter(
            "rollout_queue_rejected", "Requests refused with 503 (queue full).", registry=r
        )
        self.cancelled = Counter(
            "rollout_cancelled_requests", "Requests stopped early because their client went away.", registry=r
        )
        self.queue_depth = Gauge("rollout_queue_depth", "Requests waiting for a batch slot.", registry=r)
        self.active_rows = Gauge("rollout_active_rows", "Sequences being decoded.", registry=r)
        self.weights_version = Gauge(
            "rollout_weights_version", "Weight updates applied since start.", registry=r
        )
        self.batch_rows = Histogram(
            "rollout_batch_rows",
            "Sequences per forward pass.",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512),
            registry=r,
        )
        self.latency = Histogram(
            "rollout_request_seconds",
            "Time from arrival to the last byte, generation requests.",
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
            registry=r,
        )

    def watch(
        self,
        *,
        queue_depth: Callable[[], float],
        active_rows: Callable[[], float],
        weights_version: Callable[[], float],
    ) -> None:
        """Read these gauges at scrape time."""
        self.queue_depth.set_function(queue_depth)
        self.active_rows.set_function(active_rows)
        self.weights_version.set_function(weights_version)

    def render(self) -> bytes:
        return generate_latest(self.registry)
