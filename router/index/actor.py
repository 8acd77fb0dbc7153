"""The embedded digest index shared by a whole Ray cluster: a MemoryIndex in one named actor.

Every process that builds an :class:`ActorIndex` with the same actor name (and Ray namespace)
talks to the same actor; the first one creates it. The actor is not detached: it dies with the
process that created it (its owner), and Ray also collects it once no process holds a handle
to it. So create it from a long-lived process that keeps its client (``nalar serve``'s driver
does: ``cluster.runtime.start_index_actor``). If it dies, calls raise
:class:`IndexUnavailableError` and the next call creates a fresh, empty one; its state was
lossy by contract, so workers repopulate it (see :mod:`router.index.base`).
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import ray
from ray.exceptions import RayActorError

from router.index.base import DigestIndex, HeldPrefix, IndexStats, IndexUnavailableError
from router.index.memory import MemoryIndex


class _IndexActor:
    """Ray actor body: forwards each call to one MemoryIndex. An async actor runs calls on one
    event loop, and MemoryIndex never awaits inside a call, so each call is atomic."""

    def __init__(self, worker_ttl_s: float) -> None:
        self._index = MemoryIndex(worker_ttl_s)

    async def publish(self, model_key: str, worker_id: str, payload: bytes) -> bool:
        return await self._index.publish(model_key, worker_id, payload)

    async def heartbeat(self, model_key: str, worker_id: str) -> bool:
        return await self._index.heartbeat(model_key, worker_id)

    async def match(
        self, model_key: str, digests: list[bytes], worker_ids: list[str]
    ) -> dict[str, HeldPrefix]:
        return await self._index.match(model_key, digests, worker_ids)

    async def stats(self, model_key: str) -> IndexStats:
        return await self._index.stats(model_key)

    async def forget(self, model_key: str, worker_id: str) -> None:
        await self._index.forget(model_key, worker_id)

    async def entry_count(self) -> int:
        return self._index.entry_count()


IndexActor = ray.remote(_IndexActor)
"""The Ray actor class hosting the embedded index (created through :class:`ActorIndex`)."""


class ActorIndex(DigestIndex):
    """Client of the named index actor; gets or creates it on first use.

    Args:
        actor_name: Ray actor name shared by every process of the cluster.
        worker_ttl_s: worker liveness in seconds; only the call that creates the actor sets it.
        namespace: Ray namespace of the actor; ``None`` is the caller's job namespace (Serve
            replicas run in ``"serve"``, so a driver looking for their actor must pass it).
        call_timeout_s: seconds to wait for one call before raising
            :class:`IndexUnavailableError`.

    Raises:
        ValueError: empty ``actor_name`` or non-positive ``worker_ttl_s``.
    """

    def __init__(
        self,
        actor_name: str,
        worker_ttl_s: float = 30.0,
        *,
        namespace: str | None = None,
        call_timeout_s: float = 10.0,
    ) -> None:
        if not actor_name:
            raise ValueError("actor_name must be non-empty")
        if not worker_ttl_s > 0:
            raise ValueError(f"worker_ttl_s must be positive, got {worker_ttl_s}")
        self._name = actor_name
        self._ttl = float(worker_ttl_s)
        self._namespace = namespace
        self._timeout = call_timeout_s
        self._handle: Any = None

    async def publish(self, model_key: str, worker_id: str, payload: bytes) -> bool:
        """See :meth:`DigestIndex.publish`. Raises ValueError on a malformed payload."""
        return await self._call("publish", model_key, worker_id, payload)

    async def heartbeat(self, model_key: str, worker_id: str) -> bool:
        """See :meth:`DigestIndex.heartbeat`."""
        return await self._call("heartbeat", model_key, worker_id)

    async def match(
        self, model_key: str, digests: list[bytes], worker_ids: list[str]
    ) -> dict[str, HeldPrefix]:
        """See :meth:`DigestIndex.match`: one actor call for the whole chain."""
        return await self._call("match", model_key, list(digests), list(worker_ids))

    async def stats(self, model_key: str) -> IndexStats:
        """See :meth:`DigestIndex.stats`: the hosted index's figures, under backend "actor"."""
        return dataclasses.replace(await self._call("stats", model_key), backend="actor")

    async def forget(self, model_key: str, worker_id: str) -> None:
        """See :meth:`DigestIndex.forget`."""
        await self._call("forget", model_key, worker_id)

    async def entry_count(self) -> int:
        """Live (model key, worker) entries in the actor (for metrics and tests)."""
        return await self._call("entry_count")

    async def close(self) -> None:
        """Drop this client's handle; the shared actor keeps running for the other processes."""
        self._handle = None

    def _actor(self) -> Any:
        if self._handle is None:
            self._handle = IndexActor.options(
                name=self._name,
                namespace=self._namespace,
                get_if_exists=True,
                lifetime=None,  # non-detached: never outlives the cluster's jobs
                num_cpus=0,  # bookkeeping only; must not take a CPU from the workers
            ).remote(self._ttl)
        return self._handle

    async def _call(self, method: str, *args: Any) -> Any:
        try:
            ref = getattr(self._actor(), method).remote(*args)
            return await asyncio.wait_for(asyncio.wrap_future(ref.future()), self._timeout)
        except RayActorError as exc:
            self._handle = None  # the next call gets or creates a live actor
            raise IndexUnavailableError(f"index actor {self._name!r} died: {exc}") from exc
        except asyncio.TimeoutError as exc:
            raise IndexUnavailableError(
                f"index actor {self._name!r} did not answer {method} in {self._timeout} s"
            ) from exc
