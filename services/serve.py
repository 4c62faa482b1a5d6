"""`duplex serve`, `duplex api`, `duplex worker`: run the processes.

`serve` runs one API and one worker in one process on one event loop, sharing
an embedded Redis (fakeredis with Lua) unless DUPLEX_REDIS_URL is set.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal

import uvicorn

from services.api.app import create_app
from services.worker.process import WorkerProcess
from shared.redis.connection import RedisHandle, connect
from shared.settings import ApiSettings, WorkerSettings

log = logging.getLogger("duplex")


def _uvicorn_server(app, settings: ApiSettings) -> uvicorn.Server:
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        ws="websockets-sansio",
        # No permessage-deflate: base64 audio barely compresses, and compressing every frame
        # cost the API pod about 5% of its CPU in bench/profile for nothing.
        ws_per_message_deflate=False,
        log_level="warning",
        lifespan="on",
        # SIGTERM: stop accepting, close sockets with 1012 (reconnect and resume), then
        # wait at most this long for connections to finish before exiting
        timeout_graceful_shutdown=settings.drain_timeout_s,
    )
    server = uvicorn.Server(config)
    server.install_signal_handlers = lambda: None  # we own SIGTERM/SIGINT
    return server


async def _until_signal() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    await stop.wait()


async def run_worker(settings: WorkerSettings, redis: RedisHandle | None = None) -> None:
    if redis is None and not settings.redis_url:
        raise SystemExit("duplex worker needs DUPLEX_REDIS_URL (only `duplex serve` embeds Redis)")
    handle = redis or connect(settings.redis_url)
    worker = WorkerProcess(settings, handle)
    await worker.start()
    try:
        await _until_signal()
    finally:
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


async def run_serve(api_settings: ApiSettings, worker_settings: WorkerSettings) -> None:
    handle = connect(api_settings.redis_url)
    worker = WorkerProcess(worker_settings, handle)
    await worker.start()
    server = _uvicorn_server(create_app(api_settings, handle), api_settings)
    serving = asyncio.create_task(server.serve())
    print(
        f"duplex serve: http://{api_settings.host}:{api_settings.port} "
        f"(ws://{api_settings.host}:{api_settings.port}/v1/realtime?duplex=1), "
        f"model {worker_settings.plugin!r}, Redis: {handle.description}",
        flush=True,
    )
    try:
        await asyncio.wait(
            [serving, asyncio.create_task(_until_signal())], return_when=asyncio.FIRST_COMPLETED
        )
    finally:
        server.should_exit = True
        await worker.stop()
        await serving
