"""The digest index contract: which workers hold which KV block digests.

Workers publish batches of :class:`contract.kv_events.KVEvent` (msgpack, see
:func:`contract.kv_events.encode_events`); the router asks, for a prompt's digest chain, how many
leading blocks each candidate worker already holds. Entries are grouped by
:attr:`contract.identity.CacheIdentity.model_key`, so workers of different models never match.

Semantics shared by every backend:

* A worker's entries are two *sets* of digests, one per medium: its working pool (``pool``) and
  its second tier (``tier``). ``stored`` adds to the event's medium, ``removed`` discards from
  it, ``cleared`` empties both. Events of one batch are applied in order, and atomically: a
  malformed batch raises :class:`ValueError` and changes nothing.
* A match counts a block held in either medium, and says how many of the leading blocks are
  held only in the second tier (:class:`HeldPrefix`): a hit there is loaded before use, so the
  router prices it at the worker's measured load cost.
* Duplicates (case R3). The block pool emits events at digest level, never per physical block
  (``stored`` when the first block holding a digest becomes reusable, ``removed`` when the last
  one is evicted), so the engine never sends "stored h" twice without a "removed h" in between.
  A duplicate can therefore only be a redelivered event, and set semantics make it harmless:
  "stored h, stored h, removed h" leaves h not held, which is the worker's real state. Were an
  engine ever to emit per physical block, the same rule would at worst *under*-credit a worker
  (one lost routing hint), never credit it with a block it lacks.
* Liveness. Every publish and heartbeat refreshes the worker's expiry (``worker_ttl_s``). A worker
  not heard from for that long is never credited again, and its entries are deleted, so a dead
  worker stops costing memory within one TTL (case R2). ``forget`` drops them at once.
* Events are lossy: a worker that failed to publish should republish its whole state as one
  batch, ``[cleared, stored(all digests)]``, once the index answers again (case R7). The same
  holds when a publish or heartbeat reports that the worker's entry was missing (the index
  restarted empty, or the entry expired): both return whether it existed, so the worker knows.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Literal, NamedTuple

from contract.identity import DIGEST_SIZE
from contract.kv_events import KVEvent, decode_events


class IndexUnavailableError(RuntimeError):
    """The index backend cannot be reached (Redis down, index actor dead, or a call timed out).

    Callers treat it as "no index answer": the router falls back to load-only routing, a worker
    marks itself for a full resync.
    """


def decode_batch(payload: bytes) -> list[KVEvent]:
    """Decode and fully validate one published batch before any of it is applied.

    Stricter than :func:`contract.kv_events.decode_events`: every digest must also be a
    ``bytes`` of exactly :data:`contract.identity.DIGEST_SIZE` (32) bytes.

    Raises:
        ValueError: the payload is not valid msgpack, not a batch of known events, or holds a
            digest that is not 32 raw bytes.
    """
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise ValueError(f"KV event batch must be bytes, got {type(payload).__name__}")
    events = decode_events(bytes(payload))
    for position, event in enumerate(events):
        for digest in event.digests:
            if not isinstance(digest, bytes) or len(digest) != DIGEST_SIZE:
                raise ValueError(
                    f"event {position} ({event.kind}): digests must be {DIGEST_SIZE} raw bytes, "
                    f"got {digest!r:.80}"
                )
    return events


@dataclass(frozen=True)
class IndexStats:
    """What the index holds for one model, for the dashboard and ``/metrics``.

    Attributes:
        backend: ``"redis"``, ``"memory"`` or ``"actor"``.
        workers: workers with a live entry (a non-empty, unexpired digest set).
        digests: digests held in those workers' working pools (a digest two workers hold
            counts twice).
        last_event_age_s: seconds since any worker last published or sent a heartbeat for this
            model; ``None`` if none ever did.
        tier_digests: digests held in their second tiers, counted the same way.
    """

    backend: Literal["redis", "memory", "actor"]
    workers: int
    digests: int
    last_event_age_s: float | None
    tier_digests: int = 0


class HeldPrefix(NamedTuple):
    """How much of a prompt's digest chain one worker holds.

    Attributes:
        blocks: leading blocks it holds, in either medium (the chain up to its first miss).
        tier_blocks: of those, the ones it holds only in its second tier.
    """

    blocks: int
    tier_blocks: int = 0


class DigestIndex(abc.ABC):
    """Which workers hold which block digests, per model key.

    All methods are coroutines. Besides the errors listed per method, every method may raise
    :class:`IndexUnavailableError` when the backend cannot be reached.
    """

    @abc.abstractmethod
    async def publish(self, model_key: str, worker_id: str, payload: bytes) -> bool:
        """Apply one event batch of a worker, in order, and refresh its liveness.

        A worker must publish its batches one at a time, in the order its cache changed
        (await each call), or a ``removed`` could overtake the ``stored`` it cancels.

        Args:
            model_key: :attr:`CacheIdentity.model_key` (hex) of the worker's model.
            worker_id: stable id of the worker replica (e.g. its Ray Serve replica id).
            payload: msgpack batch from :func:`contract.kv_events.encode_events`.

        Returns:
            Whether the worker had a live entry before this batch. ``False`` while the worker
            holds digests means the index lost them (restarted empty, or they expired): the
            worker should resync its whole state.

        Raises:
            ValueError: the payload is malformed; the index is left unchanged.
        """

    @abc.abstractmethod
    async def heartbeat(self, model_key: str, worker_id: str) -> bool:
        """Refresh a worker's liveness for another ``worker_ttl_s`` seconds.

        A worker with no entries has nothing to keep alive, so this then changes no entry.

        Returns:
            Whether the worker had a live entry (and it was refreshed). ``False`` while the
            worker holds digests means the index lost them: the worker should resync.
        """

    @abc.abstractmethod
    async def match(
        self, model_key: str, digests: list[bytes], worker_ids: list[str]
    ) -> dict[str, HeldPrefix]:
        """How many leading digests of a chain each worker holds, and where.

        Args:
            model_key: the model whose entries to consult.
            digests: the prompt's chained block digests, block 0 first.
            worker_ids: candidate workers.

        Returns:
            ``{worker_id: HeldPrefix(n, t)}`` for every listed worker, where the worker holds
            ``digests[:n]``, each in its pool or its second tier, and not ``digests[n]``; ``t``
            of those ``n`` only in its second tier. ``(0, 0)`` for a worker with no live
            entries. Multiply by the block size to get cached tokens.
        """

    @abc.abstractmethod
    async def stats(self, model_key: str) -> IndexStats:
        """What the index holds for ``model_key`` now (cost: O(workers of that model))."""

    @abc.abstractmethod
    async def forget(self, model_key: str, worker_id: str) -> None:
        """Drop all of a worker's entries now (its replica died or was replaced)."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Release connections or handles; the index must not be used afterwards."""

    async def __aenter__(self) -> DigestIndex:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()
