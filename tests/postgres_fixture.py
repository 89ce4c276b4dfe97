"""A real PostgreSQL server for the batch store tests: one cluster per pytest session, made by
`initdb` in a temp directory and started on 127.0.0.1 and a free port (like the Redis fixture
does for Redis), a fresh database per test.

PostgreSQL refuses to run as root, so as root the cluster belongs to a system user
(`postgres` if the Debian package made one, else `nobody`) and its commands run through
`runuser`. Durability is off (`fsync=off`, `synchronous_commit=off`): the tests kill gateways,
never the machine, and a crash of the server (`pg_ctl -m immediate`) keeps what was committed.
Without the binaries the tests are skipped with the reason, except under `CI`, where the
package is installed by `.ci/run` and a missing server is a failure."""

from __future__ import annotations

import contextlib
import glob
import itertools
import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from support import free_port

__all__ = ["PG_BIN", "PostgresServer", "pg_server", "require_postgres"]


def _bin_dir() -> Path | None:
    """The newest `/usr/lib/postgresql/<v>/bin` (Debian's layout), else `initdb` on PATH."""
    dirs = sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda d: int(d.split("/")[-2]))
    if dirs:
        return Path(dirs[-1])
    found = shutil.which("initdb")
    return Path(found).parent if found else None


PG_BIN = _bin_dir()


def require_postgres() -> Path:
    if PG_BIN is None or not (PG_BIN / "initdb").exists():
        message = "PostgreSQL server binaries (Debian package `postgresql`) are not installed"
        if os.environ.get("CI"):
            pytest.fail(message + " (CI installs them: .ci/run)")
        pytest.skip(message)
    return PG_BIN


class PostgresServer:
    """One throwaway cluster."""

    def __init__(self) -> None:
        self.bin = require_postgres()
        self.user: str | None = None
        if os.geteuid() == 0:
            try:
                pwd.getpwnam("postgres")
                self.user = "postgres"
            except KeyError:
                self.user = "nobody"
        # Short: the socket's path must stay under 107 bytes.
        self.dir = Path(tempfile.mkdtemp(prefix="gwpg."))
        if self.user is not None:
            shutil.chown(self.dir, self.user)
        self.port = free_port()
        self._names = itertools.count(1)

    def _run(self, *args: str) -> None:
        cmd = list(args)
        if self.user is not None:
            cmd = ["runuser", "-u", self.user, "--", *cmd]
        subprocess.run(cmd, check=True, capture_output=True, timeout=60, cwd=self.dir)

    def start(self) -> None:
        data = str(self.dir / "data")
        if not (self.dir / "data").exists():
            self._run(
                str(self.bin / "initdb"), "-D", data, "-A", "trust", "-U", "postgres",
                "-E", "UTF8", "--locale=C.UTF-8", "--no-sync",
            )  # fmt: skip
        opts = (
            f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 -c fsync=off "
            "-c synchronous_commit=off -c full_page_writes=off -c max_connections=200"
        )
        self._run(
            str(self.bin / "pg_ctl"), "-D", data, "-l", str(self.dir / "log"), "-w", "-t", "30",
            "-o", opts, "start",
        )  # fmt: skip

    def stop(self, mode: str = "fast") -> None:
        self._run(str(self.bin / "pg_ctl"), "-D", str(self.dir / "data"), "-m", mode, "-w", "stop")

    def url(self, db: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{db}"

    def new_database(self) -> str:
        """A fresh, empty database; its URL."""
        import psycopg

        name = f"t{next(self._names)}"
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return self.url(name)

    def close(self) -> None:
        with contextlib.suppress(subprocess.SubprocessError, OSError):
            self.stop("immediate")
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PostgresServer]:
    """The session's PostgreSQL (import this fixture into a test module to use it)."""
    server = PostgresServer()
    server.start()
    try:
        yield server
    finally:
        server.close()
