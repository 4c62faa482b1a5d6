"""`duplex`: the one entry point (serve, api, worker, sessions)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import sys
from collections.abc import Coroutine
from typing import Any

from services.exit_codes import EXIT_NOT_AVAILABLE


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="duplex", description="Serve full-duplex speech models.")
    _log_level_argument(parser, default=None)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = commands.add_parser(
        "serve", help="API + worker in one process (embedded Redis unless DUPLEX_REDIS_URL)"
    )
    serve.add_argument("--host", default=None, help="default 127.0.0.1")
    serve.add_argument("--port", type=int, default=None, help="default 8000")
    serve.add_argument("--plugin", default=None, help="model plugin (default echo)")
    serve.add_argument("--max-sessions", type=int, default=None)
    serve.add_argument("--llm-model", default=None, help="assistant: a local model dir for vLLM")
    serve.add_argument(
        "--redis-sentinel",
        action="store_true",
        help="run on a Redis Sentinel set started here (a primary, a replica, three sentinels, "
        "from the system's redis-server), to try a failover; stopped on exit",
    )
    _model_arguments(serve)
    api = commands.add_parser("api", help="a stateless API pod (needs DUPLEX_REDIS_URL)")
    api.add_argument("--host", default=None)
    api.add_argument("--port", type=int, default=None)
    worker = commands.add_parser("worker", help="a worker pod (needs DUPLEX_REDIS_URL)")
    worker.add_argument("--plugin", default=None)
    worker.add_argument("--worker-id", default=None)
    worker.add_argument("--max-sessions", type=int, default=None)
    worker.add_argument("--llm-model", default=None, help="assistant: a local model dir for vLLM")
    _model_arguments(worker)
    sessions = commands.add_parser(
        "sessions", help="inspect live sessions over Redis (DUPLEX_REDIS_URL)"
    )
    sessions.add_argument("action", choices=["ls", "show", "tail", "close"])
    sessions.add_argument("session_id", nargs="?")
    sessions.add_argument(
        "--json", action="store_true", dest="as_json", help="ls: one JSON record a line"
    )
    sessions.add_argument(
        "--reason", default="admin_close", help="close: the session.closed reason"
    )
    sessions.add_argument(
        "-n",
        "--lines",
        type=int,
        default=10,
        help="show, tail: how many of the latest journaled events to print first (default 10)",
    )
    sessions.add_argument(
        "--limit", type=int, default=None, help="tail: stop after M printed events"
    )
    workers = commands.add_parser(
        "workers", help="live workers, their load and capacity (DUPLEX_REDIS_URL)"
    )
    workers.add_argument("--json", action="store_true", dest="as_json")
    for command in (serve, api, worker, sessions, workers):
        # after the command too (`make serve ARGS="--log-level debug"`); unset, the one before
        # the command (or none) stands
        _log_level_argument(command, default=argparse.SUPPRESS)
    return parser


LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def _log_level(text: str) -> str:
    """One `--log-level` (any case; argparse refuses another word, clearly)."""
    from shared.settings import LogLevelError, parse_log_level

    try:
        return parse_log_level(text)
    except LogLevelError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _log_level_argument(parser: argparse.ArgumentParser, default: str | None) -> None:
    parser.add_argument(
        "--log-level",
        type=_log_level,
        default=default,
        metavar="LEVEL",
        help="debug, info (default), warning or error; env DUPLEX_LOG_LEVEL. At info the log "
        "has starts, stops, session moves, refusals and failures; debug adds routine periodic "
        "work (the janitor's ticks)",
    )


def configure_logging(flag: str | None) -> str:
    """The root logger at `--log-level`, else DUPLEX_LOG_LEVEL, else INFO; returns the level.
    Raises `LogLevelError` for a DUPLEX_LOG_LEVEL that names no level."""
    from shared.settings import log_level_from_env

    level = flag or log_level_from_env()
    logging.basicConfig(format=LOG_FORMAT)  # a handler on stderr, unless one is there already
    logging.getLogger().setLevel(level)  # the level either way (basicConfig skips it then)
    return level


def _plugin_option(text: str) -> tuple[str, str]:
    """One `--plugin-option KEY=VALUE` (argparse refuses a malformed one, clearly)."""
    from shared.settings import parse_plugin_options

    try:
        ((key, value),) = parse_plugin_options([text]).items()
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return key, value


def _model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model-dir",
        default=None,
        help="a local checkpoint directory for the plugin (moshi); env DUPLEX_MODEL_DIR",
    )
    parser.add_argument(
        "--plugin-option",
        action="append",
        type=_plugin_option,
        default=[],
        metavar="KEY=VALUE",
        help="an option for the plugin (repeatable; moshi: preset, device, voice_prompt_dir, "
        "...); env DUPLEX_PLUGIN_OPTIONS=k=v,k2=v2",
    )


def _worker_settings(args: argparse.Namespace, **more: Any):
    from shared.settings import WorkerSettings

    return WorkerSettings.from_env(
        plugin=args.plugin,
        max_sessions=args.max_sessions,
        llm_model=args.llm_model,
        model_dir=args.model_dir,
        extra_plugin_options=dict(args.plugin_option),
        **more,
    )


def run_event_loop(main: Coroutine[Any, Any, None]) -> None:
    """Run a process's main coroutine on uvloop when it is installed (it is a dependency on
    Linux and macOS): bench/latency measured the event loop's own bookkeeping and socket
    writes as the largest costs of the distributed path. DUPLEX_EVENT_LOOP=asyncio opts out."""
    factory = None
    if os.environ.get("DUPLEX_EVENT_LOOP", "uvloop") == "uvloop":
        with contextlib.suppress(ImportError):
            import uvloop

            factory = uvloop.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(main)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from shared.settings import LogLevelError

    try:
        configure_logging(args.log_level)
    except LogLevelError as exc:
        print(f"duplex {args.command}: {exc}", file=sys.stderr)
        return 2
    if args.command in ("sessions", "workers"):
        return _admin(args)  # before importing the servers: admin commands read Redis only
    from services import serve
    from shared.settings import ApiSettings, PluginOptionsError

    try:
        if args.command == "serve":
            api = ApiSettings.from_env(host=args.host, port=args.port)
            run_event_loop(
                serve.run_serve(api, _worker_settings(args), sentinel=args.redis_sentinel)
            )
        elif args.command == "api":
            run_event_loop(
                serve.run_api(ApiSettings.from_env(host=args.host or "0.0.0.0", port=args.port))
            )
        elif args.command == "worker":
            run_event_loop(serve.run_worker(_worker_settings(args, worker_id=args.worker_id)))
    except KeyboardInterrupt:
        pass
    except PluginOptionsError as exc:
        print(f"duplex {args.command}: {exc}", file=sys.stderr)
        return 2
    return 0


def _admin(args: argparse.Namespace) -> int:
    """`duplex sessions ...` and `duplex workers`: they import the Redis client, the key
    schema and the store, never the servers, the wire codec (numpy), or a plugin, so they
    start in a fraction of the time (docs/operations.md)."""
    from services import admin
    from shared.redis.connection import connect
    from shared.settings import RedisSettings

    settings = RedisSettings(**RedisSettings.redis_from_env())
    if not settings.redis_url:
        print(
            f"duplex {args.command} needs DUPLEX_REDIS_URL (an embedded Redis has no port): "
            "start a redis-server (redis-server --port 6379 --daemonize yes), run the servers "
            "on it (DUPLEX_REDIS_URL=redis://localhost:6379/0 make serve) and set the same "
            "DUPLEX_REDIS_URL here (docs/operations.md)",
            file=sys.stderr,
        )
        return EXIT_NOT_AVAILABLE
    action = "workers" if args.command == "workers" else args.action
    options = {"as_json": args.as_json}
    if args.command == "sessions":
        if args.lines < 0 or (args.limit is not None and args.limit < 1):
            print("duplex sessions: -n needs N >= 0 and --limit M >= 1", file=sys.stderr)
            return 2
        options.update(reason=args.reason, limit=args.limit, lines=args.lines)
    return admin.main(
        connect(settings.redis_url),
        settings.key_prefix,
        action,
        getattr(args, "session_id", None),
        **options,
    )


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
