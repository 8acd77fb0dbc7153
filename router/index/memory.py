"""In-process digest index: a set of digests per medium and an expiry per (model key, worker)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass

from contract.kv_events import MEDIA, Medium
from router.index.base import DigestIndex, HeldPrefix, IndexStats, decode_batch


@dataclass
class _Entry:
    media: dict[Medium, set[bytes]]
    expires_at: float


class MemoryIndex(DigestIndex):
    """The embedded backend, for one process (or hosted in one Ray actor, see ``actor.py``).

    Operations never await, so on one event loop each call is atomic.

    Args:
        worker_ttl_s: seconds a worker stays credited after its last publish or heartbeat.
        clock: monotonic time source in seconds; tests inject a fake one.

    Raises:
        ValueError: ``worker_ttl_s`` is not positive.
    """

    def __init__(
        self, worker_ttl_s: float = 30.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if not worker_ttl_s > 0:
            raise ValueError(f"worker_ttl_s must be positive, got {worker_ttl_s}")
        self._ttl = float(worker_ttl_s)
        self._clock = clock
        self._entries: dict[tuple[str, str], _Entry] = {}
        self._last_event: dict[str, float] = {}  # model key -> clock time of its last write
        # A lower bound of the earliest expiry, so most calls skip the purge scan. Refreshes only
        # push expiries later, so the bound stays valid until the next scan recomputes it.
        self._next_purge = math.inf

    async def publish(self, model_key: str, worker_id: str, payload: bytes) -> bool:
        """See :meth:`DigestIndex.publish`. Raises ValueError on a malformed payload."""
        events = decode_batch(payload)  # validate everything before touching state
        now = self._tick()
        self._last_event[model_key] = now
        key = (model_key, worker_id)
        entry = self._entries.get(key)
        media = entry.media if entry else {medium: set() for medium in MEDIA}
        for event in events:
            if event.kind == "stored":
                media[event.medium].update(event.digests)
            elif event.kind == "removed":
                media[event.medium].difference_update(event.digests)
            else:
                for digests in media.values():
                    digests.clear()
        self._put(key, media, now)
        return entry is not None

    async def heartbeat(self, model_key: str, worker_id: str) -> bool:
        """See :meth:`DigestIndex.heartbeat`."""
        now = self._tick()
        self._last_event[model_key] = now
        entry = self._entries.get((model_key, worker_id))
        if entry is None:
            return False
        entry.expires_at = now + self._ttl
        return True

    async def match(
        self, model_key: str, digests: list[bytes], worker_ids: list[str]
    ) -> dict[str, HeldPrefix]:
        """See :meth:`DigestIndex.match`."""
        self._tick()
        result = {}
        for worker_id in worker_ids:
            entry = self._entries.get((model_key, worker_id))
            pool, tier = (entry.media["pool"], entry.media["tier"]) if entry else ((), ())
            result[worker_id] = _leading_run(digests, pool, tier)
        return result

    async def stats(self, model_key: str) -> IndexStats:
        """See :meth:`DigestIndex.stats` (scans every entry: O(workers of all models))."""
        now = self._tick()
        entries = [e for (model, _), e in self._entries.items() if model == model_key]
        last = self._last_event.get(model_key)
        return IndexStats("memory", len(entries), sum(len(e.media["pool"]) for e in entries),
                          None if last is None else now - last,
                          sum(len(e.media["tier"]) for e in entries))

    async def forget(self, model_key: str, worker_id: str) -> None:
        """See :meth:`DigestIndex.forget`."""
        self._entries.pop((model_key, worker_id), None)

    async def close(self) -> None:
        """Drop every entry."""
        self._entries.clear()
        self._last_event.clear()

    def entry_count(self) -> int:
        """Live (model key, worker) entries held, after purging expired ones (for metrics)."""
        self._tick()
        return len(self._entries)

    def _put(self, key: tuple[str, str], media: dict[Medium, set[bytes]], now: float) -> None:
        # Empty sets are stored as no entry at all, as Redis does with empty SETs.
        if not any(media.values()):
            self._entries.pop(key, None)
            return
        expires_at = now + self._ttl
        self._entries[key] = _Entry(media, expires_at)
        self._next_purge = min(self._next_purge, expires_at)

    def _tick(self) -> float:
        """Current time, after deleting every expired entry (keeps memory bounded)."""
        now = self._clock()
        if now >= self._next_purge:
            expired = [key for key, entry in self._entries.items() if entry.expires_at <= now]
            for key in expired:
                del self._entries[key]
            self._next_purge = min(
                (entry.expires_at for entry in self._entries.values()), default=math.inf
            )
        return now


def _leading_run(digests: list[bytes], pool: Collection[bytes],
                 tier: Collection[bytes]) -> HeldPrefix:
    """The leading run of ``digests`` held in ``pool`` or ``tier``, and of it the blocks held
    only in ``tier``."""
    blocks = tier_blocks = 0
    for digest in digests:
        if digest in pool:
            blocks += 1
        elif digest in tier:
            blocks += 1
            tier_blocks += 1
        else:
            break
    return HeldPrefix(blocks, tier_blocks)
