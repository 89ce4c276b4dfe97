"""GET /dashboard (SPEC §7) in a real headless Chromium, driven over the DevTools protocol.

The browser runs as a subprocess of the test's event loop (which also runs the gateway); the
test talks to it over a websocket with aiohttp, evaluates expressions in the page and waits for
conditions, so it sees what a person would: the DOM after the page's own polling of
/admin/state, with its computed colours.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import re
import shutil
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from gateway.dashboard import render
from gateway.sim.mock import MockServer
from support import GatewayFactory, MockFactory, RunningGateway, chat, pool_config

CHROMIUM = next(
    (
        path
        for path in (
            os.environ.get("CHROMIUM"),
            shutil.which("chromium"),
            shutil.which("chromium-browser"),
            shutil.which("google-chrome"),
        )
        if path
    ),
    None,
)

ADMIN_KEY = "adm+in/key=1&x"  # "+", "/", "=" and "&" survive the #key= fragment


class Page:
    """One tab of a headless Chromium, spoken to over the DevTools protocol (CDP)."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws = ws
        self._ids = itertools.count(1)
        # Uncaught exceptions and CSP violations seen in the page (failed fetches are not:
        # the tests cause some on purpose).
        self.errors: list[Any] = []

    async def send(self, method: str, **params: Any) -> dict[str, Any]:
        msg_id = next(self._ids)
        await self.ws.send_json({"id": msg_id, "method": method, "params": params})
        async with asyncio.timeout(10):
            while True:
                msg = await self.ws.receive()
                if msg.type != aiohttp.WSMsgType.TEXT:
                    raise ConnectionError(f"DevTools socket: {msg.type!r}")
                data: dict[str, Any] = json.loads(msg.data)
                if data.get("method") == "Runtime.exceptionThrown":
                    self.errors.append(data["params"]["exceptionDetails"])
                elif data.get("method") == "Log.entryAdded":
                    entry = data["params"]["entry"]
                    if entry.get("source") in ("javascript", "security"):
                        self.errors.append(entry)
                if data.get("id") != msg_id:
                    continue  # an event, or an answer nobody waits for any more
                if "error" in data:
                    raise RuntimeError(f"{method}: {data['error']}")
                result: dict[str, Any] = data.get("result", {})
                return result

    async def evaluate(self, expression: str) -> Any:
        result = await self.send(
            "Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True
        )
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def goto(self, url: str) -> None:
        await self.send("Page.navigate", url=url)

    async def wait_for(self, expression: str, within: float = 8.0) -> Any:
        """Polls `expression` in the page until it is truthy (as a JSON value seen from Python:
        write `!!` before a DOM node); fails with what the page shows."""
        deadline = time.monotonic() + within
        while True:
            try:
                value = await self.evaluate(expression)
            except RuntimeError:
                value = None  # the page is between two documents
            if value:
                return value
            if time.monotonic() > deadline:
                text = await self.evaluate("document.body ? document.body.innerText : ''")
                raise AssertionError(f"timed out waiting for {expression!r}; page shows:\n{text}")
            await asyncio.sleep(0.1)


@pytest.fixture
async def page(tmp_path: Path) -> AsyncIterator[Page]:
    if CHROMIUM is None:
        pytest.skip("no chromium binary (CI installs one)")
    proc = await asyncio.create_subprocess_exec(
        CHROMIUM,
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--no-first-run",
        "--no-default-browser-check",
        "--disable-extensions",
        "--remote-debugging-port=0",
        f"--user-data-dir={tmp_path / 'profile'}",
        "--window-size=1280,800",
        "about:blank",
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
        start_new_session=True,  # its renderers share our process group id: ended together
    )
    assert proc.stderr is not None
    stderr = proc.stderr
    session = aiohttp.ClientSession()
    drain: asyncio.Task[None] | None = None
    try:
        # The port is read from stderr rather than <profile>/DevToolsActivePort: a snap-packaged
        # Chromium writes its profile into a private /tmp.
        lines: list[bytes] = []
        port = 0
        async with asyncio.timeout(20):
            while not port:
                line = await stderr.readline()
                if not line:
                    tail = b"".join(lines[-20:]).decode(errors="replace")
                    raise RuntimeError(f"chromium exited before listening:\n{tail}")
                lines.append(line)
                if found := re.search(rb"DevTools listening on ws://[^\s/]+:(\d+)/", line):
                    port = int(found.group(1))

            async def drained() -> None:  # chromium logs on; a full pipe would block it
                while await stderr.read(1 << 16):
                    pass

            drain = asyncio.create_task(drained())
            targets: list[dict[str, Any]] = []
            while not targets:
                with contextlib.suppress(aiohttp.ClientError):
                    async with session.get(f"http://127.0.0.1:{port}/json/list") as resp:
                        targets = [t for t in await resp.json() if t.get("type") == "page"]
                if not targets:
                    await asyncio.sleep(0.05)
        async with session.ws_connect(targets[0]["webSocketDebuggerUrl"], max_msg_size=0) as ws:
            tab = Page(ws)
            for domain in ("Page", "Runtime", "Log"):
                await tab.send(f"{domain}.enable")
            yield tab
            await tab.evaluate("0")  # reads the events still queued
            assert tab.errors == [], tab.errors
    finally:
        await session.close()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), 5)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
        if drain is not None:
            await drain


def _config(*pools: dict[str, Any], **extra: Any) -> dict[str, Any]:
    names = ["heavy", "light"][: len(pools)]
    return {
        "pools": dict(zip(names, pools, strict=True)),
        "models": {f"m-{name}": {"pool": name} for name in names},
        # One failure ejects, for long enough to be seen.
        "health": {"failure_threshold": 1, "ejection_ms": 60_000, "max_ejection_ms": 60_000},
        "timeouts": {"first_byte_ms": 2000, "stream_idle_ms": 2000, "total_ms": 5000},
        **extra,
    }


def _name(state: dict[str, Any], pool: str, mock: MockServer) -> str:
    for inst in state["pools"][pool]["instances"]:
        if inst["name"].startswith(f"m{mock.port}-"):
            return str(inst["name"])
    raise KeyError(mock.port)


INSTANCES_JS = """[...document.querySelectorAll('[data-instance]')]
    .map(e => [e.dataset.instance, e.dataset.state, e.textContent])"""


def _colour(selector: str) -> str:
    """JS: the computed colour of the state stripe of `selector`, as [r, g, b]."""
    return f"""(() => {{
        const e = document.querySelector({json.dumps(selector)});
        if (!e) return null;
        const m = getComputedStyle(e).borderLeftColor.match(/\\d+(\\.\\d+)?/g);
        return m && m.slice(0, 3).map(Number);
    }})()"""


async def test_page_is_self_contained_html(
    mocks: MockFactory, gateway_factory: GatewayFactory
) -> None:
    gw = await gateway_factory(_config(pool_config(await mocks())))
    async with gw.session.get(gw.url + "/dashboard") as resp:
        assert resp.status == 200
        assert resp.content_type == "text/html"
        body = await resp.read()
    assert body == render()
    html = body.decode()
    assert html.lstrip().lower().startswith("<!doctype html>")
    # No build step, no CDN, no external font: nothing is loaded from anywhere else.
    assert not re.search(r"(?i)(?:https?:|wss?:)?//[a-z0-9.-]+\.[a-z]{2,}", html)
    assert not re.search(r"(?i)\b(?:src|href)\s*=\s*[\"'](?!data:)", html)
    assert not re.search(r"(?i)@import|url\(|\bimport\s*\(", html)
    assert "default-src 'none'" in html  # and the page's CSP enforces it in the browser
    assert "fetch(" in html and "admin/state" in html
    # Strings from the state go through textContent, never through an HTML parser.
    assert not re.search(r"innerHTML|outerHTML|insertAdjacentHTML|document\.write", html)


async def test_dashboard_shows_instances_and_ejection(
    page: Page, mocks: MockFactory, gateway_factory: GatewayFactory
) -> None:
    a, b, c, d = [await mocks() for _ in range(4)]
    gw = await gateway_factory(
        _config(pool_config(a, b, fallback="light"), pool_config(c, d, spill_to="heavy"))
    )
    state = await gw.state()
    assert state["pools"]["light"]["spill_to"] == "heavy"
    assert state["pools"]["heavy"]["spill_to"] is None
    expected = {
        f"{pool}/{_name(state, pool, mock)}"
        for pool, mock in (("heavy", a), ("heavy", b), ("light", c), ("light", d))
    }
    await page.goto(gw.url + "/dashboard")
    await page.wait_for(f"document.querySelectorAll('[data-instance]').length === {len(expected)}")
    shown = await page.evaluate(INSTANCES_JS)
    assert {key for key, _, _ in shown} == expected
    assert all(st == "healthy" for _, st, _ in shown), shown
    assert all(key.split("/", 1)[1] in text for key, _, text in shown)
    assert all("0 / 4" in text for _, _, text in shown)  # in flight against capacity
    assert await page.evaluate("document.getElementById('conn').dataset.conn") == "live"
    assert await page.evaluate("!document.body.hasAttribute('data-stale')")
    assert "fallback → light" in await page.evaluate("document.body.innerText")
    # where each pool's work goes besides: its fallback, and its spill target when saturated
    heads = await page.evaluate(
        "Object.fromEntries([...document.querySelectorAll('[data-pool]')]"
        ".map(e => [e.dataset.pool, e.querySelector('.pool-head').innerText]))"
    )
    assert "fallback → light" in heads["heavy"] and "spill" not in heads["heavy"], heads
    assert "no fallback" in heads["light"] and "spill → heavy" in heads["light"], heads
    r, g, _ = await page.evaluate(_colour('[data-state="healthy"]'))
    assert g > 120 and g > r + 40, "healthy is green"

    # One instance fails and is ejected: the page follows by itself.
    await a.set_down(True)
    name = _name(state, "heavy", a)
    await _eject(gw, name)
    row = f'[data-instance="heavy/{name}"]'
    await page.wait_for(f"document.querySelector('{row}').dataset.state === 'ejected'")
    r, g, b_ = await page.evaluate(_colour(f'{row}[data-state="ejected"]'))
    assert r > 180 and g < 110 and b_ < 110, "ejected is red"
    text = await page.evaluate(f"document.querySelector('{row}').innerText")
    assert "ejected" in text and re.search(r"retry in \d+(\.\d)? s", text), text
    # what ejected it, not "failures 0" (the core starts counting again at an ejection)
    assert "failures 0" not in text, text
    assert "ejected 1×" in text, text
    assert re.search(r"last failure [\d.]+ s ago: cannot connect to upstream", text), text
    others = [st for key, st, _ in await page.evaluate(INSTANCES_JS) if key != f"heavy/{name}"]
    assert others == ["healthy"] * 3
    # the change observed between two snapshots is listed
    events = await page.evaluate("document.getElementById('events').innerText")
    assert re.search(rf"\d\d:\d\d:\d\d\s+heavy/{re.escape(name)} healthy → ejected", events)

    # Polling fails: the page says so, and recovers by itself.
    await page.send("Network.enable")
    await page.send("Network.setBlockedURLs", urls=["*admin/state*"])
    await page.wait_for("document.getElementById('conn').dataset.conn === 'disconnected'")
    assert await page.evaluate("document.body.hasAttribute('data-stale')")
    assert await page.evaluate("!document.getElementById('banner').hidden")
    await page.send("Network.setBlockedURLs", urls=[])
    await page.wait_for("document.getElementById('conn').dataset.conn === 'live'")
    assert await page.evaluate("!document.body.hasAttribute('data-stale')")
    await a.set_down(False)


async def _eject(gw: RunningGateway, name: str) -> None:
    for _ in range(20):
        async with await gw.post("/v1/chat/completions", chat(model="m-heavy")) as resp:
            assert resp.status == 200  # retried on the healthy instance
        states = {i["name"]: i["state"] for i in (await gw.state())["pools"]["heavy"]["instances"]}
        if states[name] == "ejected":
            return
    raise AssertionError(f"{name} was never ejected: {states}")


async def test_dashboard_with_admin_key(
    page: Page, mocks: MockFactory, gateway_factory: GatewayFactory
) -> None:
    m = await mocks()
    auth = {"keys": [{"key": "sk-client", "name": "client"}], "admin_key": ADMIN_KEY}
    gw = await gateway_factory(_config(pool_config(m), auth=auth))
    name = "heavy/" + _name(gw.gateway.admin.state(), "heavy", m)
    count = "document.querySelectorAll('[data-instance]').length"
    auth_shown = (
        "!document.getElementById('auth').hidden"
        " && document.getElementById('conn').dataset.conn === 'auth'"
    )

    # No key: a clear message and the key box, and no state.
    await page.goto(gw.url + "/dashboard")
    await page.wait_for(auth_shown)
    assert "admin key" in await page.evaluate("document.getElementById('auth-msg').textContent")
    assert await page.evaluate("!!document.getElementById('key-input').offsetParent")
    assert await page.evaluate(count) == 0

    # The key in the fragment: shown, and the key is taken out of the address bar.
    await page.goto("about:blank")
    await page.goto(gw.url + "/dashboard#key=" + ADMIN_KEY)
    await page.wait_for(f"!!document.querySelector('[data-instance=\"{name}\"]')")
    assert await page.evaluate("location.hash") == ""
    assert await page.evaluate("document.getElementById('auth').hidden")

    # Forgotten: back to the prompt, the state is gone from the page.
    await page.evaluate("document.getElementById('key-forget').click()")
    await page.wait_for(f"{auth_shown} && {count} === 0")

    # A wrong key typed in the box is refused; the right one shows the instances.
    submit = """(k => {{ document.getElementById('key-input').value = k;
        document.getElementById('key-form').requestSubmit(); }})({key})"""
    await page.evaluate(submit.format(key=json.dumps("wrong")))
    await page.wait_for("/refused/.test(document.getElementById('auth-msg').textContent)")
    await page.evaluate(submit.format(key=json.dumps(ADMIN_KEY)))
    await page.wait_for(f"{count} === 1 && document.getElementById('auth').hidden")
    # kept for this tab: a reload needs no fragment
    await page.goto("about:blank")
    await page.goto(gw.url + "/dashboard")
    await page.wait_for(f"{count} === 1")


async def test_hostile_and_unexpected_state_is_shown_as_text(
    page: Page,
    mocks: MockFactory,
    gateway_factory: GatewayFactory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gw = await gateway_factory(_config(pool_config(await mocks())))
    evil = '<img src=x onerror="window.pwned=1">'
    doc = {
        "pools": {
            evil: {
                "queued": {"high": 3},  # low missing
                "fallback": evil,
                "future_field": {"nested": [1, 2]},
                "instances": [
                    {"name": evil, "state": "healthy", "in_flight": 2, "max_concurrency": 8},
                    {"name": "odd", "state": "warming_up"},  # unknown state, most fields missing
                    {"name": "gone", "state": "healthy", "removed": True},
                    "not an object",
                ],
            },
            "empty": {},
        },
        "version": evil,
        "draining": True,
        "future_top_level": 1,
    }
    monkeypatch.setattr(gw.gateway.admin, "state", lambda: doc)
    await page.goto(gw.url + "/dashboard")
    await page.wait_for("document.querySelectorAll('[data-instance]').length === 3")
    assert await page.evaluate("window.pwned === undefined")
    assert await page.evaluate("document.querySelectorAll('img').length") == 0
    assert await page.evaluate(f"document.body.innerText.includes({json.dumps(evil)})")
    states = {key: st for key, st, _ in await page.evaluate(INSTANCES_JS)}
    assert states[f"{evil}/{evil}"] == "healthy"
    assert states[f"{evil}/odd"] == "warming_up"
    assert states[f"{evil}/gone"] == "removed"
    assert await page.evaluate("!document.getElementById('draining').hidden")
    assert await page.evaluate("document.getElementById('conn').dataset.conn") == "live"
