"""What a store failure means to the client and to the operator.

SPEC §14: "a full or read-only disk is an error the client can read (507 / 503 with a
message), never a 500, and never leaves a batch stuck in `validating`, `finalizing` or
`cancelling`." Every store call goes through `classify`: a full disk (SQLite's "database or
disk is full", `ENOSPC`/`EDQUOT`, PostgreSQL's SQLSTATE 53100) becomes `StoreFull` (507
`insufficient_storage`); a read-only or unreachable store (`EROFS`, SQLite's "readonly
database", PostgreSQL's 25006, 57P0x, 08xxx or a lost connection) becomes `StoreDown` (503
`store_unavailable` with `Retry-After`). Their messages say what to do and never carry a path,
a URL or a password.

The classes are registered in the gateway's one error table (`responses.ANSWERS`) here, beside
their only raiser, so `error_response` shapes them like every other error.
"""

from __future__ import annotations

import errno
import sqlite3
from typing import Final

from gateway.errors import RequestError, RequestTooLarge
from gateway.responses import ANSWERS

__all__ = ["QuotaExceeded", "StoreDown", "StoreFull", "classify"]


class StoreFull(RequestError):
    """The batch store's disk (or database) is out of space."""


class StoreDown(RequestError):
    """The batch store is read-only, unreachable or refusing writes."""


class QuotaExceeded(RequestTooLarge):
    """SPEC §14: a key's stored bytes would pass `batch.max_stored_bytes`."""


ANSWERS[StoreFull] = (507, "insufficient_storage", "server_error")
ANSWERS[StoreDown] = (503, "store_unavailable", "server_error")
ANSWERS[QuotaExceeded] = (413, "quota_exceeded", "invalid_request_error")

FULL_MESSAGE: Final = (
    "The batch store is out of space; nothing was changed. Try again once the operator has "
    "freed space (or delete files you no longer need)."
)
DOWN_MESSAGE: Final = (
    "The batch store is unavailable (read-only or unreachable); nothing was changed. Try again "
    "later."
)
_FULL_ERRNO: Final = frozenset((errno.ENOSPC, errno.EDQUOT, errno.EFBIG))
_DOWN_ERRNO: Final = frozenset((errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO))
_RETRY_MS: Final = 5000


def classify(exc: BaseException) -> RequestError | None:
    """The client's error for a store failure, or None if `exc` is not one (a bug)."""
    if isinstance(exc, RequestError):
        return exc
    if isinstance(exc, OSError) and exc.errno in _FULL_ERRNO:
        return StoreFull(FULL_MESSAGE)
    if isinstance(exc, OSError) and exc.errno in _DOWN_ERRNO:
        return StoreDown(DOWN_MESSAGE, retry_after_ms=_RETRY_MS)
    if isinstance(exc, sqlite3.Error):
        text = str(exc).lower()
        if "full" in text:
            return StoreFull(FULL_MESSAGE)
        if any(w in text for w in ("readonly", "read-only", "unable to open", "disk i/o")):
            return StoreDown(DOWN_MESSAGE, retry_after_ms=_RETRY_MS)
        if "locked" in text or "busy" in text:
            return StoreDown(DOWN_MESSAGE, retry_after_ms=_RETRY_MS)
        return None
    sqlstate = getattr(exc, "sqlstate", None)
    if isinstance(sqlstate, str):  # psycopg.Error (imported only with a PostgreSQL store)
        if sqlstate.startswith("53"):  # 53100 disk_full, 53200 out_of_memory, ...
            return StoreFull(FULL_MESSAGE)
        if sqlstate == "25006" or sqlstate.startswith(("57P", "08")):
            return StoreDown(DOWN_MESSAGE, retry_after_ms=_RETRY_MS)
        return None
    if type(exc).__module__.startswith("psycopg") and type(exc).__name__ in (
        "OperationalError",
        "InterfaceError",
        "PoolTimeout",
    ):
        return StoreDown(DOWN_MESSAGE, retry_after_ms=_RETRY_MS)
    return None
