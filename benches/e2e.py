"""End-to-end proxy overhead: direct vs the bare aiohttp proxy vs the gateway, side by side.

One process tree: the mock backend, the bare proxy and the gateways are started here; the
proxies are pinned to core 0, the mock and the load generator (wrk) to core 1. For each target
wrk runs a fixed duration; we report req/s, p50/p99 latency and the proxy process's CPU time per
request read from /proc (user + system, every thread), and ratios to the bare proxy measured in
the same run.

The headline row, `gateway`, is the gateway as operators run it: the default configuration,
its access log on (one line per request, written to a file as a journal would take it).
`gw-no-log` is the same with `--no-access-log`, `gw+otel` (with `--otel`) adds tracing at
sample ratio 1.0 with the access log on; the difference between rows is what each costs.

    .venv/bin/python benches/e2e.py --duration 10 --rounds 2 [--stream] [--ttfc] [--otel]

Needs wrk (Debian: apt-get install wrk) and taskset (util-linux).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

from _harness import PY, ROOT, Processes, free_port, pinned, run_wrk, wait_port

BODY = (
    '{"model":"m","messages":[{"role":"user","content":'
    '"does this compile? int main(){return 0;}"}],"max_tokens":8}'
)
STREAM_BODY = BODY[:-1] + ',"stream":true}'


# An OTLP/HTTP collector that accepts every export and keeps nothing (for --otel).
_SINK = """
import sys
from aiohttp import web

async def ok(request):
    await request.read()
    return web.Response(status=200, content_type="application/json", body=b"{}")

app = web.Application(client_max_size=64 * 1024 * 1024)
app.router.add_route("POST", "/{tail:.*}", ok)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None, access_log=None)
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=10.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--conns", default="64,8,1", help="connection counts, comma-separated")
    ap.add_argument(
        "--workers",
        type=int,
        default=1,
        help="gateways with --workers N against N bare proxies on one port (SO_REUSEPORT); "
        "nothing pinned then (N processes need the cores), CPU summed over each process tree",
    )
    ap.add_argument("--stream", action="store_true", help="also measure streaming")
    ap.add_argument(
        "--no-log-row", action="store_true", help="skip the gw-no-log row (--no-access-log)"
    )
    ap.add_argument(
        "--ttfc", action="store_true", help="also time to first stream chunk, one at a time"
    )
    ap.add_argument(
        "--otel",
        action="store_true",
        help="also a gateway with OpenTelemetry tracing at sample ratio 1.0 (OTLP/HTTP JSON), "
        "exporting to a sink that accepts and drops every span batch",
    )
    ap.add_argument(
        "--tls",
        action="store_true",
        help="the upstream speaks HTTPS (a throwaway CA): proxies verify it, wrk talks TLS too",
    )
    args = ap.parse_args()
    for tool in ("wrk", "taskset"):
        if not shutil.which(tool):
            print(f"{tool} is required (apt-get install wrk util-linux)", file=sys.stderr)
            return 2

    mock_port, bare_port, gw_port = free_port(), free_port(), free_port()
    tmp = Path(tempfile.mkdtemp())
    cfg = tmp / "gateway.yaml"
    scheme, tls_line, mock_tls, bare_env = "http", "", [], dict(os.environ)
    if args.tls:
        import trustme

        ca = trustme.CA()
        cert = ca.issue_cert("127.0.0.1")
        ca.cert_pem.write_to_path(str(tmp / "ca.pem"))
        cert.private_key_pem.write_to_path(str(tmp / "key.pem"))
        cert.cert_chain_pems[0].write_to_path(str(tmp / "cert.pem"))
        scheme = "https"
        tls_line = f", tls: {{ca_file: {tmp / 'ca.pem'}}}"
        mock_tls = ["--tls-cert", str(tmp / "cert.pem"), "--tls-key", str(tmp / "key.pem")]
        bare_env["SSL_CERT_FILE"] = str(tmp / "ca.pem")  # aiohttp's default context reads it
    cfg.write_text(
        textwrap.dedent(f"""\
        listen: {{host: 127.0.0.1, port: {gw_port}}}
        pools:
          p:
            instances:
              - {{name: a, url: "{scheme}://127.0.0.1:{mock_port}/v1", model: up,
                  max_concurrency: 1000{tls_line}}}
        models:
          m: {{pool: p}}
        """)
    )
    procs = Processes()
    spawn = procs.spawn
    many = args.workers > 1
    # one proxy process: proxies on core 0, the rest on core 1; several: nothing pinned
    core, rest = ("0-1", "0-1") if many else ("0", "1")
    wrk_core = None if many else "1"
    workers = ["--workers", str(args.workers)] if many else []
    try:
        spawn(rest, PY, "-m", "gateway.cli", "mock", "--port", str(mock_port), *mock_tls)
        wait_port(mock_port)
        bare_cmd = [PY, "benches/bare_proxy.py", "--port", str(bare_port)]
        bare_cmd += ["--upstream", f"{scheme}://127.0.0.1:{mock_port}"]
        bares = [
            spawn(core, *bare_cmd, *(["--reuse-port"] if many else []), env=bare_env)
            for _ in range(args.workers)
        ]
        gw_cmd = [PY, "-m", "gateway.cli", "serve", "--config", str(cfg), *workers]
        # the default configuration: the access log on, into a file (as a journal takes it)
        log = (tmp / "gateway.log").open("wb")
        gw = spawn(core, *gw_cmd, output=log)
        wait_port(bare_port)
        wait_port(gw_port)
        targets: list[tuple[str, str, list[int]]] = [
            ("direct", f"{scheme}://127.0.0.1:{mock_port}/v1/chat/completions", []),
            (
                "bare-proxy" if not many else f"bare-x{args.workers}",
                f"http://127.0.0.1:{bare_port}/v1/chat/completions",
                [b.pid for b in bares],
            ),
            ("gateway", f"http://127.0.0.1:{gw_port}/v1/chat/completions", [gw.pid]),
        ]
        if not args.no_log_row:
            quiet_port = free_port()
            quiet_cfg = tmp / "gateway-quiet.yaml"
            quiet_cfg.write_text(cfg.read_text().replace(str(gw_port), str(quiet_port)))
            quiet_cmd = [PY, "-m", "gateway.cli", "serve", "--config", str(quiet_cfg)]
            quiet = spawn(core, *quiet_cmd, *workers, "--no-access-log")
            wait_port(quiet_port)
            targets.append(
                ("gw-no-log", f"http://127.0.0.1:{quiet_port}/v1/chat/completions", [quiet.pid])
            )
        if args.otel:
            sink_port, otel_port = free_port(), free_port()
            spawn(rest, PY, "-c", _SINK, str(sink_port))
            otel_cfg = tmp / "gateway-otel.yaml"
            otel_cfg.write_text(
                cfg.read_text().replace(str(gw_port), str(otel_port))
                + f"telemetry: {{otlp_endpoint: 'http://127.0.0.1:{sink_port}', "
                "sample_ratio: 1.0}\n"
            )
            otel_cmd = [PY, "-m", "gateway.cli", "serve", "--config", str(otel_cfg)]
            otel_log = (tmp / "gateway-otel.log").open("wb")
            otel = spawn(core, *otel_cmd, *workers, output=otel_log)
            wait_port(otel_port)
            targets.append(
                ("gw+otel", f"http://127.0.0.1:{otel_port}/v1/chat/completions", [otel.pid])
            )
        bodies = [("json", BODY)] + ([("sse", STREAM_BODY)] if args.stream else [])
        for _, url, _pids in targets:  # warm up connections and caches
            run_wrk(url, 8, 1.0, BODY, core=wrk_core)
        for rnd in range(1, args.rounds + 1):
            if args.ttfc:
                print(f"\nround {rnd}, time to first chunk, 1 connection, 300 sequential streams")
                print(f"{'target':12} {'p50 ms':>8} {'p99 ms':>8} {'+p50 ms':>8} {'+p99 ms':>8}")
                base_ttfc: tuple[float, float] | None = None
                for name, url, _ in targets:
                    out = subprocess.run(
                        pinned("1", [PY, "benches/ttfc.py", url, "300"]),
                        cwd=ROOT,
                        capture_output=True,
                        text=True,
                        check=True,
                    ).stdout.split()
                    p50, p99 = float(out[0]), float(out[1])
                    base_ttfc = base_ttfc or (p50, p99)
                    print(
                        f"{name:12} {p50:8.2f} {p99:8.2f} {p50 - base_ttfc[0]:8.2f}"
                        f" {p99 - base_ttfc[1]:8.2f}",
                        flush=True,
                    )
            for kind, body in bodies:
                for conns in [int(c) for c in args.conns.split(",")]:
                    results = {}
                    for name, url, pids in targets:
                        r = run_wrk(url, conns, args.duration, body, pids=pids, core=wrk_core)
                        r.name = name
                        results[name] = r
                    base = results[targets[1][0]]
                    direct = results["direct"]
                    print(f"\nround {rnd}, {kind}, {conns} connections, {args.duration:.0f} s each")
                    print(
                        f"{'target':12} {'req/s':>9} {'x bare':>7} {'p50 ms':>8} {'p99 ms':>8}"
                        f" {'+p50 ms':>8} {'+p99 ms':>8} {'CPU us/req':>10} {'x bare':>7}"
                    )
                    for r in results.values():
                        cpu = f"{r.cpu_us:10.1f}" if r.cpu_us is not None else f"{'-':>10}"
                        cpu_x = (
                            f"{r.cpu_us / base.cpu_us:7.2f}"
                            if r.cpu_us and base.cpu_us
                            else f"{'-':>7}"
                        )
                        print(
                            f"{r.name:12} {r.rps:9.0f} {r.rps / base.rps:7.2f} {r.p50_ms:8.2f}"
                            f" {r.p99_ms:8.2f} {r.p50_ms - direct.p50_ms:8.2f}"
                            f" {r.p99_ms - direct.p99_ms:8.2f} {cpu} {cpu_x}",
                            flush=True,
                        )
    finally:
        procs.stop_all()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
