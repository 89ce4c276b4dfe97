"""The command line as an operator uses it: real processes, real signals."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from gateway.config import Config
from support import MockFactory, eventually, free_port

GATEWAY = [sys.executable, "-m", "gateway.cli"]


def _config(tmp_path: Path, url: str, port: int, extra: str = "") -> Path:
    path = tmp_path / "gateway.yaml"
    path.write_text(
        textwrap.dedent(
            f"""\
            listen: {{host: 127.0.0.1, port: {port}}}
            health: {{probe: {{enabled: false}}}}
            shutdown: {{drain_timeout_ms: 3000, drain_delay_ms: 0}}
            pools:
              light:
                instances:
                  - {{name: qwen-a, url: "{url}", model: Qwen2.5-7B, max_concurrency: 2,
                      api_key: "${{UPSTREAM_KEY}}"}}
            models:
              judge-lite: {{pool: light}}
            """
        )
        + extra
    )
    return path


def test_check_prints_the_routing_table_without_secrets(tmp_path: Path) -> None:
    path = _config(tmp_path, "http://127.0.0.1:9/v1", 8080)
    env = {**os.environ, "UPSTREAM_KEY": "sk-canary-0123456789"}
    out = subprocess.run([*GATEWAY, "check", str(path)], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    assert "judge-lite" in out.stdout and "qwen-a" in out.stdout and "light" in out.stdout
    assert "sk-canary" not in out.stdout + out.stderr


def test_check_names_the_field_of_an_invalid_config(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(
        "pools:\n  light:\n    instances:\n"
        "      - {name: a, url: 'http://x/v1', model: m, max_concurrency: 0}\n"
        "models:\n  m: {pool: light}\n"
    )
    out = subprocess.run([*GATEWAY, "check", str(path)], capture_output=True, text=True)
    assert out.returncode == 2
    assert "pools.light.instances[0].max_concurrency" in out.stderr


async def _wait_pool(url: str, in_flight: int, high: int, low: int = 0) -> None:
    """Until the `light` pool of the gateway at `url` shows exactly this load."""

    async def there() -> bool:
        async with aiohttp.ClientSession() as s, s.get(url + "/admin/state") as r:
            pool = (await r.json())["pools"]["light"]
        return bool(pool["in_flight"] == in_flight and pool["queued"] == {"high": high, "low": low})

    await eventually(there, what=f"{in_flight} in flight, {high}/{low} queued")


async def _wait_listening(port: int, proc: asyncio.subprocess.Process) -> None:
    for _ in range(200):
        assert proc.returncode is None, "gateway exited early"
        try:
            _, w = await asyncio.open_connection("127.0.0.1", port)
            w.close()
            return
        except OSError:
            await asyncio.sleep(0.05)
    raise AssertionError("gateway never listened")


@pytest.mark.timeout(60)
async def test_serve_then_sigterm_drains_in_flight_requests(
    tmp_path: Path, mocks: MockFactory
) -> None:
    m = await mocks(latency_ms=600)
    port = free_port()
    path = _config(tmp_path, m.url, port)
    env = {**os.environ, "UPSTREAM_KEY": "sk-canary-0123456789"}
    proc = await asyncio.create_subprocess_exec(
        *GATEWAY,
        "--log-format",
        "json",
        "serve",
        "--config",
        str(path),
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        await _wait_listening(port, proc)
        url = f"http://127.0.0.1:{port}"
        body = {"model": "judge-lite", "messages": [{"role": "user", "content": "hi"}]}
        async with aiohttp.ClientSession() as s:

            async def one() -> int:
                async with s.post(url + "/v1/chat/completions", json=body) as r:
                    await r.read()
                    return r.status

            # 2 in flight, 2 queued behind them
            tasks = [asyncio.create_task(one()) for _ in range(4)]
            await _wait_pool(url, 2, 2)
            proc.send_signal(signal.SIGTERM)
            statuses = await asyncio.gather(*tasks)
        assert statuses == [200, 200, 200, 200]
        # new connections stop once draining
        with pytest.raises(OSError):
            await asyncio.open_connection("127.0.0.1", port)
        assert await asyncio.wait_for(proc.wait(), 10) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    _, err = await proc.communicate()
    log = err.decode()
    assert '"status":200' in log  # one JSON access line per request
    assert "sk-canary" not in log


async def _models(url: str) -> list[str]:
    async with aiohttp.ClientSession() as s, s.get(url + "/v1/models") as r:
        return sorted(m["id"] for m in (await r.json())["data"])


async def _eventually_models(url: str, want: list[str]) -> None:
    for _ in range(100):
        if await _models(url) == want:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"models never became {want}: {await _models(url)}")


@pytest.mark.timeout(60)
async def test_watch_and_sighup_reload_the_config(tmp_path: Path, mocks: MockFactory) -> None:
    m = await mocks()
    port = free_port()
    path = _config(tmp_path, m.url, port)
    env = {**os.environ, "UPSTREAM_KEY": "k"}
    proc = await asyncio.create_subprocess_exec(
        *GATEWAY,
        "serve",
        "--config",
        str(path),
        "--watch",
        env=env,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        await _wait_listening(port, proc)
        url = f"http://127.0.0.1:{port}"
        assert await _models(url) == ["judge-lite"]
        # --watch: a changed file is picked up within about a second
        path.write_text(path.read_text() + "  judge-2: {pool: light}\n")
        await _eventually_models(url, ["judge-2", "judge-lite"])
        # an invalid file is refused; the running config stays
        good = path.read_text()
        path.write_text(good.replace("max_concurrency: 2", "max_concurrency: -1"))

        async def refused() -> bool:
            async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
                return 'gateway_config_reloads_total{result="failure"} 1.0' in await r.text()

        await eventually(refused, what="the watcher's reload refused")
        assert await _models(url) == ["judge-2", "judge-lite"]
        # SIGHUP
        path.write_text(good + "  judge-3: {pool: light}\n")
        proc.send_signal(signal.SIGHUP)
        await _eventually_models(url, ["judge-2", "judge-3", "judge-lite"])
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 10) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    _, err = await proc.communicate()
    assert "pools.light.instances[0].max_concurrency" in err.decode()


@pytest.mark.timeout(60)
async def test_sigterm_past_the_drain_deadline_answers_everyone(
    tmp_path: Path, mocks: MockFactory
) -> None:
    m = await mocks(latency_ms=5000, tokens_per_s=2, default_tokens=50)
    port = free_port()
    path = _config(tmp_path, m.url, port)
    path.write_text(path.read_text().replace("drain_timeout_ms: 3000", "drain_timeout_ms: 500"))
    proc = await asyncio.create_subprocess_exec(
        *GATEWAY,
        "serve",
        "--config",
        str(path),
        env={**os.environ, "UPSTREAM_KEY": "k"},
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        await _wait_listening(port, proc)
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        body = {"model": "judge-lite", "messages": [{"role": "user", "content": "hi"}]}
        m.configure(latency_ms=0)
        async with aiohttp.ClientSession() as s:

            async def plain() -> tuple[int, str]:
                async with s.post(url, json=body) as r:
                    return r.status, await r.text()

            async def stream() -> tuple[int, str]:
                async with s.post(url, json={**body, "stream": True}) as r:
                    return r.status, await r.text()

            # 2 slots: a stream and a request in flight, 2 more queued behind them
            m.configure(latency_ms=0)
            tasks = [asyncio.create_task(stream())]
            await eventually(lambda: m.stats.in_flight == 1, what="the stream started")
            m.configure(latency_ms=5000)
            tasks += [asyncio.create_task(plain()) for _ in range(3)]
            await _wait_pool(url.removesuffix("/v1/chat/completions"), 2, 2)
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            results = await asyncio.gather(*tasks)
            assert time.monotonic() - t0 < 4  # the drain deadline, not the 5 s upstream
        status, text = results[0]
        assert status == 200 and text.rstrip().splitlines()[-1].startswith('data: {"error"')
        assert "[DONE]" not in text
        for status, text in results[1:]:  # in flight or queued: exactly one honest answer each
            assert status == 503 and '"draining"' in text
        assert await asyncio.wait_for(proc.wait(), 10) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


# ---------------------------------------------------------------------------------------------
# SPEC §18: `gateway check` reports every error in one run and summarises every section;
# `gateway schema` prints the config's JSON Schema.


def test_check_reports_every_error_in_one_run(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(
        textwrap.dedent(
            """\
            scheduler:
              high: {capacity: -5}
            balancer: sticky
            pools:
              light:
                spil_to: heavy
                instances:
                  - {name: a, url: "http://127.0.0.1:9/v1", model: m, max_concurrency: 4}
              heavy:
                instances:
                  - {name: b, model: big, max_concurrency: 8}
            models:
              lite: {pool: light}
              pro: {pool: hevy}
            """
        )
    )
    out = subprocess.run([*GATEWAY, "check", str(path)], capture_output=True, text=True)
    assert out.returncode == 2
    lines = out.stderr.splitlines()
    assert lines == [
        "config error: scheduler.high.capacity: Expected `int` >= 1",
        "config error: balancer: invalid value 'sticky'; expected one of: "
        "least_connections, round_robin, random, p2c, affinity, predicted",
        "config error: pools.light.spil_to: unknown field; did you mean `spill_to`?",
        "config error: pools.heavy.instances[0].url: required field is missing",
        "config error: models.pro.pool: unknown pool 'hevy'; did you mean 'heavy'?",
        f"5 errors in {path}",
    ], out.stderr
    assert out.stdout == ""


def test_check_summarises_every_section_without_secrets(tmp_path: Path) -> None:
    path = tmp_path / "gateway.yaml"
    path.write_text(
        textwrap.dedent(
            """\
            limits: {max_event_bytes: 4096}
            shutdown: {drain_delay_ms: 1500}
            pools:
              light:
                balancer: p2c
                spill_to: heavy
                spill_queue_depth: 10
                instances:
                  - {name: a, url: "http://127.0.0.1:9/v1", model: m, max_concurrency: 4}
              heavy:
                fallback: light
                instances:
                  - {name: b, url: "https://api.example.com/v1", model: big, max_concurrency: 8,
                     api_key: "${UPSTREAM_KEY}", provider: vllm}
            models:
              lite: {pool: light}
              pro: {pool: heavy}
            auth:
              admin_key: "${UPSTREAM_KEY}-admin"
              keys:
                - {key: "${UPSTREAM_KEY}-free", name: free, priority: low, rpm: 60, tpm: 9000,
                   routes: {pro: lite}}
            telemetry: {otlp_endpoint: "http://otel:${UPSTREAM_KEY}@collector:4318",
                        sample_ratio: 0.25}
            batch: {store: "postgresql://gw:${UPSTREAM_KEY}@db:5432/gw", max_lines: 100}
            cluster: {redis_url: "redis://:${UPSTREAM_KEY}@redis:6379/0", replica_id: r1}
            """
        )
    )
    env = {**os.environ, "UPSTREAM_KEY": "sk-canary-0123456789"}
    out = subprocess.run([*GATEWAY, "check", str(path)], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "sk-canary" not in text + out.stderr
    for expected in (
        # pools → instances
        "light  (balancer=p2c, fallback=-, 1 instance(s), 4 slots, spill_to=heavy at depth 10)",
        "max_concurrency=8  provider=vllm  api_key: set",
        # aliases → pools
        "pro   → pool heavy (fallback → light)",
        # auth and the tier routes (never a key)
        "admin_key: set",
        "free: key: set  priority=low rpm=60 tpm=9000",
        "route pro → lite  (pool light)",
        # limits, shutdown
        "max_event_bytes=4096",
        "drain_delay_ms=1500 drain_timeout_ms=25000",
        # telemetry: the endpoint without its credentials
        "telemetry   OTLP/HTTP http://collector:4318 service=gateway sample_ratio=0.25",
        # batch: a PostgreSQL store without its password
        "batch       store=postgresql://gw:***@db:5432/gw max_file_bytes=209715200 max_lines=100",
        # cluster: the Redis URL without its password
        "cluster     redis=redis://:***@redis:6379/0 replica_id=r1 lease_ms=2000 renew_ms=200",
        "routing     complexity simple=- complex=- default=simple",
    ):
        assert expected in text, f"{expected!r} not in:\n{text}"
    assert "per host" not in text  # a PostgreSQL store is shared across replicas
    # SPEC §14: `cluster:` with a SQLite store serves batches per host, and check says so
    path.write_text(path.read_text().replace("postgresql://gw:${UPSTREAM_KEY}@db:5432/gw", "b.db"))
    out = subprocess.run([*GATEWAY, "check", str(path)], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    assert "store=b.db" in out.stdout and "batches are served per host" in out.stdout


def test_check_of_a_minimal_config_says_what_is_off(tmp_path: Path) -> None:
    path = tmp_path / "gateway.yaml"
    path.write_text(
        "pools: {light: {instances: [{name: a, url: 'http://h:1/v1', model: m, "
        "max_concurrency: 1}]}}\nmodels: {lite: {pool: light}}\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    out = subprocess.run([*GATEWAY, "check", str(path)], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    for expected in (
        "auth        off",
        "telemetry   off",
        "cluster     off",
        "batch       store=./gateway-batches.db",
        "limits      header_timeout_ms=10000",
    ):
        assert expected in out.stdout, out.stdout


def _validate(instance: Any, schema: dict[str, Any], root: dict[str, Any], at: str = "") -> None:
    """A small JSON Schema validator: the keywords `gateway schema` uses, no more (the
    `jsonschema` package is not a dependency). Raises AssertionError naming the place."""
    if "$ref" in schema:
        schema = root["$defs"][schema["$ref"].removeprefix("#/$defs/")]
    if "anyOf" in schema:
        for option in schema["anyOf"]:
            try:
                _validate(instance, option, root, at)
            except AssertionError:
                continue
            return
        raise AssertionError(f"{at}: {instance!r} matches none of {schema['anyOf']}")
    if "enum" in schema:
        assert instance in schema["enum"], f"{at}: {instance!r} not in {schema['enum']}"
    types = {
        "object": dict,
        "array": list,
        "string": str,
        "integer": int,
        "number": (int, float),
        "boolean": bool,
        "null": type(None),
    }
    if "type" in schema:
        assert isinstance(instance, types[schema["type"]]), f"{at}: {instance!r} not {schema}"
        assert schema["type"] == "boolean" or not isinstance(instance, bool), at
    if "minimum" in schema:
        assert instance >= schema["minimum"], f"{at}: {instance} < {schema['minimum']}"
    if "maximum" in schema:
        assert instance <= schema["maximum"], f"{at}: {instance} > {schema['maximum']}"
    if "pattern" in schema:
        assert re.search(schema["pattern"], instance), f"{at}: {instance!r} !~ pattern"
    if isinstance(instance, list) and "items" in schema:
        for i, item in enumerate(instance):
            _validate(item, schema["items"], root, f"{at}[{i}]")
    if isinstance(instance, dict) and schema.get("type") == "object":
        for name in schema.get("required", []):
            assert name in instance, f"{at}.{name}: required"
        props = schema.get("properties", {})
        extra = schema.get("additionalProperties", True)
        for key, value in instance.items():
            if key in props:
                _validate(value, props[key], root, f"{at}.{key}")
            else:
                assert extra is not False, f"{at}.{key}: not allowed"
                if isinstance(extra, dict):
                    _validate(value, extra, root, f"{at}.{key}")


def test_schema_describes_the_file_for_editors(tmp_path: Path) -> None:
    from test_config import SPEC_EXAMPLE

    out = subprocess.run([*GATEWAY, "schema"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    schema = json.loads(out.stdout)
    assert schema["$schema"].startswith("https://json-schema.org/")
    assert schema["title"] == "gateway configuration"
    assert set(schema["properties"]) == set(Config.__struct_fields__)
    for section in ("cluster", "batch", "telemetry", "limits", "shutdown", "auth", "routing"):
        assert section in schema["properties"]
    assert schema["required"] == ["pools", "models"]
    assert schema["additionalProperties"] is False
    # Secrets are marked for editors (and never carry a default value)
    instance = schema["$defs"]["InstanceSpec"]["properties"]
    assert instance["api_key"]["writeOnly"] is True and instance["headers"]["writeOnly"] is True
    assert schema["$defs"]["Cluster"]["properties"]["redis_url"]["writeOnly"] is True
    # Bounds come through: an editor flags a zero max_concurrency
    bound = {"type": "integer", "minimum": 1, "maximum": 2**32 - 1}
    assert bound in instance["max_concurrency"]["anyOf"]

    # The SPEC's example validates, and so does what the loader accepts beyond the structs'
    # types: `${VAR}` where a number goes, `realtime`, an empty section, a partial class.
    data = yaml.safe_load(SPEC_EXAMPLE)
    _validate(data, schema, schema)
    loose = yaml.safe_load(
        SPEC_EXAMPLE.replace("port: 8080", 'port: "${PORT:-8080}"')
        .replace("default_priority: high", "default_priority: realtime")
        .replace("  high: {capacity: 200, weight: 7, max_wait_ms: 30000}", "  high: {weight: 5}")
        .replace("retries: {max_attempts: 3}", "retries:")
    )
    assert loose["retries"] is None and loose["listen"]["port"] == "${PORT:-8080}"
    _validate(loose, schema, schema)
    # ... and the loader agrees on each of them
    path = tmp_path / "loose.yaml"
    path.write_text(yaml.safe_dump(loose))
    env = {**os.environ, "OPENAI_API_KEY": "k", "QIANFAN_API_KEY": "k"}
    env |= {"FREE_TIER_KEY": "f", "PAID_TIER_KEY": "p"}
    checked = subprocess.run([*GATEWAY, "check", str(path)], capture_output=True, env=env)
    assert checked.returncode == 0, checked.stderr

    # What the schema refuses, an editor flags: a typo, a value out of range, a bad enum.
    for broken in (
        {**data, "retries": {"max_attemps": 3}},
        {**data, "listen": {"port": 70000}},
        {**data, "balancer": "sticky"},
        {**data, "listen": {"port": "eighty"}},
        {k: v for k, v in data.items() if k != "models"},
    ):
        with pytest.raises(AssertionError):
            _validate(broken, schema, schema)
