"""Helpers shared by the tests: handles on running servers, config and request builders."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from gateway.app import Gateway
from gateway.sim.mock import MockServer

MockFactory = Callable[..., Awaitable[MockServer]]


@dataclass
class RunningGateway:
    gateway: Gateway
    url: str  # http://127.0.0.1:PORT
    session: aiohttp.ClientSession
    config_path: Path
    admin_key: str | None = None

    async def reload(self, config: dict[str, Any], **kw: Any) -> tuple[int, dict[str, Any]]:
        """Rewrites the config file and asks for a reload over HTTP."""
        config.setdefault("health", {}).setdefault("probe", {}).setdefault("enabled", False)
        self.config_path.write_text(yaml.safe_dump(config))
        async with self.session.post(self.url + "/admin/reload", **kw) as resp:
            return resp.status, await resp.json()

    @property
    def base_url(self) -> str:
        """What an OpenAI client is given."""
        return self.url + "/v1"

    async def state(self) -> dict[str, Any]:
        headers = {"Authorization": f"Bearer {self.admin_key}"} if self.admin_key else {}
        async with self.session.get(self.url + "/admin/state", headers=headers) as resp:
            assert resp.status == 200
            data: dict[str, Any] = await resp.json()
            return data

    async def assert_quiet(self, within: float = 5.0) -> None:
        """Every counter exact: a quiet gateway shows 0 queued and 0 in flight."""
        deadline = time.monotonic() + within
        while True:
            state = await self.state()
            busy = [
                (name, pool["queued"], [i["in_flight"] for i in pool["instances"]])
                for name, pool in state["pools"].items()
                if pool["queued"]["high"]
                or pool["queued"]["low"]
                or any(i["in_flight"] for i in pool["instances"])
            ]
            if not busy:
                for pool in self.gateway.runtime.pools.values():
                    snap = pool.snapshot()
                    assert snap.outstanding == 0, f"{snap.name}: tickets still outstanding"
                    assert snap.waiters == 0, f"{snap.name}: waiters left behind"
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"gateway not quiet: {busy}")
            await asyncio.sleep(0.02)

    async def wait_queued(
        self, high: int, low: int, pool: str = "p", within: float = 5.0
    ) -> dict[str, Any]:
        """Until the pool's queues hold exactly `high` and `low` requests; the state then."""
        return await self.wait_state(
            lambda s: s["pools"][pool]["queued"] == {"high": high, "low": low},
            within,
            f"queue never reached {high}/{low}",
        )

    async def wait_in_flight(self, n: int, pool: str = "p", within: float = 5.0) -> dict[str, Any]:
        """Until `n` attempts of the pool are in flight; the state then."""
        return await self.wait_state(
            lambda s: s["pools"][pool]["in_flight"] == n, within, f"never {n} in flight"
        )

    async def wait_state(
        self, done: Callable[[dict[str, Any]], bool], within: float = 5.0, what: str = ""
    ) -> dict[str, Any]:
        """Polls /admin/state until `done(state)`; returns that state."""
        deadline = time.monotonic() + within
        while True:
            state = await self.state()
            if done(state):
                return state
            assert time.monotonic() < deadline, f"{what or 'state never matched'}: {state}"
            await asyncio.sleep(0.005)

    async def post(self, path: str, body: Any, **kw: Any) -> aiohttp.ClientResponse:
        return await self.session.post(self.url + path, json=body, **kw)


async def eventually(
    check: Callable[[], Awaitable[bool]] | Callable[[], bool],
    within: float = 5.0,
    what: str = "condition",
) -> None:
    """Polls `check` (sync or async) until it holds; fails after `within` seconds. Tests wait
    for what they need this way, never by sleeping a guessed time."""
    deadline = time.monotonic() + within
    while True:
        result = check()
        if not isinstance(result, bool):
            result = await result
        if result:
            return
        assert time.monotonic() < deadline, f"{what} never held within {within} s"
        await asyncio.sleep(0.005)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for a process the test starts)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pool_config(*instances: MockServer | tuple[MockServer, int], **extra: Any) -> dict[str, Any]:
    """A pool section over mock backends (`(mock, max_concurrency)` or a mock with 4 slots)."""
    out = []
    for n, item in enumerate(instances):
        mock, maxc = item if isinstance(item, tuple) else (item, 4)
        out.append(
            {
                "name": f"m{mock.port}-{n}",
                "url": mock.url,
                "model": "up-model",
                "api_key": "sk-upstream-secret",
                "max_concurrency": maxc,
            }
        )
    return {"instances": out, **extra}


GatewayFactory = Callable[..., Awaitable[RunningGateway]]


def simple_config(pool: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """One pool `p` behind the aliases `m` (bound) and `auto`."""
    return {
        "pools": {"p": pool},
        "models": {"m": {"pool": "p"}},
        **extra,
    }


def chat(text: str = "hi", model: str = "m", **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": text}], **extra}
