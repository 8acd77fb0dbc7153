"""Request and replica lifecycles on the shared cluster: a client that disconnects frees its
blocks; a dead worker is never credited again (case R2, with Ray Serve's replacement)."""

from __future__ import annotations

import asyncio
import time

import httpx
import ray
from ray import serve

from cluster.app import APP_NAME, WORKER_DEPLOYMENT
from contract.identity import CacheNamespace, block_digests
from router.index.redis_index import RedisIndex

DEADLINE_S = 60.0


def workers_handle():
    return serve.get_deployment_handle(WORKER_DEPLOYMENT, APP_NAME)


async def stats_by_worker(rounds: int = 8) -> dict[str, dict]:
    """Engine stats of every replica: the router spreads these calls (least recently chosen)."""
    handle = workers_handle()
    replies = await asyncio.gather(*(handle.engine_stats.remote() for _ in range(rounds)))
    return {reply["worker_id"]: reply for reply in replies}


async def test_client_disconnect_cancels_and_frees_blocks(cluster):
    body = {"prompt": "Count from one to one thousand: one, two,", "max_tokens": 400,
            "ignore_eos": True, "temperature": 0, "stream": True}
    # Decode counters are cumulative per worker (earlier tests decoded there too): this
    # request's tokens are the difference.
    every_replica = await asyncio.to_thread(
        lambda: workers_handle().broadcast("engine_stats").results(timeout_s=30))
    decoded_before = {s["worker_id"]: s["decode_tokens"] for s in every_replica}
    async with (httpx.AsyncClient(base_url=cluster.base_url) as client,
                client.stream("POST", "/v1/completions", json=body, timeout=60) as response):
        assert response.status_code == 200
        worker = response.headers["x-nalar-worker"]
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                break  # one token arrived; hang up mid-generation
    deadline = time.monotonic() + DEADLINE_S
    while True:
        stats = (await stats_by_worker()).get(worker)
        if stats and stats["blocks_in_use"] == 0 or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.1)
    assert stats is not None and stats["blocks_in_use"] == 0
    assert stats["decode_tokens"] - decoded_before[worker] < 400  # stopped long before max_tokens
    assert stats["blocks_free"] + stats["blocks_evictable"] == stats["blocks_total"]


async def test_dead_worker_is_never_credited(cluster):
    identity = (await workers_handle().describe.remote()).identity
    prompt = list(range(1000, 1000 + 3 * identity.block_size + 5))
    digests = block_digests(identity.with_namespace(CacheNamespace()).root_digest, prompt,
                            identity.block_size)
    index = RedisIndex(cluster.config.redis_url, cluster.config.key_prefix)
    async with httpx.AsyncClient(base_url=cluster.base_url) as client:
        response = await client.post("/v1/completions", timeout=60,
                                      json={"prompt": prompt, "max_tokens": 2})
    dead = response.headers["x-nalar-worker"]
    assert await _poll(lambda held: held == 3, index, identity.model_key, digests, dead)

    actor_name = f"SERVE_REPLICA::{APP_NAME}#{WORKER_DEPLOYMENT}#{dead}"
    ray.kill(ray.get_actor(actor_name, namespace="serve"), no_restart=True)
    assert await _poll(lambda held: held == 0, index, identity.model_key, digests, dead)

    live = await _wait_for_replacement(dead)
    assert dead not in live and len(live) == cluster.config.num_workers
    credited = await index.match(identity.model_key, digests, [dead, *live])
    assert credited[dead].blocks == 0
    await index.close()


async def _poll(done, index: RedisIndex, model_key: str, digests: list[bytes],
                worker: str) -> bool:
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        if done((await index.match(model_key, digests, [worker]))[worker].blocks):
            return True
        await asyncio.sleep(0.1)
    return False


async def _wait_for_replacement(dead: str) -> set[str]:
    """Worker ids answering once Serve has replaced the dead replica."""
    deadline = time.monotonic() + DEADLINE_S * 2
    live: set[str] = set()
    while time.monotonic() < deadline:
        status = serve.status().applications[APP_NAME].deployments[WORKER_DEPLOYMENT]
        if status.status == "HEALTHY":
            live = set(await stats_by_worker())
            if dead not in live and len(live) >= 2:
                return live
        await asyncio.sleep(0.5)
    return live
