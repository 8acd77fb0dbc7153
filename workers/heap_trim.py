"""Hands the C heap's free pages back to the OS now and then, so a worker's RSS is its live
memory and not the high-water mark of its largest steps.

Why: glibc's malloc keeps freed memory inside its arenas. A prefill chunk's activations are a
few MiB per tensor, under glibc's dynamic mmap threshold once that has risen (it follows the
largest freed mmapped block, up to 32 MiB), so they come from an arena, and the arena's pages
stay resident after the step frees them when live blocks sit above them. A 30-minute soak saw
one worker's RSS step up 127 MiB and stay there
(``benchmarks/results/epyc-avx512bf16/soak_2bed34c.json``).
``malloc_trim(0)`` releases every arena's free pages (madvise), wherever they lie. The call
walks the heap, so it runs at most once per interval, between steps.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from workers.libc import libc

log = logging.getLogger(__name__)

TRIM_INTERVAL_S = 10.0
"""Seconds between two trims: long enough that a trim's cost is under 0.1% of the engine's
time (1 to 7 ms measured in an engine process serving SmolLM2-135M at batch 16; the first
trim, after the prompts' prefill, took RSS from 1,617 to 1,457 MiB, later ones about 14 MiB),
short enough that RSS follows live memory within a couple of soak samples."""


def _glibc_malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None where the C library has none (musl, macOS)."""
    return getattr(libc(), "malloc_trim", None)


class HeapTrimmer:
    """Calls ``malloc_trim(0)`` at most once per ``interval_s`` seconds.

    Args:
        interval_s: the shortest time between two trims, seconds.
        clock: a monotonic clock in seconds (tests pass their own).
    """

    def __init__(self, interval_s: float = TRIM_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic):
        self._trim = _glibc_malloc_trim()
        if self._trim is None:
            log.info("no glibc malloc_trim here: the heap is not trimmed")
        self._interval_s = interval_s
        self._clock = clock
        self._last = clock()
        self.trims = 0

    def maybe_trim(self) -> bool:
        """Trim if ``interval_s`` has passed since the last trim; True when it trimmed."""
        now = self._clock()
        if self._trim is None or now - self._last < self._interval_s:
            return False
        self._trim(0)
        self._last = now
        self.trims += 1
        return True
