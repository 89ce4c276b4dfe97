"""Hot reload (SPEC §8): new settings apply to the next decision, nothing in flight or queued
is dropped, an invalid file changes nothing."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

from support import (
    GatewayFactory,
    MockFactory,
    RunningGateway,
    chat,
    eventually,
    pool_config,
    simple_config,
)


async def _send(gw: RunningGateway, **kw: Any) -> tuple[int, str]:
    async with await gw.post("/v1/chat/completions", chat(), **kw) as resp:
        await resp.read()
        return resp.status, resp.headers.get("X-Gateway-Instance", "")


async def _metric(gw: RunningGateway, name: str) -> str:
    # SPEC §9: with auth on, /metrics asks for the metrics key or the admin key
    headers = {"Authorization": f"Bearer {gw.admin_key}"} if gw.admin_key else {}
    async with gw.session.get(gw.url + "/metrics", headers=headers) as resp:
        text = await resp.text()
    return "\n".join(line for line in text.splitlines() if line.startswith(name))


async def test_valid_reload_under_load_adds_an_instance_and_capacity(
    mocks: MockFactory, gateway_factory: GatewayFactory
) -> None:
    a, b = await mocks(latency_ms=150), await mocks(latency_ms=150)
    config = simple_config(pool_config((a, 1)))
    gw = await gateway_factory(config)
    load = [asyncio.create_task(_send(gw)) for _ in range(12)]
    await gw.wait_queued(11, 0)
    new = copy.deepcopy(config)
    new["pools"]["p"] = pool_config((a, 2), (b, 2))
    status, body = await gw.reload(new)
    assert status == 200 and body["status"] == "reloaded"
    state = (await gw.state())["pools"]["p"]
    assert [i["max_concurrency"] for i in state["instances"]] == [2, 2]
    results = await asyncio.gather(*load)
    assert [s for s, _ in results] == [200] * 12  # nothing queued was lost
    assert b.stats.requests_total > 0  # the new instance serves the old queue
    assert a.stats.peak_in_flight <= 2 and b.stats.peak_in_flight <= 2
    assert "1.0" in await _metric(gw, "gateway_config_last_reload_success ")
    await gw.assert_quiet()


async def test_invalid_reload_keeps_the_running_config(
    mocks: MockFactory, gateway_factory: GatewayFactory
) -> None:
    a = await mocks(latency_ms=100)
    config = simple_config(pool_config((a, 1)))
    gw = await gateway_factory(config)
    load = [asyncio.create_task(_send(gw)) for _ in range(4)]
    await gw.wait_queued(3, 0)
    broken = copy.deepcopy(config)
    broken["pools"]["p"]["instances"][0]["max_concurrency"] = 0
    status, body = await gw.reload(broken)
    assert status == 400
    assert body["error"]["code"] == "invalid_config"
    assert "pools.p.instances[0].max_concurrency" in body["error"]["message"]
    assert [s for s, _ in await asyncio.gather(*load)] == [200] * 4
    assert (await gw.state())["pools"]["p"]["instances"][0]["max_concurrency"] == 1
    assert (await _send(gw))[0] == 200
    assert "0.0" in await _metric(gw, "gateway_config_last_reload_success ")
    assert 'result="failure"} 1.0' in await _metric(gw, "gateway_config_reloads_total")
    await gw.assert_quiet()


async def test_removed_instance_drains_and_takes_nothing_new(
    mocks: MockFactory, gateway_factory: GatewayFactory
) -> None:
    a, b = await mocks(latency_ms=400), await mocks()
    config = simple_config(pool_config((a, 2), (b, 2)), balancer="round_robin")
    gw = await gateway_factory(config)
    slow = [asyncio.create_task(_send(gw)) for _ in range(2)]
    await eventually(lambda: a.stats.in_flight == 1, what="a slow request on a")
    new = copy.deepcopy(config)
    new["pools"]["p"] = pool_config((b, 2))
    new["pools"]["p"]["instances"][0]["name"] = config["pools"]["p"]["instances"][1]["name"]
    status, _ = await gw.reload(new)
    assert status == 200
    names = [i["name"] for i in (await gw.state())["pools"]["p"]["instances"]]
    assert len(names) == 2  # the removed one is listed while it drains
    after = [await _send(gw) for _ in range(5)]
    assert all(inst == new["pools"]["p"]["instances"][0]["name"] for _, inst in after)
    assert [s for s, _ in await asyncio.gather(*slow)] == [200, 200]
    assert a.stats.requests_total == 1
    state = (await gw.state())["pools"]["p"]
    assert [i["name"] for i in state["instances"]] == [new["pools"]["p"]["instances"][0]["name"]]
    await gw.assert_quiet()


async def test_removed_pool_sends_its_queue_to_the_fallback(
    mocks: MockFactory, gateway_factory: GatewayFactory
) -> None:
    a, spare = await mocks(latency_ms=300), await mocks()
    config: dict[str, Any] = {
        "pools": {"p": pool_config((a, 1), fallback="spare"), "spare": pool_config(spare)},
        "models": {"m": {"pool": "p"}},
    }
    gw = await gateway_factory(config)
    load = [asyncio.create_task(_send(gw)) for _ in range(4)]
    await gw.wait_queued(3, 0)
    new = {"pools": {"spare": pool_config(spare)}, "models": {"m": {"pool": "spare"}}}
    status, _ = await gw.reload(new)
    assert status == 200
    results = await asyncio.gather(*load)
    assert [s for s, _ in results] == [200] * 4  # 1 finished in flight, 3 re-homed
    assert spare.stats.requests_total == 3
    await gw.assert_quiet()


async def test_admin_endpoints_need_the_admin_key(
    mocks: MockFactory, gateway_factory: GatewayFactory
) -> None:
    a = await mocks()
    config = simple_config(
        pool_config(a), auth={"keys": [{"key": "client-k", "name": "c"}], "admin_key": "admin-k"}
    )
    gw = await gateway_factory(config)
    for key in (None, "client-k", "wrong"):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        async with gw.session.get(gw.url + "/admin/state", headers=headers) as resp:
            assert resp.status == 401
        status, _ = await gw.reload(copy.deepcopy(config), headers=headers)
        assert status == 401
    admin = {"Authorization": "Bearer admin-k"}
    async with gw.session.get(gw.url + "/admin/state", headers=admin) as resp:
        assert resp.status == 200
    status, _ = await gw.reload(copy.deepcopy(config), headers=admin)
    assert status == 200


async def test_a_reload_keeps_each_keys_rate_limit_bucket(
    mocks: MockFactory, gateway_factory: GatewayFactory
) -> None:
    """A reload used to rebuild every key's RPM/TPM bucket: a key at its limit was let in
    again by any SIGHUP. An unchanged key keeps its bucket."""
    m = await mocks()
    auth = {
        "keys": [{"key": "sk-limited-1", "name": "limited", "rpm": 2}],
        "admin_key": "sk-admin-reload-1",
    }
    config = simple_config(pool_config(m), auth=auth)
    gw = await gateway_factory(config)
    key = {"Authorization": "Bearer sk-limited-1"}
    assert [(await _send(gw, headers=key))[0] for _ in range(2)] == [200, 200]
    assert (await _send(gw, headers=key))[0] == 429
    admin = {"Authorization": "Bearer sk-admin-reload-1"}
    status, _ = await gw.reload(copy.deepcopy(config), headers=admin)
    assert status == 200
    assert (await _send(gw, headers=key))[0] == 429  # still spent after the reload
    await gw.assert_quiet()


async def test_enabling_probes_by_reload_starts_probing(
    mocks: MockFactory, gateway_factory: GatewayFactory
) -> None:
    """A reload that turned probes on used to leave them off (the prober started only at
    boot), so an ejected instance never came back: half-open needs a passing probe."""
    a, b = await mocks(), await mocks()
    config = simple_config(
        pool_config(a, b),
        health={"failure_threshold": 1, "ejection_ms": 200, "probe": {"enabled": False}},
    )
    gw = await gateway_factory(config)
    await a.set_down(True)
    for _ in range(3):
        assert (await _send(gw))[0] == 200  # served by b; a is ejected
    name = f"m{a.port}-0"

    def state_of(s: dict[str, Any]) -> str:
        return str(next(i for i in s["pools"]["p"]["instances"] if i["name"] == name)["state"])

    assert state_of(await gw.state()) == "ejected"
    await a.set_down(False)
    probing = copy.deepcopy(config)
    probing["health"] = {
        "failure_threshold": 1,
        "ejection_ms": 200,
        "success_threshold": 1,
        "probe": {"enabled": True, "interval_ms": 100, "timeout_ms": 500},
    }
    assert (await gw.reload(probing))[0] == 200
    # a passing probe lets it into half-open; one successful request restores it
    await gw.wait_state(lambda s: state_of(s) == "half_open", within=10)
    for _ in range(4):
        assert (await _send(gw))[0] == 200
    await gw.wait_state(lambda s: state_of(s) == "healthy")
    await gw.assert_quiet()


async def test_a_reload_with_many_errors_reports_them_all_and_changes_nothing(
    mocks: MockFactory, gateway_factory: GatewayFactory
) -> None:
    """SPEC §8/§18: every error of the file in one answer, and the running config stays."""
    a = await mocks(latency_ms=100)
    config = simple_config(pool_config((a, 1)))
    gw = await gateway_factory(config)
    load = [asyncio.create_task(_send(gw)) for _ in range(3)]
    await gw.wait_queued(2, 0)
    broken = copy.deepcopy(config)
    broken["scheduler"] = {"high": {"capacity": -1}}
    broken["pools"]["p"]["instances"][0]["max_concurrency"] = 0
    broken["pools"]["p"]["colour"] = "red"
    broken["models"]["m2"] = {"pool": "nowhere"}
    status, body = await gw.reload(broken)
    assert status == 400 and body["error"]["code"] == "invalid_config"
    message = body["error"]["message"]
    assert "4 errors" in message
    for path in (
        "scheduler.high.capacity",
        "pools.p.instances[0].max_concurrency",
        "pools.p.colour",
        "models.m2.pool",
    ):
        assert path in message, message
    assert "sk-upstream-secret" not in message
    assert [s for s, _ in await asyncio.gather(*load)] == [200] * 3
    state = await gw.state()
    assert state["pools"]["p"]["instances"][0]["max_concurrency"] == 1
    assert (await _send(gw))[0] == 200
    assert 'result="failure"} 1.0' in await _metric(gw, "gateway_config_reloads_total")
    await gw.assert_quiet()


async def test_a_reload_keeps_the_classifier_unless_its_rules_changed(
    mocks: MockFactory, gateway_factory: GatewayFactory
) -> None:
    """A reload that leaves `routing.classifier` alone keeps the built classifier (building
    one is most of a reload's CPU); one that changes its keywords classifies by the new ones
    from the next request."""
    light, heavy = await mocks(), await mocks()
    config: dict[str, Any] = {
        "pools": {"light": pool_config(light), "heavy": pool_config(heavy)},
        "models": {"judge": {"route": "auto"}},
        "routing": {"complexity": {"simple": "light", "complex": "heavy"}},
    }

    async def complexity(text: str) -> str:
        async with await gw.post("/v1/chat/completions", chat(text, model="judge")) as resp:
            await resp.read()
            assert resp.status == 200
            return resp.headers["X-Gateway-Complexity"]

    gw = await gateway_factory(config)
    built = gw.gateway.runtime.router.classifier
    assert await complexity("please frobnicate this") == "simple; default"
    new = copy.deepcopy(config)
    new["pools"]["light"] = pool_config((light, 3))
    assert (await gw.reload(new))[0] == 200
    assert gw.gateway.runtime.router.classifier is built  # not rebuilt
    assert await complexity("please frobnicate this") == "simple; default"
    new = copy.deepcopy(new)
    new["routing"]["classifier"] = {"complex_keywords": ["frobnicate"]}
    assert (await gw.reload(new))[0] == 200
    assert await complexity("please frobnicate this") == "complex; keyword=frobnicate"
    await gw.assert_quiet()
