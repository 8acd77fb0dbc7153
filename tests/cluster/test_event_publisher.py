"""The worker's event publisher: ordered batches, a clean slate at start, resync after an index
outage (case R7 from the worker's side), one log line per outage."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import threading

import pytest

from cluster.event_publisher import EventPublisher
from router.index import IndexUnavailableError, MemoryIndex
from workers.kv_events import KVEvent, encode_events

MODEL = "model-key"
WORKER = "w1"


def digest(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()


class FlakyIndex(MemoryIndex):
    """A MemoryIndex that refuses every call while ``down``."""

    def __init__(self):
        super().__init__(worker_ttl_s=60)
        self.down = False
        self.publishes = 0

    async def publish(self, model_key, worker_id, payload):
        if self.down:
            raise IndexUnavailableError("index down")
        self.publishes += 1
        await super().publish(model_key, worker_id, payload)

    async def heartbeat(self, model_key, worker_id):
        if self.down:
            raise IndexUnavailableError("index down")
        await super().heartbeat(model_key, worker_id)


async def held(index: MemoryIndex, digests: list[bytes]) -> int:
    return (await index.match(MODEL, digests, [WORKER]))[WORKER]


@pytest.fixture
def cache_state():
    """What the worker's pool holds (the snapshot a resync publishes)."""
    return []


async def test_start_clears_stale_entries_then_publishes_in_order(cache_state):
    index = FlakyIndex()
    # A previous life of this worker id left entries behind (case R2, same id).
    await index.publish(MODEL, WORKER, encode_events([KVEvent("stored", [digest(9)])]))
    publisher = EventPublisher(index, MODEL, WORKER, lambda: list(cache_state), heartbeat_s=60)
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
    publisher = EventPublisher(index, MODEL, WORKER, lambda: list(cache_state), heartbeat_s=60)
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
    publisher = EventPublisher(index, MODEL, WORKER, lambda: list(cache_state), heartbeat_s=0.01)
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
