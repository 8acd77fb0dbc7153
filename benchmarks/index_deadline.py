"""Index lookup deadline benchmark: the latency of the router's digest index lookup on Redis.

Sizes the router's lookup deadline (``router.routing.index_lookup.DEFAULT_LOOKUP_DEADLINE_S``)
by measurement. Against the Redis at ``--redis-url`` (its own fresh key prefix, deleted at the
end), each of 2, 4 and 8 workers holds a realistic digest set (the chains of 64 prompts of 256
blocks split among them, plus ``--filler`` unrelated digests each, as a worker's KV pool would);
lookups then ask for the leading 1, 16, 64 or 256 digests of one of those prompts (prompts of 16
to 4096 tokens at 16 tokens a block), from 1, the router's concurrency, or 64 concurrent lookups
sharing one event loop, as the routing tasks of one router do. Each lookup is timed around the
router's own bounded call (:class:`~router.routing.index_lookup.IndexLookup`), so the figure is
exactly what the deadline bounds; ``client_cpu_ms_per_lookup`` is this process's CPU time per
lookup (redis-py packing and parsing), what a lookup costs without contention. A setting stops
at ``--samples`` lookups or after ``--seconds-per-setting``, whichever comes first, so a run
stays under two minutes on a loaded machine (``n`` says how many it got; p99.9 of fewer than
1000 is close to the maximum). The 1-minute load average before and after goes in the JSON.

Ray Serve runs at most ``min(50, 2 × replicas)`` routing tasks per router at once
(``RequestRouter.max_num_routing_tasks``): that is the concurrency the router sees. The
recommended deadline is the worst p99.9, over every prompt size, at that concurrency with the
default cluster's ``--cluster-workers`` (2), times ``--headroom``, rounded up to 50 ms, and at
most ``--max-deadline-ms``: what a miss costs (waiting longer for the index than the prefill it
would save never pays). Larger
worker counts are measured for the operator who runs more (the deadline is the router's
``index_timeout_s``). The JSON holds p50/p90/p99/p99.9 per setting, that recommendation with its
reason, and the deadline the code uses.

    .venv/bin/python benchmarks/index_deadline.py [--samples 1000] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import math
import os
import random
import time
import uuid
from typing import Any

try:
    from benchmarks import common
except ImportError:  # run as a script: benchmarks/ is on sys.path, the repo root is not
    import common

from contract.kv_events import KVEvent, encode_events  # noqa: E402
from router.index.redis_index import RedisIndex, delete_key_prefix  # noqa: E402
from router.routing.index_lookup import DEFAULT_LOOKUP_DEADLINE_S, IndexLookup  # noqa: E402
from router.routing.telemetry import RoutingTelemetry  # noqa: E402

WORKERS = (2, 4, 8)
DIGESTS = (1, 16, 64, 256)
MAX_CONCURRENCY = 64
PROMPTS = 64
"""Distinct prompts whose chains the workers hold (each ``max(DIGESTS)`` blocks long)."""

MODEL_KEY = "bench"
MAX_ROUTING_TASKS = 50
"""Ray Serve's cap on one router's concurrent routing tasks (``max_num_routing_tasks_cap``)."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--redis-url", default=os.environ.get("REDIS_URL",
                                                              "redis://127.0.0.1:6379/0"))
    parser.add_argument("--key-prefix", default=None,
                        help="this run's Redis key prefix, deleted at the end (default: fresh)")
    parser.add_argument("--samples", type=int, default=1000,
                        help="timed lookups per setting (p99.9 needs about 1000)")
    parser.add_argument("--seconds-per-setting", type=float, default=2.0,
                        help="stop a setting after this long even short of --samples")
    parser.add_argument("--filler", type=int, default=4096,
                        help="unrelated digests each worker holds besides the prompts' chains")
    parser.add_argument("--headroom", type=float, default=1.0,
                        help="the recommended deadline's factor over the measured p99.9")
    parser.add_argument("--max-deadline-ms", type=float, default=500.0,
                        help="cap: what a miss costs (default: a 640-token prefill, ~0.5 s "
                             "at ~1,200 tokens/s on a 2-core machine)")
    parser.add_argument("--cluster-workers", type=int, default=2,
                        help="workers of the cluster the deadline is sized for")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    parser.add_argument("--out", default=str(common.OUT_DIR / "index_deadline.json"))
    return parser.parse_args(argv)


def chain(seed: str, length: int) -> list[bytes]:
    """A digest chain as the workers hash it: each digest covers its parent."""
    digests, parent = [], hashlib.sha256(seed.encode()).digest()
    for block in range(length):
        parent = hashlib.sha256(parent + block.to_bytes(4, "big")).digest()
        digests.append(parent)
    return digests


def router_concurrency(workers: int) -> int:
    """Routing tasks one router runs at once with ``workers`` replicas (Ray Serve's bound)."""
    return min(MAX_ROUTING_TASKS, 2 * workers)


def concurrencies(workers: int) -> tuple[int, ...]:
    """Concurrent lookups measured with ``workers`` replicas: one, the router's, the most."""
    return tuple(sorted({1, router_concurrency(workers), MAX_CONCURRENCY}))


async def populate(index: RedisIndex, workers: list[str], prompts: list[list[bytes]],
                   filler: int) -> None:
    """Each prompt's chain goes to one worker (round robin); every worker gets filler too."""
    for position, worker in enumerate(workers):
        held = [d for p, prompt in enumerate(prompts) if p % len(workers) == position
                for d in prompt]
        held += chain(f"filler/{worker}", filler)
        await index.publish(MODEL_KEY, worker, encode_events([KVEvent("stored", held)]))


async def timed_lookups(lookup: IndexLookup, groups: dict[str, list[str]],
                        prompts: list[list[bytes]], digests: int, concurrency: int,
                        samples: int, rng: random.Random,
                        max_seconds: float = math.inf) -> list[float]:
    """Latencies (s) of ``samples`` lookups, ``concurrency`` at a time in this loop; fewer when
    ``max_seconds`` run out first."""
    latencies: list[float] = []
    remaining = samples
    stop_at = time.perf_counter() + max_seconds

    async def client() -> None:
        nonlocal remaining
        while remaining > 0 and time.perf_counter() < stop_at:
            remaining -= 1
            wanted = rng.choice(prompts)[:digests]
            started = time.perf_counter()
            answer = await lookup.cached_blocks(wanted, groups)
            latencies.append(time.perf_counter() - started)
            if answer.cached is None:
                raise RuntimeError(f"lookup failed: {answer.fallback}")

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return latencies


def summary_ms(latencies_s: list[float]) -> dict[str, float | int]:
    """``n``, p50/p90/p99/p99.9 and max, in milliseconds (3 decimals)."""
    figures = {f"p{q:g}_ms": common.percentile(latencies_s, q) * 1000
               for q in (50, 90, 99, 99.9)}
    figures["max_ms"] = max(latencies_s) * 1000
    return {"n": len(latencies_s), **{k: round(v, 3) for k, v in figures.items()}}


async def measure(args: argparse.Namespace, key_prefix: str) -> list[dict[str, Any]]:
    """Every setting's latency summary (one index, one event loop)."""
    rng = random.Random(0)
    prompts = [chain(f"prompt/{p}", max(DIGESTS)) for p in range(PROMPTS)]
    # A deadline no lookup reaches: a timed-out lookup would be cut off, not measured.
    index = RedisIndex(args.redis_url, key_prefix, worker_ttl_s=600.0, timeout_s=10.0)
    rows = []
    try:
        for workers in WORKERS:
            worker_ids = [f"w{i}" for i in range(workers)]
            await populate(index, worker_ids, prompts, args.filler)
            lookup = IndexLookup(index, RoutingTelemetry(), timeout_s=10.0, retry_s=0.0)
            groups = {MODEL_KEY: worker_ids}
            await timed_lookups(lookup, groups, prompts, 1, 1, 20, rng)  # connect, warm up
            for digests in DIGESTS:
                for concurrency in concurrencies(workers):
                    cpu_started = time.process_time()
                    latencies = await timed_lookups(lookup, groups, prompts, digests,
                                                    concurrency, args.samples, rng,
                                                    args.seconds_per_setting)
                    cpu_ms = (time.process_time() - cpu_started) * 1000 / len(latencies)
                    rows.append({"workers": workers, "digests": digests,
                                 "prompt_tokens": digests * 16, "concurrency": concurrency,
                                 **summary_ms(latencies),
                                 "client_cpu_ms_per_lookup": round(cpu_ms, 3)})
                    common.log(str(rows[-1]))
    finally:
        await index.close()
    return rows


def recommend(rows: list[dict[str, Any]], headroom: float, cluster_workers: int = 2,
              max_deadline_ms: float = math.inf) -> dict[str, Any]:
    """The deadline: the worst p99.9 over prompt sizes at the router's concurrency with
    ``cluster_workers`` workers, times ``headroom``, rounded up to 50 ms, at most
    ``max_deadline_ms``.

    Raises:
        ValueError: no row has ``cluster_workers`` workers at the router's concurrency.
    """
    at_router = [row for row in rows if row["workers"] == cluster_workers
                 and row["concurrency"] == router_concurrency(cluster_workers)]
    if not at_router:
        raise ValueError(f"no setting with {cluster_workers} workers at the router's concurrency")
    worst = max(at_router, key=lambda row: row["p99.9_ms"])
    deadline_ms = min(math.ceil(worst["p99.9_ms"] * headroom / 50) * 50, max_deadline_ms)
    reason = (f"worst p99.9 at the router's concurrency with {cluster_workers} workers "
              f"({worst['p99.9_ms']} ms: {worst['digests']} digests, {worst['concurrency']} "
              f"concurrent lookups) x {headroom:g}, rounded up to 50 ms, capped at "
              f"{max_deadline_ms:g} ms (what a miss costs)")
    return {"deadline_s": deadline_ms / 1000, "reason": reason, "headroom": headroom,
            "worst_p99.9_at_router_concurrency": worst,
            "worst_p99.9_at_concurrency_64_ms": max(
                (row["p99.9_ms"] for row in rows if row["concurrency"] == MAX_CONCURRENCY),
                default=None)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.quick:
        args.samples, args.filler = 20, 64
    key_prefix = args.key_prefix or f"nalar-bench-deadline-{uuid.uuid4().hex[:12]}"
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    try:
        rows = asyncio.run(measure(args, key_prefix))
    finally:
        delete_key_prefix(args.redis_url, f"{key_prefix}:")
    result = {
        "benchmark": "index_deadline",
        "machine": common.machine_info(),
        "load_average_1m": {"before": load_before, "after": os.getloadavg()[0]},
        "settings": {"workers": WORKERS, "digests": DIGESTS,
                     "concurrency": {w: concurrencies(w) for w in WORKERS},
                     "samples": args.samples, "seconds_per_setting": args.seconds_per_setting,
                     "filler_digests_per_worker": args.filler,
                     "prompts": PROMPTS, "block_tokens": 16},
        "rows": rows,
        "recommended": recommend(rows, args.headroom, args.cluster_workers,
                                 args.max_deadline_ms),
        "code_deadline_s": DEFAULT_LOOKUP_DEADLINE_S,
        "wall_s": round(time.perf_counter() - started, 1),
    }
    common.write_json(result, args.out)
    return result


if __name__ == "__main__":
    main()
