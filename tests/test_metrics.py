"""GET /metrics: the SPEC §9 families move exactly as requests flow; no secret in them."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import aiohttp
import orjson
from prometheus_client.parser import text_string_to_metric_families

from gateway.logs import JsonFormatter, TextFormatter
from gateway.metrics import Metrics
from gateway.redact import RedactingFilter
from support import (
    GatewayFactory,
    MockFactory,
    RunningGateway,
    chat,
    free_port,
    pool_config,
    simple_config,
)


async def _scrape(
    gw: RunningGateway, key: str | None = None
) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with gw.session.get(gw.url + "/metrics", headers=headers) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain")
        text = await resp.text()
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return out


def _value(
    m: dict[str, dict[tuple[tuple[str, str], ...], float]], name: str, **labels: str
) -> float:
    key = tuple(sorted(labels.items()))
    return m.get(name, {}).get(key, 0.0)


async def test_families_and_values_follow_the_traffic(
    mocks: MockFactory, gateway_factory: GatewayFactory
) -> None:
    good = await mocks(seed=1)
    bad = await mocks(fail_rate=1.0, fail_status=500)
    gw = await gateway_factory(
        simple_config(
            pool_config(good, bad),
            balancer="round_robin",
            health={"failure_threshold": 1, "ejection_ms": 60000, "max_ejection_ms": 60000},
        )
    )
    async with gw.session.get(gw.url + "/metrics") as resp:
        exposition = await resp.text()
    for name in (
        "gateway_requests_total counter",
        "gateway_queue_depth gauge",
        "gateway_queue_wait_seconds histogram",
        "gateway_instance_in_flight gauge",
        "gateway_instance_state gauge",
        "gateway_instance_ejections_total counter",
        "gateway_upstream_latency_seconds histogram",
        "gateway_time_to_first_byte_seconds histogram",
        "gateway_retries_total counter",
        "gateway_rejections_total counter",
        "gateway_tokens_total counter",
        "gateway_build_info gauge",
        "gateway_config_last_reload_success gauge",
    ):
        assert f"# TYPE {name}" in exposition, name
    n_ok, n_low = 7, 3
    for i in range(n_ok):
        headers = {"X-Priority": "low" if i < n_low else "high"}
        async with await gw.post("/v1/chat/completions", chat(), headers=headers) as resp:
            assert resp.status == 200
    async with await gw.post("/v1/chat/completions", chat(model="nope")) as resp:
        assert resp.status == 404
    after = await _scrape(gw)
    assert (
        _value(after, "gateway_requests_total", pool="p", priority="high", code="200")
        == n_ok - n_low
    )
    assert _value(after, "gateway_requests_total", pool="p", priority="low", code="200") == n_low
    assert _value(after, "gateway_rejections_total", reason="model_not_found") == 1
    waits = sum(
        _value(after, "gateway_queue_wait_seconds_count", pool="p", priority=p)
        for p in ("high", "low")
    )
    assert waits == n_ok + 1  # one request's failed attempt was retried: two grants
    assert _value(after, "gateway_retries_total", pool="p") == 1
    bad_name = f"m{bad.port}-1"
    assert _value(after, "gateway_instance_ejections_total", pool="p", instance=bad_name) == 1
    assert (
        _value(after, "gateway_instance_state", pool="p", instance=bad_name, state="ejected") == 1
    )
    assert (
        _value(after, "gateway_instance_state", pool="p", instance=bad_name, state="healthy") == 0
    )
    good_name = f"m{good.port}-0"
    prompt = _value(after, "gateway_tokens_total", pool="p", instance=good_name, kind="prompt")
    completion = _value(
        after, "gateway_tokens_total", pool="p", instance=good_name, kind="completion"
    )
    assert completion == good.stats.completion_tokens and prompt == good.stats.prompt_tokens
    assert (
        _value(after, "gateway_time_to_first_byte_seconds_count", pool="p", instance=good_name)
        == n_ok
    )
    assert _value(after, "gateway_queue_depth", pool="p", priority="high") == 0
    assert _value(after, "gateway_instance_in_flight", pool="p", instance=good_name) == 0
    await gw.assert_quiet()


async def test_streamed_usage_counts_tokens(
    mocks: MockFactory, gateway_factory: GatewayFactory
) -> None:
    m = await mocks(default_tokens=9)
    gw = await gateway_factory(simple_config(pool_config(m)))
    body = chat(stream=True, stream_options={"include_usage": True})
    async with await gw.post("/v1/chat/completions", body) as resp:
        await resp.read()
    after = await _scrape(gw)
    assert (
        _value(after, "gateway_tokens_total", pool="p", instance=f"m{m.port}-0", kind="completion")
        == 9
    )


async def test_queue_depth_gauge_while_saturated(
    mocks: MockFactory, gateway_factory: GatewayFactory
) -> None:
    m = await mocks(latency_ms=300)
    gw = await gateway_factory(simple_config(pool_config((m, 1))))

    def send(priority: str) -> asyncio.Task[Any]:
        headers = {"X-Priority": priority}
        return asyncio.create_task(gw.post("/v1/chat/completions", chat(), headers=headers))

    tasks = [send("high")]
    await gw.wait_in_flight(1)
    tasks += [send("low"), send("low")]
    await gw.wait_queued(0, 2)
    during = await _scrape(gw)
    assert _value(during, "gateway_queue_depth", pool="p", priority="low") == 2
    assert _value(during, "gateway_instance_in_flight", pool="p", instance=f"m{m.port}-0") == 1
    for resp in await asyncio.gather(*tasks):
        resp.release()
    await gw.assert_quiet()


async def test_no_secret_in_metrics_or_logs(
    mocks: MockFactory, gateway_factory: GatewayFactory, caplog: object
) -> None:
    import logging

    m = await mocks(fail_rate=0.5, seed=3)
    canary_client = "sk-client-canary-7f3a"
    config = simple_config(
        pool_config(m),
        auth={"keys": [{"key": canary_client, "name": "tenant-a"}], "admin_key": "adm-canary-9b1c"},
    )
    gw = await gateway_factory(config)
    logger = logging.getLogger("gateway")
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda r: records.append(r.getMessage() + str(getattr(r, "fields", "")))  # type: ignore[method-assign]
    logger.addHandler(handler)
    logging.getLogger("gateway.access").setLevel(logging.INFO)
    try:
        for key in (canary_client, "sk-wrong-canary"):
            for _ in range(4):
                async with await gw.post(
                    "/v1/chat/completions", chat(), headers={"Authorization": f"Bearer {key}"}
                ) as resp:
                    await resp.read()
    finally:
        logger.removeHandler(handler)
    # SPEC §9: with auth on, /metrics asks for the metrics key or the admin key
    admin = {"Authorization": "Bearer adm-canary-9b1c"}
    async with gw.session.get(gw.url + "/metrics", headers=admin) as resp:
        assert resp.status == 200
        text = await resp.text()
    keyed = [
        s.labels["key"]
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == "gateway_key_requests_total"
    ]
    assert "tenant-a" in keyed and "none" in keyed  # the key's name; "none" for the wrong key
    blob = text + "\n".join(records)
    assert records, "the access log wrote nothing"
    for secret in (canary_client, "sk-wrong-canary", "adm-canary-9b1c", "sk-upstream-secret"):
        assert secret not in blob


# ---------------------------------------------------------------------------------------------
# Per client key (SPEC §9: operators bill and throttle by key), and /metrics behind a key.

FREE, PAID, METRICS_KEY, ADMIN_KEY = "sk-free-5e1d9", "sk-paid-77c2a", "mk-scrape-31f0", "adm-4d2e"


def _keyed_auth(**extra: Any) -> dict[str, Any]:
    return {
        "keys": [{"key": FREE, "name": "free"}, {"key": PAID, "name": "paid"}],
        "admin_key": ADMIN_KEY,
        "metrics_key": METRICS_KEY,
        **extra,
    }


class _Lines(logging.Handler):
    """The access log's lines as `gateway serve` writes them, in both formats."""

    def __init__(self) -> None:
        super().__init__()
        self.json: list[dict[str, Any]] = []
        self.text: list[str] = []
        self.addFilter(RedactingFilter())

    def emit(self, record: logging.LogRecord) -> None:
        self.json.append(orjson.loads(JsonFormatter().format(record)))
        self.text.append(TextFormatter().format(record))


async def test_per_key_counters_and_access_log(
    mocks: MockFactory, gateway_factory: GatewayFactory
) -> None:
    m = await mocks(seed=5)
    gw = await gateway_factory(simple_config(pool_config(m), auth=_keyed_auth()))
    access = logging.getLogger("gateway.access")
    lines = _Lines()
    access.addHandler(lines)
    old_level = access.level
    access.setLevel(logging.INFO)
    usage: dict[str, list[int]] = {"free": [0, 0], "paid": [0, 0]}
    try:
        for name, key, n in (("free", FREE, 3), ("paid", PAID, 2)):
            auth = {"Authorization": f"Bearer {key}"}
            for i in range(n):
                if i == 0:  # one streamed answer per key, its usage from the last chunk
                    body = chat(stream=True, stream_options={"include_usage": True})
                else:
                    body = chat()
                async with await gw.post("/v1/chat/completions", body, headers=auth) as resp:
                    assert resp.status == 200
                    if i:
                        got = (await resp.json())["usage"]
                    else:
                        raw = (await resp.read()).decode()
                        got = orjson.loads(
                            [ln for ln in raw.splitlines() if '"usage":{' in ln][-1][6:]
                        )["usage"]
                usage[name][0] += got["prompt_tokens"]
                usage[name][1] += got["completion_tokens"]
        for headers in ({"Authorization": "Bearer sk-unknown-0000"}, {}):
            async with await gw.post("/v1/chat/completions", chat(), headers=headers) as resp:
                assert resp.status == 401
    finally:
        access.removeHandler(lines)
        access.setLevel(old_level)
    after = await _scrape(gw, METRICS_KEY)
    assert _value(after, "gateway_key_requests_total", key="free", code="200") == 3
    assert _value(after, "gateway_key_requests_total", key="paid", code="200") == 2
    assert _value(after, "gateway_key_requests_total", key="none", code="401") == 2
    for name, (prompt, completion) in usage.items():
        assert _value(after, "gateway_key_tokens_total", key=name, kind="prompt") == prompt
        assert _value(after, "gateway_key_tokens_total", key=name, kind="completion") == completion
    # every answered request is counted under exactly one key
    assert sum(after["gateway_key_requests_total"].values()) == sum(
        after["gateway_requests_total"].values()
    )
    # the key label holds configured names only
    assert {dict(k)["key"] for k in after["gateway_key_requests_total"]} == {"free", "paid", "none"}
    # the access log: key name and token counts on each request's line, in both formats
    assert len(lines.json) == 7
    by_key = [(d["key"], d["prompt_tokens"], d["completion_tokens"]) for d in lines.json]
    assert by_key[-2:] == [(None, None, None)] * 2
    for name in ("free", "paid"):
        mine = [(p, c) for k, p, c in by_key if k == name]
        assert [sum(x) for x in zip(*mine, strict=True)] == usage[name]
    for text, doc in zip(lines.text, lines.json, strict=True):
        if doc["key"] is not None:
            assert f"key={doc['key']} " in text
            assert f"prompt_tokens={doc['prompt_tokens']} " in text
            assert f"completion_tokens={doc['completion_tokens']}" in text
        else:
            assert "key=" not in text
    blob = "\n".join(lines.text) + orjson.dumps(lines.json).decode() + repr(after)
    for secret in (FREE, PAID, "sk-unknown-0000", METRICS_KEY, ADMIN_KEY):
        assert secret not in blob
    await gw.assert_quiet()


async def test_a_reload_that_removes_a_key_keeps_metrics_working(
    mocks: MockFactory, gateway_factory: GatewayFactory
) -> None:
    m = await mocks()
    config = simple_config(pool_config(m), auth=_keyed_auth())
    gw = await gateway_factory(config)
    for key in (FREE, PAID):
        async with await gw.post(
            "/v1/chat/completions", chat(), headers={"Authorization": f"Bearer {key}"}
        ) as resp:
            assert resp.status == 200
    before = await _scrape(gw, METRICS_KEY)
    assert _value(before, "gateway_key_requests_total", key="free", code="200") == 1
    config["auth"]["keys"] = [k for k in config["auth"]["keys"] if k["name"] != "free"]
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    status, _ = await gw.reload(config, headers=admin)
    assert status == 200
    async with await gw.post(
        "/v1/chat/completions", chat(), headers={"Authorization": f"Bearer {FREE}"}
    ) as resp:
        assert resp.status == 401  # the removed key is refused, counted under none
    async with await gw.post(
        "/v1/chat/completions", chat(), headers={"Authorization": f"Bearer {PAID}"}
    ) as resp:
        assert resp.status == 200
    after = await _scrape(gw, METRICS_KEY)
    keys = {dict(k)["key"] for k in after["gateway_key_requests_total"]}
    assert keys == {"paid", "none"}, "a removed key's series go with it (bounded labels)"
    assert {dict(k)["key"] for k in after["gateway_key_tokens_total"]} == {"paid", "none"}
    assert _value(after, "gateway_key_requests_total", key="paid", code="200") == 2
    assert _value(after, "gateway_key_requests_total", key="none", code="401") == 1
    await gw.assert_quiet()


async def _get_metrics(gw: RunningGateway, headers: dict[str, str]) -> tuple[int, str, str]:
    async with gw.session.get(gw.url + "/metrics", headers=headers) as resp:
        return resp.status, resp.headers.get("Content-Type", ""), await resp.text()


async def test_metrics_need_a_key_when_auth_is_on(
    mocks: MockFactory, gateway_factory: GatewayFactory
) -> None:
    m = await mocks()
    gw = await gateway_factory(simple_config(pool_config(m), auth=_keyed_auth()))
    for headers in (
        {},
        {"Authorization": f"Bearer {FREE}"},  # a client key is not enough
        {"Authorization": "Bearer mk-wrong"},
        {"Authorization": f"Basic {METRICS_KEY}"},
    ):
        status, ctype, text = await _get_metrics(gw, headers)
        assert status == 401, headers
        assert ctype.startswith("application/json") and "gateway_" not in text
        err = orjson.loads(text)["error"]
        assert err["code"] == "invalid_api_key" and set(err) == {"message", "type", "param", "code"}
        assert METRICS_KEY not in text and FREE not in text
    for key in (METRICS_KEY, ADMIN_KEY):
        status, ctype, text = await _get_metrics(gw, {"Authorization": f"Bearer {key}"})
        assert status == 200 and ctype.startswith("text/plain")
        assert "gateway_requests_total" in text
    # the explicit opt-out, and no auth at all: open as before
    for auth in (_keyed_auth(public_metrics=True), None):
        extra = {"auth": auth} if auth is not None else {}
        open_gw = await gateway_factory(simple_config(pool_config(m), **extra))
        status, _, text = await _get_metrics(open_gw, {})
        assert status == 200 and "gateway_requests_total" in text


async def test_metrics_key_with_workers(tmp_path: Path, mocks: MockFactory) -> None:
    """SPEC §12: any worker answers /metrics for the whole gateway — the same 401 without a
    key, and the per-key counts of every worker summed (through the snapshot path)."""
    m = await mocks()
    port = free_port()
    path = tmp_path / "gateway.yaml"
    path.write_text(
        textwrap.dedent(
            f"""\
            listen: {{host: 127.0.0.1, port: {port}}}
            shutdown: {{drain_timeout_ms: 5000, drain_delay_ms: 0}}
            health: {{probe: {{enabled: false}}}}
            auth:
              keys: [{{key: {FREE}, name: free}}]
              admin_key: {ADMIN_KEY}
              metrics_key: {METRICS_KEY}
            pools:
              p:
                instances:
                  - {{name: i0, url: "{m.url}", model: up, max_concurrency: 4}}
            models: {{m: {{pool: p}}}}
            """
        )
    )
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "gateway.cli",
        "serve",
        "--config",
        str(path),
        "--workers",
        "2",
        "--no-access-log",
        stdout=asyncio.subprocess.PIPE,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 60)
        assert b"(2 workers)" in line, line
        # fresh connections: SO_REUSEPORT spreads them over the workers
        connector = aiohttp.TCPConnector(force_close=True, limit=0)
        async with aiohttp.ClientSession(connector=connector) as s:
            auth = {"Authorization": f"Bearer {FREE}"}
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
            for _ in range(20):
                async with s.post(url + "/v1/chat/completions", json=body, headers=auth) as r:
                    assert r.status == 200
            scrape = {"Authorization": f"Bearer {METRICS_KEY}"}
            # Each scrape (a fresh connection: any worker) sums every worker's counts; a
            # peer's snapshot may be up to a second old, so: until 8 scrapes in a row agree.
            in_a_row, last = 0, None
            deadline = time.monotonic() + 15
            while in_a_row < 8:
                assert time.monotonic() < deadline, last
                async with s.get(url + "/metrics") as r:
                    assert r.status == 401 and "gateway_" not in await r.text()
                async with s.get(url + "/admin/state", headers=scrape) as r:
                    assert r.status == 401  # the metrics key opens /metrics only
                async with s.get(url + "/metrics", headers=scrape) as r:
                    assert r.status == 200
                    text = await r.text()
                last = [
                    sample.value
                    for fam in text_string_to_metric_families(text)
                    for sample in fam.samples
                    if sample.name == "gateway_key_requests_total"
                    and sample.labels == {"key": "free", "code": "200"}
                ]
                in_a_row = in_a_row + 1 if last == [20.0] else 0
                if not in_a_row:
                    await asyncio.sleep(0.1)
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), 20)
            except TimeoutError:
                proc.kill()
                await proc.wait()


def test_per_key_series_survive_the_workers_snapshot_sum(tmp_path: Path) -> None:
    """SPEC §12: a scrape sums this worker's per-key counts with the other workers' snapshots;
    a reload that removes a key (`keep_keys`) drops this worker's series of it and the scrape
    goes on (another worker's counts stay in the sum until it reloads too)."""
    runtime = SimpleNamespace(pools={})
    share = str(tmp_path)  # the workers' snapshots, as the topology hands it down
    peer = Metrics(lambda: runtime, share_dir=share)  # type: ignore[arg-type,return-value]
    peer.keep_keys(["free", "paid"])
    peer.request_done("p", "high", 200, "free")
    peer.used_tokens("p", "a", {"prompt_tokens": 5, "completion_tokens": 7}, "free")
    peer.flush()
    # the peer's snapshot as another (live) process's: this test's parent
    os.replace(tmp_path / f"{os.getpid()}.json", tmp_path / f"{os.getppid()}.json")
    own = Metrics(lambda: runtime, share_dir=share)  # type: ignore[arg-type,return-value]
    own.keep_keys(["free", "paid"])
    for key in ("free", "free", "paid"):
        own.request_done("p", "high", 200, key)
    own.used_tokens("p", "a", {"prompt_tokens": 1, "completion_tokens": 2}, "free")

    def scraped() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(own.render().decode())
            for s in fam.samples
            if s.name.startswith("gateway_key_") and s.name.endswith("_total")
        }

    got = scraped()
    assert got[("gateway_key_requests_total", (("code", "200"), ("key", "free")))] == 3
    assert got[("gateway_key_requests_total", (("code", "200"), ("key", "paid")))] == 1
    assert got[("gateway_key_tokens_total", (("key", "free"), ("kind", "prompt")))] == 6
    assert got[("gateway_key_tokens_total", (("key", "free"), ("kind", "completion")))] == 9
    own.keep_keys(["paid"])  # a reload removed "free"
    own.request_done("p", "high", 401)  # and its next request is nobody's
    got = scraped()
    assert got[("gateway_key_requests_total", (("code", "200"), ("key", "free")))] == 1  # peer's
    assert got[("gateway_key_requests_total", (("code", "200"), ("key", "paid")))] == 1
    assert got[("gateway_key_requests_total", (("code", "401"), ("key", "none")))] == 1
    peer.keep_keys(["paid"])  # the peer reloads too: the name is gone from the sum
    peer.flush()
    os.replace(tmp_path / f"{os.getpid()}.json", tmp_path / f"{os.getppid()}.json")
    assert all(dict(labels).get("key") != "free" for _, labels in scraped())
