"""Request lifecycles on the shared cluster: a client that disconnects frees its blocks. (A dead
worker never credited again, case R2, is asserted by the chaos test of a holder killed
mid-transfer, whose application restarts a worker anyway.)"""

from __future__ import annotations

import asyncio
import time

import httpx
from ray import serve

from cluster.app import APP_NAME, WORKER_DEPLOYMENT

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


def test_the_processes_ray_starts_carry_the_serve_settings(ray_session):
    """``init_ray`` puts ``SERVE_ENV`` in the environment of every process the local Ray
    starts (replicas read it as they import Serve): without it the workers' gRPC streams to
    the ingress refuse a chunk over 4 MiB."""
    import os

    import ray

    from cluster.runtime import SERVE_ENV

    @ray.remote(num_cpus=0)
    def environment(names):
        return {name: os.environ.get(name) for name in names}

    assert ray.get(environment.remote(list(SERVE_ENV))) == {
        "RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH": str(2**31 - 1)}


def test_the_embedded_index_outlives_the_workers_on_stop(monkeypatch):
    """The workers remove their entries from the embedded index as Serve stops them: the
    index's handle is dropped only after (dropped first, Ray collected the index and each
    worker logged that it could not reach it)."""
    from cluster import runtime

    held_during_shutdown = []
    monkeypatch.setattr(runtime.ray, "is_initialized", lambda: True)
    monkeypatch.setattr(runtime.ray, "shutdown", lambda: None)
    monkeypatch.setattr(runtime.serve, "shutdown",
                        lambda: held_during_shutdown.append(dict(runtime._OWNED_INDEXES)))
    monkeypatch.setattr(runtime, "_OWNED_INDEXES", {"index": object()})
    runtime.stop_cluster()
    assert [list(held) for held in held_during_shutdown] == [["index"]]
    assert runtime._OWNED_INDEXES == {}
