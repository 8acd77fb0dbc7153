"""Tests of the prefix-aware request router: the Ray-free scoring core and the Ray glue.

No Ray cluster: the router is constructed directly and driven with fake replicas (a real
``ReplicaID``, ``routing_stats``) and real ``PendingRequest`` objects; the digest index is a fake.
Cases R4, R5, R6 and R7 are from ``shared/cases/routing.md``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import random
import sys
import time
import types
from collections import Counter

import pytest
from helpers import held_blocks
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, RequestMetadata
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter

from contract.identity import PromptDigests
from contract.kv_transfer import KVExportRequest
from contract.request import GenerationRequest, SamplingParams
from router.index import HeldPrefix
from router.routing.finished_requests import FINISHED_REQUESTS
from router.routing.ray_router import LOOKUP_REUSE_S, PrefixAwareRequestRouter
from router.routing.replica_keys import REPLICA_MODEL_KEYS
from router.routing.request_input import routing_input
from router.routing.telemetry import RoutingTelemetry

BLOCK = 16
DEPLOYMENT = DeploymentID(name="worker", app_name="nalar")


# ---- fakes and builders ---------------------------------------------------------------------


class FakeIndex:
    """The digest index interface, in memory: ``held`` = leading blocks each worker holds."""

    def __init__(self, held: dict[str, int] | None = None):
        self.held = dict(held or {})
        self.tier: dict[str, int] = {}  # of the held blocks, those only in a second tier
        self.fail: BaseException | None = None
        self.hang = False
        self.calls = 0
        self.asked_keys: list[str] = []
        self.forgotten: list[tuple[str, str]] = []

    async def match(self, model_key, digests, worker_ids):
        self.calls += 1
        self.asked_keys.append(model_key)
        if self.hang:
            await asyncio.Event().wait()
        if self.fail is not None:
            raise self.fail
        held = {w: min(self.held.get(w, 0), len(digests)) for w in worker_ids}
        return {w: HeldPrefix(n, min(self.tier.get(w, 0), n)) for w, n in held.items()}

    async def forget(self, model_key, worker_id):
        self.forgotten.append((model_key, worker_id))
        self.held.pop(worker_id, None)


class FakeReplica:
    """The part of ``RunningReplica`` the router reads."""

    def __init__(self, unique_id: str, stats: dict | None = None, metadata: dict | None = None):
        self.replica_id = ReplicaID(unique_id=unique_id, deployment_id=DEPLOYMENT)
        self.routing_stats = stats or {}
        self.replica_metadata = metadata or {}
        self.max_ongoing_requests = 64


class Clock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def digests(n_blocks: int, salt: str = "") -> list[bytes]:
    return [hashlib.sha256(f"{salt}/{i}".encode()).digest() for i in range(n_blocks)]


def gen_request(prompt_len: int, n_blocks: int | None = None, max_tokens: int = 16, salt=""):
    n = prompt_len // BLOCK if n_blocks is None else n_blocks
    return GenerationRequest(
        request_id=f"r-{salt}",
        token_ids=list(range(prompt_len)),
        sampling=SamplingParams(max_tokens=max_tokens),
        prompt_digests=PromptDigests("m", digests(n, salt)),
    )


_ids = iter(range(10**9))


def pending(*args, **kwargs) -> PendingRequest:
    n = next(_ids)
    return PendingRequest(
        args=list(args),
        kwargs=kwargs,
        metadata=RequestMetadata(request_id=f"req-{n}", internal_request_id=f"int-{n}"),
    )


def make_router(index, clock=None, seed=0, model_key="m", **kwargs) -> PrefixAwareRequestRouter:
    class _Router(PrefixAwareRequestRouter):
        def _build_index(self, **_):
            return index

    router = _Router(
        deployment_id=DEPLOYMENT,
        handle_source=DeploymentHandleSource.UNKNOWN,
        get_curr_time_s=clock or Clock(),
    )
    kwargs.setdefault("telemetry_sink", RoutingTelemetry())  # the process-wide one stays untouched
    router.initialize_state(block_size=BLOCK, seed=seed, model_key=model_key, **kwargs)
    return router


async def route(router, replicas, pr) -> str:
    """One routing decision as Ray makes it when the first choice accepts; returns its id."""
    tiers = await router.choose_replicas(replicas, pr)
    chosen = tiers[0][0]
    dispatch(router, pr, chosen)
    await asyncio.sleep(0)  # the future's done callbacks run on the next loop iteration
    router.on_request_routed(pr, chosen.replica_id, None)
    return chosen.replica_id.unique_id


def dispatch(router, pr, replica):
    """Ray resolves the pending request's future with the replica it picked."""
    if isinstance(pr, PendingRequest):
        pr.future.set_result(replica)


def complete(router, pr, worker_id):
    replica_id = ReplicaID(unique_id=worker_id, deployment_id=DEPLOYMENT)
    router.on_request_completed(replica_id, pr.metadata.internal_request_id)


def assert_spread(counts: Counter, workers: list[str]):
    shares = [counts.get(w, 0) for w in workers]
    assert min(shares) > 0, shares
    assert max(shares) <= 1.5 * min(shares), shares


# ---- reading a request ----------------------------------------------------------------------


async def test_routing_input_reads_generation_request():
    # PendingRequest makes a future: it needs a running loop whatever ran before.
    plan = routing_input(pending(gen_request(40, max_tokens=7)))
    assert plan is not None
    assert (plan.prompt_len, len(plan.digests), plan.decode_tokens) == (40, 2, 7)


@pytest.mark.parametrize(
    "pr",
    [
        None,
        types.SimpleNamespace(),
        types.SimpleNamespace(args=None),
        types.SimpleNamespace(args=[]),
        types.SimpleNamespace(args=["not a request"]),
        types.SimpleNamespace(args=[{"token_ids": [1, 2]}]),
        types.SimpleNamespace(args=[types.SimpleNamespace(token_ids=[1, 2])]),
        types.SimpleNamespace(args=[types.SimpleNamespace(token_ids=[],
                                                          prompt_digests=PromptDigests("m", []))]),
        types.SimpleNamespace(
            args=[types.SimpleNamespace(token_ids=[1] * 32,
                                        prompt_digests=PromptDigests("m", ["x", b"y"]))]
        ),
        types.SimpleNamespace(
            args=[types.SimpleNamespace(token_ids=[1] * 32,
                                        prompt_digests=PromptDigests("m", b"\0" * 32))]
        ),
    ],
)
def test_routing_input_rejects_malformed(pr):
    assert routing_input(pr) is None


# ---- the Ray RequestRouter glue ---------------------------------------------------------------


async def test_an_export_goes_to_its_holder_or_to_anyone_when_the_holder_is_gone():
    # A gone holder: an empty choice would make Ray retry until the fetch's deadline; any
    # replica refuses the export at once instead (NalarWorker.export_kv).
    router = make_router(FakeIndex({"a": 9}))
    replicas = [FakeReplica(w) for w in "abc"]
    tiers = await router.choose_replicas(replicas, pending(KVExportRequest("b", [b"d"])))
    assert [[r.replica_id.unique_id for r in tier] for tier in tiers] == [["b"]]
    tiers = await router.choose_replicas(replicas, pending(KVExportRequest("gone", [b"d"])))
    assert [[r.replica_id.unique_id for r in tier] for tier in tiers] == [["a", "b", "c"]]


async def test_retries_of_one_attempt_reuse_its_index_answer_for_a_while():
    """While every replica is full, Ray asks again for the same attempt: the index is asked
    once per LOOKUP_REUSE_S, and again for a new attempt."""
    index, clock = FakeIndex({"b": 3}), Clock()
    router = make_router(index, clock)
    replicas = [FakeReplica(w) for w in "abc"]
    pr = pending(gen_request(64))
    for _ in range(3):
        tiers = await router.choose_replicas(replicas, pr)
        assert tiers[0][0].replica_id.unique_id == "b"
    assert index.calls == 1
    clock.now += LOOKUP_REUSE_S
    await router.choose_replicas(replicas, pr)
    assert index.calls == 2
    dispatch(router, pr, tiers[0][0])
    await asyncio.sleep(0)
    assert router._attempt_lookups == {}  # dropped with the attempt
    await router.choose_replicas(replicas, pending(gen_request(64)))
    assert index.calls == 3


async def test_tiers_best_first_then_rest_and_backoff_enabled():
    index = FakeIndex({"b": 3})
    router = make_router(index)
    replicas = [FakeReplica(w) for w in "abc"]
    pr = pending(gen_request(64))
    tiers = await router.choose_replicas(replicas, pr)
    assert [len(t) for t in tiers] == [1, 2]
    assert tiers[0][0].replica_id.unique_id == "b"
    assert {r.replica_id.unique_id for t in tiers for r in t} == {"a", "b", "c"}
    assert pr.routing_context.should_backoff


async def test_no_candidates_gives_no_tiers():
    router = make_router(FakeIndex())
    assert await router.choose_replicas([], pending(gen_request(64))) == []


async def test_r4_through_router():
    clock = Clock()
    index = FakeIndex({"A": 600 // BLOCK})
    router = make_router(index, clock)
    busy = {"queued_tokens": 20 * 600, "time": clock.now - 1}
    replicas = [FakeReplica("A", busy), FakeReplica("B", {"queued_tokens": 0, "time": clock.now})]
    assert await route(router, replicas, pending(gen_request(600))) == "B"


async def test_stale_report_of_finished_prefill_does_not_send_the_next_hit_away():
    # A just prefilled a 1,024-token prompt; its last report (taken mid-prefill) still lists
    # that request. Once the router has seen it finish, the follow-up sharing 992 of those
    # tokens must go to A, the only holder, not to idle B.
    clock = Clock()
    index = FakeIndex()
    router = make_router(index, clock)
    first = pending(gen_request(1024, max_tokens=1, salt="long"))
    idle = {"queued_tokens": 0, "requests": {}, "time": clock.now}
    replicas = [FakeReplica("A", dict(idle)), FakeReplica("B", dict(idle))]
    holder = await route(router, replicas, first)
    replicas_by_id = {r.replica_id.unique_id: r for r in replicas}
    replicas_by_id[holder].routing_stats = {
        "queued_tokens": 1025, "requests": {"r-long": 1025}, "time": clock.now + 0.1}
    clock.now += 3.0
    complete(router, first, holder)
    index.held[holder] = 992 // BLOCK
    follow_up = pending(gen_request(1024, n_blocks=1024 // BLOCK, max_tokens=1, salt="next"))
    assert await route(router, replicas, follow_up) == holder
    # Without the breakdown, the same stale report would (wrongly) send it away.
    replicas_by_id[holder].routing_stats = {"queued_tokens": 1025, "time": clock.now - 2.9}
    other = await route(router, replicas, pending(gen_request(1024, max_tokens=1, salt="x")))
    assert other != holder


async def test_a_prefix_held_only_in_a_slow_tier_is_weighed_at_its_load_cost():
    # A holds 62 blocks of a 1,024-token prompt, all only in its second tier, and has 200
    # tokens queued; B is idle and holds nothing.
    index = FakeIndex({"A": 62})
    index.tier["A"] = 62
    router = make_router(index)
    busy = {"queued_tokens": 200, "kv_tier_load_tokens_per_block": 0}
    replicas = [FakeReplica("A", busy), FakeReplica("B", {"queued_tokens": 0})]
    # Loads measured as free: the tier hit is as good as a pool hit.
    assert await route(router, replicas, pending(gen_request(1024, salt="a"))) == "A"
    # Loads measured slower than computing (the worker then computes): 62 blocks of work.
    replicas[0].routing_stats = {"queued_tokens": 200, "kv_tier_load_tokens_per_block": 40}
    assert await route(router, replicas, pending(gen_request(1024, salt="b"))) == "B"


async def test_rejected_attempt_does_not_hide_the_request_where_it_runs():
    # Ray fires on_request_completed for the replica that rejected a send; the request then
    # runs on the fallback replica, whose report must still count it.
    clock = Clock()
    router = make_router(FakeIndex(), clock)
    pr = pending(gen_request(160, max_tokens=4, salt="x"))
    replicas = [FakeReplica("A"), FakeReplica("B")]
    first_choice = (await router.choose_replicas(replicas, pr))[0][0].replica_id.unique_id
    fallback = "B" if first_choice == "A" else "A"
    complete(router, pr, first_choice)  # the rejection
    router.on_request_routed(pr, ReplicaID(unique_id=fallback, deployment_id=DEPLOYMENT), None)
    by_id = {r.replica_id.unique_id: r for r in replicas}
    by_id[fallback].routing_stats = {"queued_tokens": 164, "requests": {"r-x": 164},
                                     "time": clock.now + 1}
    assert router._load_tokens(fallback, by_id[fallback]) == 164


async def test_accepted_request_counts_until_a_report_lists_it():
    # A replica accepts a request before its engine queues it; a report taken in between
    # (newer than the send) must not make the request's work vanish.
    clock = Clock()
    router = make_router(FakeIndex(), clock)
    replicas = [FakeReplica("A"), FakeReplica("B")]
    worker = await route(router, replicas, pending(gen_request(160, max_tokens=4, salt="y")))
    replica = {r.replica_id.unique_id: r for r in replicas}[worker]
    replica.routing_stats = {"queued_tokens": 0, "requests": {}, "time": clock.now + 1}
    assert router._load_tokens(worker, replica) == 160 + 4
    replica.routing_stats = {"queued_tokens": 164, "requests": {"r-y": 164},
                             "time": clock.now + 2}
    assert router._load_tokens(worker, replica) == 164  # counted once, by the report


async def test_longer_prefix_hit_wins_through_router():
    router = make_router(FakeIndex({"a": 1, "b": 6, "c": 3}))
    replicas = [FakeReplica(w) for w in "abc"]
    assert await route(router, replicas, pending(gen_request(160))) == "b"


@pytest.mark.parametrize("seed", range(50))
async def test_r5_sequential_misses_spread_through_router(seed):
    router = make_router(FakeIndex(), seed=seed)
    workers = ["w0", "w1", "w2"]
    replicas = [FakeReplica(w, {"queued_tokens": 0, "time": 0.0}) for w in workers]
    rng = random.Random(seed)
    counts = Counter()
    for i in range(30):
        pr = pending(gen_request(rng.randint(20, 300), salt=f"{seed}-{i}"))
        worker = await route(router, replicas, pr)
        complete(router, pr, worker)  # each finishes before the next: every load reads 0
        counts[worker] += 1
    assert_spread(counts, workers)


async def test_back_to_back_requests_spread_with_stale_zero_stats():
    router = make_router(FakeIndex())
    replicas = [FakeReplica(w, {"queued_tokens": 0, "time": 0.0}) for w in "abc"]
    prs = [pending(gen_request(200, salt=str(i))) for i in range(3)]
    chosen = await asyncio.gather(*(route(router, replicas, pr) for pr in prs))
    assert sorted(chosen) == ["a", "b", "c"]


@pytest.mark.parametrize("ingress_told", [False, True])
async def test_a_request_the_ingress_saw_finish_stops_counting_as_load(ingress_told):
    # Ray Serve's completion can reach the router after the client has its answer and has sent
    # the same prompt again (CI saw it); the index has not heard of the prompt yet.
    router = make_router(FakeIndex({}))
    replicas = [FakeReplica(w, {"queued_tokens": 0, "time": 0.0}) for w in "ab"]
    first = gen_request(200, salt="turn")
    holder = await route(router, replicas, pending(first))
    if ingress_told:  # the ingress runs on another thread than the router's loop
        await asyncio.to_thread(FINISHED_REQUESTS.finished, first.request_id)
    repeat = dataclasses.replace(first, request_id="r-repeat")
    # Untold, the holder still has the first's 200 + 16 tokens ahead, so its 8 uncached
    # tokens cost more than the whole prompt on the idle other worker; told, 8 against 200.
    assert (await route(router, replicas, pending(repeat)) == holder) == ingress_told


async def test_own_accounting_shifts_choice_away_from_hit():
    # "a" caches 192 of 200 tokens: 8 to prefill, plus 16 decode tokens of work per request.
    router = make_router(FakeIndex({"a": 12}))
    replicas = [FakeReplica(w, {"queued_tokens": 0, "time": 0.0}) for w in "ab"]
    chosen = [await route(router, replicas, pending(gen_request(200))) for _ in range(9)]
    # a's score grows 8, 32, ..., 8 + 24 * 8 = 200 (= b's 200, a tie: the least recently
    # chosen, b, wins): the ninth goes to b.
    assert chosen == ["a"] * 8 + ["b"]


async def test_blocks_of_a_request_in_flight_count_before_the_index_hears_of_them():
    # The index knows nothing yet; the holder was sent a 200-token prompt, has prefilled it and
    # is decoding it (its report lists 16 tokens of work left for it).
    router = make_router(FakeIndex({}))
    replicas = {w: FakeReplica(w, {"queued_tokens": 0, "time": 0.0}) for w in "ab"}
    first = gen_request(200, salt="shared")
    holder = await route(router, list(replicas.values()), pending(first))
    replicas[holder].routing_stats = {"queued_tokens": 16, "requests": {first.request_id: 16},
                                      "time": 1.0}
    second = GenerationRequest(request_id="r-second", token_ids=list(range(200)),
                               sampling=SamplingParams(max_tokens=16),
                               prompt_digests=first.prompt_digests)
    # holder: 8 to prefill (12 blocks pinned by the first) + 16 = 24; the other: 200.
    assert await route(router, list(replicas.values()), pending(second)) == holder


async def test_new_prefixes_go_where_the_fewest_other_prefixes_live():
    index = FakeIndex({})
    router = make_router(index)
    a = FakeReplica("a", {"queued_tokens": 1000, "time": 0.0})
    b = FakeReplica("b", {"queued_tokens": 0, "time": 0.0})
    for tenant in range(3):  # a is busier by more than a prefill: b is sent three prefixes
        pr = pending(gen_request(200, salt=f"tenant-{tenant}"))
        assert await route(router, [a, b], pr) == "b"
        complete(router, pr, "b")
    # a is busier by less than one prefill of the prompt and holds fewer other prefixes.
    a.routing_stats = {"queued_tokens": 100, "time": 0.0}
    assert await route(router, [a, b], pending(gen_request(200, salt="tenant-new"))) == "a"
    # A prefix b already holds some of is not new: it follows its cached blocks.
    index.held = {"b": 5}
    assert await route(router, [a, b], pending(gen_request(200, salt="tenant-0"))) == "b"


async def test_stats_snapshot_clears_router_own_entries():
    clock = Clock()
    router = make_router(FakeIndex({"a": 10}), clock)
    a = FakeReplica("a", {"queued_tokens": 0, "time": clock.now - 5})
    b = FakeReplica("b", {"queued_tokens": 0, "time": clock.now - 5})
    for i in range(3):  # other prompts than the next (no blocks of it in flight on a)
        await route(router, [a, b], pending(gen_request(200, salt=str(i))))
        clock.now += 0.01
    assert await route(router, [a, b], pending(gen_request(200))) == "b"
    # a reports after those sends and has finished them: its own-sent entries are dropped.
    a.routing_stats = {"queued_tokens": 0, "time": clock.now + 0.5}
    clock.now += 1
    assert await route(router, [a, b], pending(gen_request(200))) == "a"


async def test_completion_clears_router_own_entries():
    router = make_router(FakeIndex({"a": 10}))
    replicas = [FakeReplica(w) for w in "ab"]
    for _ in range(4):
        pr = pending(gen_request(200))
        worker = await route(router, replicas, pr)
        assert worker == "a"
        complete(router, pr, worker)


async def test_fallback_route_moves_accounting():
    router = make_router(FakeIndex({"a": 10}))
    a, b = FakeReplica("a"), FakeReplica("b")
    pr = pending(gen_request(200))
    tiers = await router.choose_replicas([a, b], pr)
    assert tiers[0][0] is a
    router.on_request_routed(pr, b.replica_id, None)  # a was full; Ray used the second tier
    assert router._ledger.get(pr.metadata.internal_request_id).worker_id == "b"
    assert router._ledger.outstanding("b", None) == 200 + 16


async def test_r7_index_failure_falls_back_logs_once_and_recovers(caplog):
    clock = Clock()
    index = FakeIndex({"a": 10})
    router = make_router(index, clock, index_retry_s=1.0)
    replicas = [FakeReplica(w) for w in "abc"]
    index.fail = ConnectionError("redis down")
    with caplog.at_level(logging.INFO, logger="router.routing"):
        for _ in range(20):
            pr = pending(gen_request(200))
            worker = await route(router, replicas, pr)
            assert worker in {"a", "b", "c"}
            complete(router, pr, worker)
            clock.now += 0.3
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "load only" in warnings[0].getMessage()
        assert index.calls < 20  # the retry window spares the index (and the requests) meanwhile
        index.fail = None
        clock.now += 2
        assert await route(router, replicas, pending(gen_request(200))) == "a"
    assert any("answering again" in r.getMessage() for r in caplog.records)


async def test_index_timeout_is_bounded():
    index = FakeIndex({"a": 10})
    index.hang = True
    router = make_router(index, index_timeout_s=0.05, index_first_timeout_s=0.3, index_retry_s=0.0)
    replicas = [FakeReplica(w) for w in "abc"]
    elapsed = []
    for _ in range(3):
        start = time.monotonic()
        assert await route(router, replicas, pending(gen_request(200))) in {"a", "b", "c"}
        elapsed.append(time.monotonic() - start)
    assert 0.25 < elapsed[0] < 1.0  # the first lookup may also connect
    assert all(e < 0.25 for e in elapsed[1:])
    assert index.calls == 3


async def test_index_bad_answer_falls_back():
    index = FakeIndex()
    router = make_router(index)

    async def bad(*_):
        return ["not", "a", "dict"]

    index.match = bad
    replicas = [FakeReplica(w) for w in "ab"]
    assert await route(router, replicas, pending(gen_request(200))) in {"a", "b"}


async def test_missing_index_routes_on_load():
    router = make_router(None)
    idle, busy = FakeReplica("idle"), FakeReplica("busy", {"queued_tokens": 10_000, "time": 0})
    assert await route(router, [idle, busy], pending(gen_request(200))) == "idle"


async def test_short_prompt_needs_no_index():
    index = FakeIndex()
    index.fail = ConnectionError("would not be asked")
    router = make_router(index)
    replicas = [FakeReplica(w) for w in "abc"]
    await route(router, replicas, pending(gen_request(5)))
    assert index.calls == 0


@pytest.mark.parametrize(
    "make_pr",
    [
        lambda: None,
        lambda: pending(),
        lambda: pending("hello"),
        lambda: pending(types.SimpleNamespace(token_ids=[1, 2, 3])),
        lambda: pending(types.SimpleNamespace(token_ids=[1] * 64,
                                              prompt_digests=PromptDigests("m", [1, 2]))),
        lambda: pending(types.SimpleNamespace(token_ids=[1] * 64, prompt_digests=[b"\0" * 32])),
        lambda: pending(request=gen_request(64)),
    ],
)
async def test_r6_malformed_request_gets_valid_choice(make_pr):
    pr = make_pr()
    index = FakeIndex({"a": 4})
    index.hang = True  # must not even be asked
    router = make_router(index)
    replicas = [FakeReplica(w) for w in "abc"]
    tiers = await asyncio.wait_for(router.choose_replicas(replicas, pr), 1.0)
    assert tiers[0][0] in replicas
    assert index.calls == 0


async def test_replica_death_forgets_worker_in_index():
    index = FakeIndex({"a": 4})
    router = make_router(index, model_key="m1")
    router.on_replica_actor_died(ReplicaID(unique_id="a", deployment_id=DEPLOYMENT))
    await asyncio.sleep(0.01)
    assert index.forgotten == [("m1", "a")]


async def test_replica_death_never_raises_when_index_fails():
    index = FakeIndex()

    async def broken(*_):
        raise ConnectionError("redis down")

    index.forget = broken
    router = make_router(index)
    router.on_replica_actor_died(ReplicaID(unique_id="a", deployment_id=DEPLOYMENT))
    await asyncio.sleep(0.01)


def test_replica_death_outside_event_loop_never_raises():
    router = make_router(FakeIndex())
    router.on_replica_actor_died(ReplicaID(unique_id="a", deployment_id=DEPLOYMENT))


def _install_fake_index_module(monkeypatch, make_index):
    fake = types.ModuleType("router.index")
    fake.make_index = make_index
    fake.DEFAULT_ACTOR_NAME = "shared-index"
    monkeypatch.setitem(sys.modules, "router.index", fake)


def _bare_router() -> PrefixAwareRequestRouter:
    return PrefixAwareRequestRouter(
        deployment_id=DEPLOYMENT, handle_source=DeploymentHandleSource.UNKNOWN
    )


def test_initialize_state_builds_index_with_make_index(monkeypatch):
    seen = []

    def make_index(redis_url, key_prefix, worker_ttl_s=30.0, actor_name=None, **kw):
        seen.append((redis_url, key_prefix, worker_ttl_s, actor_name, kw))
        return FakeIndex()

    _install_fake_index_module(monkeypatch, make_index)
    router = _bare_router()
    router.initialize_state(redis_url="redis://x:6379", key_prefix="t1", worker_ttl_s=5.0)
    assert isinstance(router._lookup.index, FakeIndex)
    assert router._model_key is None  # discovered from the replicas
    _bare_router().initialize_state(index_actor_name="idx", index_actor_namespace="ns")
    _bare_router().initialize_state()  # no Redis: the shared actor, never a private index
    assert seen == [
        ("redis://x:6379", "t1", 5.0, None, {}),
        (None, "nalar", 30.0, "idx", {"actor_namespace": "ns"}),
        (None, "nalar", 30.0, "shared-index", {}),
    ]


async def test_model_key_discovered_from_replicas():
    index = FakeIndex({"b": 4})
    router = make_router(index, model_key=None)
    replicas = [
        FakeReplica("a", metadata={"model_key": "k1"}),
        FakeReplica("b", stats={"model_key": "k1"}),
        FakeReplica("c"),  # not told yet: credited with nothing, still a candidate
    ]
    assert await route(router, replicas, pending(gen_request(80))) == "b"
    assert index.asked_keys == ["k1"]
    router.on_replica_actor_died(replicas[1].replica_id)
    await asyncio.sleep(0.01)
    assert index.forgotten == [("k1", "b")]


async def test_index_build_failure_still_routes(monkeypatch):
    def make_index(*_, **__):
        raise RuntimeError("no index")

    _install_fake_index_module(monkeypatch, make_index)
    router = _bare_router()
    router.initialize_state()
    replicas = [FakeReplica(w) for w in "ab"]
    assert await route(router, replicas, pending(gen_request(64))) in {"a", "b"}


async def test_routes_with_the_real_memory_index():
    index_module = pytest.importorskip("router.index")
    from contract.kv_events import KVEvent, encode_events

    index = index_module.MemoryIndex(worker_ttl_s=30.0)
    request = gen_request(96, salt="shared")
    digests = request.prompt_digests.digests
    await index.publish("m", "b", encode_events([KVEvent("stored", digests[:4])]))
    await index.publish("m", "c", encode_events([KVEvent("stored", digests[:1])]))
    router = make_router(index)
    replicas = [FakeReplica(w) for w in "abc"]
    assert await route(router, replicas, pending(request)) == "b"
    router.on_replica_actor_died(replicas[1].replica_id)
    await asyncio.sleep(0.01)
    assert held_blocks(await index.match("m", digests, ["b"])) == {"b": 0}


# ---- faults: index and replicas misbehaving -----------------------------------------------------


async def test_request_cancelled_before_dispatch_stops_counting_as_load():
    # The router chose a replica, then the caller gave up before Ray sent the request: Ray
    # cancels the pending request's future and never calls on_request_routed/completed.
    router = make_router(FakeIndex())
    replicas = [FakeReplica("A"), FakeReplica("B")]
    pr = pending(gen_request(160, max_tokens=4, salt="gone"))
    chosen = (await router.choose_replicas(replicas, pr))[0][0]
    assert router._load_tokens(chosen.replica_id.unique_id, chosen) == 160 + 4
    pr.future.cancel()
    await asyncio.sleep(0)  # done callbacks run on the next loop iteration
    assert router._load_tokens(chosen.replica_id.unique_id, chosen) == 0
    assert len(router._ledger) == 0


async def test_load_counts_the_whole_output_budget():
    # Without max_tokens the ingress asks for the rest of the context (here 2048 - 160); the
    # request may really produce all of it, so it counts for all of it, per choice.
    plan = routing_input(pending(gen_request(160, max_tokens=2048 - 160)))
    assert plan.decode_tokens == 1888
    request = gen_request(160, max_tokens=300)
    request.sampling.n = 3
    assert routing_input(pending(request)).decode_tokens == 900
    router = make_router(FakeIndex())
    replicas = [FakeReplica("A"), FakeReplica("B")]
    worker = await route(router, replicas, pending(gen_request(160, max_tokens=1888, salt="z")))
    replica = {r.replica_id.unique_id: r for r in replicas}[worker]
    assert router._load_tokens(worker, replica) == 160 + 1888


async def test_fallback_route_leaves_nothing_on_the_first_choice():
    # Ray took the second tier (the first choice was full): the work must leave "a" entirely,
    # or "a" looks busier than it is until the entry ages out.
    router = make_router(FakeIndex({"a": 10}))
    a, b = FakeReplica("a"), FakeReplica("b")
    pr = pending(gen_request(200))
    assert (await router.choose_replicas([a, b], pr))[0][0] is a
    router.on_request_routed(pr, b.replica_id, None)
    assert router._ledger.outstanding("a", None) == 0
    assert router._ledger.outstanding("b", None) == 200 + 16



# ---- policies through the router, telemetry, model keys --------------------------------------


async def test_round_robin_router_cycles_and_never_asks_the_index():
    index = FakeIndex({"c": 10})
    telemetry = RoutingTelemetry()
    router = make_router(index, routing="round-robin", telemetry_sink=telemetry)
    replicas = [FakeReplica(w, {"queued_tokens": 50 * i, "time": 0.0})
                for i, w in enumerate("abc")]
    chosen = [await route(router, replicas, pending(gen_request(200, salt=str(i))))
              for i in range(6)]
    assert chosen == ["a", "b", "c", "a", "b", "c"]
    assert index.calls == 0
    assert telemetry.share() == {"a": 2, "b": 2, "c": 2}
    assert {(d.policy, d.cached_blocks, d.fallback) for d in telemetry.recent()} == {
        ("round-robin", 0, None)}


async def test_power_of_two_router_routes_on_load_only():
    index = FakeIndex({"busy": 12})
    router = make_router(index, routing="power-of-two")
    replicas = [FakeReplica("busy", {"queued_tokens": 10_000, "time": 0.0}), FakeReplica("idle")]
    for i in range(5):  # with two replicas both are sampled: the less loaded always wins
        assert await route(router, replicas, pending(gen_request(200, salt=f"p{i}"))) == "idle"
    assert index.calls == 0


def test_unknown_routing_policy_is_refused():
    with pytest.raises(ValueError, match="unknown routing policy"):
        make_router(FakeIndex(), routing="least-connections")


async def test_decisions_record_credited_blocks_and_why_routing_was_load_only():
    clock = Clock()
    telemetry = RoutingTelemetry()
    index = FakeIndex({"b": 6})
    router = make_router(index, clock, telemetry_sink=telemetry, index_retry_s=1.0)
    replicas = [FakeReplica(w) for w in "ab"]

    async def decide(pr):
        worker = await route(router, replicas, pr)
        complete(router, pr, worker)
        return telemetry.recent(1)[0]

    hit = await decide(pending(gen_request(160)))
    assert (hit.worker_id, hit.policy, hit.prompt_tokens, hit.cached_blocks, hit.cached_tokens,
            hit.fallback) == ("b", "prefix", 160, 6, 96, None)
    index.fail = ConnectionError("redis down")
    assert (await decide(pending(gen_request(160)))).fallback == "index_error"
    assert (await decide(pending(gen_request(160)))).fallback == "index_down"  # retry window
    assert (await decide(pending("unreadable"))).fallback == "no_prompt"
    await route(router, replicas, pending())  # a call without arguments, like describe()
    assert len(telemetry.recent()) == 4  # is not a request: no decision
    short = await decide(pending(gen_request(10)))  # under one block: nothing to look up
    assert (short.fallback, short.cached_blocks) == (None, 0)
    health = telemetry.index_health()
    assert (health["healthy"], health["lookups"]) == (False, 2)
    assert health["last_error"] == "ConnectionError: redis down"
    assert health["fallbacks"] == {"index_error": 1, "index_down": 1, "no_prompt": 1}
    assert len(telemetry.recent()) == 5


async def test_lookup_timeout_and_unknown_model_key_are_named():
    telemetry = RoutingTelemetry()
    index = FakeIndex({"a": 4})
    index.hang = True
    router = make_router(index, telemetry_sink=telemetry, index_timeout_s=0.01,
                         index_first_timeout_s=0.01, index_retry_s=0.0)
    await route(router, [FakeReplica("a")], pending(gen_request(64)))
    assert telemetry.recent(1)[0].fallback == "index_timeout"
    keyless = make_router(FakeIndex({"a": 4}), telemetry_sink=telemetry, model_key=None)
    await route(keyless, [FakeReplica("a")], pending(gen_request(64)))
    assert telemetry.recent(1)[0].fallback == "no_model_key"


async def test_decision_names_the_replica_ray_fell_back_to():
    telemetry = RoutingTelemetry()
    router = make_router(FakeIndex({"a": 10, "b": 2}), telemetry_sink=telemetry)
    a, b = FakeReplica("a"), FakeReplica("b")
    pr = pending(gen_request(200))
    assert (await router.choose_replicas([a, b], pr))[0][0] is a
    dispatch(router, pr, b)  # a was full: Ray took the second tier
    await asyncio.sleep(0)
    decision = telemetry.recent(1)[0]
    assert (decision.worker_id, decision.cached_blocks) == ("b", 2)
    assert router._ledger.outstanding("b", None) == 200 - 2 * BLOCK + 16
    assert router._ledger.outstanding("a", None) == 0


async def test_cancelled_request_records_no_decision():
    telemetry = RoutingTelemetry()
    router = make_router(FakeIndex(), telemetry_sink=telemetry)
    pr = pending(gen_request(64))
    await router.choose_replicas([FakeReplica("a")], pr)
    pr.future.cancel()
    await asyncio.sleep(0)
    assert telemetry.recent() == [] and telemetry.share() == {}


async def test_router_publishes_the_replicas_model_keys():
    router = make_router(FakeIndex(), model_key=None)
    replicas = [FakeReplica("a", metadata={"model_key": "k1"}),
                FakeReplica("b", stats={"model_key": "k2"}), FakeReplica("c")]
    await route(router, replicas, pending(gen_request(64)))
    assert REPLICA_MODEL_KEYS.keys(("nalar", "worker")) == {"k1", "k2"}


def test_replica_update_publishes_the_redeployed_keys(monkeypatch):
    # A redeploy reaches the router as a replica update before any request is routed.
    monkeypatch.setattr(RequestRouter, "update_replicas", lambda self, replicas: None)
    router = make_router(FakeIndex(), model_key=None)
    router.update_replicas([FakeReplica("old", metadata={"model_key": "v1"})])
    assert REPLICA_MODEL_KEYS.keys(("nalar", "worker")) == {"v1"}
    router.update_replicas([FakeReplica("new", metadata={"model_key": "v2"})])
    assert REPLICA_MODEL_KEYS.keys(("nalar", "worker")) == {"v2"}
    assert router._worker_model_keys == {"new": "v2"}


# ---- LoRA adapters: residency costed in tokens ------------------------------------------------


async def test_an_adapter_request_goes_where_its_adapter_is_held_unless_load_outweighs_it():
    """The read costs the replica's reported tokens; held there costs nothing. Equal loads:
    the holder wins. A load gap larger than the read: the read is worth it."""
    from contract.identity import AdapterRef

    adapter = AdapterRef("sql", "ab" * 32, "/adapters/sql")

    def replicas(holder_load: int, other_load: int) -> list[FakeReplica]:
        return [FakeReplica("holder", {"queued_tokens": holder_load, "adapters": ["ab" * 32],
                                       "adapter_read_tokens": 40}),
                FakeReplica("other", {"queued_tokens": other_load, "adapters": [],
                                      "adapter_read_tokens": 40})]

    def request(salt: str) -> GenerationRequest:
        req = gen_request(64, salt=salt)
        req.adapter = adapter
        return req

    for seed in range(4):  # a fresh router each time: no work of its own sent anywhere yet
        router = make_router(FakeIndex(), seed=seed)
        assert await route(router, replicas(100, 100), pending(request(f"a{seed}"))) == "holder"
    router = make_router(FakeIndex())
    assert await route(router, replicas(100, 100), pending(request("b"))) == "holder"
    # what it sent there (64 + 16 tokens) now outweighs the read (40): the next goes elsewhere
    assert await route(router, replicas(100, 100), pending(request("c"))) == "other"
    router = make_router(FakeIndex())
    assert await route(router, replicas(1000, 100), pending(request("b"))) == "other"
    base = gen_request(64, salt="c")  # no adapter: residency plays no part
    chosen = Counter()
    for i in range(6):
        router = make_router(FakeIndex(), seed=i)
        chosen[await route(router, replicas(100, 100), pending(base))] += 1
    assert set(chosen) == {"holder", "other"}


async def test_an_adapter_costs_its_tier_and_its_share_of_the_slots():
    """Three tiers, three costs: resident nothing, host its swap, elsewhere its read. An
    adapter not in use there also takes a slot: the replica's slot wait when every slot is
    busy, else that wait times the fraction busy once it takes one."""
    from contract.identity import AdapterRef

    digest = "ab" * 32

    def replica(name: str, load: int, resident=(), hosted=(), busy=0) -> FakeReplica:
        return FakeReplica(name, {"queued_tokens": load, "adapters": list(resident),
                                  "host_adapters": list(hosted), "adapter_read_tokens": 400,
                                  "adapter_swap_tokens": 5, "adapter_slots": 4,
                                  "adapter_slots_busy": busy, "adapter_slot_wait_tokens": 600})

    async def choose(seed: int, *replicas: FakeReplica) -> str:
        return await route(make_router(FakeIndex(), seed=seed), list(replicas), pending(request))

    request = gen_request(64, salt="h")
    request.adapter = AdapterRef("sql", digest, "/adapters/sql")
    for seed in range(4):
        # each takes one of four slots (+150): 255 against 650; then 455, 200 tokens busier
        assert await choose(seed, replica("disk", 100), replica("host", 100, hosted=[digest]))\
            == "host"
        assert await choose(seed, replica("disk", 100), replica("host", 300, hosted=[digest]))\
            == "host"
        assert await choose(seed, replica("resident", 104, resident=[digest]),
                            replica("host", 100, hosted=[digest])) == "resident"
        # every slot busy: 100 + 5 + 600 against 350 + 5 + 150 (without the slots: 105)
        assert await choose(seed, replica("full", 100, hosted=[digest], busy=4),
                            replica("idle", 350, hosted=[digest])) == "idle"
        # two of four busy, three once it takes one: 100 + 5 + 450 against 505
        assert await choose(seed, replica("half", 100, hosted=[digest], busy=2),
                            replica("idle", 350, hosted=[digest])) == "idle"


async def test_adapters_this_router_has_in_flight_fill_a_replicas_slots():
    """The router's own requests in flight are fresher than a replica's report: once they
    use as many adapters as it has slots, another adapter there must wait for one."""
    from contract.identity import AdapterRef

    def replica(name: str, load: int) -> FakeReplica:
        return FakeReplica(name, {"queued_tokens": load, "adapters": [], "adapter_slots": 1,
                                  "adapter_read_tokens": 400, "running": 1})

    def request(salt: str, digest: str) -> GenerationRequest:
        req = gen_request(64, salt=salt)
        req.adapter = AdapterRef(salt, digest, f"/adapters/{salt}")
        return req

    for seed in range(4):
        router = make_router(FakeIndex(), seed=seed)
        assert await route(router, [replica("a", 100), replica("b", 1000)],
                           pending(request("x", "ab" * 32))) == "a"
        # "a": 100 + 80 in flight + read 400 + a slot wait of x's 80 tokens left = 660;
        # "b": 250 + read 400 = 650 (without the slot wait "a" would cost 580)
        assert await route(router, [replica("a", 100), replica("b", 250)],
                           pending(request("y", "cd" * 32))) == "b"
        # x again: in flight on "a", so resident there
        assert await route(router, [replica("a", 100), replica("b", 250)],
                           pending(request("x2", "ab" * 32))) == "a"


def test_token_rate_follows_busy_readings_and_keeps_it_when_idle():
    from cluster.worker_deployment import TokenRate

    rate = TokenRate(weight=0.5)
    assert rate.update(0, 0.0) == 0.0
    assert rate.update(200, 1.0) == 200.0
    assert rate.update(600, 2.0) == 300.0  # (400 + 200) / 2
    assert rate.update(600, 5.0) == 300.0  # idle: the last rate stands



@pytest.mark.parametrize("seed", range(8))
async def test_requests_routed_while_an_index_lookup_is_awaited_count_as_load(seed):
    # A real index answers after the loop has run other routings: the load each worker
    # carries must include the requests routed meanwhile. Here an 8,000-token prompt goes to
    # one worker and a 100-token one to the other while the first request's lookup is
    # awaited; that request then belongs with the short one.
    class SlowIndex(FakeIndex):
        def __init__(self, delays):
            super().__init__()
            self.delays = iter(delays)

        async def match(self, model_key, digests, worker_ids):
            await asyncio.sleep(next(self.delays))
            return await super().match(model_key, digests, worker_ids)

    router = make_router(SlowIndex([0.05, 0.0, 0.0]), seed=seed)
    replicas = [FakeReplica(w, {"queued_tokens": 0, "time": 0.0}) for w in "ab"]
    waiting = asyncio.ensure_future(route(router, replicas, pending(gen_request(2000, salt="w"))))
    await asyncio.sleep(0.01)  # its lookup is in flight
    long = await route(router, replicas, pending(gen_request(8000, salt="long")))
    short = await route(router, replicas, pending(gen_request(100, salt="short")))
    assert {long, short} == {"a", "b"}
    assert await waiting == short
