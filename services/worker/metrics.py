"""Prometheus metrics of one worker process (`GET /metrics` on its health port).

A worker's work is measured where it is published (Redis, the API pods' metrics);
this registry holds what only the process itself can see: its event loop's lag.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from shared.loop_lag import lag_histogram


class WorkerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        #: duplex_event_loop_lag_seconds, the same metric as the API pod's
        self.loop_lag = lag_histogram(self.registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)
