"""The redactor's knowledge of the config's secrets (SPEC §7)."""

from __future__ import annotations

import base64
import re
import urllib.parse

from hypothesis import given
from hypothesis import strategies as st

from gateway.config import parse_config
from gateway.redact import MASK, Redactor, secrets_of

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


def _decodes_to(text: str, secret: bytes) -> bool:
    """Whether any run of base64 characters in `text`, read from any of its four
    alignments, decodes to bytes holding `secret`."""
    for run in re.findall(r"[A-Za-z0-9+/_-]+", text):
        run = run.replace("-", "+").replace("_", "/")
        for shift in range(4):
            usable = run[shift:]
            if len(usable) % 4 == 1:
                usable = usable[:-1]
            if secret in base64.b64decode(usable + "=" * (-len(usable) % 4)):
                return True
    return False


@given(
    secret=st.text(st.characters(min_codepoint=33, max_codepoint=126), min_size=8, max_size=60),
    before=st.binary(max_size=7),
    after=st.binary(max_size=7),
)
def test_a_secret_inside_base64_at_any_offset_is_masked(
    secret: str, before: bytes, after: bytes
) -> None:
    """SPEC §7: a key never appears in an error, encoded or not — base64 of any text holding
    it (the secret starts at any of a group's three byte offsets), base64url, URL-encoding."""
    redactor = Redactor()
    redactor.update({secret})
    blob = before + secret.encode() + after
    for encoded in (base64.b64encode(blob), base64.urlsafe_b64encode(blob)):
        assert _decodes_to(encoded.decode(), secret.encode())  # the check can fail
        out = redactor.redact("upstream said: " + encoded.decode())
        assert MASK in out
        assert not _decodes_to(out, secret.encode()), out
    quoted = urllib.parse.quote(secret, safe="")
    assert secret not in urllib.parse.unquote(redactor.redact("url: " + quoted))


def test_thousands_of_keys_are_each_masked_whole() -> None:
    """One search over a trie of every configured secret: a key that extends another is
    masked whole (never half, leaving its tail), and the thousandth key is found too."""
    keys = {f"client-key-{i:04d}-{'x' * (i % 7)}" for i in range(1000)}
    redactor = Redactor()
    redactor.update({*keys, "shared-prefix", "shared-prefix-and-more"})
    assert redactor.redact("a shared-prefix-and-more b") == f"a {MASK} b"
    assert redactor.redact("a shared-prefix b") == f"a {MASK} b"
    for key in sorted(keys)[::97]:
        assert redactor.redact(f"key={key};") == f"key={MASK};"
    assert redactor.redact("nothing secret here") == "nothing secret here"
