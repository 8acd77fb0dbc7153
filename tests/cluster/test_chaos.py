"""Chaos cases at CI sizes: the faults of ``benchmarks/chaos.py``, each struck once under load
on its own application (two fp32 workers, a private ``redis-server``, one ngram draft replica),
served under ``/chaos`` by the session cluster's HTTP proxy, but ``worker_kill``: the holder
killed mid-transfer below is killed mid-stream too (SIGKILL), and its stream's error event is
checked as that case checks it. A replica's restart costs each case about 15 s.

Every case asserts: each request accepted before the fault, and each sent while it lasted,
completes or ends with an explicit error (HTTP status or SSE error event), none hangs, no KV
block is left in use once the load drains (and each pool's counts add up), and a repeated
shared-prefix request is served from the cache again afterwards. The case then asserts what
its fault must (and must only) cost.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import uuid
from collections.abc import Iterator

import httpx
import pytest
import ray
from helpers import PrivateRedis, private_redis_server, random_prompt
from ray import serve

from bench.client import WORKER_HEADER
from bench.records import RequestRecord
from benchmarks import chaos, soak
from contract.identity import CacheNamespace, block_digests
from router.index.redis_index import RedisIndex

SIZES = chaos.QUICK
VOCAB = 40000  # token ids of the holder-kill prompts, within SmolLM2's vocabulary


@pytest.fixture(scope="module")
def private_redis() -> Iterator[PrivateRedis]:
    yield from private_redis_server()


@pytest.fixture(scope="module")
def target(cluster, private_redis: PrivateRedis) -> Iterator[chaos.ChaosTarget]:
    """The chaos application beside the session's (whose fixture started Serve's HTTP proxy on
    its port; the chaos app answers there under ``/chaos``)."""
    yield chaos.deploy(private_redis, cluster.config.port)
    serve.delete(chaos.APP)


async def strike(target: chaos.ChaosTarget, name: str) -> chaos.CaseResult:
    """Runs case ``name`` and checks what every case must hold."""
    result = await chaos.run_case(target, chaos.CASE_TABLE[name], SIZES,
                                  seed=chaos.CASES.index(name))
    figures = result.figures
    print(json.dumps(figures))  # shown with a failure: the whole row, not pytest's cut
    assert figures["accepted_before_fault"] == SIZES.streams, figures
    for group in (figures["before"], figures["during"]):
        assert group["hung"] == 0, figures
        assert group["completed"] + group["explicit_error"] + group["cut"] == group["sent"]
    assert figures["during"]["sent"] == SIZES.during
    assert (figures["leaked_blocks"], figures["running"], figures["waiting"]) == (0, 0, 0), figures
    assert figures["pool_counts_ok"] and figures["workers"] >= 1, figures
    assert figures["recovery_s"] is not None, figures
    # The probe's prefix is 128 words (tokens): at least 7 full 16-token blocks are shared.
    assert figures["cached_tokens_before"] >= 7 * 16, figures
    assert figures["cached_tokens_after"] >= figures["cached_tokens_before"], figures
    return result


async def complete(http: httpx.AsyncClient, tokens: list[int], salt: str,
                   max_tokens: int = 8) -> httpx.Response:
    body = {"prompt": tokens, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "cache_salt": salt}
    return await http.post("/v1/completions", json=body)


async def stream_to_the_end(http: httpx.AsyncClient, tokens: list[int], salt: str,
                            started: asyncio.Event) -> tuple[str, list[str]]:
    """A long streamed completion: (its worker, its SSE data lines); sets ``started`` at the
    first token."""
    body = {"prompt": tokens, "max_tokens": 1500, "temperature": 0, "ignore_eos": True,
            "stream": True, "cache_salt": salt}  # with the prompt, within 128 MiB of fp32 KV
    lines = []
    async with http.stream("POST", "/v1/completions", json=body) as answer:
        assert answer.status_code == 200, await answer.aread()
        async for line in answer.aiter_lines():
            if line.startswith("data:"):
                lines.append(line)
                started.set()
        return answer.headers[WORKER_HEADER], lines


def replica_pid(worker_id: str) -> int:
    """The process id of the chaos application's worker replica ``worker_id``."""
    from cluster.app import WORKER_DEPLOYMENT
    [name] = [name for name in chaos.replica_actors(chaos.APP, WORKER_DEPLOYMENT)
              if name.endswith(f"#{worker_id}")]
    actor = ray.get_actor(name, namespace=chaos.SERVE_NAMESPACE)
    return ray.get(actor.__ray_call__.remote(lambda replica: os.getpid()), timeout=30)


async def transfers(target: chaos.ChaosTarget) -> dict[str, dict]:
    return {s["worker_id"]: s["kv_transfer"] for s in await chaos.worker_stats(target.workers)}


async def test_a_holder_killed_mid_transfer_means_the_prompt_is_computed(target):
    """A worker fetching a prefix from its holder while the holder is killed: the holder is
    frozen (SIGSTOP) once it is busy, so the prefix's next request goes to the other worker,
    whose fetch then waits on it, and killed (SIGKILL) 0.3 s later, within the fetch's
    deadline (as long as computing the 992 tokens takes on one fp32 thread). The request is
    answered as a cold one is, with no transferred token; the failed fetch is counted; the
    holder's own stream, killed mid-stream, ends with an error event that says to send the
    request again; no KV block is left in use. Once Serve has replaced the holder, the index
    credits neither the dead holder nor its replacement with the prefix (case R2 of
    shared/cases/routing.md). It runs first here, on workers without a fetch history: run
    after the other cases, it once saw no fetch tried (a worker that has measured fetches
    slower than computing tries one only every TransferCost.RETRY_S)."""
    salt = uuid.uuid4().hex
    shared = random_prompt(21, 992, VOCAB)
    async with httpx.AsyncClient(base_url=target.base_url, timeout=120) as http:
        first = await complete(http, shared + random_prompt(22, 32, VOCAB), salt, max_tokens=1)
        holder = first.headers[WORKER_HEADER]
        started = asyncio.Event()
        busy = asyncio.create_task(
            stream_to_the_end(http, shared + random_prompt(23, 32, VOCAB), salt, started))
        await asyncio.wait_for(started.wait(), 60)
        await asyncio.sleep(1.0)  # the holder's load reaches the router
        before = await transfers(target)
        pid = await asyncio.to_thread(replica_pid, holder)
        os.kill(pid, signal.SIGSTOP)
        try:
            question = shared + random_prompt(24, 32, VOCAB)
            answer = asyncio.create_task(complete(http, question, salt))
            await asyncio.sleep(0.3)
        finally:
            os.kill(pid, signal.SIGKILL)
        answer = await answer
        busy_worker, busy_lines = await asyncio.wait_for(busy, 60)
        cold = await complete(http, question, uuid.uuid4().hex)
        after = await transfers(target)
        pools = await chaos.drained_pools(target.workers, SIZES.recovery_bound_s)
        while len(after) < target.config.num_workers:  # the next case wants both workers
            await asyncio.sleep(0.5)
            after = await transfers(target)
    worker = answer.headers[WORKER_HEADER]
    assert answer.status_code == 200 and worker != holder, (answer.status_code, answer.text)
    assert answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, answer.text
    assert answer.json()["choices"][0]["text"] == cold.json()["choices"][0]["text"]
    assert after[worker]["failed_fetches"] == before[worker]["failed_fetches"] + 1
    assert after[worker]["imported_blocks"] == before[worker]["imported_blocks"]
    assert busy_worker == holder, busy_worker
    assert "lost mid-stream; send the request again" in busy_lines[-2], busy_lines[-2:]
    assert busy_lines[-1] == "data: [DONE]"
    assert (pools["leaked_blocks"], pools["running"], pools["waiting"]) == (0, 0, 0), pools
    [replacement] = set(after) - {holder, worker}
    assert await credited_blocks(target, shared, salt, [holder, replacement]) == {
        holder: (0, 0), replacement: (0, 0)}


async def credited_blocks(target: chaos.ChaosTarget, prompt: list[int], salt: str,
                          workers: list[str], deadline_s: float = 60.0) -> dict[str, tuple]:
    """The (blocks, tier blocks) of ``prompt``'s chain the index credits to each of
    ``workers``, once none is credited any (a dead worker's entries go when its heartbeats
    stop), or at ``deadline_s``."""
    identity = (await target.workers.describe.remote()).identity
    namespace = identity.with_namespace(CacheNamespace(cache_salt=salt))
    digests = block_digests(namespace.root_digest, prompt, identity.block_size)
    index = RedisIndex(target.redis.url, target.config.key_prefix)
    deadline = time.monotonic() + deadline_s
    try:
        while True:
            held = await index.match(identity.model_key, digests, workers)
            if not any(p.blocks for p in held.values()) or time.monotonic() > deadline:
                return {worker: tuple(prefix) for worker, prefix in held.items()}
            await asyncio.sleep(0.2)
    finally:
        await index.close()


def all_completed(figures: dict) -> bool:
    return (figures["before"]["completed"], figures["during"]["completed"]) == (
        SIZES.streams, SIZES.during)


async def test_redis_killed_and_restarted_empty(target):
    """Nothing fails while Redis is down: routing falls back without the index."""
    result = await strike(target, "redis_restart")
    assert all_completed(result.figures), result.figures
    assert result.figures["index_fallbacks"], result.figures


async def test_index_slower_than_its_deadline(target):
    """Lookups that miss the deadline are counted, and their requests still complete."""
    result = await strike(target, "index_slow")
    assert all_completed(result.figures), result.figures
    assert result.figures["index_fallbacks"].get("reason=index_timeout", 0) > 0, result.figures


async def test_ingress_replica_restarted(target):
    """Streams through the killed ingress cannot get an SSE error event (the process writing
    them is gone): Serve's proxy closes each without the last chunk, which the client sees as
    an incomplete chunked body, at once, never a hang. Requests sent meanwhile wait for the
    replacement (or get 503) and are served."""
    result = await strike(target, "ingress_restart")
    assert {r.failure for r in result.before} <= {None, "broken_stream"}, result.figures
    assert all("incomplete chunked read" in r.error for r in result.before if not r.ok)
    assert set(result.figures["during"]["statuses"]) <= {"200", "503"}, result.figures
    assert result.figures["during"]["cut"] == 0, result.figures


async def test_draft_replica_killed_while_drafting(target):
    """Plain decoding continues: every stream completes with the text of a fault-free run."""
    result = await strike(target, "draft_kill")
    assert all_completed(result.figures), result.figures
    assert result.figures["draft_calls_missed"] > 0, result.figures
    assert result.figures["identical_outputs"] == SIZES.streams, result.figures


# -- the reports' arithmetic (no cluster) ------------------------------------------------------


def record(failure: str | None = None, status: int | None = 200) -> RequestRecord:
    return RequestRecord(label="r", start_s=0.0, failure=failure, http_status=status)


def test_outcomes_separate_explicit_errors_from_cuts_and_hangs():
    records = [record(), record("sse_error"), record("http", 503), record("broken_stream"),
               record("incomplete_stream"), record("timeout", None)]
    assert [chaos.outcome(r) for r in records] == [
        "completed", "explicit_error", "explicit_error", "cut", "cut", "hung"]
    counts = chaos.tally(records)
    assert (counts["sent"], counts["completed"], counts["explicit_error"], counts["cut"],
            counts["hung"]) == (6, 1, 2, 2, 1)
    assert counts["statuses"] == {"200": 4, "503": 1, "None": 1}


def test_counter_increase_treats_a_lower_value_as_a_restart():
    before = {"reason=index_timeout": 5.0, "reason=index_error": 2.0}
    after = {"reason=index_timeout": 9.0, "reason=index_error": 1.0, "reason=index_down": 3.0}
    assert chaos.counter_increase(before, after) == {
        "reason=index_timeout": 4.0, "reason=index_error": 1.0, "reason=index_down": 3.0}
    assert chaos.counter_increase(after, after) == {}


def test_pool_report_flags_blocks_in_use_and_counts_that_do_not_add_up():
    fine = {"blocks_total": 10, "blocks_free": 6, "blocks_evictable": 4, "blocks_in_use": 0,
            "running": 0, "waiting": 0}
    leaking = fine | {"blocks_free": 5, "blocks_in_use": 1, "running": 1}
    assert chaos.pool_report([fine, fine]) == {"workers": 2, "leaked_blocks": 0,
                                               "pool_counts_ok": True, "running": 0,
                                               "waiting": 0}
    assert chaos.pool_report([fine, leaking])["leaked_blocks"] == 1
    assert not chaos.pool_report([fine | {"blocks_free": 7}])["pool_counts_ok"]


def test_soak_rss_slope_is_fitted_on_the_second_half_only():
    # 3 MiB/min before the half-way mark, then flat: the second half's slope is 0.
    samples = [{"t_s": t, "pid": 7, "role": "NalarWorker",
                "rss_mib": 100 + 3 * min(t, 60) / 60} for t in range(0, 121, 5)]
    slopes = soak.rss_slopes(samples, 120.0)
    assert slopes["7"]["slope_second_half_mib_per_min"] == pytest.approx(0.0, abs=1e-9)
    growing = [s | {"rss_mib": 100 + 1.5 * s["t_s"] / 60} for s in samples]
    slope = soak.rss_slopes(growing, 120.0)["7"]["slope_second_half_mib_per_min"]
    assert slope == pytest.approx(1.5)


def test_soak_prompts_fit_the_context_and_the_mix_varies():
    workload = soak.MixedWorkload(max_model_len=1024, long_fraction=0.5, cancel_fraction=0.5,
                                  seed=3)
    items = [workload.next() for _ in range(200)]
    longest = max(i.request.estimated_prompt_tokens + i.request.max_tokens for i in items)
    assert 1024 - soak.PROMPT_MARGIN_TOKENS - 80 <= longest <= 1024 - soak.PROMPT_MARGIN_TOKENS
    assert 60 < sum(i.cancel_after_s is not None for i in items) < 140
    assert {i.sampling["n"] for i in items} == {1, 2}
    assert {i.sampling["temperature"] for i in items} == {0.0, 0.7, 1.0}
    assert any("stop" in i.sampling for i in items) and any("seed" in i.sampling for i in items)


def test_soak_capacity_counts_only_successes_ending_inside_the_window():
    def ended(start_s: float, e2e_s: float, failure: str | None = None) -> RequestRecord:
        return RequestRecord("r", start_s=start_s, e2e_s=e2e_s, failure=failure)

    records = [ended(0.0, 4.0),  # in the warm-up
               ended(3.0, 3.0), ended(8.0, 2.0), ended(12.0, 8.0),  # end at 6, 10 and 20
               ended(6.0, 1.0, failure="http"),  # a refusal
               ended(19.0, 2.0)]  # ends after the window
    assert soak.completions_per_second(records, warmup_s=5.0, end_s=20.0) == pytest.approx(
        3 / 15)


class ScriptedClient:
    """Answers each request after ``service_s``: 503 for every third, 200 otherwise."""

    def __init__(self, service_s: float):
        self.service_s, self.sent, self.sampling = service_s, 0, {}

    async def send(self, request, origin):
        self.sent += 1
        refused = self.sent % 3 == 0
        start = time.perf_counter() - origin
        assert request.label in self.sampling  # the mix's sampling fields go with the request
        await asyncio.sleep(self.service_s)
        return RequestRecord(request.label, start_s=start, e2e_s=self.service_s,
                             failure="http" if refused else None,
                             http_status=503 if refused else 200)


async def test_soak_closed_loop_keeps_its_clients_busy_and_backs_off_on_overload(monkeypatch):
    monkeypatch.setattr(soak, "OVERLOAD_BACKOFF_S", 0.2)
    client = ScriptedClient(service_s=0.05)
    workload = soak.MixedWorkload(1024, 0.15, 0.0, seed=1)
    records = await soak.closed_loop(client, workload, concurrency=2, duration_s=0.6)
    statuses = [r.http_status for r in records]
    assert len(records) == client.sent and client.sampling == {}
    # Each refusal costs its client a back-off four service times long, so the two clients send
    # far fewer than the 24 requests that 0.6 s of back-to-back service would take.
    assert 4 <= len(records) <= 12 and statuses.count(503) == len(records) // 3
    # No client starts a request once the duration is spent.
    assert max(r.start_s for r in records) < 0.6
