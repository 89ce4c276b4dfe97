"""`gateway demo`: the embedded default (see issue 5). Placeholder until the demo lands."""

from __future__ import annotations

import argparse

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of workload")
    parser.add_argument("--seed", type=int, default=1)


def run(args: argparse.Namespace) -> int:
    print("the demo is not built yet")
    return 1
