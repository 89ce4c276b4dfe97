"""Where a request's CPU goes in the gateway process: `gateway serve` under cProfile (its
event-loop thread), the mock on core 1, wrk at `--conns` connections for `--duration` seconds;
then the top functions by own time and by cumulative time, in µs per request.

cProfile's own cost inflates every figure (roughly 2x): compare entries with each other and
runs of this script with each other, not with the unprofiled CPU per request of e2e.py.

    .venv/bin/python benches/profile_path.py [--conns 64] [--duration 8] [--stream]
        [--no-access-log] [--top 40] [--tree DIR]   # DIR: another checkout's root
"""

from __future__ import annotations

import argparse
import io
import os
import pstats
import shutil
from pathlib import Path

from _harness import PY, ROOT, Processes, free_port, one_pool_config, run_wrk, wait_port

BODY = (
    '{"model":"m","messages":[{"role":"user","content":'
    '"does this compile? int main(){return 0;}"}],"max_tokens":8}'
)
STREAM_BODY = BODY[:-1] + ',"stream":true}'


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conns", type=int, default=64)
    ap.add_argument("--duration", type=float, default=8.0)
    ap.add_argument("--stream", action="store_true", help="streamed requests")
    ap.add_argument("--no-access-log", action="store_true")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--tree", type=Path, default=ROOT, help="the checkout whose gateway runs")
    ap.add_argument("--save", type=Path, help="keep the raw profile here")
    args = ap.parse_args()
    env = {**os.environ, "PYTHONPATH": str(args.tree.resolve() / "python")}
    mock_port, port = free_port(), free_port()
    tmp, cfg = one_pool_config(port, mock_port, max_concurrency=1000)
    prof = args.save or tmp / "gateway.prof"
    extra = ["--no-access-log"] if args.no_access_log else []
    with Processes() as procs, (tmp / "gateway.log").open("wb") as log:
        procs.spawn("1", PY, "-m", "gateway.cli", "mock", "--port", str(mock_port))
        wait_port(mock_port)
        gw = procs.spawn(
            "0",
            PY,
            "-m",
            "cProfile",
            "-o",
            str(prof),
            "-m",
            "gateway.cli",
            "serve",
            "--config",
            str(cfg),
            *extra,
            env=env,
            output=log,
        )
        wait_port(port, proc=gw)
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        body = STREAM_BODY if args.stream else BODY
        run_wrk(url, args.conns, 1.0, body, pid=gw.pid)  # warm up (in the profile too)
        r = run_wrk(url, args.conns, args.duration, body, pid=gw.pid)
        procs.stop_all()
    total = r.requests + int(r.rps)  # the warm-up second's requests, roughly
    print(
        f"{r.requests} requests measured, {r.rps:.0f} req/s, {r.cpu_us:.1f} CPU µs/request "
        f"(profiled); per-request figures divide by ~{total}"
    )
    for key in ("tottime", "cumulative"):
        out = io.StringIO()
        stats = pstats.Stats(str(prof), stream=out)
        stats.sort_stats(key).print_stats(args.top)
        print(f"\n== by {key} (µs per request = seconds x {1e6 / total:.2f}) ==")
        lines = out.getvalue().splitlines()
        start = next(i for i, line in enumerate(lines) if "ncalls" in line)
        print(lines[start])
        for line in lines[start + 1 :]:
            parts = line.split(None, 5)
            if len(parts) < 6:
                continue
            tot, cum = float(parts[1]), float(parts[3])
            print(f"{tot * 1e6 / total:8.2f} {cum * 1e6 / total:8.2f}  {parts[0]:>12} {parts[5]}")
    if not args.save:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
