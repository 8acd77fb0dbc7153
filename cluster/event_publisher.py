"""Ships a worker's KV events to the digest index: one writer, in order, that heals the index.

Every write of a worker to the index (event batches, heartbeats, resyncs) goes through one queue
and one task, so writes land in the order the cache changed. A resync takes its snapshot at its
own turn, when every event before it is reflected in the pool, and every event after it is still
queued behind it: no later ``removed`` can be overtaken by an older snapshot (DESIGN §4, "one
writer per worker, in order"). Events the snapshot already reflects may follow it again; set
semantics make that harmless.

Events are lossy by contract: when a write fails, later batches are dropped and, at the next turn
once the index answers, the worker's whole state is sent as ``[cleared, stored(all in the pool),
stored(all in the second tier)]``, which supersedes everything that was dropped. The same resync
follows a publish or heartbeat that finds the worker's entry missing (Redis restarted empty, or the
entry expired), since refreshing a missing entry refreshes nothing and the worker would never be
credited again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from contract.kv_events import KVEvent, encode_events
from router.index import DigestIndex

log = logging.getLogger(__name__)

_HEARTBEAT = "heartbeat"
_FORGET = "forget"


class EventPublisher:
    """The worker's only writer to the index.

    Args:
        index: the digest index.
        model_key: the worker's ``CacheIdentity.model_key``.
        worker_id: the id the router knows the replica by.
        snapshot: returns what the worker's cache currently holds, as ``stored`` events per
            medium (``BlockPool.held_state``), for resyncs; must be safe to call from the event
            loop while the engine thread runs.
        heartbeat_s: seconds between liveness refreshes (a third of the index TTL).
    """

    def __init__(self, index: DigestIndex, model_key: str, worker_id: str,
                 snapshot: Callable[[], list[KVEvent]], heartbeat_s: float):
        self._index = index
        self._model_key = model_key
        self._worker_id = worker_id
        self._snapshot = snapshot
        self._heartbeat_s = heartbeat_s
        self._queue: asyncio.Queue[list[KVEvent] | str] = asyncio.Queue()
        self._loop = asyncio.get_running_loop()
        self._needs_resync = True  # a (re)started worker first tells the index what it holds
        self._heartbeat_queued = False
        self._closing = False
        self._outage_logged = False
        self._queue_heartbeat()  # the first turn performs that resync
        self._writer = asyncio.create_task(self._write_loop())
        self._ticker = asyncio.create_task(self._tick())

    def submit_threadsafe(self, events: list[KVEvent]) -> None:
        """Queue a batch from the engine thread (never blocks it)."""
        self._loop.call_soon_threadsafe(self._queue.put_nowait, events)

    async def flush(self) -> None:
        """Wait until every write queued so far is done or dropped (for tests)."""
        await self._queue.join()

    async def close(self, timeout_s: float = 5.0) -> None:
        """Remove this worker's entries from the index, then release it (clean shutdown).

        A worker that is going away must not be credited with blocks a moment longer: queued
        batches are dropped and ``forget`` is the writer's next write, after at most the one in
        flight. Waits up to ``timeout_s`` seconds for it; if the index does not answer, the
        entries expire within one TTL instead. Never raises for index errors.
        """
        self._ticker.cancel()
        self._closing = True
        self._queue.put_nowait(_FORGET)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._writer, timeout_s)  # cancels the writer on timeout
        await self._index.close()

    def _queue_heartbeat(self) -> None:
        # One pending heartbeat is enough; a slow index must not pile them up.
        if not self._heartbeat_queued:
            self._heartbeat_queued = True
            self._queue.put_nowait(_HEARTBEAT)

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(self._heartbeat_s)
            self._queue_heartbeat()

    async def _write_loop(self) -> None:
        while True:
            item = await self._queue.get()
            try:
                if item == _FORGET:
                    await self._forget()
                    return
                if item == _HEARTBEAT:
                    self._heartbeat_queued = False
                if not self._closing:
                    await self._write(item)
            except Exception as exc:
                self._fail(exc)
            finally:
                self._queue.task_done()

    async def _write(self, item: list[KVEvent] | str) -> None:
        """One turn: a resync if one is owed (it supersedes the item), else the item itself."""
        if self._needs_resync:
            await self._publish_state(self._snapshot())
        elif item == _HEARTBEAT:
            if not await self._index.heartbeat(self._model_key, self._worker_id):
                await self._restore("a heartbeat")
        elif not await self._index.publish(self._model_key, self._worker_id,
                                           encode_events(item)):
            await self._restore("a publish", _stored_digests(item))

    async def _restore(self, write: str, published: set[bytes] | None = None) -> None:
        """The index had no entry for this worker before ``write``: send the whole state
        again, unless the cache holds nothing beyond what that write itself just ``published``
        (a cache that was empty and gains its first blocks)."""
        state = self._snapshot()
        held = _stored_digests(state)
        if not held.difference(published or ()):
            return
        log.info("digest index had no entry for worker %s at %s; resyncing %d digests",
                 self._worker_id, write, len(held))
        await self._publish_state(state)

    async def _publish_state(self, state: list[KVEvent]) -> None:
        """Publish ``[cleared, *state]`` (raises what the index raises)."""
        await self._index.publish(self._model_key, self._worker_id,
                                  encode_events([KVEvent("cleared"), *state]))
        if self._outage_logged:
            log.info("digest index answers again; worker %s resynced", self._worker_id)
        self._needs_resync = self._outage_logged = False

    async def _forget(self) -> None:
        try:
            await self._index.forget(self._model_key, self._worker_id)
        except Exception as exc:  # shutting down: the entries expire within one TTL anyway
            log.warning("could not remove worker %s from the digest index (%s)",
                        self._worker_id, exc)

    def _fail(self, exc: Exception) -> None:
        if not self._outage_logged:  # log an outage once, not per batch
            log.warning("digest index unavailable (%s); will resync when it answers", exc)
        self._needs_resync = self._outage_logged = True


def _stored_digests(events: list[KVEvent]) -> set[bytes]:
    """Every digest a batch stores (whether a later event of it removes it again or not)."""
    return {digest for event in events if event.kind == "stored" for digest in event.digests}
