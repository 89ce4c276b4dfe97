"""Batch API throughput when the backend, not the gateway, is the bound (SPEC §14).

`benches/batch.py` measures a batch against a mock with spare capacity (what the machinery
costs); this one asks the question a platform team asks: with a pool of 4 slots answering in
20 ms (4 x 50/s = 200 lines/s at most), how close does a batch come to keeping every slot busy?

It starts `gateway mock --latency-ms 20` and `gateway serve --no-access-log` over it (one
instance, `max_concurrency` 4), each store fresh, and for each store (SQLite in a temp
directory; PostgreSQL: a throwaway cluster made with `initdb` as tests/postgres_fixture.py
makes it, fsync off) runs two shapes through the official wire protocol (upload, create, poll
`GET /v1/batches/{id}` every 50 ms):

- one batch of `--lines` lines (2,000);
- `--batches` batches (60) of `--per-batch` lines (20) from one key, created at once.

It reports lines/s from the first create to the last `completed` (validation and finalization
included: what a client waits), the slot usage that rate means (lines/s / 200), and the gateway
process's CPU per line (user + system, every thread, from /proc). `--rounds` repeats each cell
(a fresh gateway each time) so the spread on a shared machine shows.

    .venv/bin/python benches/batch_throughput.py [--lines 2000] [--batches 60] [--per-batch 20]
        [--rounds 2] [--stores sqlite,postgresql] [--latency-ms 20] [--slots 4]
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import yaml

from _harness import PY, Processes, cpu_seconds, free_port, wait_port

CHAT = "/v1/chat/completions"
FINAL = ("completed", "failed", "cancelled", "expired")


def body(i: int) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": f"line {i}"}], "max_tokens": 8}


def jsonl(tag: str, n: int) -> bytes:
    return b"".join(
        orjson.dumps({"custom_id": f"{tag}-{i}", "method": "POST", "url": CHAT, "body": body(i)})
        + b"\n"
        for i in range(n)
    )


async def create(session: aiohttp.ClientSession, base: str, data: bytes) -> str:
    form = aiohttp.FormData()
    form.add_field("purpose", "batch")
    form.add_field("file", data, filename="in.jsonl")
    async with session.post(base + "/v1/files", data=form) as resp:
        f = await resp.json()
        assert resp.status == 200, f
    spec = {"input_file_id": f["id"], "endpoint": CHAT, "completion_window": "24h"}
    async with session.post(base + "/v1/batches", json=spec) as resp:
        b = await resp.json()
        assert resp.status == 200, b
    return str(b["id"])


async def finished(session: aiohttp.ClientSession, base: str, ids: list[str], n: int) -> float:
    """Polls the batch list every 50 ms (one request however many batches: the bench's own
    polling must not load the gateway) until every batch in `ids` is final; returns when
    (monotonic) the last was seen `completed`."""
    left = set(ids)
    while True:
        async with session.get(f"{base}/v1/batches?limit=100") as resp:
            page = await resp.json()
        for b in page["data"]:
            if b["id"] in left and b["status"] in FINAL:
                assert b["status"] == "completed", b
                assert b["request_counts"]["completed"] == n, b
                left.discard(b["id"])
        if not left:
            return time.monotonic()
        await asyncio.sleep(0.05)


async def each_finished(
    session: aiohttp.ClientSession, base: str, batch_id: str, n: int, every_s: float
) -> float:
    """One client per batch polling `GET /v1/batches/{id}` every `every_s` (as an SDK user
    waiting for each batch does); returns when (monotonic) it was seen `completed`."""
    while True:
        async with session.get(f"{base}/v1/batches/{batch_id}") as resp:
            b = await resp.json()
        if b["status"] in FINAL:
            assert b["status"] == "completed" and b["request_counts"]["completed"] == n, b
            return time.monotonic()
        await asyncio.sleep(every_s)


async def over_http(session: aiohttp.ClientSession, base: str, n: int) -> float:
    """The same requests sent by a client at low priority, 64 in flight: what the slots give
    a request that does not go through the batch machinery (lines/s' real ceiling)."""
    todo = iter(range(n))

    async def worker() -> None:
        for i in todo:
            async with session.post(
                base + CHAT, json=body(i), headers={"X-Priority": "low"}
            ) as resp:
                await resp.read()
                assert resp.status == 200, resp.status

    t0 = time.monotonic()
    await asyncio.gather(*(worker() for _ in range(64)))
    return n / (time.monotonic() - t0)


async def shape(
    base: str, pid: int, batches: int, per_batch: int, http_n: int, poll_each_ms: int
) -> tuple[float, float, float]:
    """(lines/s from the first upload to the last `completed`, gateway CPU-us per line, the
    same number of requests per second over HTTP)."""
    files = [jsonl(f"b{j}", per_batch) for j in range(batches)]
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        http = await over_http(session, base, http_n) if http_n else 0.0
        cpu0, t0 = cpu_seconds(pid), time.monotonic()
        ids = await asyncio.gather(*(create(session, base, data) for data in files))
        if poll_each_ms:
            ends = await asyncio.gather(
                *(each_finished(session, base, i, per_batch, poll_each_ms / 1000) for i in ids)
            )
            end = max(ends)
        else:
            end = await finished(session, base, ids, per_batch)
        cpu = cpu_seconds(pid) - cpu0
    n = batches * per_batch
    return n / (end - t0), cpu * 1e6 / n, http


def gateway_config(
    tmp: Path, port: int, mock_port: int, store: str, args: argparse.Namespace
) -> Path:
    batch: dict[str, Any] = {"store": store}
    if args.in_flight_per_batch:
        batch["in_flight_per_batch"] = args.in_flight_per_batch
    doc: dict[str, Any] = {
        "listen": {"host": "127.0.0.1", "port": port},
        "health": {"probe": {"enabled": False}},
        "shutdown": {"drain_delay_ms": 0},
        "pools": {
            "p": {
                "instances": [
                    {
                        "name": "a",
                        "url": f"http://127.0.0.1:{mock_port}/v1",
                        "model": "up",
                        "max_concurrency": args.slots,
                    }
                ]
            }
        },
        "models": {"m": {"pool": "p"}},
        "batch": batch,
    }
    if args.low_max_wait_ms:
        doc["scheduler"] = {"low": {"max_wait_ms": args.low_max_wait_ms}}
    cfg = tmp / f"gw-{port}.yaml"
    cfg.write_text(yaml.safe_dump(doc))
    return cfg


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lines", type=int, default=2000, help="lines of the one big batch")
    ap.add_argument("--batches", type=int, default=60)
    ap.add_argument("--per-batch", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--stores", default="sqlite,postgresql")
    ap.add_argument("--latency-ms", type=int, default=20)
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument(
        "--http-requests", type=int, default=400, help="low requests over HTTP first (0: none)"
    )
    ap.add_argument(
        "--poll-each-ms",
        type=int,
        default=0,
        help="poll each batch on its own at this interval (0: one list request every 50 ms)",
    )
    ap.add_argument("--in-flight-per-batch", type=int, default=0, help="0: the default (64)")
    ap.add_argument(
        "--low-max-wait-ms", type=int, default=0, help="scheduler.low.max_wait_ms (0: default)"
    )
    args = ap.parse_args()
    stores = args.stores.split(",")
    ceiling = args.slots * 1000 / args.latency_ms
    tmp = Path(tempfile.mkdtemp(prefix="gateway-bench-batch-tp-"))
    pg = None
    procs = Processes()
    try:
        mock_port = free_port()
        mock = procs.spawn(
            "1", PY, "-m", "gateway.cli", "mock", "--port", str(mock_port),
            "--latency-ms", str(args.latency_ms),
        )  # fmt: skip
        wait_port(mock_port, proc=mock)
        if "postgresql" in stores:
            sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
            from postgres_fixture import PostgresServer

            pg = PostgresServer()
            pg.start()
        print(
            f"{args.slots} slots x {args.latency_ms} ms: at most {ceiling:.0f} lines/s; "
            "lines/s from the first upload to the last completed"
        )
        print(
            "  round  store        shape          lines/s   slots busy   gateway CPU-us/line"
            "   HTTP req/s"
        )
        shapes = [(1, args.lines), (args.batches, args.per_batch)]
        for r in range(1, args.rounds + 1):
            for store in stores:
                for batches, per_batch in shapes:
                    if store == "sqlite":
                        url = str(tmp / f"s-{r}-{batches}.db")
                    else:
                        assert pg is not None
                        url = pg.new_database()
                    port = free_port()
                    cfg = gateway_config(tmp, port, mock_port, url, args)
                    gw_procs = Processes()
                    try:
                        gw = gw_procs.spawn(
                            "0", PY, "-m", "gateway.cli", "serve", "--config", str(cfg),
                            "--no-access-log",
                        )  # fmt: skip
                        wait_port(port, proc=gw)
                        rate, cpu, http = asyncio.run(
                            shape(
                                f"http://127.0.0.1:{port}", gw.pid, batches, per_batch,
                                args.http_requests, args.poll_each_ms,
                            )
                        )  # fmt: skip
                    finally:
                        gw_procs.stop_all()
                    what = f"{batches} x {per_batch}"
                    print(
                        f"  {r:5}  {store:11}  {what:12}  {rate:8.1f}   {rate / ceiling:9.0%}"
                        f"   {cpu:19.0f}   {http:10.1f}",
                        flush=True,
                    )
    finally:
        procs.stop_all()
        if pg is not None:
            pg.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
