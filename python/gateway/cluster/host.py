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

What passes between the workers, through files in the supervisor's directory. Each file is
rewritten in place (one `pwrite` on a descriptor kept open) behind a header of its length, a
write stamp and a CRC-32 of its body; a reader that catches a write half done sees the CRC
fail and keeps what it had, looking again at its next tick (a `pwrite` is one system call, so
a writer killed with `kill -9` leaves the whole previous or the whole next). Not written to a
temporary name and renamed: on ext4 a rename over an existing file starts the new file's
writeback (`auto_da_alloc`), ~70 us of CPU and ~0.2 ms (more under load) of the event loop
blocked, ten times a second on the member — a write in place costs under 1 us, a look at
whether anything changed (a 20-byte `pread`) less than the `stat` it replaces:

- `cluster-host.json`: the member's publication after each sync — per pool the slots of each
  instance (by name) and the lease's expiry on the monotonic clock (CLOCK_MONOTONIC is
  system-wide, so a follower self-fences at the same instant as the member: SPEC §13), or no
  expiry on the static share (Redis unreachable); the lease state a new member continues from;
  and the cluster block of `/admin/state`. A follower looks at it every tick (10 ms: the
  header's write stamp, read again in whole only when it changed).
- `cluster-waiting.<slot>`: requests a follower holds waiting for a lease (every instance they
  may use unleased: they wait before the shared queue, where the member cannot see them), per
  pool, and the sequence number of the last publication that lowered a cap it applied,
  rewritten when either changes (so not at every renewal). The member adds the
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
import struct
import time
import zlib
from typing import TYPE_CHECKING, Any

import orjson

if TYPE_CHECKING:
    from gateway import _core

__all__ = ["HostSeat"]

_LOCK = "cluster.lock"
_PUBLISHED = "cluster-host.json"
_WAITING = "cluster-waiting."
#: A follower's report of waiters is bounded (a hostile file cannot grow the member's memory),
#: and so is the publication (SPEC §16: nothing grows without limit).
_MAX_REPORT_BYTES = 1 << 16
_MAX_PUBLISHED_BYTES = 1 << 26
#: A file's header: magic, write stamp (CLOCK_MONOTONIC ns: system-wide, so increasing across
#: writers), body length, CRC-32 of the body.
_HEADER = struct.Struct("<4sQII")
_MAGIC = b"GWh1"


class HostSeat:
    """One worker's seat at its host's cluster membership (see the module doc)."""

    def __init__(
        self, directory: str, slot: int, workers: int, region: _core.Region | None = None
    ) -> None:
        self.slot = slot
        self.workers = workers
        #: The host's region: where the host's per-key allowances live (SPEC §12 × §13).
        self.region = region
        self._lock_path = os.path.join(directory, _LOCK)
        self._published = os.path.join(directory, _PUBLISHED)
        self._lock_fd: int | None = None
        self._board = _Board(self._published, _MAX_PUBLISHED_BYTES)
        self._mine = _Board(os.path.join(directory, f"{_WAITING}{slot}"), _MAX_REPORT_BYTES)
        self._theirs = {
            k: _Board(os.path.join(directory, f"{_WAITING}{k}"), _MAX_REPORT_BYTES)
            for k in range(workers)
            if k != slot
        }
        self._seen = 0
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
        """The member's publication (whole, in place: see the module doc)."""
        self._board.write(orjson.dumps(doc))

    # ---- every worker ----------------------------------------------------------------------

    def changed(self) -> dict[str, Any] | None:
        """The publication, if it changed since the last call (a 20-byte read otherwise)."""
        if self._board.stamp() in (0, self._seen):
            return None
        stamp, doc = self._board.read()
        if doc is None or stamp == self._seen:
            return None  # being written: looked at again at the next tick
        self._seen = stamp
        return doc

    def read(self) -> dict[str, Any] | None:
        """The publication as it is now (None: none yet, unreadable, or being written)."""
        return self._board.read()[1]

    def report(self, waiting: dict[str, int], applied: int) -> None:
        """This worker's requests waiting for a lease, per pool, and the sequence number of
        the last publication it applied (written when either changed)."""
        doc = {"w": waiting, "seq": applied}
        if doc == self._reported:
            return
        self._reported = {"w": dict(waiting), "seq": applied}
        self._mine.write(orjson.dumps(doc))

    def others(self) -> tuple[dict[str, int], int]:
        """The other workers' requests waiting for a lease, per pool, summed; and the lowest
        publication sequence number they all applied (0: one of them has not reported)."""
        out: dict[str, int] = {}
        acked: int | None = None
        for board in self._theirs.values():
            doc = board.read()[1]
            if doc is None:
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


class _Board:
    """One file written in place behind a header (see the module doc): the writer's and the
    readers' descriptors stay open, so a write is one `pwrite` and a look one `pread`."""

    __slots__ = ("_fd", "_last", "_max", "_path", "_writable")

    def __init__(self, path: str, max_bytes: int) -> None:
        self._path = path
        self._max = max_bytes
        self._fd: int | None = None
        self._writable = False
        #: The last whole document read: what a read that catches a write half done answers.
        self._last: tuple[int, dict[str, Any] | None] = (0, None)

    def _open(self, write: bool) -> int | None:
        if self._fd is not None and (self._writable or not write):
            return self._fd
        flags = os.O_RDWR | os.O_CREAT if write else os.O_RDONLY
        try:
            fd = os.open(self._path, flags | os.O_CLOEXEC, 0o600)
        except OSError:
            return None  # not written yet (a reader), or the directory is gone
        if self._fd is not None:
            os.close(self._fd)
        self._fd, self._writable = fd, write
        return fd

    def write(self, body: bytes) -> None:
        fd = self._open(write=True)
        if fd is None or len(body) > self._max:
            return
        head = _HEADER.pack(_MAGIC, time.monotonic_ns(), len(body), zlib.crc32(body))
        with contextlib.suppress(OSError):
            os.pwrite(fd, head + body, 0)

    def _head(self, fd: int) -> tuple[int, int, int]:
        """(stamp, body length, CRC) of the last write; stamp 0: none."""
        try:
            head = os.pread(fd, _HEADER.size, 0)
        except OSError:
            return 0, 0, 0
        if len(head) < _HEADER.size:
            return 0, 0, 0
        magic, stamp, size, crc = _HEADER.unpack(head)
        return (int(stamp), size, crc) if magic == _MAGIC and size <= self._max else (0, 0, 0)

    def stamp(self) -> int:
        """The last write's stamp (0: nothing written yet)."""
        fd = self._open(write=False)
        return 0 if fd is None else self._head(fd)[0]

    def read(self) -> tuple[int, dict[str, Any] | None]:
        """(stamp, the document) as written last; (0, None) if there is none or it is not a
        JSON object. A write caught half done answers the last whole one read (if any)."""
        fd = self._open(write=False)
        if fd is None:
            return 0, None
        stamp, size, _ = self._head(fd)
        if not stamp:
            return 0, None
        try:
            data = os.pread(fd, _HEADER.size + size, 0)
        except OSError:
            return self._last
        # The header again, with the body it came with: a write may have begun meanwhile.
        if len(data) != _HEADER.size + size:
            return self._last
        magic, stamp, length, crc = _HEADER.unpack_from(data)
        body = data[_HEADER.size :]
        if magic != _MAGIC or length != size or zlib.crc32(body) != crc:
            return self._last
        try:
            doc = orjson.loads(body)
        except orjson.JSONDecodeError:
            return 0, None
        if not isinstance(doc, dict):
            return 0, None
        self._last = (int(stamp), doc)
        return self._last
