"""Soak: a bounded mixed workload at twice the measured capacity.

Starts its own cluster (``--workers`` workers, Redis at ``--redis-url`` under a fresh key
prefix, ``--max-model-len`` tokens of context) and drives it through the ``nalar bench``
client with a mixed workload: random sampling settings (temperature, top_p, top_k, seed, n,
stop strings), short prompts and prompts near ``max_model_len``, and clients that disconnect
mid-stream (``--cancel-fraction``).

1. Capacity: saturation throughput, the requests completed per second by
   ``--capacity-concurrency`` closed-loop clients (the mix without cancellations) over
   ``--capacity-s`` seconds, the first ``--capacity-warmup-s`` not counted.
2. Soak: Poisson arrivals at ``--load-factor`` (2) x capacity for ``--duration`` seconds
   (default 1,800), at most ``--max-in-flight`` requests at once; the RSS of every worker and
   ingress replica process is sampled every ``--sample-period`` seconds.
3. Checks once the load has drained: no KV block in use and every pool's free + evictable +
   in-use blocks add up to its total; the RSS slope over the second half of the run is at most
   ``--rss-slope-bound`` MiB per minute for every process; every answer is 200, 503 or 429
   (overload), never a timeout, a 5xx other than 503, a cut stream or an SSE error event.

    .venv/bin/python benchmarks/soak.py [--duration 1800] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np
import psutil

from bench.arrival import poisson_gaps
from bench.client import OpenAIClient, first_model
from bench.records import BenchRequest, RequestRecord
from bench.stats import summarize
from bench.text import random_words
from benchmarks import chaos, common

OVERLOAD_STATUSES = {429, 503}
OVERLOAD_BACKOFF_S = 1.0
"""How long a closed-loop client waits after an overload answer: the server's ``Retry-After``."""
PROMPT_MARGIN_TOKENS = 48
"""Room left below ``max_model_len`` by the longest prompts: the completion template's own
tokens and the one-token-per-word estimate's error."""


# --- the workload -----------------------------------------------------------------------------

@dataclass
class SoakRequest:
    """One request of the mix: what to send, the sampling fields added to its body, and when
    its client hangs up (seconds after sending; None: it reads to the end)."""

    request: BenchRequest
    sampling: dict[str, Any]
    cancel_after_s: float | None


class MixedWorkload:
    """An endless, seeded stream of :class:`SoakRequest` s.

    Args:
        max_model_len: the served context length, tokens.
        long_fraction: share of prompts near ``max_model_len``.
        cancel_fraction: share of clients that disconnect mid-stream.
        seed: seeds every choice.
    """

    STOPS = (None, ["."], ["\n\n", " the "])
    MAX_TOKENS = (16, 96)

    def __init__(self, max_model_len: int, long_fraction: float, cancel_fraction: float,
                 seed: int):
        self.max_model_len = max_model_len
        self.long_fraction = long_fraction
        self.cancel_fraction = cancel_fraction
        self.rng = random.Random(seed)
        self.count = 0

    def sampling(self, max_tokens: int) -> dict[str, Any]:
        rng = self.rng
        fields: dict[str, Any] = {"temperature": rng.choice([0.0, 0.7, 1.0]),
                                  "top_p": rng.choice([1.0, 0.9, 0.5]),
                                  "n": rng.choice([1, 1, 1, 2]), "max_tokens": max_tokens}
        if rng.random() < 0.5:
            fields["top_k"] = rng.choice([1, 20, 50])
        if rng.random() < 0.5:
            fields["seed"] = rng.randrange(2**31)
        stop = rng.choice(self.STOPS)
        if stop:
            fields["stop"] = stop
        return fields

    def next(self) -> SoakRequest:
        """The next request of the mix."""
        rng = self.rng
        self.count += 1
        max_tokens = rng.randint(*self.MAX_TOKENS)
        if rng.random() < self.long_fraction:
            words = self.max_model_len - self.MAX_TOKENS[1] - PROMPT_MARGIN_TOKENS
        else:
            words = rng.randint(32, 256)
        request = BenchRequest([{"role": "user", "content": random_words(rng, words)}],
                               max_tokens, words, label=f"soak-{self.count}")
        cancel = rng.uniform(0.2, 3.0) if rng.random() < self.cancel_fraction else None
        return SoakRequest(request, self.sampling(max_tokens), cancel)


class SamplingClient(OpenAIClient):
    """The bench client with each request's own sampling fields in its body."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.sampling: dict[str, dict[str, Any]] = {}

    def body(self, request: BenchRequest) -> dict[str, Any]:
        return super().body(request) | self.sampling.get(request.label, {})


# --- driving it -------------------------------------------------------------------------------

@dataclass
class Phase:
    """What one phase sent: the finished requests' records, how many clients hung up on
    purpose, its wall time until the last request ended and its arrival window (s)."""

    records: list[RequestRecord]
    cancelled: int
    duration_s: float
    window_s: float


async def one(client: SamplingClient, item: SoakRequest, origin: float,
              slots: asyncio.Semaphore) -> RequestRecord | None:
    """Sends ``item``; None when its client hung up before the end (on purpose)."""
    async with slots:
        client.sampling[item.request.label] = item.sampling
        task = asyncio.create_task(client.send(item.request, origin))
        try:
            done, _ = await asyncio.wait([task], timeout=item.cancel_after_s)
            if done:
                return task.result()
            task.cancel()  # closes the connection mid-stream: the server must free the request
            return None
        finally:
            client.sampling.pop(item.request.label, None)


async def drive(client: SamplingClient, workload: MixedWorkload, rate: float,
                duration_s: float, max_in_flight: int, seed: int) -> Phase:
    """Poisson arrivals at ``rate`` per second for ``duration_s``; waits for the last one."""
    origin = time.perf_counter()
    slots = asyncio.Semaphore(max_in_flight)
    tasks = []
    for gap in poisson_gaps(rate, seed):
        await asyncio.sleep(gap)
        if time.perf_counter() - origin >= duration_s:
            break
        tasks.append(asyncio.create_task(one(client, workload.next(), origin, slots)))
    results = await asyncio.gather(*tasks)
    records = [r for r in results if r is not None]
    return Phase(records, len(results) - len(records), time.perf_counter() - origin,
                 duration_s)


async def closed_loop(client: SamplingClient, workload: MixedWorkload, concurrency: int,
                      duration_s: float) -> list[RequestRecord]:
    """``concurrency`` clients that each send their next request as soon as the last one ends,
    for ``duration_s``; a client refused for overload waits :data:`OVERLOAD_BACKOFF_S` first,
    as ``Retry-After`` asks. Returns every request's record, refusals included."""
    origin = time.perf_counter()
    records: list[RequestRecord] = []

    async def user() -> None:
        while time.perf_counter() - origin < duration_s:
            item = workload.next()
            client.sampling[item.request.label] = item.sampling
            try:
                record = await client.send(item.request, origin)
            finally:
                client.sampling.pop(item.request.label, None)
            records.append(record)
            if record.http_status in OVERLOAD_STATUSES:
                await asyncio.sleep(OVERLOAD_BACKOFF_S)

    await asyncio.gather(*(user() for _ in range(concurrency)))
    return records


def completions_per_second(records: list[RequestRecord], warmup_s: float,
                           end_s: float) -> float:
    """Successful requests that ended in ``[warmup_s, end_s]`` (seconds since the phase
    began), per second of that window: the saturation throughput, once the warm-up has
    filled the batches and before the closed loop stops sending."""
    ended = [r for r in records if r.ok and warmup_s <= r.start_s + r.e2e_s <= end_s]
    return len(ended) / (end_s - warmup_s)


async def measure_capacity(client: SamplingClient, args: argparse.Namespace) -> tuple[float, dict]:
    """Capacity as saturation throughput (``vllm bench serve`` at an infinite request rate
    measures the same): requests completed per second with ``--capacity-concurrency``
    requests always in flight, the soak's mix without cancellations. A rising-rate ramp
    judged by TTFT growth was tried first and stopped at 0.4-0.6 req/s, by the noise of a
    few dozen mixed-length requests, where the cluster completes about 1.7 req/s once
    overloaded: its "twice capacity" did not overload."""
    workload = MixedWorkload(args.max_model_len, args.long_fraction, 0.0, args.seed)
    records = await closed_loop(client, workload, args.capacity_concurrency, args.capacity_s)
    capacity = completions_per_second(records, args.capacity_warmup_s, args.capacity_s)
    statuses = Counter(r.http_status for r in records)
    figures = {"concurrency": args.capacity_concurrency, "window_s":
               [args.capacity_warmup_s, args.capacity_s], "requests": len(records),
               "completed": sum(r.ok for r in records), "statuses": dict(statuses),
               "completions_per_s": capacity}
    common.log(f"saturation: {figures}")
    if capacity <= 0:
        raise RuntimeError(f"no request completed inside the capacity window: {figures}")
    return capacity, figures


# --- memory -----------------------------------------------------------------------------------

def replica_processes(app: str) -> dict[int, str]:
    """pid → role (deployment name) of the worker and ingress replica processes of the Ray
    instance this process started (its descendants: other local Ray instances may serve an
    application of the same name), found by the title Ray gives a replica process
    (``ray::ServeReplica:<app>:<deployment>``)."""
    from cluster.app import INGRESS_DEPLOYMENT, WORKER_DEPLOYMENT

    found = {}
    for process in psutil.Process().children(recursive=True):
        try:
            title = " ".join(process.cmdline())
        except psutil.Error:
            continue  # exited meanwhile
        for role in (WORKER_DEPLOYMENT, INGRESS_DEPLOYMENT):
            if f"ServeReplica:{app}:{role}" in title:
                found[process.pid] = role
    return found


async def sample_rss(app: str, period_s: float, samples: list[dict], stop: asyncio.Event,
                     origin: float) -> None:
    """Appends {t_s, pid, role, rss_mib} of every replica process every ``period_s``."""
    while not stop.is_set():
        for pid, role in replica_processes(app).items():
            try:
                rss = psutil.Process(pid).memory_info().rss / 2**20
            except psutil.Error:
                continue  # it exited between the listing and the read
            samples.append({"t_s": round(time.perf_counter() - origin, 2), "pid": pid,
                            "role": role, "rss_mib": round(rss, 2)})
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), period_s)


def rss_slopes(samples: list[dict], duration_s: float) -> dict[str, dict[str, Any]]:
    """Per process: RSS at the start and end, and the least-squares slope of RSS over the
    second half of the run, MiB per minute (None with fewer than 3 samples there)."""
    by_pid: dict[int, list[dict]] = {}
    for sample in samples:
        by_pid.setdefault(sample["pid"], []).append(sample)
    slopes = {}
    for pid, series in by_pid.items():
        late = [s for s in series if s["t_s"] >= duration_s / 2]
        slope = None
        if len(late) >= 3:
            slope = float(np.polyfit([s["t_s"] / 60 for s in late],
                                     [s["rss_mib"] for s in late], 1)[0])
        slopes[str(pid)] = {"role": series[0]["role"], "rss_first_mib": series[0]["rss_mib"],
                            "rss_last_mib": series[-1]["rss_mib"],
                            "slope_second_half_mib_per_min": slope}
    return slopes


# --- verdict ----------------------------------------------------------------------------------

def answers(phase: Phase) -> dict[str, Any]:
    """How the soak's requests ended: HTTP statuses, failure kinds, and the answers that break
    the rule (anything but 200 or an overload status, a timeout, a cut stream, an SSE error)."""
    statuses = Counter(str(r.http_status) for r in phase.records)
    failures = Counter(r.failure for r in phase.records if not r.ok)
    overload = sum(1 for r in phase.records if r.http_status in OVERLOAD_STATUSES)
    bad = [r for r in phase.records
           if not r.ok and r.http_status not in OVERLOAD_STATUSES]
    return {"sent": len(phase.records) + phase.cancelled, "cancelled": phase.cancelled,
            "finished": len(phase.records), "completed": sum(r.ok for r in phase.records),
            "overload_answers": overload, "statuses": dict(statuses),
            "failures": dict(failures), "rule_breaking": len(bad),
            "rule_breaking_errors": sorted({f"{r.failure}: {r.error}" for r in bad})[:10],
            # When they were sent (s into the soak): a cluster slowed by something else on the
            # machine shows as a cluster of them.
            "rule_breaking_start_s": sorted(round(r.start_s, 1) for r in bad)[:50]}


def checks(pools: dict, slopes: dict, outcome: dict, bound: float) -> list[dict]:
    """The soak's pass/fail checks (``common.goal`` rows)."""
    worst = max((s["slope_second_half_mib_per_min"] or 0.0 for s in slopes.values()),
                default=None)
    return [common.goal("KV blocks in use after the drain", pools["leaked_blocks"], 0,
                        at_least=False),
            common.goal("pools whose counts do not add up", 0 if pools["pool_counts_ok"] else 1,
                        0, at_least=False),
            common.goal("worst RSS slope, second half (MiB/min)", worst, bound, at_least=False),
            common.goal("answers other than 200/429/503 (timeouts, 5xx, cut, SSE errors)",
                        outcome["rule_breaking"], 0, at_least=False)]


# --- the script -------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=1800.0, help="soak length, s")
    parser.add_argument("--load-factor", type=float, default=2.0, help="x measured capacity")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--kv-cache-mib", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--long-fraction", type=float, default=0.15,
                        help="share of prompts near max_model_len")
    parser.add_argument("--cancel-fraction", type=float, default=0.15,
                        help="share of clients that disconnect mid-stream")
    parser.add_argument("--capacity-concurrency", type=int, default=32,
                        help="requests kept in flight while capacity is measured")
    parser.add_argument("--capacity-s", type=float, default=240.0,
                        help="length of the capacity measurement, s")
    parser.add_argument("--capacity-warmup-s", type=float, default=60.0,
                        help="its first seconds, not counted")
    parser.add_argument("--max-queue-delay", type=float, default=60.0,
                        help="the server's --max-queue-delay, s: overload is refused past it "
                             "(well under --request-timeout, so it is an answer, not a timeout)")
    parser.add_argument("--max-in-flight", type=int, default=512)
    parser.add_argument("--request-timeout", type=float, default=300.0,
                        help="a request not finished by then is a timeout, s")
    parser.add_argument("--sample-period", type=float, default=5.0, help="RSS sampling, s")
    parser.add_argument("--rss-slope-bound", type=float, default=2.0,
                        help="the most RSS growth allowed over the second half, MiB/min")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true",
                        help="a short capacity measurement (20 s, 5 s of warm-up, 4 in "
                             "flight); --duration still applies")
    parser.add_argument("--out", default=str(common.OUT_DIR / "soak.json"))
    args = parser.parse_args(argv)
    if args.quick:
        args.capacity_s, args.capacity_warmup_s, args.capacity_concurrency = 20.0, 5.0, 4
    return args


def cluster_config(args: argparse.Namespace, key_prefix: str, port: int):
    from cluster.config import ClusterConfig

    return ClusterConfig(num_workers=args.workers, dtype=args.dtype, redis_url=args.redis_url,
                         key_prefix=key_prefix, port=port, kv_cache_mib=args.kv_cache_mib,
                         max_model_len=args.max_model_len,
                         max_queue_delay_s=args.max_queue_delay)


async def soak(args: argparse.Namespace, base_url: str, workers: Any) -> dict[str, Any]:
    """Capacity, soak, drain and check (steps 1-3 of the module docstring)."""
    from cluster.app import APP_NAME

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(limits=limits, timeout=args.request_timeout) as http:
        model = await first_model(http, base_url, None)
        client = SamplingClient(http, base_url, model, "completions",
                                timeout_s=args.request_timeout)
        capacity, saturation = await measure_capacity(client, args)
        rate = args.load_factor * capacity
        common.log(f"capacity {capacity:.2f} req/s; soaking at {rate:.2f} req/s for "
                   f"{args.duration:.0f} s")
        samples: list[dict] = []
        stop = asyncio.Event()
        origin = time.perf_counter()
        sampler = asyncio.create_task(sample_rss(APP_NAME, args.sample_period, samples, stop,
                                                 origin))
        workload = MixedWorkload(args.max_model_len, args.long_fraction, args.cancel_fraction,
                                 args.seed + 100)
        phase = await drive(client, workload, rate, args.duration, args.max_in_flight,
                            args.seed + 100)
        pools = await chaos.drained_pools(workers, 60.0)
        stop.set()
        await sampler
    outcome = answers(phase)
    slopes = rss_slopes(samples, phase.duration_s)
    done = [r for r in phase.records if r.ok]
    return {"capacity_req_s": capacity, "saturation": saturation, "soak_rate_req_s": rate,
            "soak_wall_s": phase.duration_s, "answers": outcome,
            "latency": summarize(done, phase.duration_s) if done else None,
            "pools": pools, "rss": slopes, "rss_samples": samples,
            "checks": checks(pools, slopes, outcome, args.rss_slope_bound)}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    from ray import serve

    from cluster.app import APP_NAME, WORKER_DEPLOYMENT
    from cluster.runtime import start_cluster, stop_cluster
    from router.index.redis_index import delete_key_prefix

    key_prefix = f"nalar-soak-{uuid.uuid4().hex[:8]}"
    config = cluster_config(args, key_prefix, chaos.free_port())
    common.log(f"starting {args.workers} workers on port {config.port}")
    start_cluster(config)
    try:
        result = asyncio.run(soak(args, f"http://127.0.0.1:{config.port}",
                                  serve.get_deployment_handle(WORKER_DEPLOYMENT, APP_NAME)))
    finally:
        stop_cluster()
        delete_key_prefix(args.redis_url, key_prefix)
    result = {"benchmark": "soak", "machine": common.machine_info(args.dtype),
              "settings": {k: v for k, v in vars(args).items() if k != "out"}, **result}
    common.log_goals(result["checks"])
    common.write_json(result, args.out)
    return result


if __name__ == "__main__":
    main()
