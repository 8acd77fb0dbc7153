"""When sessions start: a Poisson process at a rate, or all at once."""

from __future__ import annotations

import math
import random
from collections.abc import Iterator


def poisson_gaps(rate: float, seed: int) -> Iterator[float]:
    """Endless gaps between arrivals, seconds: exponential with mean ``1 / rate`` (a Poisson
    process of ``rate`` arrivals per second); all zero when ``rate`` is infinite.

    Raises:
        ValueError: ``rate`` is not positive.
    """
    if not rate > 0:
        raise ValueError(f"request rate must be positive, got {rate}")
    rng = random.Random(seed)
    while True:
        yield 0.0 if math.isinf(rate) else rng.expovariate(rate)
