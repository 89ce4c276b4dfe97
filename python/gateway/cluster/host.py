"""SPEC §12 × §13: `cluster:` with `--workers N` is one replica per host. One worker of the host
— the *member* — talks to Redis for the pools' leases; it publishes the host's lease of every
instance, and every worker applies it as the instance's cap in its core. The region already
enforces a cap across workers (each worker's core passes its cap to the instance's shared
in-flight word), so the same cap in every worker is the host's lease enforced across them.

Which worker is the member: whoever holds an exclusive `flock` on a file in the supervisor's
directory. The kernel drops the lock when its holder dies, `kill -9` included, so another
worker takes the role at its next try (every renew period) and renews the host's lease under
the same `replica_id` long before it could expire (the lease is valid `lease_ms − lease_ms/4`,
1.5 s of a 2 s lease; the role moves within one renew period, 200 ms). The supervisor is not the
member: it serves no HTTP and runs no pool (the demand and the hints are in the workers' pools
and probes, `/admin/state` in their HTTP), and it is the one process whose crash takes the host
down anyway — a Redis client bug there would take every worker with it. Nobody waits on the
lock (`LOCK_NB`), and nothing on the request path touches it.

What passes between the workers, through files in the supervisor's directory (written whole
to a temporary name and renamed, so a reader never sees half of one, and a writer killed
mid-write leaves the previous one):

- `cluster-host.json`: the member's publication after each sync — per pool the slots of each
  instance (by name) and the lease's expiry on the monotonic clock (CLOCK_MONOTONIC is
  system-wide, so a follower self-fences at the same instant as the member: SPEC §13), or no
  expiry on the static share (Redis unreachable); the lease state a new member continues from;
  and the cluster block of `/admin/state`. A follower looks at it every tick (10 ms: one
  `stat`).
- `cluster-waiting.<slot>`: requests a follower holds waiting for a lease (every instance they
  may use unleased: they wait before the shared queue, where the member cannot see them), per
  pool, and the sequence number of the last publication that lowered a cap it applied,
  rewritten when either changes (so not at every renewal: a rename costs). The member adds the
  waiting to the host's demand; the queues and the in-flight counts are already the whole
  host's in the member's pool snapshot (the region).

A lease that shrank is safe only once every worker applied it: until then a worker whose loop
was busy may still grant up to its old cap. So the member reports to Redis, as what the host
may have in flight (the floor), the largest cap of every publication that some other worker
has not acknowledged and that has not expired (a worker stops using a lease at its expiry; a
static share is held for one `lease_ms`). Only lowerings are acknowledged: the caps published
after the last lowering all workers acknowledged are never above the current ones, unless a
later lowering follows, whose acknowledgement ends them. A worker that died acknowledges
nothing: its publications are held until they expire — the host's floor stays higher for at
most a lease, the safe direction.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from typing import TYPE_CHECKING, Any

import orjson

if TYPE_CHECKING:
    from gateway import _core

__all__ = ["HostSeat"]

_LOCK = "cluster.lock"
_PUBLISHED = "cluster-host.json"
_WAITING = "cluster-waiting."
#: A follower's report of waiters is bounded (a hostile file cannot grow the member's memory).
_MAX_REPORT_BYTES = 1 << 16


class HostSeat:
    """One worker's seat at its host's cluster membership (see the module doc)."""

    def __init__(
        self, directory: str, slot: int, workers: int, region: _core.Region | None = None
    ) -> None:
        self.slot = slot
        self.workers = workers
        #: The host's region: where the host's per-key allowances live (SPEC §12 × §13).
        self.region = region
        self._dir = directory
        self._lock_path = os.path.join(directory, _LOCK)
        self._published = os.path.join(directory, _PUBLISHED)
        self._lock_fd: int | None = None
        self._seen: tuple[int, int, int] | None = None
        self._reported: dict[str, Any] | None = None

    # ---- the member role -------------------------------------------------------------------

    @property
    def member(self) -> bool:
        return self._lock_fd is not None

    def try_lead(self) -> bool:
        """Takes the member role if nobody holds it (never waits); True while this worker is
        the member."""
        if self._lock_fd is not None:
            return True
        try:
            fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return False
        self._lock_fd = fd
        return True

    def resign(self) -> None:
        """Gives the role up (at shutdown): another worker takes it at its next try."""
        if self._lock_fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._lock_fd)
            self._lock_fd = None

    def publish(self, doc: dict[str, Any]) -> None:
        """The member's publication (whole, atomically renamed into place)."""
        _write(self._published, orjson.dumps(doc))

    # ---- every worker ----------------------------------------------------------------------

    def changed(self) -> dict[str, Any] | None:
        """The publication, if it changed since the last call (one `stat` otherwise)."""
        try:
            st = os.stat(self._published)
        except OSError:
            return None
        stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
        if stamp == self._seen:
            return None
        doc = self.read()
        if doc is not None:
            self._seen = stamp
        return doc

    def read(self) -> dict[str, Any] | None:
        """The publication as it is now (None: none yet, or unreadable)."""
        try:
            with open(self._published, "rb") as f:
                doc = orjson.loads(f.read())
        except (OSError, orjson.JSONDecodeError):
            return None
        return doc if isinstance(doc, dict) else None

    def report(self, waiting: dict[str, int], applied: int) -> None:
        """This worker's requests waiting for a lease, per pool, and the sequence number of
        the last publication it applied (written when either changed)."""
        doc = {"w": waiting, "seq": applied}
        if doc == self._reported:
            return
        self._reported = {"w": dict(waiting), "seq": applied}
        _write(os.path.join(self._dir, f"{_WAITING}{self.slot}"), orjson.dumps(doc))

    def others(self) -> tuple[dict[str, int], int]:
        """The other workers' requests waiting for a lease, per pool, summed; and the lowest
        publication sequence number they all applied (0: one of them has not reported)."""
        out: dict[str, int] = {}
        acked: int | None = None
        for k in range(self.workers):
            if k == self.slot:
                continue
            try:
                with open(os.path.join(self._dir, f"{_WAITING}{k}"), "rb") as f:
                    doc = orjson.loads(f.read(_MAX_REPORT_BYTES))
            except (OSError, orjson.JSONDecodeError):
                doc = None
            if not isinstance(doc, dict):
                acked = 0
                continue
            seq = doc.get("seq")
            seq = seq if isinstance(seq, int) and seq >= 0 else 0
            acked = seq if acked is None else min(acked, seq)
            waiting = doc.get("w")
            for pool, n in waiting.items() if isinstance(waiting, dict) else ():
                if isinstance(n, int) and 0 < n < 1 << 31:
                    out[pool] = out.get(pool, 0) + n
        return out, acked if acked is not None else 1 << 62


def _write(path: str, data: bytes) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
