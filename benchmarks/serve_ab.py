"""``nalar serve`` at an earlier commit against this checkout, through HTTP, alternating.

Both servers run with the same flags (``--nalar-args``; by default ``nalar serve``'s defaults:
the embedded Q4_1 GGUF as stored, 2 workers), plus each side's own (``--before-args``,
``--after-args``: with ``BEFORE`` the checkout's own commit, an A/B of a flag). Paths in the
flags must be absolute: each server runs in its own checkout. The earlier
one runs from a git worktree of ``BEFORE`` (its code first on ``PYTHONPATH``, its own kernel
builds). Both stay up; one is measured at a time with ``benchmarks/llama_server.py``'s
``nalar bench`` workloads, the order flipping every round, each round with a new seed that both
servers share. What the end-to-end path adds per token (Serve's streaming, the worker's event
loop) shows here and not in an engine-level profile.

The JSON holds every run's figures (``llama_server.METRICS``), each side's medians over the
rounds, the ratio after / before of the medians, and the machine.

    .venv/bin/python benchmarks/serve_ab.py BEFORE [--rounds 3]
        [--workloads single,concurrent16] [--nalar-args "--workers 1"]
        [--before-args "--step-time-target-ms 0"] [--after-args ...] [--out PATH]
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks import common  # noqa: E402
from benchmarks.llama_server import (  # noqa: E402
    METRICS,
    WORKLOADS,
    alternate,
    checkout_env,
    median,
    nalar_server,
)

SIDES = ("before", "after")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", help="the earlier commit")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workloads", default="single,concurrent16",
                        help=f"comma-separated, of {', '.join(WORKLOADS)}")
    parser.add_argument("--nalar-args", default="", help="flags of both nalar serve")
    for side in SIDES:
        parser.add_argument(f"--{side}-args", default="", help=f"flags of the {side} side only")
    parser.add_argument("--start-timeout", type=float, default=900.0)
    parser.add_argument("--out", default=str(common.OUT_DIR / "serve_ab.json"))
    args = parser.parse_args(argv)
    args.workloads = args.workloads.split(",")
    return args


def add_worktree(commit: str, path: Path) -> None:
    """A detached worktree of ``commit`` at ``path``, with its kernels built."""
    subprocess.run(["git", "worktree", "add", "--detach", str(path), commit], check=True,
                   cwd=common.REPO_ROOT, capture_output=True)
    subprocess.run([sys.executable, "-m", "workers.kernels"], check=True, cwd=path,
                   env=checkout_env(path), capture_output=True)


def summarize(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Per workload: each side's median figures over rounds, and after / before of those."""
    summary = {}
    for workload in dict.fromkeys(r["workload"] for r in rounds):
        mine = [r for r in rounds if r["workload"] == workload]
        sides = {side: {m: median([r[side][m] for r in mine]) for m in METRICS}
                 for side in SIDES}
        sides["ratio"] = {m: common.ratio(sides["after"][m], sides["before"][m])
                          for m in METRICS}
        summary[workload] = sides
    return summary


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # stop the servers on SIGTERM too
    out = Path(args.out)
    runs = out.with_name(out.stem + "_runs")
    before = Path(tempfile.mkdtemp(prefix="nalar-ab-")) / args.before
    extra = shlex.split(args.nalar_args)
    servers = {"before": nalar_server("before", extra + shlex.split(args.before_args),
                                      runs / "before.log", before),
               "after": nalar_server("after", extra + shlex.split(args.after_args),
                                     runs / "after.log", common.REPO_ROOT)}
    try:
        add_worktree(args.before, before)
        for side, server in servers.items():
            common.log(f"{side}: {server.start(args.start_timeout):.1f} s to start")
        rounds = alternate(servers, args.workloads, args.rounds, False, runs)
    finally:
        for server in servers.values():
            server.stop()
        subprocess.run(["git", "worktree", "remove", "--force", str(before)],
                       cwd=common.REPO_ROOT, check=False, capture_output=True)
        shutil.rmtree(before.parent, ignore_errors=True)
    result = {"benchmark": "serve_ab", "machine": common.machine_info(), "argv": sys.argv,
              "before": args.before, "commands": {s: shlex.join(v.command)
                                                  for s, v in servers.items()},
              "workloads": {w: WORKLOADS[w]["args"] for w in args.workloads},
              "rounds": rounds, "summary": summarize(rounds)}
    for workload, figures in result["summary"].items():
        common.log(f"{workload}: after / before {figures['ratio']}")
    common.write_json(result, out)
    return result


if __name__ == "__main__":
    main()
