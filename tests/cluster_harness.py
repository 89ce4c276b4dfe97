"""Gateway replicas as real processes (`python -m gateway.cli serve`), for the cluster tests:
each with its own port, replica id and config file; killed, stopped and resumed with signals."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from support import free_port

__all__ = ["Replica"]

ADMIN_KEY = "admin-key-for-tests"


class Replica:
    """One `gateway serve` process."""

    def __init__(
        self, workdir: Path, replica_id: str, config: dict[str, Any], workers: int = 1
    ) -> None:
        self.id = replica_id
        #: SPEC §12 × §13: `--workers N` (one replica per host, N worker processes).
        self.workers = workers
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cfg = yaml.safe_load(yaml.safe_dump(config))  # a deep copy
        cfg["cluster"]["replica_id"] = replica_id
        # Stopped with SIGTERM at teardown: no load balancer to wait for (SPEC §7 drain delay).
        cfg.setdefault("shutdown", {}).setdefault("drain_delay_ms", 0)
        self.config_path = workdir / f"{replica_id}.yaml"
        self.config_path.write_text(yaml.safe_dump(cfg))
        self.log_path = workdir / f"{replica_id}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.stopped = False

    def start(self) -> None:
        log = self.log_path.open("ab")
        # fmt: off
        args = [
            sys.executable, "-m", "gateway.cli", "--log-level", "warning",
            "serve", "--config", str(self.config_path), "--port", str(self.port),
            "--no-access-log",
        ]
        # fmt: on
        if self.workers > 1:
            args += ["--workers", str(self.workers)]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(args, stdout=log, stderr=log, env=env)
        log.close()

    async def wait_ready(self, session: aiohttp.ClientSession, within: float = 20.0) -> None:
        deadline = time.monotonic() + within
        while True:
            assert self.proc is not None and self.proc.poll() is None, self.tail()
            try:
                async with session.get(self.url + "/readyz") as resp:
                    if resp.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            assert time.monotonic() < deadline, f"{self.id} never ready:\n{self.tail()}"
            await asyncio.sleep(0.05)

    async def state(self, session: aiohttp.ClientSession) -> dict[str, Any]:
        headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
        async with session.get(self.url + "/admin/state", headers=headers) as resp:
            assert resp.status == 200, await resp.text()
            data: dict[str, Any] = await resp.json()
            return data

    async def readyz(self, session: aiohttp.ClientSession) -> tuple[int, dict[str, Any]]:
        async with session.get(self.url + "/readyz") as resp:
            return resp.status, await resp.json()

    def signal(self, sig: signal.Signals) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)
        if sig == signal.SIGSTOP:
            self.stopped = True
        elif sig == signal.SIGCONT:
            self.stopped = False

    def kill(self) -> None:
        """`kill -9`."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        """Ends the process at teardown (resumed first if it was stopped)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        if self.stopped:
            self.proc.send_signal(signal.SIGCONT)
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)

    def tail(self, n: int = 30) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])
