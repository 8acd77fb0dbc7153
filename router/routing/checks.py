"""Value checks shared by the parsers of what replicas and requests report."""

from __future__ import annotations

import math
from typing import Any


def is_count(value: Any) -> bool:
    """True for a finite non-negative int or float (``bool`` excluded)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return math.isfinite(value) and value >= 0
