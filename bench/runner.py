"""The load generator, and the Python API of ``nalar bench`` (:func:`run_benchmark`).

Sessions (see :mod:`bench.workloads.session`) start at Poisson arrival times (or all at once);
``max_concurrency`` bounds the requests in flight, the rest wait for a slot. A phase ends when
its request budget is spent or its duration has passed (no request starts after that; those in
flight finish). Warm-up requests run as a phase of their own before the measured one.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
from tqdm import tqdm

from bench.adapters import AdapterMix, with_adapters
from bench.arrival import poisson_gaps
from bench.client import OpenAIClient, first_model
from bench.records import RequestRecord
from bench.stats import summarize
from bench.workloads import Session, WorkloadConfig, sessions
from bench.workloads.json_schema import output_is_valid


@dataclass
class LoadConfig:
    """How requests arrive and when a run stops.

    Attributes:
        request_rate: sessions started per second (Poisson); ``inf`` starts them all at once.
            For single-request workloads this is the request rate.
        max_concurrency: the most requests in flight; None for no bound.
        num_requests: the most measured requests; None for no bound (then ``duration_s``
            must be given).
        duration_s: no measured request starts after this many seconds; None for no bound.
        warmup: requests run (and discarded) before the measured phase.
        seed: seeds the arrival times.
    """

    request_rate: float = math.inf
    max_concurrency: int | None = None
    num_requests: int | None = 100
    duration_s: float | None = None
    warmup: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_requests is None and self.duration_s is None:
            raise ValueError("give num_requests or duration_s (or both): the run needs a bound")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError("max_concurrency must be at least 1")
        if self.warmup < 0:
            raise ValueError(f"warmup must be at least 0 requests, not {self.warmup}")


@dataclass
class BenchConfig:
    """One ``nalar bench`` run.

    Attributes:
        base_url: the server's root or ``/v1`` URL.
        endpoint: ``chat`` or ``completions``.
        model: the model to ask for; None for the first ``GET /v1/models`` lists.
        workload: what to send.
        load: how to send it.
        temperature: sampling temperature.
        ignore_eos: send vLLM's ``ignore_eos`` (every request decodes ``max_tokens``).
        timeout_s: the most one request may take.
        goodput_slos_ms: SLOs for ``request_goodput`` (see :func:`bench.stats.parse_goodput`).
        progress: show a progress bar.
        lora_adapters: LoRA adapter names to spread sessions over (``bench.adapters``); empty
            for every request to ask for ``model``.
        lora_distribution: ``uniform`` or ``zipf``.
    """

    base_url: str = "http://127.0.0.1:8000"
    endpoint: str = "chat"
    model: str | None = None
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    load: LoadConfig = field(default_factory=LoadConfig)
    temperature: float = 0.0
    ignore_eos: bool = False
    timeout_s: float = 600.0
    goodput_slos_ms: dict[str, float] = field(default_factory=dict)
    progress: bool = True
    lora_adapters: list[str] = field(default_factory=list)
    lora_distribution: str = "uniform"


@dataclass
class BenchResult:
    """A finished run: the measured records (warm-up excluded), the measured phase's wall time
    and the summary (:func:`bench.stats.summarize`)."""

    config: BenchConfig
    model: str
    records: list[RequestRecord]
    duration_s: float
    summary: dict[str, Any]


def run_benchmark(config: BenchConfig) -> BenchResult:
    """Runs ``config`` to the end (blocking; starts its own event loop).

    Raises:
        httpx.HTTPError, LookupError: no model was given and ``GET /v1/models`` failed.
    """
    return asyncio.run(run_benchmark_async(config))


async def run_benchmark_async(config: BenchConfig) -> BenchResult:
    """:func:`run_benchmark` inside a running event loop."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(limits=limits, timeout=config.timeout_s) as http:
        model = config.model or await first_model(http, config.base_url,
                                                  config.workload.api_key)
        client = OpenAIClient(http, config.base_url, model, config.endpoint,
                              config.workload.api_key, config.temperature, config.ignore_eos,
                              config.timeout_s)
        stream = sessions(config.workload)
        if config.lora_adapters:
            mix = AdapterMix(config.lora_adapters, config.lora_distribution, config.load.seed)
            stream = with_adapters(stream, mix)
        load = config.load
        if load.warmup:
            await run_phase(client, stream, load, load.warmup, None,
                            "warm-up" if config.progress else None)
        records, duration_s = await run_phase(client, stream, load, load.num_requests,
                                              load.duration_s,
                                              "bench" if config.progress else None)
    return BenchResult(config, model, records, duration_s,
                       summarize(records, duration_s, config.goodput_slos_ms or None))


async def run_phase(client: OpenAIClient, stream: Iterator[Session], load: LoadConfig,
                    num_requests: int | None, duration_s: float | None,
                    progress: str | None) -> tuple[list[RequestRecord], float]:
    """Runs sessions from ``stream`` until ``num_requests`` requests have been assigned or
    ``duration_s`` has passed; returns the records (in completion order) and the wall time.

    Args:
        progress: the progress bar's label; None for no bar.
    """
    origin = time.perf_counter()
    deadline = origin + duration_s if duration_s is not None else math.inf
    remaining = num_requests if num_requests is not None else math.inf
    slots = (asyncio.Semaphore(load.max_concurrency) if load.max_concurrency
             else contextlib.nullcontext())
    records: list[RequestRecord] = []
    with tqdm(total=num_requests, desc=progress, disable=progress is None,
              unit="req") as bar:
        async def drive(session: Session, budget: int) -> None:
            previous = None
            for turn in range(budget):
                if turn and session.think_time_s:
                    await asyncio.sleep(session.think_time_s)
                request = session.next_request(previous)
                if request is None or time.perf_counter() >= deadline:
                    return
                async with slots:
                    previous = await client.send(request, origin)
                if request.response_format is not None and previous.ok:
                    previous.valid_output = output_is_valid(request.response_format,
                                                            previous.output_text)
                records.append(previous)
                bar.update()

        tasks = []
        for session, gap in zip(stream, poisson_gaps(load.request_rate, load.seed), strict=False):
            if remaining <= 0 or time.perf_counter() >= deadline:
                break
            # A session's turns are reserved up front so that conversations run to length
            # instead of the budget going to ever more first turns.
            budget = int(min(session.max_requests, remaining))
            remaining -= budget
            tasks.append(asyncio.create_task(drive(session, budget)))
            if remaining <= 0:
                break
            await asyncio.sleep(min(gap, max(0.0, deadline - time.perf_counter())))
        await asyncio.gather(*tasks)
    return records, time.perf_counter() - origin
