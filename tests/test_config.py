"""Configuration loading (SPEC §8): defaults, env expansion, validation paths, secret hygiene."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from gateway.check import describe
from gateway.config import (
    DEFAULT_COMPLEX_KEYWORDS,
    DEFAULT_SIMPLE_KEYWORDS,
    MASK,
    ApiKey,
    Auth,
    Classifier,
    ClassSettings,
    Config,
    Health,
    InstanceSpec,
    Limits,
    Listen,
    Probe,
    Retries,
    Routing,
    Scheduler,
    Shutdown,
    Timeouts,
    TlsSpec,
    expand_env,
    load_config,
    masked,
    parse_config,
)
from gateway.errors import ConfigError

# The SPEC §8 example, verbatim except for the classifier line (whose `[...]` is prose).
SPEC_EXAMPLE = """\
listen: {host: 127.0.0.1, port: 8080}
max_body_bytes: 10485760
default_priority: high
scheduler:
  policy: weighted                 # weighted | strict
  high: {capacity: 200, weight: 7, max_wait_ms: 30000}
  low:  {capacity: 1000, weight: 3, max_wait_ms: 600000}
  max_consecutive_high: 20
  max_low_wait_ms: 5000
  overflow_high_to_low: true
balancer: least_connections        # least_connections | round_robin | random | p2c
health:
  failure_threshold: 3
  ejection_ms: 10000
  max_ejection_ms: 300000
  half_open_max_requests: 1
  success_threshold: 2
  probe: {interval_ms: 5000, timeout_ms: 2000, path: /v1/models}
timeouts: {connect_ms: 5000, first_byte_ms: 120000, stream_idle_ms: 60000, total_ms: 600000}
retries: {max_attempts: 3}
pools:
  light:
    instances:
      - {name: qwen-a, url: "http://10.0.0.5:8000/v1", model: Qwen2.5-7B-Instruct, max_concurrency: 16}
      - {name: qwen-b, url: "http://10.0.0.6:8000/v1", model: Qwen2.5-7B-Instruct, max_concurrency: 16}
  heavy:
    fallback: light
    instances:
      - {name: gpt, url: "https://api.openai.com/v1", model: gpt-4o, api_key: "${OPENAI_API_KEY}", max_concurrency: 64}
      - {name: ernie, url: "https://qianfan.baidubce.com/v2", model: ernie-4.0-8k, api_key: "${QIANFAN_API_KEY}", max_concurrency: 32}
models:
  judge: {route: auto}
  judge-lite: {pool: light}
  judge-pro: {pool: heavy}
routing:
  complexity: {simple: light, complex: heavy}
auth:                              # optional; absent = no client auth
  keys:
    - {key: "${FREE_TIER_KEY}", name: free, priority: low, rpm: 60}
    - {key: "${PAID_TIER_KEY}", name: paid, priority: high}
"""  # noqa: E501 - kept as the SPEC writes it

SPEC_ENV = {
    "OPENAI_API_KEY": "sk-openai-test",
    "QIANFAN_API_KEY": "qf-test",
    "FREE_TIER_KEY": "free-test",
    "PAID_TIER_KEY": "paid-test",
}

MINIMAL = """\
pools:
  light:
    instances:
      - {name: a, url: "http://127.0.0.1:9001/v1", model: m, max_concurrency: 4}
models:
  lite: {pool: light}
"""

# A value that must never be printed: tests search every output for it.
CANARY = "sk-CANARY-7f3a9c2e51"


def minimal() -> dict[str, Any]:
    """A fresh, valid config as data, for tests to mutate."""
    return {
        "pools": {
            "light": {
                "instances": [
                    {
                        "name": "a",
                        "url": "http://127.0.0.1:9001/v1",
                        "model": "m",
                        "max_concurrency": 4,
                    },
                    {
                        "name": "b",
                        "url": "http://127.0.0.1:9002/v1",
                        "model": "m",
                        "max_concurrency": 4,
                    },
                ]
            },
            "heavy": {
                "instances": [
                    {
                        "name": "c",
                        "url": "https://api.example.com/v1",
                        "model": "big",
                        "max_concurrency": 8,
                    }
                ]
            },
        },
        "models": {"lite": {"pool": "light"}, "pro": {"pool": "heavy"}},
    }


def dump(data: dict[str, Any]) -> str:
    return yaml.safe_dump(data, allow_unicode=True, sort_keys=False)


def load(data: dict[str, Any] | str, env: dict[str, str] | None = None) -> Config:
    return parse_config(data if isinstance(data, str) else dump(data), env=env or {})


def error(data: dict[str, Any] | str, env: dict[str, str] | None = None) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load(data, env)
    return info.value


# ---------------------------------------------------------------------------------------------
# Loading and defaults


def test_spec_example_loads_with_the_spec_values() -> None:
    cfg = parse_config(SPEC_EXAMPLE, env=SPEC_ENV)
    assert cfg.listen == Listen(host="127.0.0.1", port=8080)
    assert cfg.max_body_bytes == 10_485_760
    assert cfg.default_priority == "high"
    assert cfg.scheduler == Scheduler()
    assert cfg.balancer == "least_connections"
    assert cfg.health == Health()
    assert cfg.timeouts == Timeouts()
    assert cfg.retries == Retries()
    assert list(cfg.pools) == ["light", "heavy"]
    assert [i.name for i in cfg.pools["light"].instances] == ["qwen-a", "qwen-b"]
    gpt = cfg.pools["heavy"].instances[0]
    assert gpt.url == "https://api.openai.com/v1"
    assert gpt.model == "gpt-4o"
    assert gpt.api_key == "sk-openai-test"
    assert gpt.max_concurrency == 64
    assert gpt.provider == "openai"
    assert gpt.headers == {}
    assert cfg.pools["heavy"].fallback == "light"
    assert cfg.pools["light"].fallback is None
    assert cfg.models["judge"].route == "auto"
    assert cfg.models["judge-lite"].pool == "light"
    assert cfg.routing.complexity.simple == "light"
    assert cfg.routing.complexity.complex == "heavy"
    assert cfg.auth is not None
    assert cfg.auth.keys[0] == ApiKey(key="free-test", name="free", priority="low", rpm=60)
    assert cfg.auth.keys[1].priority == "high"
    assert cfg.auth.admin_key is None
    assert cfg.limits == Limits()
    assert cfg.shutdown == Shutdown()
    assert cfg.seed == 0


def test_every_default_matches_the_spec() -> None:
    cfg = load(MINIMAL)
    assert cfg.listen == Listen(host="127.0.0.1", port=8080)
    assert cfg.max_body_bytes == 10_485_760
    assert cfg.default_priority == "high"
    s = cfg.scheduler
    assert s.policy == "weighted"
    assert s.high == ClassSettings(capacity=200, weight=7, max_wait_ms=30_000)
    assert s.low == ClassSettings(capacity=1000, weight=3, max_wait_ms=600_000)
    assert (s.max_consecutive_high, s.max_low_wait_ms, s.overflow_high_to_low) == (20, 5000, True)
    assert cfg.balancer == "least_connections"
    h = cfg.health
    assert (h.failure_threshold, h.ejection_ms, h.max_ejection_ms) == (3, 10_000, 300_000)
    assert (h.half_open_max_requests, h.success_threshold) == (1, 2)
    assert h.probe == Probe(interval_ms=5000, timeout_ms=2000, path="/v1/models", enabled=True)
    t = cfg.timeouts
    assert (t.connect_ms, t.first_byte_ms, t.stream_idle_ms, t.total_ms) == (
        5000,
        120_000,
        60_000,
        600_000,
    )
    assert cfg.retries.max_attempts == 3
    assert cfg.routing.default_complexity == "simple"
    assert cfg.routing.complexity.simple is None and cfg.routing.complexity.complex is None
    assert cfg.routing.classifier.long_prompt_chars == 4000
    assert cfg.routing.classifier.code_lines_complex == 40
    assert cfg.auth is None
    assert cfg.limits == Limits(
        header_timeout_ms=10_000, body_timeout_ms=30_000, keepalive_timeout_ms=75_000
    )
    assert cfg.shutdown.drain_timeout_ms == 25_000
    inst = cfg.pools["light"].instances[0]
    assert (inst.api_key, inst.provider, inst.headers) == (None, "openai", {})
    pool = cfg.pools["light"]
    assert (pool.fallback, pool.balancer, pool.spill_to, pool.spill_queue_depth) == (
        None,
        None,
        None,
        0,
    )


def test_default_classifier_keywords_are_bilingual() -> None:
    cl = Classifier()
    for word in ("time complexity", "worst case", "prove", "optimize", "时间复杂度", "最坏情况"):
        assert word in cl.complex_keywords
    for word in ("compile", "syntax", "编译", "语法"):
        assert word in cl.simple_keywords
    assert tuple(cl.complex_keywords) == DEFAULT_COMPLEX_KEYWORDS
    assert tuple(cl.simple_keywords) == DEFAULT_SIMPLE_KEYWORDS


def test_partial_sections_keep_the_defaults_of_omitted_fields() -> None:
    d = minimal()
    d["scheduler"] = {"policy": "strict", "high": {"weight": 5}, "low": {"capacity": 50}}
    d["health"] = {"failure_threshold": 5, "probe": {"path": "/health"}}
    d["timeouts"] = {"total_ms": 900_000}
    d["listen"] = {"port": 9000}
    d["routing"] = {"classifier": {"long_prompt_chars": 100}}
    cfg = load(d)
    assert cfg.scheduler.policy == "strict"
    assert cfg.scheduler.high == ClassSettings(capacity=200, weight=5, max_wait_ms=30_000)
    assert cfg.scheduler.low == ClassSettings(capacity=50, weight=3, max_wait_ms=600_000)
    assert cfg.scheduler.max_consecutive_high == 20
    assert cfg.health.failure_threshold == 5
    assert cfg.health.ejection_ms == 10_000
    assert cfg.health.probe == Probe(path="/health")
    assert cfg.timeouts == Timeouts(total_ms=900_000)
    assert cfg.listen == Listen(port=9000)
    assert cfg.routing.classifier.long_prompt_chars == 100
    assert cfg.routing.classifier.complex_keywords == list(DEFAULT_COMPLEX_KEYWORDS)


def test_an_empty_section_keeps_its_defaults() -> None:
    cfg = load(MINIMAL + "health:\nscheduler:\n  high:\n")
    assert cfg.health == Health()
    assert cfg.scheduler == Scheduler()


def test_configured_values_are_kept() -> None:
    d = minimal()
    d["balancer"] = "p2c"
    d["seed"] = 42
    d["pools"]["heavy"].update(balancer="round_robin", spill_to="light", spill_queue_depth=10)
    d["pools"]["heavy"]["instances"][0].update(
        provider="qianfan", api_key="k", headers={"X-Tenant": "oj"}
    )
    d["routing"] = {
        "complexity": {"simple": "light", "complex": "heavy"},
        "classifier": {"complex_keywords": ["big-o"], "simple_keywords": []},
        "default_complexity": "complex",
    }
    d["models"]["judge"] = {"route": "auto"}
    cfg = load(d)
    assert cfg.seed == 42
    assert cfg.pool_balancer("light") == "p2c"
    assert cfg.pool_balancer("heavy") == "round_robin"
    assert cfg.pools["heavy"].spill_to == "light"
    inst = cfg.pools["heavy"].instances[0]
    assert (inst.provider, inst.api_key, inst.headers) == ("qianfan", "k", {"X-Tenant": "oj"})
    assert cfg.routing.classifier == Classifier(complex_keywords=["big-o"], simple_keywords=[])
    assert cfg.routing.default_complexity == "complex"
    assert [(p, i.name) for p, i in cfg.instances()] == [
        ("light", "a"),
        ("light", "b"),
        ("heavy", "c"),
    ]


@pytest.mark.parametrize(("written", "resolved"), [("realtime", "high"), ("batch", "low")])
def test_priority_aliases_are_normalised(written: str, resolved: str) -> None:
    d = minimal()
    d["default_priority"] = written
    d["auth"] = {"keys": [{"key": "k1", "name": "n", "priority": written}]}
    cfg = load(d)
    assert cfg.default_priority == resolved
    assert cfg.auth is not None and cfg.auth.keys[0].priority == resolved


def test_url_trailing_slash_is_stripped() -> None:
    d = minimal()
    d["pools"]["light"]["instances"][0]["url"] = "http://127.0.0.1:9001/v1/"
    d["pools"]["heavy"]["instances"][0]["url"] = "https://api.example.com/"
    cfg = load(d)
    assert cfg.pools["light"].instances[0].url == "http://127.0.0.1:9001/v1"
    assert cfg.pools["heavy"].instances[0].url == "https://api.example.com"


def test_config_is_frozen() -> None:
    cfg = load(MINIMAL)
    with pytest.raises(AttributeError):
        cfg.seed = 1  # type: ignore[misc]


def test_load_config_reads_a_file(tmp_path: Path) -> None:
    path = tmp_path / "gateway.yaml"
    path.write_text("\ufeff" + MINIMAL, encoding="utf-8")  # a BOM is tolerated
    cfg = load_config(path, env={})
    assert list(cfg.models) == ["lite"]
    assert load_config(str(path), env={}) == cfg


def test_load_config_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "nope.yaml")


def test_load_config_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_bytes(b"pools: \xff\xfe\n")
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_config(path)


# ---------------------------------------------------------------------------------------------
# Environment expansion


def test_env_expansion_with_and_without_defaults() -> None:
    d = minimal()
    inst = d["pools"]["heavy"]["instances"][0]
    inst["api_key"] = "${KEY}"
    inst["url"] = "https://${HOST:-api.example.com}/v1"
    inst["model"] = "${MODEL:-fallback-model}"
    d["listen"] = {"host": "${BIND:-0.0.0.0}", "port": "${PORT:-8080}"}
    cfg = load(d, env={"KEY": "secret", "MODEL": "gpt-4o"})
    inst_cfg = cfg.pools["heavy"].instances[0]
    assert inst_cfg.api_key == "secret"
    assert inst_cfg.url == "https://api.example.com/v1"
    assert inst_cfg.model == "gpt-4o"
    assert cfg.listen == Listen(host="0.0.0.0", port=8080)


def test_env_numbers_become_ints() -> None:
    d = minimal()
    d["listen"] = {"port": "${PORT:-8080}"}
    d["pools"]["light"]["instances"][0]["max_concurrency"] = "${QWEN_SLOTS}"
    d["scheduler"] = {"overflow_high_to_low": "${OVERFLOW:-false}"}
    cfg = load(d, env={"PORT": "9090", "QWEN_SLOTS": "32"})
    assert cfg.listen.port == 9090
    assert cfg.pools["light"].instances[0].max_concurrency == 32
    assert cfg.scheduler.overflow_high_to_low is False


def test_env_default_applies_to_empty_variables_too() -> None:
    d = minimal()
    d["listen"] = {"port": "${PORT:-7000}"}
    assert load(d, env={"PORT": ""}).listen.port == 7000


def test_env_missing_variable_names_the_field() -> None:
    d = minimal()
    d["pools"]["heavy"]["instances"][0]["api_key"] = "${OPENAI_API_KEY}"
    err = error(d, env={})
    assert err.path == "pools.heavy.instances[0].api_key"
    assert "OPENAI_API_KEY" in err.reason


def test_env_expanded_values_are_not_expanded_again() -> None:
    d = minimal()
    d["pools"]["heavy"]["instances"][0]["api_key"] = "${KEY}"
    cfg = load(d, env={"KEY": "${OTHER}", "OTHER": "nope"})
    assert cfg.pools["heavy"].instances[0].api_key == "${OTHER}"


def test_env_keys_are_not_expanded() -> None:
    text = MINIMAL.replace("lite: {pool: light}", "${ALIAS}: {pool: light}")
    cfg = load(text, env={"ALIAS": "expanded"})
    assert list(cfg.models) == ["${ALIAS}"]


def test_env_escape_writes_a_literal_reference() -> None:
    d = minimal()
    d["pools"]["heavy"]["instances"][0]["headers"] = {"X-Template": "$${NOT_A_VAR} and $HOME"}
    cfg = load(d)
    assert cfg.pools["heavy"].instances[0].headers == {"X-Template": "${NOT_A_VAR} and $HOME"}


@pytest.mark.parametrize("value", ["${", "x${UNCLOSED", "${1BAD}", "${A:?err}", "${A:-${B}}"])
def test_env_malformed_reference(value: str) -> None:
    d = minimal()
    d["pools"]["heavy"]["instances"][0]["model"] = value
    err = error(d)
    assert err.path == "pools.heavy.instances[0].model"


@given(st.text().filter(lambda t: "${" not in t))
def test_env_text_without_references_is_unchanged(text: str) -> None:
    assert expand_env({"k": [text]}, {}) == {"k": [text]}


@given(value=st.text(), default=st.text().filter(lambda t: "}" not in t and "${" not in t))
def test_env_substitutes_values_verbatim(value: str, default: str) -> None:
    env = {"V": value}
    assert expand_env("<${V}>", env) == f"<{value}>"
    assert expand_env("${V:-" + default + "}", env) == (value or default)
    assert expand_env("${UNSET:-" + default + "}", env) == default


def test_env_defaults_to_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GATEWAY_TEST_PORT", "8123")
    d = minimal()
    d["listen"] = {"port": "${GATEWAY_TEST_PORT}"}
    assert parse_config(dump(d)).listen.port == 8123


# ---------------------------------------------------------------------------------------------
# Validation: one case per rule, with the exact field path.

Mutation = Callable[[dict[str, Any]], None]


def _set(path: str, value: object) -> Mutation:
    """A mutation setting the dotted `path` (list indices as numbers) of the config data."""

    def mutate(d: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node: Any = d
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node.setdefault(part, {})
        if isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value

    return mutate


def _delete(path: str) -> Mutation:
    def mutate(d: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node: Any = d
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        del node[last]

    return mutate


def _many(*mutations: Mutation) -> Mutation:
    def mutate(d: dict[str, Any]) -> None:
        for m in mutations:
            m(d)

    return mutate


def _instance(name: str, url: str = "http://127.0.0.1:9100/v1") -> dict[str, Any]:
    return {"name": name, "url": url, "model": "m", "max_concurrency": 1}


def _too_many(d: dict[str, Any]) -> None:
    d["pools"]["light"]["instances"] = [_instance(f"i{n}") for n in range(65)]


L0 = "pools.light.instances.0"
H0 = "pools.heavy.instances.0"

CASES: list[tuple[str, Mutation, str, str]] = [
    # (id, mutation, expected path, fragment of the reason)
    ("top-level typo", _set("listn", {}), "listn", "did you mean `listen`"),
    (
        "nested typo",
        _set(f"{L0}.max_concurency", 3),
        "pools.light.instances[0].max_concurency",
        "did you mean `max_concurrency`",
    ),
    (
        "section typo",
        _set("health.probe.intervl_ms", 3),
        "health.probe.intervl_ms",
        "did you mean `interval_ms`",
    ),
    ("wrong type", _set("listen.port", "eighty"), "listen.port", "Expected `int`"),
    ("wrong section type", _set("scheduler", [1]), "scheduler", "Expected `object`"),
    ("port too big", _set("listen.port", 70000), "listen.port", "65535"),
    ("port negative", _set("listen.port", -1), "listen.port", ">= 0"),
    ("empty host", _set("listen.host", " "), "listen.host", "empty"),
    ("max_body_bytes", _set("max_body_bytes", 0), "max_body_bytes", ">= 1"),
    ("bad default priority", _set("default_priority", "urgent"), "default_priority", "realtime"),
    ("bad policy", _set("scheduler.policy", "fifo"), "scheduler.policy", "weighted, strict"),
    ("high capacity", _set("scheduler.high.capacity", 0), "scheduler.high.capacity", ">= 1"),
    ("low capacity", _set("scheduler.low.capacity", -5), "scheduler.low.capacity", ">= 1"),
    ("max_wait_ms", _set("scheduler.low.max_wait_ms", 0), "scheduler.low.max_wait_ms", ">= 1"),
    ("negative weight", _set("scheduler.high.weight", -1), "scheduler.high.weight", ">= 0"),
    (
        "both weights 0",
        _many(_set("scheduler.high.weight", 0), _set("scheduler.low.weight", 0)),
        "scheduler.low.weight",
        "both be 0",
    ),
    (
        "max_consecutive_high",
        _set("scheduler.max_consecutive_high", 0),
        "scheduler.max_consecutive_high",
        ">= 1",
    ),
    ("max_low_wait_ms", _set("scheduler.max_low_wait_ms", 0), "scheduler.max_low_wait_ms", ">= 1"),
    (
        "class typo",
        _set("scheduler.high.weigth", 1),
        "scheduler.high.weigth",
        "did you mean `weight`",
    ),
    (
        "bad balancer",
        _set("balancer", "fastest"),
        "balancer",
        "least_connections, round_robin, random, p2c",
    ),
    ("bad pool balancer", _set("pools.light.balancer", "fastest"), "pools.light.balancer", "p2c"),
    ("failure_threshold", _set("health.failure_threshold", 0), "health.failure_threshold", ">= 1"),
    ("success_threshold", _set("health.success_threshold", 0), "health.success_threshold", ">= 1"),
    (
        "half_open_max_requests",
        _set("health.half_open_max_requests", 0),
        "health.half_open_max_requests",
        ">= 1",
    ),
    ("ejection_ms", _set("health.ejection_ms", 0), "health.ejection_ms", ">= 1"),
    (
        "max below ejection",
        _set("health.max_ejection_ms", 5000),
        "health.max_ejection_ms",
        "ejection_ms",
    ),
    ("probe interval", _set("health.probe.interval_ms", 0), "health.probe.interval_ms", ">= 1"),
    ("probe timeout", _set("health.probe.timeout_ms", 0), "health.probe.timeout_ms", ">= 1"),
    ("probe path", _set("health.probe.path", "v1/models"), "health.probe.path", "start with `/`"),
    (
        "probe path query",
        _set("health.probe.path", "/v1/models?x=1"),
        "health.probe.path",
        "plain URL path",
    ),
    ("connect timeout", _set("timeouts.connect_ms", 0), "timeouts.connect_ms", ">= 1"),
    ("first byte timeout", _set("timeouts.first_byte_ms", -1), "timeouts.first_byte_ms", ">= 1"),
    ("idle timeout", _set("timeouts.stream_idle_ms", 0), "timeouts.stream_idle_ms", ">= 1"),
    ("total timeout", _set("timeouts.total_ms", 0), "timeouts.total_ms", ">= 1"),
    (
        "timeout over total",
        _set("timeouts.first_byte_ms", 700_000),
        "timeouts.first_byte_ms",
        "total_ms",
    ),
    ("retries", _set("retries.max_attempts", 0), "retries.max_attempts", ">= 1"),
    ("limits", _set("limits.header_timeout_ms", 0), "limits.header_timeout_ms", ">= 1"),
    ("drain", _set("shutdown.drain_timeout_ms", -1), "shutdown.drain_timeout_ms", ">= 0"),
    ("seed", _set("seed", -1), "seed", ">= 0"),
    # pools and instances
    ("pools missing", _delete("pools"), "pools", "required"),
    ("pools empty", _set("pools", {}), "pools", "at least one pool"),
    ("pool null", _set("pools.light", None), "pools.light", "Expected `object`"),
    ("instances missing", _set("pools.light", {}), "pools.light.instances", "required"),
    (
        "instances empty",
        _set("pools.light.instances", []),
        "pools.light.instances",
        "at least one instance",
    ),
    ("too many instances", _too_many, "pools.light.instances", "at most 64"),
    (
        "bad pool name",
        _many(
            lambda d: d["pools"].update({"heavy pool": d["pools"].pop("heavy")}),
            _set("models.pro.pool", "heavy pool"),
        ),
        "pools.heavy pool",
        "pool name",
    ),
    (
        "pool name key type",
        lambda d: d["pools"].update({7: d["pools"].pop("heavy")}),
        "pools",
        "keys must be strings",
    ),
    (
        "max_concurrency 0",
        _set(f"{L0}.max_concurrency", 0),
        "pools.light.instances[0].max_concurrency",
        ">= 1",
    ),
    (
        "max_concurrency missing",
        _delete(f"{L0}.max_concurrency"),
        "pools.light.instances[0].max_concurrency",
        "required",
    ),
    ("name missing", _delete(f"{H0}.name"), "pools.heavy.instances[0].name", "required"),
    ("empty name", _set(f"{L0}.name", ""), "pools.light.instances[0].name", "non-empty"),
    (
        "bad name",
        _set(f"{L0}.name", "qwen a"),
        "pools.light.instances[0].name",
        "A-Z a-z 0-9 . _ -",
    ),
    (
        "duplicate in pool",
        _set("pools.light.instances.1.name", "a"),
        "pools.light.instances[1].name",
        "duplicate",
    ),
    (
        "duplicate across pools",
        _set(f"{H0}.name", "b"),
        "pools.heavy.instances[0].name",
        "pools.light.instances[1].name",
    ),
    ("empty model", _set(f"{L0}.model", ""), "pools.light.instances[0].model", "empty"),
    (
        "bad provider",
        _set(f"{L0}.provider", "anthropic"),
        "pools.light.instances[0].provider",
        "openai, vllm, dashscope, qianfan",
    ),
    ("empty api_key", _set(f"{H0}.api_key", ""), "pools.heavy.instances[0].api_key", "non-empty"),
    (
        "header type",
        _set(f"{H0}.headers", {"X-A": 1}),
        "pools.heavy.instances[0].headers.X-A",
        "Expected `str`",
    ),
    (
        "header name",
        _set(f"{H0}.headers", {"Bad Header": "v"}),
        "pools.heavy.instances[0].headers.Bad Header",
        "header name",
    ),
    (
        "reserved header",
        _set(f"{H0}.headers", {"Host": "evil"}),
        "pools.heavy.instances[0].headers.Host",
        "set by the gateway",
    ),
    (
        "header value",
        _set(f"{H0}.headers", {"X-A": "a\r\nb"}),
        "pools.heavy.instances[0].headers.X-A",
        "control",
    ),
    ("url scheme", _set(f"{L0}.url", "ftp://10.0.0.5/v1"), "pools.light.instances[0].url", "http"),
    (
        "url no scheme",
        _set(f"{L0}.url", "10.0.0.5:8000/v1"),
        "pools.light.instances[0].url",
        "http",
    ),
    ("url no host", _set(f"{L0}.url", "http:///v1"), "pools.light.instances[0].url", "host"),
    (
        "url query",
        _set(f"{L0}.url", "http://10.0.0.5/v1?x=1"),
        "pools.light.instances[0].url",
        "query",
    ),
    (
        "url fragment",
        _set(f"{L0}.url", "http://10.0.0.5/v1#x"),
        "pools.light.instances[0].url",
        "fragment",
    ),
    (
        "url bad port",
        _set(f"{L0}.url", "http://10.0.0.5:99999/v1"),
        "pools.light.instances[0].url",
        "port",
    ),
    (
        "url credentials",
        _set(f"{L0}.url", "http://u:p@10.0.0.5/v1"),
        "pools.light.instances[0].url",
        "credentials",
    ),
    (
        "url space",
        _set(f"{L0}.url", "http://10.0.0.5/v 1"),
        "pools.light.instances[0].url",
        "spaces",
    ),
    (
        "fallback unknown",
        _set("pools.heavy.fallback", "ligth"),
        "pools.heavy.fallback",
        "did you mean 'light'",
    ),
    (
        "fallback self",
        _set("pools.heavy.fallback", "heavy"),
        "pools.heavy.fallback",
        "another pool",
    ),
    (
        "fallback cycle",
        _many(_set("pools.heavy.fallback", "light"), _set("pools.light.fallback", "heavy")),
        "pools.light.fallback",
        "cycle",
    ),
    (
        "spill_to unknown",
        _set("pools.light.spill_to", "nowhere"),
        "pools.light.spill_to",
        "unknown pool",
    ),
    (
        "spill_to self",
        _set("pools.light.spill_to", "light"),
        "pools.light.spill_to",
        "another pool",
    ),
    (
        "spill depth alone",
        _set("pools.light.spill_queue_depth", 5),
        "pools.light.spill_queue_depth",
        "spill_to",
    ),
    (
        "spill depth negative",
        _set("pools.light.spill_queue_depth", -1),
        "pools.light.spill_queue_depth",
        ">= 0",
    ),
    # models and routing
    ("models missing", _delete("models"), "models", "required"),
    ("models empty", _set("models", {}), "models", "at least one"),
    ("alias unknown pool", _set("models.lite.pool", "lihgt"), "models.lite.pool", "unknown pool"),
    ("alias both", _set("models.lite.route", "auto"), "models.lite", "exactly one"),
    ("alias neither", _set("models.lite", {}), "models.lite", "exactly one"),
    ("alias bad route", _set("models.lite", {"route": "smart"}), "models.lite.route", "auto"),
    ("alias typo", _set("models.lite", {"pol": "light"}), "models.lite.pol", "did you mean `pool`"),
    (
        "auto half routing",
        _many(_set("models.judge", {"route": "auto"}), _set("routing.complexity.simple", "light")),
        "routing.complexity.complex",
        "route: auto",
    ),
    (
        "routing unknown pool",
        _set("routing.complexity.complex", "hevy"),
        "routing.complexity.complex",
        "did you mean 'heavy'",
    ),
    (
        "bad default complexity",
        _set("routing.default_complexity", "medium"),
        "routing.default_complexity",
        "simple, complex",
    ),
    (
        "empty keyword",
        _set("routing.classifier.complex_keywords", ["ok", " "]),
        "routing.classifier.complex_keywords[1]",
        "empty",
    ),
    (
        "long_prompt_chars",
        _set("routing.classifier.long_prompt_chars", 0),
        "routing.classifier.long_prompt_chars",
        ">= 1",
    ),
    (
        "code_lines_complex",
        _set("routing.classifier.code_lines_complex", 0),
        "routing.classifier.code_lines_complex",
        ">= 1",
    ),
    # auth
    ("auth no keys", _set("auth", {"keys": []}), "auth.keys", "no keys"),
    ("auth keys missing", _set("auth", {"admin_key": "x"}), "auth.keys", "required"),
    (
        "empty api key",
        _set("auth", {"keys": [{"key": "", "name": "n"}]}),
        "auth.keys[0].key",
        "non-empty",
    ),
    (
        "duplicate api key",
        _set("auth", {"keys": [{"key": "k", "name": "a"}, {"key": "k", "name": "b"}]}),
        "auth.keys[1].key",
        "auth.keys[0]",
    ),
    (
        "duplicate key name",
        _set("auth", {"keys": [{"key": "k1", "name": "a"}, {"key": "k2", "name": "a"}]}),
        "auth.keys[1].name",
        "duplicate",
    ),
    (
        "key priority",
        _set("auth", {"keys": [{"key": "k", "name": "n", "priority": "top"}]}),
        "auth.keys[0].priority",
        "high, low",
    ),
    (
        "key rpm",
        _set("auth", {"keys": [{"key": "k", "name": "n", "rpm": 0}]}),
        "auth.keys[0].rpm",
        ">= 1",
    ),
    (
        "key tpm",
        _set("auth", {"keys": [{"key": "k", "name": "n", "tpm": -1}]}),
        "auth.keys[0].tpm",
        ">= 1",
    ),
    (
        "key models",
        _set("auth", {"keys": [{"key": "k", "name": "n", "models": ["lite", "nope"]}]}),
        "auth.keys[0].models[1]",
        "unknown model alias",
    ),
    (
        "key typo",
        _set("auth", {"keys": [{"key": "k", "name": "n", "rmp": 1}]}),
        "auth.keys[0].rmp",
        "did you mean `rpm`",
    ),
    (
        "admin equals client",
        _set("auth", {"keys": [{"key": "k", "name": "n"}], "admin_key": "k"}),
        "auth.admin_key",
        "differ",
    ),
    (
        "admin empty",
        _set("auth", {"keys": [{"key": "k", "name": "n"}], "admin_key": ""}),
        "auth.admin_key",
        "non-empty",
    ),
]


@pytest.mark.parametrize(
    ("mutate", "path", "fragment"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_validation_names_the_field(mutate: Mutation, path: str, fragment: str) -> None:
    d = minimal()
    mutate(d)
    err = error(d)
    assert err.errors == [err], err  # one mistake, one error: no noise from other rules
    assert err.path == path, err
    assert fragment in err.reason, err
    assert str(err) == f"{path}: {err.reason}"


def test_validation_cases_each_break_a_valid_config() -> None:
    # Guard against the base config itself being the thing that fails.
    assert load(minimal()).pools.keys() == {"light", "heavy"}


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("pools: [\n  a: 1\n", "line "),
        ("pools:\n  light:\n\tinstances: []\n", "line 3, column 1"),
        ("listen: {port: 1}\nlisten: {port: 2}\n", "duplicate key 'listen'"),
        ("a: !!python/object:os.system {}\n", "line 1"),
    ],
)
def test_yaml_errors_give_line_and_column(text: str, fragment: str) -> None:
    err = error(text)
    assert err.path == ""
    assert "invalid YAML" in err.reason
    assert fragment in err.reason


def test_duplicate_key_reports_the_second_occurrence() -> None:
    err = error("listen: {port: 1}\nseed: 3\nlisten: {port: 2}\n")
    assert "line 3, column 1" in err.reason


def test_merge_keys_may_be_overridden() -> None:
    text = MINIMAL + "listen:\n  <<: {host: 0.0.0.0, port: 1}\n  port: 2\n"
    assert load(text).listen == Listen(host="0.0.0.0", port=2)


@pytest.mark.parametrize("text", ["", "   \n", "# only a comment\n"])
def test_empty_file(text: str) -> None:
    err = error(text)
    assert "empty" in err.reason


@pytest.mark.parametrize("text", ["- a\n- b\n", "just a string\n", "42\n"])
def test_top_level_must_be_a_mapping(text: str) -> None:
    err = error(text)
    assert "mapping" in err.reason


# ---------------------------------------------------------------------------------------------
# Secrets


def _secret_config() -> dict[str, Any]:
    d = minimal()
    inst = d["pools"]["heavy"]["instances"][0]
    inst["api_key"] = "${UPSTREAM_KEY}"
    inst["headers"] = {"X-Api-Key": CANARY}
    d["auth"] = {
        "keys": [{"key": CANARY + "-client", "name": "free", "priority": "batch", "rpm": 60}],
        "admin_key": CANARY + "-admin",
    }
    d["models"]["judge"] = {"route": "auto"}
    d["routing"] = {"complexity": {"simple": "light", "complex": "heavy"}}
    return d


def test_secrets_are_masked_in_repr_and_describe() -> None:
    cfg = load(_secret_config(), env={"UPSTREAM_KEY": CANARY})
    inst = cfg.pools["heavy"].instances[0]
    assert inst.api_key == CANARY  # the value is there for the forwarder ...
    assert cfg.auth is not None
    outputs = [
        repr(cfg),
        str(cfg),
        repr(inst),
        repr(cfg.auth),
        repr(cfg.auth.keys[0]),
        repr(inst.__rich_repr__()),
        repr(cfg.auth.__rich_repr__()),
        repr(cfg.auth.keys[0].__rich_repr__()),
        describe(cfg),
    ]
    for text in outputs:  # ... and nowhere else
        assert "CANARY" not in text, text
    assert "api_key='***'" in repr(inst)
    assert "X-Api-Key" in repr(inst)


def test_proxy_credentials_are_masked_in_repr_and_describe() -> None:
    d = _secret_config()
    d["pools"]["heavy"]["instances"][0]["proxy"] = f"http://user:{CANARY}@proxy.internal:3128"
    cfg = load(d, env={"UPSTREAM_KEY": CANARY})
    inst = cfg.pools["heavy"].instances[0]
    assert inst.proxy == f"http://user:{CANARY}@proxy.internal:3128"
    for text in (repr(cfg), repr(inst), repr(inst.__rich_repr__()), describe(cfg)):
        assert "CANARY" not in text and "proxy.internal" not in text, text
    assert "proxy='***'" in repr(inst)


def test_secrets_stay_plain_strings_for_the_code_that_sends_them() -> None:
    cfg = load(_secret_config(), env={"UPSTREAM_KEY": CANARY})
    inst = cfg.pools["heavy"].instances[0]
    assert cfg.auth is not None
    for value in (inst.api_key, inst.headers["X-Api-Key"], cfg.auth.keys[0].key):
        assert type(value) is str
    assert f"Bearer {inst.api_key}" == f"Bearer {CANARY}"
    assert str(cfg.auth.admin_key) == CANARY + "-admin"
    assert CANARY in msgspec.json.encode(cfg).decode()


def test_masked_hides_exactly_the_secret_fields() -> None:
    inst = InstanceSpec(
        name="n",
        url="http://h",
        model="m",
        api_key="k",
        max_concurrency=1,
        headers={"X-Key": "v"},
        tls=TlsSpec(server_name="h"),
        proxy="http://u:p@h:1",
    )
    assert masked(inst) == [
        ("name", "n"),
        ("url", "http://h"),
        ("model", "m"),
        ("api_key", MASK),
        ("max_concurrency", 1),
        ("adaptive_concurrency", False),
        ("provider", "openai"),
        ("headers", {"X-Key": MASK}),
        ("tls", TlsSpec(server_name="h")),
        ("proxy", MASK),
    ]
    key = ApiKey(key="k", name="n", models=["a"])
    assert dict(masked(key)) == {
        "key": MASK,
        "name": "n",
        "priority": None,
        "rpm": None,
        "tpm": None,
        "models": ["a"],
        "routes": None,
        "slo_ttft_ms": None,
        "slo_tpot_ms": None,
    }
    assert dict(masked(Auth(keys=[key], admin_key="a", metrics_key="m"))) == {
        "keys": [key],
        "admin_key": MASK,
        "metrics_key": MASK,
        "public_metrics": False,
    }
    # An unset secret shows as unset; a struct without secrets keeps the usual repr.
    assert dict(masked(Auth(keys=[])))["admin_key"] is None
    assert repr(Listen()) == "Listen(host='127.0.0.1', port=8080)"
    assert repr(Auth(keys=[key])) == (
        "Auth(keys=[ApiKey(key='***', name='n', priority=None, rpm=None, tpm=None, "
        "models=['a'], routes=None, slo_ttft_ms=None, slo_tpot_ms=None)], admin_key=None, "
        "metrics_key=None, public_metrics=False)"
    )


def test_describe_shows_the_routing_table() -> None:
    cfg = load(_secret_config(), env={"UPSTREAM_KEY": CANARY})
    text = describe(cfg)
    assert "auto → simple:light / complex:heavy" in text
    assert "lite" in text and "pool light" in text
    for name, url in (("a", "http://127.0.0.1:9001/v1"), ("c", "https://api.example.com/v1")):
        assert name in text and url in text
    assert "model=big" in text
    assert "max_concurrency=8" in text
    assert "provider=openai" in text
    assert "api_key: set" in text and "api_key: unset" in text
    assert "admin_key: set" in text
    assert "free: key: set" in text
    assert "weighted" in text and "least_connections" in text and "failure_threshold=3" in text


def test_describe_shows_fallback_chains() -> None:
    cfg = parse_config(SPEC_EXAMPLE, env=SPEC_ENV)
    text = describe(cfg)
    assert "judge-pro" in text and "pool heavy (fallback → light)" in text
    assert "fallback=light" in text
    for value in SPEC_ENV.values():
        assert value not in text


def test_describe_of_a_minimal_config_says_auth_is_off() -> None:
    assert "auth        off" in describe(load(MINIMAL))


SECRET_ERRORS: list[tuple[str, Mutation, str]] = [
    ("api_key wrong type", _set(f"{H0}.api_key", [CANARY]), "pools.heavy.instances[0].api_key"),
    (
        "api_key control char",
        _set(f"{H0}.api_key", CANARY + "\n"),
        "pools.heavy.instances[0].api_key",
    ),
    (
        "api_key malformed ref",
        _set(f"{H0}.api_key", CANARY + "${"),
        "pools.heavy.instances[0].api_key",
    ),
    (
        "url credentials",
        _set(f"{H0}.url", f"https://user:{CANARY}@api.example.com/v1"),
        "pools.heavy.instances[0].url",
    ),
    (
        "url with secret query",
        _set(f"{H0}.url", f"https://api.example.com/v1?key={CANARY}"),
        "pools.heavy.instances[0].url",
    ),
    (
        "header value",
        _set(f"{H0}.headers", {"X-Api-Key": CANARY + "\r\n"}),
        "pools.heavy.instances[0].headers.X-Api-Key",
    ),
    (
        "header wrong type",
        _set(f"{H0}.headers", {"X-Api-Key": [CANARY]}),
        "pools.heavy.instances[0].headers.X-Api-Key",
    ),
    (
        "duplicate client key",
        _set("auth", {"keys": [{"key": CANARY, "name": "a"}, {"key": CANARY, "name": "b"}]}),
        "auth.keys[1].key",
    ),
    (
        "client key wrong type",
        _set("auth", {"keys": [{"key": {"v": CANARY}, "name": "a"}]}),
        "auth.keys[0].key",
    ),
    (
        "client key spaces",
        _set("auth", {"keys": [{"key": f" {CANARY} ", "name": "a"}]}),
        "auth.keys[0].key",
    ),
    (
        "admin equals client",
        _set("auth", {"keys": [{"key": CANARY, "name": "a"}], "admin_key": CANARY}),
        "auth.admin_key",
    ),
]


@pytest.mark.parametrize(
    ("mutate", "path"), [c[1:] for c in SECRET_ERRORS], ids=[c[0] for c in SECRET_ERRORS]
)
def test_errors_never_contain_secrets(mutate: Mutation, path: str) -> None:
    d = minimal()
    mutate(d)
    err = error(d)
    assert err.errors == [err], err
    assert err.path == path
    assert "CANARY" not in str(err)
    assert all("CANARY" not in str(a) for a in err.args)


def test_yaml_errors_never_quote_the_offending_line() -> None:
    text = MINIMAL + f'secret: "{CANARY}\n  broken: [\n'
    err = error(text)
    assert "invalid YAML" in err.reason
    assert "CANARY" not in str(err)


def test_env_value_of_a_secret_is_not_in_type_errors() -> None:
    d = minimal()
    d["pools"]["heavy"]["instances"][0]["max_concurrency"] = "${SLOTS}"
    err = error(d, env={"SLOTS": CANARY})
    assert err.path == "pools.heavy.instances[0].max_concurrency"
    assert "CANARY" not in str(err)


# ---------------------------------------------------------------------------------------------
# The structs themselves


def test_structs_are_usable_directly() -> None:
    inst = InstanceSpec(name="x", url="http://h", model="m", max_concurrency=1)
    assert inst.api_key is None and inst.headers == {}
    key = ApiKey(key="k", name="n")
    assert key.priority is None and key.models is None
    assert Auth(keys=[key]).admin_key is None
    assert Routing().classifier == Classifier()
    assert msgspec.structs.replace(Scheduler(), policy="strict").high == Scheduler().high


def test_round_trip_through_builtins() -> None:
    cfg = parse_config(SPEC_EXAMPLE, env=SPEC_ENV)
    data = msgspec.to_builtins(cfg)
    again = load(copy.deepcopy(data))
    assert again == cfg


# ---------------------------------------------------------------------------------------------
# Every error of a file in one run (SPEC §8, §18)


def _paths(err: ConfigError) -> list[str]:
    return [e.path for e in err.errors]


def test_five_mistakes_in_five_sections_are_five_errors() -> None:
    d = minimal()
    d["scheduler"] = {"high": {"capacity": -5}}  # a negative capacity
    d["pools"]["light"]["spil_to"] = "heavy"  # an unknown field in a pool
    del d["pools"]["heavy"]["instances"][0]["url"]  # an instance without `url`
    d["models"]["judge"] = {"pool": "hevy"}  # an alias naming a missing pool
    d["balancer"] = "sticky"  # a bad balancer name
    err = error(d)
    assert sorted(_paths(err)) == sorted(
        [
            "scheduler.high.capacity",
            "pools.light.spil_to",
            "pools.heavy.instances[0].url",
            "models.judge.pool",
            "balancer",
        ]
    ), err
    reasons = {e.path: e.reason for e in err.errors}
    assert ">= 1" in reasons["scheduler.high.capacity"]
    assert "did you mean `spill_to`" in reasons["pools.light.spil_to"]
    assert "required" in reasons["pools.heavy.instances[0].url"]
    assert "did you mean 'heavy'" in reasons["models.judge.pool"]
    assert "least_connections" in reasons["balancer"]
    # One exception for start and reload: no single path, and a message listing them all.
    assert err.path == ""
    assert str(err).startswith("5 errors:")
    assert all(f"{e.path}: {e.reason}" in str(err) for e in err.errors)


def test_a_mistake_in_one_instance_does_not_hide_anothers() -> None:
    d = minimal()
    light = d["pools"]["light"]["instances"]
    light[0]["max_concurrency"] = 0  # fails decoding
    light[0]["provider"] = "anthropic"  # ... in another field too
    light[1]["url"] = "ftp://10.0.0.5/v1"  # decodes, breaks a cross-field rule
    d["pools"]["heavy"]["instances"][0]["name"] = "b"  # a duplicate of light's second
    d["pools"]["heavy"]["instances"].append({**_instance("c2"), "colour": "red"})
    err = error(d)
    assert _paths(err) == [
        "pools.light.instances[0].max_concurrency",
        "pools.light.instances[0].provider",
        "pools.heavy.instances[1].colour",
        "pools.light.instances[1].url",
        "pools.heavy.instances[0].name",
    ], err


def test_every_finding_of_the_cross_field_rules() -> None:
    d = minimal()
    d["health"] = {"ejection_ms": 20_000, "max_ejection_ms": 10_000, "probe": {"path": "x"}}
    d["timeouts"] = {"connect_ms": 700_000, "stream_idle_ms": 700_000}
    d["pools"]["light"]["fallback"] = "nowhere"
    d["pools"]["heavy"]["instances"][0]["url"] = "http://u:p@10.0.0.5/v1"
    d["models"]["judge"] = {"route": "auto"}
    d["auth"] = {"keys": [{"key": "k", "name": "a"}, {"key": "k", "name": "a", "models": ["x"]}]}
    err = error(d)
    assert _paths(err) == [
        "health.max_ejection_ms",
        "health.probe.path",
        "timeouts.connect_ms",
        "timeouts.stream_idle_ms",
        "pools.light.fallback",
        "pools.heavy.instances[0].url",
        # `route: auto` needs both pools named: each missing field is its own error
        "routing.complexity.simple",
        "routing.complexity.complex",
        "auth.keys[1].key",
        "auth.keys[1].name",
        "auth.keys[1].models[0]",
    ], err


def test_rules_that_need_a_failed_section_are_skipped() -> None:
    """No noise: what depends on a part that did not decode is not judged."""
    # cluster.lease_ms fails: renew_ms (checked against the lease) is not reported
    d = minimal()
    d["cluster"] = {"redis_url": "redis://h:1", "lease_ms": 0}
    assert _paths(error(d)) == ["cluster.lease_ms"]
    # `pools` is not a mapping: nothing is said about the aliases naming pools
    d = minimal()
    d["pools"] = ["light"]
    assert _paths(error(d)) == ["pools"]
    # an unset variable is one error, not also a type error where it was used
    d = minimal()
    d["pools"]["light"]["instances"][0]["max_concurrency"] = "${SLOTS}"
    d["pools"]["heavy"]["instances"][0]["api_key"] = "${KEY}"
    d["default_priority"] = "urgent"
    err = error(d)
    assert _paths(err) == [
        "pools.light.instances[0].max_concurrency",
        "pools.heavy.instances[0].api_key",
        "default_priority",
    ], err
    assert "SLOTS" in err.errors[0].reason and "KEY" in err.errors[1].reason
    # an alias that failed does not make its references look unknown
    d = minimal()
    d["models"]["lite"] = {"pool": "light", "colour": "red"}
    d["auth"] = {"keys": [{"key": "k", "name": "a", "models": ["lite"]}]}
    assert _paths(error(d)) == ["models.lite.colour"]
    # a pool that failed still exists for the aliases and fallbacks naming it
    d = minimal()
    d["pools"]["heavy"]["colour"] = "red"
    d["pools"]["light"]["fallback"] = "heavy"
    assert _paths(error(d)) == ["pools.heavy.colour"]


def test_auto_alias_without_routing_names_both_fields() -> None:
    d = minimal()
    d["models"]["judge"] = {"route": "auto"}
    err = error(d)
    assert _paths(err) == ["routing.complexity.simple", "routing.complexity.complex"]
    assert all("models.judge" in e.reason for e in err.errors)


def test_every_env_error_in_one_run() -> None:
    with pytest.raises(ConfigError) as info:
        expand_env({"a": "${A}", "b": ["${", "ok", "${B}"]}, {})
    assert _paths(info.value) == ["a", "b[0]", "b[2]"]


def test_many_errors_never_contain_secrets() -> None:
    d = _secret_config()
    d["pools"]["heavy"]["instances"][0]["url"] = f"https://user:{CANARY}@api.example.com/v1"
    d["pools"]["heavy"]["instances"][0]["headers"] = {"X-Api-Key": CANARY + "\r\n"}
    d["pools"]["light"]["instances"][0]["api_key"] = [CANARY]
    d["auth"]["keys"].append({"key": CANARY + "-client", "name": "other"})
    d["auth"]["admin_key"] = CANARY + "-client"
    err = error(d, env={"UPSTREAM_KEY": CANARY})
    assert len(err.errors) == 5, err
    assert "CANARY" not in str(err)
    assert all("CANARY" not in str(e) for e in err.errors)


_ODD_VALUES = st.recursive(
    st.sampled_from(
        [None, 0, -1, 2**70, 1.5, "", "x", "light", "${UNSET}", "${", "http://h:1/v1", True]
    ),
    lambda inner: (
        st.lists(inner, max_size=2)
        | st.dictionaries(
            st.sampled_from(["pool", "url", "keys", "high", "colour"]), inner, max_size=2
        )
    ),
    max_leaves=4,
)


def _places(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every path into `node`'s mappings and lists, `()` included."""
    out = [prefix]
    items = (
        node.items()
        if isinstance(node, dict)
        else enumerate(node)
        if isinstance(node, list)
        else ()
    )
    for key, value in items:
        out += _places(value, (*prefix, key))
    return out


@given(st.data())
def test_any_broken_config_gives_errors_never_a_crash(data: st.DataObject) -> None:
    """Whatever is wrong, and wherever: a `ConfigError` listing at least one error, each with
    a reason (never another exception from the collecting decoder or the partial checks)."""
    d = minimal()
    for _ in range(data.draw(st.integers(1, 3))):
        place = data.draw(st.sampled_from([p for p in _places(d) if p]))
        *parents, last = place
        node: Any = d
        for part in parents:
            node = node[part]
        node[last] = data.draw(_ODD_VALUES)
    try:
        load(d)
    except ConfigError as err:
        assert err.errors and all(e.reason and e.errors == [e] for e in err.errors)
        assert len({(e.path, e.reason) for e in err.errors}) == len(err.errors)  # no repeats
