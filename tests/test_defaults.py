"""Defaults are written once, in the Rust core: the config's defaults must equal them."""

from __future__ import annotations

from gateway._core import PoolConfig
from gateway.config import parse_config
from gateway.pool import core_config

FIELDS = (
    "policy",
    "high_capacity",
    "low_capacity",
    "high_weight",
    "low_weight",
    "high_max_wait_ms",
    "low_max_wait_ms",
    "max_consecutive_high",
    "max_low_wait_ms",
    "overflow_high_to_low",
    "balancer",
    "failure_threshold",
    "ejection_ms",
    "max_ejection_ms",
    "half_open_max_requests",
    "success_threshold",
    "probing",
)


def test_config_defaults_are_the_cores() -> None:
    """A config that sets nothing but its pools schedules exactly like the core's defaults
    (SPEC §8: "Every field shown has the default shown")."""
    cfg = parse_config(
        "pools: {p: {instances: [{name: a, url: 'http://127.0.0.1:1/v1', model: m, "
        "max_concurrency: 1}]}}\nmodels: {m: {pool: p}}\n",
        env={},
    )
    ours, core = core_config(cfg, cfg.pools["p"]), PoolConfig()
    assert {f: getattr(ours, f) for f in FIELDS} == {f: getattr(core, f) for f in FIELDS}
