"""Chaos benchmark: faults injected into a live cluster under load.

One application, ``nalar-chaos`` (served under ``/chaos``), with two fp32 workers, a private
``redis-server`` as its index (never the shared one: this one is killed) and ngram speculation
on one draft replica (``speculative_remote``), so every fault below has something to strike:

* ``worker_kill``: ``ray.kill`` of the worker replica serving the first accepted stream;
* ``redis_restart``: the private ``redis-server`` killed, restarted empty ``outage_s`` later;
* ``index_slow``: ``CLIENT PAUSE`` holds every Redis client for ``outage_s``, far past the
  router's index lookup deadline (tens of milliseconds);
* ``ingress_restart``: ``ray.kill`` of the NalarIngress replica (Serve starts another);
* ``draft_kill``: ``ray.kill`` of the draft replica while the workers draft through it; with
  temperature 0 the output must equal a run without the fault.

Per case, ``streams`` streaming completions (EOS ignored, copy-heavy prompts so the ngram
proposer drafts) are accepted (HTTP 200) before the fault strikes, and ``during`` more are sent
while it lasts. Each request is classified as *completed*, *explicit error* (an HTTP error
status or an SSE error event), *cut* (the connection or stream ended without either) or *hung*
(not finished within ``hang_bound_s``). After the load drains, every worker's KV pool must hold
no block in use (``leaked_blocks``) and its free + evictable + in-use blocks must add up to its
total. Time to recovery runs from the end of the fault until every worker answers, the index is
up and a repeated shared-prefix request is served from the prefix cache as before the fault
(probed every 0.5 s alongside the load; ``hit_rate_before`` / ``hit_rate_after``: cached /
prompt tokens of that request).

    .venv/bin/python benchmarks/chaos.py [--cases worker_kill,...] [--quick]

Run it only on a quiet machine: it holds about 2 CPUs for up to ~5 minutes.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import itertools
import random
import socket
import sys
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import ray
import redis.asyncio as aioredis
from prometheus_client.parser import text_string_to_metric_families

from bench.client import WORKER_HEADER, OpenAIClient, first_model
from bench.records import BenchRequest, RequestRecord
from bench.text import random_words
from benchmarks import common

APP = "nalar-chaos"
ROUTE = "/chaos"
SERVE_NAMESPACE = "serve"
"""Ray namespace of Serve's replica actors (``SERVE_REPLICA::<app>#<deployment>#<id>``)."""

CASES = ("worker_kill", "redis_restart", "index_slow", "ingress_restart", "draft_kill")
SETTLE_S = 0.2
"""Pause between the last stream's 200 and the fault, so every stream is decoding."""


@dataclass
class Sizes:
    """How hard a case pushes (tokens; seconds).

    Attributes:
        streams: requests accepted (HTTP 200) before the fault strikes.
        during: requests sent, evenly spread, over ``outage_s`` from the fault's start.
        max_tokens: output tokens of each request (EOS ignored).
        prefix_words: length of the hit-rate probe's shared prefix (one token per word).
        outage_s: how long Redis stays down or paused.
        hang_bound_s: a request not finished within this counts as hung.
        recovery_bound_s: the longest wait for recovery (and for the pools to drain).
    """

    streams: int = 8
    during: int = 8
    max_tokens: int = 64
    prefix_words: int = 256
    outage_s: float = 5.0
    hang_bound_s: float = 180.0
    recovery_bound_s: float = 180.0


QUICK = Sizes(streams=4, during=4, max_tokens=96, prefix_words=128, outage_s=3.0,
              hang_bound_s=120.0, recovery_bound_s=150.0)
"""CI sizes (``--quick`` and tests/cluster/test_chaos.py)."""


# --- the application under test ---------------------------------------------------------------

def chaos_config(redis_url: str, key_prefix: str, dtype: str = "float32"):
    """Two small workers on the given Redis, drafting through one ngram draft replica.

    128 MiB of KV each (about 2,900 fp32 tokens) holds the probe's prefix through the load, so
    a lost hit means the fault lost it, not an eviction. A 64 MiB second tier each lets a
    worker fetch a prefix that the other holds (KV transfers land in the tier), so a holder
    can be killed mid-transfer (tests/cluster/test_chaos.py).

    The draft deadline is generous (0.5 s) so that drafts are really proposed on a busy CPU
    (the point of ``draft_kill``); adaptive speculation is off so the workers always draft.
    Dense weights: outputs are compared with a fault-free run, and on weights kept quantized
    a token's rounding depends on its step's row count (int8 activations up to 4 rows), so a
    run that loses its drafts would differ for that reason alone.
    """
    from cluster.config import ClusterConfig

    return ClusterConfig(num_workers=2, redis_url=redis_url, key_prefix=key_prefix, dtype=dtype,
                         quantization="none", kv_cache_mib=128, kv_tier_mib=64,
                         worker_cpus=0.25, worker_threads=1,
                         routing_stats_period_s=0.2, worker_ttl_s=15.0, speculative="ngram",
                         speculative_remote=True, draft_deadline_s=0.5,
                         adaptive_speculation=False, draft_cpus=0.1)


@dataclass
class ChaosTarget:
    """The deployed chaos application.

    Attributes:
        config: its configuration.
        redis: its private ``redis-server`` (``tests/helpers.PrivateRedis``: ``url``,
            ``kill()``, ``start()``).
        base_url: its HTTP root (``http://host:port/chaos``).
    """

    config: Any
    redis: Any
    base_url: str

    @functools.cached_property
    def workers(self):
        """One handle to the worker deployment (each handle builds a router of its own)."""
        from ray import serve

        from cluster.app import WORKER_DEPLOYMENT
        return serve.get_deployment_handle(WORKER_DEPLOYMENT, APP)


def deploy(redis_server: Any, port: int, dtype: str = "float32") -> ChaosTarget:
    """Deploys :data:`APP` under :data:`ROUTE` on the running Serve instance, whose HTTP proxy
    listens on ``port``; returns once every replica is up."""
    from ray import serve

    from cluster.app import build_app

    config = chaos_config(redis_server.url, f"nalar-chaos-{uuid.uuid4().hex[:8]}", dtype)
    serve.run(build_app(config), name=APP, route_prefix=ROUTE)
    return ChaosTarget(config, redis_server, f"http://127.0.0.1:{port}{ROUTE}")


def replica_actors(app: str, deployment: str) -> list[str]:
    """Names of the live replica actors of ``deployment`` in ``app``, sorted."""
    prefix = f"SERVE_REPLICA::{app}#{deployment}#"
    return sorted(actor["name"] for actor in ray.util.list_named_actors(all_namespaces=True)
                  if actor["namespace"] == SERVE_NAMESPACE and actor["name"].startswith(prefix))


def kill_replica(app: str, deployment: str, replica_id: str | None = None) -> str:
    """``ray.kill`` one replica actor (``replica_id``, else the first by name); Serve starts a
    replacement under a new id. Returns the killed actor's name.

    Raises:
        LookupError: no such replica is alive.
    """
    names = replica_actors(app, deployment)
    if replica_id is not None:
        names = [name for name in names if name.endswith(f"#{replica_id}")]
    if not names:
        raise LookupError(f"no live replica of {app}/{deployment} ({replica_id or 'any'})")
    ray.kill(ray.get_actor(names[0], namespace=SERVE_NAMESPACE), no_restart=True)
    return names[0]


# --- what the cluster reports -----------------------------------------------------------------

async def worker_stats(handle: Any, timeout_s: float = 2.0) -> list[dict]:
    """``engine_stats`` of every worker replica that answers within ``timeout_s``."""
    from cluster.metrics import fetch_worker_stats

    return (await asyncio.to_thread(fetch_worker_stats, handle, timeout_s)).workers


def pool_report(stats: list[dict]) -> dict[str, Any]:
    """KV pool figures over ``stats``: blocks still in use (leaked, once the load has drained),
    whether each pool's free + evictable + in-use blocks add up to its total, and sequences
    still running or waiting."""
    return {"workers": len(stats),
            "leaked_blocks": sum(s["blocks_in_use"] for s in stats),
            "pool_counts_ok": all(s["blocks_free"] + s["blocks_evictable"] + s["blocks_in_use"]
                                  == s["blocks_total"] for s in stats),
            "running": sum(s["running"] for s in stats),
            "waiting": sum(s["waiting"] for s in stats)}


async def drained_pools(handle: Any, bound_s: float) -> dict[str, Any]:
    """Polls the workers until none holds a KV block in use (cancellations take a moment to
    reach the engines), at most ``bound_s``; returns :func:`pool_report` of the last poll."""
    deadline = time.monotonic() + bound_s
    while True:
        stats = await worker_stats(handle)
        if (stats and all(s["blocks_in_use"] == 0 for s in stats)) or (
                time.monotonic() > deadline):
            return pool_report(stats)
        await asyncio.sleep(0.2)


async def scrape(http: httpx.AsyncClient, base_url: str) -> dict[str, dict[str, float]]:
    """``GET /metrics`` as {series name: {label values joined by ",": value}}; empty when the
    ingress does not answer."""
    try:
        response = await http.get(f"{base_url}/metrics", timeout=10)
        response.raise_for_status()
    except httpx.HTTPError:
        return {}
    series: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            key = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            series.setdefault(sample.name, {})[key] = sample.value
    return series


def counter_increase(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Increase of each labelled counter; a counter lower than before restarted from zero (a
    replaced process), so its increase is its new value, as Prometheus's ``increase`` has it."""
    increase = {key: value - before.get(key, 0.0) if value >= before.get(key, 0.0) else value
                for key, value in after.items()}
    return {key: value for key, value in increase.items() if value}


# --- load -------------------------------------------------------------------------------------

class Answers:
    """Response heads as they arrive (an httpx response hook): status and serving worker of
    every POST, in order."""

    def __init__(self) -> None:
        self.heads: list[tuple[int, str | None]] = []

    async def hook(self, response: httpx.Response) -> None:
        if response.request.method == "POST":
            self.heads.append((response.status_code, response.headers.get(WORKER_HEADER)))

    async def wait_for(self, count: int, bound_s: float) -> None:
        """Until ``count`` heads have arrived, at most ``bound_s``."""
        deadline = time.monotonic() + bound_s
        while len(self.heads) < count and time.monotonic() < deadline:
            await asyncio.sleep(0.05)


def copy_request(label: str, seed: int, max_tokens: int) -> BenchRequest:
    """A copy-heavy prompt (a phrase of 20 words three times) that the ngram proposer drafts
    from; the seed picks the phrase."""
    phrase = random_words(random.Random(seed), 20)
    content = f"Repeat after me: {phrase}. {phrase}. {phrase}."
    return BenchRequest([{"role": "user", "content": content}], max_tokens, 70, label=label)


_PROBE_TAILS = itertools.count(1)
"""Seeds of the probes' tails: every probe in a process has a tail of its own."""


def probe_request(sizes: Sizes) -> BenchRequest:
    """The shared-prefix probe: a fixed prefix of ``prefix_words`` words, then a tail no other
    probe has (so only the prefix can come from the cache)."""
    prefix = random_words(random.Random(7), sizes.prefix_words)
    tail = random_words(random.Random(next(_PROBE_TAILS)), 8)
    return BenchRequest([{"role": "user", "content": f"{prefix} {tail}"}], 2,
                        sizes.prefix_words + 8, label="probe")


def outcome(record: RequestRecord) -> str:
    """``completed``, ``explicit_error`` (HTTP error status or SSE error event), ``hung``
    (the client's bound ran out) or ``cut`` (the stream ended without either)."""
    if record.ok:
        return "completed"
    if record.failure in ("http", "sse_error"):
        return "explicit_error"
    return "hung" if record.failure == "timeout" else "cut"


def tally(records: list[RequestRecord]) -> dict[str, Any]:
    """Outcomes, HTTP statuses and the distinct error messages (first 5) of ``records``."""
    outcomes = Counter(outcome(r) for r in records)
    return {"sent": len(records),
            **{name: outcomes.get(name, 0)
               for name in ("completed", "explicit_error", "cut", "hung")},
            "statuses": dict(Counter(str(r.http_status) for r in records)),
            "errors": sorted({f"{r.failure}: {r.error}" for r in records if not r.ok})[:5]}


def hit_rate(record: RequestRecord) -> float | None:
    """Cached / prompt tokens of a successful request; None otherwise."""
    if not record.ok or not record.prompt_tokens or record.cached_tokens is None:
        return None
    return record.cached_tokens / record.prompt_tokens


# --- one case ---------------------------------------------------------------------------------

Strike = Callable[["ChaosTarget", Sizes, list[str]], Awaitable[dict[str, Any]]]
"""A fault: strikes given the workers serving the accepted streams, returns once the fault is
over (the condition removed, or the kill done), with facts for the report."""


async def kill_worker(target: ChaosTarget, sizes: Sizes, workers: list[str]) -> dict:
    from cluster.app import WORKER_DEPLOYMENT
    return {"killed": kill_replica(APP, WORKER_DEPLOYMENT, workers[0]), "worker": workers[0]}


async def restart_redis(target: ChaosTarget, sizes: Sizes, workers: list[str]) -> dict:
    await asyncio.to_thread(target.redis.kill)
    await asyncio.sleep(sizes.outage_s)
    await asyncio.to_thread(target.redis.start)  # empty: no persistence
    return {}


async def pause_index(target: ChaosTarget, sizes: Sizes, workers: list[str]) -> dict:
    client = aioredis.Redis.from_url(target.redis.url)
    try:
        # Every client's commands (reads and writes) wait until the pause ends.
        await client.execute_command("CLIENT", "PAUSE", int(sizes.outage_s * 1000), "ALL")
    finally:
        await client.aclose()
    await asyncio.sleep(sizes.outage_s)
    return {}


async def kill_ingress(target: ChaosTarget, sizes: Sizes, workers: list[str]) -> dict:
    from cluster.app import INGRESS_DEPLOYMENT
    return {"killed": kill_replica(APP, INGRESS_DEPLOYMENT)}


async def kill_draft(target: ChaosTarget, sizes: Sizes, workers: list[str]) -> dict:
    from cluster.draft_deployment import DRAFT_DEPLOYMENT
    return {"killed": kill_replica(APP, DRAFT_DEPLOYMENT)}


@dataclass(frozen=True)
class Case:
    """A fault and what else to check: ``compare_outputs`` runs the same requests once without
    the fault first, and the faulted run's texts must be identical (temperature 0)."""

    name: str
    description: str
    strike: Strike
    compare_outputs: bool = False


CASE_TABLE = {case.name: case for case in (
    Case("worker_kill", "ray.kill the worker replica serving a stream, mid-stream", kill_worker),
    Case("redis_restart", "kill the index's redis-server, restart it empty after the outage",
         restart_redis),
    Case("index_slow", "CLIENT PAUSE the index's Redis for the outage (lookups miss their "
         "deadline)", pause_index),
    Case("ingress_restart", "ray.kill the NalarIngress replica, mid-stream", kill_ingress),
    Case("draft_kill", "ray.kill the draft replica while workers draft through it",
         kill_draft, compare_outputs=True),
)}


@dataclass
class CaseResult:
    """One case's figures (``figures``, the JSON row) and the records behind them."""

    figures: dict[str, Any]
    before: list[RequestRecord] = field(default_factory=list)
    during: list[RequestRecord] = field(default_factory=list)
    reference: dict[str, str] = field(default_factory=dict)


async def send_spread(client: OpenAIClient, requests: list[BenchRequest], spread_s: float,
                      origin: float) -> list[RequestRecord]:
    """Sends ``requests`` evenly over ``spread_s`` seconds; their records, in order."""
    async def send_at(i: int, request: BenchRequest) -> RequestRecord:
        await asyncio.sleep(i * spread_s / max(1, len(requests)))
        return await client.send(request, origin)
    return list(await asyncio.gather(*(send_at(i, r) for i, r in enumerate(requests))))


async def index_up(http: httpx.AsyncClient, base_url: str) -> bool:
    """Whether the router's last index lookup succeeded (``nalar:index_up``)."""
    return any(v == 1.0 for v in (await scrape(http, base_url)).get("nalar:index_up",
                                                                     {}).values())


async def recover(target: ChaosTarget, client: OpenAIClient, http: httpx.AsyncClient,
                  sizes: Sizes, cached_before: int, since: float) -> tuple[float | None, dict]:
    """Waits until every worker answers, the index is up and a shared-prefix probe gets at
    least ``cached_before`` cached tokens again. Returns (seconds since ``since``, or None
    when the bound ran out; the last probe's figures)."""
    deadline = since + sizes.recovery_bound_s
    last: dict[str, Any] = {}
    while time.perf_counter() < deadline:
        full = len(await worker_stats(target.workers)) == target.config.num_workers
        record = await client.send(probe_request(sizes), since)
        last = {"probe_ok": record.ok, "cached_tokens": record.cached_tokens,
                "hit_rate": hit_rate(record)}
        if (full and record.ok and (record.cached_tokens or 0) >= cached_before
                and await index_up(http, target.base_url)):
            return time.perf_counter() - since, last
        await asyncio.sleep(0.5)
    return None, last


async def warm_probe(client: OpenAIClient, sizes: Sizes, block_size: int,
                     tries: int = 20) -> RequestRecord:
    """Sends probes until one is served with the whole prefix but its last partial block from
    the cache (the prefix reached a worker's cache and the index), at most ``tries``; the last
    probe's record."""
    for _ in range(tries):
        record = await client.send(probe_request(sizes), time.perf_counter())
        if (record.cached_tokens or 0) >= sizes.prefix_words - block_size:
            return record
        await asyncio.sleep(0.3)
    return record


async def draft_misses(handle: Any) -> int:
    """Remote draft calls that failed, missed their deadline or were skipped while backing
    off, summed over the workers."""
    stats = await worker_stats(handle)
    return sum(s.get("draft_failures", 0) + s.get("draft_timeouts", 0) + s.get("draft_skipped", 0)
               for s in stats)


async def run_case(target: ChaosTarget, case: Case, sizes: Sizes, seed: int = 0) -> CaseResult:
    """Runs one case against ``target`` (which must be at full strength); see the module
    docstring for what is measured. ``seed`` picks the load's prompts."""
    answers = Answers()
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(limits=limits, timeout=sizes.hang_bound_s,
                                 event_hooks={"response": [answers.hook]}) as http:
        model = await first_model(http, target.base_url, None)
        client = OpenAIClient(http, target.base_url, model, "completions", ignore_eos=True,
                              timeout_s=sizes.hang_bound_s)
        origin = time.perf_counter()
        warm = await warm_probe(client, sizes, target.config.block_size)
        cached_before = warm.cached_tokens or 0
        before_requests = [copy_request(f"before-{i}", seed * 1000 + i, sizes.max_tokens)
                           for i in range(sizes.streams)]
        reference = {}
        if case.compare_outputs:
            records = await asyncio.gather(*(client.send(r, origin) for r in before_requests))
            reference = {r.label: r.output_text for r in records if r.ok}
        metrics_before = await scrape(http, target.base_url)
        misses_before = await draft_misses(target.workers)

        answers.heads.clear()
        before = [asyncio.create_task(client.send(r, origin)) for r in before_requests]
        await answers.wait_for(len(before), sizes.hang_bound_s)
        await asyncio.sleep(SETTLE_S)
        accepted_workers = [worker for status, worker in answers.heads if status == 200]
        fault_start = time.perf_counter()
        during_requests = [copy_request(f"during-{i}", seed * 1000 + 500 + i, sizes.max_tokens)
                           for i in range(sizes.during)]
        during = asyncio.create_task(send_spread(client, during_requests, sizes.outage_s,
                                                 origin))
        facts = await case.strike(target, sizes, accepted_workers)
        fault_end = time.perf_counter()
        recovery = asyncio.create_task(recover(target, client, http, sizes, cached_before,
                                               fault_end))  # probes alongside the load
        before_records = list(await asyncio.gather(*before))
        during_records = await during
        recovery_s, probe = await recovery
        pools = await drained_pools(target.workers, sizes.recovery_bound_s)
        metrics_after = await scrape(http, target.base_url)
        misses = await draft_misses(target.workers) - misses_before

    accepted = [r for r in before_records if r.http_status == 200]
    figures = {
        "case": case.name, "fault": case.description, **facts,
        "fault_s": round(fault_end - fault_start, 2),
        "accepted_before_fault": len(accepted),
        "before": tally(before_records), "during": tally(during_records),
        **pools,
        "recovery_s": None if recovery_s is None else round(recovery_s, 2),
        "hit_rate_before": hit_rate(warm), "hit_rate_after": probe.get("hit_rate"),
        "cached_tokens_before": cached_before, "cached_tokens_after": probe.get("cached_tokens"),
        "index_fallbacks": counter_increase(
            metrics_before.get("nalar:router_fallbacks_total", {}),
            metrics_after.get("nalar:router_fallbacks_total", {})),
    }
    if case.compare_outputs:
        figures["draft_calls_missed"] = misses
        figures["identical_outputs"] = sum(
            r.ok and reference.get(r.label) == r.output_text for r in before_records)
    return CaseResult(figures, before_records, during_records, reference)


# --- the script -------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    defaults = Sizes()
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated, in order")
    parser.add_argument("--streams", type=int, default=defaults.streams)
    parser.add_argument("--during", type=int, default=defaults.during)
    parser.add_argument("--max-tokens", type=int, default=defaults.max_tokens)
    parser.add_argument("--prefix-words", type=int, default=defaults.prefix_words)
    parser.add_argument("--outage-s", type=float, default=defaults.outage_s)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--quick", action="store_true", help="the CI sizes")
    parser.add_argument("--out", default=str(common.OUT_DIR / "chaos.json"))
    return parser.parse_args(argv)


def sizes_from(args: argparse.Namespace) -> Sizes:
    if args.quick:
        return QUICK
    return Sizes(streams=args.streams, during=args.during, max_tokens=args.max_tokens,
                 prefix_words=args.prefix_words, outage_s=args.outage_s)


def private_redis():
    """A started private ``redis-server`` (the tests' ``PrivateRedis``, on a free port)."""
    import shutil

    sys.path.insert(0, str(common.REPO_ROOT / "tests"))  # tests/ is not a package
    from helpers import PrivateRedis

    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("chaos: no redis-server binary on PATH")
    server = PrivateRedis(binary)
    server.start()
    return server


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def table(rows: list[dict]) -> str:
    """A Markdown table of the case rows (as docs/operations.md shows them)."""
    head = ("| case | accepted before fault | completed | explicit errors | cut | hung | "
            "sent during (completed / errors) | leaked blocks | recovery (s) | "
            "hit rate before / after |\n|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for row in rows:
        b, d = row["before"], row["during"]
        rate = "/".join("-" if v is None else f"{v:.2f}"
                        for v in (row["hit_rate_before"], row["hit_rate_after"]))
        lines.append(f"| {row['case']} | {row['accepted_before_fault']} | {b['completed']} | "
                     f"{b['explicit_error']} | {b['cut']} | {b['hung'] + d['hung']} | "
                     f"{d['sent']} ({d['completed']} / {d['explicit_error'] + d['cut']}) | "
                     f"{row['leaked_blocks']} | {row['recovery_s']} | {rate} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    sizes = sizes_from(args)
    from ray import serve

    from cluster.runtime import init_ray, stop_cluster

    init_ray(log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    server = private_redis()
    rows = []
    try:
        common.log(f"deploying {APP} (2 workers, 1 draft replica, redis on {server.port})")
        target = deploy(server, port, args.dtype)
        for seed, name in enumerate(args.cases.split(",")):
            common.log(f"case {name}")
            row = asyncio.run(run_case(target, CASE_TABLE[name], sizes, seed)).figures
            common.log(f"case {name}: {row}")
            rows.append(row)
    finally:
        stop_cluster()
        server.kill()
    result = {"benchmark": "chaos", "machine": common.machine_info(args.dtype),
              "quick": args.quick, "sizes": vars(sizes), "cases": rows, "table": table(rows)}
    print(result["table"])
    common.write_json(result, args.out)
    return result


if __name__ == "__main__":
    main()
