"""The command line (SPEC §10): serve, check, schema, mock, demo."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import logging
import os
import sys

from gateway import __version__
from gateway.check import describe, describe_errors
from gateway.config import Config, load_config
from gateway.errors import ConfigError
from gateway.logs import setup_logging
from gateway.topology import Topology, WorkerLink
from gateway.workers import enter_worker, resolve_workers, tuning

__all__ = ["main"]

log = logging.getLogger("gateway")


def _event_loop_policy() -> None:
    with contextlib.suppress(ImportError):
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


async def serve(args: argparse.Namespace, worker: WorkerLink | None = None) -> int:
    """Runs the gateway until SIGTERM/SIGINT, then drains (SPEC §7). `worker`: this process's
    place among the workers the supervisor started (None: it is the whole gateway)."""
    from gateway.server import ListenError, Server

    try:
        config = load_config(args.config)
    except ConfigError as exc:
        return _cannot_start(2, f"config error: {exc}", worker)
    if args.workers > 1 and worker is None:
        return await supervise(args, config)
    topology = Topology.workers(worker) if worker is not None else Topology.single()
    server = Server(
        config,
        config_path=args.config,
        host=args.host,
        port=args.port,
        watch=args.watch,
        topology=topology,
    )

    def listening(s: Server) -> None:
        # What start-up built (config, pools, routes, imported modules: ~50k objects) lives as
        # long as the process: out of the collector's sight, a full collection pauses the loop
        # 3 ms instead of ~20 ms (measured under 400 streams; such a pause delays every event
        # in flight).
        gc.freeze()
        if worker is None:  # a worker: the supervisor says it once for all (SPEC §12)
            print(f"gateway {__version__} listening on {s.url}", flush=True)

    try:
        await server.serve(listening)
    except ListenError as exc:
        return _cannot_start(1, str(exc), worker)
    return 0


def _cannot_start(status: int, reason: str, worker: WorkerLink | None) -> int:
    """The gateway cannot start: one line on stderr, and `status`. A worker tells its
    supervisor instead, which says it once for all (SPEC §12: it stops when every worker
    reports the same; until then the others serve and the slot is retried)."""
    if worker is None or not worker.cannot_start(status, reason):
        print(reason, file=sys.stderr)
    return status


async def supervise(args: argparse.Namespace, config: Config) -> int:
    """SPEC §12: N workers on one port, one gateway."""
    from gateway.workers import Supervisor, unavailable

    missing = unavailable()
    if missing is not None:  # SPEC §18: where memfd/pidfd are missing, --workers says so
        print(f"--workers {args.workers}: {missing}", file=sys.stderr)
        return 2
    argv = ["--log-format", args.log_format, "--log-level", args.log_level, "serve"]
    argv += ["--config", args.config]  # the supervisor adds `--worker K/N` and `--port`
    host = args.host or config.listen.host
    argv += ["--host", host]
    if args.watch:
        argv.append("--watch")
    if args.no_access_log:
        argv.append("--no-access-log")
    port = args.port if args.port is not None else config.listen.port
    try:
        # The composition root reads the supervisor's timing overrides, once.
        supervisor = Supervisor(args.workers, argv, host, port, **tuning(os.environ))
    except OSError as exc:
        print(f"cannot listen on {host}:{port}: {exc.strerror}", file=sys.stderr)
        return 1

    def listening(s: Supervisor) -> None:
        print(f"gateway {__version__} listening on {s.url} ({s.n} workers)", flush=True)

    return await supervisor.run(listening)


def check(args: argparse.Namespace) -> int:
    """SPEC §18: every error of the file in one run (exit 2), or the summary of every section."""
    try:
        config = load_config(args.file)
    except ConfigError as exc:
        print(describe_errors(exc, args.file), end="", file=sys.stderr)
        return 2
    print(describe(config))
    return 0


def schema(args: argparse.Namespace) -> int:
    """SPEC §18: the config's JSON Schema, for editors."""
    from gateway.config.json_schema import json_schema

    print(json.dumps(json_schema(), indent=2, ensure_ascii=False))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gateway", description="OpenAI-compatible model gateway")
    parser.add_argument("--version", action="version", version=f"gateway {__version__}")
    parser.add_argument("--log-format", choices=("text", "json"), default="text")
    parser.add_argument("--log-level", default="info")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="run the gateway")
    p.add_argument("--config", required=True, help="YAML config file")
    p.add_argument("--host", help="listen address (overrides listen.host)")
    p.add_argument("--port", type=int, help="listen port (overrides listen.port)")
    p.add_argument("--watch", action="store_true", help="reload when the config file changes")
    p.add_argument("--no-access-log", action="store_true", help="no per-request log line")
    p.add_argument(
        "--workers",
        type=resolve_workers,
        default=1,
        help="worker processes sharing one scheduling state: N or auto (one per CPU, at most 8)",
    )
    # Given by the supervisor to each worker, so `ps` says what the process is ("serve
    # --worker 1/4": slot 1 of 4); the worker learns its place from its environment.
    p.add_argument("--worker", metavar="K/N", help=argparse.SUPPRESS)

    p = sub.add_parser("check", help="validate a config and print the routing table")
    p.add_argument("file")

    sub.add_parser(
        "schema",
        help="print the config's JSON Schema (for editors' YAML language servers)",
        description="Prints the JSON Schema of the config file. Point an editor at it, e.g. "
        "`# yaml-language-server: $schema=gateway.schema.json` as the file's first line.",
    )

    from gateway.sim import mock

    p = sub.add_parser("mock", help="an OpenAI-compatible simulated model server")
    mock.add_arguments(p)

    from gateway.sim import demo

    p = sub.add_parser("demo", help="simulated pools, a judge workload and an injected failure")
    demo.add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.log_format, args.log_level, not getattr(args, "no_access_log", False))
    if args.command == "check":
        return check(args)
    if args.command == "schema":
        return schema(args)
    _event_loop_policy()
    if args.command == "serve":
        # SPEC §12: a worker started by the supervisor attaches here; its place among the
        # workers is handed down from here as a value (the topology), never read from a global.
        worker = enter_worker()
        return asyncio.run(serve(args, worker))
    if args.command == "mock":
        from gateway.sim import mock

        return mock.run(args)
    from gateway.sim import demo

    return demo.run(args)


if __name__ == "__main__":
    raise SystemExit(main())
