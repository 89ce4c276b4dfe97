"""Token streams: S concurrent SSE streams through the gateway vs the bare aiohttp proxy.

The LLM workload a gateway actually carries: many long-lived streams, each a trickle of small
`chat.completion.chunk` events. For each stream count S and each target (direct to the
upstream, the bare aiohttp proxy `benches/bare_proxy.py`, the gateway, optionally nginx) the
load client opens S streams (staggered over `--stagger` s), each `--events` events
`--interval-ms` apart plus `data: [DONE]`. Every event carries its send time
(`time.monotonic_ns()`, CLOCK_MONOTONIC, the same clock in every process on Linux), so the
client measures each event's delay; the direct run is the baseline the proxies add to.

Processes: the upstream (raw uvloop protocol, events pre-built, chunked encoding) and the load
client (raw uvloop protocol, its own process) on core 1; the proxy under test on core 0, a
fresh process for every measurement (so its RSS starts from the same idle state).

Per target and S: events/s relayed; the proxy's CPU time per relayed event (utime + stime from
/proc/PID/stat over the client's run, stream setup included); event delay p50/p99/max and what
the proxy adds over direct; time to first chunk p50 and its addition; the proxy's RSS idle
(after a warm-up), at peak, and per open stream ((peak - idle) / S).

    .venv/bin/python benches/stream.py                          # S = 100, 400; 2 rounds
    .venv/bin/python benches/stream.py --streams 50,100 --rounds 1 --json stream.json
    .venv/bin/python benches/stream.py --nginx                  # also nginx, the ceiling

Needs taskset (util-linux); `--nginx` needs nginx on PATH (apt-get install nginx).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path
from typing import Any, cast

from _harness import PY, ROOT, cpu_seconds, free_port, pinned, stop, wait_port

HERE = Path(__file__).resolve()
TS_DIGITS = 20  # the send timestamp, zero-padded in a JSON string: every event has one length

# ---- shared helpers ---------------------------------------------------------------------------


def sched_ns(pid: int) -> int:
    """Time on CPU of every thread of `pid`, in ns (/proc/PID/task/*/schedstat): finer than
    the clock ticks of /proc/PID/stat (10 ms), kept in the JSON as a cross-check."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):
            total += int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0])
    return total


def status_kb(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def pct(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    return sorted_values[min(len(sorted_values) - 1, int(len(sorted_values) * q))]


# ---- the upstream: answers any POST with a paced SSE stream -----------------------------------


def build_events(n: int) -> tuple[list[tuple[bytes, bytes]], bytes, int]:
    """Per event index: (chunk-size line + `data: {...,"t":"`, `"}` + blank line + CRLF); the
    timestamp goes between. Returns also the [DONE] chunk + terminator and the first event's
    size (`data: ` to the blank line)."""
    events = []
    sizes = []
    for i in range(n):
        last = i == n - 1
        delta = b"{}" if last else b'{"content":" tok%03d"}' % (i % 1000)
        finish = b'"stop"' if last else b"null"
        head = (
            b'data: {"id":"chatcmpl-bench01","object":"chat.completion.chunk",'
            b'"created":1764460800,"model":"up","choices":[{"index":0,"delta":'
            + delta
            + b',"logprobs":null,"finish_reason":'
            + finish
            + b'}],"t":"'
        )
        tail = b'"}\n\n'
        size = len(head) + TS_DIGITS + len(tail)
        sizes.append(size)
        events.append((b"%x\r\n" % size + head, tail + b"\r\n"))
    done = b"data: [DONE]\n\n"
    return events, b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done), sizes[0]


_SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n"
)
_MODELS = b'{"object":"list","data":[{"id":"up","object":"model","created":0,"owned_by":"b"}]}'
_MODELS_RESP = (
    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
    % (len(_MODELS), _MODELS)
)


def run_upstream(port: int, n_events: int, interval_ms: int) -> None:
    import uvloop

    events, done, _ = build_events(n_events)
    ns = time.monotonic_ns

    class Stream:
        __slots__ = ("conn", "due_ms", "i", "slot")
        conn: Conn
        due_ms: int
        i: int
        slot: int

    # Streams are kept in `interval_ms` buckets by their phase (arrival ms mod interval); one
    # timer per millisecond sends every due event, instead of one timer per event.
    buckets: list[dict[int, Stream]] = [{} for _ in range(interval_ms)]
    state = {"last_ms": -1}

    class Conn(asyncio.Protocol):
        def __init__(self) -> None:
            self.buf = b""
            self.transport: asyncio.Transport | None = None
            self.stream: Stream | None = None

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.transport = transport  # type: ignore[assignment]

        def connection_lost(self, exc: Exception | None) -> None:
            s = self.stream
            if s is not None:
                buckets[s.slot].pop(id(s), None)
                self.stream = None
            self.transport = None

        def data_received(self, data: bytes) -> None:
            self.buf += data
            self.parse()

        def parse(self) -> None:
            while self.stream is None and self.transport is not None:
                end = self.buf.find(b"\r\n\r\n")
                if end < 0:
                    return
                head = self.buf[:end].decode("latin-1")
                length = 0
                for line in head.split("\r\n")[1:]:
                    name, _, value = line.partition(":")
                    if name.strip().lower() == "content-length":
                        length = int(value)
                if len(self.buf) < end + 4 + length:
                    return
                self.buf = self.buf[end + 4 + length :]
                if not head.startswith("POST"):
                    self.transport.write(_MODELS_RESP)
                    continue
                now_ms = int(ns() // 1_000_000)
                s = Stream()
                s.conn = self
                s.i = 1
                s.due_ms = now_ms + interval_ms
                s.slot = now_ms % interval_ms
                pre, post = events[0]
                self.transport.write(
                    b"".join((_SSE_HEAD, pre, b"%020d" % ns(), post))
                    if n_events > 1
                    else _SSE_HEAD + pre + b"%020d" % ns() + post + done
                )
                if n_events > 1:
                    self.stream = s
                    buckets[s.slot][id(s)] = s

        def advance(self, s: Stream) -> None:
            t = self.transport
            if t is None:
                return
            pre, post = events[s.i]
            s.i += 1
            if s.i < n_events:
                t.write(b"".join((pre, b"%020d" % ns(), post)))
                s.due_ms += interval_ms
            else:
                t.write(b"".join((pre, b"%020d" % ns(), post, done)))
                buckets[s.slot].pop(id(s), None)
                self.stream = None
                self.parse()  # a pipelined next request

    async def main() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(Conn, "127.0.0.1", port, backlog=4096)

        def tick() -> None:
            now_ms = int(ns() // 1_000_000)
            start = max(state["last_ms"] + 1, now_ms - interval_ms + 1)
            for ms in range(start, now_ms + 1):
                bucket = buckets[ms % interval_ms]
                if bucket:
                    for s in list(bucket.values()):
                        if s.due_ms <= now_ms:
                            s.conn.advance(s)
            state["last_ms"] = now_ms
            loop.call_later(0.001, tick)

        tick()
        print(f"upstream on {port}", flush=True)
        async with server:
            await asyncio.Event().wait()

    uvloop.run(main())


# ---- the load client --------------------------------------------------------------------------

REQUEST_BODY = (
    b'{"model":"m","messages":[{"role":"user","content":"explain the loop"}],'
    b'"max_tokens":100,"stream":true}'
)


def run_client(
    port: int, path: str, streams: int, n_events: int, stagger: float, timeout: float, out: str
) -> None:
    import uvloop

    ns = time.monotonic_ns
    request = (
        b"POST %s HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nContent-Type: application/json\r\n"
        b"Accept: text/event-stream\r\nContent-Length: %d\r\n\r\n%s"
        % (path.encode(), port, len(REQUEST_BODY), REQUEST_BODY)
    )
    delays: list[int] = []
    ttfc: list[int] = []
    errors: dict[str, int] = {}
    results: dict[str, Any] = {"ok": 0, "errors": errors, "events": 0, "reads": 0}
    finished: asyncio.Future[None]
    pending = {"n": streams}

    def error(kind: str) -> None:
        errors[kind] = errors.get(kind, 0) + 1

    class Client(asyncio.Protocol):
        def __init__(self) -> None:
            self.buf = b""
            self.body = b""
            self.head_done = False
            self.chunked = False
            self.remaining = -1  # see data_received
            self.framed_end = False
            self.events = 0
            self.done = False
            self.closed = False
            self.t_sent = 0
            self.transport: asyncio.Transport | None = None

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            # uvloop's transports are not asyncio.Transport subclasses: cast, do not check
            self.transport = t = cast(asyncio.Transport, transport)
            self.t_sent = ns()
            t.write(request)

        def finish(self, kind: str | None) -> None:
            if self.closed:
                return
            self.closed = True
            if kind is None:
                results["ok"] += 1
            else:
                error(kind)
            if self.transport is not None:
                self.transport.close()
            pending["n"] -= 1
            if pending["n"] == 0 and not finished.done():
                finished.set_result(None)

        def connection_lost(self, exc: Exception | None) -> None:
            if not self.closed:
                if self.done:
                    self.finish(None)
                elif not self.head_done:
                    self.finish("closed before the response head")
                else:
                    self.finish(f"cut after {self.events} events")

        def data_received(self, data: bytes) -> None:
            now = ns()
            results["reads"] += 1
            buf = self.buf + data if self.buf else data
            if not self.head_done:
                end = buf.find(b"\r\n\r\n")
                if end < 0:
                    self.buf = buf
                    return
                head = buf[:end].decode("latin-1").split("\r\n")
                status = head[0].split(" ", 2)[1] if " " in head[0] else "?"
                if status != "200":
                    self.finish(f"HTTP {status}")
                    return
                hdrs = {}
                for line in head[1:]:
                    k, _, v = line.partition(":")
                    hdrs[k.strip().lower()] = v.strip().lower()
                self.chunked = "chunked" in hdrs.get("transfer-encoding", "")
                if not self.chunked:
                    cl = hdrs.get("content-length")
                    self.remaining = int(cl) if cl is not None else -2  # -2: until close
                self.head_done = True
                buf = buf[end + 4 :]
            if self.chunked:
                # remaining: -1 = a size line is next, 0 = the CRLF after a chunk, > 0 = data
                parts = []
                pos = 0
                n = len(buf)
                while True:
                    if self.remaining > 0:
                        take = min(self.remaining, n - pos)
                        if take <= 0:
                            break
                        parts.append(buf[pos : pos + take])
                        pos += take
                        self.remaining -= take
                    elif self.remaining == 0:
                        if n - pos < 2:
                            break
                        pos += 2
                        self.remaining = -1
                    else:
                        eol = buf.find(b"\r\n", pos)
                        if eol < 0:
                            break
                        size = int(buf[pos:eol].split(b";", 1)[0], 16)
                        pos = eol + 2
                        if size == 0:
                            self.framed_end = True
                            break
                        self.remaining = size
                self.buf = buf[pos:]
                self.body += b"".join(parts)
            elif self.remaining >= 0:  # Content-Length
                piece = buf[: self.remaining]
                self.remaining -= len(piece)
                self.body += piece
                self.buf = b""
                if self.remaining == 0:
                    self.framed_end = True
            else:  # until the connection closes
                self.buf = b""
                self.body += buf
            self.events_from(now)
            if self.done or self.framed_end:
                self.finish(None if self.done else f"ended after {self.events} events")

        def events_from(self, now: int) -> None:
            body = self.body
            end = body.rfind(b"\n\n")
            if end < 0:
                return
            self.body = body[end + 2 :]
            for ev in body[: end + 2].split(b"\n\n"):
                if not ev:
                    continue
                i = ev.find(b'"t":"')
                if i >= 0:
                    sent = int(ev[i + 5 : i + 5 + TS_DIGITS])
                    delays.append(now - sent)
                    if self.events == 0:
                        ttfc.append(now - self.t_sent)
                    self.events += 1
                elif ev.startswith(b"data: [DONE]"):
                    self.done = True
                elif ev.startswith(b"data:") or ev.startswith(b"event:"):
                    error("other event: " + ev[:60].decode("latin-1"))

    async def main() -> None:
        nonlocal finished
        loop = asyncio.get_running_loop()
        finished = loop.create_future()
        t0 = ns()
        conns: list[Client] = []

        async def open_one(k: int) -> None:
            await asyncio.sleep(k * stagger / streams)
            try:
                _, proto = await loop.create_connection(Client, "127.0.0.1", port)
                conns.append(proto)
            except OSError as exc:
                error(f"connect: {exc.__class__.__name__}")
                pending["n"] -= 1
                if pending["n"] == 0 and not finished.done():
                    finished.set_result(None)

        openers = [loop.create_task(open_one(k)) for k in range(streams)]
        try:
            await asyncio.wait_for(asyncio.shield(finished), timeout)
        except TimeoutError:
            for c in conns:
                if not c.closed:
                    c.finish(f"timeout after {c.events} events")
        for t in openers:
            t.cancel()
        t1 = ns()
        results["events"] = len(delays)
        results["wall_s"] = (t1 - t0) / 1e9
        results["delays_us"] = [d // 1000 for d in delays]
        results["ttfc_us"] = [d // 1000 for d in ttfc]
        results["client_cpu_s"] = time.process_time()

    uvloop.run(main())
    Path(out).write_text(json.dumps(results))


# ---- the orchestrator -------------------------------------------------------------------------


class Proxy:
    """One proxy process under test (fresh per measurement), pinned to core 0."""

    def __init__(self, name: str, cmd: list[str], port: int, log: Path) -> None:
        self.name = name
        self.port = port
        self.log = log
        self.logf = log.open("ab")
        self.proc = subprocess.Popen(pinned("0", cmd), cwd=ROOT, stdout=self.logf, stderr=self.logf)
        try:
            wait_port(port, 30.0, self.proc)
        except RuntimeError:
            self.stop()
            raise

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self) -> None:
        stop(self.proc, 15.0)
        self.logf.close()


def start_proxy(name: str, cmd: list[str], port: int, log: Path, tries: int = 8) -> Proxy:
    """Starts a proxy; the gateway is being edited by others, so a failed start is retried a
    few times, 20 s apart, before giving up."""
    for attempt in range(1, tries + 1):
        try:
            return Proxy(name, cmd, port, log)
        except RuntimeError as exc:
            tail = log.read_text(errors="replace").strip().splitlines()[-1:] if log.exists() else []
            print(
                f"  {name} did not start ({exc}; {' '.join(tail)[:200]}); "
                f"attempt {attempt}/{tries}",
                file=sys.stderr,
                flush=True,
            )
            if attempt == tries:
                raise
            time.sleep(20)
    raise AssertionError("unreachable")


def run_load(
    port: int, path: str, streams: int, events: int, interval_ms: int, stagger: float, tmp: Path
) -> dict[str, Any]:
    out = tmp / f"client-{port}-{streams}-{time.monotonic_ns()}.json"
    timeout = stagger + events * interval_ms / 1000 * 3 + 30
    subprocess.run(
        pinned(
            "1",
            [
                PY,
                str(HERE),
                "--role",
                "client",
                "--port",
                str(port),
                "--path",
                path,
                "--streams",
                str(streams),
                "--events",
                str(events),
                "--stagger",
                str(stagger),
                "--timeout",
                str(timeout),
                "--out",
                str(out),
            ],
        ),
        cwd=ROOT,
        check=True,
        timeout=timeout + 30,
    )
    data: dict[str, Any] = json.loads(out.read_text())
    out.unlink()
    return data


def measure(
    target: str,
    proxy: Proxy | None,
    port: int,
    path: str,
    streams: int,
    args: argparse.Namespace,
    tmp: Path,
) -> dict[str, Any]:
    # Warm-up: a few short streams through the path (imports, pools, first-request caches).
    run_load(port, path, min(4, streams), 3, args.interval_ms, 0.1, tmp)
    time.sleep(0.5)
    pid = proxy.pid if proxy else None
    rss_idle = status_kb(pid, "VmRSS") if pid else 0
    samples: list[int] = []
    stop = threading.Event()

    def sampler() -> None:
        while not stop.is_set():
            try:
                samples.append(status_kb(pid, "VmRSS"))  # type: ignore[arg-type]
            except OSError:
                return
            stop.wait(0.05)

    th = threading.Thread(target=sampler, daemon=True) if pid else None
    if th:
        th.start()
    cpu0 = cpu_seconds(pid) if pid else 0.0
    sched0 = sched_ns(pid) if pid else 0
    res = run_load(port, path, streams, args.events, args.interval_ms, args.stagger, tmp)
    cpu1 = cpu_seconds(pid) if pid else 0.0
    sched1 = sched_ns(pid) if pid else 0
    if th:
        stop.set()
        th.join()
    delays = sorted(d / 1000 for d in res.pop("delays_us"))  # ms
    ttfc = sorted(d / 1000 for d in res.pop("ttfc_us"))
    n = res["events"]
    row: dict[str, Any] = {
        "target": target,
        "streams": streams,
        "events": n,
        "expected_events": streams * args.events,
        "ok_streams": res["ok"],
        "errors": res["errors"],
        "wall_s": res["wall_s"],
        "events_per_s": n / res["wall_s"] if res["wall_s"] else 0.0,
        "delay_ms": {
            "p50": pct(delays, 0.50),
            "p90": pct(delays, 0.90),
            "p99": pct(delays, 0.99),
            "p999": pct(delays, 0.999),
            "max": delays[-1] if delays else float("nan"),
            "mean": statistics.fmean(delays) if delays else float("nan"),
        },
        "ttfc_ms": {"p50": pct(ttfc, 0.5), "p99": pct(ttfc, 0.99)},
        "client_cpu_s": res["client_cpu_s"],
        # socket reads the client needed per event: > 1 means the proxy split events into
        # several TCP segments (e.g. chunk-size line, data and CRLF written separately)
        "client_reads_per_event": res["reads"] / n if n else None,
        "cpu_s": cpu1 - cpu0 if pid else None,
        "cpu_us_per_event": (cpu1 - cpu0) / n * 1e6 if pid and n else None,
        "cpu_us_per_event_schedstat": (sched1 - sched0) / n / 1e3 if pid and n else None,
        "rss_idle_kb": rss_idle if pid else None,
        "rss_peak_kb": max(samples) if samples else None,
        "vm_hwm_kb": status_kb(pid, "VmHWM") if pid else None,
    }
    if pid and samples:
        row["rss_per_stream_kb"] = (max(samples) - rss_idle) / streams
    if args.raw:
        row["delays_ms"] = delays
        row["ttfc_all_ms"] = ttfc
    return row


def fmt(v: float | None, spec: str = ".2f") -> str:
    return "-" if v is None or v != v else format(v, spec)


def print_table(
    rows: list[dict[str, Any]], rnd: int, streams: int, args: argparse.Namespace
) -> None:
    direct = next((r for r in rows if r["target"] == "direct"), None)
    print(
        f"\n#### round {rnd}, S = {streams} streams x {args.events} events every "
        f"{args.interval_ms} ms\n"
    )
    print(
        "| target | events/s | ok streams | CPU-us/event | delay p50 / p99 / max ms "
        "| added p50 / p99 / max ms | TTFC p50 ms (added) | RSS idle / peak MB | RSS/stream KB |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        d = r["delay_ms"]
        if direct is not None and r is not direct:
            dd = direct["delay_ms"]
            added = (
                f"{d['p50'] - dd['p50']:+.2f} / {d['p99'] - dd['p99']:+.2f} / "
                f"{d['max'] - dd['max']:+.1f}"
            )
            ttfc_add = f" ({r['ttfc_ms']['p50'] - direct['ttfc_ms']['p50']:+.2f})"
        else:
            added, ttfc_add = "-", ""
        errs = (
            "" if not r["errors"] else " " + ", ".join(f"{k}: {v}" for k, v in r["errors"].items())
        )
        rss = (
            f"{r['rss_idle_kb'] / 1024:.1f} / {r['rss_peak_kb'] / 1024:.1f}"
            if r.get("rss_peak_kb")
            else "-"
        )
        print(
            f"| {r['target']} | {r['events_per_s']:,.0f} | {r['ok_streams']}/{r['streams']}{errs} "
            f"| {fmt(r['cpu_us_per_event'], '.1f')} "
            f"| {d['p50']:.2f} / {d['p99']:.2f} / {d['max']:.1f} | {added} "
            f"| {r['ttfc_ms']['p50']:.2f}{ttfc_add} | {rss} "
            f"| {fmt(r.get('rss_per_stream_kb'), '.1f')} |",
            flush=True,
        )


def nginx_conf(tmp: Path, port: int, upstream_port: int) -> Path:
    conf = tmp / "nginx.conf"
    conf.write_text(
        textwrap.dedent(f"""\
        daemon off;
        master_process off;
        worker_processes 1;
        worker_rlimit_nofile 16384;
        pid {tmp}/nginx.pid;
        error_log {tmp}/nginx-error.log warn;
        events {{ worker_connections 8192; }}
        http {{
            access_log off;
            client_body_temp_path {tmp}/nginx-body;
            proxy_temp_path {tmp}/nginx-proxy;
            fastcgi_temp_path {tmp}/nginx-fastcgi;
            uwsgi_temp_path {tmp}/nginx-uwsgi;
            scgi_temp_path {tmp}/nginx-scgi;
            upstream up {{ server 127.0.0.1:{upstream_port}; keepalive 1024; }}
            server {{
                listen 127.0.0.1:{port} backlog=4096;
                location / {{
                    proxy_pass http://up;
                    proxy_http_version 1.1;
                    proxy_set_header Connection "";
                    proxy_buffering off;
                    proxy_request_buffering off;
                    proxy_read_timeout 300s;
                }}
            }}
        }}
        """)
    )
    return conf


def measure_target(
    target: str, streams: int, up_port: int, cfg: Path, args: argparse.Namespace, tmp: Path
) -> dict[str, Any]:
    """One measurement on a fresh proxy process. The gateway is being rebuilt by others while
    this runs: a gateway run in which no stream succeeded is retried later (4 tries, 30 s apart)
    rather than reported."""
    for attempt in range(1, 5):
        port = free_port()
        proxy: Proxy | None = None
        log = tmp / f"{target}.log"
        if target == "bare-proxy":
            cmd = [
                PY,
                "benches/bare_proxy.py",
                "--port",
                str(port),
                "--upstream",
                f"http://127.0.0.1:{up_port}",
            ]
            proxy = start_proxy(target, cmd, port, log)
        elif target == "gateway":
            cmd = [PY, "-m", "gateway.cli", "serve", "--config", str(cfg), "--port", str(port)]
            if not args.access_log:
                cmd.append("--no-access-log")
            proxy = start_proxy(target, cmd, port, log)
        elif target == "nginx":
            conf = nginx_conf(tmp, port, up_port)
            proxy = start_proxy(target, ["nginx", "-c", str(conf), "-p", str(tmp)], port, log)
        else:
            port = up_port
        try:
            row = measure(target, proxy, port, "/v1/chat/completions", streams, args, tmp)
        finally:
            if proxy is not None:
                proxy.stop()
        if target != "gateway" or row["ok_streams"] > 0 or attempt == 4:
            break
        print(
            f"  gateway answered no stream ({row['errors']}); retrying in 30 s "
            f"(attempt {attempt}/4; log {log})",
            file=sys.stderr,
            flush=True,
        )
        time.sleep(30)
    return row


def orchestrate(args: argparse.Namespace) -> int:
    if not shutil.which("taskset"):
        print("taskset is required (util-linux)", file=sys.stderr)
        return 2
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    unknown = set(targets) - {"direct", "bare-proxy", "gateway"}
    if unknown:
        print(f"unknown targets {sorted(unknown)}", file=sys.stderr)
        return 2
    if args.nginx:
        if not shutil.which("nginx"):
            print(
                "--nginx: nginx is not installed (apt-get install nginx); skipped", file=sys.stderr
            )
        else:
            targets.append("nginx")
    stream_counts = [int(s) for s in args.streams.split(",") if s.strip()]
    tmp = Path(tempfile.mkdtemp(prefix="stream-bench-"))
    up_port = free_port()
    cfg = tmp / "gateway.yaml"
    high = max(stream_counts) * 4
    cfg.write_text(
        textwrap.dedent(f"""\
        listen: {{host: 127.0.0.1, port: 0}}
        scheduler:
          high: {{capacity: {high}}}
          low: {{capacity: {high}}}
        pools:
          p:
            instances:
              - {{name: a, url: "http://127.0.0.1:{up_port}/v1", model: up,
                  max_concurrency: {high}}}
        models:
          m: {{pool: p}}
        """)
    )
    role = ["--role", "upstream", "--port", str(up_port), "--events", str(args.events)]
    upstream = subprocess.Popen(
        pinned("1", [PY, str(HERE), *role, "--interval-ms", str(args.interval_ms)]),
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
    )
    all_rows: list[dict[str, Any]] = []
    started = time.time()
    try:
        wait_port(up_port, 30.0, upstream)
        for rnd in range(1, args.rounds + 1):
            for streams in stream_counts:
                rows = []
                for target in targets:
                    row = measure_target(target, streams, up_port, cfg, args, tmp)
                    row["round"] = rnd
                    rows.append(row)
                    time.sleep(0.5)
                print_table(rows, rnd, streams, args)
                all_rows.extend(rows)
    finally:
        stop(upstream, 5.0)
    if args.json:
        doc = {
            "benchmark": "stream",
            "started": started,
            "args": {k: v for k, v in vars(args).items() if k not in ("role",)},
            "load_avg_at_end": os.getloadavg(),
            "rows": all_rows,
        }
        Path(args.json).write_text(json.dumps(doc, indent=1))
        print(f"\nraw results: {args.json}")
    bad = [r for r in all_rows if r["errors"] or r["events"] != r["expected_events"]]
    if bad:
        print(
            f"\nWARNING: {len(bad)} measurement(s) had errors or missing events (logs in {tmp})",
            file=sys.stderr,
        )
    else:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", default="100,400", help="comma-separated stream counts S")
    ap.add_argument("--events", type=int, default=100, help="events per stream (+ [DONE])")
    ap.add_argument("--interval-ms", type=int, default=20, help="gap between events")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--stagger", type=float, default=1.0, help="seconds over which streams start")
    ap.add_argument(
        "--targets",
        default="direct,bare-proxy,gateway",
        help="which of direct, bare-proxy, gateway (default all three)",
    )
    ap.add_argument("--nginx", action="store_true", help="also nginx (proxy_buffering off)")
    ap.add_argument("--access-log", action="store_true", help="gateway logs every request")
    ap.add_argument("--json", help="save every measurement here")
    ap.add_argument("--raw", action="store_true", help="with --json: every event's delay too")
    # internal: the child processes
    ap.add_argument(
        "--role",
        choices=("orchestrate", "upstream", "client"),
        default="orchestrate",
        help=argparse.SUPPRESS,
    )
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--path", default="/v1/chat/completions", help=argparse.SUPPRESS)
    ap.add_argument("--timeout", type=float, default=60.0, help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role == "upstream":
        run_upstream(args.port, args.events, args.interval_ms)
        return 0
    if args.role == "client":
        run_client(
            args.port,
            args.path,
            int(args.streams),
            args.events,
            args.stagger,
            args.timeout,
            args.out,
        )
        return 0
    return orchestrate(args)


if __name__ == "__main__":
    raise SystemExit(main())
