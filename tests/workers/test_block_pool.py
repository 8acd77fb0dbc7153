"""The block pool: reference counts, verified lookup, LRU eviction and digest-level events."""

from __future__ import annotations

import pytest
from helpers import fitted_prompt_costs

from contract.identity import block_digests
from contract.kv_events import KVEvent, decode_events, encode_events
from contract.request import GenerationRequest
from workers.block_manager import BlockManager
from workers.block_pool import BlockPool, NoFreeBlocksError
from workers.sequence import Sequence

BLOCK = 4


ROOT = b"\x00" * 32  # the identity root digest every test chain starts from


def digest(n: int) -> bytes:
    return bytes([n]) * 32


def tokens(n: int) -> list[int]:
    return [n] * BLOCK


def assert_accounted(pool: BlockPool) -> None:
    assert pool.num_free + pool.num_evictable + pool.num_in_use == pool.num_blocks
    assert pool.num_in_use == sum(1 for b in pool.blocks if b.ref_count > 0)


def cached_table(pool: BlockPool, first: int, count: int) -> list[int]:
    """Allocate ``count`` blocks and register them under digests ``first, first + 1, ...``."""
    table = []
    for n in range(first, first + count):
        block = pool.allocate()
        pool.register(block, digest(n), tokens(n), ROOT)
        table.append(block.block_id)
    return table


def test_empty_budget_is_refused():
    with pytest.raises(ValueError, match="holds no block"):
        BlockPool(0, BLOCK)


def test_allocate_references_blocks_and_runs_out():
    pool = BlockPool(3, BLOCK)
    blocks = [pool.allocate() for _ in range(3)]
    assert [b.block_id for b in blocks] == [0, 1, 2]
    assert [b.ref_count for b in blocks] == [1, 1, 1]
    assert (pool.num_free, pool.num_evictable, pool.num_in_use) == (0, 0, 3)
    with pytest.raises(NoFreeBlocksError):
        pool.allocate()
    assert_accounted(pool)


def test_refcounts_keep_a_shared_block_in_use_until_the_last_release():
    pool = BlockPool(4, BLOCK)
    (block_id,) = cached_table(pool, 1, 1)
    block = pool.lookup(digest(1), tokens(1), ROOT)
    assert block is pool.blocks[block_id]
    pool.acquire(block)
    assert block.ref_count == 2
    pool.release([block_id])
    assert (block.ref_count, pool.num_in_use, pool.num_evictable) == (1, 1, 0)
    pool.release([block_id])
    assert (block.ref_count, pool.num_in_use, pool.num_evictable) == (0, 0, 1)
    assert_accounted(pool)
    # an unreferenced cached block is revived by acquire and leaves the LRU
    pool.acquire(block)
    assert (block.ref_count, pool.num_in_use, pool.num_evictable) == (1, 1, 0)
    assert_accounted(pool)


def test_release_more_often_than_acquired_raises():
    pool = BlockPool(2, BLOCK)
    block = pool.allocate()
    pool.release([block.block_id])
    with pytest.raises(RuntimeError, match="released more often than acquired"):
        pool.release([block.block_id])
    with pytest.raises(RuntimeError, match="released more often than acquired"):
        pool.release([1])  # never allocated


def test_released_block_without_digest_is_free_not_cached():
    pool = BlockPool(2, BLOCK)
    block = pool.allocate()
    pool.release([block.block_id])
    assert (pool.num_free, pool.num_evictable) == (2, 0)
    assert pool.drain_events() == []


def test_lookup_verifies_token_ids():
    pool = BlockPool(2, BLOCK)
    cached_table(pool, 5, 1)
    assert pool.lookup(digest(5), tokens(5), ROOT) is not None
    assert pool.lookup(digest(5), tokens(6), ROOT) is None  # same digest, other tokens
    assert pool.lookup(digest(6), tokens(5), ROOT) is None


def test_tail_blocks_of_a_released_table_are_evicted_first():
    pool = BlockPool(3, BLOCK)
    table = cached_table(pool, 1, 3)
    pool.drain_events()
    pool.release(reversed(table))  # what BlockManager.free passes: tail first
    assert pool.num_evictable == 3
    evicted = []
    for _ in range(3):
        pool.allocate()
        (event,) = pool.drain_events()
        assert event.kind == "removed"
        evicted.extend(event.digests)
    assert evicted == [digest(3), digest(2), digest(1)]
    assert pool.lookup(digest(1), tokens(1), ROOT) is None


def test_lru_evicts_the_least_recently_released_table_first_and_hits_refresh():
    pool = BlockPool(4, BLOCK)
    a = cached_table(pool, 1, 2)
    b = cached_table(pool, 3, 2)
    pool.release(reversed(a))
    pool.release(reversed(b))
    # a hit on a's head moves it to the most recently used end
    head = pool.lookup(digest(1), tokens(1), ROOT)
    pool.acquire(head)
    pool.release([head.block_id])
    pool.drain_events()
    order = []
    for _ in range(4):
        pool.allocate()
        order.extend(pool.drain_events()[0].digests)
    assert order == [digest(2), digest(4), digest(3), digest(1)]


def test_block_manager_free_releases_tail_first():
    pool = BlockPool(8, BLOCK)
    manager = BlockManager(pool)
    root = b"\x01" * 32
    prompt = list(range(1, 13))  # three full blocks
    seq = Sequence(GenerationRequest("r", prompt), root, BLOCK)
    manager.admit(seq, [], len(prompt))
    manager.commit(seq, len(prompt))
    assert pool.drain_events() == [KVEvent("stored", block_digests(root, prompt, BLOCK))]
    manager.free(seq)
    assert (seq.block_table, seq.num_computed_tokens, pool.num_evictable) == ([], 0, 3)
    evicted = []
    for _ in range(8):
        pool.allocate()
        evicted.extend(d for e in pool.drain_events() for d in e.digests)
    assert evicted == list(reversed(block_digests(root, prompt, BLOCK)))


def test_events_are_per_digest_and_merged_in_order():
    pool = BlockPool(3, BLOCK)
    first = pool.allocate()
    twin = pool.allocate()
    pool.register(first, digest(1), tokens(1), ROOT)
    pool.register(twin, digest(1), tokens(1), ROOT)  # same prefix computed twice at once
    assert not pool.register(first, digest(9), tokens(9), ROOT)  # a cached block keeps its digest
    assert twin.digest is None and first.digest == digest(1)
    other = pool.allocate()
    pool.register(other, digest(2), tokens(2), ROOT)
    assert pool.drain_events() == [KVEvent("stored", [digest(1), digest(2)])]
    assert pool.drain_events() == []

    pool.release([twin.block_id, first.block_id, other.block_id])
    # the private twin is simply free; the two cached blocks are evictable
    assert (pool.num_free, pool.num_evictable, pool.num_in_use) == (1, 2, 0)
    pool.allocate()  # takes the free block: no event
    assert pool.drain_events() == []
    pool.allocate()
    pool.allocate()
    assert pool.drain_events() == [KVEvent("removed", [digest(1), digest(2)])]
    assert_accounted(pool)


def test_stored_again_only_after_removed():
    pool = BlockPool(1, BLOCK)
    (block_id,) = cached_table(pool, 1, 1)
    pool.release([block_id])
    block = pool.allocate()  # evicts digest 1
    pool.register(block, digest(1), tokens(1), ROOT)
    assert pool.drain_events() == [KVEvent("stored", [digest(1)]), KVEvent("removed", [digest(1)]),
                                   KVEvent("stored", [digest(1)])]


def test_reset_cache_forgets_every_prefix_with_one_cleared_event():
    pool = BlockPool(4, BLOCK)
    table = cached_table(pool, 1, 3)
    pool.release([table[0]])  # one evictable, two in use
    pool.drain_events()
    pool.reset_cache()
    assert pool.drain_events() == [KVEvent("cleared")]
    assert (pool.num_free, pool.num_evictable, pool.num_in_use) == (2, 0, 2)
    assert all(pool.lookup(digest(n), tokens(n), ROOT) is None for n in (1, 2, 3))
    pool.release(table[1:])  # in-use blocks became private: they come back free, no events
    assert (pool.num_free, pool.num_evictable) == (4, 0)
    assert pool.drain_events() == []


def test_event_batches_round_trip_through_msgpack():
    events = [KVEvent("stored", [digest(1), digest(2)]), KVEvent("removed", [digest(1)]),
              KVEvent("cleared")]
    assert decode_events(encode_events(events)) == events
    with pytest.raises(ValueError, match="unknown KV event kind"):
        decode_events(encode_events([KVEvent("bogus", [])]))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="malformed"):
        decode_events(b"\xc1")


def test_register_reports_a_digest_collision():
    pool = BlockPool(3, BLOCK)
    holder, same, other = pool.allocate(), pool.allocate(), pool.allocate()
    assert pool.register(holder, digest(1), tokens(1), ROOT)
    assert pool.register(same, digest(1), tokens(1), ROOT)  # an identical prefix: no collision
    assert not pool.register(other, digest(1), tokens(2), ROOT)  # same digest, other tokens
    assert (same.digest, other.digest) == (None, None)
    assert pool.drain_events() == [KVEvent("stored", [digest(1)])]


def test_blocks_after_a_collision_are_not_registered_until_it_is_gone():
    """A block computed after a colliding block must not be found under the colliding chain."""
    pool = BlockPool(8, BLOCK)
    manager = BlockManager(pool)
    root = b"\x02" * 32
    prompt = list(range(1, 13))
    chain = block_digests(root, prompt, BLOCK)
    squatter = pool.allocate()  # holds block 0's digest with other tokens: a collision
    pool.register(squatter, chain[0], tokens(99), ROOT)
    pool.drain_events()

    seq = Sequence(GenerationRequest("r", prompt), root, BLOCK)
    manager.admit(seq, manager.cached_prefix(seq), len(prompt))
    assert seq.num_computed_tokens == 0  # the token comparison refused the hit
    manager.commit(seq, len(prompt))
    assert seq.num_registered_blocks == 0
    assert pool.drain_events() == []  # neither block 0 nor blocks 1, 2 chained from it
    assert manager.cached_prefix(seq) == []

    pool.release([squatter.block_id])
    for _ in range(5):  # 4 free blocks, then the squatter is evicted
        pool.allocate()
    assert pool.drain_events() == [KVEvent("removed", [chain[0]])]
    manager.commit(seq, 0)  # the next commit retries: the chain is the sequence's own now
    assert seq.num_registered_blocks == 3
    assert pool.drain_events() == [KVEvent("stored", chain)]
    assert [b.block_id for b in manager.cached_prefix(seq)] == seq.block_table[:2]


def chained(pool: BlockPool, chain: list[tuple[bytes, list[int]]]) -> list:
    """Allocate and register blocks that extend one another: ``(digest, tokens)`` each."""
    blocks: list = []
    for block_digest, block_tokens in chain:
        block = pool.allocate()
        parent_digest, parent = (blocks[-1].digest, blocks[-1]) if blocks else (ROOT, None)
        assert pool.register(block, block_digest, block_tokens, parent_digest, parent)
        blocks.append(block)
    return blocks


def test_a_hit_needs_the_parent_digest_it_was_computed_after():
    """Case P6's chain collision: the same tokens after another prefix, under the same digest."""
    pool = BlockPool(4, BLOCK)
    head, tail = chained(pool, [(digest(1), tokens(1)), (digest(2), tokens(2))])
    assert pool.lookup(digest(2), tokens(2), digest(1), head) is tail
    assert pool.lookup(digest(2), tokens(2), digest(7), head) is None
    assert pool.lookup(digest(1), tokens(1), digest(7)) is None  # another root
    # registering it after another parent digest is a collision: no second copy, no event
    pool.drain_events()
    other = pool.allocate()
    assert not pool.register(other, digest(2), tokens(2), digest(7), head)
    assert (other.digest, other.copy_of, pool.drain_events()) == (None, None, [])
    pool.check_invariants()


def test_a_hit_needs_the_very_parent_copy_not_only_its_digest():
    """A block's parent digest may name a later copy with other tokens (a collision at the
    parent, after the first copy was evicted): the generation tells the copies apart, even in
    the same physical block."""
    pool = BlockPool(2, BLOCK)
    head, tail = chained(pool, [(digest(1), tokens(1)), (digest(2), tokens(2))])
    pool.release([head.block_id])
    again = pool.allocate()  # evicts the head: the tail now extends a copy that is gone
    assert again is head
    assert pool.register(again, digest(1), tokens(7), ROOT)  # a collider takes the digest
    assert pool.lookup(digest(1), tokens(7), ROOT) is again
    assert pool.lookup(digest(2), tokens(2), digest(1), again) is None
    pool.check_invariants()


def test_an_unreachable_cached_block_is_replaced_by_a_reachable_copy():
    pool = BlockPool(4, BLOCK)
    head, tail = chained(pool, [(digest(1), tokens(1)), (digest(2), tokens(2))])
    pool.release([tail.block_id, head.block_id])
    pool.acquire(tail)  # keep the tail cached while the head is evicted
    pool.release([tail.block_id])
    for _ in range(3):  # two free blocks, then the head (the oldest)
        pool.allocate()
    assert pool.cached_digests() == [digest(2)]
    pool.release([0, 2, 3])
    new_head, new_tail = chained(pool, [(digest(1), tokens(1)), (digest(2), tokens(2))])
    assert pool.drain_events()[-3:] == [KVEvent("stored", [digest(1)]),
                                        KVEvent("removed", [digest(2)]),
                                        KVEvent("stored", [digest(2)])]
    # the old copy is simply free now, beside the block the head never took back
    assert (tail.digest, pool.num_free, pool.num_in_use) == (None, 2, 2)
    assert pool.lookup(digest(2), tokens(2), digest(1), new_head) is new_tail
    pool.check_invariants()


def test_a_block_computed_after_a_duplicate_extends_the_cached_copy():
    """Two sequences compute the same block 0 at once: the second's copy stays private, and
    its block 1 is found through the first's block 0. When that copy is evicted before block 1
    is registered, the duplicate is registered in its place first."""
    pool = BlockPool(8, BLOCK)
    manager = BlockManager(pool)
    root = b"\x03" * 32
    prompt = list(range(1, 13))  # three full blocks
    chain = block_digests(root, prompt, BLOCK)
    first = Sequence(GenerationRequest("first", prompt[:6]), root, BLOCK)
    second = Sequence(GenerationRequest("second", prompt), root, BLOCK)
    manager.admit(first, [], 6)
    manager.admit(second, [], BLOCK)  # a prefill chunk of one block
    manager.commit(first, 6)
    manager.commit(second, BLOCK)
    duplicate = pool.blocks[second.block_table[0]]
    assert duplicate.digest is None and duplicate.copy_of == pool.blocks[first.block_table[0]].ref
    assert pool.drain_events() == [KVEvent("stored", chain[:1])]

    manager.free(first)
    taken = [pool.allocate().block_id for _ in range(7)]  # 6 free blocks, then first's copy
    assert pool.drain_events() == [KVEvent("removed", chain[:1])]
    pool.release(taken)
    assert manager.reserve(second, 8)
    manager.commit(second, 8)
    assert second.num_registered_blocks == 3
    assert pool.drain_events() == [KVEvent("stored", chain)]
    probe = Sequence(GenerationRequest("probe", prompt + [99]), root, BLOCK)
    assert [b.block_id for b in manager.cached_prefix(probe)] == second.block_table
    pool.check_invariants()


def test_register_refuses_a_parent_that_is_no_cached_copy():
    pool = BlockPool(2, BLOCK)
    parent, block = pool.allocate(), pool.allocate()
    with pytest.raises(ValueError, match="no cached copy"):
        pool.register(block, digest(2), tokens(2), digest(1), parent)


# ---- adjacent blocks (allocate_run) ------------------------------------------------------------


def test_a_run_takes_adjacent_blocks_and_grows_into_the_next_one():
    pool = BlockPool(12, BLOCK)
    first = pool.allocate_run(4)
    assert [b.block_id for b in first] == [0, 1, 2, 3]
    assert pool.allocate(after=3).block_id == 4
    other = pool.allocate_run(2)  # the next free ones
    assert [b.block_id for b in other] == [5, 6]
    # 5 is taken: the first table's growth starts a new run at the oldest free block
    assert pool.allocate(after=4).block_id == 7
    assert pool.allocate(after=7).block_id == 8
    assert_accounted(pool)


def test_a_run_is_all_or_nothing():
    pool = BlockPool(4, BLOCK)
    pool.allocate_run(3)
    with pytest.raises(NoFreeBlocksError, match="2 KV blocks wanted, 1 free"):
        pool.allocate_run(2)
    assert (pool.num_free, pool.num_in_use) == (1, 3)


def test_a_run_from_the_lru_takes_what_strict_lru_would_evict_in_ascending_order():
    pool = BlockPool(8, BLOCK)
    old = cached_table(pool, 1, 8)  # blocks 0..7, digests 1..8
    pool.release(reversed(old[:4]))  # the older table: blocks 0..3, tail first
    pool.release(reversed(old[4:]))
    pool.drain_events()
    run = pool.allocate_run(3)
    # strict LRU would evict blocks 3, 2, 1 (digests 4, 3, 2); the run takes them ascending
    assert [b.block_id for b in run] == [1, 2, 3]
    evicted = {d for event in pool.drain_events() for d in event.digests}
    assert evicted == {digest(2), digest(3), digest(4)}
    assert pool.lookup(digest(1), tokens(1), ROOT) is not None  # the table's head stays
    pool.check_invariants()


def test_growth_evicts_an_adjacent_cached_block_only_from_the_older_half_of_the_lru():
    pool = BlockPool(9, BLOCK)
    cached = cached_table(pool, 1, 8)  # blocks 0..7
    growing = pool.allocate()  # block 8: the pool is full
    pool.release([growing.block_id])  # free again: the only free block
    for index in (1, 3, 5, 7, 0, 2, 4, 6):  # release order: odd blocks are the older half
        pool.release([cached[index]])
    # block 1 is cold, but a free block is never passed over for an eviction
    assert pool.allocate(after=0).block_id == 8
    assert pool.allocate(after=0).block_id == 1  # none free: the cold block 1 is taken
    # block 3 is cold too, but block 2 is not: growth after 1 starts a new run at the LRU head
    assert pool.allocate(after=1).block_id == 3
    assert pool.lookup(digest(3), tokens(3), ROOT) is not None  # block 2 survives
    pool.check_invariants()


def test_the_block_manager_grows_a_table_into_adjacent_blocks():
    pool = BlockPool(16, BLOCK)
    manager = BlockManager(pool)
    a = Sequence(GenerationRequest("a", list(range(3 * BLOCK))), ROOT, BLOCK)
    b = Sequence(GenerationRequest("b", list(range(2 * BLOCK))), ROOT, BLOCK)
    manager.admit(a, [], 3 * BLOCK)
    manager.admit(b, [], 2 * BLOCK)
    assert (a.block_table, b.block_table) == ([0, 1, 2], [3, 4])
    manager.commit(a, 3 * BLOCK)
    a.token_ids += [7] * (BLOCK + 1)
    manager.free(b)  # 3 and 4 are free again, behind 5..15
    assert manager.reserve(a, BLOCK + 1)  # two more blocks: first-in first-out gives 5 and 6
    assert a.block_table == [0, 1, 2, 3, 4]
    assert manager.reserve(a, 5 * BLOCK)  # 5 is free and next: the run goes on
    assert a.block_table == [0, 1, 2, 3, 4, 5, 6, 7]


def test_recomputing_blocks_costs_what_the_engine_measured_at_their_depth():
    assert BlockManager(BlockPool(8, 16)).recompute_s(0, 4) is None  # nothing measured yet
    manager = BlockManager(BlockPool(8, 16), fitted_prompt_costs(1e-3, per_key_s=1e-6))
    # Blocks 2-4 are tokens 32-79: 48 tokens at 1 ms plus 1 µs per key before each.
    assert manager.recompute_s(2, 3) == pytest.approx(48 * 1e-3 + 1e-6 * sum(
        t + 0.5 for t in range(32, 80)))
    assert manager.recompute_s(100, 1) > manager.recompute_s(0, 1)
