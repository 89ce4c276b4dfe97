"""The redactor's knowledge of the config's secrets (SPEC §7)."""

from __future__ import annotations

from gateway.config import parse_config
from gateway.redact import Redactor, secrets_of

CONFIG = """
pools:
  p:
    instances:
      - {name: a, url: "http://127.0.0.1:1/v1", model: m, max_concurrency: 1,
         api_key: sk-upstream-key-1, proxy: "http://proxy-user:proxy-pass-1@proxy:3128"}
models:
  m: {pool: p}
cluster: {redis_url: "redis://redis-user:redis-pass-1@redis:6379/0", replica_id: r1}
"""


def test_the_credentials_inside_any_secret_url_are_secrets_of_their_own() -> None:
    secrets = secrets_of(parse_config(CONFIG, env={}))
    assert {"sk-upstream-key-1", "proxy-user", "proxy-pass-1"} <= secrets
    assert {"redis-user", "redis-pass-1"} <= secrets  # a Redis URL's password too
    redactor = Redactor()
    redactor.update(secrets)
    line = redactor.redact("AUTH redis-user redis-pass-1 failed; proxy said proxy-pass-1")
    assert "pass-1" not in line and "redis-user" not in line
