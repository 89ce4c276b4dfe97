"""Client API keys (SPEC §4, §7, §8 `auth`): who is calling, at what default priority, with
which aliases and limits. Keys are compared in constant time and never logged or echoed."""

from __future__ import annotations

import hmac
from collections.abc import Mapping
from dataclasses import dataclass

from gateway._core import Priority
from gateway.config import PRIORITIES, Config
from gateway.errors import Unauthorized
from gateway.limits import KeyLimits

__all__ = ["ANONYMOUS", "KeyRing", "Tenant"]


@dataclass(slots=True, eq=False)
class Tenant:
    """One caller. `index` is the small integer the core's fair queues use (0: anonymous)."""

    name: str
    index: int
    priority: Priority | None
    models: frozenset[str] | None
    limits: KeyLimits | None
    secret: bytes = b""
    # SPEC §15 tier routes: alias asked → alias served (e.g. a free tier's judge → judge-lite).
    routes: Mapping[str, str] | None = None
    # SPEC §17: the key's own (TTFT, TPOT) objectives in ms (None: the class's).
    slo: tuple[int | None, int | None] = (None, None)


ANONYMOUS = Tenant("anonymous", 0, None, None, None)


def bearer(headers: Mapping[str, str]) -> bytes | None:
    raw = headers.get("Authorization", "")
    scheme, _, token = raw.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    # aiohttp decodes header bytes as UTF-8 with surrogate escapes: a token that is not
    # UTF-8 comes back as its own bytes (and then matches no key: 401, never a 500).
    return token.strip().encode("utf-8", "surrogateescape")


class KeyRing:
    """The keys of the running config; a reload keeps the buckets of unchanged keys."""

    def __init__(self, config: Config, previous: KeyRing | None = None) -> None:
        auth = config.auth
        self.enabled = auth is not None
        self._admin = (auth.admin_key or "").encode() if auth is not None else b""
        self.tenants: list[Tenant] = []
        old = {t.name: t for t in previous.tenants} if previous is not None else {}
        # Tenant indexes stay stable across reloads: queued requests keep their fair share.
        indexes: dict[str, int] = dict(previous._indexes) if previous is not None else {}
        self._indexes: dict[str, int] = indexes
        for key in auth.keys if auth is not None else []:
            index = indexes.setdefault(key.name, len(indexes) + 1)
            prio = None
            if key.priority is not None:
                prio = PRIORITIES[key.priority]
            limits = None
            if key.rpm or key.tpm:
                kept = old.get(key.name)
                if (
                    kept is not None
                    and kept.limits is not None
                    and kept.limits.same_limits(key.rpm, key.tpm)
                ):
                    limits = kept.limits
                else:
                    limits = KeyLimits(key.rpm, key.tpm)
            models = frozenset(key.models) if key.models is not None else None
            self.tenants.append(
                Tenant(
                    key.name,
                    index,
                    prio,
                    models,
                    limits,
                    key.key.encode(),
                    dict(key.routes) if key.routes else None,
                    (key.slo_ttft_ms, key.slo_tpot_ms),
                )
            )

    def authenticate(self, headers: Mapping[str, str]) -> Tenant:
        if not self.enabled:
            return ANONYMOUS
        presented = bearer(headers)
        if presented is None:
            raise Unauthorized("Missing API key: send 'Authorization: Bearer <key>'.")
        found = None
        # Constant time in the key: every key is compared, whatever matched.
        for tenant in self.tenants:
            if hmac.compare_digest(tenant.secret, presented) and found is None:
                found = tenant
        if found is None:
            raise Unauthorized("Incorrect API key provided.")
        return found

    def authenticate_admin(self, headers: Mapping[str, str]) -> None:
        if not self.enabled:
            return
        presented = bearer(headers)
        if not self._admin or presented is None or not hmac.compare_digest(self._admin, presented):
            raise Unauthorized("The admin API needs the admin key.")
