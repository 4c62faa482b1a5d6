"""Prometheus metrics of one worker process (`GET /metrics` on its health port).

A worker's work is measured where it is published (Redis, the API pods' metrics);
this registry holds what only the process itself can see: its event loop's lag, and the
clock of a frame-clocked model's tick-batched stage (`stages/tick_batched.py`), whose
metrics the stage defines beside it (`stages/tick_metrics.py`).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from services.worker.stages.tick_metrics import TickMetrics
from shared.loop_lag import lag_histogram


class WorkerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        #: duplex_event_loop_lag_seconds, the same metric as the API pod's
        self.loop_lag = lag_histogram(self.registry)
        #: duplex_tick_*: only a frame-clocked plugin's worker has samples of these
        self.tick = TickMetrics(self.registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)
