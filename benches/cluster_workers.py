"""Cluster mode with `--workers 2` (SPEC §12 × §13: one replica per host, one worker of it the
member that talks to Redis) against `--workers 2` alone: what the composition costs per
request. Issue 20 asks for CPU per request within 5 %.

The same layout as benches/cluster.py (whose config, alternation and report this reuses):
a `redis-server` (free port, no persistence), the mock backend, and two gateways — `off`
(`--workers 2`, no `cluster:` section) and `on` (`--workers 2`, a one-host cluster on that
Redis, with a per-key rpm limit far above the load so the leased-limit path runs too: each
worker takes its own chunks). Neither gateway is pinned (two workers on a 2-core machine need
both cores; the kernel balances both gateways the same way); the mock and Redis run on core 1
as in cluster.py, wrk on core 1. For each connection count wrk runs against `off` and `on`
alternately, `--rounds` times each (which goes first alternates); reported: the medians of
req/s, p50/p99, the CPU time per request of the gateway's whole process tree (supervisor and
workers, /proc), their on/off ratios, each round's CPU ratio (the spread: the machine is shared),
and Redis's script calls per request (the background syncs only). Before the load, both gateways'
idle CPU per process (`--idle` seconds, both measured over the same seconds): the background
work the composition adds (the member's syncs and publication, the other worker's following),
a fixed CPU per second whose share per request is larger the lower the rate.

    .venv/bin/python benches/cluster_workers.py --duration 3 --rounds 8

Needs wrk, taskset and redis-server (Debian: apt-get install wrk util-linux redis-server).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from _harness import PY, Processes, cpu_seconds, free_port, wait_port
from cluster import alternate, config, report, run

CPUS = ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))


def _children(pid: int) -> list[int]:
    with contextlib.suppress(OSError):
        return sorted(int(k) for k in Path(f"/proc/{pid}/task/{pid}/children").read_text().split())
    return []


def idle(pids: dict[str, int], seconds: float) -> None:
    """CPU per second of each gateway's supervisor and workers at rest, over the same
    `seconds` (the workers in slot order: with `cluster:` the member is whichever holds the
    host's lock, usually the first)."""
    procs = {name: [pid, *_children(pid)] for name, pid in pids.items()}
    before = {p: cpu_seconds(p) for ps in procs.values() for p in ps}
    time.sleep(seconds)
    after = {p: cpu_seconds(p) for ps in procs.values() for p in ps}
    print(f"\nidle CPU over {seconds:.0f} s, ms per second (supervisor, then each worker)")
    for name, ps in procs.items():
        each = [(after[p] - before[p]) / seconds * 1000 for p in ps]
        print(
            f"{name:>6} total {sum(each):6.1f}: " + " ".join(f"{x:5.1f}" for x in each),
            flush=True,
        )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=3.0, help="seconds per wrk run")
    ap.add_argument("--rounds", type=int, default=6, help="off/on alternations per case")
    ap.add_argument("--workers", type=int, default=2, help="workers of each gateway")
    ap.add_argument("--conns", default="64,8", help="connection counts, comma-separated")
    ap.add_argument(
        "--idle", type=float, default=10.0, help="seconds of the idle CPU look (0: none)"
    )
    args = ap.parse_args()
    for tool in ("wrk", "taskset", "redis-server", "redis-cli"):
        if not shutil.which(tool):
            print(f"{tool} is required (apt-get install wrk util-linux redis-server)")
            return 2
    tmp = Path(tempfile.mkdtemp())
    redis_port, mock_port, off_port, on_port = free_port(), free_port(), free_port(), free_port()
    (tmp / "off.yaml").write_text(config(off_port, mock_port, ""))
    cluster = f'cluster: {{redis_url: "redis://127.0.0.1:{redis_port}/0", replica_id: bench}}'
    (tmp / "on.yaml").write_text(config(on_port, mock_port, cluster))
    procs = Processes()
    spawn = procs.spawn
    try:
        # fmt: off
        spawn("1", "redis-server", "--port", str(redis_port), "--bind", "127.0.0.1",
              "--save", "", "--appendonly", "no", "--dir", str(tmp))
        # fmt: on
        spawn("1", PY, "-m", "gateway.cli", "mock", "--port", str(mock_port))
        wait_port(redis_port)
        wait_port(mock_port)
        gw = {
            name: spawn(
                CPUS,
                PY,
                "-m",
                "gateway.cli",
                "serve",
                "--config",
                str(tmp / f"{name}.yaml"),
                "--no-access-log",
                "--workers",
                str(args.workers),
            )
            for name in ("off", "on")
        }
        wait_port(off_port)
        wait_port(on_port)
        urls = {
            "off": f"http://127.0.0.1:{off_port}/v1/chat/completions",
            "on": f"http://127.0.0.1:{on_port}/v1/chat/completions",
        }
        for name in ("off", "on"):  # warm up: connections, and the lease grows to the load
            run(urls[name], 64, 2.0, gw[name].pid)
        if args.idle > 0:
            idle({name: proc.pid for name, proc in gw.items()}, args.idle)
        for conns in (int(c) for c in args.conns.split(",")):
            runs = [
                alternate(urls, gw, redis_port, conns, args.duration, i) for i in range(args.rounds)
            ]
            report(conns, runs)
            ratios = [r["on"][0].cpu_us / r["off"][0].cpu_us for r in runs]  # type: ignore[operator]
            print(
                f"CPU on/off per round: {' '.join(f'{x:.3f}' for x in ratios)}"
                f" (mean {statistics.mean(ratios):.3f}, min {min(ratios):.3f},"
                f" max {max(ratios):.3f})",
                flush=True,
            )
    finally:
        procs.stop_all()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
