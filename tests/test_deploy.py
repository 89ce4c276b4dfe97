"""The operator's files in deploy/: the Grafana dashboard and the Prometheus alert rules.

Every PromQL expression in them is checked against a real gateway's `/metrics` (each metric
it names is exposed, each label it selects or groups by exists on them), and, where `promtool`
is installed (Debian package `prometheus`), parsed by Prometheus itself; the alerts are also
unit-tested with `promtool test rules` on synthetic series.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from redis_fixture import REDIS_SERVER, RedisServer
from support import GatewayFactory, MockFactory, chat, pool_config

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "deploy" / "grafana" / "gateway.json"
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None,
    reason="promtool not installed (Debian: apt-get install --no-install-recommends prometheus)",
)

#: SPEC §9: what an operator must find on the dashboard.
SPEC_METRICS = {
    "gateway_requests_total",
    "gateway_queue_depth",
    "gateway_queue_wait_seconds_bucket",
    "gateway_instance_in_flight",
    "gateway_instance_state",
    "gateway_instance_ejections_total",
    "gateway_upstream_latency_seconds_bucket",
    "gateway_time_to_first_byte_seconds_bucket",
    "gateway_retries_total",
    "gateway_rejections_total",
    "gateway_tokens_total",
}

#: Labels a scrape adds (`instance` is the target: the gateway replica) and the histogram's.
TARGET_LABELS = {"job", "instance"}
#: Prometheus stores a scraped label that collides with a target label as `exported_<name>`:
#: the gateway's own `instance` (the upstream instance) becomes `exported_instance`.
EXPORTED = {"exported_instance": "instance"}

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_METRIC = re.compile(r"\b(gateway_[A-Za-z0-9_]+)\b")
_SELECTOR = re.compile(r"\b(gateway_[A-Za-z0-9_]+)\s*\{([^}]*)\}")
_MATCHER = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)\s*\"")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring)\s*\(([^)]*)\)")
_GRAFANA_VARS = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "1h"}


# ---------------------------------------------------------------------------------------------
# The files.


def _dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


def _panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))


def dashboard_exprs() -> list[tuple[str, str]]:
    """(where, PromQL) of every panel target and every query variable."""
    dash = _dashboard()
    out = [
        (f"panel {p.get('title')!r} {t.get('refId')}", t["expr"])
        for p in _panels(dash["panels"])
        for t in p.get("targets", [])
    ]
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            q = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            m = re.fullmatch(r"label_values\((.*),\s*([A-Za-z_]\w*)\)", q.strip())
            assert m is not None, f"variable {var['name']}: {q}"
            out.append((f"variable {var['name']}", m.group(1)))
    return out


def alert_rules() -> list[dict[str, Any]]:
    data = yaml.safe_load(ALERTS.read_text())
    return [rule for group in data["groups"] for rule in group["rules"]]


def grafana_to_promql(expr: str) -> str:
    """A dashboard expression as plain PromQL: Grafana's variables substituted."""
    for var, value in _GRAFANA_VARS.items():
        expr = expr.replace(var, value)
    return re.sub(r"\$\{?[A-Za-z_]\w*\}?", ".*", expr)


# ---------------------------------------------------------------------------------------------
# The dashboard's shape.


def test_dashboard_is_an_importable_grafana_dashboard() -> None:
    dash = _dashboard()
    assert dash["schemaVersion"] >= 36
    assert dash["title"] and dash["uid"] and len(dash["uid"]) <= 40
    assert dash["id"] is None  # an import creates its own
    (ds_input,) = [i for i in dash["__inputs"] if i["name"] == "DS_PROMETHEUS"]
    assert ds_input["type"] == "datasource" and ds_input["pluginId"] == "prometheus"
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource"
    assert variables["DS_PROMETHEUS"]["query"] == "prometheus"
    ids = [p["id"] for p in _panels(dash["panels"])]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    cells: set[tuple[int, int]] = set()
    for p in _panels(dash["panels"]):
        g = p["gridPos"]
        assert g["x"] >= 0 and g["w"] >= 1 and g["x"] + g["w"] <= 24, p["title"]
        mine = {
            (x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])
        }
        assert not cells & mine, f"panel {p['title']!r} overlaps another"
        cells |= mine
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}, p["title"]
        assert p["targets"], p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), p["title"]
        for t in p["targets"]:
            assert t["datasource"]["uid"] == "${DS_PROMETHEUS}"
            assert t["expr"].strip(), p["title"]
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            assert var["datasource"]["uid"] == "${DS_PROMETHEUS}"


def test_dashboard_covers_the_spec_metrics() -> None:
    named = {m for _, expr in dashboard_exprs() for m in _METRIC.findall(_STRING.sub("", expr))}
    assert named >= SPEC_METRICS, SPEC_METRICS - named
    titles = " | ".join(p.get("title", "") for p in _panels(_dashboard()["panels"])).lower()
    for topic in (
        "status code",
        "queue depth",
        "queue wait",
        "in-flight",
        "state",
        "ejections",
        "retries",
        "rejections by reason",
        "tokens",
        # issue 21: what an operator bills and throttles by, and what breaks quietly
        "by key",
        "per key",
        "redis",
        "degraded",
        "reloads",
        "batch lines",
        "worker restarts",
    ):
        assert topic in titles, topic
    # the alerts of the same
    assert {
        "GatewayConfigReloadFailed",
        "GatewayRedisUnreachable",
        "GatewayClusterDegraded",
        "GatewayBatchLinesFailing",
        "GatewayWorkersRestarting",
    } <= {r["alert"] for r in alert_rules()}
    named = {m for _, expr in dashboard_exprs() for m in _METRIC.findall(_STRING.sub("", expr))}
    assert {
        "gateway_key_requests_total",
        "gateway_key_tokens_total",
        "gateway_cluster_redis_up",
        "gateway_cluster_degraded",
        "gateway_config_reloads_total",
        "gateway_batch_lines_total",
        "gateway_worker_restarts_total",
    } <= named


def test_alert_rules_are_well_formed() -> None:
    rules = alert_rules()
    names = [r["alert"] for r in rules]
    assert len(names) == len(set(names))
    assert {
        "GatewayPoolAllInstancesEjected",
        "GatewayQueueFullRejections",
        "GatewayRealtimeQueueWaitHigh",
    } <= set(names)
    for r in rules:
        assert r["expr"].strip() and re.fullmatch(r"\d+[smh]", r["for"]), r["alert"]
        assert r["labels"]["severity"] in ("critical", "warning", "info"), r["alert"]
        assert r["annotations"]["summary"] and r["annotations"]["description"], r["alert"]


# ---------------------------------------------------------------------------------------------
# Every expression against a real gateway's /metrics.


def _families(text: str, into: dict[str, set[str]]) -> dict[str, set[str]]:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            into.setdefault(sample.name, set()).update(sample.labels)
    return into


async def _cluster_metrics(
    tmp_path: Path, mocks: MockFactory, gateway_factory: GatewayFactory
) -> str:
    """/metrics of a replica in cluster mode (SPEC §13: Redis up, degraded, leases)."""
    assert REDIS_SERVER is not None, "redis-server is not installed (CI installs Debian's)"
    redis = RedisServer(tmp_path)
    await redis.start()
    try:
        up = await mocks()
        gw = await gateway_factory(
            {
                "pools": {"p": pool_config(up)},
                "models": {"m": {"pool": "p"}},
                "auth": {"keys": [{"key": "sk-deploy-1", "name": "k"}], "metrics_key": "mk-1"},
                "cluster": {"redis_url": redis.url, "lease_ms": 1500, "renew_ms": 150},
            }
        )
        headers = {"Authorization": "Bearer mk-1"}
        async with gw.session.get(gw.url + "/metrics", headers=headers) as resp:
            assert resp.status == 200
            return await resp.text()
    finally:
        redis.stop()


async def _workers_metrics(tmp_path: Path, mocks: MockFactory) -> str:
    """/metrics of `gateway serve --workers 2` (SPEC §12: gateway_worker_restarts_total)."""
    up = await mocks()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    path = tmp_path / "workers.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "listen": {"host": "127.0.0.1", "port": port},
                "shutdown": {"drain_delay_ms": 0, "drain_timeout_ms": 5000},
                "health": {"probe": {"enabled": False}},
                "pools": {"p": pool_config(up)},
                "models": {"m": {"pool": "p"}},
            }
        )
    )
    args = ["-m", "gateway.cli", "serve", "--config", str(path), "--workers", "2"]
    proc = await asyncio.create_subprocess_exec(
        sys.executable, *args, "--no-access-log", stdout=asyncio.subprocess.PIPE
    )
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 60)
        assert b"(2 workers)" in line, line
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"http://127.0.0.1:{port}/metrics") as resp,
        ):
            assert resp.status == 200
            return await resp.text()
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), 20)
            except TimeoutError:
                proc.kill()
                await proc.wait()


@pytest.fixture
async def exposed(
    tmp_path: Path, mocks: MockFactory, gateway_factory: GatewayFactory
) -> dict[str, set[str]]:
    """Sample name → label names of a gateway that served traffic of every kind: successes
    (tokens), a retried request (retries), a failing pool (a 502 and ejections), an unknown
    model (a rejection), a stream and a client key (per-key counters); plus what only a
    replica in cluster mode (SPEC §13) and `--workers` (SPEC §12) expose."""
    good, bad, broken = (
        await mocks(),
        await mocks(fail_rate=1.0, fail_status=500),
        await mocks(fail_rate=1.0, fail_status=500),
    )
    gw = await gateway_factory(
        {
            "pools": {"p": pool_config(good, bad), "q": pool_config(broken)},
            "models": {"m": {"pool": "p"}, "broken": {"pool": "q"}},
            "balancer": "round_robin",
            "retries": {"max_attempts": 2},
            "health": {"failure_threshold": 1, "ejection_ms": 60_000, "max_ejection_ms": 60_000},
            "auth": {"keys": [{"key": "sk-deploy-0", "name": "team"}], "admin_key": "adm-0"},
        }
    )
    # With a latency objective (SPEC §17), so the goodput counter shows too.
    key = {"Authorization": "Bearer sk-deploy-0", "x-slo-ttft-ms": "60000"}
    for body in (chat(), chat(), chat(stream=True), chat(model="broken"), chat(model="nope")):
        async with await gw.post("/v1/chat/completions", body, headers=key) as resp:
            await resp.read()
    async with gw.session.get(
        gw.url + "/metrics", headers={"Authorization": "Bearer adm-0"}
    ) as resp:
        assert resp.status == 200
        text = await resp.text()
    out = _families(text, {})
    # the traffic above made every label-bearing family show
    assert {"gateway_retries_total", "gateway_tokens_total", "gateway_key_tokens_total"} <= set(out)
    _families(await _cluster_metrics(tmp_path, mocks, gateway_factory), out)
    _families(await _workers_metrics(tmp_path, mocks), out)
    assert {"gateway_cluster_degraded", "gateway_worker_restarts_total"} <= set(out)
    return out


def _check_expr(where: str, expr: str, exposed: dict[str, set[str]]) -> list[str]:
    """What is wrong with one expression: metric names not exposed, labels not on them."""
    problems: list[str] = []
    bare = _STRING.sub('""', expr)
    names = set(_METRIC.findall(bare))
    if not names:
        problems.append(f"{where}: names no gateway metric: {expr}")
    for name in sorted(names - set(exposed)):
        hint = [n for n in exposed if n.startswith(name) or name.startswith(n)]
        problems.append(f"{where}: {name} is not exposed (close: {hint})")

    def known(label: str, metrics: set[str]) -> bool:
        label = EXPORTED.get(label, label)
        return label in TARGET_LABELS or any(label in exposed.get(m, ()) for m in metrics)

    for name, matchers in _SELECTOR.findall(bare):
        for label in _MATCHER.findall(matchers):
            if name in exposed and not known(label, {name}):
                problems.append(f"{where}: {name} has no label {label!r}")
    for group in _GROUPING.findall(bare):
        for label in filter(None, (g.strip() for g in group.split(","))):
            if not known(label, names):
                problems.append(f"{where}: no metric of the expression has label {label!r}")
    return problems


async def test_every_dashboard_expression_names_exposed_metrics_and_labels(
    exposed: dict[str, set[str]],
) -> None:
    problems = [p for where, expr in dashboard_exprs() for p in _check_expr(where, expr, exposed)]
    assert not problems, "\n".join(problems)


async def test_every_alert_expression_names_exposed_metrics_and_labels(
    exposed: dict[str, set[str]],
) -> None:
    problems = [p for r in alert_rules() for p in _check_expr(r["alert"], r["expr"], exposed)]
    assert not problems, "\n".join(problems)


def test_the_expression_check_catches_mistakes() -> None:
    exposed = {
        "gateway_requests_total": {"pool", "priority", "code"},
        "gateway_queue_wait_seconds_bucket": {"pool", "priority", "le"},
        "gateway_instance_in_flight": {"pool", "instance"},
    }
    ok = 'sum by (pool, le) (rate(gateway_queue_wait_seconds_bucket{priority="high"}[5m]))'
    assert _check_expr("x", ok, exposed) == []
    assert (
        _check_expr("x", "sum by (exported_instance) (gateway_instance_in_flight)", exposed) == []
    )
    assert _check_expr("x", "rate(gateway_requests[5m])", exposed)  # the family, not the sample
    assert _check_expr("x", "gateway_queue_wait_seconds", exposed)  # a histogram's base name
    assert _check_expr("x", 'gateway_requests_total{reason="x"}', exposed)
    assert _check_expr("x", "sum by (instanse) (gateway_instance_in_flight)", exposed)
    assert _check_expr("x", "vector(1)", exposed)
    # a label value is not a metric name
    assert _check_expr("x", 'gateway_requests_total{code="gateway_nope"}', exposed) == []


# ---------------------------------------------------------------------------------------------
# promtool: Prometheus's own parser and rule unit tests.


def _promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run(
        [PROMTOOL, *args], cwd=cwd, capture_output=True, text=True, timeout=120, check=False
    )


@needs_promtool
def test_promtool_checks_the_alert_rules(tmp_path: Path) -> None:
    out = _promtool("check", "rules", str(ALERTS), cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr


@needs_promtool
def test_promtool_parses_every_dashboard_expression(tmp_path: Path) -> None:
    """Each expression (Grafana variables substituted) as a recording rule: `promtool check
    rules` parses them with Prometheus's own PromQL parser."""
    rules = [
        {"record": f"dashboard:expr_{i}", "expr": grafana_to_promql(expr)}
        for i, (_, expr) in enumerate(dashboard_exprs())
    ]
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    out = _promtool("check", "rules", str(path), cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr


def _series(name: str, values: str, **labels: str) -> dict[str, str]:
    base = {"job": "gw", "instance": "gw-0:8080"} | labels
    text = ", ".join(f'{k}="{v}"' for k, v in base.items())
    return {"series": f"{name}{{{text}}}", "values": values}


def _alert(**labels: str) -> dict[str, Any]:
    return {"exp_labels": {"job": "gw", "instance": "gw-0:8080"} | labels}


ALERT_TESTS: list[dict[str, Any]] = [
    {
        # pool light: both instances unhealthy the whole time; heavy: one still healthy
        "interval": "1m",
        "input_series": [
            _series(
                "gateway_instance_state",
                "0x15",
                pool="light",
                exported_instance="a",
                state="healthy",
            ),
            _series(
                "gateway_instance_state",
                "0x15",
                pool="light",
                exported_instance="b",
                state="healthy",
            ),
            _series(
                "gateway_instance_state",
                "1x15",
                pool="heavy",
                exported_instance="c",
                state="healthy",
            ),
            _series(
                "gateway_instance_state",
                "0x15",
                pool="heavy",
                exported_instance="d",
                state="healthy",
            ),
        ],
        "alert_rule_test": [
            {"eval_time": "1m", "alertname": "GatewayPoolAllInstancesEjected", "exp_alerts": []},
            {
                "eval_time": "5m",
                "alertname": "GatewayPoolAllInstancesEjected",
                "exp_alerts": [_alert(pool="light", severity="critical")],
            },
        ],
    },
    {
        # 10 requests/s; on gw-0 1/s of them refused queue_full (10 %), none on gw-1
        "interval": "1m",
        "input_series": [
            _series("gateway_requests_total", "0+600x20", pool="p", priority="high", code="200"),
            _series("gateway_rejections_total", "0+60x20", reason="queue_full"),
            _series(
                "gateway_requests_total",
                "0+600x20",
                instance="gw-1:8080",
                pool="p",
                priority="high",
                code="200",
            ),
            _series("gateway_rejections_total", "0x20", instance="gw-1:8080", reason="queue_full"),
        ],
        "alert_rule_test": [
            {"eval_time": "3m", "alertname": "GatewayQueueFullRejections", "exp_alerts": []},
            {
                "eval_time": "12m",
                "alertname": "GatewayQueueFullRejections",
                "exp_alerts": [_alert(severity="warning")],
            },
        ],
    },
    {
        # realtime waits between 1 s and 2.5 s in pool light (p99 ≈ 2.49 s); fast in heavy;
        # slow batch (low) waits never alert
        "interval": "1m",
        "input_series": [
            _series(
                "gateway_queue_wait_seconds_bucket", "0x30", pool="light", priority="high", le="1"
            ),
            _series(
                "gateway_queue_wait_seconds_bucket",
                "0+100x30",
                pool="light",
                priority="high",
                le="2.5",
            ),
            _series(
                "gateway_queue_wait_seconds_bucket",
                "0+100x30",
                pool="light",
                priority="high",
                le="+Inf",
            ),
            _series(
                "gateway_queue_wait_seconds_bucket",
                "0+100x30",
                pool="heavy",
                priority="high",
                le="0.5",
            ),
            _series(
                "gateway_queue_wait_seconds_bucket",
                "0+100x30",
                pool="heavy",
                priority="high",
                le="+Inf",
            ),
            _series(
                "gateway_queue_wait_seconds_bucket", "0x30", pool="heavy", priority="low", le="60"
            ),
            _series(
                "gateway_queue_wait_seconds_bucket",
                "0+100x30",
                pool="heavy",
                priority="low",
                le="+Inf",
            ),
        ],
        "alert_rule_test": [
            {"eval_time": "5m", "alertname": "GatewayRealtimeQueueWaitHigh", "exp_alerts": []},
            {
                "eval_time": "20m",
                "alertname": "GatewayRealtimeQueueWaitHigh",
                "exp_alerts": [_alert(pool="light", severity="warning")],
            },
        ],
    },
    {
        # 10 requests/s, 1/s of them 502
        "interval": "1m",
        "input_series": [
            _series("gateway_requests_total", "0+540x20", pool="p", priority="high", code="200"),
            _series("gateway_requests_total", "0+60x20", pool="p", priority="high", code="502"),
        ],
        "alert_rule_test": [
            {
                "eval_time": "12m",
                "alertname": "GatewayHighErrorRate",
                "exp_alerts": [_alert(severity="warning")],
            },
            {"eval_time": "12m", "alertname": "GatewayQueueFullRejections", "exp_alerts": []},
        ],
    },
    {
        # gw-0's reload at 2m is refused (and stays so); gw-1 reloads fine
        "interval": "1m",
        "input_series": [
            _series("gateway_config_last_reload_success", "1 1 0x10"),
            _series("gateway_config_last_reload_success", "1x12", instance="gw-1:8080"),
        ],
        "alert_rule_test": [
            {"eval_time": "1m", "alertname": "GatewayConfigReloadFailed", "exp_alerts": []},
            {
                "eval_time": "5m",
                "alertname": "GatewayConfigReloadFailed",
                "exp_alerts": [_alert(severity="warning")],
            },
        ],
    },
    {
        # Redis gone from 2m on for gw-0 (degraded from 3m); gw-1 had a one-minute blip
        "interval": "1m",
        "input_series": [
            _series("gateway_cluster_redis_up", "1 1 0x15"),
            _series("gateway_cluster_degraded", "0 0 0 1x14"),
            _series("gateway_cluster_redis_up", "1 1 0 1x14", instance="gw-1:8080"),
            _series("gateway_cluster_degraded", "0x17", instance="gw-1:8080"),
        ],
        "alert_rule_test": [
            {
                "eval_time": "2m",
                "alertname": "GatewayRedisUnreachable",
                "exp_alerts": [],  # pending: a blip is not an alert
            },
            {
                "eval_time": "4m",
                "alertname": "GatewayRedisUnreachable",
                "exp_alerts": [_alert(severity="warning")],
            },
            {"eval_time": "6m", "alertname": "GatewayClusterDegraded", "exp_alerts": []},
            {
                "eval_time": "9m",
                "alertname": "GatewayClusterDegraded",
                "exp_alerts": [_alert(severity="critical")],
            },
        ],
    },
    {
        # 10 batch lines/s; on gw-0 1/s fail (10 %), on gw-1 1 in 100 (1 %)
        "interval": "1m",
        "input_series": [
            _series("gateway_batch_lines_total", "0+540x40", result="completed"),
            _series("gateway_batch_lines_total", "0+60x40", result="failed"),
            _series(
                "gateway_batch_lines_total", "0+594x40", instance="gw-1:8080", result="completed"
            ),
            _series("gateway_batch_lines_total", "0+6x40", instance="gw-1:8080", result="failed"),
        ],
        "alert_rule_test": [
            {"eval_time": "10m", "alertname": "GatewayBatchLinesFailing", "exp_alerts": []},
            {
                "eval_time": "25m",
                "alertname": "GatewayBatchLinesFailing",
                "exp_alerts": [_alert(severity="warning")],
            },
        ],
    },
    {
        # gw-0: a worker dies every minute from 2m to 5m; gw-1: one restart only
        "interval": "1m",
        "input_series": [
            _series("gateway_worker_restarts_total", "0 0 1 2 3 4 4x20"),
            _series("gateway_worker_restarts_total", "0 0 1x23", instance="gw-1:8080"),
        ],
        "alert_rule_test": [
            {"eval_time": "3m", "alertname": "GatewayWorkersRestarting", "exp_alerts": []},
            {
                "eval_time": "8m",
                "alertname": "GatewayWorkersRestarting",
                "exp_alerts": [_alert(severity="warning")],
            },
        ],
    },
]


@needs_promtool
def test_promtool_alerts_fire_when_they_should(tmp_path: Path) -> None:
    """`promtool test rules` on synthetic series. promtool compares annotations too, so the
    rules are tested without theirs (their templates are checked by `check rules` above)."""
    data = yaml.safe_load(ALERTS.read_text())
    for group in data["groups"]:
        for rule in group["rules"]:
            rule.pop("annotations", None)
    (tmp_path / "alerts.yml").write_text(yaml.safe_dump(data))
    (tmp_path / "alerts_test.yml").write_text(
        yaml.safe_dump(
            {"rule_files": ["alerts.yml"], "evaluation_interval": "1m", "tests": ALERT_TESTS}
        )
    )
    out = _promtool("test", "rules", "alerts_test.yml", cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
