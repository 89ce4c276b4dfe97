"""One redaction for everything that leaves the gateway as text: log records (ours and
aiohttp's, tracebacks included), upstream-derived error text, `/admin/state`.

SPEC §7: "Upstream API keys, and the client's own key, never appear in an error, a log line
or a metric." Two nets: every secret the config knows (client keys, the admin key, upstream
keys, header values, proxy credentials) is replaced wherever it appears, and anything shaped
like a credential (`Authorization: …`, `Bearer …`, `api-key: …`, `sk-…`) is masked even
when nobody configured it — a client's mistyped key is still a secret.
"""

from __future__ import annotations

import base64
import logging
import re
from collections.abc import Iterable
from typing import Any
from urllib.parse import quote, quote_plus, urlsplit

from gateway.config import Config, secret_values

__all__ = ["REDACTOR", "RedactingFilter", "Redactor", "secrets_of"]

MASK = "[redacted]"

# A header line that carries a credential, as raw text or inside a bytes repr: everything
# after the name up to the end of the line or the quote that closes the repr.
_CREDENTIAL_LINE = re.compile(
    r"(?i)((?:proxy-)?authorization|x-api-key|api-key|x-goog-api-key|cookie)"
    r"(\s*[:=]\s*)[^\r\n'\"]*"
)
_BEARER = re.compile(r"(?i)\b(bearer|basic)\s+[^\s'\",;]+")
_KEY_LIKE = re.compile(r"\bsk-[A-Za-z0-9_\-]{6,}")


def secrets_of(config: Config) -> set[str]:
    """Every secret a config holds: each field typed `Secret`, and for one that is a URL
    (an egress proxy, Redis) the credentials inside it, which a log line may quote alone."""
    out: set[str] = set()
    for value in secret_values(config):
        out.add(value)
        out.update(_url_credentials(value))
    # Very short values would mask ordinary words; they are not credentials anyway.
    return {s for s in out if len(s) >= 6}


def _url_credentials(value: str) -> list[str]:
    """The user name and password of `scheme://user:password@host/...`, if it is one."""
    if "://" not in value or "@" not in value:
        return []
    try:
        parts = urlsplit(value)
    except ValueError:
        return []
    return [p for p in (parts.username, parts.password) if p]


# An encoded form shorter than this could match ordinary text by chance.
_MIN_ENCODED = 8


def encodings_of(secret: str) -> set[str]:
    """The forms a secret commonly travels in besides verbatim (SPEC §7: a key never appears
    in an error): URL-encoded, and base64 / base64url — also as a piece of a longer encoded
    text (`user:key` under `Basic`, a JSON blob), where the secret starts at any of the three
    byte offsets of a base64 group. For each offset only the characters that depend on the
    secret's bytes alone are kept (the ones at the edges mix in the neighbours' bits), the
    way secret scanners search for base64-embedded keys."""
    raw = secret.encode()
    out = {quote(secret, safe=""), quote_plus(secret, safe="")}
    for pad in range(3):
        encoded = base64.b64encode(b"\0" * pad + raw + b"\0\0").decode()
        # Character i carries bits [6i, 6i + 6); the secret's bits are [8 pad, 8 (pad + n)).
        first = -(-8 * pad // 6)
        last = (8 * (pad + len(raw))) // 6
        core = encoded[first:last]
        out.add(core)
        out.add(core.replace("+", "-").replace("/", "_"))
    return {form for form in out if form != secret and len(form) >= _MIN_ENCODED}


def _trie_pattern(words: Iterable[str]) -> str:
    """One regular expression matching any of `words`, shaped as their trie
    (`sk-(?:a(?:bc|xy)|q…)`): the engine follows one branch per character, so a search costs
    about the same for one secret as for thousands (an alternation, or one `in` per secret,
    grows with their number — measured 1 µs against 29 µs at 100 keys). At a word that ends
    where a longer one goes on, the longer is tried first (greedy `?`)."""
    root: dict[str, dict[str, Any]] = {}
    for word in words:
        node = root
        for ch in word:
            node = node.setdefault(ch, {})
        node[""] = {}

    def build(node: dict[str, Any]) -> str:
        out = []
        # A chain without branches or ends is written in a loop, not by recursion, so a
        # long secret (a JWT) costs no stack.
        while len(node) == 1 and "" not in node:
            ((ch, node),) = node.items()
            out.append(re.escape(ch))
        if not node or list(node) == [""]:
            return "".join(out)
        alts = [re.escape(ch) + build(child) for ch, child in sorted(node.items()) if ch]
        body = alts[0] if len(alts) == 1 else "(?:" + "|".join(alts) + ")"
        return "".join(out) + ("(?:" + body + ")?" if "" in node else body)

    return build(root)


class Redactor:
    """Masks known secrets (verbatim and in their common encodings) and credential-shaped
    text."""

    def __init__(self) -> None:
        self._secrets: frozenset[str] = frozenset()
        self._known: re.Pattern[str] | None = None

    def update(self, secrets: Iterable[str]) -> None:
        """Replaces the known secrets."""
        self._secrets = frozenset(s for s in secrets if s)  # "" would match everywhere
        forms = set(self._secrets)
        for secret in self._secrets:
            forms.update(encodings_of(secret))
        self._known = re.compile(_trie_pattern(forms)) if forms else None

    def add(self, secrets: Iterable[str]) -> None:
        self.update({*self._secrets, *secrets})

    def redact(self, text: str) -> str:
        if self._known is not None:
            text = self._known.sub(MASK, text)
        if "uthoriz" in text or "earer" in text or "asic" in text or "ey" in text:
            text = _CREDENTIAL_LINE.sub(lambda m: m.group(1) + m.group(2) + MASK, text)
            text = _BEARER.sub(lambda m: m.group(1) + " " + MASK, text)
        if "sk-" in text:
            text = _KEY_LIKE.sub(MASK, text)
        return text


#: The process's redactor: the gateway keeps it up to date with its config.
REDACTOR = Redactor()


class RedactingFilter(logging.Filter):
    """Attached to every log handler: the message, its arguments, its structured fields and
    any traceback are rendered and redacted before a formatter sees them."""

    def __init__(self, redactor: Redactor = REDACTOR) -> None:
        super().__init__()
        self._redactor = redactor

    def filter(self, record: logging.LogRecord) -> bool:
        redact = self._redactor.redact
        try:
            message = record.getMessage()
        except Exception:  # a bad format string must not lose the record
            message = str(record.msg)
        record.msg, record.args = redact(message), None
        if record.exc_info:
            formatter = logging.Formatter()
            record.exc_text = redact(formatter.formatException(record.exc_info))
            record.exc_info = None
        elif record.exc_text:
            record.exc_text = redact(record.exc_text)
        if record.stack_info:
            record.stack_info = redact(record.stack_info)
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            record.fields = {k: redact(v) if isinstance(v, str) else v for k, v in fields.items()}
        return True
