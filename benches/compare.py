"""Regression run against a git ref, side by side: `make bench-compare BASE=main`.

A stored baseline is the wrong reference on a shared, noisy machine (and a fresh clone has
none). This builds the base in a git worktree (`target/bench-base/<sha>`), then runs the base
and the working tree *alternately in one session* — the core micro-benchmarks
(pytest-benchmark, `benches/test_*_bench.py`) and the end-to-end CPU per request of a gateway
in its default configuration (access log on, into a file) under wrk at 64 connections — and
fails when the working tree is slower than the base by more than the tolerance.

Each side is measured `--rounds` times, the order alternating per round; a benchmark's figure
is its best (lowest) over the rounds: the least noisy estimate of what the code costs when the
machine lets it run. The tolerance defaults to 10 % (micro-benchmarks and the end-to-end CPU
alike), with slowdowns under 50 ns ignored whatever their ratio (a 0.36 us cycle moves by
10 % between two runs of the same code here): what a shared 2-core machine holds (see
benches/README.md); raise it (`TOLERANCE=0.15`) on a noisier one.

The extension: when the base's Rust sources and lock file are the working tree's, the
working tree's built extension is copied into the worktree (nothing to build); otherwise the
base is built with maturin (release, its own target directory under target/).

    .venv/bin/python benches/compare.py --base main [--rounds 3] [--tolerance 0.10]
        [--e2e-duration 5] [--no-e2e]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from _harness import PY, ROOT, Processes, free_port, one_pool_config, run_wrk, wait_port

BODY = (
    '{"model":"m","messages":[{"role":"user","content":'
    '"does this compile? int main(){return 0;}"}],"max_tokens":8}'
)
EXT = "gateway/_core.abi3.so"
# What the extension is built from (its tests excluded).
BUILD_INPUTS = ["rust", ":(exclude)rust/*/tests", "Cargo.toml", "Cargo.lock", "pyproject.toml"]


def git(*args: str, cwd: Path = ROOT) -> str:
    return subprocess.run(
        ["git", *args], cwd=cwd, check=True, capture_output=True, text=True
    ).stdout.strip()


def prepare_base(ref: str) -> Path:
    """The base's tree in a worktree, with its extension in place."""
    sha = git("rev-parse", "--verify", f"{ref}^{{commit}}")
    where = ROOT / "target" / "bench-base" / sha[:12]
    if not (where / ".git").exists():
        where.parent.mkdir(parents=True, exist_ok=True)
        if where.exists():
            shutil.rmtree(where)
        git("worktree", "add", "--force", "--detach", str(where), sha)
    ext = where / "python" / EXT
    if ext.exists():
        return where
    same = (
        subprocess.run(["git", "diff", "--quiet", sha, "--", *BUILD_INPUTS], cwd=ROOT).returncode
        == 0
    )
    if same:
        print(f"base {ref} ({sha[:12]}): same Rust sources, the built extension is reused")
        shutil.copy2(ROOT / "python" / EXT, ext)
        return where
    print(f"base {ref} ({sha[:12]}): building its extension (release) ...", flush=True)
    out = Path(tempfile.mkdtemp())
    env = {**os.environ, "CARGO_TARGET_DIR": str(ROOT / "target" / "bench-base-cargo")}
    maturin = Path(PY).parent / "maturin"
    subprocess.run(
        [str(maturin), "build", "--release", "--locked", "-o", str(out)],
        cwd=where,
        env=env,
        check=True,
    )
    wheel = next(out.glob("gateway-*.whl"))
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith("_core.abi3.so"))
        ext.write_bytes(z.read(name))
    return where


def side_env(tree: Path) -> dict[str, str]:
    """The environment that imports `gateway` from `tree` (ahead of the venv's own path)."""
    return {**os.environ, "PYTHONPATH": str(tree / "python")}


def micro(tree: Path) -> dict[str, float]:
    """Each core micro-benchmark's best time (s) on the code of `tree`."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        report = Path(f.name)
    files = sorted(str(p) for p in (tree / "benches").glob("test_*_bench.py"))
    try:
        subprocess.run(
            [
                PY,
                "-m",
                "pytest",
                *files,
                "--benchmark-only",
                "-q",
                "-p",
                "no:cacheprovider",
                f"--benchmark-json={report}",
            ],
            cwd=tree,
            env=side_env(tree),
            check=True,
            capture_output=True,
        )
        data = json.loads(report.read_text())
    finally:
        report.unlink(missing_ok=True)
    return {b["fullname"].split("::", 1)[1]: b["stats"]["min"] for b in data["benchmarks"]}


def e2e_cpu(tree: Path, mock_port: int, duration: float) -> float:
    """CPU µs per request of `tree`'s gateway (default configuration: access log on, into a
    file), proxying to the mock under wrk at 64 connections; gateway on core 0, wrk on 1."""
    port = free_port()
    tmp, cfg = one_pool_config(port, mock_port, max_concurrency=1000)
    with Processes() as procs, (tmp / "gateway.log").open("wb") as log:
        gw = procs.spawn(
            "0",
            PY,
            "-m",
            "gateway.cli",
            "serve",
            "--config",
            str(cfg),
            env=side_env(tree),
            output=log,
        )
        wait_port(port, proc=gw)
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        run_wrk(url, 64, 1.0, BODY, pid=gw.pid)  # warm up
        r = run_wrk(url, 64, duration, BODY, pid=gw.pid)
    shutil.rmtree(tmp, ignore_errors=True)
    assert r.cpu_us is not None
    return r.cpu_us


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="main", help="the git ref to compare against")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tolerance", type=float, default=0.10, help="allowed slowdown (0.10: 10 %%)")
    ap.add_argument(
        "--min-delta-us",
        type=float,
        default=0.05,
        help="a slowdown smaller than this (us) is not a regression whatever its ratio: "
        "sub-50 ns differences are the timer's and the machine's noise here",
    )
    ap.add_argument("--e2e-duration", type=float, default=5.0)
    ap.add_argument("--no-e2e", action="store_true", help="micro-benchmarks only")
    args = ap.parse_args()
    if not args.no_e2e and not shutil.which("wrk"):
        print(
            "wrk is required for the end-to-end row (apt-get install wrk), or --no-e2e",
            file=sys.stderr,
        )
        return 2
    sides = {"base": prepare_base(args.base), "head": ROOT}
    runs: dict[str, dict[str, list[float]]] = {"base": {}, "head": {}}
    procs = Processes()
    mock_port = free_port()
    try:
        if not args.no_e2e:
            procs.spawn("1", PY, "-m", "gateway.cli", "mock", "--port", str(mock_port))
            wait_port(mock_port)
        for rnd in range(args.rounds):
            order = ["base", "head"] if rnd % 2 == 0 else ["head", "base"]
            for side in order:
                print(f"round {rnd + 1}/{args.rounds}: {side} ...", flush=True)
                for name, value in micro(sides[side]).items():
                    runs[side].setdefault(name, []).append(value * 1e6)
                if not args.no_e2e:
                    cpu = e2e_cpu(sides[side], mock_port, args.e2e_duration)
                    runs[side].setdefault("e2e: CPU per request, c64", []).append(cpu)
    finally:
        procs.stop_all()
    common = [n for n in runs["head"] if n in runs["base"]]
    print(f"\n{'benchmark (best of rounds, us)':58} {'base':>9} {'head':>9} {'change':>8}")
    failed = []
    for name in common:
        base, head = min(runs["base"][name]), min(runs["head"][name])
        change = head / base - 1
        spread = statistics.pstdev(runs["head"][name]) / head if len(runs["head"][name]) > 1 else 0
        flag = ""
        if change > args.tolerance and head - base > args.min_delta_us:
            failed.append(name)
            flag = "  REGRESSION"
        print(
            f"{name[:58]:58} {base:9.2f} {head:9.2f} {change:+8.1%}{flag}"
            f"{'  (noisy: ' + format(spread, '.0%') + ')' if spread > args.tolerance else ''}"
        )
    only = sorted(set(runs["head"]) ^ set(runs["base"]))
    if only:
        print("on one side only (not compared): " + ", ".join(only))
    if failed:
        print(f"\n{len(failed)} regression(s) beyond {args.tolerance:.0%} against {args.base}")
        return 1
    print(f"\nno regression beyond {args.tolerance:.0%} against {args.base}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
