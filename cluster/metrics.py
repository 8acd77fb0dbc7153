"""Prometheus metrics of the cluster, served by the ingress as ``GET /metrics``.

The ingress owns one :class:`~prometheus_client.CollectorRegistry` (:func:`build_registry`),
never the process-wide default one, so the text holds only Nalar's series. Its
:class:`EngineStatsCollector` works at scrape time: it asks every worker replica for
``NalarWorker.engine_stats()`` in one broadcast (:func:`fetch_worker_stats`), waits at most
:data:`SCRAPE_TIMEOUT_S`, and turns each answer into samples labelled ``worker`` (the replica
id the router and the ``x-nalar-worker`` header use). A worker that does not answer in time is
left out of that scrape and counted in ``nalar_metrics_workers_skipped``; the scrape itself
still succeeds.

Counters are the engines' own monotonic counts since each replica started (a replacement
replica starts again from zero under a new ``worker`` label, which Prometheus' ``rate()``
handles). Speculative counters count committed tokens only (case S6): a draft token past a
stop or the length cap is neither accepted nor rejected, exactly as the per-request
``usage.speculative`` extension counts it, so the two add up.

Extending: the dashboard adds its own collectors to the same registry
(``registry.register(...)``); :data:`ENGINE_METRICS` lists the scalar engine series.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

SCRAPE_TIMEOUT_S = 1.0
"""Seconds a scrape waits for the workers' stats; later answers are left out of it."""

WORKER_LABEL = "worker"

STATS_METHOD = "engine_stats"
"""The worker method every scrape calls on each replica."""


@dataclass(frozen=True)
class Series:
    """One scalar series read from a worker's stats.

    Attributes:
        name: the metric family name (a counter's samples get ``_total`` appended).
        kind: ``counter`` or ``gauge``.
        path: keys leading to the value in ``engine_stats()``'s dict (a missing key: no
            sample for that worker, e.g. remote draft counters on a worker drafting in process).
        doc: the HELP text.
    """

    name: str
    kind: str
    path: tuple[str, ...]
    doc: str


ENGINE_METRICS: tuple[Series, ...] = (
    Series("nalar_engine_steps", "counter", ("steps",), "Engine steps (forward passes) run."),
    Series("nalar_prefill_tokens", "counter", ("prefill_tokens",),
           "Tokens computed at prompt positions (prefix-cache hits excluded)."),
    Series("nalar_decode_tokens", "counter", ("decode_tokens",),
           "Tokens computed at output positions (verified draft positions included)."),
    Series("nalar_prefix_query_tokens", "counter", ("prefix_query_tokens",),
           "Prompt tokens looked up in the prefix cache at admission."),
    Series("nalar_prefix_hit_tokens", "counter", ("prefix_hit_tokens",),
           "Prompt tokens whose KV the prefix cache supplied."),
    Series("nalar_preemptions", "counter", ("preemptions",),
           "Sequences preempted for lack of KV blocks."),
    Series("nalar_kv_blocks_capacity", "gauge", ("blocks_total",), "KV blocks in the pool."),
    Series("nalar_kv_blocks_in_use", "gauge", ("blocks_in_use",),
           "KV blocks held by running sequences."),
    Series("nalar_kv_blocks_free", "gauge", ("blocks_free",),
           "KV blocks free and holding no cached prefix."),
    Series("nalar_kv_blocks_evictable", "gauge", ("blocks_evictable",),
           "KV blocks holding a cached prefix no sequence uses (reusable, evictable)."),
    Series("nalar_requests_running", "gauge", ("running",), "Sequences being computed."),
    Series("nalar_requests_waiting", "gauge", ("waiting",), "Sequences waiting for admission."),
    Series("nalar_spec_proposed_tokens", "counter", ("spec", "proposed_tokens"),
           "Draft tokens sent to verification."),
    Series("nalar_spec_accepted_tokens", "counter", ("spec", "accepted_tokens"),
           "Draft tokens verification accepted and committed."),
    Series("nalar_spec_rejected_tokens", "counter", ("spec", "rejected_tokens"),
           "Draft tokens verified and not committed (proposed minus accepted)."),
    Series("nalar_spec_verification_steps", "counter", ("spec", "verification_steps"),
           "Per-sequence verifications of at least one draft token."),
    Series("nalar_spec_draft_seconds", "counter", ("spec", "draft_s"),
           "Seconds spent in the proposer's batched calls (remote: the round trip)."),
    Series("nalar_spec_verify_seconds", "counter", ("spec", "verify_s"),
           "Step seconds of verification steps, once per verified sequence."),
    Series("nalar_spec_draft_calls", "counter", ("spec", "draft_calls"),
           "Batched proposer calls made by the engine."),
    Series("nalar_spec_remote_calls", "counter", ("draft_calls",),
           "Calls the worker made to the draft replicas (remote proposer only)."),
    Series("nalar_spec_draft_timeouts", "counter", ("draft_timeouts",),
           "Remote draft calls that missed their deadline (no drafts that step)."),
    Series("nalar_spec_draft_failures", "counter", ("draft_failures",),
           "Remote draft calls that failed (no drafts that step)."),
    Series("nalar_spec_draft_skipped", "counter", ("draft_skipped",),
           "Draft batches given no drafts without a call while backing off from the replicas."),
)


@dataclass
class WorkerScrape:
    """What one scrape got from the worker replicas.

    Attributes:
        workers: ``engine_stats()`` of each replica that answered in time.
        skipped: replicas asked that did not answer in time or failed.
        seconds: how long asking took.
    """

    workers: list[dict[str, Any]] = field(default_factory=list)
    skipped: int = 0
    seconds: float = 0.0


def fetch_worker_stats(handle: Any, timeout_s: float = SCRAPE_TIMEOUT_S) -> WorkerScrape:
    """Asks every replica behind ``handle`` for its stats, in parallel, within ``timeout_s``.

    Blocking: call it from a plain thread, not an event loop's (the ingress renders metrics
    in a worker thread). Uses ``DeploymentHandle.broadcast``, which reaches every running
    replica without the request router; each replica's answer is awaited on its own, so one
    slow or dead replica costs only its own samples. Never raises.

    Args:
        handle: a ``DeploymentHandle`` to the worker deployment (or anything with the same
            ``broadcast(method).results(timeout_s=..., return_exceptions=True)``).
        timeout_s: the most seconds to wait in all.
    """
    started = time.perf_counter()
    try:
        answers = handle.broadcast(STATS_METHOD).results(timeout_s=timeout_s,
                                                         return_exceptions=True)
    except Exception as exc:  # noqa: BLE001 - no workers reachable: an empty scrape
        log.warning("metrics: no worker stats this scrape (%r)", exc)
        return WorkerScrape([], 0, time.perf_counter() - started)
    workers = [answer for answer in answers if isinstance(answer, dict)]
    skipped = len(answers) - len(workers)
    if skipped:
        log.info("metrics: %d worker(s) did not answer within %.1f s", skipped, timeout_s)
    return WorkerScrape(workers, skipped, time.perf_counter() - started)


def _lookup(stats: dict[str, Any], path: tuple[str, ...]) -> Any:
    value: Any = stats
    for key in path:
        if not isinstance(value, dict) or key not in value:
            return None
        value = value[key]
    return value


def _family(name: str, kind: str, doc: str, labels: list[str]) -> Metric:
    if kind == "counter":
        return CounterMetricFamily(name, doc, labels=labels)
    return GaugeMetricFamily(name, doc, labels=labels)


def engine_families(workers: Iterable[dict[str, Any]]) -> Iterator[Metric]:
    """The metric families of the workers' stats (families without samples when there are
    none, which is what :meth:`EngineStatsCollector.describe` lists)."""
    workers = list(workers)
    for series in ENGINE_METRICS:
        family = _family(series.name, series.kind, series.doc, [WORKER_LABEL])
        for stats in workers:
            value = _lookup(stats, series.path)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                family.add_metric([str(stats.get("worker_id", ""))], value)
        yield family

    mean = GaugeMetricFamily("nalar_spec_mean_accepted_length",
                             "Accepted draft tokens per verification step, since start.",
                             labels=[WORKER_LABEL])
    accepted = CounterMetricFamily("nalar_spec_accepted_by_position",
                                   "Draft tokens accepted at each draft position (0: first).",
                                   labels=[WORKER_LABEL, "position"])
    proposed = CounterMetricFamily("nalar_spec_proposed_by_position",
                                   "Draft tokens verified at each draft position (0: first).",
                                   labels=[WORKER_LABEL, "position"])
    decisions = CounterMetricFamily("nalar_spec_k_decisions",
                                    "Draft lengths chosen, per sequence and step "
                                    "(k=0: the sequence did not speculate that step).",
                                    labels=[WORKER_LABEL, "k"])
    for stats in workers:
        spec = stats.get("spec")
        if not isinstance(spec, dict):
            continue
        worker = str(stats.get("worker_id", ""))
        steps = spec.get("verification_steps", 0)
        mean.add_metric([worker], spec.get("accepted_tokens", 0) / steps if steps else 0.0)
        for position, count in enumerate(spec.get("accepted_by_position", ())):
            accepted.add_metric([worker, str(position)], count)
        for position, count in enumerate(spec.get("proposed_by_position", ())):
            proposed.add_metric([worker, str(position)], count)
        for k, count in sorted(spec.get("k_decisions", {}).items()):
            decisions.add_metric([worker, str(k)], count)
    yield from (mean, accepted, proposed, decisions)


def scrape_families(scrape: WorkerScrape) -> Iterator[Metric]:
    """How the scrape itself went: workers answered and skipped, seconds spent asking."""
    yield GaugeMetricFamily("nalar_metrics_workers_answered",
                            "Worker replicas whose stats are in this scrape.",
                            value=len(scrape.workers))
    yield GaugeMetricFamily("nalar_metrics_workers_skipped",
                            "Worker replicas that did not answer this scrape in time.",
                            value=scrape.skipped)
    yield GaugeMetricFamily("nalar_metrics_scrape_seconds",
                            "Seconds this scrape spent asking the workers.",
                            value=scrape.seconds)


class EngineStatsCollector(Collector):
    """A Prometheus collector that fetches every worker's stats when scraped.

    Args:
        fetch: returns the workers' stats (blocking; e.g. :func:`fetch_worker_stats` bound to
            the worker deployment's handle). Called once per scrape, from the scraping thread.
    """

    def __init__(self, fetch: Callable[[], WorkerScrape]):
        self._fetch = fetch

    def collect(self) -> Iterator[Metric]:
        """Every family, with one sample set per worker that answered."""
        scrape = self._fetch()
        yield from engine_families(scrape.workers)
        yield from scrape_families(scrape)

    def describe(self) -> Iterator[Metric]:
        """The families without samples: registering never calls the workers."""
        yield from engine_families([])
        yield from scrape_families(WorkerScrape())


def build_registry(fetch: Callable[[], WorkerScrape]) -> CollectorRegistry:
    """A registry of Nalar's own series (no process or platform collectors) with one
    :class:`EngineStatsCollector` reading the workers through ``fetch``."""
    registry = CollectorRegistry(auto_describe=True)
    registry.register(EngineStatsCollector(fetch))
    return registry
