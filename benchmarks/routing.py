"""Routing benchmark: prefix-aware routing against round-robin and power-of-two choices.

Each routing policy serves the same ``nalar bench`` workload on a fresh cluster: ``--workers``
replicas, the real Redis index under a fresh key prefix, Serve shut down and started again
between runs (Ray stays up), so every run begins with empty caches. So does a single worker:
the oracle for reuse, since one worker sees every request and can reuse every prefix it still
holds.
Workloads: ``shared-prefix`` (8 tenants, 512-token system prompts, 200 requests) and
``multi-turn`` (conversations whose history grows turn by turn). Requests ignore EOS, so every
policy decodes the same tokens.

Per policy and workload the JSON holds the token-weighted prefix reuse ratio, its fraction of
the oracle's, the busiest / least busy worker ratio of requests served (infinite when a worker
served none), TTFT p50 and its ratio to round-robin's, and the whole ``nalar bench`` summary;
each run also keeps the workers' transfer and preemption counters. ``--warmup N`` serves N
requests first in each run, left out of the figures, to measure past the tenants' cold start.
Goals: prefix routing reaches >= 0.9 of the oracle's reuse, keeps the busiest worker
<= 1.3x the least busy, and has TTFT p50 <= 0.5x round-robin's.

A policy named ``NAME+tier`` (``prefix+tier``) runs with a second KV tier of
``--kv-tier-mib`` per worker, so workers fetch prefixes from each other; ``--hot-share 0.8``
gives one tenant 80% of the ``shared-prefix`` requests.

The ``random`` workload has no reuse at all (random prompts), so it runs no oracle; its goal
is what the second tier and transfers cost where nothing can be reused: ``prefix+tier``
keeps at least 0.99x the output throughput of ``prefix``. ``--rounds N`` runs the policies
N times, alternating, and compares medians.

    .venv/bin/python benchmarks/routing.py [--requests 200] [--quick]
"""

from __future__ import annotations

import argparse
import math
import socket
import statistics
import uuid
from pathlib import Path
from typing import Any

import httpx
import matplotlib
from prometheus_client.parser import text_string_to_metric_families

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

try:
    from benchmarks import common
except ImportError:  # run as a script: benchmarks/ is on sys.path, the repo root is not
    import common

from bench.report import report  # noqa: E402
from bench.runner import BenchConfig, LoadConfig, run_benchmark  # noqa: E402
from bench.stats import load_imbalance  # noqa: E402
from bench.workloads import WorkloadConfig  # noqa: E402

POLICIES = ("prefix", "round-robin", "power-of-two")
WORKLOADS = ("shared-prefix", "multi-turn")
COUNTERS = {"kv_transfer_imported_blocks": "imported_blocks",
            "kv_transfer_import_seconds": "import_seconds",
            "kv_transfer_failed_fetches": "failed_fetches", "num_preemptions": "preemptions"}
"""The workers' counters a run keeps (``/metrics``, ``nalar:`` names without ``_total``) and
their names in the JSON."""
NO_REUSE = "random"
"""``nalar bench``'s random prompts: nothing to reuse."""
ORACLE = "oracle"
"""The single-worker run's name among the policies."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_common_args(parser, "routing")
    parser.add_argument("--workers", type=int, default=2, help="worker replicas per policy")
    parser.add_argument("--requests", type=int, default=200, help="measured requests per run")
    parser.add_argument("--warmup", type=int, default=0,
                        help="requests run first in each run and not measured (the tenants' "
                             "cold start), drawn from the same workload")
    parser.add_argument("--tenants", type=int, default=8)
    parser.add_argument("--hot-share", type=float, default=None,
                        help="shared-prefix: fraction of requests from one hot tenant")
    parser.add_argument("--kv-tier-mib", type=int, default=256,
                        help="the second KV tier per worker of a policy named NAME+tier "
                             "(prefix+tier: prefix routing, workers fetching prefixes from "
                             "each other), MiB")
    parser.add_argument("--prefix-tokens", type=int, default=512,
                        help="shared-prefix: system prompt tokens per tenant")
    parser.add_argument("--input-tokens", type=int, default=32, help="tokens per user turn")
    parser.add_argument("--output-tokens", type=int, default=32, help="tokens per answer")
    parser.add_argument("--turns", type=int, default=4, help="multi-turn: turns per conversation")
    parser.add_argument("--max-concurrency", type=int, default=8,
                        help="requests in flight at once")
    parser.add_argument("--request-rate", type=float, default=float("inf"),
                        help="Poisson arrivals per second (default: as fast as concurrency "
                             "allows)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workloads", default=",".join(WORKLOADS),
                        help=f"of {', '.join(WORKLOADS + (NO_REUSE,))}")
    parser.add_argument("--rounds", type=int, default=1,
                        help="runs of each policy per workload, alternating")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--plot", default=str(common.OUT_DIR / "routing.png"))
    args = parser.parse_args(argv)
    if args.quick:
        args.requests, args.tenants, args.prefix_tokens = 12, 3, 64
        args.input_tokens, args.output_tokens, args.turns = 8, 4, 2
    return args


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def cluster_config(args: argparse.Namespace, routing: str, workers: int, key_prefix: str):
    """The :class:`cluster.config.ClusterConfig` of one run (a free port, its own key prefix).

    Raises:
        pydantic.ValidationError: a flag out of range.
    """
    from cluster.config import ClusterConfig

    # The oracle's one worker gets the whole cluster's KV budget, so the oracle differs from
    # the cluster only in routing, not in how much it can cache.
    kv_cache_mib = args.kv_cache_mib * (args.workers if workers == 1 else 1)
    policy, _, tier = routing.partition("+")
    return ClusterConfig(model=args.model, dtype=args.dtype, num_workers=workers,
                         routing=policy, redis_url=args.redis_url, key_prefix=key_prefix,
                         port=_free_port(), kv_cache_mib=kv_cache_mib,
                         kv_tier_mib=args.kv_tier_mib if tier == "tier" else 0,
                         worker_threads=args.threads)


def bench_config(args: argparse.Namespace, workload: str, port: int,
                 tenant_key_prefix: str) -> BenchConfig:
    """The ``nalar bench`` run against a cluster on ``port``: EOS ignored, so every policy
    decodes the same number of tokens."""
    return BenchConfig(
        base_url=f"http://127.0.0.1:{port}", ignore_eos=True, progress=False,
        workload=WorkloadConfig(name=workload, input_tokens=args.input_tokens,
                                output_tokens=args.output_tokens, seed=args.seed,
                                tenants=args.tenants, prefix_tokens=args.prefix_tokens,
                                tenant_key_prefix=tenant_key_prefix,
                                hot_share=args.hot_share, turns=args.turns),
        load=LoadConfig(request_rate=args.request_rate, max_concurrency=args.max_concurrency,
                        num_requests=args.requests, warmup=args.warmup, seed=args.seed))


def run_one(args: argparse.Namespace, workload: str, routing: str, workers: int) -> dict:
    """One run on a fresh cluster: start it, drive the workload, delete the application."""
    from ray import serve

    from cluster.runtime import start_cluster
    from router.index.redis_index import delete_key_prefix

    key_prefix = f"nalar-bench-routing-{uuid.uuid4().hex[:8]}"
    config = cluster_config(args, routing, workers, key_prefix)
    common.log(f"{workload}: {routing}, {workers} worker(s), starting")
    start_cluster(config)
    try:
        result = run_benchmark(bench_config(args, workload, config.port, key_prefix))
        counters = worker_counters(config.port)
    finally:
        # Not serve.delete: Serve's HTTP proxy keeps the first run's port for as long as Serve
        # runs, so the next start_cluster would find its port taken (or serve on the old one).
        # Shutting Serve down (Ray stays up) frees the port and the workers' caches.
        serve.shutdown()
        delete_key_prefix(args.redis_url, key_prefix)
    summary = result.summary
    common.log(f"{workload}: {routing}: {summary['completed']} done, {summary['failed']} failed, "
               f"reuse {summary['prefix_reuse_ratio']}, TTFT p50 {summary['median_ttft_ms']} ms")
    return {"routing": routing, "workers": workers,
            "busiest_to_least_busy": load_imbalance(result.records, workers),
            "counters": counters, "bench": report(result)}


def worker_counters(port: int) -> dict[str, float]:
    """:data:`COUNTERS` summed over the workers at the end of a run (warm-up included), and
    the milliseconds from asking for a fetched block to storing it, per block (None when no
    block was fetched)."""
    totals = dict.fromkeys(COUNTERS.values(), 0.0)
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = COUNTERS.get(sample.name.removeprefix("nalar:").removesuffix("_total"))
            if name is not None:
                totals[name] += sample.value
    blocks = totals["imported_blocks"]
    return totals | {"import_ms_per_block": 1000 * totals["import_seconds"] / blocks
                     if blocks else None}


def figures(runs: dict[str, list[dict]]) -> dict[str, dict[str, Any]]:
    """Per policy, over its rounds: the median reuse ratio, its fraction of the oracle's, the
    median busiest/least busy ratio, TTFT p50 and output throughput, the TTFT's ratio to
    round-robin's, and each round's throughput (None where a figure it needs is missing)."""
    def median(name: str, key: str) -> float | None:
        values = [run["bench"][key] for run in runs.get(name, [])]
        return statistics.median(values) if values and None not in values else None

    oracle_reuse = median(ORACLE, "prefix_reuse_ratio")
    round_robin = median("round-robin", "median_ttft_ms")
    table = {}
    for name, rounds in runs.items():
        reuse, ttft = median(name, "prefix_reuse_ratio"), median(name, "median_ttft_ms")
        table[name] = {
            "prefix_reuse_ratio": reuse,
            "fraction_of_oracle_reuse": common.ratio(reuse, oracle_reuse),
            "busiest_to_least_busy": statistics.median(
                run["busiest_to_least_busy"] for run in rounds) if name != ORACLE else None,
            "ttft_p50_ms": ttft,
            "ttft_p50_to_round_robin": common.ratio(ttft, round_robin),
            "output_throughput": median(name, "output_throughput"),
            "output_throughput_by_round": [run["bench"]["output_throughput"] for run in rounds],
            "completed": sum(run["bench"]["completed"] for run in rounds),
            "failed": sum(run["bench"]["failed"] for run in rounds),
        }
    return table


def goals(workload: str, table: dict[str, dict]) -> list[dict]:
    """The three goals of prefix routing on one workload, or, on the workload without reuse,
    what the second tier and transfers may cost there."""
    prefix = table.get("prefix", {})
    if workload == NO_REUSE:
        tier = table.get("prefix+tier", {})
        return [common.goal(f"{workload} prefix+tier / prefix output throughput",
                            common.ratio(tier.get("output_throughput"),
                                         prefix.get("output_throughput")), 0.99)]
    return [common.goal(f"{workload} prefix reuse / oracle",
                        prefix.get("fraction_of_oracle_reuse"), 0.9),
            common.goal(f"{workload} prefix busiest / least busy",
                        prefix.get("busiest_to_least_busy"), 1.3, at_least=False),
            common.goal(f"{workload} prefix TTFT p50 / round-robin",
                        prefix.get("ttft_p50_to_round_robin"), 0.5, at_least=False)]


INFINITE_BAR = 10.0
"""Height of a busiest / least busy bar when a worker served nothing (the ratio is infinite)."""


def plot(tables: dict[str, dict[str, dict]], path: str | Path) -> Path:
    """One row per workload: reuse ratio, busiest/least busy ratio and TTFT p50 per policy,
    each bar labelled with its value."""
    panels = (("prefix_reuse_ratio", "prefix reuse ratio (cached / prompt)", None),
              ("busiest_to_least_busy", "busiest / least busy worker (requests)", 1.3),
              ("ttft_p50_ms", "TTFT p50 (ms)", None))
    figure, axes = plt.subplots(len(tables), len(panels), figsize=(13, 3.8 * len(tables)),
                                squeeze=False)
    for row, (workload, table) in enumerate(tables.items()):
        for column, (key, title, goal_line) in enumerate(panels):
            axis = axes[row, column]
            names = [name for name in table if table[name][key] is not None]
            values = [table[name][key] for name in names]
            bars = axis.bar(names, [INFINITE_BAR if math.isinf(v) else v for v in values],
                            color=["tab:green" if n == "prefix" else "tab:gray" for n in names])
            axis.bar_label(bars, labels=[f"{v:.3g}" for v in values], fontsize=8)
            if goal_line is not None:
                axis.axhline(goal_line, color="tab:red", linestyle="--", label="goal")
            axis.set_title(f"{workload}: {title}", fontsize=9)
            axis.tick_params(axis="x", labelsize=8)
    figure.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)
    common.log(f"wrote {path}")
    return path


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    from cluster.runtime import init_ray, stop_cluster

    init_ray()
    policies = args.policies.split(",")
    results: dict[str, Any] = {}
    tables: dict[str, dict] = {}
    checks: list[dict] = []
    try:
        for workload in args.workloads.split(","):
            runs: dict[str, list[dict]] = {}
            if workload != NO_REUSE:
                runs[ORACLE] = [run_one(args, workload, "prefix", 1)]
            for _ in range(args.rounds):
                for policy in policies:
                    runs.setdefault(policy, []).append(
                        run_one(args, workload, policy, args.workers))
            tables[workload] = figures(runs)
            checks += goals(workload, tables[workload])
            results[workload] = {"figures": tables[workload], "runs": runs}
    finally:
        stop_cluster()
    result = {"benchmark": "routing", "machine": common.machine_info(args.dtype),
              "quick": args.quick,
              "settings": {key: value for key, value in vars(args).items()
                           if key not in ("out", "plot")},
              "workloads": results, "goals": checks}
    common.log_goals(checks)
    common.write_json(result, args.out)
    plot(tables, args.plot)
    return result


if __name__ == "__main__":
    main()
