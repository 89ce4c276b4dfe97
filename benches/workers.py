"""`gateway serve --workers N` (SPEC §12): what the second worker buys, and what sharing costs.

Three parts, all by default (`--only throughput|queued|handoff` runs one; `--only metrics` is a
fourth, an A/B of one process with and without prometheus-client's multiprocess mode):

throughput — requests/s through `--workers 2`, `--workers 1` and two bare aiohttp proxy
processes on one port (benches/bare_proxy.py --reuse-port: the ceiling for two processes of
this design) and one bare process (what a second process buys without any gateway), side by
side in one run, all in front of the same `gateway mock` (no latency, its
own process), driven by wrk over 127.0.0.1 at the same connection count and duration. Every
round runs every target once, the order reversed each round. Nothing is pinned: on a 2-core
machine the two proxy processes, the mock and wrk all need CPU at once, and any static split
(e.g. proxies on core 0, mock and wrk on core 1 as in e2e.py) would cap two workers at one core
and measure the split, not the workers; the kernel balances all three targets the same way.
Reported per run: req/s, p50/p99, and the CPU each part used per request (the proxy's process
tree from /proc — supervisor + workers, or both bare processes —, the mock, wrk) and the
req/s that CPU would allow on this machine's cores (`cpus / total CPU per request`): with the
load generator and the mock on the same cores, that, not the proxy alone, bounds the scaling.

queued — the queued path through HTTP: one instance of `max_concurrency` 1, a mock with a fixed
2 ms latency, 8 closed-loop clients (one connection each) against `--workers 1` and `--workers
2`: the cycle per request, latency p50/p99/max and requests per connection (how evenly the one
unit went round the waiters; see `queued`).

handoff — the core's queued-path handoff between workers: one shared pool, one instance of
`max_concurrency` 1, two processes (fork) with a `_core.Pool` each attached to one
`_core.Region` over a memfd (as the supervisor makes it). The holder releases the unit while the
other process has a request queued; the core answers the release with a wake mask
(`take_wakes()`), the holder writes the waiter's eventfd, the waiter wakes and its `tick()`
grants. The latency is CLOCK_MONOTONIC from before `release` in one process to after the grant
event in the other; the roles swap every iteration (ping-pong, synchronised on a second pair of
eventfds outside the timed window). The waiter waits either in a blocking `read` of its eventfd
or, as a worker does, in a uvloop loop with the eventfd as a reader. For scale, in one process:
the same release -> grant on a plain pool (`--workers 1`), on an attached pool with both
requests in one worker, and across two attached pools (the core's work of a cross-worker handoff
without the kernel: release, take_wakes, the other pool's tick).

    .venv/bin/python benches/workers.py --duration 10 --rounds 2 --conns 64
    .venv/bin/python benches/workers.py --only throughput --backend nginx
    .venv/bin/python benches/workers.py --only queued --duration 10 --rounds 2
    .venv/bin/python benches/workers.py --only handoff --iterations 20000 --rounds 2
    .venv/bin/python benches/workers.py --only metrics --backend nginx --duration 6 --rounds 3

Needs wrk (Debian: apt-get install wrk); `--backend nginx` needs nginx.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import shutil
import signal
import statistics
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

from _harness import (
    CLK_TCK,
    PY,
    Processes,
    WrkResult,
    cpu_seconds,
    free_port,
    one_pool_config,
    run_wrk,
    wait_port,
)

BODY = (
    '{"model":"m","messages":[{"role":"user","content":'
    '"does this compile? int main(){return 0;}"}],"max_tokens":8}'
)
# `--backend nginx`: the mock's answer to BODY, served by nginx as a constant (a backend that
# costs ~10x less CPU per request than `gateway mock`, to see what the proxies alone scale to).
CHAT = (
    '{"id":"chatcmpl-mock00000001","object":"chat.completion","created":1796070510,"model":"m",'
    '"choices":[{"index":0,"message":{"role":"assistant","content":"accepts program but each '
    'input each in runs"},"logprobs":null,"finish_reason":"length"}],"usage":{"prompt_tokens":'
    '10,"completion_tokens":8,"total_tokens":18}}'
)
MODELS = '{"object":"list","data":[{"id":"up","object":"model","owned_by":"bench"}]}'
NGINX = """daemon off; master_process off; worker_processes 1; pid {tmp}/nginx.pid;
error_log {tmp}/nginx.err warn;
events {{ worker_connections 4096; }}
http {{
  access_log off; keepalive_requests 1000000; client_body_temp_path {tmp};
  proxy_temp_path {tmp}; fastcgi_temp_path {tmp}; uwsgi_temp_path {tmp}; scgi_temp_path {tmp};
  server {{
    listen 127.0.0.1:{port};
    default_type application/json;
    location = /v1/models {{ return 200 '{models}'; }}
    location / {{ return 200 '{chat}'; }}
  }}
}}
"""
CPUS = sorted(os.sched_getaffinity(0))
ALL = ",".join(str(c) for c in CPUS)  # taskset to every CPU: not pinned


def tree(pid: int) -> list[int]:
    """`pid` and its descendants (the supervisor and its workers)."""
    out = [pid]
    try:
        kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return out
    for kid in kids:
        out += tree(int(kid))
    return out


def cpu_of(pids: list[int]) -> dict[int, float]:
    out = {}
    for pid in pids:
        with contextlib.suppress(OSError):
            out[pid] = cpu_seconds(pid)
    return out


def proc_stat() -> list[int]:
    """The machine's CPU time by kind (ticks): user nice system idle iowait irq softirq steal."""
    return [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]


def machine(before: list[int], after: list[int], seconds: float) -> tuple[float, float, float]:
    """CPUs busy (user, system, irq, softirq), idle and stolen, on average over the interval."""
    d = [b - a for a, b in zip(before, after, strict=True)]
    per = 1 / CLK_TCK / seconds
    busy = (d[0] + d[1] + d[2] + d[5] + d[6]) * per
    return busy, (d[3] + d[4]) * per, d[7] * per


def children_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


# --- throughput ---------------------------------------------------------------------------


def throughput(args: argparse.Namespace) -> None:
    mock_port, w1_port, w2_port, bare_port, bare1_port = (free_port() for _ in range(5))
    tmp, cfg = one_pool_config(w1_port, mock_port, max_concurrency=100_000)
    upstream = f"http://127.0.0.1:{mock_port}"
    with Processes() as procs:
        if args.backend == "nginx":
            conf = tmp / "nginx.conf"
            conf.write_text(NGINX.format(tmp=tmp, port=mock_port, models=MODELS, chat=CHAT))
            mock = procs.spawn(ALL, "nginx", "-c", str(conf), "-e", str(tmp / "nginx.err"))
        else:
            mock = procs.spawn(ALL, PY, "-m", "gateway.cli", "mock", "--port", str(mock_port))
        wait_port(mock_port, proc=mock)
        serve = [PY, "-m", "gateway.cli", "serve", "--config", str(cfg), "--no-access-log"]
        w1 = procs.spawn(ALL, *serve, "--port", str(w1_port), "--workers", "1")
        w2 = procs.spawn(ALL, *serve, "--port", str(w2_port), "--workers", "2")
        bare1 = procs.spawn(
            ALL, PY, "benches/bare_proxy.py", "--port", str(bare1_port), "--upstream", upstream
        )
        bare = [
            procs.spawn(
                ALL,
                PY,
                "benches/bare_proxy.py",
                "--port",
                str(bare_port),
                "--upstream",
                upstream,
                "--reuse-port",
            )
            for _ in range(2)
        ]
        for port, proc in ((w1_port, w1), (w2_port, w2), (bare_port, bare[0]), (bare1_port, bare1)):
            wait_port(port, proc=proc)
        time.sleep(1.0)  # both workers and both bare processes listening
        assert len(tree(w2.pid)) == 3, f"expected a supervisor and 2 workers: {tree(w2.pid)}"
        targets: dict[str, tuple[int, Callable[[], list[int]]]] = {
            "workers=1": (w1_port, lambda: [w1.pid]),
            "workers=2": (w2_port, lambda: tree(w2.pid)),
            "bare x2": (bare_port, lambda: [p.pid for p in bare]),
            "bare x1": (bare1_port, lambda: [bare1.pid]),
        }
        if args.direct:
            targets["direct"] = (mock_port, lambda: [])
        for port, _ in targets.values():  # warm up connections and caches
            run_wrk(f"http://127.0.0.1:{port}/v1/chat/completions", 64, 2, BODY, core=None)
        print(
            f"{len(CPUS)} CPUs; nothing pinned; wrk -t1; backend {args.backend} pid {mock.pid}",
            flush=True,
        )
        print(f"workers=2 tree: {tree(w2.pid)} (supervisor first)", flush=True)
        rows: list[dict[str, object]] = []
        for conns in args.conns:
            for rnd in range(1, args.rounds + 1):
                order = list(targets) if rnd % 2 else list(reversed(targets))
                results: dict[str, dict[str, object]] = {}
                for name in order:
                    port, pids_of = targets[name]
                    pids = pids_of()
                    c0, m0, k0 = cpu_of(pids), cpu_seconds(mock.pid), children_cpu()
                    s0, t0 = proc_stat(), time.monotonic()
                    r: WrkResult = run_wrk(
                        f"http://127.0.0.1:{port}/v1/chat/completions",
                        conns,
                        args.duration,
                        BODY,
                        core=None,
                    )
                    s1, t1 = proc_stat(), time.monotonic()
                    c1, m1, k1 = cpu_of(pids), cpu_seconds(mock.pid), children_cpu()
                    busy, idle, steal = machine(s0, s1, t1 - t0)
                    n = r.requests
                    per = {p: (c1[p] - c0[p]) / n * 1e6 for p in c1 if p in c0}
                    proxy_us = sum(per.values())
                    mock_us = (m1 - m0) / n * 1e6
                    wrk_us = (k1 - k0) / n * 1e6
                    total = proxy_us + mock_us + wrk_us
                    results[name] = {
                        "round": rnd,
                        "conns": conns,
                        "target": name,
                        "rps": r.rps,
                        "p50_ms": r.p50_ms,
                        "p99_ms": r.p99_ms,
                        "proxy_cpu_us": proxy_us,
                        "per_process_us": [round(v, 1) for v in per.values()],
                        "mock_cpu_us": mock_us,
                        "wrk_cpu_us": wrk_us,
                        "cpu_bound_rps": len(CPUS) / total * 1e6 if total else float("nan"),
                        "busy_cpus": total * r.rps / 1e6,
                        "machine_busy": busy,
                        "machine_idle": idle,
                        "machine_steal": steal,
                    }
                print(
                    f"\nround {rnd}, {conns} connections, {args.duration:.0f} s each, "
                    f"order {', '.join(order)}"
                )
                print(
                    f"{'target':10} {'req/s':>7} {'p50 ms':>7} {'p99 ms':>7} {'proxy us':>9}"
                    f" {'(per process)':>22} {'mock us':>8} {'wrk us':>7} {'CPUs busy':>9}"
                    f" {'CPU-bound req/s':>15} {'machine busy/idle/steal':>24}"
                )
                for name in targets:
                    x = results[name]
                    print(
                        f"{name:10} {x['rps']:7.0f} {x['p50_ms']:7.2f} {x['p99_ms']:7.2f}"
                        f" {x['proxy_cpu_us']:9.1f} {x['per_process_us']!s:>22}"
                        f" {x['mock_cpu_us']:8.1f} {x['wrk_cpu_us']:7.1f} {x['busy_cpus']:9.2f}"
                        f" {x['cpu_bound_rps']:15.0f}"
                        f" {x['machine_busy']:10.2f} /{x['machine_idle']:5.2f} /"
                        f"{x['machine_steal']:5.2f}"
                    )
                w1r, w2r, b2r, b1r = (
                    float(results[k]["rps"])  # type: ignore[arg-type]
                    for k in ("workers=1", "workers=2", "bare x2", "bare x1")
                )
                print(
                    f"ratios: workers=2 / workers=1 = {w2r / w1r:.2f} (target >= 1.6); "
                    f"workers=2 / bare x2 = {w2r / b2r:.2f} (target >= 0.9); "
                    f"bare x2 / bare x1 = {b2r / b1r:.2f}; workers=1 / bare x1 = {w1r / b1r:.2f}",
                    flush=True,
                )
                rows += results.values()
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1))


# --- metrics: what prometheus-client's multiprocess mode costs one process ------------------


def metrics(args: argparse.Namespace) -> None:
    """Two single-process gateways (`--workers 1`), one with `PROMETHEUS_MULTIPROC_DIR` set as
    the supervisor sets it for its workers (every metric update goes to an mmap'd file), pinned
    to core 0 like e2e.py (backend and wrk on core 1); wrk alternates between them. The CPU per
    request difference is what the whole-gateway /metrics of SPEC §12 costs each request."""
    be, a, b = free_port(), free_port(), free_port()
    tmp = Path(tempfile.mkdtemp())
    cfg = tmp / "gateway.yaml"
    cfg.write_text(
        textwrap.dedent(f"""\
        listen: {{host: 127.0.0.1, port: {a}}}
        pools:
          p:
            instances:
              - {{name: a, url: "http://127.0.0.1:{be}/v1", model: up, max_concurrency: 100000}}
        models:
          m: {{pool: p}}
        """)
    )
    (tmp / "prom").mkdir()
    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(tmp / "prom"))
    with Processes() as procs:
        if args.backend == "nginx":
            (tmp / "nginx.conf").write_text(
                NGINX.format(tmp=tmp, port=be, models=MODELS, chat=CHAT)
            )
            procs.spawn("1", "nginx", "-c", str(tmp / "nginx.conf"), "-e", str(tmp / "err"))
        else:
            procs.spawn("1", PY, "-m", "gateway.cli", "mock", "--port", str(be))
        serve = [PY, "-m", "gateway.cli", "serve", "--config", str(cfg), "--no-access-log"]
        single = procs.spawn("0", *serve, "--port", str(a))
        multi = procs.spawn("0", *serve, "--port", str(b), env=env)
        for port in (be, a, b):
            wait_port(port)
        targets = [("in-process metrics", a, single), ("multiprocess metrics", b, multi)]
        for _, port, _ in targets:
            run_wrk(f"http://127.0.0.1:{port}/v1/chat/completions", 64, 2, BODY)
        print(f"\nmetrics A/B, one process each on core 0, backend {args.backend}, 64 connections")
        for rnd in range(1, args.rounds + 1):
            for name, port, proc in targets if rnd % 2 else list(reversed(targets)):
                url = f"http://127.0.0.1:{port}/v1/chat/completions"
                r = run_wrk(url, 64, args.duration, BODY, pid=proc.pid)
                print(
                    f"{rnd:3} {name:22} {r.rps:7.0f} req/s {r.cpu_us:6.1f} CPU us/req", flush=True
                )


# --- queued: the handoff through HTTP ----------------------------------------------------


async def closed_loop(port: int, conns: int, seconds: float) -> list[list[float]]:
    """`conns` clients, one keep-alive connection each, each sending BODY again as soon as the
    previous answer is read, for `seconds`: every request's latency (s), per connection."""
    import aiohttp

    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    headers = {"Content-Type": "application/json"}

    async def client(out: list[float]) -> None:
        connector = aiohttp.TCPConnector(limit=1)
        async with aiohttp.ClientSession(connector=connector) as session:
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                t0 = time.monotonic()
                async with session.post(url, data=BODY, headers=headers) as resp:
                    await resp.read()
                    if resp.status != 200:
                        raise RuntimeError(f"{url}: {resp.status}")
                out.append(time.monotonic() - t0)

    outs: list[list[float]] = [[] for _ in range(conns)]
    await asyncio.gather(*(client(o) for o in outs))
    return outs


def queued(args: argparse.Namespace) -> None:
    """One instance of `max_concurrency` 1 behind `--workers 1` and `--workers 2`, a mock
    answering after `--queued-latency-ms`, 8 closed-loop clients on a connection each: all
    but one request wait, so the unit is handed from request to request (with 2 workers,
    between workers whenever the next waiter is in the other one). Served one at a time, so
    1 / (req/s) is the cycle per request, and with one FIFO queue every request waits for the
    7 others (latency ~ 8 cycles, every connection served equally). Reported: the cycle, the
    latency percentiles and max over all requests, and requests per connection (min / max):
    how evenly the unit went round."""
    mock_port, w1_port, w2_port = (free_port() for _ in range(3))
    _, cfg = one_pool_config(w1_port, mock_port, max_concurrency=1)
    conns = 8
    with Processes() as procs:
        mock = procs.spawn(
            ALL,
            *[PY, "-m", "gateway.cli", "mock", "--port", str(mock_port)],
            *["--latency-ms", str(args.queued_latency_ms), "--latency-dist", "fixed"],
        )
        wait_port(mock_port, proc=mock)
        serve = [PY, "-m", "gateway.cli", "serve", "--config", str(cfg), "--no-access-log"]
        w1 = procs.spawn(ALL, *serve, "--port", str(w1_port), "--workers", "1")
        w2 = procs.spawn(ALL, *serve, "--port", str(w2_port), "--workers", "2")
        for port, proc in ((w1_port, w1), (w2_port, w2)):
            wait_port(port, proc=proc)
        time.sleep(1.0)
        targets = {"workers=1": w1_port, "workers=2": w2_port}
        for port in targets.values():
            asyncio.run(closed_loop(port, conns, 1.0))
        print(
            f"\nqueued path through HTTP: max_concurrency 1, mock {args.queued_latency_ms} ms"
            f" fixed, {conns} closed-loop connections, {args.duration:.0f} s each"
        )
        print(
            f"{'round':>5} {'target':10} {'req/s':>7} {'cycle us':>9} {'p50 ms':>7}"
            f" {'p99 ms':>7} {'max ms':>8} {'requests per connection':>24}"
        )
        for rnd in range(1, args.rounds + 1):
            order = list(targets) if rnd % 2 else list(reversed(targets))
            cycle = {}
            for name in order:
                t0 = time.monotonic()
                outs = asyncio.run(closed_loop(targets[name], conns, args.duration))
                elapsed = time.monotonic() - t0
                lat = [x * 1000 for o in outs for x in o]
                rps = len(lat) / elapsed
                cycle[name] = 1e6 / rps
                counts = sorted(len(o) for o in outs)
                print(
                    f"{rnd:5} {name:10} {rps:7.1f} {cycle[name]:9.1f} {pct(lat, 0.5):7.2f}"
                    f" {pct(lat, 0.99):7.2f} {max(lat):8.1f} {counts!s:>24}",
                    flush=True,
                )
            extra = cycle["workers=2"] - cycle["workers=1"]
            print(f"round {rnd}: workers=2 adds {extra:+.1f} us per request to the cycle")


# --- handoff ------------------------------------------------------------------------------


def clock() -> int:
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def summary(name: str, ns: list[int]) -> None:
    us = [x / 1000 for x in ns]
    print(
        f"{name:58} {len(us):6} {pct(us, 0.5):8.2f} {pct(us, 0.9):8.2f} {pct(us, 0.99):8.2f}"
        f" {pct(us, 0.999):9.2f} {statistics.fmean(us):8.2f}",
        flush=True,
    )


def in_process(iterations: int, mode: str) -> list[int]:
    """release -> grant of a queued request in one process: `plain` pool, `attached` (both
    requests in worker 0 of a region) or `two-pools` (worker 0 releases, worker 1's tick
    grants: the core's part of a cross-worker handoff, no syscall)."""
    from gateway._core import REGION_BYTES, Outcome, Pool, PoolConfig, Priority, Region

    high, ok = Priority.HIGH, Outcome.SUCCESS
    a = Pool(PoolConfig(), 1)
    b = a
    if mode != "plain":
        fd = os.memfd_create("bench-handoff", os.MFD_ALLOW_SEALING)
        os.ftruncate(fd, REGION_BYTES)
        region = Region(fd, workers=2)
        a.attach(region, 1, 0)
        if mode == "two-pools":
            b = Pool(PoolConfig(), 1)
            b.attach(Region(fd), 1, 1)
    a.add_instance(1)
    if b is not a:
        b.add_instance(1)
    pools = (a, b)
    held, holder = 1, 0
    assert a.submit(held, high, 1) == 0
    out = []
    for i in range(iterations):
        hold, wait = pools[holder], pools[1 - holder]
        ticket = 2 + i
        assert wait.submit(ticket, high, 1) is None
        if wait is hold:
            t0 = clock()
            events = hold.release(held, ok, 1)
            t1 = clock()
        else:
            t0 = clock()
            hold.release(held, ok, 1)
            assert hold.take_wakes() == 1 << (1 - holder)
            events = wait.tick(1)
            t1 = clock()
            holder = 1 - holder
        assert len(events) == 1 and events[0].ticket == ticket and events[0].instance == 0
        out.append(t1 - t0)
        held = ticket
    return out


def two_processes(iterations: int, use_loop: bool, settle_us: int) -> list[int]:
    """Cross-process handoff latency (ns), see the module's docstring. The holder waits
    `settle_us` after the peer said it is queued before releasing, so that the waiter is
    asleep (in `read` or `epoll_wait`) when the wake comes; 0 races it."""
    from gateway._core import REGION_BYTES, Outcome, Pool, PoolConfig, Priority, Region

    fd = os.memfd_create("bench-handoff", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, REGION_BYTES)
    Region(fd, workers=2)  # the supervisor's header
    wake = [os.eventfd(0) for _ in range(2)]  # the measured path, as the workers use it
    sig = [os.eventfd(0) for _ in range(2)]  # synchronisation outside the timed window
    rd, wr = os.pipe()

    high, ok = Priority.HIGH, Outcome.SUCCESS

    def attached(me: int) -> Pool:
        pool = Pool(PoolConfig(), 1)
        pool.attach(Region(fd), 1, me)
        pool.add_instance(1)
        return pool

    # process 0 holds the unit first (taken before the fork: process 1 queues behind it)
    pool0 = attached(0)
    assert pool0.submit(1, high, 1) == 0

    def run(me: int, pool: Pool) -> tuple[list[int], list[int]]:
        import uvloop

        peer = 1 - me
        loop = uvloop.new_event_loop() if use_loop else None
        granted: list[object] = []
        fut = None

        def woken() -> None:
            os.eventfd_read(wake[me])
            granted.extend(pool.tick(1))
            fut.set_result(clock())  # type: ignore[union-attr]

        if loop is not None:
            loop.add_reader(wake[me], woken)
        releases, grants = [], []
        held = 1
        for i in range(iterations):
            if i % 2 == me:  # holder: wait until the peer is queued, then release
                os.eventfd_read(sig[me])
                if settle_us:
                    until = clock() + settle_us * 1000
                    while clock() < until:
                        pass
                t0 = clock()
                pool.release(held, ok, 1)
                mask = pool.take_wakes()
                os.eventfd_write(wake[peer], 1)  # always, so a wrong mask cannot hang the run
                if mask != 1 << peer:
                    raise AssertionError(f"wake mask {mask:#b}, expected {1 << peer:#b}")
                releases.append(t0)
                os.eventfd_read(sig[me])  # the peer was granted
            else:  # waiter: queue, say so, wait for the wake, tick
                ticket = 2 + i
                assert pool.submit(ticket, high, 1) is None
                os.eventfd_write(sig[peer], 1)
                if loop is None:
                    os.eventfd_read(wake[me])
                    events = pool.tick(1)
                    t1 = clock()
                else:
                    fut = loop.create_future()
                    t1 = loop.run_until_complete(fut)
                    events, granted[:] = list(granted), []
                assert len(events) == 1 and events[0].ticket == ticket, events
                grants.append(t1)
                held = ticket
                os.eventfd_write(sig[peer], 1)
        return releases, grants

    pid = os.fork()
    if pid == 0:
        try:
            os.close(rd)
            rel, gr = run(1, attached(1))
            with os.fdopen(wr, "w") as f:
                json.dump([rel, gr], f)
        finally:
            os._exit(0)
    os.close(wr)
    signal.alarm(300)  # a failed assert in the child would leave this process waiting
    rel0, gr0 = run(0, pool0)
    signal.alarm(0)
    with os.fdopen(rd) as f:
        rel1, gr1 = json.load(f)
    os.waitpid(pid, 0)
    for f in (fd, *wake, *sig):
        os.close(f)
    # iteration i: the holder is i % 2; process 0 releases at even i, process 1 grants then.
    out = []
    for i in range(iterations):
        if i % 2 == 0:
            out.append(gr1[i // 2] - rel0[i // 2])
        else:
            out.append(gr0[i // 2] - rel1[i // 2])
    return out


def handoff(args: argparse.Namespace) -> None:
    n = args.iterations
    print(f"\nqueued-path handoff, release -> grant of a queued request, {n} iterations each (us)")
    print(f"{'case':58} {'n':>6} {'p50':>8} {'p90':>8} {'p99':>8} {'p99.9':>9} {'mean':>8}")
    for _ in range(args.rounds):
        summary("1 process, plain pool (--workers 1)", in_process(n, "plain"))
        summary("1 process, attached pool, both requests in worker 0", in_process(n, "attached"))
        summary("1 process, 2 attached pools (core only, no syscall)", in_process(n, "two-pools"))
        for settle in sorted({args.settle_us, 0}, reverse=True):
            when = f"asleep ({settle} us)" if settle else "just queued"
            summary(f"2 processes, blocking read, waiter {when}", two_processes(n, False, settle))
            summary(f"2 processes, uvloop loop, waiter {when}", two_processes(n, True, settle))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=("throughput", "queued", "handoff", "metrics"))
    ap.add_argument(
        "--queued-latency-ms", type=float, default=2.0, help="queued: the mock's fixed latency"
    )
    ap.add_argument("--duration", type=float, default=10.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument(
        "--conns", type=lambda s: [int(x) for x in s.split(",")], default=[64], help="e.g. 64,8"
    )
    ap.add_argument("--direct", action="store_true", help="also wrk straight at the backend")
    ap.add_argument(
        "--backend",
        choices=("mock", "nginx"),
        default="mock",
        help="`gateway mock` (default), or nginx answering the same JSON as a constant",
    )
    ap.add_argument("--iterations", type=int, default=20000, help="handoff iterations per case")
    ap.add_argument(
        "--settle-us", type=int, default=200, help="handoff: the holder's pause before release"
    )
    ap.add_argument("--json", help="write the throughput rows to this file")
    args = ap.parse_args()
    if args.only != "handoff" and not shutil.which("wrk"):
        print("wrk is required (apt-get install wrk)", file=sys.stderr)
        return 2
    if args.only in (None, "throughput"):
        throughput(args)
    if args.only == "metrics":  # not by default
        metrics(args)
    if args.only in (None, "queued"):
        queued(args)
    if args.only in (None, "handoff"):
        handoff(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
