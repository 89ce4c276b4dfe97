"""`gateway demo`: the whole product doing its job, in about a minute, with nothing to set up.

Everything runs in this process, on one event loop:

1. four simulated backends (`MockServer`): pool `light` (two fast "Qwen" instances) and pool
   `heavy` (two slow, heavy-tailed "GPT-4o" / "ERNIE" instances, falling back to `light`);
2. the gateway over them, configured from YAML text like any deployment, with fast probes
   and short ejections so a crash and its recovery fit in the run;
3. an online-judge workload, open loop (arrivals do not wait for answers, as real students
   do not): a backlog of batch re-judging queued at the start, a Poisson stream of realtime
   and batch requests, simple ("does this compile?") and complex ("worst-case time
   complexity?") prompts in English and Chinese, and an exam-deadline surge of realtime;
4. a scripted failure: one heavy instance crashes mid-run and comes back later;
5. the overnight re-judging as a real batch (SPEC §14): a JSONL file uploaded with
   `POST /v1/files` and run with `POST /v1/batches` beside the backlog, its progress polled
   with `GET /v1/batches/{id}` like any Batch API client would.

While it runs, one progress line; the gateway's state is sampled every 200 ms (what
`GET /admin/state` serves). At the end: a plain-text summary and a self-contained HTML report
(`report.py` draws the charts). Seeded: two runs with one seed tell the same story.

This module is the command; the parts are `scenario` (what happens), `run` (running it and
observing), `analysis` (what the observations show) and `summary` (the text and the report).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import signal
import sys
from pathlib import Path
from typing import TextIO

from gateway.sim.run import DemoResult, run_demo
from gateway.sim.scenario import DRAIN_LIMIT_S, LIGHT_BALANCER, Options
from gateway.sim.summary import render_report, summarize

__all__ = ["add_arguments", "main", "options_from_args", "run"]


# ---- options ---------------------------------------------------------------------------------


def _positive(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a positive number, not {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `gateway demo`."""
    d = Options()
    a = parser.add_argument
    a(
        "--duration",
        type=_positive,
        default=d.duration,
        help="seconds of workload (default %(default)s); the answers still owed are then "
        f"awaited, at most {DRAIN_LIMIT_S:.0f} s",
    )
    a(
        "--rate",
        type=_positive,
        default=d.rate,
        help="mean arrivals per second of the live judge stream, Poisson (default %(default)s)",
    )
    a("--policy", choices=("weighted", "strict"), default=d.policy, help="scheduler.policy")
    a(
        "--balancer",
        choices=("least_connections", "round_robin", "random", "p2c", "affinity"),
        default=d.balancer,
        help=f"the load balancer of pool heavy (default %(default)s; pool light uses "
        f"{LIGHT_BALANCER})",
    )
    a("--report", default=d.report, metavar="PATH", help="HTML report (default %(default)s)")
    a("--seed", type=int, default=d.seed, help="seeds arrivals, prompts and backends")
    a("--no-progress", action="store_true", help="no live progress line")


def options_from_args(args: argparse.Namespace) -> Options:
    """The `Options` the parsed flags describe."""
    return Options(
        duration=args.duration,
        rate=args.rate,
        policy=args.policy,
        balancer=args.balancer,
        report=args.report,
        seed=args.seed,
        progress=not getattr(args, "no_progress", False),
    )


# ---- the command -----------------------------------------------------------------------------


async def main(
    options: Options, *, out: TextIO | None = None, stop: asyncio.Event | None = None
) -> DemoResult:
    """Runs the demo: starts everything, sends the workload, stops everything, prints the
    summary and writes the report. `stop` set early ends the workload (Ctrl-C); the report is
    written all the same."""
    out = out if out is not None else sys.stdout
    result = await run_demo(options, out=out, stop=stop)
    result.summary = summarize(result)
    print(result.summary, file=out)
    result.report_path = await asyncio.to_thread(
        _write, Path(options.report), render_report(result)
    )
    print(f"report: {result.report_path}  (open it in a browser)", file=out)
    print(f"demo took {result.wall_s:.0f} s", file=out, flush=True)
    return result


def _write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path.resolve()


def run(args: argparse.Namespace) -> int:
    """`gateway demo`: returns 0 when the demo ran and the report was written."""
    options = options_from_args(args)
    if not Path(options.report).resolve().parent.is_dir():
        # Say so now, not after a minute of demo.
        print(f"gateway demo: no directory for the report {options.report!r}", file=sys.stderr)
        return 2

    async def go() -> DemoResult:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()

        def first_interrupt() -> None:
            print("\nstopping early: waiting for nothing more, writing the report…", flush=True)
            stop.set()
            # A second Ctrl-C interrupts for real.
            loop.remove_signal_handler(signal.SIGINT)

        loop.add_signal_handler(signal.SIGINT, first_interrupt)
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        return await main(options, stop=stop)

    try:
        asyncio.run(go())
    except OSError as exc:
        print(f"gateway demo: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ngateway demo: interrupted", file=sys.stderr)
        return 130
    return 0
