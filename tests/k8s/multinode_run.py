"""More than one node, on one machine: a Ray head and two worker nodes.

Run by ``tests/k8s/test_multinode.py`` in its own process (a pytest session already holds a Ray
instance): ``python tests/k8s/multinode_run.py --model-dir D --redis-url U --out F``.
It starts ``ray.cluster_utils.Cluster`` with a head (the Serve proxy and ingress, no worker:
the ingress is pinned there by the custom resource ``nalar_ingress``, as ``k8s/`` pins it) and
two worker nodes that each offer one unit of the custom resource ``nalar_target``, so each
node runs exactly one worker replica, deploys the application against a real Redis index,
then writes what it saw as JSON (the test asserts on it):

1. ``placement``: worker id → node id, for both workers, and ``ingress_node_id``;
2. ``routing``: for a prompt prefix first served on each worker, where a repeat with the same
   prefix went and how many of its tokens were cached;
3. ``index_workers``: the workers the Redis index credits with those prefixes;
4. ``removal``: streams running on both nodes while one node is removed: how each ended
   (completed or an explicit error), whether any hung, how long until the index stopped
   crediting the removed worker, and a request for the removed worker's prefix afterwards.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import uuid
from pathlib import Path

import httpx
import ray
from ray import serve
from ray.cluster_utils import Cluster
from ray.util.state import list_actors

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from cluster.app import APP_NAME, WORKER_DEPLOYMENT, build_app  # noqa: E402
from cluster.config import INDEX_ACTOR_NAMESPACE, ClusterConfig  # noqa: E402
from contract.description import WorkerDescription  # noqa: E402
from contract.identity import CacheNamespace, block_digests, tenant_from_api_key  # noqa: E402
from router.index.redis_index import RedisIndex, delete_key_prefix  # noqa: E402

NODE_MEMORY = 80 << 20
PREFIX_TOKENS = 128
STREAM_TOKENS = 360
"""Long enough that the streams outlast the node's removal: the tiny model decodes 48 tokens
before the removed node's processes die (CI saw all four streams complete)."""
REQUEST_TIMEOUT_S = 120


def start_nodes() -> tuple[Cluster, list]:
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "resources": {"nalar_ingress": 1}, "object_store_memory": NODE_MEMORY})
    nodes = [cluster.add_node(num_cpus=1, resources={"nalar_target": 1},
                              object_store_memory=NODE_MEMORY) for _ in range(2)]
    cluster.wait_for_nodes()
    return cluster, nodes


def deploy(config: ClusterConfig, address: str) -> None:
    ray.init(address=address, namespace=INDEX_ACTOR_NAMESPACE, log_to_driver=False)
    serve.start(proxy_location="HeadOnly",
                http_options={"host": config.host, "port": config.port})
    serve.run(build_app(config), name=APP_NAME, route_prefix="/")


async def describe_workers() -> dict[str, WorkerDescription]:
    """Every worker replica's ``describe()``, by asking through the handle until both answer."""
    handle = serve.get_deployment_handle(WORKER_DEPLOYMENT, APP_NAME)
    seen: dict[str, WorkerDescription] = {}
    for _ in range(50):
        answers = await asyncio.gather(*(handle.describe.remote() for _ in range(8)))
        for description in answers:
            seen[description.worker_id] = description
        if len(seen) == 2:
            break
    return seen


def ingress_node_id() -> str:
    """The node the live ingress replica runs on (Ray's state API)."""
    (actor,) = list_actors(filters=[("state", "=", "ALIVE"),
                                    ("class_name", "=", f"ServeReplica:{APP_NAME}:NalarIngress")])
    return actor.node_id


class Probe:
    """HTTP requests with a token-id prompt under one tenant key, and their index digests."""

    def __init__(self, base_url: str, config: ClusterConfig,
                 description: WorkerDescription):
        self.base_url = base_url
        self.identity = description.identity
        self.secret = bytes.fromhex(config.namespace_secret)
        self.index = RedisIndex(config.redis_url, config.key_prefix)

    def prompt(self, seed: int, length: int) -> list[int]:
        return [(seed * 7919 + i * 31) % 4000 + 100 for i in range(length)]

    def digests(self, key: str, ids: list[int]) -> list[bytes]:
        tenant = tenant_from_api_key(key, self.secret)
        root = self.identity.with_namespace(CacheNamespace(tenant)).root_digest
        return block_digests(root, ids, self.identity.block_size)

    async def credited(self, key: str, ids: list[int], workers: list[str]) -> dict[str, int]:
        held = await self.index.match(self.identity.model_key, self.digests(key, ids), workers)
        return {worker: prefix.blocks for worker, prefix in held.items()}

    async def complete(self, client: httpx.AsyncClient, key: str, ids: list[int],
                       max_tokens: int = 4) -> dict:
        body = {"prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        response = await client.post("/v1/completions", json=body, timeout=REQUEST_TIMEOUT_S,
                                     headers={"Authorization": f"Bearer {key}"})
        payload = response.json()
        usage = payload.get("usage") or {}
        details = usage.get("prompt_tokens_details") or {}
        return {"status": response.status_code,
                "worker": response.headers.get("x-nalar-worker"),
                "cached_tokens": details.get("cached_tokens", 0),
                "cached_tokens_by_source": details.get("cached_tokens_by_source"),
                "error": payload.get("error")}

    async def stream(self, client: httpx.AsyncClient, key: str, ids: list[int],
                     started: asyncio.Queue) -> dict:
        """One streamed completion: how it ended (``completed``, ``error_event``, ``http_error``,
        ``broken_stream``), its worker and tokens received. Its worker is put on ``started``
        at its first token."""
        body = {"prompt": ids, "max_tokens": STREAM_TOKENS, "temperature": 0,
                "ignore_eos": True, "stream": True}
        outcome = {"worker": None, "chunks": 0, "ended": "broken_stream", "detail": None}
        try:
            async with client.stream("POST", "/v1/completions", json=body,
                                     timeout=REQUEST_TIMEOUT_S,
                                     headers={"Authorization": f"Bearer {key}"}) as response:
                outcome["worker"] = response.headers.get("x-nalar-worker")
                if response.status_code != 200:
                    outcome.update(ended="http_error", detail=(await response.aread()).decode())
                    return outcome
                async for line in response.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[len("data: "):]
                    if data == "[DONE]":
                        outcome["ended"] = ("completed" if outcome["ended"] == "finished"
                                            else outcome["ended"])
                        break
                    event = json.loads(data)
                    if "error" in event:
                        outcome.update(ended="error_event", detail=event["error"])
                        continue
                    outcome["chunks"] += 1
                    if outcome["chunks"] == 1:
                        started.put_nowait(outcome["worker"])
                    if any(c.get("finish_reason") for c in event.get("choices", [])):
                        outcome["ended"] = "finished"
        except httpx.HTTPError as exc:
            outcome["detail"] = repr(exc)
        return outcome


async def wait_for(predicate, deadline_s: float, period_s: float = 0.1) -> float | None:
    """Seconds until ``await predicate()`` is true, or ``None`` at the deadline."""
    started = time.monotonic()
    while time.monotonic() - started < deadline_s:
        if await predicate():
            return time.monotonic() - started
        await asyncio.sleep(period_s)
    return None


async def observe(cluster: Cluster, nodes: list, config: ClusterConfig) -> dict:
    workers = await describe_workers()
    placement = {w: d.node_id for w, d in workers.items()}
    probe = Probe(f"http://{config.host}:{config.port}", config, next(iter(workers.values())))
    worker_ids = sorted(workers)
    result: dict = {"placement": placement,
                    "head_node_id": cluster.head_node.node_id,
                    "ingress_node_id": ingress_node_id(),
                    "worker_node_ids": [n.node_id for n in nodes]}
    async with httpx.AsyncClient(base_url=probe.base_url) as client:
        holders = await place_prefixes(client, probe, worker_ids)
        result["routing"] = await repeat_prefixes(client, probe, holders)
        result["transfer"] = await fetch_from_a_busy_holder(client, probe, holders)
        result["index_workers"] = sorted({
            w for key, (ids, _) in holders.items()
            for w, n in (await probe.credited(key, ids, worker_ids)).items() if n > 0})
        result["removal"] = await remove_a_node(cluster, nodes, client, probe, holders,
                                                placement, config)
    await probe.index.close()
    return result


async def place_prefixes(client, probe: Probe, worker_ids: list[str]) -> dict:
    """Distinct prefixes until each worker has served (and the index credits) at least one:
    ``{key: (prompt ids, holder)}``."""
    holders: dict[str, tuple[list[int], str]] = {}
    blocks = PREFIX_TOKENS // probe.identity.block_size
    for seed in range(1, 40):
        key = f"tenant-{seed}"
        ids = probe.prompt(seed, PREFIX_TOKENS)
        answer = await probe.complete(client, key, ids)
        holder = answer["worker"]

        async def credited(key=key, ids=ids, holder=holder) -> bool:
            return (await probe.credited(key, ids, [holder]))[holder] >= blocks

        if answer["status"] == 200 and await wait_for(credited, 30):
            holders[key] = (ids, holder)
        if {h for _, h in holders.values()} >= set(worker_ids):
            break
    return holders


async def repeat_prefixes(client, probe: Probe, holders: dict) -> list[dict]:
    """The same prefix with a new suffix, once per prefix: where it went, what was cached."""
    repeats = []
    for key, (ids, holder) in holders.items():
        answer = await probe.complete(client, key, ids + [7, 8, 9, 10])
        repeats.append({"key": key, "holder": holder, **answer})
    return repeats


async def fetch_from_a_busy_holder(client, probe: Probe, holders: dict) -> dict:
    """A long stream on a held prefix keeps its holder busy; the same prefix sent meanwhile
    goes to the worker on the other node, which fetches the prefix across nodes."""
    key, (ids, holder) = next(iter(holders.items()))
    started: asyncio.Queue = asyncio.Queue()
    busy = asyncio.create_task(probe.stream(client, key, ids + [20], started))
    await asyncio.wait_for(started.get(), REQUEST_TIMEOUT_S)
    answer = await probe.complete(client, key, ids + [21, 22, 23, 24])
    await busy
    return {"holder": holder, **answer}


async def remove_a_node(cluster, nodes, client, probe: Probe, holders: dict,
                        placement: dict, config: ClusterConfig) -> dict:
    """Streams on both workers; remove the node of the first worker whose stream delivers a
    token (chosen then, not before: the router may send every stream to one worker, and a
    removed node with no stream in flight tests nothing)."""
    started: asyncio.Queue = asyncio.Queue()
    tasks = [asyncio.create_task(probe.stream(client, key, ids + [11, 12], started))
             for key, (ids, _) in holders.items() for _ in range(2)]
    victim_worker = await asyncio.wait_for(started.get(), REQUEST_TIMEOUT_S)
    victim_node = next(n for n in nodes if n.node_id == placement[victim_worker])
    cluster.remove_node(victim_node, allow_graceful=False)
    removed_at = time.monotonic()
    done, pending = await asyncio.wait(tasks, timeout=REQUEST_TIMEOUT_S)
    for task in pending:
        task.cancel()
    victim_keys = [k for k, (_, h) in holders.items() if h == victim_worker]

    async def uncredited() -> bool:
        for key in victim_keys:
            ids = holders[key][0]
            if (await probe.credited(key, ids, [victim_worker]))[victim_worker] > 0:
                return False
        return True

    uncredited_after = await wait_for(uncredited, 3 * config.worker_ttl_s)
    after = await probe.complete(client, victim_keys[0], holders[victim_keys[0]][0] + [13])
    return {"victim_worker": victim_worker, "victim_node": victim_node.node_id,
            "streams": [t.result() for t in done], "hung": len(pending),
            "uncredited_after_s": (None if uncredited_after is None
                                   else round(time.monotonic() - removed_at, 2)),
            "request_after": after}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--redis-url", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    config = ClusterConfig(model=args.model_dir, dtype="float32", num_workers=2,
                           redis_url=args.redis_url,
                           key_prefix=f"nalar-multinode-{uuid.uuid4().hex[:8]}",
                           port=args.port, kv_cache_mib=16, kv_tier_mib=8, worker_threads=1,
                           worker_resources={"nalar_target": 1},
                           ingress_resources={"nalar_ingress": 1}, speculative="off",
                           routing_stats_period_s=0.2, worker_ttl_s=6)
    cluster, nodes = start_nodes()
    try:
        deploy(config, cluster.address)
        result = asyncio.run(observe(cluster, nodes, config))
        Path(args.out).write_text(json.dumps(result, indent=2))
    finally:  # no serve.shutdown(): its graceful stop took 9 s, and the nodes die anyway
        ray.shutdown()
        cluster.shutdown()
        delete_key_prefix(config.redis_url, config.key_prefix)
    return 0


if __name__ == "__main__":
    sys.exit(main())
