"""Workloads: endless, seeded streams of sessions (see :mod:`bench.workloads.session`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from bench.workloads.config import WorkloadConfig
from bench.workloads.copy_tasks import copy_sessions
from bench.workloads.json_schema import json_sessions
from bench.workloads.multi_turn import multi_turn_sessions
from bench.workloads.random_lengths import random_sessions
from bench.workloads.session import Session
from bench.workloads.shared_prefix import shared_prefix_sessions

WORKLOADS: dict[str, Callable[[WorkloadConfig], Iterator[Session]]] = {
    "shared-prefix": shared_prefix_sessions,
    "multi-turn": multi_turn_sessions,
    "copy": copy_sessions,
    "random": random_sessions,
    "json": json_sessions,
}
"""``--workload`` names and their session generators."""


def sessions(config: WorkloadConfig) -> Iterator[Session]:
    """The endless session stream of ``config.name``.

    Raises:
        ValueError: an unknown workload name.
    """
    try:
        return WORKLOADS[config.name](config)
    except KeyError:
        raise ValueError(f"unknown workload {config.name!r}; choose from "
                         f"{', '.join(WORKLOADS)}") from None


__all__ = ["WORKLOADS", "Session", "WorkloadConfig", "sessions"]
