"""Digest index: which workers hold the longest prefix of a prompt's block-digest chain.

One interface (:class:`DigestIndex`), two backends: Redis (:class:`RedisIndex`) and an embedded
in-memory one (:class:`MemoryIndex`, shared cluster-wide through :class:`ActorIndex`). Pick one
with :func:`make_index`. Semantics are documented in :mod:`router.index.base`.
"""

from __future__ import annotations

from router.index.base import (
    DigestIndex,
    HeldPrefix,
    IndexStats,
    IndexUnavailableError,
    decode_batch,
)
from router.index.memory import MemoryIndex

__all__ = [
    "DEFAULT_ACTOR_NAME",
    "ActorIndex",
    "DigestIndex",
    "HeldPrefix",
    "IndexStats",
    "IndexUnavailableError",
    "MemoryIndex",
    "RedisIndex",
    "decode_batch",
    "make_index",
]

DEFAULT_ACTOR_NAME = "nalar-digest-index"
"""A name for the shared index actor; pass it as ``actor_name`` (``None`` means no actor)."""


def make_index(
    redis_url: str | None,
    key_prefix: str,
    worker_ttl_s: float = 30.0,
    actor_name: str | None = None,
    *,
    actor_namespace: str | None = None,
) -> DigestIndex:
    """Build the configured backend.

    Args:
        redis_url: Redis URL; when given, the Redis backend is used.
        key_prefix: per-cluster prefix of the Redis keys (unused by the embedded backend).
        worker_ttl_s: seconds a worker stays credited after its last publish or heartbeat.
        actor_name: without a Redis URL, host the embedded index in this named Ray actor so
            every process shares it; ``None`` gives a private in-process :class:`MemoryIndex`.
        actor_namespace: Ray namespace of that actor (``None``: the caller's).

    Raises:
        ValueError: an invalid ``worker_ttl_s``, or an empty ``key_prefix`` with Redis.
    """
    if redis_url:
        from router.index.redis_index import RedisIndex

        return RedisIndex(redis_url, key_prefix, worker_ttl_s)
    if actor_name:
        from router.index.actor import ActorIndex

        return ActorIndex(actor_name, worker_ttl_s, namespace=actor_namespace)
    return MemoryIndex(worker_ttl_s)


def __getattr__(name: str) -> object:
    # Backends with heavy imports (ray, redis) load only when used.
    if name == "RedisIndex":
        from router.index.redis_index import RedisIndex

        return RedisIndex
    if name == "ActorIndex":
        from router.index.actor import ActorIndex

        return ActorIndex
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
