"""What routing reads from a replica's routing stats (``record_routing_stats``) and metadata."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from router.routing.checks import is_count

STATS_QUEUED_TOKENS = "queued_tokens"
"""Routing-stats key: tokens of work queued or running on the replica (see ``SentLedger``)."""

STATS_REQUESTS = "requests"
"""Routing-stats key: request id → tokens of work, for every request queued or running."""

STATS_TIME = "time"
"""Routing-stats key: the replica's ``time.time()`` when it took the snapshot, in seconds."""

STATS_MODEL_KEY = "model_key"
"""Replica-metadata (or routing-stats) key: the ``CacheIdentity.model_key`` (hex) the replica
publishes its digests under."""


def parse_routing_stats(stats: Any) -> tuple[int, float | None]:
    """Reads a replica's routing stats: ``(queued tokens, snapshot time in seconds or None)``.

    Missing or malformed values read as 0 queued tokens and no snapshot time. Never raises.
    """
    if not isinstance(stats, Mapping):
        return 0, None
    queued = stats.get(STATS_QUEUED_TOKENS)
    taken_at = stats.get(STATS_TIME)
    queued_tokens = int(queued) if is_count(queued) else 0
    snapshot = float(taken_at) if is_count(taken_at) else None
    return queued_tokens, snapshot


def parse_request_tokens(stats: Any) -> dict[str, int] | None:
    """The per-request breakdown of ``queued_tokens`` (request id → tokens), if reported.

    Malformed entries are skipped; a missing or malformed breakdown is None. Never raises.
    """
    requests = stats.get(STATS_REQUESTS) if isinstance(stats, Mapping) else None
    if not isinstance(requests, Mapping):
        return None
    return {rid: int(tokens) for rid, tokens in requests.items()
            if isinstance(rid, str) and is_count(tokens)}
