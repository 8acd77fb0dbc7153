"""The ingress's copy of what the workers hash prompts under, kept current across redeploys.

The ingress hashes every prompt's blocks under the workers' ``CacheIdentity`` so the router can
ask the index who holds them. It reads that identity from a worker at start-up; when the workers
are later redeployed with other weights, their ``model_key`` changes, no request digest matches
anything any more, and routing quietly becomes load-only. The router sees the replicas' model
keys (``router.routing.replica_keys``); when the ingress's key is no longer among them, the
ingress asks a worker to ``describe`` itself again and re-hashes the request in hand.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable

from workers.identity import AdapterRef, CacheIdentity, CacheNamespace, block_digest, block_digests
from workers.request import GenerationRequest

log = logging.getLogger(__name__)


def identity_from_dict(fields: dict) -> CacheIdentity:
    """Rebuild a CacheIdentity from ``dataclasses.asdict`` output."""
    adapter = fields.get("adapter")
    return CacheIdentity(
        model_digest=fields["model_digest"], numerics=fields["numerics"],
        block_size=fields["block_size"], adapter=AdapterRef(**adapter) if adapter else None,
        namespace=CacheNamespace(**fields.get("namespace") or {}))


class WorkerIdentity:
    """The workers' cache identity and context length, as the ingress last read them.

    Args:
        describe: asks one worker for its ``describe()`` dict (``identity``, ``max_model_len``).
        description: the answer read at start-up.
        live_keys: the model keys the live worker replicas report (empty when not known yet).
        min_interval_s: least seconds between two refreshing ``describe`` calls: mid-rollout a
            call may still reach an old replica, and requests must not each ask again.
        clock: monotonic time in seconds (tests pass a fake).
    """

    def __init__(self, describe: Callable[[], Awaitable[dict]], description: dict,
                 live_keys: Callable[[], frozenset[str]], min_interval_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic):
        self._describe = describe
        self._live_keys = live_keys
        self._min_interval_s = min_interval_s
        self._clock = clock
        self._lock = asyncio.Lock()
        self._refreshed_at: float | None = None
        self._apply(description)

    def stale(self) -> bool:
        """True when the live replicas report model keys and this identity's is not one."""
        keys = self._live_keys()
        return bool(keys) and self.identity.model_key not in keys

    async def current(self, request: GenerationRequest) -> GenerationRequest:
        """``request`` with digests under the current identity, refreshing it first if stale.

        The request itself when its digests are already current (the common case: one hash of
        its first block to check). A failed ``describe`` is logged and leaves the identity as
        it was: routing is then load-only for that request, never failed.
        """
        if self.stale():
            await self._refresh()
        return self._rehashed(request)

    async def _refresh(self) -> None:
        async with self._lock:  # one describe for a burst of requests
            if not self.stale() or self._too_soon():
                return
            self._refreshed_at = self._clock()
            old_key = self.identity.model_key
            try:
                self._apply(await self._describe())
            except Exception as exc:
                log.warning("Could not re-read the workers' identity (%s); keeping %s.",
                            exc, old_key[:12])
                return
            log.info("Workers' model key changed %s -> %s: prompts are hashed under the new "
                     "identity.", old_key[:12], self.identity.model_key[:12])

    def _too_soon(self) -> bool:
        return (self._refreshed_at is not None
                and self._clock() - self._refreshed_at < self._min_interval_s)

    def _apply(self, description: dict) -> None:
        self.identity = identity_from_dict(description["identity"])
        self.max_model_len = description["max_model_len"]

    def _rehashed(self, request: GenerationRequest) -> GenerationRequest:
        digests = request.routing_digests
        if not digests:
            return request  # shorter than one block: nothing to hash
        block_size = self.identity.block_size
        root = self.identity.with_namespace(request.namespace).root_digest
        if block_digest(root, request.token_ids[:block_size]) == digests[0]:
            return request
        return dataclasses.replace(
            request, routing_digests=block_digests(root, request.token_ids, block_size))
