"""What ``GET /dashboard/data`` answers: the cluster's state in one JSON document.

:class:`Dashboard` gathers, per poll, every worker's ``engine_stats()`` (the same broadcast
``/metrics`` makes), the router's telemetry (routing share, recent decisions, index health),
the digest index's contents, and the ingress's own TTFT and ITL rings.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from cluster.dashboard.latency import LatencyRing, StreamTimer
from cluster.dashboard.rates import CounterRates
from cluster.metrics import WorkerScrape, kv_cache_usage

log = logging.getLogger(__name__)

LATENCY_WINDOW_S = 5.0
"""Width of one point of the percentile charts, in seconds."""
LATENCY_SPAN_S = 300.0
"""How far back the percentile charts reach, in seconds."""
RECENT_DECISIONS = 12


class RoutingTelemetry(Protocol):
    """The router's telemetry as the dashboard reads it (``router.routing.telemetry``)."""

    def share(self) -> dict[str, int]: ...

    def recent(self, limit: int) -> list[Any]: ...

    def index_health(self) -> dict[str, Any]: ...


class Dashboard:
    """Sources of the dashboard and their assembly into one document.

    Args:
        fetch: every worker's stats (blocking; e.g. :func:`cluster.metrics.fetch_worker_stats`
            bound to the worker deployment); run in a thread per poll.
        model_name: the served model name shown in the title.
        telemetry: the router's telemetry, or None when the router keeps none.
        index_stats: coroutine function giving the index's ``IndexStats`` for the served
            model, or None; a failure shows as an index error, never a failed poll.
        clock: wall-clock seconds.
    """

    def __init__(self, fetch: Callable[[], WorkerScrape], model_name: str,
                 telemetry: RoutingTelemetry | None = None,
                 index_stats: Callable[[], Awaitable[Any]] | None = None,
                 clock: Callable[[], float] = time.time):
        self.fetch = fetch
        self.model_name = model_name
        self.telemetry = telemetry
        self.index_stats = index_stats
        self.clock = clock
        self.ttft = LatencyRing(clock=clock)
        self.itl = LatencyRing(clock=clock)
        self.rates = CounterRates()

    def timer(self) -> StreamTimer:
        """A timer for one request's stream, feeding this dashboard's TTFT and ITL rings."""
        return StreamTimer(self.ttft, self.itl)

    async def data(self) -> dict[str, Any]:
        """The whole document (docs/operations.md, "Metrics and dashboard", lists its fields)."""
        scrape, index = await asyncio.gather(asyncio.to_thread(self.fetch), self._index())
        now = self.clock()
        workers = [self._worker_row(stats, now) for stats in scrape.workers]
        self.rates.keep_only({row["worker"] for row in workers})
        return {
            "time": now,
            "model": self.model_name,
            "workers": sorted(workers, key=lambda row: row["worker"]),
            "scrape": {"answered": len(scrape.workers), "skipped": scrape.skipped},
            "latency": self._latency(),
            "routing": self._routing(),
            "index": index,
        }

    def _worker_row(self, stats: dict[str, Any], now: float) -> dict[str, Any]:
        worker = str(stats.get("worker_id", ""))
        queries = stats.get("prefix_query_tokens", 0)
        spec = stats.get("spec") or {}
        proposed = spec.get("proposed_tokens", 0)
        finished = stats.get("histograms", {}).get("e2e_request_latency_seconds", {})
        return {
            "worker": worker,
            "running": stats.get("running", 0),
            "waiting": stats.get("waiting", 0),
            "kv_usage": kv_cache_usage(stats),
            "hit_ratio": stats.get("prefix_hit_tokens", 0) / queries if queries else None,
            "hits_by_source": hits_by_source(stats),
            "tokens_per_s": self.rates.update(worker, stats.get("generation_tokens", 0), now),
            "acceptance": spec.get("accepted_tokens", 0) / proposed if proposed else None,
            "requests": finished.get("count", 0),
            "prompt_tokens": stats.get("prompt_tokens", 0),
            "generation_tokens": stats.get("generation_tokens", 0),
            "adapters": list((stats.get("lora") or {}).get("held", [])),
            "hosted_adapters": list((stats.get("lora") or {}).get("hosted", [])),
        }

    def _latency(self) -> dict[str, Any]:
        return {
            "window_s": LATENCY_WINDOW_S,
            "ttft": self.ttft.series(LATENCY_WINDOW_S, LATENCY_SPAN_S),
            "itl": self.itl.series(LATENCY_WINDOW_S, LATENCY_SPAN_S),
            "ttft_last_minute": self.ttft.recent(60.0),
            "itl_last_minute": self.itl.recent(60.0),
        }

    def _routing(self) -> dict[str, Any]:
        if self.telemetry is None:
            return {"share": {}, "recent": [], "health": None}
        return {
            "share": dict(self.telemetry.share()),
            "recent": [dataclasses.asdict(decision)
                       for decision in self.telemetry.recent(RECENT_DECISIONS)],
            "health": self.telemetry.index_health(),
        }

    async def _index(self) -> dict[str, Any] | None:
        if self.index_stats is None:
            return None
        try:
            return {**dataclasses.asdict(await self.index_stats()), "error": None}
        except Exception as exc:  # noqa: BLE001 - an unreachable index is what to show
            log.info("dashboard: index stats unavailable (%r)", exc)
            return {"error": f"{type(exc).__name__}: {exc}"}


def hits_by_source(stats: dict[str, Any]) -> dict[str, int]:
    """A worker's prefix hits in prompt tokens, by where the KV came from: its KV cache, its
    second tier, or another worker."""
    tier, transfer = stats.get("tier_hit_tokens", 0), stats.get("transfer_hit_tokens", 0)
    return {"local_cache_hit": stats.get("prefix_hit_tokens", 0) - tier - transfer,
            "second_tier": tier, "external_kv_transfer": transfer}
