"""Prometheus metrics of the cluster, served by the ingress as ``GET /metrics``.

The ingress owns one :class:`~prometheus_client.CollectorRegistry` (:func:`build_registry`),
never the process-wide default one, so the text holds only Nalar's series. Its
:class:`EngineStatsCollector` works at scrape time: it asks every worker replica for
``NalarWorker.engine_stats()`` in one broadcast (:func:`fetch_worker_stats`), waits at most
:data:`SCRAPE_TIMEOUT_S`, and turns each answer into samples labelled ``worker`` (the replica
id the router and the ``x-nalar-worker`` header use) and ``model_name`` (the served model). A
worker that does not answer in time is left out of that scrape and counted in
``nalar:metrics_workers_skipped``; the scrape itself still succeeds.

Names mirror vLLM's v1 metrics with a ``nalar:`` prefix wherever vLLM has the same quantity
(``vllm:num_requests_running`` -> ``nalar:num_requests_running``, ``vllm:prefix_cache_hits``
-> ``nalar:prefix_cache_hits``, the ``spec_decode_*`` counters, the latency histograms with
vLLM's buckets), so dashboards and queries written for vLLM carry over; series vLLM lacks keep
a ``nalar:`` name of their own (``nalar:kv_blocks_*``, ``nalar:computed_*_tokens``).

Counters are the engines' own monotonic counts since each replica started (a replacement
replica starts again from zero under a new ``worker`` label, which Prometheus' ``rate()``
handles). Speculative counters count committed tokens only (case S6): a draft token past a
stop or the length cap is neither accepted nor rejected, exactly as the per-request
``usage.speculative`` extension counts it, so the two add up.

Extending: the router's telemetry and the dashboard add their own collectors to the same
registry (``registry.register(...)``); :data:`ENGINE_METRICS` lists the scalar engine series.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from workers.request_metrics import HISTOGRAM_BOUNDS

log = logging.getLogger(__name__)

SCRAPE_TIMEOUT_S = 1.0
"""Seconds a scrape waits for the workers' stats; later answers are left out of it."""

PREFIX = "nalar:"
WORKER_LABEL = "worker"
MODEL_LABEL = "model_name"
LABELS = [WORKER_LABEL, MODEL_LABEL]

STATS_METHOD = "engine_stats"
"""The worker method every scrape calls on each replica."""

Reader = Callable[[dict[str, Any]], Any]


def at(*path: str) -> Reader:
    """Reads the value under ``path`` in ``engine_stats()``'s dict (None when a key is missing:
    no sample for that worker, e.g. remote draft counters on a worker drafting in process)."""

    def read(stats: dict[str, Any]) -> Any:
        value: Any = stats
        for key in path:
            if not isinstance(value, dict) or key not in value:
                return None
            value = value[key]
        return value

    return read


def kv_cache_usage(stats: dict[str, Any]) -> float | None:
    """Fraction of KV blocks held by running sequences (vLLM's ``kv_cache_usage_perc``: cached
    blocks no sequence uses count as free, since they are reusable)."""
    total = stats.get("blocks_total")
    return stats.get("blocks_in_use", 0) / total if total else None


@dataclass(frozen=True)
class Series:
    """One scalar series read from a worker's stats.

    Attributes:
        name: the metric family name without the ``nalar:`` prefix (a counter's samples get
            ``_total`` appended).
        kind: ``counter`` or ``gauge``.
        read: the value in ``engine_stats()``'s dict, or None for no sample.
        doc: the HELP text.
    """

    name: str
    kind: str
    read: Reader
    doc: str


ENGINE_METRICS: tuple[Series, ...] = (
    # vLLM's names
    Series("num_requests_running", "gauge", at("running"), "Sequences being computed."),
    Series("num_requests_waiting", "gauge", at("waiting"), "Sequences waiting for admission."),
    Series("kv_cache_usage_perc", "gauge", kv_cache_usage,
           "KV-cache usage: fraction of blocks held by running sequences (1 = 100%)."),
    Series("prefix_cache_queries", "counter", at("prefix_query_tokens"),
           "Prefix cache queries, in prompt tokens looked up at admission."),
    Series("prefix_cache_hits", "counter", at("prefix_hit_tokens"),
           "Prefix cache hits, in prompt tokens whose KV the cache supplied."),
    Series("num_preemptions", "counter", at("preemptions"),
           "Sequences preempted for lack of KV blocks."),
    Series("prompt_tokens", "counter", at("prompt_tokens"),
           "Prompt tokens of requests that produced a first token (cached ones included, as "
           "usage.prompt_tokens counts them)."),
    Series("generation_tokens", "counter", at("generation_tokens"),
           "Output tokens committed (usage.completion_tokens summed)."),
    Series("spec_decode_num_drafts", "counter", at("spec", "verification_steps"),
           "Drafts verified: per-sequence verifications of at least one draft token."),
    Series("spec_decode_num_draft_tokens", "counter", at("spec", "proposed_tokens"),
           "Draft tokens sent to verification."),
    Series("spec_decode_num_accepted_tokens", "counter", at("spec", "accepted_tokens"),
           "Draft tokens verification accepted and committed."),
    # Nalar's own
    Series("engine_steps", "counter", at("steps"), "Engine steps (forward passes) run."),
    Series("engine_steps_on_borrowed_cores", "counter", at("borrowed_core_steps"),
           "Engine steps of many prompt tokens that also ran on the cores of the host's idle "
           "workers."),
    Series("computed_prefill_tokens", "counter", at("prefill_tokens"),
           "Tokens computed at prompt positions (prefix-cache hits excluded, recomputation "
           "after preemption included)."),
    Series("shared_prefix_waits", "counter", at("shared_prefix_waits"),
           "Steps in which a waiting request waited for a running prompt computing its next "
           "KV block, rather than computing it a second time (per request and step)."),
    Series("computed_decode_tokens", "counter", at("decode_tokens"),
           "Tokens computed at output positions (verified draft positions included)."),
    Series("kv_blocks_capacity", "gauge", at("blocks_total"), "KV blocks in the pool."),
    Series("kv_blocks_in_use", "gauge", at("blocks_in_use"),
           "KV blocks held by running sequences."),
    Series("kv_blocks_free", "gauge", at("blocks_free"),
           "KV blocks free and holding no cached prefix."),
    Series("kv_blocks_evictable", "gauge", at("blocks_evictable"),
           "KV blocks holding a cached prefix no sequence uses (reusable, evictable)."),
    Series("spec_decode_draft_seconds", "counter", at("spec", "draft_s"),
           "Seconds spent in the proposer's batched calls (remote: the round trip)."),
    Series("spec_decode_verify_seconds", "counter", at("spec", "verify_s"),
           "Step seconds of verification steps, once per verified sequence."),
    Series("spec_decode_draft_calls", "counter", at("spec", "draft_calls"),
           "Batched proposer calls made by the engine."),
    Series("spec_decode_remote_calls", "counter", at("draft_calls"),
           "Calls the worker made to the draft replicas (remote proposer only)."),
    Series("spec_decode_draft_timeouts", "counter", at("draft_timeouts"),
           "Remote draft calls that missed their deadline (no drafts that step)."),
    Series("spec_decode_draft_failures", "counter", at("draft_failures"),
           "Remote draft calls that failed (no drafts that step)."),
    Series("spec_decode_draft_skipped", "counter", at("draft_skipped"),
           "Draft batches given no drafts without a call while backing off from the replicas."),
    Series("lora_adapter_loads", "counter", at("lora", "loads"),
           "LoRA adapters read (start, run-time loads, and reads again after an eviction)."),
    Series("lora_adapter_load_seconds", "counter", at("lora", "load_seconds"),
           "Seconds spent reading LoRA adapters."),
    Series("lora_adapter_swaps", "counter", at("lora", "swaps"),
           "LoRA adapters moved back from the host tier to a resident slot."),
    Series("lora_adapter_swap_seconds", "counter", at("lora", "swap_seconds"),
           "Seconds spent moving LoRA adapters back from the host tier."),
    Series("lora_requests", "counter", at("lora", "requests"),
           "Requests for a LoRA adapter (counted as the worker makes their adapter resident)."),
    Series("lora_slot_wait_seconds", "counter", at("lora", "slot_wait_seconds"),
           "Seconds LoRA requests waited for a free resident slot, in all."),
    Series("lora_adapter_evictions", "counter", at("lora", "evictions"),
           "LoRA adapters evicted from a full set of resident slots (least recently used, "
           "idle): to the host tier, or dropped without one."),
    Series("lora_adapter_host_evictions", "counter", at("lora", "host_evictions"),
           "LoRA adapters dropped from a full host tier (read from disk when next needed)."),
    Series("kv_tier_blocks", "gauge", at("kv_tier", "blocks"),
           "KV blocks held by the second tier (absent without one)."),
    Series("kv_tier_blocks_capacity", "gauge", at("kv_tier", "capacity"),
           "KV blocks the second tier can hold."),
    Series("kv_tier_saved_blocks", "counter", at("kv_tier", "saved_blocks"),
           "KV blocks written to the second tier on eviction from the KV cache."),
    Series("kv_tier_loaded_blocks", "counter", at("kv_tier", "loaded_blocks"),
           "KV blocks loaded back from the second tier for a hit."),
    Series("kv_tier_dropped_blocks", "counter", at("kv_tier", "dropped_blocks"),
           "KV blocks dropped from a full second tier (least recently used)."),
    Series("kv_tier_corrupt_blocks", "counter", at("kv_tier", "corrupt_blocks"),
           "Second-tier loads refused for a checksum mismatch (the tokens were recomputed)."),
    Series("kv_tier_io_errors", "counter", at("kv_tier", "io_errors"),
           "Second-tier reads and writes the disk failed (the block was not stored, or was "
           "recomputed)."),
    Series("kv_tier_saved_bytes", "counter", at("kv_tier", "bytes_saved"),
           "Bytes written to the second KV tier."),
    Series("kv_tier_loaded_bytes", "counter", at("kv_tier", "bytes_loaded"),
           "Bytes read back from the second KV tier."),
    Series("kv_tier_save_seconds", "counter", at("kv_tier", "save_seconds"),
           "Seconds spent writing blocks to the second KV tier."),
    Series("kv_tier_load_seconds", "counter", at("kv_tier", "load_seconds"),
           "Seconds spent loading blocks from the second KV tier, checksums included."),
    Series("kv_transfer_exported_blocks", "counter", at("kv_transfer", "exported_blocks"),
           "KV blocks sent to other workers."),
    Series("kv_transfer_exported_bytes", "counter", at("kv_transfer", "exported_bytes"),
           "Bytes of KV sent to other workers."),
    Series("kv_transfer_export_seconds", "counter", at("kv_transfer", "export_seconds"),
           "Seconds spent copying KV for other workers, between steps."),
    Series("kv_transfer_imported_blocks", "counter", at("kv_transfer", "imported_blocks"),
           "KV blocks fetched from other workers and accepted."),
    Series("kv_transfer_imported_bytes", "counter", at("kv_transfer", "imported_bytes"),
           "Bytes of KV fetched from other workers and accepted."),
    Series("kv_transfer_import_seconds", "counter", at("kv_transfer", "import_seconds"),
           "Seconds from asking another worker for KV to storing it, in all."),
    Series("kv_transfer_already_held_blocks", "counter",
           at("kv_transfer", "already_held_blocks"),
           "Fetched KV blocks not stored: computed here, or fetched, while the fetch ran."),
    Series("kv_transfer_rejected_blocks", "counter", at("kv_transfer", "rejected_blocks"),
           "Fetched KV blocks refused by a check (digest, tokens, prefix, checksum, size)."),
    Series("kv_transfer_failed_fetches", "counter", at("kv_transfer", "failed_fetches"),
           "Fetches from another worker that failed or ran out of time (computed instead)."),
)

HISTOGRAM_DOCS = {
    "time_to_first_token_seconds": "Time to first token: arrival at the engine to the step "
                                   "that commits the first output token.",
    "inter_token_latency_seconds": "Inter-token latency: between steps that commit tokens "
                                   "for a request (one observation per such step).",
    "e2e_request_latency_seconds": "End-to-end request latency in the engine: arrival to "
                                   "finish (stop or length).",
    "request_queue_time_seconds": "Time in the WAITING phase: arrival to first scheduled.",
    "request_prefill_time_seconds": "Time in the PREFILL phase: first scheduled to first "
                                    "token.",
    "request_decode_time_seconds": "Time in the DECODE phase: first to last token.",
}


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


def _family(name: str, kind: str, doc: str, labels: list[str]) -> Metric:
    if kind == "counter":
        return CounterMetricFamily(PREFIX + name, doc, labels=labels)
    return GaugeMetricFamily(PREFIX + name, doc, labels=labels)


def _labels(stats: dict[str, Any]) -> list[str]:
    return [str(stats.get("worker_id", "")), str(stats.get("model_name", ""))]


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def engine_families(workers: Iterable[dict[str, Any]]) -> Iterator[Metric]:
    """The metric families of the workers' stats (families without samples when there are
    none, which is what :meth:`EngineStatsCollector.describe` lists)."""
    workers = list(workers)
    for series in ENGINE_METRICS:
        family = _family(series.name, series.kind, series.doc, LABELS)
        for stats in workers:
            value = series.read(stats)
            if _is_number(value):
                family.add_metric(_labels(stats), value)
        yield family
    yield from spec_families(workers)
    yield from source_families(workers)
    yield from lora_families(workers)
    yield from histogram_families(workers)


def source_families(workers: list[dict[str, Any]]) -> Iterator[Metric]:
    """vLLM's ``prompt_tokens_by_source``: prompt tokens of admitted requests by where their
    KV came from; the second tier is a source of its own."""
    family = _family("prompt_tokens_by_source", "counter",
                     "Prompt tokens by where their KV came from: local_compute (computed), "
                     "local_cache_hit (the KV cache), second_tier (the worker's second tier), "
                     "external_kv_transfer (fetched from another worker).", LABELS + ["source"])
    for stats in workers:
        if not _is_number(stats.get("prefix_query_tokens")):
            continue
        hits = stats["prefix_hit_tokens"]
        tier, transfer = stats.get("tier_hit_tokens", 0), stats.get("transfer_hit_tokens", 0)
        labels = _labels(stats)
        for source, value in (("local_compute", stats["prefix_query_tokens"] - hits),
                              ("local_cache_hit", hits - tier - transfer),
                              ("second_tier", tier), ("external_kv_transfer", transfer)):
            family.add_metric(labels + [source], value)
    yield family


def lora_families(workers: list[dict[str, Any]]) -> Iterator[Metric]:
    """vLLM's ``lora_requests_info`` (its labels: the adapters of running and waiting
    requests, comma-separated, and the most held; the value is the scrape's Unix time), the
    adapters each worker holds per tier, and where its adapter requests found their adapter."""
    info = _family("lora_requests_info", "gauge",
                   "LoRA adapters of running and waiting requests (value: Unix time).",
                   LABELS + ["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
    loaded = _family("lora_adapters_loaded", "gauge",
                     "LoRA adapters held by the worker, per tier: resident (batched in its "
                     "steps) or host (in host memory, moved back when a request needs it).",
                     LABELS + ["tier"])
    found = _family("lora_requests_by_adapter_source", "counter",
                    "LoRA requests by where their adapter was: resident, host (moved back from "
                    "the host tier), read (waited for a read from disk), slot (waited for a "
                    "free resident slot).", LABELS + ["source"])
    now = time.time()
    for stats in workers:
        lora = stats.get("lora")
        if not isinstance(lora, dict):
            continue
        labels = _labels(stats)
        info.add_metric(labels + [str(lora["max_loras"]), ",".join(lora["running"]),
                                  ",".join(lora["waiting"])], now)
        loaded.add_metric(labels + ["resident"], lora["loaded"])
        loaded.add_metric(labels + ["host"], len(lora.get("hosted", ())))
        for source, count in lora.get("waits", {}).items():
            found.add_metric(labels + [source], count)
    yield from (info, loaded, found)


def spec_families(workers: list[dict[str, Any]]) -> Iterator[Metric]:
    """Speculative decoding per draft position and per chosen draft length."""
    mean = _family("spec_decode_mean_accepted_length", "gauge",
                   "Accepted draft tokens per verified draft, since start.", LABELS)
    accepted = _family("spec_decode_num_accepted_tokens_per_pos", "counter",
                       "Draft tokens accepted at each draft position (0: first).",
                       LABELS + ["position"])
    proposed = _family("spec_decode_num_draft_tokens_per_pos", "counter",
                       "Draft tokens verified at each draft position (0: first).",
                       LABELS + ["position"])
    decisions = _family("spec_decode_k_decisions", "counter",
                        "Draft lengths chosen, per sequence and step "
                        "(k=0: the sequence did not speculate that step).", LABELS + ["k"])
    for stats in workers:
        spec = stats.get("spec")
        if not isinstance(spec, dict):
            continue
        labels = _labels(stats)
        drafts = spec.get("verification_steps", 0)
        mean.add_metric(labels, spec.get("accepted_tokens", 0) / drafts if drafts else 0.0)
        for position, count in enumerate(spec.get("accepted_by_position", ())):
            accepted.add_metric(labels + [str(position)], count)
        for position, count in enumerate(spec.get("proposed_by_position", ())):
            proposed.add_metric(labels + [str(position)], count)
        for k, count in sorted(spec.get("k_decisions", {}).items()):
            decisions.add_metric(labels + [str(k)], count)
    yield from (mean, accepted, proposed, decisions)


def histogram_families(workers: list[dict[str, Any]]) -> Iterator[Metric]:
    """The request-latency histograms: cumulative ``le`` buckets ending in ``+Inf``, ``_sum``
    and ``_count``, from each worker's per-bucket counts."""
    for name in HISTOGRAM_BOUNDS:
        family = HistogramMetricFamily(PREFIX + name, HISTOGRAM_DOCS[name], labels=LABELS)
        for stats in workers:
            snapshot = stats.get("histograms", {}).get(name)
            if snapshot:
                family.add_metric(_labels(stats), cumulative_buckets(snapshot),
                                  snapshot["sum"])
        yield family


def cumulative_buckets(snapshot: dict[str, Any]) -> list[tuple[str, float]]:
    """``[(le, observations <= le), ..., ("+Inf", all observations)]`` of a
    :meth:`~workers.request_metrics.Histogram.snapshot`."""
    buckets, running = [], 0
    for bound, count in zip(snapshot["bounds"], snapshot["counts"], strict=False):
        running += count
        buckets.append((floatToGoString(bound), running))
    buckets.append(("+Inf", sum(snapshot["counts"])))
    return buckets


def scrape_families(scrape: WorkerScrape) -> Iterator[Metric]:
    """How the scrape itself went: workers answered and skipped, seconds spent asking."""
    yield GaugeMetricFamily(PREFIX + "metrics_workers_answered",
                            "Worker replicas whose stats are in this scrape.",
                            value=len(scrape.workers))
    yield GaugeMetricFamily(PREFIX + "metrics_workers_skipped",
                            "Worker replicas that did not answer this scrape in time.",
                            value=scrape.skipped)
    yield GaugeMetricFamily(PREFIX + "metrics_scrape_seconds",
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
