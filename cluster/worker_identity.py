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

from contract.description import WorkerDescription
from contract.identity import prompt_digests
from contract.request import GenerationRequest

log = logging.getLogger(__name__)


class WorkerIdentity:
    """The workers' cache identity and context length, as the ingress last read them.

    Args:
        describe: asks one worker for its ``describe()``.
        description: the answer read at start-up.
        live_keys: the model keys the live worker replicas report (empty when not known yet).
        min_interval_s: least seconds between two refreshing ``describe`` calls: mid-rollout a
            call may still reach an old replica, and requests must not each ask again.
        clock: monotonic time in seconds (tests pass a fake).
    """

    def __init__(self, describe: Callable[[], Awaitable[WorkerDescription]],
                 description: WorkerDescription,
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

        The request itself when its digests are already current (the common case: their model
        key is the identity's, no hashing). A failed ``describe`` is logged and leaves the
        identity as it was: routing is then load-only for that request, never failed.
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

    def _apply(self, description: WorkerDescription) -> None:
        self.identity = description.identity
        self.max_model_len = description.max_model_len

    def _rehashed(self, request: GenerationRequest) -> GenerationRequest:
        digests = request.prompt_digests
        if digests is None or digests.model_key == self.identity.model_key:
            return request
        return dataclasses.replace(request, prompt_digests=prompt_digests(
            self.identity, request.namespace, request.token_ids, request.adapter))
