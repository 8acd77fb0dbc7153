"""A worker fetching KV from another, with the holder faked: a holder that dies or stalls
mid-transfer means the prompt is computed, never an error, and the failure is counted; a fetch
slower than computing stops being tried."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from helpers import fitted_prompt_costs
from ray.exceptions import RayActorError

from cluster.worker_deployment import NalarWorker, TransferCost
from contract.identity import PromptDigests
from contract.kv_transfer import KVExportRequest, KVSource
from contract.request import GenerationRequest
from workers.block_manager import BlockManager
from workers.block_pool import BlockPool
from workers.kv_transfer import TransferCounters
from workers.step_time import PromptCostModel

DIGESTS = [bytes([n]) * 32 for n in range(62)]
HOLDER = KVSource("holder", 62)


class Holder:
    """``handle.export_kv.remote(...)``, answering as told."""

    def __init__(self, behaviour: str):
        self.behaviour = behaviour
        self.asked: list[KVExportRequest] = []
        self.export_kv = SimpleNamespace(remote=self._remote)

    async def _remote(self, request: KVExportRequest):
        self.asked.append(request)
        if self.behaviour == "dies":
            raise RayActorError()
        if self.behaviour == "stalls":
            await asyncio.Event().wait()
        return ["block"] * len(request.digests)


class OnEngineThread:
    async def call(self, fn, *args):
        return fn(*args)


def block_manager(costs: PromptCostModel | None = None) -> BlockManager:
    """A block manager of 16-token blocks whose recompute cost is ``costs``' (unmeasured
    where None)."""
    return BlockManager(BlockPool(64, 16), costs)


def fetcher(holder: Holder, recompute_s_per_token: float = 1e-3) -> NalarWorker:
    worker = object.__new__(NalarWorker)
    worker.worker_id = "me"
    imported = []
    worker.engine = SimpleNamespace(
        pool=SimpleNamespace(tier=object()), transfers=TransferCounters(),
        fetch_range=lambda request, credited: (2, min(credited, 61)),
        import_blocks=lambda request, first, blocks: imported.append((first, blocks))
        or len(blocks))
    worker.imported = imported
    worker.async_engine = OnEngineThread()
    worker.transfer_cost = TransferCost(block_manager(fitted_prompt_costs(recompute_s_per_token)))
    worker._worker_handle = holder
    return worker


def request(source: KVSource | None = HOLDER) -> GenerationRequest:
    return GenerationRequest("r", list(range(1000)), prompt_digests=PromptDigests(
        "key", DIGESTS), kv_source=source)


async def test_the_blocks_it_lacks_are_fetched_from_the_holder_and_imported():
    holder = Holder("answers")
    worker = fetcher(holder)
    await worker._fetch_prefix(request())
    assert holder.asked == [KVExportRequest("holder", DIGESTS[2:61])]
    assert worker.imported == [(2, ["block"] * 59)]
    assert worker.transfer_cost.fetch_s_per_block is not None


@pytest.mark.parametrize("behaviour", ["dies", "stalls"])
async def test_a_holder_that_dies_or_stalls_means_compute_and_is_counted(behaviour):
    worker = fetcher(Holder(behaviour), recompute_s_per_token=1e-4)  # a 0.25 s deadline
    started = asyncio.get_running_loop().time()
    await worker._fetch_prefix(request())  # never raises
    assert asyncio.get_running_loop().time() - started < 2
    assert worker.engine.transfers.failed_fetches == 1
    assert worker.imported == []


async def test_no_fetch_without_a_source_a_tier_or_when_fetching_is_slower():
    holder = Holder("answers")
    worker = fetcher(holder)
    await worker._fetch_prefix(request(None))
    await worker._fetch_prefix(request(KVSource("me", 62)))
    worker.transfer_cost.observe(60, 60.0)  # measured: far slower than computing
    await worker._fetch_prefix(request())
    worker.transfer_cost.fetch_s_per_block = None
    worker.engine.pool.tier = None
    await worker._fetch_prefix(request())
    assert holder.asked == []


def test_the_fetch_deadline_is_what_computing_would_take():
    cost = TransferCost(block_manager())
    assert cost.deadline_s(0, 10) == TransferCost.UNMEASURED_DEADLINE_S
    cost = TransferCost(block_manager(fitted_prompt_costs(0.01)))
    assert cost.deadline_s(0, 10) == pytest.approx(1.6)
    assert cost.deadline_s(0, 1) == TransferCost.MIN_DEADLINE_S
    cost.observe(10, 2.0)
    assert cost.deadline_s(0, 10) is None  # 0.2 s per block against 0.16 s computing


def test_the_fetch_deadline_grows_with_the_depth_of_the_blocks():
    # A token 100 blocks deep attends to 1,600 more keys: at 1e-6 s a key, 1.6 ms more.
    cost = TransferCost(block_manager(fitted_prompt_costs(0.01, per_key_s=1e-6)))
    shallow = 16 * sum(0.01 + 1e-6 * (b * 16 + 8) for b in range(10))
    deep = 16 * sum(0.01 + 1e-6 * (b * 16 + 8) for b in range(100, 110))
    assert cost.deadline_s(0, 10) == pytest.approx(shallow)
    assert cost.deadline_s(100, 10) == pytest.approx(deep)
    assert deep - shallow == pytest.approx(160 * 1600 * 1e-6)


def test_fetching_measured_slower_is_tried_again_after_a_while():
    # A fetch slowed by a busy holder must not stop fetching for good: without fetches the
    # average never moves again.
    now = [0.0]
    cost = TransferCost(block_manager(fitted_prompt_costs(0.01)), clock=lambda: now[0])
    assert cost.deadline_s(0, 10) == pytest.approx(1.6)
    cost.observe(10, 2.0)  # 0.2 s per block against 0.16 s computing
    now[0] = TransferCost.RETRY_S - 1
    assert cost.deadline_s(0, 10) is None
    now[0] = TransferCost.RETRY_S
    assert cost.deadline_s(0, 10) == pytest.approx(1.6)  # one try
    now[0] += 1
    assert cost.deadline_s(0, 10) is None
    cost.observe(10, 0.5)  # that try was fast: the average falls below computing
    assert cost.deadline_s(0, 10) == pytest.approx(1.6)


def test_the_tier_load_and_fetch_costs_are_reported_in_tokens_of_work():
    worker = object.__new__(NalarWorker)
    tier = SimpleNamespace(counters=SimpleNamespace(load_s_per_block=0.002))
    worker.engine = SimpleNamespace(pool=SimpleNamespace(tier=tier))
    assert worker._tier_tokens(worker._tier_load_s_per_block(), 1500.0) == 3
    assert worker._tier_tokens(None, 1500.0) is None  # not measured yet
    # A fetch faster than half a token's work still costs one: at 0 an idle worker that would
    # fetch a whole prefix tied with its holder, and took the repeat from it.
    assert worker._tier_tokens(0.0002, 1500.0) == 1
    assert worker._tier_tokens(0.002, 0.0) == 1  # no rate measured yet
    worker.engine.pool.tier = None  # no tier: nothing to load, nothing to fetch into
    assert worker._tier_load_s_per_block() is None
    assert worker._tier_tokens(0.002, 1500.0) is None


async def test_an_export_naming_another_worker_is_refused_at_once():
    # The router sends an export whose holder is gone to any replica; it must not answer
    # with its own blocks under the holder's name.
    worker = object.__new__(NalarWorker)
    worker.worker_id = "me"
    worker.async_engine = OnEngineThread()
    worker.engine = SimpleNamespace(export_blocks=lambda digests: ["block"] * len(digests))
    assert await worker.export_kv(KVExportRequest("me", DIGESTS[:2])) == ["block"] * 2
    with pytest.raises(LookupError, match="worker gone is gone"):
        await worker.export_kv(KVExportRequest("gone", DIGESTS[:2]))
    # a starting worker's warm-up, routed here before the router knows its caller
    assert await worker.export_kv(KVExportRequest("starting", [])) == []
