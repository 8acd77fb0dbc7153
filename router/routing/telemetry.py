"""What the router decided and how the digest index answered, for ``/metrics`` and the dashboard.

The router runs inside the ingress replica's process (a ``DeploymentHandle``'s router), so one
process-wide :data:`TELEMETRY` serves both: the router records into it from its event loop, the
metrics endpoint and the dashboard read it from theirs, hence the lock.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

LOOKUP_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
"""Upper bounds (seconds) of the ``nalar:index_lookup_seconds`` buckets; ``+Inf`` is implied."""


@dataclass(frozen=True)
class RoutingDecision:
    """One request placed on a worker.

    Attributes:
        at: when, ``time.time()`` in seconds.
        worker_id: the worker the request was sent to.
        policy: the routing policy: ``"prefix"``, ``"round-robin"`` or ``"power-of-two"``.
        prompt_tokens: the request's prompt length in tokens (0 when unreadable).
        cached_blocks: leading prompt blocks the index credited to that worker (0 if unknown).
        cached_tokens: ``cached_blocks * block_size``.
        fallback: ``None``, or why routing went without the index's answer: ``"index_error"``,
            ``"index_timeout"``, ``"index_down"`` (waiting to retry after a failed lookup),
            ``"no_index"``, ``"no_model_key"``, ``"no_prompt"`` (the request was unreadable).
        record_blocks: on a fallback, leading prompt blocks the router's own record of the
            prefixes it sent credited to that worker (0: routed on load alone there).
    """

    at: float
    worker_id: str
    policy: str
    prompt_tokens: int
    cached_blocks: int
    cached_tokens: int
    fallback: str | None
    record_blocks: int = 0


class RoutingTelemetry:
    """Routing decisions and index lookups, counted; also a prometheus-client collector.

    Register it with ``registry.register(telemetry)``; :meth:`collect` yields
    ``nalar:router_decisions_total{worker,policy}``, ``nalar:router_cached_blocks_total{worker}``,
    ``nalar:router_fallbacks_total{reason}``, ``nalar:router_record_hits_total{reason}`` (the
    fallbacks whose worker the router's own record credited with part of the prompt),
    ``nalar:index_up`` and the histogram
    ``nalar:index_lookup_seconds``. Thread-safe.

    Args:
        capacity: how many recent decisions :meth:`recent` keeps (positive).
        clock: wall clock in seconds (tests pass a fake).
    """

    def __init__(self, capacity: int = 500, clock: Callable[[], float] = time.time):
        self._lock = threading.Lock()
        self._clock = clock
        self._recent: deque[RoutingDecision] = deque(maxlen=capacity)
        self._decisions: Counter[tuple[str, str]] = Counter()
        self._cached_blocks: Counter[str] = Counter()
        self._fallbacks: Counter[str] = Counter()
        self._record_hits: Counter[str] = Counter()
        self._lookups = 0
        self._lookup_buckets = [0] * (len(LOOKUP_BUCKETS_S) + 1)  # the last is +Inf
        self._lookup_sum_s = 0.0
        self._healthy = True
        self._last_error: str | None = None
        self._last_ok_at: float | None = None

    def record(self, decision: RoutingDecision) -> None:
        """Counts one routing decision."""
        with self._lock:
            self._recent.append(decision)
            self._decisions[(decision.worker_id, decision.policy)] += 1
            self._cached_blocks[decision.worker_id] += decision.cached_blocks
            if decision.fallback is not None:
                self._fallbacks[decision.fallback] += 1
                if decision.record_blocks > 0:
                    self._record_hits[decision.fallback] += 1

    def record_lookup(self, seconds: float, ok: bool, error: str | None = None) -> None:
        """Counts one index lookup that took ``seconds``; ``error`` says why one failed."""
        with self._lock:
            self._lookups += 1
            self._lookup_buckets[bisect.bisect_left(LOOKUP_BUCKETS_S, seconds)] += 1
            self._lookup_sum_s += seconds
            self._healthy = ok
            if ok:
                self._last_ok_at = self._clock()
            else:
                self._last_error = error or "lookup failed"

    def recent(self, limit: int = 50) -> list[RoutingDecision]:
        """Up to ``limit`` most recent decisions, newest first."""
        with self._lock:
            newest_first = list(reversed(self._recent))
        return newest_first[:max(0, limit)]

    def share(self) -> dict[str, int]:
        """Decisions per worker id, since start."""
        with self._lock:
            per_worker: Counter[str] = Counter()
            for (worker_id, _), count in self._decisions.items():
                per_worker[worker_id] += count
        return dict(per_worker)

    def index_health(self) -> dict:
        """``{"healthy", "last_error", "last_ok_age_s", "lookups", "fallbacks"}``.

        ``healthy`` is whether the latest lookup succeeded (``True`` before any);
        ``last_error`` the latest failure's description, ``last_ok_age_s`` seconds since the
        latest success (``None`` before any), ``fallbacks`` decisions routed without the
        index's answer, per reason.
        """
        with self._lock:
            age = None if self._last_ok_at is None else self._clock() - self._last_ok_at
            return {
                "healthy": self._healthy,
                "last_error": self._last_error,
                "last_ok_age_s": age,
                "lookups": self._lookups,
                "fallbacks": dict(self._fallbacks),
            }

    def collect(self) -> Iterator[Metric]:
        """The prometheus-client collector interface: one consistent snapshot per scrape."""
        with self._lock:
            decisions = dict(self._decisions)
            cached_blocks = dict(self._cached_blocks)
            fallbacks = dict(self._fallbacks)
            record_hits = dict(self._record_hits)
            buckets = list(self._lookup_buckets)
            lookup_sum = self._lookup_sum_s
            healthy = self._healthy
        yield _counter("nalar:router_decisions", "Requests routed, by chosen worker and policy.",
                       ["worker", "policy"], decisions)
        yield _counter("nalar:router_cached_blocks",
                       "Prompt blocks the index credited to the chosen worker.", ["worker"],
                       {(worker,): n for worker, n in cached_blocks.items()})
        yield _counter("nalar:router_fallbacks",
                       "Requests routed without the index's answer, by reason.",
                       ["reason"], {(reason,): n for reason, n in fallbacks.items()})
        yield _counter("nalar:router_record_hits",
                       "Requests routed without the index's answer to a worker the router's own "
                       "record of sent prefixes credited with part of the prompt, by reason.",
                       ["reason"], {(reason,): n for reason, n in record_hits.items()})
        yield GaugeMetricFamily("nalar:index_up",
                                "1 when the latest digest index lookup succeeded, else 0.",
                                value=1 if healthy else 0)
        yield _histogram("nalar:index_lookup_seconds", "Digest index lookup latency.",
                         buckets, lookup_sum)


def _counter(name: str, documentation: str, labels: list[str],
             values: dict[tuple[str, ...], float]) -> CounterMetricFamily:
    family = CounterMetricFamily(name, documentation, labels=labels)
    for label_values, value in sorted(values.items()):
        family.add_metric(list(label_values), value)
    return family


def _histogram(name: str, documentation: str, bucket_counts: list[int],
               total: float) -> HistogramMetricFamily:
    bounds = [*(str(bound) for bound in LOOKUP_BUCKETS_S), "+Inf"]
    cumulative, running = [], 0
    for bound, count in zip(bounds, bucket_counts, strict=True):
        running += count
        cumulative.append((bound, running))
    return HistogramMetricFamily(name, documentation, buckets=cumulative, sum_value=total)


TELEMETRY = RoutingTelemetry()
"""This process's routing telemetry (the router records, ``/metrics`` and the dashboard read)."""
