"""Request-level latency histograms of one engine, measured the way vLLM measures them.

The engine stamps each :class:`~workers.sequence.Sequence` as it moves through its life:
arrival at the engine, first scheduled, every step that commits tokens for it, finish.
:class:`RequestMetrics` turns those stamps into observations:

* TTFT: arrival -> the step that commits the first output token;
* ITL: between consecutive steps that commit tokens for the sequence, one observation per such
  step (a verification step that commits several tokens is one observation, as in vLLM);
* queue time: arrival -> first scheduled; prefill time: first scheduled -> first token;
  decode time: first token -> last token; E2E latency: arrival -> finish. Observed when a
  sequence finishes by ``stop`` or ``length`` (an aborted one never completed).

Buckets are kept as plain counts (:class:`Histogram`), so a worker ships them to the ingress's
Prometheus collector as a small dict (``NalarWorker.engine_stats()["histograms"]``). Bucket
bounds are vLLM's (``vllm/v1/metrics``), so dashboards built for vLLM read ours alike.
All times are seconds from :func:`time.monotonic` (the engine thread and the async front
stamp with the same clock).
"""

from __future__ import annotations

import bisect
import itertools
import threading
import time
from collections.abc import Callable, Iterable
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from workers.sequence import Sequence

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                           40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

TTFT = "time_to_first_token_seconds"
ITL = "inter_token_latency_seconds"
E2E = "e2e_request_latency_seconds"
QUEUE = "request_queue_time_seconds"
PREFILL = "request_prefill_time_seconds"
DECODE = "request_decode_time_seconds"

HISTOGRAM_BOUNDS: dict[str, tuple[float, ...]] = {
    TTFT: TTFT_BUCKETS, ITL: ITL_BUCKETS, E2E: REQUEST_LATENCY_BUCKETS,
    QUEUE: REQUEST_LATENCY_BUCKETS, PREFILL: REQUEST_LATENCY_BUCKETS,
    DECODE: REQUEST_LATENCY_BUCKETS,
}
"""Histogram name (without the ``nalar:`` prefix) -> upper bucket bounds, in seconds."""


class Histogram:
    """Counts of observations per bucket, thread-safe (the engine thread observes, the
    replica's event loop snapshots).

    Args:
        bounds: strictly increasing upper bounds; a value equal to a bound falls in that
            bucket (Prometheus' ``le``), a value above the last in the overflow bucket.

    Raises:
        ValueError: bounds empty or not strictly increasing.
    """

    def __init__(self, bounds: Seq[float]):
        if not bounds or any(high <= low for low, high in itertools.pairwise(bounds)):
            raise ValueError(f"bucket bounds must be strictly increasing, got {bounds!r}")
        self.bounds = tuple(float(b) for b in bounds)
        self._counts = [0] * (len(self.bounds) + 1)
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        """Count one observation of ``value``."""
        index = bisect.bisect_left(self.bounds, value)
        with self._lock:
            self._counts[index] += 1
            self._sum += value

    def snapshot(self) -> dict[str, Any]:
        """``{"bounds", "counts", "sum", "count"}``: ``counts[i]`` observations in bucket ``i``
        (not cumulative; one more entry than ``bounds``, the last being above every bound)."""
        with self._lock:
            counts = list(self._counts)
            total = self._sum
        return {"bounds": list(self.bounds), "counts": counts, "sum": total,
                "count": sum(counts)}


class RequestMetrics:
    """Stamps sequences and fills the request-latency histograms and token counters.

    Attributes:
        histograms: name (see :data:`HISTOGRAM_BOUNDS`) -> :class:`Histogram`.
        prompt_tokens: prompt tokens of requests whose first choice produced its first token
            (cached tokens included, once per request: as ``usage.prompt_tokens`` counts them).
        generation_tokens: output tokens committed (``usage.completion_tokens`` summed).

    Args:
        clock: seconds, monotonic; tests pass a fake one.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.histograms = {name: Histogram(bounds) for name, bounds in HISTOGRAM_BOUNDS.items()}
        self.prompt_tokens = 0
        self.generation_tokens = 0

    def arrived(self, seq: Sequence, at: float | None = None) -> None:
        """Stamp arrival (``at``: when the request reached the engine's front, else now)."""
        seq.arrived_at = self.clock() if at is None else at

    def scheduled(self, seqs: Iterable[Sequence]) -> None:
        """Stamp the first time each of ``seqs`` is in a scheduled batch."""
        now = self.clock()
        for seq in seqs:
            if seq.scheduled_at is None:
                seq.scheduled_at = now

    def committed(self, seq: Sequence, num_tokens: int) -> None:
        """A step committed ``num_tokens`` output tokens of ``seq``: TTFT or one ITL."""
        if num_tokens <= 0:
            return
        now = self.clock()
        if seq.first_token_at is None:
            seq.first_token_at = now
            self.histograms[TTFT].observe(now - seq.arrived_at)
            if seq.choice_index == 0:  # n choices share one prompt, counted once in usage
                self.prompt_tokens += seq.num_prompt_tokens
        else:
            self.histograms[ITL].observe(now - seq.last_token_at)
        seq.last_token_at = now
        self.generation_tokens += num_tokens

    def finished(self, seq: Sequence) -> None:
        """``seq`` ended by ``stop`` or ``length``: its E2E, queue, prefill and decode times
        (a sequence that never produced a token contributes E2E and queue time only)."""
        now = self.clock()
        seq.finished_at = now
        self.histograms[E2E].observe(now - seq.arrived_at)
        if seq.scheduled_at is not None:
            self.histograms[QUEUE].observe(seq.scheduled_at - seq.arrived_at)
        if seq.first_token_at is not None and seq.scheduled_at is not None:
            self.histograms[PREFILL].observe(seq.first_token_at - seq.scheduled_at)
            self.histograms[DECODE].observe(seq.last_token_at - seq.first_token_at)

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """Every histogram's :meth:`Histogram.snapshot`, by name."""
        return {name: histogram.snapshot() for name, histogram in self.histograms.items()}
