"""Ships a worker's KV events to the digest index, in order, and heals after index outages.

Events are lossy by contract (DESIGN §4): when a publish fails, later batches are dropped and,
once the index answers again, the worker's whole state is sent as ``[cleared, stored(all)]``,
which supersedes everything that was dropped.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from router.index import DigestIndex
from workers.kv_events import KVEvent, encode_events

log = logging.getLogger(__name__)


class EventPublisher:
    """One ordered publishing task per worker.

    Args:
        index: the digest index.
        model_key: the worker's ``CacheIdentity.model_key``.
        worker_id: the id the router knows the replica by.
        snapshot: returns every digest the worker's cache currently holds (for resyncs).
        heartbeat_s: seconds between liveness refreshes (a third of the index TTL).
    """

    def __init__(self, index: DigestIndex, model_key: str, worker_id: str,
                 snapshot: Callable[[], list[bytes]], heartbeat_s: float):
        self._index = index
        self._model_key = model_key
        self._worker_id = worker_id
        self._snapshot = snapshot
        self._heartbeat_s = heartbeat_s
        self._queue: asyncio.Queue[list[KVEvent]] = asyncio.Queue()
        self._loop = asyncio.get_running_loop()
        self._needs_resync = True  # a (re)started worker first tells the index it holds nothing
        self._outage_logged = False
        self._tasks = [asyncio.create_task(self._publish_loop()),
                       asyncio.create_task(self._heartbeat_loop())]

    def submit_threadsafe(self, events: list[KVEvent]) -> None:
        """Queue a batch from the engine thread (never blocks it)."""
        self._loop.call_soon_threadsafe(self._queue.put_nowait, events)

    async def flush(self) -> None:
        """Wait until every batch queued so far is published or dropped (for tests)."""
        await self._queue.join()

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await self._index.close()

    async def _publish_loop(self) -> None:
        await self._try_resync()
        while True:
            events = await self._queue.get()
            try:
                if not self._needs_resync or await self._try_resync():
                    await self._send(events)
            finally:
                self._queue.task_done()

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self._heartbeat_s)
            if self._needs_resync:
                await self._try_resync()
                continue
            try:
                await self._index.heartbeat(self._model_key, self._worker_id)
            except Exception as exc:
                self._fail(exc)

    async def _try_resync(self) -> bool:
        """Publish ``[cleared, stored(snapshot)]``; returns whether it went through."""
        state = [KVEvent("cleared"), KVEvent("stored", self._snapshot())]
        try:
            await self._index.publish(self._model_key, self._worker_id, encode_events(state))
        except Exception as exc:
            self._fail(exc)
            return False
        if self._outage_logged:
            log.info("digest index answers again; worker %s resynced", self._worker_id)
        self._needs_resync = self._outage_logged = False
        return True

    async def _send(self, events: list[KVEvent]) -> None:
        try:
            await self._index.publish(self._model_key, self._worker_id, encode_events(events))
        except Exception as exc:
            self._fail(exc)

    def _fail(self, exc: Exception) -> None:
        if not self._outage_logged:  # log an outage once, not per batch
            log.warning("digest index unavailable (%s); will resync when it answers", exc)
        self._needs_resync = self._outage_logged = True
