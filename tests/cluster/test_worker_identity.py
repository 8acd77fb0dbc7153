"""The ingress's copy of the workers' cache identity follows a redeploy with other weights.

Before the refresh, the ingress hashed every prompt under the identity it read at start-up; after
the workers were redeployed with other weights their index entries live under another model key,
so no request digest matched anything and routing quietly became load-only. No Ray cluster: the
worker handle's ``describe`` is a fake, the index is the in-memory one.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from helpers import held_blocks

import contract.identity
from cluster.ingress_deployment import NalarIngress
from cluster.worker_identity import WorkerIdentity
from contract.description import WorkerDescription
from contract.identity import CacheIdentity, CacheNamespace, PromptDigests, block_digests
from contract.kv_events import KVEvent, encode_events
from contract.request import GenerationChunk, GenerationRequest
from router.index import MemoryIndex
from router.routing.replica_keys import ReplicaModelKeys

BLOCK = 16
OLD = CacheIdentity(model_digest="weights-v1", numerics="cpu-fp32", block_size=BLOCK)
NEW = CacheIdentity(model_digest="weights-v2", numerics="cpu-fp32", block_size=BLOCK)
TENANT = CacheNamespace(tenant="t1")
PROMPT = list(range(100, 100 + 4 * BLOCK + 3))  # four full blocks and a partial one
DEPLOYMENT = ("nalar", "NalarWorker")


def description(identity: CacheIdentity, max_model_len: int = 2048) -> WorkerDescription:
    return WorkerDescription("w", "node", identity, "smol", "/models/smol", max_model_len,
                             49152, 64, 1.0)


def request_under(identity: CacheIdentity) -> GenerationRequest:
    root = identity.with_namespace(TENANT).root_digest
    return GenerationRequest("r1", list(PROMPT), namespace=TENANT, prompt_digests=PromptDigests(
        identity.model_key, block_digests(root, PROMPT, BLOCK)))


class FakeWorkers:
    """``describe`` as the redeployed workers answer it, counting the calls."""

    def __init__(self, answer: WorkerDescription):
        self.answer = answer
        self.calls = 0

    async def describe(self) -> WorkerDescription:
        self.calls += 1
        await asyncio.sleep(0.01)  # a remote call: concurrent requests overlap it
        return self.answer


def watch_over(workers: FakeWorkers, keys: ReplicaModelKeys, **kwargs) -> WorkerIdentity:
    return WorkerIdentity(workers.describe, description(OLD), lambda: keys.keys(DEPLOYMENT),
                          **kwargs)


async def test_unchanged_workers_leave_the_request_alone(monkeypatch):
    keys = ReplicaModelKeys()
    keys.update(DEPLOYMENT, [OLD.model_key])
    workers = FakeWorkers(description(NEW))
    watch = watch_over(workers, keys)
    request = request_under(OLD)
    hashed = []
    monkeypatch.setattr(contract.identity, "_hash_fields", lambda fields: hashed.append(fields))
    monkeypatch.setattr(contract.identity, "block_digest", lambda *args: hashed.append(args))
    assert await watch.current(request) is request
    assert hashed == []  # current digests are recognised by their model key, unhashed
    assert watch.identity == OLD and watch.max_model_len == 2048
    assert workers.calls == 0


async def test_redeployed_workers_refresh_identity_and_rehash_once():
    keys = ReplicaModelKeys()
    keys.update(DEPLOYMENT, [OLD.model_key])
    workers = FakeWorkers(description(NEW, max_model_len=4096))
    watch = watch_over(workers, keys)
    keys.update(DEPLOYMENT, [NEW.model_key])  # the router saw the redeployed replicas
    requests = [request_under(OLD) for _ in range(5)]
    refreshed = await asyncio.gather(*(watch.current(r) for r in requests))
    assert workers.calls == 1  # one describe for the burst, not one per request
    assert watch.identity == NEW and watch.max_model_len == 4096
    expected = block_digests(NEW.with_namespace(TENANT).root_digest, PROMPT, BLOCK)
    assert len(expected) == 4
    assert all(r.prompt_digests.digests == expected for r in refreshed)
    assert all(r.token_ids == PROMPT and r.namespace == TENANT for r in refreshed)


async def test_refresh_is_rate_limited_while_describe_lags():
    # Mid-rollout a describe may still reach an old replica: ask again only after the interval.
    keys = ReplicaModelKeys()
    keys.update(DEPLOYMENT, [NEW.model_key])
    workers = FakeWorkers(description(OLD))
    clock = [100.0]
    watch = watch_over(workers, keys, min_interval_s=5.0, clock=lambda: clock[0])
    await watch.current(request_under(OLD))
    await watch.current(request_under(OLD))
    assert workers.calls == 1
    workers.answer = description(NEW)
    clock[0] += 6.0
    await watch.current(request_under(OLD))
    assert workers.calls == 2 and watch.identity == NEW


async def test_no_known_replica_keys_is_not_staleness():
    workers = FakeWorkers(description(NEW))
    watch = watch_over(workers, ReplicaModelKeys())
    request = request_under(OLD)
    assert await watch.current(request) is request
    assert workers.calls == 0


async def test_refreshed_digests_find_the_redeployed_workers_blocks():
    # The redeployed worker "b" holds the prompt's first three blocks under the new key.
    index = MemoryIndex(worker_ttl_s=30.0)
    new_digests = request_under(NEW).prompt_digests.digests
    await index.publish(NEW.model_key, "b", encode_events([KVEvent("stored", new_digests[:3])]))
    stale = request_under(OLD)
    stale_digests = stale.prompt_digests.digests
    assert held_blocks(await index.match(NEW.model_key, stale_digests, ["a", "b"])) == (
        {"a": 0, "b": 0})
    keys = ReplicaModelKeys()
    keys.update(DEPLOYMENT, [NEW.model_key])
    watch = watch_over(FakeWorkers(description(NEW)), keys)
    fresh = await watch.current(stale)
    fresh_digests = fresh.prompt_digests.digests
    assert held_blocks(await index.match(NEW.model_key, fresh_digests, ["a", "b"])) == (
        {"a": 0, "b": 3})


async def test_failed_describe_keeps_the_identity_and_the_request(caplog):
    keys = ReplicaModelKeys()
    keys.update(DEPLOYMENT, [NEW.model_key])

    async def unreachable() -> WorkerDescription:
        raise ConnectionError("no replica answered")

    watch = WorkerIdentity(unreachable, description(OLD), lambda: keys.keys(DEPLOYMENT))
    request = request_under(OLD)
    assert await watch.current(request) is request
    assert watch.identity == OLD
    assert "no replica answered" in caplog.text


class _Stream:
    """A worker stream of one last chunk."""

    def __init__(self):
        self._chunks = [GenerationChunk("r1", [7], "x", "stop", len(PROMPT), 0, 1, "b")]

    def __aiter__(self):
        return self

    async def __anext__(self) -> GenerationChunk:
        if not self._chunks:
            raise StopAsyncIteration
        return self._chunks.pop()


async def test_ingress_sends_the_workers_the_rehashed_request():
    sent: list[GenerationRequest] = []

    def remote(request):
        sent.append(request)
        return _Stream()

    keys = ReplicaModelKeys()
    keys.update(DEPLOYMENT, [NEW.model_key])
    ingress = SimpleNamespace(
        workers=SimpleNamespace(options=lambda **_: SimpleNamespace(
            generate=SimpleNamespace(remote=remote))),
        dashboard=SimpleNamespace(timer=lambda: SimpleNamespace(chunk=lambda n: None)),
        worker_identity=watch_over(FakeWorkers(description(NEW)), keys))
    chunks = [c async for c in NalarIngress.generate(ingress, request_under(OLD))]
    assert [c.finish_reason for c in chunks] == ["stop"]
    assert sent[0].prompt_digests.digests == request_under(NEW).prompt_digests.digests
