"""What the benchmarks share: ports, child processes pinned to a core, /proc accounting, a wrk
run, and an in-process gateway. Imported by the scripts beside it (`from _harness import ...`:
a script's own folder is on `sys.path`)."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gateway.app import Gateway

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
CLK_TCK = os.sysconf("SC_CLK_TCK")

__all__ = [
    "CLK_TCK",
    "PY",
    "ROOT",
    "Processes",
    "WrkResult",
    "cpu_seconds",
    "free_port",
    "pinned",
    "run_wrk",
    "serving",
    "stop",
    "tree_cpu_seconds",
    "wait_port",
]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(
    port: int, timeout: float = 20.0, proc: subprocess.Popen[bytes] | None = None
) -> None:
    """Returns once something accepts connections on `port`; raises `RuntimeError` after
    `timeout` seconds, or as soon as `proc` (the process meant to listen) has exited."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited ({proc.returncode}) before listening on {port}")
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listening on {port}")


def cpu_seconds(pid: int) -> float:
    """The CPU time (user + system) process `pid` has used so far, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def tree_cpu_seconds(pid: int) -> float:
    """The CPU time of process `pid` and every descendant alive now (a supervisor and its
    workers), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(entry))
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        with contextlib.suppress(OSError):
            total += cpu_seconds(p)
        todo.extend(children.get(p, ()))
    return total


def pinned(core: str, cmd: Sequence[str]) -> list[str]:
    """`cmd` run on CPU `core` (taskset), or as it is where taskset is missing."""
    return ["taskset", "-c", core, *cmd] if shutil.which("taskset") else list(cmd)


def terminate(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM twice: a gateway's second signal skips its drain delay (`shutdown.drain_delay_ms`,
    for load balancers), which a benchmark has no use for."""
    for attempt in range(2):
        if attempt:
            # Two signals sent at once merge into one (standard signals do not queue).
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(0.1)
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)


def stop(proc: subprocess.Popen[bytes], timeout: float = 10.0) -> None:
    """SIGTERM (twice), then SIGKILL if `proc` has not exited within `timeout` seconds."""
    if proc.poll() is not None:
        return
    terminate(proc)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class Processes:
    """The child processes of one benchmark, each pinned to a core, stopped together:
    `with Processes() as procs: procs.spawn("1", PY, "-m", "gateway.cli", "mock", ...)`."""

    def __init__(self) -> None:
        self.started: list[subprocess.Popen[bytes]] = []

    def spawn(
        self,
        core: str,
        *cmd: str,
        env: dict[str, str] | None = None,
        output: IO[Any] | int = subprocess.DEVNULL,
    ) -> subprocess.Popen[bytes]:
        """Starts `cmd` from the repository root on CPU `core`; its output goes to `output`
        (dropped by default)."""
        p = subprocess.Popen(pinned(core, cmd), cwd=ROOT, env=env, stdout=output, stderr=output)
        self.started.append(p)
        return p

    def stop_all(self) -> None:
        """SIGTERM to every process at once, then each is waited for (SIGKILL after 10 s)."""
        for p in self.started:
            terminate(p)
        for p in self.started:
            stop(p)

    def __enter__(self) -> Processes:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()


@dataclass
class WrkResult:
    """One wrk run: throughput, latency percentiles and the CPU a process spent per request."""

    conns: int
    rps: float
    p50_ms: float
    p99_ms: float
    requests: int
    cpu_us: float | None  # CPU time of the measured process per request (None: not measured)
    name: str = ""


def one_pool_config(port: int, mock_port: int, max_concurrency: int) -> tuple[Path, Path]:
    """A temporary directory and the one-pool gateway config in it (one instance: the mock)."""
    tmp = Path(tempfile.mkdtemp())
    cfg = tmp / "gateway.yaml"
    cfg.write_text(
        textwrap.dedent(f"""\
        listen: {{host: 127.0.0.1, port: {port}}}
        pools:
          p:
            instances:
              - {{name: a, url: "http://127.0.0.1:{mock_port}/v1", model: up,
                  max_concurrency: {max_concurrency}}}
        models:
          m: {{pool: p}}
        """)
    )
    return tmp, cfg


def wrk_latency_ms(text: str, pct: str) -> float:
    """The `pct`% latency of wrk's `--latency` distribution, in ms (NaN when absent)."""
    m = re.search(rf"^\s*{pct}%\s+([\d.]+)(us|ms|s)\s*$", text, re.M)
    if not m:
        return float("nan")
    value, unit = float(m.group(1)), m.group(2)
    return value / 1000 if unit == "us" else value * 1000 if unit == "s" else value


def run_wrk(
    url: str,
    conns: int,
    duration: float,
    body: str,
    *,
    headers: dict[str, str] | None = None,
    pid: int | None = None,
    pids: Sequence[int] = (),
    core: str | None = "1",
) -> WrkResult:
    """POSTs the JSON `body` to `url` for `duration` seconds over `conns` connections (wrk, one
    thread, pinned to CPU `core`; `None`: not pinned), measuring `pid`'s CPU time meanwhile
    (with its descendants'), or the sum of `pids`' (each with its descendants).
    Raises `RuntimeError` when any answer was not 2xx."""
    lines = ['wrk.method = "POST"', f'wrk.body = "{_lua_string(body)}"']
    for name, value in {"Content-Type": "application/json", **(headers or {})}.items():
        lines.append(f'wrk.headers["{name}"] = "{_lua_string(value)}"')
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as script:
        script.write("\n".join(lines) + "\n")
    cmd = ["wrk", "-t1", f"-c{conns}", f"-d{max(1, round(duration))}s", "--latency"]
    measured = [pid] if pid else list(pids)

    def cpu() -> float:
        return sum(tree_cpu_seconds(p) for p in measured)

    cpu0 = cpu()
    try:
        out = subprocess.run(
            pinned(core, [*cmd, "-s", script.name, url])
            if core
            else [*cmd, "-s", script.name, url],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    finally:
        os.unlink(script.name)
    cpu1 = cpu()
    if "Non-2xx" in out:
        raise RuntimeError(f"errors from {url}:\n{out}")
    total = int(re.search(r"(\d+) requests in", out).group(1))  # type: ignore[union-attr]
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    cpu_us = (cpu1 - cpu0) / total * 1e6 if measured else None
    p50, p99 = wrk_latency_ms(out, "50"), wrk_latency_ms(out, "99")
    return WrkResult(conns, rps, p50, p99, total, cpu_us)


def _lua_string(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"')


@contextlib.asynccontextmanager
async def serving(text: str, source: str = "bench") -> AsyncIterator[tuple[Gateway, str]]:
    """The gateway of config `text`, in this process on an ephemeral port: (its `Gateway`,
    its base URL); shut down on exit."""
    from gateway.config import parse_config
    from gateway.server import Server

    server = Server(parse_config(text, env={}, source=source), host="127.0.0.1", port=0)
    await server.start()
    try:
        yield server.gateway, server.url
    finally:
        await server.shutdown()
