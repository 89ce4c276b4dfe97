"""The data path through the official openai client: unchanged client code, only base_url."""

from __future__ import annotations

import asyncio
import time

import openai
import pytest

from support import GatewayFactory, MockFactory, chat, pool_config, simple_config


async def test_async_client_chat_completion(
    mocks: MockFactory, gateway_factory: GatewayFactory
) -> None:
    m = await mocks()
    gw = await gateway_factory(simple_config(pool_config(m)))
    client = openai.AsyncOpenAI(base_url=gw.base_url, api_key="client-key", max_retries=0)
    async with client:
        raw = await client.chat.completions.with_raw_response.create(
            model="m", messages=[{"role": "user", "content": "does this compile?"}]
        )
        completion = raw.parse()
    assert completion.choices[0].message.content
    assert completion.usage is not None and completion.usage.total_tokens > 0
    assert raw.headers["X-Gateway-Pool"] == "p"
    assert raw.headers["X-Gateway-Instance"] == f"m{m.port}-0"
    assert raw.headers["X-Gateway-Priority"] == "high"
    assert raw.headers["X-Gateway-Complexity"].startswith("simple; ")
    assert float(raw.headers["X-Gateway-Queue-Ms"]) >= 0
    assert raw.headers["X-Request-Id"]
    # the upstream got the instance's model and key, not the client's
    seen = m.requests[-1]
    assert seen["body"]["model"] == "up-model"
    assert seen["headers"]["authorization"] == "Bearer sk-upstream-secret"
    await gw.assert_quiet()


async def test_async_client_streams_incrementally(
    mocks: MockFactory, gateway_factory: GatewayFactory
) -> None:
    m = await mocks(tokens_per_s=40, default_tokens=12)
    gw = await gateway_factory(simple_config(pool_config(m)))
    async with openai.AsyncOpenAI(base_url=gw.base_url, api_key="k", max_retries=0) as client:
        stream = await client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "hi"}],
            stream=True,
            stream_options={"include_usage": True},
        )
        arrivals = []
        text = []
        usage = None
        async for chunk in stream:
            arrivals.append(time.monotonic())
            if chunk.choices and chunk.choices[0].delta.content:
                text.append(chunk.choices[0].delta.content)
            if chunk.usage:
                usage = chunk.usage
    assert len(text) >= 10
    assert usage is not None and usage.completion_tokens == 12
    # 12 tokens at 40/s take ~0.3 s: the first chunk must arrive long before the last
    assert arrivals[-1] - arrivals[0] > 0.15
    await gw.assert_quiet()


def _sync_round_trip(base_url: str) -> tuple[str, list[str]]:
    with openai.OpenAI(base_url=base_url, api_key="k", max_retries=0) as client:
        done = client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "你好，时间复杂度是多少？"}]
        )
        chunks = [
            c.choices[0].delta.content or ""
            for c in client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "hi"}], stream=True
            )
            if c.choices
        ]
    return done.choices[0].message.content or "", chunks


async def test_sync_client_in_a_thread(mocks: MockFactory, gateway_factory: GatewayFactory) -> None:
    m = await mocks()
    gw = await gateway_factory(simple_config(pool_config(m)))
    content, chunks = await asyncio.to_thread(_sync_round_trip, gw.base_url)
    assert content and "".join(chunks)
    await gw.assert_quiet()


async def test_completions_embeddings_and_models(
    mocks: MockFactory, gateway_factory: GatewayFactory
) -> None:
    m = await mocks()
    gw = await gateway_factory(
        simple_config(pool_config(m), models={"m": {"pool": "p"}, "m2": {"pool": "p"}})
    )
    async with openai.AsyncOpenAI(base_url=gw.base_url, api_key="k", max_retries=0) as client:
        comp = await client.completions.create(model="m", prompt="int main(){}", max_tokens=5)
        assert comp.choices[0].text
        emb = await client.embeddings.create(model="m2", input=["a", "b"])
        assert len(emb.data) == 2 and len(emb.data[0].embedding) > 0
        models = await client.models.list()
        assert sorted(x.id for x in models.data) == ["m", "m2"]
    assert [r["body"]["model"] for r in m.requests[-2:]] == ["up-model", "up-model"]
    await gw.assert_quiet()


async def test_unknown_model_is_404_and_upstream_untouched(
    mocks: MockFactory, gateway_factory: GatewayFactory
) -> None:
    m = await mocks()
    gw = await gateway_factory(simple_config(pool_config(m)))
    async with openai.AsyncOpenAI(base_url=gw.base_url, api_key="k", max_retries=0) as client:
        with pytest.raises(openai.NotFoundError) as err:
            await client.chat.completions.create(
                model="gpt-nope", messages=[{"role": "user", "content": "x"}]
            )
    assert err.value.code == "model_not_found"
    assert m.stats.requests_total == 0
    await gw.assert_quiet()


async def test_upstream_request_is_built_from_config_alone(
    mocks: MockFactory, gateway_factory: GatewayFactory
) -> None:
    m = await mocks()
    gw = await gateway_factory(simple_config(pool_config(m)))
    body = chat("hi", api_base="http://169.254.169.254/", base_url="http://evil/")
    headers = {
        "Authorization": "Bearer client-secret",
        "Connection": "keep-alive, X-Drop-Me",
        "X-Drop-Me": "1",
        "Proxy-Authorization": "Basic abc",
        "TE": "trailers",
        "Upgrade": "websocket",
        "Cookie": "session=1",
    }
    async with await gw.post("/v1/chat/completions", body, headers=headers) as resp:
        assert resp.status == 200
    seen = m.requests[-1]
    sent = seen["headers"]
    assert sent["authorization"] == "Bearer sk-upstream-secret"
    for name in ("x-drop-me", "proxy-authorization", "te", "upgrade", "cookie"):
        assert name not in sent, name
    assert "api_base" not in seen["body"] and "base_url" not in seen["body"]
    await gw.assert_quiet()


async def test_upstream_redirect_is_not_followed(
    mocks: MockFactory, gateway_factory: GatewayFactory
) -> None:
    target = await mocks()
    m = await mocks(fail_rate=1.0, fail_status=302)
    gw = await gateway_factory(simple_config(pool_config(m), retries={"max_attempts": 1}))
    async with await gw.post("/v1/chat/completions", chat()) as resp:
        assert resp.status == 502
        assert (await resp.json())["error"]["code"] == "upstream_error"
    assert target.stats.requests_total == 0
    await gw.assert_quiet()


async def test_auto_alias_routes_by_complexity(
    mocks: MockFactory, gateway_factory: GatewayFactory
) -> None:
    light, heavy = await mocks(), await mocks()
    config = {
        "pools": {"light": pool_config(light), "heavy": pool_config(heavy)},
        "models": {"judge": {"route": "auto"}},
        "routing": {"complexity": {"simple": "light", "complex": "heavy"}},
    }
    gw = await gateway_factory(config)
    cases = [
        ("Does this compile? int main(){return 0;}", "light", "simple; keyword=does this compile"),
        (
            "What is the worst-case time complexity of quicksort?",
            "heavy",
            "complex; keyword=worst-case",
        ),
        (
            "这段代码的时间复杂度是多少？",
            "heavy",
            "complex; keyword=%E6%97%B6%E9%97%B4%E5%A4%8D%E6%9D%82%E5%BA%A6",
        ),
        ("hello", "light", "simple; default"),
    ]
    for prompt, pool, header in cases:
        async with await gw.post("/v1/chat/completions", chat(prompt, model="judge")) as resp:
            assert resp.status == 200
            assert resp.headers["X-Gateway-Pool"] == pool, prompt
            assert resp.headers["X-Gateway-Complexity"] == header
    # the header overrides the classifier
    async with await gw.post(
        "/v1/chat/completions", chat("hello", model="judge"), headers={"X-Complexity": "complex"}
    ) as resp:
        assert resp.headers["X-Gateway-Pool"] == "heavy"
        assert resp.headers["X-Gateway-Complexity"] == "complex; header"
    await gw.assert_quiet()
