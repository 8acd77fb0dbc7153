"""The load unit every part counts work in, and the load report a worker sends the router.

Work is counted in tokens: the tokens a request still has to compute before it produces output
(its prompt, less what a worker already holds) plus every output token it may still produce
(``max_tokens`` for each of its ``n`` choices). The ingress bounds admitted work in this unit
(``router.api.admission``), the router weighs replicas by it (``router.routing``), and each
worker reports it (:class:`RoutingStats`, from ``workers.engine.LLMEngine.load_by_request``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


def work_tokens(uncomputed_tokens: int, output_tokens_left: int, choices: int = 1) -> int:
    """Tokens of work: ``uncomputed_tokens`` still to compute before output, plus
    ``output_tokens_left`` possible output tokens for each of ``choices`` choices (at least 1:
    ``n`` missing or 0 reads as one choice)."""
    return uncomputed_tokens + output_tokens_left * max(1, choices)


def is_count(value: Any) -> bool:
    """True for a finite non-negative int or float (``bool`` excluded)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return math.isfinite(value) and value >= 0


@dataclass(frozen=True)
class RoutingStats:
    """A worker's load report: what Ray Serve's ``record_routing_stats()`` returns, every
    ``routing_stats_period_s``, as the dict :meth:`to_wire` makes (Serve's type for it).

    Attributes:
        queued_tokens: tokens of work waiting or running on the worker (:func:`work_tokens`).
        requests: request id → its tokens of work, for every request waiting or running, so the
            router can discount requests it has since seen finish; None when not reported.
        running: sequences running.
        waiting: sequences waiting to be scheduled.
        time: the worker's ``time.time()`` when it took the report, in seconds, so the router
            can drop its own count of requests this report already includes; None when unknown.
        model_key: ``CacheIdentity.model_key`` (hex) the worker publishes its digests under.
        worker_id: the replica's id.
        adapters: content digests of the LoRA adapters resident there (None: not reported).
        host_adapters: content digests of those in its host tier.
        adapter_read_tokens: what reading an adapter it does not hold costs there, in tokens
            of work: its measured mean read time times its measured tokens per second.
        adapter_swap_tokens: the same for moving one back from its host tier.
        adapter_slots: its resident adapter slots (``--max-loras``; 0: not reported).
        adapter_slots_busy: those holding an adapter some request is using.
        adapter_slot_wait_tokens: what waiting for a free slot costs there once none is free,
            in tokens of work: the larger of its estimate (``LLMEngine.adapter_slots_busy``)
            and its measured mean wait times its measured tokens per second.
        kv_fetch_tokens_per_block: what fetching one KV block from another worker costs
            there, in tokens of work (at least 1): its measured seconds per fetched block
            times its measured tokens per second; None when it cannot fetch (no second tier)
            or has not measured it yet.
        kv_tier_load_tokens_per_block: what loading one KV block from its own second tier
            costs there, in tokens of work (seconds per block times tokens per second, at
            least 1); None without a second tier or a load measured.
    """

    queued_tokens: int = 0
    requests: dict[str, int] | None = None
    running: int = 0
    waiting: int = 0
    time: float | None = None
    model_key: str | None = None
    worker_id: str | None = None
    adapters: list[str] | None = None
    host_adapters: list[str] | None = None
    adapter_read_tokens: int = 0
    adapter_swap_tokens: int = 0
    adapter_slots: int = 0
    adapter_slots_busy: int = 0
    adapter_slot_wait_tokens: int = 0
    kv_fetch_tokens_per_block: int | None = None
    kv_tier_load_tokens_per_block: int | None = None

    def to_wire(self) -> dict[str, Any]:
        """The report as a plain dict, keyed by this class's field names."""
        return dataclasses.asdict(self)

    @classmethod
    def from_wire(cls, stats: Any) -> RoutingStats:
        """Reads a report defensively: a missing or malformed field reads as its default
        (0 tokens, no breakdown, no time, no key), a malformed entry of ``requests`` is
        skipped. Never raises."""
        if not isinstance(stats, Mapping):
            return cls()
        return cls(queued_tokens=_count(stats.get("queued_tokens")),
                   requests=_request_tokens(stats.get("requests")),
                   running=_count(stats.get("running")),
                   waiting=_count(stats.get("waiting")),
                   time=_seconds(stats.get("time")),
                   model_key=_key(stats.get("model_key")),
                   worker_id=_key(stats.get("worker_id")),
                   adapters=_keys(stats.get("adapters")),
                   host_adapters=_keys(stats.get("host_adapters")),
                   adapter_read_tokens=_count(stats.get("adapter_read_tokens")),
                   adapter_swap_tokens=_count(stats.get("adapter_swap_tokens")),
                   adapter_slots=_count(stats.get("adapter_slots")),
                   adapter_slots_busy=_count(stats.get("adapter_slots_busy")),
                   adapter_slot_wait_tokens=_count(stats.get("adapter_slot_wait_tokens")),
                   kv_fetch_tokens_per_block=_count_or_none(
                       stats.get("kv_fetch_tokens_per_block")),
                   kv_tier_load_tokens_per_block=_count_or_none(
                       stats.get("kv_tier_load_tokens_per_block")))


@dataclass(frozen=True)
class ReplicaMetadata:
    """What a worker tells the router once (Ray Serve's ``record_replica_metadata()``), as
    the dict :meth:`to_wire` makes.

    Attributes:
        model_key: ``CacheIdentity.model_key`` (hex) the worker publishes its digests under.
        worker_id: the replica's id.
    """

    model_key: str | None = None
    worker_id: str | None = None

    def to_wire(self) -> dict[str, Any]:
        """The metadata as a plain dict, keyed by this class's field names."""
        return dataclasses.asdict(self)

    @classmethod
    def from_wire(cls, metadata: Any) -> ReplicaMetadata:
        """Reads metadata defensively (malformed fields read as None). Never raises."""
        if not isinstance(metadata, Mapping):
            return cls()
        return cls(_key(metadata.get("model_key")), _key(metadata.get("worker_id")))


def _count(value: Any) -> int:
    return int(value) if is_count(value) else 0


def _count_or_none(value: Any) -> int | None:
    return int(value) if is_count(value) else None


def _seconds(value: Any) -> float | None:
    return float(value) if is_count(value) else None


def _key(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def _keys(values: Any) -> list[str] | None:
    if not isinstance(values, (list, tuple)):
        return None
    return [value for value in values if _key(value)]


def _request_tokens(requests: Any) -> dict[str, int] | None:
    if not isinstance(requests, Mapping):
        return None
    return {rid: int(tokens) for rid, tokens in requests.items()
            if isinstance(rid, str) and is_count(tokens)}
