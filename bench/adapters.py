"""Spreading a workload's sessions over LoRA adapters (``nalar bench --lora-adapters``).

Each session (all turns of a conversation) is sent under one adapter's name in ``model``,
drawn from a seeded generator: ``uniform``, or ``zipf`` (adapter ``i`` of the list with weight
``1 / (i + 1)``, the long tail of many-adapter traces as S-LoRA and Punica evaluate).
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterator

from bench.records import BenchRequest, RequestRecord
from bench.workloads.session import Session

DISTRIBUTIONS = ("uniform", "zipf")


class AdapterMix:
    """Draws an adapter name per session.

    Args:
        names: the adapters, most popular first for ``zipf``.
        distribution: ``uniform`` or ``zipf``.
        seed: seeds the draws, so two runs send the same adapters in the same order.

    Raises:
        ValueError: no names, or an unknown distribution.
    """

    def __init__(self, names: list[str], distribution: str = "uniform", seed: int = 0):
        if not names:
            raise ValueError("--lora-adapters needs at least one name")
        if distribution not in DISTRIBUTIONS:
            raise ValueError(f"unknown --lora-distribution {distribution!r}; choose from "
                             f"{', '.join(DISTRIBUTIONS)}")
        self.names = list(names)
        self.weights = ([1.0] * len(names) if distribution == "uniform"
                        else [1.0 / (rank + 1) for rank in range(len(names))])
        self._random = random.Random(seed)

    def draw(self) -> str:
        """The next session's adapter."""
        return self._random.choices(self.names, self.weights)[0]


class _AdapterSession:
    """A session whose every request names one adapter."""

    def __init__(self, session: Session, model: str):
        self._session = session
        self._model = model
        self.max_requests = session.max_requests
        self.think_time_s = session.think_time_s

    def next_request(self, previous: RequestRecord | None) -> BenchRequest | None:
        request = self._session.next_request(previous)
        if request is None:
            return None
        return dataclasses.replace(request, model=self._model, label=request.label or self._model)


def with_adapters(stream: Iterator[Session], mix: AdapterMix) -> Iterator[Session]:
    """``stream`` with each session sent under an adapter drawn from ``mix``."""
    for session in stream:
        yield _AdapterSession(session, mix.draw())
