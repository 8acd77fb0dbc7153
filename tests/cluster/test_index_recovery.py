"""The index heals after Redis restarts empty, end to end.

A one-worker application on the session's Ray cluster uses a private ``redis-server`` (no
persistence, on a free port; never the shared one). Redis is killed while the worker has nothing
to publish (every request hits cached blocks), so no failed publish tells it to resync; requests
keep flowing on load-only routing with one warning from the router; Redis comes back empty on
the same port, and the worker's next heartbeat finds no entry and resyncs, so its blocks are
credited again. Then the entries vanish while Redis stays up (a flush of the private server):
no call fails at all, and only the heartbeat's report brings them back. Deleting the
application then removes the worker's entries at once (clean shutdown), not after a TTL.

Requests go through a worker handle, so the prefix-aware router runs in this process and its
log lines reach ``caplog``.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Iterator

import pytest
import redis
from helpers import PrivateRedis, free_port, private_redis_server
from ray import serve

from cluster.app import WORKER_DEPLOYMENT, build_app
from cluster.config import ClusterConfig
from contract.identity import CacheIdentity, CacheNamespace, block_digests, prompt_digests
from contract.request import GenerationRequest, SamplingParams
from router.index.redis_index import RedisIndex
from router.routing.index_lookup import INDEX_RETRY_S

APP = "nalar-index-recovery-test"
PREFIX_BLOCKS = 8
TTL_S = 15.0  # workers send a heartbeat every 5 s
HEAL_S = 2 * TTL_S / 3 + 5.0  # two heartbeats (a failed one, then the resync) and slack
ROUTER_LOGGER = "router"  # the router's modules log under it


@pytest.fixture(scope="module")
def private_redis() -> Iterator[PrivateRedis]:
    yield from private_redis_server()


@pytest.fixture(scope="module")
def recovery_config(ray_session, private_redis: PrivateRedis,
                    tiny_model_dir) -> Iterator[ClusterConfig]:
    """One tiny fp32 worker against the private Redis. Serve's HTTP proxy is not needed; if
    Serve is not running yet it starts on a free port (the session ``cluster`` fixture, which
    sorts before this file, otherwise chose it)."""
    serve.start(http_options={"host": "127.0.0.1", "port": free_port()})
    config = ClusterConfig(model=str(tiny_model_dir), num_workers=1, redis_url=private_redis.url,
                           key_prefix=f"nalar-test-{uuid.uuid4().hex[:8]}", dtype="float32",
                           kv_cache_mib=16, worker_cpus=0.25, worker_threads=1,
                           routing_stats_period_s=0.2, worker_ttl_s=TTL_S, speculative="off")
    serve.run(build_app(config), name=APP, route_prefix=None)
    yield config
    if APP in serve.status().applications:  # the test deletes it itself when it gets there
        serve.delete(APP)


async def generate(handle, identity: CacheIdentity, prompt: list[int]) -> tuple[str, int]:
    """Worker id and cached tokens of one request placed by the prefix-aware router."""
    request = GenerationRequest(f"recovery-{uuid.uuid4().hex[:8]}", prompt,
                                SamplingParams(temperature=0, max_tokens=2),
                                prompt_digests=prompt_digests(identity, CacheNamespace(), prompt))
    worker, cached = "", -1
    async for chunk in handle.options(stream=True).generate.remote(request):
        worker, cached = chunk.worker_id, chunk.cached_tokens
    return worker, cached


async def wait_for(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not await condition():
        assert time.monotonic() < deadline, f"{what} within {timeout_s} s"
        await asyncio.sleep(0.1)


async def test_index_heals_after_redis_restarts_empty(
    recovery_config: ClusterConfig, private_redis: PrivateRedis, caplog
) -> None:
    handle = serve.get_deployment_handle(WORKER_DEPLOYMENT, APP)
    identity = (await handle.describe.remote()).identity
    block = identity.block_size
    shared = list(range(3000, 3000 + PREFIX_BLOCKS * block))
    digests = block_digests(identity.with_namespace(CacheNamespace()).root_digest, shared, block)

    def prompt(i: int) -> list[int]:
        # A tail of 3 tokens (+1 generated) never fills a block: no event after the first.
        return shared + [7, 8, 9 + i]

    index = RedisIndex(private_redis.url, recovery_config.key_prefix, TTL_S)
    try:
        worker, cold = await generate(handle, identity, prompt(0))

        async def credited() -> bool:
            held = await index.match(identity.model_key, digests, [worker])
            return held[worker].blocks == len(digests)

        await wait_for(credited, 30.0, "the worker's blocks reached the index")
        assert cold == 0

        # 1. Redis down: requests flow on load only, with one router warning for the outage.
        private_redis.kill()
        with caplog.at_level(logging.INFO, logger=ROUTER_LOGGER):
            during = [await generate(handle, identity, prompt(i)) for i in range(1, 6)]
            private_redis.start()  # on the same port, empty (no persistence)
            # 2. The worker's next heartbeat (or, had one failed in the outage, its resync)
            # puts its blocks back; then the router credits them again.
            await wait_for(credited, HEAL_S, "the index held the worker's blocks again")
            # The router asks the index again only this long after its last failed lookup;
            # a heartbeat that heals the index sooner would leave the next request unasked.
            await asyncio.sleep(INDEX_RETRY_S)
            after = await generate(handle, identity, prompt(6))
        assert during == [(worker, PREFIX_BLOCKS * block)] * 5  # served, from the engine's cache
        router_lines = [r for r in caplog.records if r.name.startswith(f"{ROUTER_LOGGER}.")]
        warnings = [r.getMessage() for r in router_lines if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "load only" in warnings[0], warnings  # one line, no flood
        assert any("answering again" in r.getMessage() for r in router_lines)
        assert after == (worker, PREFIX_BLOCKS * block)

        # 3. The entry vanishes while Redis stays up (expired, evicted, flushed): nothing
        # fails, so only a heartbeat that finds no entry can bring the blocks back.
        client = redis.Redis.from_url(private_redis.url)
        client.flushall()  # the private server only, never the shared one
        client.close()
        await wait_for(credited, HEAL_S, "a heartbeat found no entry and resynced")
        stats = await index.stats(identity.model_key)
        assert (stats.backend, stats.workers, stats.digests) == ("redis", 1, PREFIX_BLOCKS)
        assert stats.last_event_age_s is not None and stats.last_event_age_s < HEAL_S

        # 4. A clean shutdown: the worker removes its own entries, without waiting for a TTL.
        serve.delete(APP)
        assert (await index.match(identity.model_key, digests, [worker]))[worker].blocks == 0
        assert (await index.stats(identity.model_key)).workers == 0
    finally:
        await index.close()
