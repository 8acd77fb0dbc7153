"""Routing while the digest index is down or late: the router's own record of the prefixes it
sent keeps it prefix-aware, weighed against load by the prefix policy's scorer; the index stays
the truth when it answers, but for what it cannot have heard of yet; the record is bounded and
forgets dead workers; every fallback and every record hit is counted in ``/metrics``.

No Ray cluster: the router is driven directly with fake replicas and a fake index (the builders
of ``test_request_router``).
"""

from __future__ import annotations

import pytest
from ray.serve.request_router import ReplicaID, RequestRouter
from test_request_router import (
    DEPLOYMENT,
    Clock,
    FakeIndex,
    FakeReplica,
    complete,
    gen_request,
    make_router,
    pending,
    route,
)
from test_routing_telemetry import scrape

from router.routing.policies import PrefixPolicy, ReplicaView
from router.routing.telemetry import RoutingTelemetry

PROMPT = 640  # tokens: 40 blocks of 16, a shared prefix as a real report had it


def broken_index(how: str) -> tuple[FakeIndex, dict]:
    """An index holding nothing that fails every lookup ``how``, and the router's kwargs."""
    index = FakeIndex()
    if how == "raises":
        index.fail = ConnectionError("redis down")
        return index, {"index_retry_s": 0.0}
    if how == "times out":
        index.hang = True
        return index, {"index_timeout_s": 0.01, "index_first_timeout_s": 0.01,
                       "index_retry_s": 0.0}
    # "down": one failure, then the retry window (the index is not even asked).
    index.fail = ConnectionError("redis down")
    return index, {"index_retry_s": 3600.0}


@pytest.mark.parametrize("how", ["raises", "times out", "down"])
async def test_identical_requests_follow_their_prefix_while_the_index_fails(how):
    # Before the fix, load-only routing alternated two idle workers on ties: every repeat of
    # the 640-token prompt went where it was not cached.
    index, kwargs = broken_index(how)
    router = make_router(index, **kwargs)
    replicas = [FakeReplica(w) for w in "ab"]
    served = []
    for _ in range(6):
        pr = pending(gen_request(PROMPT, salt="shared"))
        served.append(await route(router, replicas, pr))
        complete(router, pr, served[-1])
    assert served == served[:1] * 6
    assert index.calls == {"raises": 6, "times out": 6, "down": 1}[how]


async def test_load_still_outweighs_the_recorded_prefix():
    index, kwargs = broken_index("raises")
    clock = Clock()
    router = make_router(index, clock, **kwargs)
    replicas = {w: FakeReplica(w) for w in "ab"}
    first = pending(gen_request(PROMPT, salt="shared"))
    holder = await route(router, list(replicas.values()), first)
    complete(router, first, holder)
    other = "b" if holder == "a" else "a"

    async def route_with_load(queued_tokens: int) -> str:
        replicas[holder].routing_stats = {"queued_tokens": queued_tokens, "time": clock.now}
        pr = pending(gen_request(PROMPT, salt="shared"))
        worker = await route(router, list(replicas.values()), pr)
        complete(router, pr, worker)
        return worker

    # The prefix policy's scores: on the holder 1 token to prefill (the last one, for its
    # logits) + its load; elsewhere the whole prompt.
    policy = PrefixPolicy(16)
    assert policy.score(ReplicaView(holder, 40, 638), PROMPT) == 639
    assert policy.score(ReplicaView(other, 0, 0), PROMPT) == 640
    assert await route_with_load(638) == holder
    assert await route_with_load(10_000) == other  # far higher load: the other wins


async def test_the_index_is_the_truth_when_it_answers():
    clock = Clock()
    index = FakeIndex()
    index.fail = ConnectionError("redis down")
    router = make_router(index, clock, index_retry_s=1.0)
    replicas = [FakeReplica(w) for w in "ab"]
    pr = pending(gen_request(PROMPT, salt="shared"))
    recorded_on = await route(router, replicas, pr)
    complete(router, pr, recorded_on)
    # The index answers again and says the other worker holds the prompt (the recorded one
    # evicted it): the index wins over the router's record.
    elsewhere = "b" if recorded_on == "a" else "a"
    index.fail = None
    index.held = {elsewhere: 40}
    clock.now += 2.0
    assert await route(router, replicas, pending(gen_request(PROMPT, salt="shared"))) == elsewhere


async def test_a_repeat_before_the_index_hears_follows_its_prefix():
    # CI caught this: right after a completion, the index answered without the prompt (its
    # events were still on their way), routing went on load alone, and an identical request
    # went to the other, idle worker and computed the prompt again.
    clock = Clock()
    index = FakeIndex()  # answers every lookup, and never hears of the prompt
    router = make_router(index, clock, index_lag_s=1.0)
    replicas = [FakeReplica(w) for w in "ab"]
    served = []
    for _ in range(6):
        pr = pending(gen_request(PROMPT, salt="shared"))
        served.append(await route(router, replicas, pr))
        clock.now += 5.0  # it runs for longer than the lag
        complete(router, pr, served[-1])
        clock.now += 0.9  # and the repeat comes 0.9 s after it finished
    assert served == served[:1] * 6
    # Past the lag the index's silence is the truth: the idle workers alternate on load.
    later = []
    for _ in range(2):
        clock.now += 1.5
        pr = pending(gen_request(PROMPT, salt="shared"))
        later.append(await route(router, replicas, pr))
        complete(router, pr, later[-1])
    assert sorted(later) == ["a", "b"]


async def test_the_record_forgets_a_dead_or_removed_worker(monkeypatch):
    monkeypatch.setattr(RequestRouter, "update_replicas", lambda self, replicas: None)
    index, kwargs = broken_index("raises")
    telemetry = RoutingTelemetry()
    router = make_router(index, telemetry_sink=telemetry, **kwargs)
    replicas = [FakeReplica(w) for w in "ab"]
    for _ in range(2):
        pr = pending(gen_request(PROMPT, salt="shared"))
        holder = await route(router, replicas, pr)
        complete(router, pr, holder)
    assert telemetry.recent(1)[0].record_blocks == 40
    router.on_replica_actor_died(ReplicaID(unique_id=holder, deployment_id=DEPLOYMENT))
    # Still listed as a candidate (Ray has not updated the set yet): credited nothing now.
    pr = pending(gen_request(PROMPT, salt="shared"))
    complete(router, pr, await route(router, replicas, pr))
    assert telemetry.recent(1)[0].record_blocks == 0
    # A worker removed from the deployment is forgotten too.
    survivor = telemetry.recent(1)[0].worker_id
    router.update_replicas([r for r in replicas if r.replica_id.unique_id != survivor])
    replicas.append(FakeReplica("c"))
    pr = pending(gen_request(PROMPT, salt="shared"))
    complete(router, pr, await route(router, replicas, pr))
    assert telemetry.recent(1)[0].record_blocks == 0


async def test_the_record_is_capped():
    index, kwargs = broken_index("raises")
    telemetry = RoutingTelemetry()
    router = make_router(index, telemetry_sink=telemetry, record_max_blocks=60, **kwargs)
    replicas = [FakeReplica("a")]
    for salt in ("p", "q", "p"):
        pr = pending(gen_request(PROMPT, salt=salt))
        complete(router, pr, await route(router, replicas, pr))
    # 40 + 40 blocks sent into a 60-block record: q's 40 stay, p keeps only its 20 head blocks.
    assert telemetry.recent(1)[0].record_blocks == 20


async def test_every_fallback_and_record_hit_reaches_metrics():
    clock = Clock()
    index = FakeIndex({"a": 40})
    telemetry = RoutingTelemetry()
    router = make_router(index, clock, telemetry_sink=telemetry, index_retry_s=1.0)
    replicas = [FakeReplica(w) for w in "ab"]

    async def send(salt: str) -> None:
        pr = pending(gen_request(PROMPT, salt=salt))
        complete(router, pr, await route(router, replicas, pr))
        clock.now += 0.1

    await send("shared")  # the index answers: no fallback, recorded all the same
    index.fail = ConnectionError("redis down")
    await send("shared")  # index_error, the record holds the prompt
    await send("shared")  # index_down (retry window), the record holds it
    await send("unseen")  # index_down, nothing recorded: load alone
    samples = scrape(telemetry)

    def value(name, **labels):
        return samples.get((name, tuple(sorted(labels.items()))))

    assert value("nalar:router_fallbacks_total", reason="index_error") == 1
    assert value("nalar:router_fallbacks_total", reason="index_down") == 2
    assert value("nalar:router_record_hits_total", reason="index_error") == 1
    assert value("nalar:router_record_hits_total", reason="index_down") == 1
    assert [(d.fallback, d.record_blocks, d.cached_blocks) for d in telemetry.recent(4)] == [
        ("index_down", 0, 0), ("index_down", 40, 0), ("index_error", 40, 0), (None, 0, 40)]
