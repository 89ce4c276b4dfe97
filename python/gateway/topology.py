"""Where shared state lives, decided once by the composition root and handed down as a value.

`Server` (given what `cli` found at a worker's start) decides the topology — one process, one
of N workers on a shared region (SPEC §12), each of them possibly a cluster member (SPEC §13,
the `ClusterNode` the `Server` builds) — and hands it down: the pools attach to the region
through `link`, the metrics read the other workers' snapshots from `metrics_dir`. No module
reads a process global or the environment at import to find out who it is (the way uvicorn's
supervisor hands each worker its sockets and target).

`WorkerLink` is a worker's side of the supervisor (workers.py): its slot, the region and the
wake-up eventfds, read once from what the supervisor put in its environment.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec

from gateway import _core
from gateway.capacity import CapacityFactory, own_capacity
from gateway.config.schema import Cluster, default_replica_id

if TYPE_CHECKING:
    from gateway.cluster.host import HostSeat
    from gateway.config import Config

__all__ = ["WORKER_RESTARTS_FILE", "Topology", "WorkerLink"]

#: SPEC §12: the supervisor's count of replaced workers, a file beside the workers' metrics
#: snapshots (the supervisor serves no HTTP; every worker's `/metrics` reads it).
WORKER_RESTARTS_FILE = "worker_restarts"

# What the supervisor puts in a worker's environment (read once, by `WorkerLink.from_env`).
_ENV = "GATEWAY_WORKER"
_BATCH_ENV = "GATEWAY_WORKER_BATCH_SOCKET"
#: The supervisor's directory, where a worker that cannot start says why.
_DIR_ENV = "GATEWAY_WORKER_DIR"
#: Where the workers' metrics snapshots live.
_METRICS_ENV = "GATEWAY_METRICS_DIR"


@dataclass
class WorkerLink:
    """A worker's side: its slot, the region and every slot's eventfd."""

    slot: int
    incarnation: int
    region: _core.Region
    wake_fds: tuple[int, ...]
    supervisor: int
    #: SPEC §14 with workers: worker 0 serves the Batch API on this Unix socket, the others
    #: relay to it.
    batch_socket: str = ""
    #: The supervisor's directory (where `cannot_start` leaves its report).
    directory: str = ""
    #: SPEC §12: where the workers' metrics snapshots live.
    metrics_dir: str = ""
    #: Called (on the loop) when another worker woke this one.
    on_wake: Callable[[], None] | None = None
    _pending: int = field(default=0, repr=False)

    @property
    def workers(self) -> int:
        return len(self.wake_fds)

    @classmethod
    def from_env(cls) -> WorkerLink | None:
        spec = os.environ.get(_ENV)
        if not spec:
            return None
        slot, incarnation, shm_fd, supervisor, fds = spec.split(":")
        wake_fds = tuple(int(fd) for fd in fds.split(","))
        return cls(
            slot=int(slot),
            incarnation=int(incarnation),
            region=_core.Region(int(shm_fd)),
            wake_fds=wake_fds,
            supervisor=int(supervisor),
            batch_socket=os.environ.get(_BATCH_ENV, ""),
            directory=os.environ.get(_DIR_ENV, ""),
            metrics_dir=os.environ.get(_METRICS_ENV, ""),
        )

    @property
    def batch_home(self) -> bool:
        """Whether this worker runs the Batch API (the store and its runner)."""
        return self.slot == 0

    def wake(self, mask: int) -> None:
        """Wakes the worker slots in the bit set `mask` (never this one)."""
        mask &= ~(1 << self.slot)
        k = 0
        while mask:
            if mask & 1 and k < len(self.wake_fds):
                with contextlib.suppress(BlockingIOError, OSError):
                    os.eventfd_write(self.wake_fds[k], 1)
            mask >>= 1
            k += 1

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        loop.add_reader(self.wake_fds[self.slot], self._woken)

    def stop(self, loop: asyncio.AbstractEventLoop) -> None:
        with contextlib.suppress(Exception):
            loop.remove_reader(self.wake_fds[self.slot])

    def _woken(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            os.eventfd_read(self.wake_fds[self.slot])
        if self.on_wake is not None:
            self.on_wake()

    def heartbeat(self, now_ms: int) -> None:
        self.region.heartbeat(self.slot, now_ms)

    def reloaded(self) -> None:
        """A reload through this worker's HTTP API: the others reload too."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(self.supervisor, signal.SIGUSR1)

    def cannot_start(self, status: int, reason: str) -> bool:
        """SPEC §12: this worker cannot start (a bad config): tells the supervisor why, before
        exiting with `status`. When every slot reports the same, the supervisor exits with it;
        until then the slot is retried with back-off (the others keep serving). False if the
        report could not be written."""
        if not self.directory:
            return False
        path = _report_path(self.directory, self.slot)
        try:
            with open(path + ".tmp", "w") as f:
                json.dump({"status": status, "reason": reason}, f)
            os.replace(path + ".tmp", path)
        except OSError:
            return False
        return True


def _report_path(directory: str, slot: int) -> str:
    return os.path.join(directory, f"cannot-start.{slot}")


@dataclass(frozen=True, slots=True)
class Topology:
    """One process (`single`) or one of N workers sharing a region (`workers`), and either of
    them a cluster member (`cluster`, SPEC §13): the `Server` builds its `ClusterNode` from
    `cluster` over the pools this topology attached, seated at its host's one membership
    (`seat()`) when it is one of several workers (SPEC §12 × §13)."""

    link: WorkerLink | None = None
    #: SPEC §13: the cluster settings, with the replica id of the host (None: no cluster).
    cluster_settings: Cluster | None = None

    @classmethod
    def single(cls) -> Topology:
        return cls()

    @classmethod
    def workers(cls, link: WorkerLink) -> Topology:
        return cls(link)

    @classmethod
    def cluster(cls, settings: Cluster, link: WorkerLink | None = None) -> Topology:
        """SPEC §12: "`cluster:` with `--workers N` is one replica per host": every worker of a
        host is the same replica. Its default id ("host name + pid") is the supervisor's pid,
        not each worker's, so a worker that takes the member role over (or a replacement)
        renews the host's lease rather than registering another replica."""
        if link is not None and settings.replica_id == default_replica_id():
            host_id = f"{socket.gethostname()}-{link.supervisor}"
            settings = msgspec.structs.replace(settings, replica_id=host_id)
        return cls(link, settings)

    def capacity(self, config: Config) -> CapacityFactory:
        """Where each pool's slots come from beyond its core's counters: its own (one process;
        a worker's core already reads the region), or SPEC §13 the replica's leased share of
        each instance (nothing is leased until the cluster sync's first answer)."""
        if self.cluster_settings is None:
            return own_capacity
        from gateway.cluster.local import LocalLeases  # SPEC §13: only with a cluster section

        # SPEC §13: waiting for a lease is queueing (an idle replica's share follows demand,
        # so its first requests wait for a busy one's slots to come back).
        gate_wait_ms = max(self.cluster_settings.lease_ms, config.scheduler.high.max_wait_ms)
        return lambda core, fail_waiting, configured: LocalLeases(
            core, fail_waiting, configured, gate_wait_ms
        )

    def seat(self) -> HostSeat | None:
        """This worker's seat at its host's membership (None: one process, or no cluster)."""
        if self.cluster_settings is None or self.link is None or not self.link.directory:
            return None
        from gateway.cluster.host import HostSeat  # SPEC §13: only with a cluster section

        return HostSeat(self.link.directory, self.link.slot, self.link.workers, self.link.region)

    @property
    def metrics_dir(self) -> str | None:
        """SPEC §12: where every worker's metrics snapshot lives (None: one process)."""
        return (self.link.metrics_dir or None) if self.link is not None else None

    @property
    def worker_restarts_path(self) -> str | None:
        """The supervisor's count of replaced workers (None: no supervisor)."""
        share = self.metrics_dir
        return os.path.join(share, WORKER_RESTARTS_FILE) if share is not None else None
