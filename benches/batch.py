"""Batch API throughput and the CPU cost of the batch machinery itself (SPEC §14).

One process tree: the mock backend (`gateway mock`, no latency, spare capacity) and the gateway
(`gateway serve --no-access-log`, a fresh SQLite store in a temp directory) are started here;
with `taskset` available the gateway is pinned to core 0 and the mock and this client to core 1.
Each round runs the same N chat requests twice through the gateway:

1. over HTTP, `X-Priority: low`, with as many requests in flight as the batch keeps
   (`batch.in_flight_per_batch`, 64) — the cost of the requests themselves;
2. as one Batch API batch: upload (`POST /v1/files`), create, poll `GET /v1/batches/{id}`
   every 50 ms until `completed`.

It reports the batch's lines/s while `in_progress`, the time spent validating and finalizing,
and the gateway process's CPU time per request from /proc (user + system, every thread: the
store's SQLite thread and the validator included). CPU per line of the batch minus CPU per
request over HTTP is what a line costs beside the same request sent by a client: negative when
the batch machinery costs less than the HTTP ingress (parsing, the response) it does without.

To isolate the machinery itself, a second part runs the gateway in this process (the mock
stays a subprocess, on the other core) and compares the same N requests sent straight through
`Gateway.call` — the seam every batch line goes through, 64 at a time — with the same N as a
batch; this process's CPU time (`time.process_time`, all threads) per request/line is
compared. The difference is validation, the upload, the store's thread and group commits,
leasing, the pump, output records and finalization, per line.

A third part compares the stores (SPEC §14 "Across hosts"): the same batch against SQLite,
then PostgreSQL (a throwaway cluster made with `initdb`, as the tests make it: fsync off, so
it measures the gateway and the queries, not a disk) with one gateway replica, then two
replicas on the one database (the batch created through the first; both run its lines). It
reports lines/s while `in_progress`, the CPU per line of the gateway processes together, and
of the PostgreSQL server's processes.

    .venv/bin/python benches/batch.py [--lines 10000] [--rounds 2] [--store-lines 10000]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import uvloop
import yaml

from _harness import PY, Processes, cpu_seconds, free_port, terminate, wait_port
from gateway.auth import ANONYMOUS
from gateway.config import parse_config
from gateway.messages import ENDPOINTS
from gateway.server import Server

CHAT = "/v1/chat/completions"
IN_FLIGHT = 64


def body(i: int) -> dict[str, Any]:
    text = f"does submission {i} compile? int main(){{return 0;}}"
    return {"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": 8}


@dataclass
class Http:
    wall_s: float
    cpu_us: float  # gateway CPU per request


@dataclass
class BatchRun:
    validate_s: float  # created → in_progress (seen by polling)
    run_s: float  # in_progress → finalizing or completed
    finalize_s: float  # → completed
    lines_per_s: float
    cpu_us: float  # gateway CPU per line, upload to completed


async def over_http(session: aiohttp.ClientSession, base: str, n: int, pid: int) -> Http:
    todo = iter(range(n))
    headers = {"X-Priority": "low"}

    async def worker() -> None:
        for i in todo:
            async with session.post(base + CHAT, json=body(i), headers=headers) as resp:
                await resp.read()
                assert resp.status == 200, resp.status

    cpu0, t0 = cpu_seconds(pid), time.monotonic()
    await asyncio.gather(*(worker() for _ in range(IN_FLIGHT)))
    wall, cpu = time.monotonic() - t0, cpu_seconds(pid) - cpu0
    return Http(wall, cpu * 1e6 / n)


async def as_batch(session: aiohttp.ClientSession, base: str, n: int, pid: int) -> BatchRun:
    data = b"".join(
        orjson.dumps({"custom_id": f"c{i}", "method": "POST", "url": CHAT, "body": body(i)}) + b"\n"
        for i in range(n)
    )
    cpu0, t0 = cpu_seconds(pid), time.monotonic()
    form = aiohttp.FormData()
    form.add_field("purpose", "batch")
    form.add_field("file", data, filename="bench.jsonl")
    async with session.post(base + "/v1/files", data=form) as resp:
        f = await resp.json()
    spec = {"input_file_id": f["id"], "endpoint": CHAT, "completion_window": "24h"}
    async with session.post(base + "/v1/batches", json=spec) as resp:
        b = await resp.json()
    seen: dict[str, float] = {}
    while b["status"] not in ("completed", "failed", "cancelled", "expired"):
        await asyncio.sleep(0.05)
        async with session.get(f"{base}/v1/batches/{b['id']}") as resp:
            b = await resp.json()
        seen.setdefault(b["status"], time.monotonic())
    cpu = cpu_seconds(pid) - cpu0
    assert b["status"] == "completed" and b["request_counts"]["completed"] == n, b
    started = seen.get("in_progress", t0)
    ended = seen.get("finalizing", seen["completed"])
    return BatchRun(
        validate_s=started - t0,
        run_s=ended - started,
        finalize_s=seen["completed"] - ended,
        lines_per_s=n / max(ended - started, 1e-9),
        cpu_us=cpu * 1e6 / n,
    )


async def rounds(base: str, pid: int, n: int, count: int) -> None:
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        await over_http(session, base, 500, pid)  # warm up
        for rnd in range(1, count + 1):
            http = await over_http(session, base, n, pid)
            batch = await as_batch(session, base, n, pid)
            print(f"\nround {rnd}: {n} requests, {IN_FLIGHT} in flight")
            rate = n / http.wall_s
            print(f"  HTTP  low priority   {rate:8.0f} req/s   {http.cpu_us:7.1f} CPU-us/req")
            print(
                f"  batch                {batch.lines_per_s:8.0f} lines/s {batch.cpu_us:7.1f} "
                f"CPU-us/line (validate {batch.validate_s:.2f} s, finalize "
                f"{batch.finalize_s:.2f} s)"
            )
            print(
                f"  batch machinery      {batch.cpu_us - http.cpu_us:+7.1f} CPU-us/line", flush=True
            )


async def in_process(cfg: dict[str, Any], n: int, count: int) -> None:
    server = Server(parse_config(yaml.safe_dump(cfg), env={}), port=0)
    await server.start()
    gw = server.gateway
    base = server.url
    endpoint = ENDPOINTS[CHAT]
    raws = [orjson.dumps(body(i)) for i in range(n)]

    async def direct(count_: int) -> float:
        todo = iter(range(count_))

        async def worker() -> None:
            for i in todo:
                status, _ = await gw.call(endpoint, raws[i % n], ANONYMOUS, request_id=f"b{i}")
                assert status == 200, status

        cpu0 = time.process_time()
        await asyncio.gather(*(worker() for _ in range(IN_FLIGHT)))
        return (time.process_time() - cpu0) * 1e6 / count_

    try:
        async with aiohttp.ClientSession() as session:
            await direct(500)  # warm up
            for rnd in range(1, count + 1):
                call_us = await direct(n)
                cpu0 = time.process_time()
                run = await as_batch(session, base, n, os.getpid())
                batch_us = (time.process_time() - cpu0) * 1e6 / n
                print(
                    f"  round {rnd}: Gateway.call {call_us:6.1f} CPU-us/req · batch "
                    f"{batch_us:6.1f} CPU-us/line ({run.lines_per_s:.0f} lines/s) · "
                    f"batch machinery {batch_us - call_us:+6.1f} CPU-us/line",
                    flush=True,
                )
    finally:
        await server.shutdown(drain=False)


def postgres_cpu_seconds() -> float:
    """CPU time (user + system) of every `postgres` process (the bench's server: the machine
    runs no other)."""
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)
        except OSError:
            continue
        if fields[0].endswith("(postgres"):
            parts = fields[1].split()
            total += int(parts[11]) + int(parts[12])
    return total / os.sysconf("SC_CLK_TCK")


async def store_run(bases: list[str], pids: list[int], n: int) -> tuple[float, float, float]:
    """(lines/s, gateway CPU-us/line over every replica, PostgreSQL CPU-us/line)."""
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        await over_http(session, bases[0], 200, pids[0])  # warm up
        cpu0 = sum(cpu_seconds(p) for p in pids)
        pg0 = postgres_cpu_seconds()
        run = await as_batch(session, bases[0], n, pids[0])
        cpu = sum(cpu_seconds(p) for p in pids) - cpu0
        pg = postgres_cpu_seconds() - pg0
    return run.lines_per_s, cpu * 1e6 / n, pg * 1e6 / n


def compare_stores(tmp: Path, mock_port: int, n: int) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from postgres_fixture import PostgresServer

    print(f"\nstores: one batch of {n} lines")
    print("  store       replicas   lines/s   gateway CPU-us/line   PostgreSQL CPU-us/line")
    pg = PostgresServer()
    pg.start()
    try:
        for store, replicas in (("sqlite", 1), ("postgresql", 1), ("postgresql", 2)):
            url = str(tmp / f"{store}.db") if store == "sqlite" else pg.new_database()
            ports = [free_port() for _ in range(replicas)]
            procs = Processes()
            try:
                gws = []
                for i, port in enumerate(ports):
                    cfg = tmp / f"{store}-{i}.yaml"
                    cfg.write_text(
                        textwrap.dedent(f"""\
                        listen: {{host: 127.0.0.1, port: {port}}}
                        health: {{probe: {{enabled: false}}}}
                        shutdown: {{drain_delay_ms: 0}}
                        pools:
                          p:
                            instances:
                              - {{name: a, url: "http://127.0.0.1:{mock_port}/v1", model: up,
                                  max_concurrency: 1000}}
                        models:
                          m: {{pool: p}}
                        batch: {{store: "{url}", in_flight_per_batch: {IN_FLIGHT}}}
                        """)
                    )
                    gws.append(
                        procs.spawn(
                            "0",
                            PY,
                            "-m",
                            "gateway.cli",
                            "serve",
                            "--config",
                            str(cfg),
                            "--no-access-log",
                        )
                    )
                for port in ports:
                    wait_port(port)
                bases = [f"http://127.0.0.1:{port}" for port in ports]
                rate, cpu, pg_cpu = asyncio.run(store_run(bases, [g.pid for g in gws], n))
                pg_text = f"{pg_cpu:10.1f}" if store != "sqlite" else "         -"
                print(f"  {store:11} {replicas:8}   {rate:7.0f}   {cpu:19.1f}   {pg_text}",
                      flush=True)  # fmt: skip
            finally:
                procs.stop_all()
    finally:
        pg.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lines", type=int, default=10_000)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--store-lines", type=int, default=10_000)
    ap.add_argument("--stores-only", action="store_true", help="only the store comparison")
    args = ap.parse_args()
    pin = shutil.which("taskset") is not None
    mock_port, gw_port = free_port(), free_port()
    tmp = Path(tempfile.mkdtemp(prefix="gateway-bench-batch-"))
    cfg = tmp / "gateway.yaml"
    cfg.write_text(
        textwrap.dedent(f"""\
        listen: {{host: 127.0.0.1, port: {gw_port}}}
        health: {{probe: {{enabled: false}}}}
        pools:
          p:
            instances:
              - {{name: a, url: "http://127.0.0.1:{mock_port}/v1", model: up,
                  max_concurrency: 1000}}
        models:
          m: {{pool: p}}
        batch: {{store: "{tmp / "batches.db"}", in_flight_per_batch: {IN_FLIGHT}}}
        """)
    )
    procs = Processes()
    spawn = procs.spawn
    try:
        spawn("1", PY, "-m", "gateway.cli", "mock", "--port", str(mock_port))
        wait_port(mock_port)
        if pin:
            os.sched_setaffinity(0, {1})
        if args.stores_only:
            compare_stores(tmp, mock_port, args.store_lines)
            return 0
        gw = spawn("0", PY, "-m", "gateway.cli", "serve", "--config", str(cfg), "--no-access-log")
        wait_port(gw_port)
        if pin:
            os.sched_setaffinity(0, {1})
        asyncio.run(rounds(f"http://127.0.0.1:{gw_port}", gw.pid, args.lines, args.rounds))
        terminate(gw)
        gw.wait(10)
        cfg_in = yaml.safe_load(cfg.read_text())
        cfg_in["listen"]["port"] = 0
        cfg_in["batch"]["store"] = str(tmp / "in-process.db")
        print("\nin process: Gateway.call (the seam) vs the batch, this process's CPU")
        uvloop.run(in_process(cfg_in, args.lines, args.rounds))
        compare_stores(tmp, mock_port, args.store_lines)
    finally:
        procs.stop_all()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
