"""One redaction for everything that leaves the gateway as text: log records (ours and
aiohttp's, tracebacks included), upstream-derived error text, `/admin/state`.

SPEC §7: "Upstream API keys, and the client's own key, never appear in an error, a log line
or a metric." Two nets: every secret the config knows (client keys, the admin key, upstream
keys, header values, proxy credentials) is replaced wherever it appears, and anything shaped
like a credential (`Authorization: …`, `Bearer …`, `api-key: …`, `sk-…`) is masked even
when nobody configured it — a client's mistyped key is still a secret.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from urllib.parse import urlsplit

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


class Redactor:
    """Masks known secrets and credential-shaped text."""

    def __init__(self) -> None:
        self._known: tuple[str, ...] = ()

    def update(self, secrets: Iterable[str]) -> None:
        """Replaces the known secrets (longest first, so no secret is masked halfway)."""
        self._known = tuple(sorted(set(secrets), key=len, reverse=True))

    def add(self, secrets: Iterable[str]) -> None:
        self.update({*self._known, *secrets})

    def redact(self, text: str) -> str:
        for secret in self._known:
            if secret in text:
                text = text.replace(secret, MASK)
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
