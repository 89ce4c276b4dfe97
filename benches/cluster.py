"""Cluster mode's cost on the request path (SPEC §13: "No Redis round trip on the per-request
path"): the same gateway config with and without `cluster:`, side by side in one run.

Started here: a `redis-server` (free port, no persistence), the mock backend (`gateway mock`),
and two gateway processes — `off` (no `cluster:` section) and `on` (a one-replica cluster on that
Redis, with a per-key rpm limit far above the load so the leased-limit path runs too). The
gateways are pinned to core 0; the mock, Redis and wrk to core 1. For each connection count wrk
runs against `off` and `on` alternately, `--rounds` times each (which goes first alternates), and
we report the medians of req/s, p50/p99 and the gateway process's CPU time per request (/proc,
user + system), their on/off ratios, and Redis's own count of script calls (EVALSHA: the
gateway's round trips to it) during each run divided by that run's requests — the background
syncs only, two per `renew_ms` whatever the rate (the `off` row shows the idle `on` gateway's
syncs during the `off` run: the same background).

    .venv/bin/python benches/cluster.py --duration 3 --rounds 6

Needs wrk, taskset and redis-server (Debian: apt-get install wrk util-linux redis-server).
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import tempfile
import textwrap
from pathlib import Path

from _harness import PY, Processes, WrkResult, free_port, run_wrk, wait_port

BODY = (
    '{"model":"m","messages":[{"role":"user","content":'
    '"does this compile? int main(){return 0;}"}],"max_tokens":8}'
)
KEY = "sk-bench-0000001"


def redis_calls(port: int) -> int:
    """Script calls Redis has answered so far (EVALSHA + EVAL in INFO commandstats): the
    gateway's round trips to Redis."""
    out = subprocess.run(
        ["redis-cli", "-p", str(port), "INFO", "commandstats"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return sum(int(n) for n in re.findall(r"^cmdstat_eval(?:sha)?:calls=(\d+)", out, re.M))


def run(url: str, conns: int, duration: float, pid: int) -> WrkResult:
    """One wrk run of the bench's request, as its tenant, measuring the gateway `pid`."""
    return run_wrk(url, conns, duration, BODY, headers={"Authorization": f"Bearer {KEY}"}, pid=pid)


def alternate(
    urls: dict[str, str],
    gw: dict[str, subprocess.Popen[bytes]],
    redis_port: int,
    conns: int,
    duration: float,
    i: int,
) -> dict[str, tuple[WrkResult, float]]:
    """One `off` run and one `on` run back to back (which goes first alternates), each with
    the Redis round trips per request made meanwhile."""
    out: dict[str, tuple[WrkResult, float]] = {}
    for name in ("off", "on") if i % 2 == 0 else ("on", "off"):
        before = redis_calls(redis_port)
        res = run(urls[name], conns, duration, gw[name].pid)
        out[name] = (res, (redis_calls(redis_port) - before) / res.requests)
    return out


def report(conns: int, runs: list[dict[str, tuple[WrkResult, float]]]) -> None:
    """Medians over the alternations, and on/off ratios of the medians."""

    def med(name: str, field: str) -> float:
        values = sorted(getattr(run[name][0], field) for run in runs)
        return (
            values[len(values) // 2]
            if len(values) % 2
            else sum(values[len(values) // 2 - 1 : len(values) // 2 + 1]) / 2
        )

    def rtt(name: str) -> float:
        return max(run[name][1] for run in runs)

    print(f"\n{conns} connections, {len(runs)} alternating runs of each, medians")
    print(
        f"{'mode':>6} {'req/s':>8} {'p50 ms':>7} {'p99 ms':>7} {'CPU us/req':>10}"
        f" {'Redis RTT/req (max)':>20}"
    )
    for name in ("off", "on"):
        print(
            f"{name:>6} {med(name, 'rps'):8.0f} {med(name, 'p50_ms'):7.2f} "
            f"{med(name, 'p99_ms'):7.2f} {med(name, 'cpu_us'):10.1f} {rtt(name):20.4f}"
        )
    ratio = {f: med("on", f) / med("off", f) for f in ("rps", "p50_ms", "p99_ms", "cpu_us")}
    print(
        f"{'on/off':>6} {ratio['rps']:8.3f} {ratio['p50_ms']:7.3f} {ratio['p99_ms']:7.3f} "
        f"{ratio['cpu_us']:10.3f}",
        flush=True,
    )


def config(gw_port: int, mock_port: int, cluster: str) -> str:
    return textwrap.dedent(f"""\
        listen: {{host: 127.0.0.1, port: {gw_port}}}
        pools:
          p:
            instances:
              - {{name: a, url: "http://127.0.0.1:{mock_port}/v1", model: up,
                  max_concurrency: 1000}}
        models:
          m: {{pool: p}}
        auth:
          keys:
            - {{key: "{KEY}", name: bench, rpm: 100000000}}
        {cluster}
        """)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=3.0, help="seconds per wrk run")
    ap.add_argument("--rounds", type=int, default=6, help="off/on alternations per case")
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
                "0",
                PY,
                "-m",
                "gateway.cli",
                "serve",
                "--config",
                str(tmp / f"{name}.yaml"),
                "--no-access-log",
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
        for conns in (64, 8, 1):
            report(
                conns,
                [
                    alternate(urls, gw, redis_port, conns, args.duration, i)
                    for i in range(args.rounds)
                ],
            )
    finally:
        procs.stop_all()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
