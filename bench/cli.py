"""``nalar bench``: placeholder wiring, replaced by the load-testing client."""

from __future__ import annotations

import argparse


def add_bench_parser(commands) -> None:
    """Registers ``nalar bench`` on the ``nalar`` sub-command parser."""
    commands.add_parser("bench", help="load-test an OpenAI-compatible server")


def bench_command(args: argparse.Namespace) -> int:
    """Runs ``nalar bench``; returns the process exit code."""
    raise SystemExit("nalar bench is not built yet")
