"""`duplex serve`, `duplex api`, `duplex worker`: run the processes.

`serve` runs one API and one worker in one process on one event loop, sharing
an embedded Redis (fakeredis with Lua) unless DUPLEX_REDIS_URL is set.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import resource
import signal

import uvicorn

from services.api.app import create_app
from services.api.http_guard import GuardedH11Protocol
from services.worker.process import WorkerProcess
from shared.loop_lag import LoopLagMonitor
from shared.redis.connection import RedisHandle, connect
from shared.settings import ApiSettings, WorkerSettings

log = logging.getLogger("duplex")


def _uvicorn_server(app, settings: ApiSettings) -> uvicorn.Server:
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        # h11 with a deadline for request heads and the concurrency limit on WebSocket
        # upgrades too (services/api/http_guard.py); never httptools, whatever is installed
        http=functools.partial(GuardedH11Protocol, header_timeout_s=settings.header_timeout_s),
        ws="websockets-sansio",
        # No permessage-deflate: base64 audio barely compresses, and compressing every frame
        # cost the API pod about 5% of its CPU in bench/profile for nothing.
        ws_per_message_deflate=False,
        log_level="warning",
        lifespan="on",
        # SIGTERM: stop accepting, close sockets with 1012 (reconnect and resume), then
        # wait at most this long for connections to finish before exiting
        timeout_graceful_shutdown=settings.drain_timeout_s,
        # an idle kept-alive connection is closed after this (uvicorn's own timer)
        timeout_keep_alive=settings.keep_alive_s,  # typed int, used as a float delay
        # past this many open connections (a WebSocket counts as one) requests and upgrades
        # get 503 at once: a flood degrades into refusals, not into a pod out of descriptors
        limit_concurrency=settings.limit_concurrency or None,
    )
    server = uvicorn.Server(config)
    server.install_signal_handlers = lambda: None  # we own SIGTERM/SIGINT
    _check_descriptors(settings.limit_concurrency)
    return server


def _check_descriptors(limit_concurrency: int) -> None:
    """The concurrency limit only protects the pod while it is below the descriptor limit:
    past that, accept() fails and everyone is refused, with no 503 to say why."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    # Redis connections, the log and the listening socket need descriptors too
    if soft != resource.RLIM_INFINITY and (not limit_concurrency or limit_concurrency > soft - 64):
        log.warning(
            "DUPLEX_LIMIT_CONCURRENCY=%d is not under the open-file limit %d (minus 64): "
            "a connection flood will exhaust descriptors before it gets 503s",
            limit_concurrency,
            soft,
        )


def _on_signal() -> asyncio.Event:
    """An event SIGTERM/SIGINT set from now on (the default action, an exit with no
    cleanup, no longer applies)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    return stop


async def _until_signal() -> None:
    await _on_signal().wait()


def _worker_loop_lag(worker: WorkerProcess, warn_after_s: float | None) -> LoopLagMonitor:
    """The worker's loop-lag monitor, its metric on the worker's GET /metrics."""
    metrics = worker.metrics
    if worker.health is not None:
        worker.health.registry = metrics.registry
    return LoopLagMonitor(f"worker {worker.worker_id}", metrics.loop_lag, warn_after_s)


async def run_worker(settings: WorkerSettings, redis: RedisHandle | None = None) -> None:
    if redis is None and not settings.redis_url:
        raise SystemExit("duplex worker needs DUPLEX_REDIS_URL (only `duplex serve` embeds Redis)")
    handle = redis or connect(settings.redis_url)
    worker = WorkerProcess(settings, handle)
    loop_lag = _worker_loop_lag(worker, settings.loop_lag_warn_s)
    # handled before the worker registers: a SIGTERM that comes as soon as it is seen
    # registered (an orchestrator's, a test's) drains it instead of killing it unregistered
    stop = _on_signal()
    await worker.start()
    loop_lag.start()  # after start(): loading a model blocks the loop, and is expected to
    try:
        await stop.wait()
    finally:
        await loop_lag.stop()
        await worker.stop()


async def run_api(settings: ApiSettings) -> None:
    if not settings.redis_url:
        raise SystemExit("duplex api needs DUPLEX_REDIS_URL (only `duplex serve` embeds Redis)")
    server = _uvicorn_server(create_app(settings), settings)
    serving = asyncio.create_task(server.serve())
    print(f"duplex api listening on http://{settings.host}:{settings.port}", flush=True)
    await asyncio.wait(
        [serving, asyncio.create_task(_until_signal())], return_when=asyncio.FIRST_COMPLETED
    )
    server.should_exit = True
    await serving


def serve_hints(settings: ApiSettings, handle: RedisHandle) -> str:
    """What a newcomer to `duplex serve` needs next: the console, how loud the log is and how
    to change it, and, on the embedded Redis, why `duplex sessions` cannot see it."""
    level = logging.getLogger().getEffectiveLevel()
    name = logging.getLevelName(level)
    if level <= logging.DEBUG:
        log_line = (
            f"  log level {name}: routine work too, such as the janitor's ticks (six lines a "
            "second); the default, info, has only starts, stops, session moves, refusals and "
            "failures"
        )
    elif level <= logging.INFO:
        log_line = (
            f"  log level {name}: starts, stops, session moves, refusals and failures; "
            "--log-level debug (or DUPLEX_LOG_LEVEL=debug) adds routine work, such as the "
            "janitor's ticks"
        )
    else:
        log_line = (
            f"  log level {name}: failures only; info, the default, adds starts, stops, "
            "session moves and refusals"
        )
    lines = [
        f"  talk to it from a browser at http://{settings.host}:{settings.port}/ (the page asks "
        "for the microphone when you press Connect + talk)",
        log_line,
    ]
    if handle.server is not None:
        lines.append(
            "  the embedded Redis lives in this process: `duplex sessions` and redis-cli cannot "
            "reach it; run on a redis-server to inspect it (DUPLEX_REDIS_URL=redis://"
            "localhost:6379/0 make serve, docs/operations.md)"
        )
    return "\n".join(lines)


async def run_serve(
    api_settings: ApiSettings, worker_settings: WorkerSettings, *, sentinel: bool = False
) -> None:
    if not sentinel:
        await _serve(api_settings, worker_settings)
        return
    # a Sentinel set of this machine's redis-server (services/local_redis.py), for trying
    # a failover with sessions talking; started before, stopped after, the servers
    if api_settings.redis_url:
        raise SystemExit(
            "duplex serve --redis-sentinel starts its own Redis: unset DUPLEX_REDIS_URL"
        )
    from services.local_redis import RedisSentinelSet

    sentinels = await asyncio.to_thread(RedisSentinelSet)
    try:
        primary, replica = sentinels.primary_port(), sentinels.replica_port()
        print(
            f"duplex serve: a Redis Sentinel set on this machine: primary 127.0.0.1:{primary}, "
            f"replica 127.0.0.1:{replica}, sentinels {', '.join(map(str, sentinels.sentinels))}"
            f" (service {sentinels.service!r}); fail it over with `redis-cli -p "
            f"{next(iter(sentinels.sentinels))} SENTINEL FAILOVER {sentinels.service}` or by "
            "killing the primary",
            flush=True,
        )
        url = sentinels.url
        await _serve(
            dataclasses.replace(api_settings, redis_url=url),
            dataclasses.replace(worker_settings, redis_url=url),
        )
    finally:
        await asyncio.to_thread(sentinels.stop)


async def _serve(api_settings: ApiSettings, worker_settings: WorkerSettings) -> None:
    handle = connect(api_settings.redis_url)
    worker = WorkerProcess(worker_settings, handle)
    # One loop for both: the API pod's monitor logs its stalls; the worker's only feeds the
    # worker's /metrics, when it has a health port at all.
    loop_lag = _worker_loop_lag(worker, warn_after_s=None) if worker.health else None
    await worker.start()
    if loop_lag is not None:
        loop_lag.start()
    server = _uvicorn_server(create_app(api_settings, handle), api_settings)
    serving = asyncio.create_task(server.serve())
    print(
        f"duplex serve: http://{api_settings.host}:{api_settings.port} "
        f"(ws://{api_settings.host}:{api_settings.port}/v1/realtime?duplex=1), "
        f"model {worker_settings.plugin!r}, Redis: {handle.description}",
        flush=True,
    )
    print(serve_hints(api_settings, handle), flush=True)
    try:
        await asyncio.wait(
            [serving, asyncio.create_task(_until_signal())], return_when=asyncio.FIRST_COMPLETED
        )
    finally:
        server.should_exit = True
        if loop_lag is not None:
            await loop_lag.stop()
        await worker.stop()
        await serving
