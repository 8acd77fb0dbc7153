"""The second KV tier (``workers.kv_tier``) in the engine: blocks evicted from the working pool
move to a file on disk (or host memory) under the same digest and come back on a hit, with
output equal to cold in fp32; a corrupt block is recomputed, a full tier drops its oldest, a
disk that cannot hold the file means no tier, one that turns read-only or fails reads later
costs recomputes (counted), never a request; and the index hears where the worker holds each
digest (its pool, its tier), so that replaying the events gives exactly the worker's state."""

from __future__ import annotations

import dataclasses
import os

import pytest
from helpers import cold, fitted_prompt_costs, greedy, output_ids, random_prompt, serve

from contract.identity import CacheNamespace, block_digests
from contract.kv_events import KVEvent
from workers.config import EngineConfig
from workers.kv_cache import PagedKVCache

BLOCK = 16
POOL_BLOCKS = 12
PROMPT = random_prompt(seed=1, length=4 * BLOCK + 6, vocab=5000)  # 4 full blocks, then more
FILLERS = [random_prompt(seed=s, length=5 * BLOCK, vocab=5000) for s in (2, 3, 4)]


def tier_engine(make_engine, smollm, tmp_path, tier_blocks: int = 32, medium: str = "disk",
                **overrides):
    per_block = PagedKVCache.bytes_per_block(smollm.model.config, BLOCK, smollm.dtype)
    return make_engine(smollm, num_blocks=POOL_BLOCKS, kv_tier_bytes=tier_blocks * per_block,
                       kv_tier_medium=medium, kv_tier_dir=str(tmp_path), **overrides)


def evict_to_tier(engine) -> list[bytes]:
    """Serves the prompt, then fillers that push its blocks out of the working pool; returns
    the prompt's full-block digests, now in the tier only."""
    serve(engine, greedy("warm", PROMPT, max_tokens=4, ignore_eos=True))
    for n, filler in enumerate(FILLERS):
        serve(engine, greedy(f"filler-{n}", filler, max_tokens=4, ignore_eos=True))
    digests = digests_of(engine, PROMPT)
    assert all(d in engine.pool.tier for d in digests)
    assert not any(d in engine.pool._by_digest for d in digests)
    assert set(digests) <= set(engine.pool.cached_digests())  # the worker still holds them
    return digests


def digests_of(engine, prompt: list[int]) -> list[bytes]:
    root = engine.identity.root_for(CacheNamespace(), None)
    return block_digests(root, prompt, BLOCK)


def removed(events: list[KVEvent], medium: str) -> set[bytes]:
    return {d for event in events if (event.kind, event.medium) == ("removed", medium)
            for d in event.digests}


def replayed(events: list[KVEvent]) -> dict[str, set[bytes]]:
    """What an index that heard ``events`` from the worker's start holds, per medium."""
    media: dict[str, set[bytes]] = {"pool": set(), "tier": set()}
    for event in events:
        for medium, held in media.items():
            if event.kind == "cleared":
                held.clear()
            elif event.medium == medium:
                (held.update if event.kind == "stored" else held.difference_update)(event.digests)
    return media


def assert_index_view_is_the_state(engine, events: list[KVEvent]) -> dict[str, set[bytes]]:
    view = replayed(events)
    assert view == {"pool": set(engine.pool._by_digest), "tier": set(engine.pool.tier.digests())}
    return view


@pytest.mark.parametrize("medium", ["disk", "host"])
def test_an_evicted_prefix_comes_back_from_the_tier_and_output_equals_cold(
        smollm, make_engine, tmp_path, medium):
    engine = tier_engine(make_engine, smollm, tmp_path, medium=medium)
    assert engine.pool.tier.slots.medium == medium
    assert os.listdir(tmp_path) == []  # a file tier's file is unlinked; a host tier has none
    request = greedy("again", PROMPT, max_tokens=8, ignore_eos=True)
    reference = cold(engine, request)
    digests = evict_to_tier(engine)
    events = engine.drain_events()
    view = assert_index_view_is_the_state(engine, events)
    assert set(digests) <= view["tier"] and not set(digests) & view["pool"]  # moved, not lost

    tier_tokens = engine.scheduler.counters.tier_hit_tokens
    output, cached, prefilled = serve(engine, greedy("again", PROMPT, max_tokens=8,
                                                     ignore_eos=True))
    assert output == reference
    assert cached == 4 * BLOCK and prefilled == len(PROMPT) - 4 * BLOCK
    assert engine.scheduler.counters.tier_hit_tokens - tier_tokens == 4 * BLOCK
    assert engine.scheduler.counters.transfer_hit_tokens == 0
    assert engine.pool.tier.counters.loaded_blocks == 4
    view = assert_index_view_is_the_state(engine, events + engine.drain_events())
    assert set(digests) <= view["pool"] & view["tier"]  # loaded back; the tier keeps a copy
    engine.pool.check_invariants()


def flip_stored_bit(tier, digest: bytes, offset: int) -> None:
    """Flips one bit of ``digest``'s stored bytes, where the tier keeps them."""
    slot = tier._entries[digest].slot
    if tier.slots.medium == "host":
        tier.slots._slab[slot, offset] ^= 0x10
        return
    offset += slot * tier.block_bytes
    byte = os.pread(tier.slots._fd, 1, offset)[0]
    os.pwrite(tier.slots._fd, bytes([byte ^ 0x10]), offset)


@pytest.mark.parametrize("medium", ["disk", "host"])
def test_a_corrupt_stored_block_is_recomputed_never_used(smollm, make_engine, tmp_path,
                                                         medium):
    engine = tier_engine(make_engine, smollm, tmp_path, medium=medium)
    reference = cold(engine, greedy("ref", PROMPT, max_tokens=8, ignore_eos=True))
    digests = evict_to_tier(engine)
    engine.drain_events()
    tier = engine.pool.tier
    flip_stored_bit(tier, digests[1], 7)

    output, cached, _ = serve(engine, greedy("again", PROMPT, max_tokens=8, ignore_eos=True))
    assert output == reference
    assert cached == BLOCK  # block 0 from disk; block 1 failed its CRC, the rest follow it
    assert tier.counters.corrupt_blocks == 1
    assert digests[1] not in tier
    assert digests[1] in removed(engine.drain_events(), "tier")


def test_a_damaged_tier_heals_once_the_prompt_is_computed_again(smollm, make_engine, tmp_path):
    """Blocks 1-3 damaged: the first request loads block 0 and computes the rest, and the
    tier forgets blocks 2 and 3 with block 1, so that their fresh copies take their place
    once evicted: the next request loads all four. (Kept, each request got one block
    further, failing the next check.)"""
    engine = tier_engine(make_engine, smollm, tmp_path)
    reference = cold(engine, greedy("ref", PROMPT, max_tokens=8, ignore_eos=True))
    digests = evict_to_tier(engine)
    tier = engine.pool.tier
    for digest in digests[1:4]:
        flip_stored_bit(tier, digest, 7)
    engine.drain_events()

    output, cached, _ = serve(engine, greedy("damaged", PROMPT, max_tokens=8, ignore_eos=True))
    assert (output, cached, tier.counters.corrupt_blocks) == (reference, BLOCK, 1)
    assert [digest in tier for digest in digests[:4]] == [True, False, False, False]
    assert set(digests[1:4]) <= removed(engine.drain_events(), "tier")

    assert evict_to_tier(engine) == digests
    # What the tier holds is under test, not whether loading pays: the one load measured so
    # far, slow on a busy machine, must not turn the tier's blocks down.
    tier.counters.load_s_per_block = 1e-9
    output, cached, _ = serve(engine, greedy("healed", PROMPT, max_tokens=8, ignore_eos=True))
    assert (output, cached, tier.counters.corrupt_blocks) == (reference, 4 * BLOCK, 1)
    engine.pool.check_invariants()


def test_a_full_tier_drops_its_oldest_block_and_the_index_hears_of_it(smollm, make_engine,
                                                                      tmp_path):
    engine = tier_engine(make_engine, smollm, tmp_path, tier_blocks=2)
    serve(engine, greedy("warm", PROMPT, max_tokens=4, ignore_eos=True))
    for n, filler in enumerate(FILLERS):
        serve(engine, greedy(f"filler-{n}", filler, max_tokens=4, ignore_eos=True))
    tier = engine.pool.tier
    assert len(tier) == 2 and tier.counters.dropped_blocks == tier.counters.saved_blocks - 2
    events = engine.drain_events()
    assert len(removed(events, "tier")) == tier.counters.dropped_blocks
    assert_index_view_is_the_state(engine, events)
    engine.pool.check_invariants()


def test_the_tier_is_used_only_while_loading_beats_recomputing(smollm, make_engine, tmp_path):
    engine = tier_engine(make_engine, smollm, tmp_path)
    evict_to_tier(engine)
    engine.block_manager.prompt_costs = fitted_prompt_costs(1e-6)  # 16 µs a block
    engine.pool.tier.counters.load_s_per_block = 1e-3
    _, cached, _ = serve(engine, greedy("again", PROMPT, max_tokens=2, ignore_eos=True))
    assert cached == 0


def test_another_namespace_never_hits_the_tier(smollm, make_engine, tmp_path):
    engine = tier_engine(make_engine, smollm, tmp_path)
    evict_to_tier(engine)
    other = CacheNamespace(cache_salt="another-tenant")
    _, cached, _ = serve(engine, greedy("other", PROMPT, max_tokens=2, ignore_eos=True,
                                        namespace=other))
    assert cached == 0


def test_the_tier_medium_follows_the_device_unless_asked():
    def medium(asked: str, device_type: str) -> str:
        return EngineConfig(kv_tier_medium=asked).tier_medium(device_type)

    assert medium("auto", "cuda") == "host"
    assert medium("auto", "cpu") == "disk"
    assert medium("host", "cpu") == "host"
    assert medium("disk", "cuda") == "disk"


@pytest.mark.parametrize("fault", ["missing directory", "disk full"])
def test_a_disk_that_cannot_hold_the_tier_means_no_tier(smollm, make_engine, tmp_path,
                                                        monkeypatch, caplog, fault):
    if fault == "missing directory":
        tmp_path = tmp_path / "nowhere"
    else:
        def full(fd, offset, length):
            raise OSError(28, "No space left on device")
        monkeypatch.setattr(os, "posix_fallocate", full)
    engine = tier_engine(make_engine, smollm, tmp_path)
    assert engine.pool.tier is None
    assert "no second KV tier" in caplog.text
    output, _, _ = serve(engine, greedy("works", PROMPT, max_tokens=2, ignore_eos=True))
    assert len(output) == 2
    assert os.listdir(tmp_path if tmp_path.exists() else tmp_path.parent) == []


def reopened(fd: int, flags: int) -> int:
    """Another descriptor of the (unlinked) file ``fd`` names, opened with ``flags``."""
    return os.open(f"/proc/self/fd/{fd}", flags)


def break_disk(tier, flags: int) -> None:
    """From now on the tier's file answers only what ``flags`` allows: ``os.O_RDONLY`` as a
    disk remounted read-only does (writes fail), ``os.O_WRONLY`` as one whose reads fail."""
    broken = reopened(tier.slots._fd, flags)
    os.dup2(broken, tier.slots._fd)
    os.close(broken)


def test_a_disk_turned_read_only_at_run_time_costs_spills_not_requests(smollm, make_engine,
                                                                      tmp_path):
    engine = tier_engine(make_engine, smollm, tmp_path)
    request = greedy("again", PROMPT, max_tokens=8, ignore_eos=True)
    reference = cold(engine, request)
    tier = engine.pool.tier
    break_disk(tier, os.O_RDONLY)
    serve(engine, greedy("warm", PROMPT, max_tokens=4, ignore_eos=True))
    for n, filler in enumerate(FILLERS):
        serve(engine, greedy(f"filler-{n}", filler, max_tokens=4, ignore_eos=True))
    assert len(tier) == 0 and tier.counters.saved_blocks == 0
    assert tier.counters.io_errors > 0  # every eviction tried, and each failure counted
    assert assert_index_view_is_the_state(engine, engine.drain_events())["tier"] == set()

    output, cached, _ = serve(engine, request)
    assert output == reference and cached == 0
    engine.pool.check_invariants()
    assert engine.pool.num_available == POOL_BLOCKS  # nothing leaked


def test_a_disk_whose_reads_fail_costs_recomputes_not_requests(smollm, make_engine, tmp_path):
    engine = tier_engine(make_engine, smollm, tmp_path)
    request = greedy("again", PROMPT, max_tokens=8, ignore_eos=True)
    reference = cold(engine, request)
    digests = evict_to_tier(engine)
    events = engine.drain_events()
    tier = engine.pool.tier
    break_disk(tier, os.O_WRONLY)

    output, cached, _ = serve(engine, request)
    assert output == reference and cached == 0
    assert tier.counters.io_errors == 1 and tier.counters.loaded_blocks == 0
    assert digests[0] not in tier  # the one it tried is dropped; the index hears of it
    view = assert_index_view_is_the_state(engine, events + engine.drain_events())
    assert digests[0] not in view["tier"]
    engine.pool.check_invariants()


# -- blocks from another worker ------------------------------------------------------------------

def holder_and_requester(make_engine, smollm, tmp_path):
    holder = make_engine(smollm, num_blocks=32)
    requester = tier_engine(make_engine, smollm, tmp_path)
    serve(holder, greedy("warm", PROMPT, max_tokens=4, ignore_eos=True))
    return holder, requester


@pytest.mark.parametrize("into", ["pool", "tier"])
def test_blocks_fetched_from_another_worker_are_hits_and_output_equals_cold(
        smollm, make_engine, tmp_path, into):
    """Fetched blocks go into the working pool where it has room for the run, else into the
    tier; either way the first request counts them as a transfer, and the next as its own."""
    holder, requester = holder_and_requester(make_engine, smollm, tmp_path)
    request = greedy("again", PROMPT, max_tokens=8, ignore_eos=True)
    reference = cold(make_engine(smollm, num_blocks=32), request)
    requester.drain_events()
    digests = digests_of(requester, PROMPT)
    assert requester.fetch_range(request, 9) == (0, 4)
    whole = greedy("whole", PROMPT[:4 * BLOCK], max_tokens=1, ignore_eos=True)
    assert requester.fetch_range(whole, 4) == (0, 3)  # its last block is computed anyway
    blocks = holder.export_blocks(digests)
    assert [b.digest for b in blocks] == digests
    pool = requester.pool
    busy = [pool.allocate() for _ in range(pool.num_available - 3)] if into == "tier" else []
    assert requester.import_blocks(request, 0, blocks) == 4
    pool.release(block.block_id for block in busy)
    assert requester.fetch_range(request, 9) == (4, 4)
    events = requester.drain_events()
    assert replayed(events)[into] == set(digests)  # the index learns where it holds them
    assert replayed(events)["tier" if into == "pool" else "pool"] == set()
    pool.check_invariants()

    chunks = requester.generate([greedy("again", PROMPT, max_tokens=8, ignore_eos=True)])
    last = chunks["again"][-1]
    assert output_ids(chunks["again"]) == reference
    assert (last.cached_tokens, last.transfer_tokens, last.tier_tokens) == (4 * BLOCK,
                                                                             4 * BLOCK, 0)
    counters = requester.scheduler.counters
    assert (counters.transfer_hit_tokens, counters.tier_hit_tokens) == (4 * BLOCK, 0)
    assert (holder.transfers.exported_blocks, requester.transfers.imported_blocks) == (4, 4)
    assert requester.pool.tier.counters.loaded_blocks == (4 if into == "tier" else 0)

    chunks = requester.generate([greedy("later", PROMPT, max_tokens=2, ignore_eos=True)])
    last = chunks["later"][-1]
    assert (last.cached_tokens, last.transfer_tokens, last.tier_tokens) == (4 * BLOCK, 0, 0)


def test_fetched_blocks_extend_the_prefix_the_pool_holds(smollm, make_engine, tmp_path):
    holder, requester = holder_and_requester(make_engine, smollm, tmp_path)
    serve(requester, greedy("head", PROMPT[:2 * BLOCK + 1], max_tokens=1, ignore_eos=True))
    request = greedy("again", PROMPT, max_tokens=8, ignore_eos=True)
    assert requester.fetch_range(request, 4) == (2, 4)
    blocks = holder.export_blocks(digests_of(requester, PROMPT)[2:])
    assert requester.import_blocks(request, 2, blocks) == 2
    assert len(requester.pool.tier) == 0
    chunks = requester.generate([request])["again"]
    assert (chunks[-1].cached_tokens, chunks[-1].transfer_tokens) == (4 * BLOCK, 2 * BLOCK)
    assert output_ids(chunks) == cold(make_engine(smollm, num_blocks=32), request)


@pytest.mark.parametrize("into", ["pool", "tier"])
def test_blocks_computed_while_the_fetch_ran_are_accepted_not_counted_as_imported(
        smollm, make_engine, tmp_path, into):
    """The requester computed the prompt's first blocks (a request beside the one that asked)
    before the holder's copies came: they are accepted, since they are the same blocks, but
    counted as already held; the one block it lacked is imported."""
    holder, requester = holder_and_requester(make_engine, smollm, tmp_path)
    request = greedy("again", PROMPT, max_tokens=8, ignore_eos=True)
    blocks = holder.export_blocks(digests_of(requester, PROMPT))
    serve(requester, greedy("beside", PROMPT[:3 * BLOCK + 1], max_tokens=1, ignore_eos=True))
    pool = requester.pool
    busy = [pool.allocate() for _ in range(pool.num_available - 3)] if into == "tier" else []
    assert requester.import_blocks(request, 0, blocks) == 4
    pool.release(block.block_id for block in busy)
    transfers = requester.transfers
    assert (transfers.imported_blocks, transfers.already_held_blocks,
            transfers.rejected_blocks) == (1, 3, 0)
    assert transfers.imported_bytes == pool.tier.block_bytes
    assert requester.fetch_range(request, 9) == (4, 4)
    chunks = requester.generate([request])["again"]
    assert chunks[-1].cached_tokens == 4 * BLOCK
    assert output_ids(chunks) == cold(make_engine(smollm, num_blocks=32), request)
    pool.check_invariants()


def tampered(block, **changes):
    return dataclasses.replace(block, **changes)


@pytest.mark.parametrize("fault", ["other tokens", "bytes changed", "another prefix",
                                   "wrong size"])
def test_a_fetched_block_that_fails_a_check_is_never_used(smollm, make_engine, tmp_path, fault):
    holder, requester = holder_and_requester(make_engine, smollm, tmp_path)
    request = greedy("again", PROMPT, max_tokens=2, ignore_eos=True)
    blocks = holder.export_blocks(digests_of(requester, PROMPT))
    second = blocks[1]
    if fault == "other tokens":
        second = tampered(second, token_ids=(7,) * BLOCK)
    elif fault == "bytes changed":
        kv = second.kv.copy()
        kv[100] ^= 0xFF
        second = tampered(second, kv=kv)
    elif fault == "another prefix":
        second = tampered(second, check=bytes(16))
    else:
        second = tampered(second, kv=second.kv[:-2])
    assert requester.import_blocks(request, 0, [blocks[0], second, *blocks[2:]]) == 1
    assert requester.transfers.rejected_blocks == 3
    _, cached, _ = serve(requester, request)
    assert cached == BLOCK
