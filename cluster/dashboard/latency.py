"""Cluster-wide TTFT and ITL as clients see them, for the dashboard's percentiles over time.

Measured in the ingress as chunks stream through ``NalarIngress.generate`` (one
:class:`StreamTimer` per request), rather than derived from the workers' histograms: the ingress
sees every request of the cluster in one place, from the moment it dispatches to the moment a
token leaves, so the figures include routing and the hop from the worker; and raw samples give
exact percentiles, where histogram deltas only interpolate within vLLM's coarse buckets (TTFT
jumps from 0.25 s to 0.5 s to 0.75 s) and need two scrapes per point. Memory stays bounded:
each ring keeps only the latest :data:`RING_CAPACITY` samples.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable

RING_CAPACITY = 20_000
"""Samples kept per ring (at 100 tokens/s across the cluster: over three minutes of ITL)."""

QUANTILES = (0.5, 0.9, 0.99)


def percentile(ordered: list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending, non-empty list (``q`` in (0, 1])."""
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def summary(values: list[float]) -> dict[str, float]:
    """``{"n", "p50", "p90", "p99"}`` of ``values`` in seconds (only ``n`` when empty)."""
    if not values:
        return {"n": 0}
    ordered = sorted(values)
    return {"n": len(ordered),
            **{f"p{round(q * 100)}": percentile(ordered, q) for q in QUANTILES}}


class LatencyRing:
    """The latest samples of one latency, with the wall-clock second each was taken.

    Thread-safe: the ingress's event loop adds, the dashboard's data route reads.

    Args:
        capacity: samples kept; older ones drop off.
        clock: wall-clock seconds (``time.time``); tests pass a fake one.
    """

    def __init__(self, capacity: int = RING_CAPACITY, clock: Callable[[], float] = time.time):
        self.clock = clock
        self._samples: deque[tuple[float, float]] = deque(maxlen=capacity)
        self._lock = threading.Lock()

    def add(self, seconds: float) -> None:
        """Record one sample taken now."""
        with self._lock:
            self._samples.append((self.clock(), seconds))

    def series(self, window_s: float, span_s: float) -> list[dict[str, float]]:
        """Percentiles per window of ``window_s`` seconds over the last ``span_s`` seconds,
        oldest first; windows without samples are left out. Each point is
        ``{"t": window start (wall clock), "n", "p50", "p90", "p99"}``."""
        now = self.clock()
        first = math.floor((now - span_s) / window_s)
        windows: dict[int, list[float]] = {}
        with self._lock:
            samples = list(self._samples)
        for at, value in samples:
            index = math.floor(at / window_s)
            if index >= first:
                windows.setdefault(index, []).append(value)
        return [{"t": index * window_s, **summary(values)}
                for index, values in sorted(windows.items())]

    def recent(self, span_s: float) -> dict[str, float]:
        """:func:`summary` of the samples of the last ``span_s`` seconds."""
        since = self.clock() - span_s
        with self._lock:
            values = [value for at, value in self._samples if at >= since]
        return summary(values)


class StreamTimer:
    """Times one request's stream: its TTFT, then an ITL per later chunk with tokens.

    A chunk may carry several tokens (a verification step's, or tokens the worker coalesced
    while the stream lagged): its gap is spread evenly over them, one sample per chunk.

    Args:
        ttft: ring for the time to the first chunk with tokens.
        itl: ring for the per-token gaps after it.
        clock: monotonic seconds.
    """

    def __init__(self, ttft: LatencyRing, itl: LatencyRing,
                 clock: Callable[[], float] = time.monotonic):
        self._ttft, self._itl, self._clock = ttft, itl, clock
        self._started = clock()
        self._last: float | None = None

    def chunk(self, num_tokens: int) -> None:
        """A chunk of ``num_tokens`` tokens arrived now (chunks without tokens are ignored)."""
        if num_tokens <= 0:
            return
        now = self._clock()
        if self._last is None:
            self._ttft.add(now - self._started)
        else:
            self._itl.add((now - self._last) / num_tokens)
        self._last = now
