"""CPU per request of two (or more) checkouts' gateways, side by side: each tree's `gateway
serve` on core 0 in turn (the order rotating every round), the mock and wrk on core 1, and
the user + system CPU of the gateway process over the measured window divided by the requests
wrk counted. For "which commit costs what" on a shared machine, where throughput is noise.

    .venv/bin/python benches/cpu_ab.py --tree old=/tmp/wt-old --tree head=. \
        [--rounds 4] [--duration 5] [--conns 64] [--stream] [--no-access-log]

`--tree NAME=PATH,ARG,...` passes ARGs to that tree's `gateway serve` alone, e.g. the same
tree with and without its access log: `--tree on=. --tree off=.,--no-access-log`.

`--together`: every tree's gateway runs at the same time (all on core 0, one wrk each on core
1, each round with fresh processes), so whatever else the machine runs meanwhile weighs on all
of them alike: on a loaded machine the differences between trees hold within a few µs where
one after the other they swing by ±10 %.

A tree is a checkout's root with its extension built into python/gateway (see compare.py's
prepare_base, or `maturin build --release` in a worktree and the wheel's _core.abi3.so copied).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from _harness import CLK_TCK, PY, Processes, free_port, one_pool_config, run_wrk, wait_port
from profile_path import BODY, STREAM_BODY


def user_sys(pid: int) -> tuple[float, float]:
    """Process `pid`'s user and system CPU seconds so far (/proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) / CLK_TCK, int(fields[12]) / CLK_TCK


def cpu_us(
    tree: Path, mock_port: int, args: argparse.Namespace, own: list[str]
) -> tuple[float, float]:
    """(user, system) CPU µs per request."""
    port = free_port()
    tmp, cfg = one_pool_config(port, mock_port, max_concurrency=1000)
    extra = (["--no-access-log"] if args.no_access_log else []) + own
    env = {**os.environ, "PYTHONPATH": str(tree.resolve() / "python")}
    with Processes() as procs, (tmp / "gateway.log").open("wb") as log:
        gw = procs.spawn(
            "0", PY, "-m", "gateway.cli", "serve", "--config", str(cfg), *extra,
            env=env, output=log,
        )  # fmt: skip
        wait_port(port, proc=gw)
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        body = STREAM_BODY if args.stream else BODY
        run_wrk(url, args.conns, 1.0, body, pid=gw.pid)  # warm up
        u0, s0 = user_sys(gw.pid)
        r = run_wrk(url, args.conns, args.duration, body, pid=gw.pid)
        u1, s1 = user_sys(gw.pid)
    shutil.rmtree(tmp, ignore_errors=True)
    return (u1 - u0) / r.requests * 1e6, (s1 - s0) / r.requests * 1e6


def cpu_us_together(
    trees: list[tuple[str, Path, list[str]]], mock_port: int, args: argparse.Namespace
) -> dict[str, tuple[float, float]]:
    """(user, system) CPU µs per request of each tree's gateway, all loaded at once."""
    body = STREAM_BODY if args.stream else BODY
    with Processes() as procs:
        urls, pids, tmps = [], [], []
        for _, tree, own in trees:
            port = free_port()
            tmp, cfg = one_pool_config(port, mock_port, max_concurrency=1000)
            tmps.append(tmp)
            extra = (["--no-access-log"] if args.no_access_log else []) + own
            env = {**os.environ, "PYTHONPATH": str(tree.resolve() / "python")}
            log = (tmp / "gateway.log").open("wb")
            gw = procs.spawn(
                "0", PY, "-m", "gateway.cli", "serve", "--config", str(cfg), *extra,
                env=env, output=log,
            )  # fmt: skip
            wait_port(port, proc=gw)
            urls.append(f"http://127.0.0.1:{port}/v1/chat/completions")
            pids.append(gw.pid)
        with ThreadPoolExecutor(len(trees)) as pool:
            list(pool.map(lambda u: run_wrk(u, args.conns, 1.0, body), urls))  # warm up
            before = [user_sys(p) for p in pids]
            results = list(pool.map(lambda u: run_wrk(u, args.conns, args.duration, body), urls))
            after = [user_sys(p) for p in pids]
    for tmp in tmps:
        shutil.rmtree(tmp, ignore_errors=True)
    return {
        name: ((u1 - u0) / r.requests * 1e6, (s1 - s0) / r.requests * 1e6)
        for (name, _, _), (u0, s0), (u1, s1), r in zip(trees, before, after, results, strict=True)
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", action="append", required=True, help="name=path")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--duration", type=float, default=5.0)
    ap.add_argument("--conns", type=int, default=64)
    ap.add_argument("--stream", action="store_true")
    ap.add_argument("--no-access-log", action="store_true")
    ap.add_argument("--together", action="store_true", help="all trees at once (see above)")
    args = ap.parse_args()
    trees = []
    for spec in args.tree:
        name, rest = spec.split("=", 1)
        path, *own = rest.split(",")
        trees.append((name, Path(path), own))
    runs: dict[str, list[float]] = {n: [] for n, _, _ in trees}
    split: dict[str, list[tuple[float, float]]] = {n: [] for n, _, _ in trees}
    mock_port = free_port()
    with Processes() as procs:
        procs.spawn("1", PY, "-m", "gateway.cli", "mock", "--port", str(mock_port))
        wait_port(mock_port)
        for rnd in range(args.rounds):
            k = rnd % len(trees)
            order = trees[k:] + trees[:k]
            together = cpu_us_together(order, mock_port, args) if args.together else {}
            for name, tree, own in order:
                user, system = together.get(name) or cpu_us(tree, mock_port, args, own)
                runs[name].append(user + system)
                split[name].append((user, system))
                print(
                    f"round {rnd + 1}: {name:10} {user + system:7.1f} µs/request "
                    f"(user {user:.1f}, system {system:.1f})",
                    flush=True,
                )
    print(
        f"\n{'tree':10} {'best':>7} {'median':>7} {'user':>6} {'sys':>6}  rounds (CPU µs/request)"
    )
    for name, values in runs.items():
        listed = " ".join(f"{v:.1f}" for v in values)
        user = statistics.median(u for u, _ in split[name])
        system = statistics.median(s for _, s in split[name])
        print(
            f"{name:10} {min(values):7.1f} {statistics.median(values):7.1f} {user:6.1f} "
            f"{system:6.1f}  {listed}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
