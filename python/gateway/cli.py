"""The command line (SPEC §10): serve, check, mock, demo."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from aiohttp import web

from gateway import __version__
from gateway.config import describe, load_config
from gateway.errors import ConfigError
from gateway.logs import setup_logging

if TYPE_CHECKING:
    from gateway.app import Gateway

__all__ = ["main"]

log = logging.getLogger("gateway")


def _event_loop_policy() -> None:
    with contextlib.suppress(ImportError):
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


async def serve(args: argparse.Namespace) -> int:
    """Runs the gateway until SIGTERM/SIGINT, then drains (SPEC §7)."""
    from gateway.app import Gateway
    from gateway.health import Prober

    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    host = args.host or config.listen.host
    port = args.port if args.port is not None else config.listen.port
    gateway = Gateway(config, config_path=args.config)
    runner = web.ServerRunner(gateway.server(), handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=4096, reuse_address=True)
    await site.start()
    prober = Prober(gateway.runtime)
    prober.start()
    bound = runner.addresses[0] if runner.addresses else (host, port)
    print(f"gateway {__version__} listening on http://{bound[0]}:{bound[1]}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    background: set[asyncio.Task[object]] = set()

    def reload_soon() -> None:
        task = loop.create_task(gateway.reload())
        background.add(task)
        task.add_done_callback(background.discard)

    # SPEC §8: hot reload on SIGHUP, POST /admin/reload, or a changed file with --watch.
    loop.add_signal_handler(signal.SIGHUP, reload_soon)
    watcher = loop.create_task(_watch(args.config, reload_soon)) if args.watch else None
    janitor = loop.create_task(_janitor(gateway))
    await stop.wait()
    for task in (watcher, janitor):
        if task is not None:
            task.cancel()
    log.info("draining", extra={"fields": {"deadline_ms": config.shutdown.drain_timeout_ms}})
    await gateway.drain(site)
    await prober.stop()
    await runner.cleanup()
    await gateway.close()
    log.info("stopped")
    return 0


async def _watch(path: str, reload: Callable[[], None], interval: float = 1.0) -> None:
    """Polls the config file's identity (mtime, size, inode); a change triggers a reload."""

    def stamp() -> tuple[int, int, int] | None:
        try:
            st = os.stat(path)
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    last = stamp()
    while True:
        await asyncio.sleep(interval)
        now = stamp()
        if now is not None and now != last:
            last = now
            reload()


async def _janitor(gateway: Gateway, interval: float = 5.0) -> None:
    """Closes the connection pools of instances and pools that drained after a reload."""
    while True:
        await asyncio.sleep(interval)
        await gateway.runtime.collect()


def check(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.file)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    print(describe(config))
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

    p = sub.add_parser("check", help="validate a config and print the routing table")
    p.add_argument("file")

    from gateway import mock

    p = sub.add_parser("mock", help="an OpenAI-compatible simulated model server")
    mock.add_arguments(p)

    from gateway import demo

    p = sub.add_parser("demo", help="simulated pools, a judge workload and an injected failure")
    demo.add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.log_format, args.log_level, not getattr(args, "no_access_log", False))
    if args.command == "check":
        return check(args)
    _event_loop_policy()
    if args.command == "serve":
        return asyncio.run(serve(args))
    if args.command == "mock":
        from gateway import mock

        return mock.run(args)
    from gateway import demo

    return demo.run(args)


if __name__ == "__main__":
    raise SystemExit(main())
