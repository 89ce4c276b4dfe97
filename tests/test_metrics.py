"""GET /metrics: the SPEC §9 families move exactly as requests flow; no secret in them."""

from __future__ import annotations

import asyncio
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from support import GatewayFactory, MockFactory, RunningGateway, chat, pool_config, simple_config


async def _scrape(gw: RunningGateway) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    async with gw.session.get(gw.url + "/metrics") as resp:
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
    async with gw.session.get(gw.url + "/metrics") as resp:
        text = await resp.text()
    blob = text + "\n".join(records)
    assert records, "the access log wrote nothing"
    for secret in (canary_client, "sk-wrong-canary", "adm-canary-9b1c", "sk-upstream-secret"):
        assert secret not in blob
