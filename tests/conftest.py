"""Shared fixtures: real servers on 127.0.0.1 — `gateway mock` backends and the gateway."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import yaml
from aiohttp import web

from gateway.app import Gateway
from gateway.config import parse_config
from gateway.health import Prober
from gateway.mock import MockBehavior, MockServer
from support import GatewayFactory, MockFactory, RunningGateway


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
    running: list[tuple[RunningGateway, web.ServerRunner, Prober]] = []

    async def start(config: dict[str, Any], *, probes: bool = False) -> RunningGateway:
        config.setdefault("health", {}).setdefault("probe", {}).setdefault("enabled", probes)
        path = tmp_path_factory.mktemp("gw") / "gateway.yaml"
        path.write_text(yaml.safe_dump(config))
        cfg = parse_config(path.read_text(), env={})
        gw = Gateway(cfg, config_path=str(path))
        runner = web.ServerRunner(gw.server(), handle_signals=False, shutdown_timeout=1.0)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        prober = Prober(gw.runtime)
        prober.start()
        session = aiohttp.ClientSession()
        admin = (config.get("auth") or {}).get("admin_key")
        handle = RunningGateway(gw, f"http://127.0.0.1:{port}", session, path, admin)
        running.append((handle, runner, prober))
        return handle

    yield start
    for handle, runner, prober in running:
        await prober.stop()
        await handle.session.close()
        await runner.cleanup()
        await handle.gateway.close()
