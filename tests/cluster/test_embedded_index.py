"""The default path of ``nalar serve``: no Redis, the embedded index in one shared Ray actor.

The side application (``side_app`` in conftest.py: two tiny workers on the embedded index),
driven through a worker handle (the prefix-aware router runs inside it) rather than HTTP.
"""

from __future__ import annotations

import asyncio
import gc
import time

import ray
from ray import serve

from cluster.app import WORKER_DEPLOYMENT
from cluster.config import INDEX_ACTOR_NAMESPACE, ClusterConfig
from cluster.runtime import start_index_actor
from contract.identity import CacheNamespace, block_digests, prompt_digests
from contract.request import GenerationRequest, SamplingParams
from router.index import ActorIndex

PROMPT = list(range(2000, 2000 + 16 * 12 + 3))


async def generate(handle, request_id: str, prompt: list[int], identity) -> tuple[str, int]:
    """Worker id and cached tokens of one request routed by the prefix-aware router, with
    the routing digests the ingress would compute."""
    request = GenerationRequest(request_id, prompt, SamplingParams(temperature=0, max_tokens=2),
                                prompt_digests=prompt_digests(identity, CacheNamespace(), prompt))
    worker, cached = "", -1
    async for chunk in handle.options(stream=True).generate.remote(request):
        worker, cached = chunk.worker_id, chunk.cached_tokens
    return worker, cached


async def test_embedded_index_routes_a_shared_prefix_to_its_holder(side_app):
    handle = serve.get_deployment_handle(WORKER_DEPLOYMENT, side_app.name)
    identity = (await handle.describe.remote()).identity
    digests = block_digests(identity.with_namespace(CacheNamespace()).root_digest, PROMPT,
                            identity.block_size)
    index = ActorIndex(side_app.config.index_actor_name, namespace=INDEX_ACTOR_NAMESPACE)

    holder, cold_cached = await generate(handle, "first", PROMPT, identity)
    deadline = time.monotonic() + 30
    while (await index.match(identity.model_key, digests, [holder]))[holder].blocks < len(digests):
        assert time.monotonic() < deadline, "the holder's blocks never reached the index"
        await asyncio.sleep(0.05)

    follow_ups = [await generate(handle, f"again-{i}", PROMPT[:-3] + [7, 8, 9, i],
                                   identity)
                  for i in range(4)]
    assert cold_cached == 0
    assert all(worker == holder for worker, _ in follow_ups)
    assert all(cached == len(digests) * identity.block_size for _, cached in follow_ups)


def test_the_driver_keeps_the_index_actor_it_starts(ray_session):
    """``start_index_actor`` owns the actor and keeps a handle to it. Without the handle, Ray
    collected the actor within half a second, the first worker to call created it anew as
    its owner, and killing that worker (a user's trial of ``nalar serve``) took the index
    with it. Still there 1.5 s on, the same actor."""
    config = ClusterConfig(redis_url=None, index_actor_name="nalar-embedded-test-kept-index")
    start_index_actor(config)
    gc.collect()
    first = ray.get_actor(config.index_actor_name, namespace=INDEX_ACTOR_NAMESPACE)
    time.sleep(1.5)  # what must not happen (a collection) takes well under that
    again = ray.get_actor(config.index_actor_name, namespace=INDEX_ACTOR_NAMESPACE)
    assert again._actor_id == first._actor_id
