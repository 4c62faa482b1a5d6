"""`duplex`: the one entry point (serve, api, worker, sessions).

Each subcommand is wired to its process as that process lands; until then it
says plainly what it will do and exits non-zero instead of pretending to serve.
"""

from __future__ import annotations

import argparse
import sys

EXIT_NOT_AVAILABLE = 3

_PLANNED = {
    "serve": (
        "run everything in one process: the API on --host/--port, one worker with the "
        "CPU 'echo' model, and an embedded Redis (fakeredis) unless DUPLEX_REDIS_URL is set"
    ),
    "api": "run a stateless API pod (FastAPI + uvicorn) against DUPLEX_REDIS_URL",
    "worker": "run a worker pod serving --plugin sessions, registered in DUPLEX_REDIS_URL",
    "sessions": "list, show, tail or close live sessions over Redis",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="duplex", description="Serve full-duplex speech models.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = commands.add_parser("serve", help=_PLANNED["serve"])
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--plugin", default="echo")
    api = commands.add_parser("api", help=_PLANNED["api"])
    api.add_argument("--host", default="0.0.0.0")
    api.add_argument("--port", type=int, default=8000)
    worker = commands.add_parser("worker", help=_PLANNED["worker"])
    worker.add_argument("--plugin", default="echo")
    sessions = commands.add_parser("sessions", help=_PLANNED["sessions"])
    sessions.add_argument("action", choices=["ls", "show", "tail", "close"])
    sessions.add_argument("session_id", nargs="?")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    print(
        f"duplex {args.command}: not available yet in this build.\n"
        f"  It will {_PLANNED[args.command]}.\n"
        "  What exists today is the wire codec (shared.protocol.duplex); see README.md.",
        file=sys.stderr,
    )
    return EXIT_NOT_AVAILABLE


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
