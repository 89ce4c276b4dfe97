"""A real `redis-server` for the cluster tests: a child process on 127.0.0.1 and a free port,
without persistence (`--save '' --appendonly no`), that a test can shut down, restart on the
same port (empty: what a crashed Redis without persistence comes back as), pause and purge of
its clients."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import subprocess
import time
from pathlib import Path

from redis.asyncio import Redis

from support import free_port

__all__ = ["REDIS_SERVER", "RedisServer"]

REDIS_SERVER = shutil.which("redis-server")


class RedisServer:
    """One `redis-server` child."""

    def __init__(self, workdir: Path, port: int | None = None) -> None:
        assert REDIS_SERVER is not None, "redis-server is not installed"
        self.workdir = workdir
        self.port = port or free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> Redis:
        return Redis(host="127.0.0.1", port=self.port, socket_timeout=5, decode_responses=True)

    def _spawn(self) -> subprocess.Popen[bytes]:
        assert REDIS_SERVER is not None
        # fmt: off
        args = [
            REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1",
            "--save", "", "--appendonly", "no", "--dir", str(self.workdir),
            "--protected-mode", "no", "--loglevel", "warning",
        ]
        # fmt: on
        return subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    async def start(self) -> None:
        self.proc = self._spawn()
        deadline = time.monotonic() + 10
        while True:
            try:
                async with self.client() as r:
                    if await r.ping():
                        return
            except OSError:
                pass
            except Exception:  # redis' ConnectionError while it is coming up
                pass
            assert self.proc.poll() is None, "redis-server exited at start"
            assert time.monotonic() < deadline, "redis-server did not answer PING"
            await asyncio.sleep(0.02)

    async def shutdown_nosave(self) -> None:
        """`SHUTDOWN NOSAVE`: the server exits and forgets every key. From a client that does
        not retry: redis-py's default one reconnects to the server it just shut down, with
        back-off, for 3-4 s before it gives up."""
        r = Redis(host="127.0.0.1", port=self.port, socket_timeout=5, retry=None)
        with contextlib.suppress(Exception):  # the connection dies with the server
            await r.execute_command("SHUTDOWN", "NOSAVE")
        await r.aclose()
        if self.proc is not None:
            await asyncio.to_thread(self.proc.wait, 10)
            self.proc = None

    async def restart(self) -> None:
        """A new, empty server on the same port."""
        if self.proc is not None:
            await self.shutdown_nosave()
        await self.start()

    async def pause(self, ms: int) -> None:
        async with self.client() as r:
            await r.execute_command("CLIENT", "PAUSE", ms)

    async def kill_clients(self) -> int:
        """`CLIENT KILL TYPE normal` (this command's own connection survives it)."""
        async with self.client() as r:
            killed: int = await r.execute_command(
                "CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes"
            )
            return killed

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None
