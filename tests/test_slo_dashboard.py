"""SPEC §17 on the dashboard, in a real headless Chromium (the `page` of test_dashboard.py): a
pool's goodput tile follows the verdicts of requests with objectives, and an adaptive
instance's row shows its current concurrency limit."""

from __future__ import annotations

from support import GatewayFactory, MockFactory, pool_config, simple_config
from test_dashboard import Page, page  # noqa: F401 (the browser fixture)

GOODPUT_JS = "document.querySelector('[data-pool=\"p\"] .tile.goodput b').textContent"


async def test_goodput_tile_and_adaptive_limit(
    page: Page,  # noqa: F811
    mocks: MockFactory,
    gateway_factory: GatewayFactory,
) -> None:
    m = await mocks(latency_ms=60)
    pool = pool_config(m, m)
    pool["instances"][1]["max_concurrency"] = {"max": 8, "adaptive": True}
    gw = await gateway_factory(simple_config(pool))
    await page.goto(gw.url + "/dashboard")
    await page.wait_for("document.querySelectorAll('[data-instance]').length === 2")
    # No request with an objective yet: nothing to show.
    assert await page.evaluate(GOODPUT_JS) == "\u2013"
    # Three met (a 30 s objective), one missed (10 ms against a 60 ms backend): 75 %.
    for objective in ("30000", "30000", "10", "30000"):
        async with await gw.post(
            "/v1/chat/completions",
            {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
            headers={"x-slo-ttft-ms": objective},
        ) as resp:
            assert resp.status == 200
    await page.wait_for(f"{GOODPUT_JS} === '75.0%'")
    state = await gw.state()
    assert state["pools"]["p"]["slo"] == {"met": 3, "missed": 1, "shed": 0, "goodput": 0.75}
    # The adaptive instance's row says its limit out of its ceiling; the fixed one's does not.
    limit = state["pools"]["p"]["instances"][1]["concurrency_limit"]
    rows = await page.evaluate(
        "[...document.querySelectorAll('[data-instance]')].map(e => e.textContent)"
    )
    assert f"limit {limit} of 8" in rows[1], rows
    assert "limit" not in rows[0], rows
    await gw.assert_quiet()
