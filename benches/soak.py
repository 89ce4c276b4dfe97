"""Soak with faults: a real `gateway serve` under steady mixed traffic for minutes, faults on.

Not a CI test: a benchmark that watches for leaks and stuck state. The gateway (one process,
pinned to core 0) fronts one pool of `--mocks` `gateway mock` instances (core 1, with this
script). An open-loop Poisson load (`--rate` req/s in total) mixes non-stream and stream chat
requests, high and low priority (`X-Priority`), clients that disconnect mid-stream and clients
that give up early. Every `--fault-every` s one fault is injected, in turn:

- `crash`: one instance goes down and comes back (`POST /mock/crash {"for_s": 8}`);
- `5xx`: a burst of 503s from one instance (`POST /mock/config`, fail_rate 0.6, 6 s);
- `stall`: streams stop mid-way on one instance (fail_mode stall, 6 s; the gateway's
  `stream_idle_ms` ends them);
- `hang`: no first byte from one instance (fail_mode hang, 6 s; `first_byte_ms` ends them);
- `reset`: connections reset by one instance (fail_mode reset, 6 s);
- `kill`: one mock process SIGKILLed and restarted on its port 6 s later;
- `slow`: one instance's latency to 1.5 s for 6 s (queues build).

Every `--sample-s` s (default 10) it samples the gateway process: RSS (VmRSS), open fds,
threads, and the asyncio task count if /metrics or /admin/state exposes one (today neither
does: the report says so); plus requests done, status counts, and /admin/state queued and
in-flight. At the end: the time series, the least-squares slope per hour of RSS and fds over
the second half (after warm-up), and queued / in-flight after traffic stops (must be 0).

    .venv/bin/python benches/soak.py                       # 10 minutes
    .venv/bin/python benches/soak.py --minutes 1 --json soak.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp

from _harness import PY, ROOT, cpu_seconds, free_port, pinned, stop, wait_port

FAULTS = ("crash", "5xx", "stall", "hang", "reset", "kill", "slow")
FAULT_S = 6.0  # how long a config fault lasts


def proc_status(pid: int) -> dict[str, int]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "Threads"):
            out[key] = int(value.split()[0])
    return out


def fd_kinds(pid: int, listen_port: int, upstream_ports: set[int]) -> dict[str, int]:
    """The gateway's fds by kind: client connections (to its listening port), upstream
    connections (to a mock), the listener, other sockets, and non-sockets."""
    inodes: dict[str, str] = {}
    out = {"client": 0, "upstream": 0, "listen": 0, "other_socket": 0, "non_socket": 0}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes[link[8:-1]] = "other_socket"
        else:
            out["non_socket"] += 1
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                f = line.split()
                if f[9] not in inodes:
                    continue
                local_port = int(f[1].rsplit(":", 1)[1], 16)
                remote_port = int(f[2].rsplit(":", 1)[1], 16)
                if f[3] == "0A":
                    inodes[f[9]] = "listen"
                elif local_port == listen_port:
                    inodes[f[9]] = "client"
                elif remote_port in upstream_ports:
                    inodes[f[9]] = "upstream"
    for kind in inodes.values():
        out[kind] += 1
    return out


def slope_per_hour(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (seconds, value), per hour."""
    if len(points) < 3:
        return None
    n = len(points)
    mx = sum(p[0] for p in points) / n
    my = sum(p[1] for p in points) / n
    sxx = sum((p[0] - mx) ** 2 for p in points)
    if sxx == 0:
        return None
    sxy = sum((p[0] - mx) * (p[1] - my) for p in points)
    return sxy / sxx * 3600


class Mock:
    def __init__(self, name: str, port: int, seed: int, log: Path) -> None:
        self.name = name
        self.port = port
        self.seed = seed
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None
        self.base = f"http://127.0.0.1:{port}"

    def start(self) -> None:
        with self.log.open("ab") as logf:
            self.proc = subprocess.Popen(
                pinned(
                    "1",
                    [
                        PY,
                        "-m",
                        "gateway.cli",
                        "mock",
                        "--port",
                        str(self.port),
                        "--model",
                        "up",
                        "--latency-ms",
                        "40",
                        "--latency-dist",
                        "lognormal",
                        "--tokens-per-s",
                        "100",
                        "--tokens",
                        "16",
                        "--seed",
                        str(self.seed),
                    ],
                ),
                cwd=ROOT,
                stdout=logf,
                stderr=logf,
            )
        wait_port(self.port, 30.0, self.proc)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None:
            stop(self.proc)


class Load:
    """The open-loop client: Poisson arrivals, a mix of request kinds; counts outcomes."""

    def __init__(self, session: aiohttp.ClientSession, url: str, args: argparse.Namespace) -> None:
        self.session = session
        self.url = url
        self.args = args
        self.rng = random.Random(args.seed)
        self.outcomes: Counter[str] = Counter()  # cumulative
        self.window: Counter[str] = Counter()  # since the last sample
        self.kinds: Counter[str] = Counter()
        self.sent = 0
        self.done = 0
        self.skipped = 0
        self.tasks: set[asyncio.Task[None]] = set()
        self.latencies: list[float] = []
        self.running = True

    def record(self, outcome: str) -> None:
        self.outcomes[outcome] += 1
        self.window[outcome] += 1
        self.done += 1

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        next_t = loop.time()
        while self.running:
            next_t += self.rng.expovariate(self.args.rate)
            delay = next_t - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            if not self.running:
                break
            if len(self.tasks) >= self.args.max_outstanding:
                self.skipped += 1
                continue
            task = loop.create_task(self.one())
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def one(self) -> None:
        rng = self.rng
        a = self.args
        stream = rng.random() < a.stream_share
        priority = "high" if rng.random() < a.high_share else "low"
        r = rng.random()
        behaviour = "normal"
        if stream and r < a.disconnect_share:
            behaviour = "disconnect"
        elif r < a.disconnect_share + a.early_timeout_share:
            behaviour = "early-timeout"
        kind = f"{'stream' if stream else 'json'}/{priority}/{behaviour}"
        self.kinds[kind] += 1
        self.sent += 1
        body = {
            "model": "m",
            "messages": [{"role": "user", "content": f"question {self.sent}: is this linear?"}],
            "max_tokens": rng.randint(4, 24),
            "stream": stream,
        }
        headers = {"X-Priority": priority}
        timeout_s = rng.uniform(0.03, 0.3) if behaviour == "early-timeout" else a.client_timeout
        t0 = time.monotonic()
        outcome = "?"
        try:
            async with asyncio.timeout(timeout_s):
                async with self.session.post(self.url, json=body, headers=headers) as resp:
                    if not stream or resp.status != 200:
                        await resp.read()
                        outcome = str(resp.status)
                    else:
                        events = 0
                        done = False
                        error = False
                        cut_after = rng.randint(1, 6) if behaviour == "disconnect" else -1
                        async for line in resp.content:
                            if not line.startswith(b"data:"):
                                continue
                            if line.startswith(b"data: [DONE]"):
                                done = True
                                continue
                            if b'"error"' in line:
                                error = True
                            events += 1
                            if events == cut_after:
                                resp.close()  # drop the connection mid-stream
                                break
                        if cut_after > 0 and events >= cut_after:
                            outcome = "client-disconnect"
                        elif error:
                            outcome = "200+error-event"
                        elif not done:
                            outcome = "200-no-done"
                        else:
                            outcome = "200"
        except TimeoutError:
            outcome = "client-timeout" if behaviour == "early-timeout" else "client-timeout-LATE"
        except aiohttp.ClientPayloadError:
            outcome = "payload-error"
        except aiohttp.ClientError as exc:
            outcome = f"client-error:{type(exc).__name__}"
        except OSError as exc:
            outcome = f"os-error:{type(exc).__name__}"
        self.record(outcome)
        if outcome == "200" and behaviour == "normal":
            self.latencies.append(time.monotonic() - t0)

    async def drain(self, wait_s: float) -> int:
        self.running = False
        if self.tasks:
            _, pending = await asyncio.wait(set(self.tasks), timeout=wait_s)
            for t in pending:
                t.cancel()
            return len(pending)
        return 0


async def fetch_state(session: aiohttp.ClientSession, base: str) -> dict[str, Any] | None:
    try:
        async with asyncio.timeout(3):
            async with session.get(base + "/admin/state") as resp:
                data: dict[str, Any] = await resp.json()
                return data
    except (aiohttp.ClientError, TimeoutError, OSError, ValueError):
        return None


async def fetch_metrics(session: aiohttp.ClientSession, base: str) -> str | None:
    try:
        async with asyncio.timeout(3):
            async with session.get(base + "/metrics") as resp:
                return await resp.text()
    except (aiohttp.ClientError, TimeoutError, OSError):
        return None


_TASK_RE = re.compile(r"^(\w*tasks?\w*)(\{[^}]*\})?\s+([0-9.e+]+)$", re.M)


def task_gauge(metrics: str | None, state: dict[str, Any] | None) -> float | None:
    """An asyncio task count, if the gateway exposes one (a metric or state field named *task*)."""
    if metrics:
        total = None
        for m in _TASK_RE.finditer(metrics):
            total = (total or 0.0) + float(m.group(3))
        if total is not None:
            return total
    if state:
        for key in ("tasks", "asyncio_tasks", "task_count"):
            if isinstance(state.get(key), int | float):
                return float(state[key])
    return None


def queued_in_flight(state: dict[str, Any] | None) -> tuple[int | None, int | None, str]:
    if state is None:
        return None, None, "?"
    queued = in_flight = 0
    inst = []
    for pool in state.get("pools", {}).values():
        q = pool.get("queued", {})
        queued += int(q.get("high", 0)) + int(q.get("low", 0))
        in_flight += int(pool.get("in_flight", 0))
        for i in pool.get("instances", []):
            mark = {"healthy": "h", "half_open": "o", "ejected": "e"}.get(i.get("state"), "?")
            inst.append(f"{i['name']}:{mark}{i.get('in_flight', 0)}")
    return queued, in_flight, " ".join(inst)


async def faults(
    mocks: list[Mock],
    session: aiohttp.ClientSession,
    args: argparse.Namespace,
    log: list[dict[str, Any]],
    t_start: float,
    stop: asyncio.Event,
) -> None:
    """Starts fault k at t_start + k * fault_every, cycling through FAULTS and the instances;
    on `stop`, lets the running ones finish (each restores its instance)."""
    rng = random.Random(args.seed + 1)
    running: set[asyncio.Task[None]] = set()
    k = 0
    while True:
        k += 1
        due = k * args.fault_every
        if due > args.minutes * 60.0 - 10.0:
            break  # none that would still be on when traffic stops
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), max(0.0, t_start + due - time.monotonic()))
        if stop.is_set():
            break
        kind = FAULTS[(k - 1) % len(FAULTS)]
        mock = mocks[(k - 1) % len(mocks)]
        entry = {"t": round(time.monotonic() - t_start, 1), "fault": kind, "instance": mock.name}
        log.append(entry)
        print(f"  [{entry['t']:6.1f} s] fault {kind} on {mock.name}", flush=True)
        task = asyncio.create_task(inject(kind, mock, session, entry, rng))
        running.add(task)
        task.add_done_callback(running.discard)
    if running:
        await asyncio.wait(set(running))


async def inject(
    kind: str,
    mock: Mock,
    session: aiohttp.ClientSession,
    entry: dict[str, Any],
    rng: random.Random,
) -> None:
    try:
        if kind == "crash":
            await post(session, mock.base + "/mock/crash", {"for_s": 8.0})
        elif kind == "kill":
            mock.kill()
            await asyncio.sleep(FAULT_S)
            await asyncio.to_thread(mock.start)
        else:
            patches: dict[str, dict[str, Any]] = {
                "5xx": {"fail_rate": 0.6, "fail_mode": "status", "fail_status": 503},
                "stall": {
                    "fail_rate": 0.4,
                    "fail_mode": "stall",
                    "fail_after_chunks": rng.randint(2, 6),
                },
                "hang": {"fail_rate": 0.4, "fail_mode": "hang"},
                "reset": {"fail_rate": 0.4, "fail_mode": "reset"},
                "slow": {"latency_ms": 1500.0},
            }
            await post(session, mock.base + "/mock/config", patches[kind])
            await asyncio.sleep(FAULT_S)
            await post(
                session,
                mock.base + "/mock/config",
                {"fail_rate": 0.0, "latency_ms": 40.0, "fail_mode": "status"},
            )
    except Exception as exc:  # a fault that could not be injected is reported, not fatal
        entry["error"] = f"{type(exc).__name__}: {exc}"
        print(f"  fault {kind} on {mock.name} failed: {entry['error']}", flush=True)


async def post(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> None:
    async with asyncio.timeout(5):
        async with session.post(url, json=body) as resp:
            await resp.read()
            if resp.status != 200:
                raise RuntimeError(f"{url}: HTTP {resp.status}")


def gateway_config(path: Path, port: int, mocks: list[Mock]) -> None:
    instances = "\n".join(
        f'          - {{name: {m.name}, url: "{m.base}/v1", model: up, max_concurrency: 48}}'
        for m in mocks
    )
    path.write_text(
        textwrap.dedent("""\
        listen: {host: 127.0.0.1, port: %d}
        scheduler:
          high: {capacity: 300, max_wait_ms: 10000}
          low: {capacity: 600, max_wait_ms: 20000}
        health:
          failure_threshold: 3
          ejection_ms: 4000
          max_ejection_ms: 20000
          probe: {interval_ms: 2000, timeout_ms: 1000}
        timeouts:
          connect_ms: 1000
          first_byte_ms: 3000
          stream_idle_ms: 2000
          total_ms: 30000
        retries: {max_attempts: 3}
        pools:
          p:
            instances:
        """)
        % port
        + instances
        + "\nmodels:\n  m: {pool: p}\n"
    )


def start_gateway(cmd: list[str], port: int, log: Path) -> subprocess.Popen[bytes]:
    """`gateway serve` pinned to core 0. The gateway is being edited by others while this
    runs: a failed start is retried (8 tries, 20 s apart)."""
    for attempt in range(1, 9):
        with log.open("ab") as logf:
            gw = subprocess.Popen(pinned("0", cmd), cwd=ROOT, stdout=logf, stderr=logf)
        try:
            wait_port(port, 30.0, gw)
            return gw
        except RuntimeError as exc:
            tail = log.read_text(errors="replace").strip().splitlines()[-1:]
            print(
                f"gateway did not start ({exc}; {' '.join(tail)[:200]}); attempt {attempt}/8",
                file=sys.stderr,
                flush=True,
            )
            if gw.poll() is None:
                gw.kill()
                gw.wait()
            if attempt == 8:
                raise
            time.sleep(20)
    raise AssertionError("unreachable")


async def soak(
    args: argparse.Namespace,
    gw: subprocess.Popen[bytes],
    gw_port: int,
    mocks: list[Mock],
    tmp: Path,
) -> dict[str, Any]:
    pid = gw.pid
    base = f"http://127.0.0.1:{gw_port}"
    print(f"gateway pid {pid} on {base}; {args.mocks} mocks; logs in {tmp}", flush=True)
    samples: list[dict[str, Any]] = []
    fault_log: list[dict[str, Any]] = []
    connector = aiohttp.TCPConnector(limit=args.max_outstanding + 50)
    ctl = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=20))
    session = aiohttp.ClientSession(connector=connector)
    load = Load(session, base + "/v1/chat/completions", args)
    stop_faults = asyncio.Event()
    duration = args.minutes * 60.0
    t_start = time.monotonic()
    task_note: str | None = None
    last_cpu = [time.monotonic(), cpu_seconds(pid)]

    async def sample(phase: str) -> dict[str, Any]:
        nonlocal task_note
        st = proc_status(pid)
        fds = len(os.listdir(f"/proc/{pid}/fd"))
        kinds = fd_kinds(pid, gw_port, {m.port for m in mocks})
        now, cpu = time.monotonic(), cpu_seconds(pid)
        cpu_pct = 100 * (cpu - last_cpu[1]) / max(1e-9, now - last_cpu[0])
        last_cpu[:] = [now, cpu]
        state = await fetch_state(ctl, base)
        metrics = await fetch_metrics(ctl, base)
        tasks = task_gauge(metrics, state)
        if tasks is None:
            task_note = (
                "the gateway exposes no asyncio task count (nothing named *task* in /metrics "
                "or /admin/state): fds, RSS and threads stand in for it"
            )
        queued, in_flight, inst = queued_in_flight(state)
        row = {
            "t": round(time.monotonic() - t_start, 1),
            "phase": phase,
            "rss_kb": st.get("VmRSS"),
            "hwm_kb": st.get("VmHWM"),
            "threads": st.get("Threads"),
            "cpu_pct": round(cpu_pct, 1),
            "fds": fds,
            "fd_kinds": kinds,
            "tasks": tasks,
            "sent": load.sent,
            "done": load.done,
            "outstanding": len(load.tasks),
            "skipped": load.skipped,
            "window": dict(load.window),
            "queued": queued,
            "in_flight": in_flight,
            "instances": inst,
        }
        load.window.clear()
        samples.append(row)
        return row

    def show(row: dict[str, Any]) -> None:
        w = row["window"]
        ok = w.get("200", 0)
        other = ", ".join(f"{k} {v}" for k, v in sorted(w.items()) if k != "200")
        kinds = row["fd_kinds"]
        print(
            f"  {row['t']:7.1f} s  RSS {row['rss_kb'] / 1024:6.1f} MB  fds {row['fds']:4d} "
            f"(cl {kinds['client']} up {kinds['upstream']})  thr {row['threads']:2d}  "
            f"CPU {row['cpu_pct']:3.0f}%  done {row['done']:6d}  q {row['queued']}  "
            f"inflight {row['in_flight']}  [{row['instances']}]  200: {ok}  {other}",
            flush=True,
        )

    try:
        show(await sample("idle"))
        load_task = asyncio.create_task(load.run())
        fault_task = asyncio.create_task(faults(mocks, ctl, args, fault_log, t_start, stop_faults))
        next_sample = t_start + args.sample_s
        while time.monotonic() - t_start < duration:
            await asyncio.sleep(max(0.0, min(next_sample, t_start + duration) - time.monotonic()))
            if time.monotonic() >= next_sample:
                show(await sample("load"))
                next_sample += args.sample_s
            if gw.poll() is not None:
                raise RuntimeError(f"the gateway exited ({gw.returncode}); see {tmp}/gateway.log")
        # Traffic stops; faults stop (a running one finishes and restores its instance).
        stop_faults.set()
        load.running = False
        await load_task
        t_stop = time.monotonic()
        print(f"  traffic stopped at {t_stop - t_start:.1f} s; waiting for the clients", flush=True)
        unfinished = await load.drain(args.drain_s)
        # Queued and in-flight must come back to 0 once no client is left.
        final_state = None
        zero_after = None
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            final_state = await fetch_state(ctl, base)
            q, f, _ = queued_in_flight(final_state)
            if q == 0 and f == 0:
                zero_after = round(time.monotonic() - t_stop, 1)
                break
            await asyncio.sleep(0.5)
        await fault_task
        await asyncio.sleep(2)  # let connection close-down and timers settle
        show(await sample("after"))
        # The clients' keep-alive connections are the gateway's fds too: close them, then
        # what is left is the listener, the upstream pools' idle connections and this probe.
        await session.close()
        await asyncio.sleep(2)
        show(await sample("closed"))
        q, f, inst = queued_in_flight(final_state)
    finally:
        stop_faults.set()
        load.running = False
        await session.close()
        await ctl.close()

    half = duration / 2
    second = [s for s in samples if s["phase"] == "load" and s["t"] >= half]
    lat = sorted(load.latencies)
    return {
        "benchmark": "soak",
        "args": vars(args),
        "tmp": str(tmp),
        "samples": samples,
        "faults": fault_log,
        "outcomes": dict(load.outcomes),
        "kinds": dict(load.kinds),
        "sent": load.sent,
        "done": load.done,
        "skipped": load.skipped,
        "unfinished_clients": unfinished,
        "ok_latency_s": {
            "p50": lat[len(lat) // 2] if lat else None,
            "p99": lat[min(len(lat) - 1, int(len(lat) * 0.99))] if lat else None,
        },
        "slope_rss_mb_per_h": (
            s / 1024
            if (s := slope_per_hour([(x["t"], x["rss_kb"]) for x in second])) is not None
            else None
        ),
        "slope_fds_per_h": slope_per_hour([(x["t"], x["fds"]) for x in second]),
        "slope_threads_per_h": slope_per_hour([(x["t"], x["threads"]) for x in second]),
        # fds that are not connections (pipes, eventfds, files, stray sockets): their count
        # does not follow the load, so a slope here is a leak, not traffic
        "slope_other_fds_per_h": slope_per_hour(
            [
                (x["t"], x["fds"] - x["fd_kinds"]["client"] - x["fd_kinds"]["upstream"])
                for x in second
            ]
        ),
        "slope_samples": len(second),
        "final_queued": q,
        "final_in_flight": f,
        "final_instances": inst,
        "zero_after_stop_s": zero_after,
        "task_gauge_note": task_note,
    }


def report(r: dict[str, Any]) -> None:
    print("\n### Time series\n")
    print(
        "| t s | phase | RSS MB | fds (client / upstream) | threads | CPU % | tasks | done "
        "| outstanding | queued | in-flight | instances | outcomes in the interval |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|")
    for s in r["samples"]:
        w = ", ".join(f"{k} {v}" for k, v in sorted(s["window"].items()))
        tasks = "-" if s["tasks"] is None else f"{s['tasks']:.0f}"
        print(
            f"| {s['t']:.0f} | {s['phase']} | {s['rss_kb'] / 1024:.1f} "
            f"| {s['fds']} ({s['fd_kinds']['client']} / {s['fd_kinds']['upstream']}) "
            f"| {s['threads']} | {s['cpu_pct']:.0f} | {tasks} | {s['done']} | {s['outstanding']} "
            f"| {s['queued']} | {s['in_flight']} | {s['instances']} | {w} |"
        )
    print("\n### Faults\n")
    for fault in r["faults"]:
        print(
            f"- {fault['t']:.0f} s: {fault['fault']} on {fault['instance']}"
            + (f" (failed: {fault['error']})" if fault.get("error") else "")
        )
    print("\n### Summary\n")
    total = sum(r["outcomes"].values())
    print(
        f"- requests sent {r['sent']}, finished {r['done']}, skipped (client cap) "
        f"{r['skipped']}, unfinished at the end {r['unfinished_clients']}"
    )
    print(
        "- outcomes: "
        + ", ".join(
            f"{k} {v} ({v / total:.1%})"
            for k, v in sorted(r["outcomes"].items(), key=lambda x: -x[1])
        )
    )
    lat = r["ok_latency_s"]
    if lat["p50"] is not None:
        print(
            f"- successful plain requests, end to end: p50 {lat['p50'] * 1000:.0f} ms, "
            f"p99 {lat['p99'] * 1000:.0f} ms"
        )

    def f(v: float | None, unit: str) -> str:
        return "n/a (too few samples)" if v is None else f"{v:+.2f} {unit}/h"

    print(
        f"- second half ({r['slope_samples']} samples): RSS {f(r['slope_rss_mb_per_h'], 'MB')}, "
        f"fds {f(r['slope_fds_per_h'], 'fds')} (not connections: "
        f"{f(r['slope_other_fds_per_h'], 'fds')}), threads {f(r['slope_threads_per_h'], '')}"
    )
    ok = r["final_queued"] == 0 and r["final_in_flight"] == 0
    print(
        f"- after traffic stopped: queued {r['final_queued']}, in-flight {r['final_in_flight']} "
        f"({'OK' if ok else 'NOT ZERO'}; zero after {r['zero_after_stop_s']} s); "
        f"instances {r['final_instances']}"
    )
    if r["task_gauge_note"]:
        print(f"- note: {r['task_gauge_note']}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--rate", type=float, default=120.0, help="requests/s in total (Poisson)")
    ap.add_argument("--mocks", type=int, default=3, help="instances in the pool (2-3)")
    ap.add_argument("--stream-share", type=float, default=0.5)
    ap.add_argument("--high-share", type=float, default=0.3)
    ap.add_argument(
        "--disconnect-share",
        type=float,
        default=0.05,
        help="of streams: the client drops the connection after 1-6 events",
    )
    ap.add_argument(
        "--early-timeout-share",
        type=float,
        default=0.03,
        help="of requests: the client gives up after 30-300 ms",
    )
    ap.add_argument("--client-timeout", type=float, default=60.0, help="everyone else's timeout")
    ap.add_argument("--max-outstanding", type=int, default=600, help="client-side cap")
    ap.add_argument("--fault-every", type=float, default=20.0, help="seconds between faults")
    ap.add_argument("--sample-s", type=float, default=10.0)
    ap.add_argument("--drain-s", type=float, default=60.0, help="wait for clients at the end")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--access-log", action="store_true", help="gateway logs every request")
    ap.add_argument("--json", help="save the time series and summary here")
    args = ap.parse_args()
    with contextlib.suppress(OSError):
        os.sched_setaffinity(0, {1})  # the load generator shares core 1 with the mocks
    import uvloop

    # SIGTERM (e.g. from `timeout`) unwinds like Ctrl-C, so the child processes are stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    tmp = Path(tempfile.mkdtemp(prefix="soak-"))
    mocks = [Mock(f"m{i}", free_port(), i + 1, tmp / f"mock{i}.log") for i in range(args.mocks)]
    gw: subprocess.Popen[bytes] | None = None
    try:
        for m in mocks:
            m.start()
        gw_port = free_port()
        cfg = tmp / "gateway.yaml"
        gateway_config(cfg, gw_port, mocks)
        cmd = [PY, "-m", "gateway.cli", "serve", "--config", str(cfg)]
        if not args.access_log:
            cmd.append("--no-access-log")
        gw = start_gateway(cmd, gw_port, tmp / "gateway.log")
        result = uvloop.run(soak(args, gw, gw_port, mocks, tmp))
    finally:
        if gw is not None:
            stop(gw, 30.0)
        for m in mocks:
            m.stop()
    result["gateway_exit"] = gw.returncode if gw is not None else None
    report(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
        print(f"\nsaved: {args.json}")
    ok = result["final_queued"] == 0 and result["final_in_flight"] == 0
    if ok and result["gateway_exit"] == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        print(f"logs kept in {tmp}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
