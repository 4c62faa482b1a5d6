"""Prometheus metrics of one API pod (`GET /metrics`)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from shared.loop_lag import lag_histogram


class ApiMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.active_sessions = Gauge(
            "duplex_active_websocket_sessions",
            "WebSocket connections attached to a session",
            registry=r,
        )
        self.sessions_opened = Counter(
            "duplex_sessions_opened", "Sessions opened through this pod", registry=r
        )
        self.sessions_closed = Counter(
            "duplex_sessions_closed", "Sessions closed by their client", registry=r
        )
        self.events = Counter("duplex_events", "Server events delivered to clients", registry=r)
        self.resumes = Counter("duplex_resumes", "Sessions resumed through this pod", registry=r)
        self.store_regressions = Counter(
            "duplex_store_regressions",
            "Sessions told to resync because an event came again under a seq their client "
            "had (the session store went back in time: a Redis failover lost writes)",
            registry=r,
        )
        self.sessions_lost = Counter(
            "duplex_sessions_lost",
            "Sessions told to resync because their state was gone from Redis (a failover "
            "or a Redis that restarted empty lost the session's hash)",
            registry=r,
        )
        self.errors = Counter(
            "duplex_errors", "Client errors answered by this pod", ["code"], registry=r
        )
        self.command_latency = Histogram(
            "duplex_command_seconds",
            "Time to hand a client command to its worker's inbox",
            buckets=(0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25),
            registry=r,
        )
        #: duplex_event_loop_lag_seconds (shared/loop_lag.py): a handler that computes
        #: without yielding delays every socket of the pod; this says by how much
        self.loop_lag = lag_histogram(r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
