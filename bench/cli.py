"""``nalar bench``: load-test any OpenAI-compatible server and report as ``vllm bench serve``
does (see :mod:`bench.runner` for the load model, :mod:`bench.stats` for the definitions)."""

from __future__ import annotations

import argparse
import math
import sys

import httpx

from bench.adapters import DISTRIBUTIONS
from bench.client import ENDPOINTS
from bench.plot import plot_run
from bench.report import report, summary_table, write_report
from bench.runner import BenchConfig, LoadConfig, run_benchmark
from bench.stats import parse_goodput
from bench.workloads import WORKLOADS, WorkloadConfig


def add_bench_parser(commands) -> None:
    """Registers ``nalar bench`` and its flags on the ``nalar`` sub-command parser."""
    bench = commands.add_parser("bench", help="load-test an OpenAI-compatible server",
                                description=__doc__)
    target = bench.add_argument_group("target")
    target.add_argument("--base-url", default="http://127.0.0.1:8000",
                        help="the server's root or /v1 URL")
    target.add_argument("--endpoint", choices=list(ENDPOINTS), default="chat")
    target.add_argument("--model", default=None, help="default: the first of GET /v1/models")
    target.add_argument("--lora-adapters", default="",
                        help="comma-separated LoRA adapter names: each session asks for one "
                             "of them as its model")
    target.add_argument("--lora-distribution", choices=list(DISTRIBUTIONS), default="uniform",
                        help="how sessions pick an adapter: uniform, or zipf (the i-th of "
                             "--lora-adapters with weight 1/i)")
    target.add_argument("--api-key", default=None,
                        help="bearer key (shared-prefix sends each tenant's own key)")
    target.add_argument("--timeout", type=float, default=600.0, dest="timeout_s",
                        help="the most one request may take, s")
    _workload_flags(bench)
    _load_flags(bench)
    out = bench.add_argument_group("output")
    out.add_argument("--goodput", nargs="+", default=[], metavar="METRIC:MS",
                     help="SLOs for request_goodput, e.g. ttft:500 tpot:50 (ttft, tpot, e2el)")
    out.add_argument("--output-json", default=None, help="write the JSON report here")
    out.add_argument("--save-detailed", action="store_true",
                     help="put every request's record in the JSON report")
    out.add_argument("--plot", default=None,
                     help="write a PNG of latency CDFs and throughput over time here")
    out.add_argument("--no-progress", action="store_true", help="no progress bar")


def _workload_flags(bench: argparse.ArgumentParser) -> None:
    group = bench.add_argument_group("workload")
    group.add_argument("--workload", choices=list(WORKLOADS), default="random")
    group.add_argument("--input-tokens", type=int, default=128,
                       help="user turn length (copy: source snippet length), tokens")
    group.add_argument("--output-tokens", type=int, default=128, help="max_tokens of requests")
    group.add_argument("--range-ratio", type=float, default=0.0,
                       help="draw lengths uniformly from [n(1-r), n(1+r)]; 0: fixed")
    group.add_argument("--seed", type=int, default=0)
    group.add_argument("--tenants", type=int, default=8, help="shared-prefix: tenants")
    group.add_argument("--prefix-tokens", type=int, default=512,
                       help="shared-prefix: system prompt length per tenant, tokens")
    group.add_argument("--hot-share", type=float, default=None,
                       help="shared-prefix: fraction of requests from tenant 0 (a hot system "
                            "prompt); default: every tenant alike")
    group.add_argument("--tenant-key-prefix", default="nalar-bench-tenant",
                       help="shared-prefix: tenant i's API key is PREFIX-i")
    group.add_argument("--turns", type=int, default=4, help="multi-turn: turns per conversation")
    group.add_argument("--think-time", type=float, default=0.0, dest="think_time_s",
                       help="multi-turn: pause between a reply and the next turn, s")
    group.add_argument("--temperature", type=float, default=0.0)
    group.add_argument("--ignore-eos", action="store_true",
                       help="send ignore_eos (a vLLM extension): decode all of max_tokens")


def _load_flags(bench: argparse.ArgumentParser) -> None:
    group = bench.add_argument_group("load")
    group.add_argument("--request-rate", type=float, default=math.inf,
                       help="Poisson arrivals per second (multi-turn: conversations); "
                            "default inf: all at once")
    group.add_argument("--max-concurrency", type=int, default=None,
                       help="the most requests in flight")
    group.add_argument("--num-requests", type=int, default=100,
                       help="measured requests (0: no bound; then give --duration)")
    group.add_argument("--duration", type=float, default=None, dest="duration_s",
                       help="no measured request starts after this many seconds")
    group.add_argument("--warmup", type=int, default=0,
                       help="requests sent first and left out of the statistics")


def bench_config(args: argparse.Namespace) -> BenchConfig:
    """The run the flags describe.

    Raises:
        ValueError: flags out of range or a malformed ``--goodput``.
    """
    workload = WorkloadConfig(
        name=args.workload, input_tokens=args.input_tokens, output_tokens=args.output_tokens,
        range_ratio=args.range_ratio, seed=args.seed, api_key=args.api_key,
        tenants=args.tenants, prefix_tokens=args.prefix_tokens,
        tenant_key_prefix=args.tenant_key_prefix, hot_share=args.hot_share, turns=args.turns,
        think_time_s=args.think_time_s)
    load = LoadConfig(request_rate=args.request_rate, max_concurrency=args.max_concurrency,
                      num_requests=args.num_requests or None, duration_s=args.duration_s,
                      warmup=args.warmup, seed=args.seed)
    return BenchConfig(base_url=args.base_url, endpoint=args.endpoint, model=args.model,
                       workload=workload, load=load, temperature=args.temperature,
                       ignore_eos=args.ignore_eos, timeout_s=args.timeout_s,
                       lora_adapters=[n for n in args.lora_adapters.split(",") if n],
                       lora_distribution=args.lora_distribution,
                       goodput_slos_ms=parse_goodput(args.goodput),
                       progress=not args.no_progress)


def bench_command(args: argparse.Namespace) -> int:
    """Runs ``nalar bench``; returns the process exit code: 0 when at least one request
    succeeded, 1 when every request failed or the server could not be asked for its model,
    2 for bad flags."""
    try:
        config = bench_config(args)
    except ValueError as exc:
        print(f"nalar bench: {exc}", file=sys.stderr)
        return 2
    try:
        result = run_benchmark(config)
    except (httpx.HTTPError, LookupError) as exc:
        print(f"nalar bench: cannot get the model from {config.base_url}: {exc}",
              file=sys.stderr)
        return 1
    print(summary_table(result.summary))
    if args.output_json:
        path = write_report(report(result, detailed=args.save_detailed), args.output_json)
        print(f"wrote {path}")
    if args.plot:
        title = f"{config.workload.name} on {config.base_url} ({result.model})"
        print(f"wrote {plot_run(result.records, result.duration_s, args.plot, title)}")
    if result.summary["completed"] == 0:
        print("nalar bench: every request failed", file=sys.stderr)
        return 1
    return 0
