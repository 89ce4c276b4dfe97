"""Shared fixtures: real servers on 127.0.0.1 — `gateway mock` backends and the gateway."""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any

import aiohttp
import pytest
import uvloop
import yaml

from gateway.config import parse_config
from gateway.server import Server
from gateway.sim.mock import MockBehavior, MockServer
from support import GatewayFactory, MockFactory, RunningGateway


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every async test ends within its timeout (the `timeout` mark, else the ini's), by the
    loop's own clock. pytest-timeout's SIGALRM could not end a test awaiting something that
    never comes on uvloop: its exception was raised in the loop's signal callback and
    swallowed there, the loop stopped running its timers, and the run hung instead of failing
    (a test that awaited a future nobody sets held the suite until the outer kill). So the
    loop's timeout comes first, at three quarters of it, raising TimeoutError where the test
    waits and leaving the rest for its clean-up; pytest-timeout (the thread method, see
    pyproject) is the backstop that ends the run with every thread's stack."""
    for item in items:
        test = getattr(item, "obj", None)
        if isinstance(item, pytest.Function) and inspect.iscoroutinefunction(test):
            marker = item.get_closest_marker("timeout")
            seconds = float(marker.args[0] if marker else item.config.getini("timeout"))
            if seconds > 0:
                item.obj = _within(test, seconds * 0.75)


def _within(
    test: Callable[..., Awaitable[None]], seconds: float
) -> Callable[..., Coroutine[Any, Any, None]]:
    @functools.wraps(test)
    async def bounded(*args: Any, **kwargs: Any) -> None:
        async with asyncio.timeout(seconds):
            await test(*args, **kwargs)

    return bounded


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> dict[str, Callable[[], asyncio.AbstractEventLoop]]:
    """Tests run on uvloop, the loop `gateway serve` runs on (its transports differ from
    asyncio's: a client that only worked on the default loop would pass and then fail)."""
    return {"uvloop": uvloop.new_event_loop}


@pytest.fixture
async def mocks() -> AsyncIterator[MockFactory]:
    """Starts simulated backends: `m = await mocks(latency_ms=50)`."""
    started: list[MockServer] = []

    async def start(**behavior: Any) -> MockServer:
        server = MockServer(MockBehavior(**behavior))
        await server.start()
        started.append(server)
        return server

    yield start
    for server in started:
        await server.stop()


@pytest.fixture
async def gateway_factory(
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[GatewayFactory]:
    """Starts the gateway in process on a free port with a config dict (YAML semantics)."""
    running: list[tuple[RunningGateway, Server]] = []

    async def start(config: dict[str, Any], *, probes: bool = False) -> RunningGateway:
        config.setdefault("health", {}).setdefault("probe", {}).setdefault("enabled", probes)
        path = tmp_path_factory.mktemp("gw") / "gateway.yaml"
        path.write_text(yaml.safe_dump(config))
        cfg = parse_config(path.read_text(), env={})
        server = Server(cfg, config_path=str(path), host="127.0.0.1", port=0)
        await server.start()
        session = aiohttp.ClientSession()
        admin = (config.get("auth") or {}).get("admin_key")
        handle = RunningGateway(server.gateway, server.url, session, path, admin)
        running.append((handle, server))
        return handle

    yield start
    for handle, server in running:
        await handle.session.close()
        await server.shutdown(drain=False)
