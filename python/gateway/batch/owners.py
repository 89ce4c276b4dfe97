"""Who owns a file or a batch, and whose limits its lines run under.

SPEC §14: "Keys own their files and batches (another key gets 404)." An owner is stored as a
string: `key:<name>` for a configured key (names are unique, and stable across reloads and
key rotation), `admin` for the admin key, `anonymous` when auth is off. The admin key sees
every owner's files and batches; with auth off there is one owner.

A batch's lines run as its owner's tenant — so the owner's RPM/TPM buckets and allowed
aliases apply — but with a tenant index for the owner's batches (`batch_index`). SPEC §14:
"all batches of one key are one tenant of the low class (sixty batches from one key get one
key's share, not sixty)"; and that tenant is not the key's live one, so the key's own live
low-priority requests share the low queue round-robin with its batches instead of waiting
behind them.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from gateway.auth import ANONYMOUS, KeyRing, Tenant
from gateway.errors import Unauthorized
from gateway.router import Router

__all__ = [
    "ADMIN",
    "BATCH_TENANT_BASE",
    "Principal",
    "allowed_models",
    "base_tenant",
    "batch_index",
    "principal",
]

ADMIN: Final = "admin"
ANONYMOUS_OWNER: Final = "anonymous"
#: Batch tenant indexes start here, far above any key's (keys count from 1); the core's
#: tenant is a u32.
BATCH_TENANT_BASE: Final = 1_000_000
_U32: Final = 2**32


@dataclass(frozen=True, slots=True)
class Principal:
    """The caller of a Batch API route: the owner it creates as, and what it may see
    (`sees` None: everything, the admin key)."""

    owner: str
    sees: str | None
    tenant: Tenant


def principal(keys: KeyRing, headers: Mapping[str, str]) -> Principal:
    """Authenticates a Batch API request (401 like any other route)."""
    if not keys.enabled:
        return Principal(ANONYMOUS_OWNER, ANONYMOUS_OWNER, ANONYMOUS)
    try:
        tenant = keys.authenticate(headers)
    except Unauthorized:
        try:
            keys.authenticate_admin(headers)
        except Unauthorized:
            pass
        else:
            return Principal(ADMIN, None, ANONYMOUS)
        raise
    owner = f"key:{tenant.name}"
    return Principal(owner, owner, tenant)


def base_tenant(keys: KeyRing, owner: str) -> Tenant | None:
    """The tenant an owner's lines run as now; None if its key is no longer configured (its
    batches wait: a revoked key's work does not run)."""
    if not keys.enabled or not owner.startswith("key:"):
        return ANONYMOUS
    name = owner[4:]
    for tenant in keys.tenants:
        if tenant.name == name:
            return tenant
    return None


def batch_index(owner: str) -> int:
    """The fair-queue tenant index of every batch of `owner` (stable across restarts and
    replicas: a hash of the owner, far above any key's own index)."""
    return BATCH_TENANT_BASE + zlib.crc32(owner.encode()) % (_U32 - BATCH_TENANT_BASE)


def batch_tenant(base: Tenant, owner: str) -> Tenant:
    """`base` (its limits and aliases) under the owner's batch fair-queue index."""
    return dataclasses.replace(base, index=batch_index(owner))


def allowed_models(router: Router, tenant: Tenant | None) -> frozenset[str]:
    """The aliases a tenant may send (what validation checks `body.model` against)."""
    if tenant is None:
        return frozenset()
    aliases = router.aliases()
    if tenant.models is None:
        return frozenset(aliases)
    return frozenset(a for a in aliases if a in tenant.models)
