"""Issue 20: "a request's path through the code goes down, not back and forth — the ingress
(`app.py`) hands a request on and is not re-entered" by the modules it hands it to. Served
through HTTP with the access log on, plain and streamed: every entry into app.py's code from
outside it is aiohttp calling the handler (and resuming it), never a call back up from
forward.py, the pool, the scheduler or the log (the runtime and the drain's verdict are values
handed down; the access line's values are built below the ingress)."""

from __future__ import annotations

import asyncio
import collections
import os
import sys
from types import FrameType
from typing import Any

import aiohttp
import pytest

import gateway.app
from gateway import logs
from gateway.logs import AccessLog, Sink
from support import GatewayFactory, MockFactory, chat, pool_config, simple_config

APP = os.path.abspath(gateway.app.__file__)


@pytest.mark.parametrize("stream", [False, True])
async def test_the_ingress_is_not_re_entered_on_a_requests_way(
    gateway_factory: GatewayFactory,
    mocks: MockFactory,
    monkeypatch: pytest.MonkeyPatch,
    stream: bool,
) -> None:
    devnull = os.open(os.devnull, os.O_WRONLY)
    monkeypatch.setattr(logs, "_ACCESS", AccessLog(Sink(devnull), "json"))
    m = await mocks()
    gw = await gateway_factory(simple_config(pool_config(m)))
    url = gw.base_url + "/chat/completions"
    entries: collections.Counter[str] = collections.Counter()

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event != "call" or frame.f_code.co_filename != APP:
            return
        caller = frame.f_back
        where = caller.f_code.co_filename if caller is not None else "<loop>"
        if where != APP:
            entries[f"{frame.f_code.co_name} <- {os.path.basename(where)}"] += 1

    try:
        async with aiohttp.ClientSession() as session:
            async with session.post(url, json=chat(stream=stream)) as r:
                await r.read()  # warm: the first request builds connections and caches
                assert r.status == 200
            sys.setprofile(profile)
            try:
                for _ in range(3):
                    async with session.post(url, json=chat(stream=stream)) as r:
                        body = await r.read()
                        assert r.status == 200, body
                logs._ACCESS.sink.flush()  # type: ignore[union-attr]  # the lines get built
                await asyncio.sleep(0)
            finally:
                sys.setprofile(None)
        await gw.assert_quiet()
    finally:
        monkeypatch.undo()  # the gateway's log no longer writes to the descriptor
        os.close(devnull)
    assert entries, "the profile saw the requests"
    back_up = {k: v for k, v in entries.items() if not k.startswith("handle <- ")}
    assert back_up == {}, f"app.py re-entered from below: {dict(entries)}"
