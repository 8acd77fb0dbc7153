"""Per-second rates of monotonic counters, from the values seen at successive polls."""

from __future__ import annotations

from collections import deque


class CounterRates:
    """Rate of each named counter over roughly the last ``window_s`` seconds.

    Each poll records ``(time, value)``; the rate is measured back to the oldest sample still
    in the window, so viewers polling at any pace (or several at once) see a steady figure.
    A counter that went down (its replica restarted under the same name) starts over.

    Args:
        window_s: how far back a rate looks, in seconds.
    """

    def __init__(self, window_s: float = 10.0):
        self.window_s = window_s
        self._history: dict[str, deque[tuple[float, float]]] = {}

    def update(self, key: str, value: float, now: float) -> float | None:
        """Record ``value`` of counter ``key`` at ``now`` (seconds); returns its rate per second
        since the oldest sample in the window, or None until there are two samples."""
        history = self._history.setdefault(key, deque())
        if history and value < history[-1][1]:
            history.clear()
        history.append((now, value))
        while len(history) > 2 and now - history[1][0] >= self.window_s:
            history.popleft()
        then, before = history[0]
        return (value - before) / (now - then) if now > then else None

    def keep_only(self, keys: set[str]) -> None:
        """Forget counters not in ``keys`` (replicas gone)."""
        for key in set(self._history) - keys:
            del self._history[key]
