"""The worker's event publisher: ordered batches, a clean slate at start, resync after an index
outage (case R7 from the worker's side), one log line per outage."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import threading

import pytest
from helpers import held_blocks

from cluster.event_publisher import EventPublisher
from contract.kv_events import KVEvent, decode_events, encode_events
from router.index import IndexUnavailableError, MemoryIndex

MODEL = "model-key"
WORKER = "w1"


def digest(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()


class FlakyIndex(MemoryIndex):
    """A MemoryIndex that refuses every call while ``down``. Like a client of a shared index,
    closing it keeps the entries (it only counts the calls)."""

    def __init__(self):
        super().__init__(worker_ttl_s=60)
        self.down = False
        self.publishes = 0
        self.closes = 0

    async def close(self):
        self.closes += 1

    async def publish(self, model_key, worker_id, payload):
        if self.down:
            raise IndexUnavailableError("index down")
        self.publishes += 1
        return await super().publish(model_key, worker_id, payload)

    async def heartbeat(self, model_key, worker_id):
        if self.down:
            raise IndexUnavailableError("index down")
        return await super().heartbeat(model_key, worker_id)


async def held(index: MemoryIndex, digests: list[bytes]) -> int:
    return (await index.match(MODEL, digests, [WORKER]))[WORKER].blocks


def in_pool(digests) -> list[KVEvent]:
    """A worker's snapshot for resyncs: ``digests`` in its working pool, none in a tier."""
    return [KVEvent("stored", list(digests), "pool")]


@pytest.fixture
def cache_state():
    """What the worker's pool holds (the snapshot a resync publishes)."""
    return []


async def test_start_clears_stale_entries_then_publishes_in_order(cache_state):
    index = FlakyIndex()
    # A previous life of this worker id left entries behind (case R2, same id).
    await index.publish(MODEL, WORKER, encode_events([KVEvent("stored", [digest(9)])]))
    publisher = EventPublisher(index, MODEL, WORKER, lambda: in_pool(cache_state), heartbeat_s=60)
    chain = [digest(i) for i in range(3)]
    sender = threading.Thread(target=lambda: (
        publisher.submit_threadsafe([KVEvent("stored", chain)]),
        publisher.submit_threadsafe([KVEvent("removed", chain[2:])])))
    sender.start()
    sender.join()
    await asyncio.sleep(0)  # run the callbacks the engine thread scheduled
    await publisher.flush()
    assert await held(index, chain) == 2
    assert await held(index, [digest(9)]) == 0
    await publisher.close()


async def test_outage_drops_batches_then_resyncs_from_the_pool(cache_state, caplog):
    index = FlakyIndex()
    publisher = EventPublisher(index, MODEL, WORKER, lambda: in_pool(cache_state), heartbeat_s=60)
    await publisher.flush()
    index.down = True
    with caplog.at_level(logging.WARNING, logger="cluster.event_publisher"):
        for i in range(3):  # the pool changes while nobody can hear it
            cache_state.append(digest(i))
            publisher.submit_threadsafe([KVEvent("stored", [digest(i)])])
            await asyncio.sleep(0)
            await publisher.flush()
    assert len([r for r in caplog.records if "unavailable" in r.message]) == 1
    assert await held(index, [digest(0)]) == 0

    index.down = False
    cache_state.remove(digest(0))  # evicted before the index came back
    publisher.submit_threadsafe([KVEvent("stored", [digest(3)])])
    cache_state.append(digest(3))
    await asyncio.sleep(0)
    await publisher.flush()
    credited = {i for i in range(4) if await held(index, [digest(i)]) == 1}
    assert credited == {1, 2, 3}  # exactly the pool's state, not the lost event stream
    await publisher.close()


async def test_heartbeat_keeps_an_idle_worker_alive_and_heals_after_outage(cache_state):
    index = FlakyIndex()
    cache_state.append(digest(1))
    publisher = EventPublisher(index, MODEL, WORKER, lambda: in_pool(cache_state), heartbeat_s=0.01)
    await publisher.flush()
    index.down = True
    await asyncio.sleep(0.05)  # heartbeats fail: the publisher now owes a resync
    index.down = False
    before = index.publishes
    for _ in range(200):  # no traffic at all: the heartbeat loop alone must resync
        if index.publishes > before:
            break
        await asyncio.sleep(0.01)
    assert index.publishes > before
    assert await held(index, [digest(1)]) == 1
    await publisher.close()


class GatedIndex(FlakyIndex):
    """A FlakyIndex that can hold the next resync (a batch starting with ``cleared``) until the
    test opens the gate: a slow snapshot publish, reproduced deterministically."""

    def __init__(self):
        super().__init__()
        self.gate: asyncio.Event | None = None
        self.holding = asyncio.Event()

    async def publish(self, model_key, worker_id, payload):
        gate = self.gate
        if gate is not None and not self.down and decode_events(payload)[0].kind == "cleared":
            self.gate = None
            self.holding.set()
            await gate.wait()
        return await super().publish(model_key, worker_id, payload)


async def test_slow_resync_never_overtakes_a_later_removal(cache_state):
    stale = digest(1)
    cache_state.append(stale)
    index = GatedIndex()
    publisher = EventPublisher(index, MODEL, WORKER, lambda: in_pool(cache_state),
                               heartbeat_s=0.01)
    await publisher.flush()
    index.down = True  # a failed publish: the worker owes a resync
    publisher.submit_threadsafe([KVEvent("stored", [digest(2)])])
    cache_state.append(digest(2))
    await asyncio.sleep(0)
    await publisher.flush()

    gate = index.gate = asyncio.Event()
    index.down = False
    await asyncio.wait_for(index.holding.wait(), 5)  # a resync holding the snapshot {1, 2}
    cache_state.remove(stale)  # evicted while that snapshot is in flight
    publisher.submit_threadsafe([KVEvent("removed", [stale])])
    for _ in range(50):  # let any other task run as far as it can before the snapshot lands
        await asyncio.sleep(0)
    gate.set()
    await asyncio.sleep(0)
    await publisher.flush()
    await asyncio.sleep(0.05)  # a few heartbeats: they must not keep a stale entry alive

    assert await held(index, [stale]) == 0
    assert await held(index, [digest(2)]) == 1
    await publisher.close()


async def wait_until(condition, timeout_s: float = 5.0) -> None:
    """Poll an async condition every 10 ms; fails the test after ``timeout_s``."""
    for _ in range(int(timeout_s / 0.01)):
        if await condition():
            return
        await asyncio.sleep(0.01)
    pytest.fail("condition not reached in time")


async def test_heartbeat_that_finds_no_entry_resyncs(cache_state, caplog):
    """The index restarted empty between two heartbeats, and the worker publishes nothing:
    no write failed, yet the next heartbeat must bring the worker's blocks back."""
    cache_state.extend([digest(1), digest(2)])
    index = FlakyIndex()
    publisher = EventPublisher(index, MODEL, WORKER, lambda: in_pool(cache_state),
                               heartbeat_s=0.01)
    await wait_until(lambda: held(index, [digest(1), digest(2)]))

    with caplog.at_level(logging.INFO, logger="cluster.event_publisher"):
        await index.forget(MODEL, WORKER)  # what a restarted, empty Redis holds for us
        await wait_until(lambda: held(index, [digest(1), digest(2)]), 2.0)
    assert await held(index, [digest(1), digest(2)]) == 2
    assert [r.message for r in caplog.records if "no entry" in r.message] == [
        f"digest index had no entry for worker {WORKER} at a heartbeat; resyncing 2 digests"]
    await publisher.close()


async def test_publish_that_finds_no_entry_resyncs(cache_state):
    """Redis restarted between two publishes and the client reconnected at once: the publish
    succeeds on an empty index, which must not end up holding that one batch only."""
    cache_state.append(digest(1))
    index = FlakyIndex()
    publisher = EventPublisher(index, MODEL, WORKER, lambda: in_pool(cache_state), heartbeat_s=60)
    await wait_until(lambda: held(index, [digest(1)]))
    await index.forget(MODEL, WORKER)

    cache_state.append(digest(2))
    publisher.submit_threadsafe([KVEvent("stored", [digest(2)])])
    await asyncio.sleep(0)
    await publisher.flush()

    assert await held(index, [digest(1), digest(2)]) == 2
    await publisher.close()


async def test_a_resync_restores_both_media():
    """The snapshot a resync publishes names each digest's medium: after the index lost
    everything, it again knows which blocks the worker holds only in its second tier."""
    index = FlakyIndex()
    state = [KVEvent("stored", [digest(1)], "pool"), KVEvent("stored", [digest(2)], "tier")]
    publisher = EventPublisher(index, MODEL, WORKER, lambda: state, heartbeat_s=60)
    await publisher.flush()
    await index.forget(MODEL, WORKER)  # the index restarted empty
    publisher.submit_threadsafe([KVEvent("stored", [digest(3)], "tier")])
    await asyncio.sleep(0)
    await publisher.flush()

    matched = await index.match(MODEL, [digest(1), digest(2)], [WORKER])
    assert matched == {WORKER: (2, 1)}
    assert (await index.stats(MODEL)).tier_digests == 1  # the resync superseded digest 3
    await publisher.close()


async def test_an_empty_cache_is_not_resynced_at_every_heartbeat(cache_state):
    index = FlakyIndex()
    publisher = EventPublisher(index, MODEL, WORKER, lambda: in_pool(cache_state),
                               heartbeat_s=0.01)
    await publisher.flush()
    assert index.publishes == 1  # the clean slate at start
    await asyncio.sleep(0.1)  # about ten heartbeats, each finding no entry (nothing held)
    assert index.publishes == 1
    await publisher.close()


async def test_the_first_blocks_publish_creates_the_entry_without_a_resync(cache_state):
    # No heartbeat in between (60 s): one queued ahead of the batch would see the new block
    # with no entry and rightly resync, which is another case (the heartbeat tests above).
    index = FlakyIndex()
    publisher = EventPublisher(index, MODEL, WORKER, lambda: in_pool(cache_state), heartbeat_s=60)
    await publisher.flush()
    assert index.publishes == 1  # the clean slate at start: no entry for an empty cache
    cache_state.append(digest(1))
    publisher.submit_threadsafe([KVEvent("stored", [digest(1)])])
    await asyncio.sleep(0)
    await publisher.flush()
    assert index.publishes == 2  # the batch alone; no resync of the same block behind it
    assert await held(index, [digest(1)]) == 1
    await publisher.close()


async def test_close_removes_the_workers_entries(cache_state):
    cache_state.append(digest(1))
    index = FlakyIndex()
    other = EventPublisher(index, MODEL, "w2", lambda: in_pool([digest(1)]), heartbeat_s=60)
    publisher = EventPublisher(index, MODEL, WORKER, lambda: in_pool(cache_state), heartbeat_s=60)
    await publisher.flush()
    await other.flush()
    publisher.submit_threadsafe([KVEvent("stored", [digest(2)])])  # still queued at close

    await publisher.close()

    assert held_blocks(await index.match(MODEL, [digest(1)], [WORKER, "w2"])) == (
        {WORKER: 0, "w2": 1})
    assert (index.entry_count(), index.closes) == (1, 1)
    await other.close()


async def test_close_with_the_index_down_returns(cache_state):
    index = FlakyIndex()
    publisher = EventPublisher(index, MODEL, WORKER, lambda: in_pool(cache_state), heartbeat_s=60)
    await publisher.flush()
    index.down = True
    await asyncio.wait_for(publisher.close(timeout_s=1.0), 2.0)
    assert index.closes == 1
