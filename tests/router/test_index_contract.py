"""Contract of the digest index (cases R1, R2, R3 of shared/cases/routing.md), run against the
in-memory and the Redis backend alike, plus backend-specific checks and one Ray actor test."""

from __future__ import annotations

import asyncio
import hashlib
import time
import uuid
from collections.abc import AsyncIterator, Iterator

import msgpack
import pytest
import redis
from helpers import PrivateRedis, free_port, held_blocks, private_redis_server

from contract.kv_events import KVEvent, encode_events
from router.index import DigestIndex, IndexStats, IndexUnavailableError, MemoryIndex, make_index
from router.index.redis_index import RedisIndex, delete_key_prefix

# ---------------------------------------------------------------------------------- helpers


def h(i: int) -> bytes:
    """Digest number ``i`` of a test chain (32 bytes, like a real block digest)."""
    return hashlib.sha256(f"h{i}".encode()).digest()


def chain(n: int) -> list[bytes]:
    """h1..hn."""
    return [h(i) for i in range(1, n + 1)]


def batch(*events: KVEvent) -> bytes:
    return encode_events(list(events))


def stored(*digests: bytes) -> KVEvent:
    return KVEvent("stored", list(digests))


def removed(*digests: bytes) -> KVEvent:
    return KVEvent("removed", list(digests))


def cleared() -> KVEvent:
    return KVEvent("cleared", [])


class FakeClock:
    """Monotonic seconds that move only when a test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


# ---------------------------------------------------------------------------------- backends


class MemoryBackend:
    """MemoryIndex on a fake clock: time passes in steps of a quarter TTL."""

    name = "memory"
    short_ttl_s = 30.0
    max_ticks = 10

    def __init__(self) -> None:
        self.clock = FakeClock()
        self.index: MemoryIndex | None = None

    def open(self, ttl_s: float) -> DigestIndex:
        self.ttl_s = ttl_s
        self.index = MemoryIndex(ttl_s, clock=self.clock)
        return self.index

    async def tick(self) -> None:
        self.clock.advance(self.ttl_s / 4)

    async def stored_entries(self, model_key: str) -> int:
        assert self.index is not None
        return self.index.entry_count()


class RedisBackend:
    """RedisIndex under a per-test key prefix: real time, polled every 50 ms (10 s deadline)."""

    name = "redis"
    short_ttl_s = 1.0
    max_ticks = 200

    def __init__(self, url: str, prefix: str) -> None:
        self.url = url
        self.prefix = prefix

    def open(self, ttl_s: float) -> DigestIndex:
        return RedisIndex(self.url, self.prefix, ttl_s)

    async def tick(self) -> None:
        await asyncio.sleep(0.05)

    async def stored_entries(self, model_key: str) -> int:
        """Keys of this model that still exist (expired keys are not returned by SCAN)."""
        client = redis.Redis.from_url(self.url)
        try:
            return len(list(client.scan_iter(match=f"{self.prefix}:{model_key}:w:*")))
        finally:
            client.close()


@pytest.fixture(params=["memory", "redis"])
def backend(request: pytest.FixtureRequest) -> MemoryBackend | RedisBackend:
    if request.param == "memory":
        return MemoryBackend()
    # Requested lazily so the memory half runs even where Redis is unavailable.
    url = request.getfixturevalue("redis_url")
    return RedisBackend(url, request.getfixturevalue("redis_key_prefix"))


@pytest.fixture
async def index(backend: MemoryBackend | RedisBackend) -> AsyncIterator[DigestIndex]:
    idx = backend.open(30.0)
    yield idx
    await idx.close()


@pytest.fixture
def model_key() -> str:
    return uuid.uuid4().hex


# ---------------------------------------------------------------------------------- contract


async def test_match_counts_leading_digests_only(index: DigestIndex, model_key: str) -> None:
    await index.publish(model_key, "A", batch(stored(h(1), h(2), h(4))))
    await index.publish(model_key, "B", batch(stored(h(2), h(3), h(4))))
    await index.publish(model_key, "C", batch(stored(*chain(4))))

    result = await index.match(model_key, chain(4), ["A", "B", "C", "unknown"])

    assert result == {"A": (2, 0), "B": (0, 0), "C": (4, 0), "unknown": (0, 0)}


async def test_r1_clear_all_drops_only_that_worker(index: DigestIndex, model_key: str) -> None:
    await index.publish(model_key, "A", batch(stored(*chain(4))))
    await index.publish(model_key, "B", batch(stored(*chain(4))))

    await index.publish(model_key, "A", batch(cleared()))

    assert held_blocks(await index.match(model_key, chain(4), ["A", "B"])) == {"A": 0, "B": 4}
    for digest in chain(4):  # not credited with any single one of h1..h4 either
        assert held_blocks(await index.match(model_key, [digest], ["A"])) == {"A": 0}


async def test_events_of_a_batch_apply_in_order(index: DigestIndex, model_key: str) -> None:
    await index.publish(
        model_key, "A", batch(stored(*chain(3)), removed(h(2)), cleared(), stored(h(1), h(2)))
    )
    await index.publish(model_key, "B", batch(stored(h(1)), removed(h(1))))
    await index.publish(model_key, "C", batch(removed(h(1)), stored(h(1))))

    assert held_blocks(await index.match(model_key, chain(3), ["A", "B", "C"])) == (
        {"A": 2, "B": 0, "C": 1})


def in_tier(event: KVEvent) -> KVEvent:
    event.medium = "tier"
    return event


async def test_match_counts_both_media_and_says_which_blocks_are_in_the_tier(
    index: DigestIndex, model_key: str
) -> None:
    # A: blocks 1-2 in its pool, 3-4 evicted into its tier; B: 1 in both, 2 only in the tier.
    await index.publish(model_key, "A", batch(stored(*chain(4)), removed(h(3), h(4)),
                                              in_tier(stored(h(3), h(4)))))
    await index.publish(model_key, "B", batch(stored(h(1)), in_tier(stored(h(1), h(2)))))

    result = await index.match(model_key, chain(4), ["A", "B"])

    assert result == {"A": (4, 2), "B": (2, 1)}
    assert result["A"].tier_blocks == 2


async def test_a_medium_loses_only_its_own_copy_and_cleared_empties_both(
    index: DigestIndex, model_key: str
) -> None:
    await index.publish(model_key, "A", batch(stored(*chain(2)), in_tier(stored(*chain(2)))))
    await index.publish(model_key, "A", batch(in_tier(removed(h(1)))))  # dropped from the tier
    assert await index.match(model_key, chain(2), ["A"]) == {"A": (2, 0)}
    await index.publish(model_key, "A", batch(removed(h(2))))  # evicted from the pool
    assert await index.match(model_key, chain(2), ["A"]) == {"A": (2, 1)}
    stats = await index.stats(model_key)
    assert (stats.workers, stats.digests, stats.tier_digests) == (1, 1, 1)

    await index.publish(model_key, "A", batch(cleared()))

    assert await index.match(model_key, chain(2), ["A"]) == {"A": (0, 0)}
    assert (await index.stats(model_key)).workers == 0


async def test_a_worker_holding_only_a_tier_is_live_and_expires(
    backend: MemoryBackend | RedisBackend, model_key: str
) -> None:
    index = backend.open(backend.short_ttl_s)
    try:
        assert not await index.publish(model_key, "A", batch(in_tier(stored(h(1)))))
        assert await index.heartbeat(model_key, "A")  # the entry exists: tier digests only
        assert (await index.stats(model_key)).tier_digests == 1
        for _ in range(backend.max_ticks):
            await backend.tick()
            if (await index.match(model_key, [h(1)], ["A"]))["A"].blocks == 0:
                break
        else:
            pytest.fail("A's tier entries did not expire within the deadline")
    finally:
        await index.close()


async def test_a_long_chain_split_across_media_counts_past_every_chunk(
    index: DigestIndex, model_key: str
) -> None:
    # Redis walks a chain 256 digests at a time: the run crosses two chunk boundaries.
    full = chain(600)
    await index.publish(model_key, "A", batch(stored(*full[:300]), in_tier(stored(*full[300:450])),
                                              in_tier(stored(*full[451:]))))
    await index.publish(model_key, "B", batch(in_tier(stored(*full[:513]))))
    assert await index.match(model_key, full, ["A", "B"]) == {"A": (450, 150), "B": (513, 513)}


async def test_a_row_without_a_medium_is_in_the_pool(index: DigestIndex, model_key: str) -> None:
    # what workers published before events named their medium
    await index.publish(model_key, "A", msgpack.packb([["stored", [h(1)]]], use_bin_type=True))
    assert await index.match(model_key, [h(1)], ["A"]) == {"A": (1, 0)}


async def test_r3_duplicate_stored_then_one_removed_is_not_held(
    index: DigestIndex, model_key: str
) -> None:
    await index.publish(model_key, "A", batch(stored(h(1), h(2))))
    await index.publish(model_key, "A", batch(stored(h(2))))  # duplicate, e.g. redelivered
    assert held_blocks(await index.match(model_key, chain(2), ["A"])) == {"A": 2}

    await index.publish(model_key, "A", batch(removed(h(2))))

    assert held_blocks(await index.match(model_key, chain(2), ["A"])) == {"A": 1}
    assert held_blocks(await index.match(model_key, [h(2)], ["A"])) == {"A": 0}


async def test_r2_dead_worker_expires_and_frees_its_key(
    backend: MemoryBackend | RedisBackend, model_key: str
) -> None:
    index = backend.open(backend.short_ttl_s)
    try:
        for worker in ("A", "B", "C"):
            await index.publish(model_key, worker, batch(stored(*chain(4))))
        assert await backend.stored_entries(model_key) == 3

        # A dies (goes silent); B keeps alive by heartbeat, C by publishing (an empty batch).
        for _ in range(backend.max_ticks):
            await index.heartbeat(model_key, "B")
            await index.publish(model_key, "C", batch())
            if await backend.stored_entries(model_key) == 2:
                break
            await backend.tick()
        else:
            pytest.fail("A's entries did not expire within the deadline")

        result = await index.match(model_key, chain(4), ["A", "B", "C"])
        assert held_blocks(result) == {"A": 0, "B": 4, "C": 4}
        assert (await index.stats(model_key)).workers == 2
        # A heartbeat after the expiry refreshes nothing and says so: A must resync.
        assert await index.heartbeat(model_key, "A") is False
        assert held_blocks(await index.match(model_key, chain(4), ["A"])) == {"A": 0}

        # A comes back empty under the same id: only what it publishes now counts.
        await index.publish(model_key, "A", batch(stored(h(9))))
        assert held_blocks(await index.match(model_key, chain(4), ["A"])) == {"A": 0}
        assert held_blocks(await index.match(model_key, [h(9)], ["A"])) == {"A": 1}
    finally:
        await index.close()


async def test_r2_restart_same_id_publishes_cleared(
    index: DigestIndex, backend: MemoryBackend | RedisBackend, model_key: str
) -> None:
    await index.publish(model_key, "A", batch(stored(*chain(4))))
    await index.publish(model_key, "B", batch(stored(*chain(4))))

    await index.publish(model_key, "A", batch(cleared()))  # first batch of the restarted A

    assert held_blocks(await index.match(model_key, chain(4), ["A", "B"])) == {"A": 0, "B": 4}
    assert await backend.stored_entries(model_key) == 1  # an empty worker costs nothing


async def test_forget_drops_a_worker_at_once(
    index: DigestIndex, backend: MemoryBackend | RedisBackend, model_key: str
) -> None:
    await index.publish(model_key, "A", batch(stored(*chain(4))))
    await index.publish(model_key, "B", batch(stored(*chain(4))))

    await index.forget(model_key, "A")
    await index.forget(model_key, "never-seen")  # not an error

    assert held_blocks(await index.match(model_key, chain(4), ["A", "B"])) == {"A": 0, "B": 4}
    assert await backend.stored_entries(model_key) == 1


async def test_heartbeat_of_unknown_worker_creates_nothing(
    index: DigestIndex, backend: MemoryBackend | RedisBackend, model_key: str
) -> None:
    await index.heartbeat(model_key, "A")

    assert held_blocks(await index.match(model_key, chain(1), ["A"])) == {"A": 0}
    assert await backend.stored_entries(model_key) == 0


async def test_heartbeat_and_publish_report_whether_the_entry_existed(
    index: DigestIndex, model_key: str
) -> None:
    assert await index.heartbeat(model_key, "A") is False  # never published
    assert await index.publish(model_key, "A", batch(stored(h(1)))) is False  # created now
    assert await index.heartbeat(model_key, "A") is True
    assert await index.publish(model_key, "A", batch(stored(h(2)))) is True

    await index.forget(model_key, "A")  # as if the index had restarted empty
    assert await index.heartbeat(model_key, "A") is False
    assert await index.publish(model_key, "A", batch(stored(h(3)))) is False

    assert await index.publish(model_key, "A", batch(cleared())) is True
    assert await index.heartbeat(model_key, "A") is False  # an empty set is no entry
    assert held_blocks(await index.match(model_key, [h(3)], ["A"])) == {"A": 0}


async def test_stats_count_live_workers_and_their_digests(
    backend: MemoryBackend | RedisBackend, index: DigestIndex, model_key: str
) -> None:
    assert await index.stats(model_key) == IndexStats(backend.name, 0, 0, None)

    await index.publish(model_key, "A", batch(stored(*chain(4))))
    await index.publish(model_key, "B", batch(stored(h(1), h(2))))
    await index.publish(model_key, "C", batch(stored(h(1)), cleared()))  # holds nothing
    await index.publish(uuid.uuid4().hex, "D", batch(stored(*chain(8))))  # another model

    stats = await index.stats(model_key)
    assert (stats.backend, stats.workers, stats.digests) == (backend.name, 2, 6)
    assert stats.last_event_age_s is not None and 0.0 <= stats.last_event_age_s < 1.0

    await index.publish(model_key, "A", batch(removed(h(4))))
    await index.forget(model_key, "B")
    stats = await index.stats(model_key)
    assert (stats.workers, stats.digests) == (1, 3)


async def test_stats_age_of_the_last_publish_or_heartbeat(model_key: str) -> None:
    clock = FakeClock()
    index = MemoryIndex(30.0, clock=clock)
    await index.publish(model_key, "A", batch(stored(h(1))))
    clock.advance(7.5)
    assert (await index.stats(model_key)).last_event_age_s == 7.5

    await index.heartbeat(model_key, "B")  # a heartbeat counts, even one that finds no entry
    clock.advance(2.0)
    assert await index.stats(model_key) == IndexStats("memory", 1, 1, 2.0)

    clock.advance(30.0)  # every entry expired; the last event stays known
    assert await index.stats(model_key) == IndexStats("memory", 0, 0, 32.0)


async def test_redis_stats_age_follows_the_server_clock(
    redis_url: str, redis_key_prefix: str, model_key: str
) -> None:
    index = RedisIndex(redis_url, redis_key_prefix, worker_ttl_s=30.0)
    raw = redis.Redis.from_url(redis_url)
    try:
        await index.heartbeat(model_key, "A")
        seconds, micros = raw.time()
        raw.set(f"{redis_key_prefix}:{model_key}:last", seconds * 1000 + micros // 1000 - 7500)
        age = (await index.stats(model_key)).last_event_age_s
        assert age is not None and 7.5 <= age < 8.5
    finally:
        raw.close()
        await index.close()


async def test_redis_stats_visit_only_live_workers(
    redis_url: str, redis_key_prefix: str, model_key: str
) -> None:
    """Workers gone silent leave the registry at the next write, so stats stay O(workers)."""
    index = RedisIndex(redis_url, redis_key_prefix, worker_ttl_s=0.2)
    raw = redis.Redis.from_url(redis_url)
    registry = f"{redis_key_prefix}:{model_key}:workers"
    try:
        for worker in ("A", "B", "C"):
            await index.publish(model_key, worker, batch(stored(h(1))))
        assert raw.zcard(registry) == 3
        await asyncio.sleep(0.3)  # all three expire
        await index.publish(model_key, "D", batch(stored(h(1), h(2))))
        assert raw.zrange(registry, 0, -1) == [b"D"]
        stats = await index.stats(model_key)
        assert (stats.workers, stats.digests) == (1, 2)
    finally:
        raw.close()
        await index.close()


async def test_entries_are_scoped_by_model_key(index: DigestIndex, model_key: str) -> None:
    other_model = uuid.uuid4().hex
    await index.publish(model_key, "A", batch(stored(*chain(4))))
    await index.publish(other_model, "A", batch(stored(h(1))))

    await index.publish(other_model, "A", batch(cleared()))

    assert held_blocks(await index.match(model_key, chain(4), ["A"])) == {"A": 4}
    assert held_blocks(await index.match(other_model, chain(4), ["A"])) == {"A": 0}


_HELD = [h(1), h(2)]
_BAD_PAYLOADS = {
    "empty": b"",
    "not msgpack": b"\xc1",
    "truncated": batch(stored(h(1)))[:-5],
    "trailing data": batch(cleared()) + b"\x01",
    "not a list": msgpack.packb(7),
    "unknown kind": msgpack.packb([["evicted", [h(1)]]]),
    "row too long": msgpack.packb([["stored", [h(1)], "pool", 3]]),
    "unknown medium": msgpack.packb([["stored", [h(1)], "disk"]]),
    "medium not a string": msgpack.packb([["stored", [h(1)], 3]]),
    "row is a map": msgpack.packb([{"stored": [h(1)]}]),
    "digests not a list": msgpack.packb([["stored", h(1)]]),
    "digest not bytes": msgpack.packb([["stored", [17]]]),
    "digest too short": msgpack.packb([["stored", [b"short"]]]),
    "valid event then bad kind": msgpack.packb([["cleared", []], ["evicted", []]]),
    "valid event then bad digest": msgpack.packb([["cleared", []], ["stored", [b"x"]]]),
}


@pytest.mark.parametrize("payload", _BAD_PAYLOADS.values(), ids=_BAD_PAYLOADS.keys())
async def test_malformed_payload_raises_and_changes_nothing(
    index: DigestIndex, model_key: str, payload: bytes
) -> None:
    await index.publish(model_key, "A", batch(stored(*_HELD)))

    with pytest.raises(ValueError):
        await index.publish(model_key, "A", payload)

    assert held_blocks(await index.match(model_key, _HELD, ["A"])) == {"A": 2}


async def test_match_of_empty_chain_or_no_workers(index: DigestIndex, model_key: str) -> None:
    await index.publish(model_key, "A", batch(stored(h(1))))

    assert held_blocks(await index.match(model_key, [], ["A", "B"])) == {"A": 0, "B": 0}
    assert held_blocks(await index.match(model_key, chain(1), [])) == {}


async def test_many_workers_in_one_call(index: DigestIndex, model_key: str) -> None:
    full = chain(64)
    workers = [f"replica-{i}" for i in range(50)]
    for i, worker in enumerate(workers):  # worker i holds the first i blocks of the chain
        if i:
            await index.publish(model_key, worker, batch(stored(*full[:i])))

    result = await index.match(model_key, full, workers)

    assert held_blocks(result) == {worker: i for i, worker in enumerate(workers)}


async def test_large_batch(index: DigestIndex, model_key: str) -> None:
    big = [hashlib.sha256(i.to_bytes(4, "little")).digest() for i in range(5000)]
    await index.publish(model_key, "A", batch(stored(*big)))
    await index.publish(model_key, "A", batch(removed(*big[2500:])))

    assert held_blocks(await index.match(model_key, big, ["A"])) == {"A": 2500}


# ---------------------------------------------------------------------------------- Redis only


async def test_redis_publish_and_heartbeat_refresh_the_key_ttl(
    redis_url: str, redis_key_prefix: str, model_key: str
) -> None:
    index = RedisIndex(redis_url, redis_key_prefix, worker_ttl_s=30.0)
    raw = redis.Redis.from_url(redis_url)
    try:
        await index.publish(model_key, "A", batch(stored(h(1))))
        key = index.worker_key(model_key, "A")
        assert 29_000 < raw.pttl(key) <= 30_000

        raw.pexpire(key, 100)  # as if A had been silent for almost a whole TTL
        await index.heartbeat(model_key, "A")
        assert 29_000 < raw.pttl(key) <= 30_000
        assert raw.smembers(key) == {h(1)}  # binary digests stored as is
    finally:
        raw.close()
        await index.close()


_BAD_RAW_BATCHES = {
    # What the Lua script itself rejects, should a caller skip the Python-side validation.
    "bin format (unsupported by cmsgpack)": batch(stored(h(1))),
    "not msgpack": b"\xc1",
    "truncated": msgpack.packb([["stored", [h(1)], "pool"]], use_bin_type=False)[:-5],
    "two objects": msgpack.packb([], use_bin_type=False) * 2,
    "not a list": msgpack.packb(7),
    "unknown kind": msgpack.packb([["evicted", [h(1)], "pool"]], use_bin_type=False),
    "unknown medium": msgpack.packb([["stored", [h(1)], "disk"]], use_bin_type=False),
    "row without a medium": msgpack.packb([["stored", [h(1)]]], use_bin_type=False),
    "row is a map": msgpack.packb([{"stored": [h(1)]}], use_bin_type=False),
    "digest too short": msgpack.packb([["cleared", [], "pool"], ["stored", [b"x"], "tier"]],
                                      use_bin_type=False),
}


@pytest.mark.parametrize("raw_batch", _BAD_RAW_BATCHES.values(), ids=_BAD_RAW_BATCHES.keys())
async def test_redis_script_rejects_bad_batches_atomically(
    redis_url: str, redis_key_prefix: str, model_key: str, raw_batch: bytes
) -> None:
    index = RedisIndex(redis_url, redis_key_prefix)
    try:
        await index.publish(model_key, "A", batch(stored(*_HELD)))
        with pytest.raises(ValueError, match="BADBATCH"):
            await index._apply(model_key, "A", raw_batch)
        assert held_blocks(await index.match(model_key, _HELD, ["A"])) == {"A": 2}
    finally:
        await index.close()


async def test_redis_down_raises_index_unavailable_fast(model_key: str) -> None:
    # a port nobody listens on: connection refused at once
    url = f"redis://127.0.0.1:{free_port()}/0"
    index = RedisIndex(url, "nalar-test-down", timeout_s=0.5)
    started = time.monotonic()
    try:
        for call in (
            index.publish(model_key, "A", batch(stored(h(1)))),
            index.heartbeat(model_key, "A"),
            index.match(model_key, chain(2), ["A"]),
            index.forget(model_key, "A"),
        ):
            with pytest.raises(IndexUnavailableError):
                await call
    finally:
        await index.close()
    assert time.monotonic() - started < 5.0


@pytest.fixture
def private_redis() -> Iterator[PrivateRedis]:
    yield from private_redis_server()


async def test_redis_restarted_empty_is_reported_not_raised(
    private_redis: PrivateRedis, model_key: str
) -> None:
    """After Redis restarts, the client's pooled connection is dead: the call must reconnect
    and tell the worker its entry is gone (so it resyncs), not fail or pass silently."""
    index = RedisIndex(private_redis.url, "nalar-test-restart", worker_ttl_s=30.0)
    try:
        assert await index.publish(model_key, "A", batch(stored(h(1)))) is False
        assert await index.heartbeat(model_key, "A") is True

        private_redis.restart()
        assert await index.heartbeat(model_key, "A") is False

        private_redis.restart()
        assert await index.publish(model_key, "A", batch(stored(h(2)))) is False
        private_redis.restart()
        assert held_blocks(await index.match(model_key, chain(2), ["A"])) == {"A": 0}
    finally:
        await index.close()


def test_make_index_picks_the_backend(redis_url: str, redis_key_prefix: str) -> None:
    assert isinstance(make_index(None, "unused"), MemoryIndex)
    assert isinstance(make_index(redis_url, redis_key_prefix, 5.0), RedisIndex)
    with pytest.raises(ValueError):
        make_index(None, "unused", worker_ttl_s=0)


# ---------------------------------------------------------------------------------- Ray actor


async def test_actor_index_is_shared_and_survives_actor_death(
    ray_session: None, model_key: str
) -> None:
    import ray

    from router.index.actor import ActorIndex

    name = f"nalar-test-index-{uuid.uuid4().hex[:8]}"
    first = make_index(None, "unused", 30.0, actor_name=name)
    second = ActorIndex(name)  # another process of the cluster would do the same
    assert isinstance(first, ActorIndex)

    assert await first.publish(model_key, "A", batch(stored(*chain(4)))) is False
    await first.publish(model_key, "B", batch(stored(*chain(2))))
    with pytest.raises(ValueError):
        await first.publish(model_key, "A", b"\xc1")
    assert held_blocks(await second.match(model_key, chain(4), ["A", "B"])) == {"A": 4, "B": 2}
    assert await second.heartbeat(model_key, "A") is True
    assert await second.heartbeat(model_key, "C") is False
    stats = await second.stats(model_key)
    assert (stats.backend, stats.workers, stats.digests) == ("actor", 2, 6)
    assert stats.last_event_age_s is not None and 0.0 <= stats.last_event_age_s < 5.0

    await second.publish(model_key, "A", batch(cleared()))
    await second.forget(model_key, "B")
    assert held_blocks(await first.match(model_key, chain(4), ["A", "B"])) == {"A": 0, "B": 0}
    assert await first.entry_count() == 0

    ray.kill(ray.get_actor(name))  # e.g. its owner died: lossy by contract, then recreated
    deadline = time.monotonic() + 30.0
    while True:  # the kill is asynchronous: poll until a call sees the dead actor
        try:
            await first.heartbeat(model_key, "A")
        except IndexUnavailableError:
            break
        assert time.monotonic() < deadline, "killing the index actor went unnoticed"
        await asyncio.sleep(0.01)
    await first.publish(model_key, "A", batch(stored(h(1))))
    assert held_blocks(await first.match(model_key, chain(4), ["A"])) == {"A": 1}
    await first.close()
    await second.close()


def test_delete_key_prefix_deletes_only_that_prefix(redis_url: str) -> None:
    run = f"nalar-test-{uuid.uuid4().hex[:8]}"
    client = redis.Redis.from_url(redis_url)
    try:
        client.set(f"{run}-a:x", 1)
        client.set(f"{run}-a:y", 1)
        client.set(f"{run}-b:x", 1)
        assert delete_key_prefix(redis_url, f"{run}-a:") == 2
        assert client.exists(f"{run}-a:x", f"{run}-a:y") == 0
        assert client.get(f"{run}-b:x") == b"1"
        assert delete_key_prefix(redis_url, f"{run}-a:") == 0
    finally:
        assert delete_key_prefix(redis_url, run) == 1
        client.close()
