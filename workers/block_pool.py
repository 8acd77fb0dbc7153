"""The paged KV block pool: reference counts, prefix-cache lookup and LRU eviction.

Bookkeeping only; the KV tensors themselves live in ``workers.kv_cache``. The design follows
vLLM's block manager (and nano-vllm's): a block whose tokens are all committed gets a chained
digest; once unreferenced it stays reusable until the pool needs it back, least recently used
first (or, to keep a table's blocks adjacent in memory, any in the older half of that order).
Every change to the set of reusable digests is an event for the index.

A hit never rests on the digest alone (case P6: digests may collide). A cached block records
its tokens, the digest its chain extends (its parent digest; the identity's root for block 0)
and the very cached copy of its parent block whose KV it was computed after: a
:class:`BlockRef`, which dies when that copy is evicted. A lookup walks a prefix block by
block and accepts block *i* only if it holds block *i*'s tokens and extends the block found
for *i - 1*, so a hit is always a chain of copies computed one after the other.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from contract.kv_events import KVEvent, Medium
from workers.kv_tier import KVTier, TierWrite

COLD_FRACTION = 0.5
"""A cached block may be evicted out of LRU order, to extend a run of adjacent blocks, only if it
was released in the older ``COLD_FRACTION`` of the span between the least and the most
recently released evictable blocks."""


class NoFreeBlocksError(RuntimeError):
    """The pool has no free or evictable block left."""


class BlockRef(NamedTuple):
    """One cached copy of a block: its id and the generation it was cached in.

    The pool bumps a block's generation whenever the block stops being a cached copy (evicted,
    cleared, or replaced as unreachable), so an old reference never names the KV that a later
    occupant of the same block holds.
    """

    block_id: int
    generation: int


@dataclass
class Block:
    """One physical KV block.

    Attributes:
        block_id: index into the KV tensors' block dimension.
        ref_count: sequences whose block tables hold it.
        digest: chained digest once the block is a cached copy, else None.
        token_ids: the tokens a cached copy holds, kept to verify every hit.
        parent_digest: the digest a cached copy's chain extends: the previous block's, or the
            identity's root digest for block 0.
        parent: the cached copy of the previous block that this block's KV was computed
            after (None for block 0).
        copy_of: for a private block that duplicates a cached copy (the same prefix computed
            twice at once), that copy: blocks computed after this one extend it.
        generation: bumped whenever the block stops being a cached copy (see :class:`BlockRef`).
        check: a cached copy's :func:`~workers.kv_tier.prefix_check`, which the second tier
            keeps with the block when it is evicted; empty if none was given.
        fetched: a cached copy fetched from another worker that no sequence has used yet (its
            first hit counts as a transfer, later ones as this worker's own cache).
    """

    block_id: int
    ref_count: int = 0
    digest: bytes | None = None
    token_ids: tuple[int, ...] = ()
    parent_digest: bytes | None = None
    parent: BlockRef | None = None
    copy_of: BlockRef | None = None
    generation: int = 0
    check: bytes = b""
    fetched: bool = False

    @property
    def ref(self) -> BlockRef:
        """This block as it is now (meaningful while it is a cached copy)."""
        return BlockRef(self.block_id, self.generation)


class BlockPool:
    """A fixed set of ``num_blocks`` blocks of ``block_size`` tokens.

    Invariant: every block is in exactly one state — free (no digest, unreferenced),
    evictable (digest, unreferenced, in LRU order) or in use (referenced).
    """

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1:
            raise ValueError(f"the KV budget holds no block (num_blocks={num_blocks})")
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # oldest first
        self._evictable: OrderedDict[int, None] = OrderedDict()  # oldest first
        self._releases = 0
        self._released_at = [0] * num_blocks
        """Per block, the count of :meth:`release` calls when it last became evictable."""
        self._by_digest: dict[bytes, int] = {}
        self._events: list[KVEvent] = []
        self.tier: KVTier | None = None
        """The second tier evicted blocks move to (set by the engine); None: they are lost."""

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        """Blocks that hold nothing reusable."""
        return len(self._free)

    @property
    def num_evictable(self) -> int:
        """Unreferenced blocks that still hold a reusable prefix."""
        return len(self._evictable)

    @property
    def num_available(self) -> int:
        """Blocks an allocation can take: free plus evictable."""
        return len(self._free) + len(self._evictable)

    @property
    def num_in_use(self) -> int:
        return self.num_blocks - self.num_available

    def lookup(self, digest: bytes, token_ids: Sequence[int], parent_digest: bytes,
               parent: Block | None = None) -> Block | None:
        """The cached block for ``digest``, only if it really continues the caller's prefix.

        Args:
            digest: the block's chained digest.
            token_ids: the tokens the block must hold.
            parent_digest: the digest the caller's chain extends here (its root for block 0).
            parent: the block this lookup found for the previous block; None for block 0.

        Returns:
            The block, if it holds ``token_ids``, extends ``parent_digest`` and was computed
            after ``parent`` itself; else None, even when the digest matches (a collision).
        """
        block_id = self._by_digest.get(digest)
        if block_id is None:
            return None
        block = self.blocks[block_id]
        expected = (tuple(token_ids), parent_digest, None if parent is None else parent.ref)
        return block if (block.token_ids, block.parent_digest, block.parent) == expected else None

    def is_evictable(self, block: Block) -> bool:
        return block.block_id in self._evictable

    def acquire(self, block: Block) -> None:
        """Take a reference on a cached block found by :meth:`lookup`."""
        if block.ref_count == 0:
            self._evictable.pop(block.block_id, None)
        block.ref_count += 1

    def allocate(self, after: int | None = None) -> Block:
        """A fresh, referenced, empty block: :meth:`allocate_run` of one."""
        return self.allocate_run(1, after)[0]

    def allocate_run(self, count: int, after: int | None = None) -> list[Block]:
        """``count`` fresh, referenced, empty blocks, with ids ascending one by one from
        ``after + 1`` wherever the pool can; all or none.

        Why adjacency: each KV head's blocks lie next to each other in memory when their ids do
        (``workers.kv_cache``), and decode attention reads a run of adjacent blocks at close to
        the sequential read bandwidth, scattered 2-4 KB blocks at a third to a half of it
        (docs/performance.md, "Adjacent blocks"). Taking blocks first-in first-out and least
        recently used first, as vLLM's block pool does, scatters every table once the pool has
        turned over.

        Each block is the one after the previous (after ``after`` for the first) when that one
        can be taken: free, or, once no block is free, cached and released in the older part of
        the LRU order (:data:`COLD_FRACTION`). Otherwise a run starts where the pool takes a
        block anyway (the oldest free block, else the least recently used cached one) and is
        moved down over up to ``count - 1`` takeable blocks below it, so that it ends there: of
        a table released tail first, the run takes the same tail blocks that strict LRU order
        would evict, in ascending order.

        Args:
            count: blocks wanted, at least 1.
            after: the id the first block should follow: the last block of the table being
                grown; None for a table's first block.

        Raises:
            NoFreeBlocksError: fewer than ``count`` blocks are free or evictable.
        """
        if count > self.num_available:
            raise NoFreeBlocksError(f"{count} KV blocks wanted, {self.num_available} free")
        taken: list[Block] = []
        last = after
        while len(taken) < count:
            block_id = last + 1 if last is not None else -1
            if not self._takeable(block_id):
                block_id = self._run_start(count - len(taken))
            taken.append(self._take(block_id))
            last = block_id
        return taken

    def _takeable(self, block_id: int) -> bool:
        """Whether a run may take ``block_id``: a free block, or, only while none is free (a
        free block is never passed over for an eviction), a cached one released in the older
        part of the LRU order."""
        if block_id in self._free:
            return True
        if self._free or block_id not in self._evictable:
            return False
        oldest = self._released_at[next(iter(self._evictable))]
        newest = self._released_at[next(reversed(self._evictable))]
        return self._released_at[block_id] <= oldest + COLD_FRACTION * (newest - oldest)

    def _run_start(self, count: int) -> int:
        """Where a run of up to ``count`` blocks starts: it ends at the block the pool would
        take next, or starts lower where fewer takeable blocks lie below that one."""
        end = next(iter(self._free)) if self._free else next(iter(self._evictable))
        start = end
        while end - start < count - 1 and self._takeable(start - 1):
            start -= 1
        return start

    def _take(self, block_id: int) -> Block:
        """References a free or evictable block; an evicted one is spilled and forgotten."""
        block = self.blocks[block_id]
        if block_id in self._free:
            del self._free[block_id]
        else:
            del self._evictable[block_id]
            self._spill(block)
            self._uncache(block)
        block.ref_count = 1
        return block

    def release(self, block_ids: Iterable[int]) -> None:
        """Drop one reference on each block, in the order given.

        Callers pass a block table tail first, so a sequence's last blocks are evicted before
        its first ones: the head of a prefix is the part most likely to be shared.
        """
        self._releases += 1
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count <= 0:
                raise RuntimeError(f"block {block_id} released more often than acquired")
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.digest is None:
                    block.copy_of = None
                    self._free[block_id] = None
                else:
                    self._evictable[block_id] = None
                    self._released_at[block_id] = self._releases

    def has_cached_copy(self, block: Block) -> bool:
        """Whether ``block`` is a cached copy, or a private duplicate of one still cached: what
        a block must be before the block computed after it can be registered."""
        return self._cached_copy(block) is not None

    def register(self, block: Block, digest: bytes, token_ids: Sequence[int],
                 parent_digest: bytes, parent: Block | None = None, check: bytes = b"",
                 ) -> bool:
        """Mark a full block of committed tokens reusable under ``digest``.

        If another block already holds this digest with the same tokens, parent digest and
        parent copy (two sequences computed the same prefix at once), the first stays the cached
        copy and this one remains private, a duplicate of it, so the index sees one ``stored``
        per digest. A holder whose parent copy is gone can no longer be reached by any lookup;
        this block replaces it.

        Args:
            block: the block, full of committed tokens.
            digest: its chained digest.
            token_ids: its tokens.
            parent_digest: the digest its chain extends (the root digest for block 0).
            parent: the block before it in the sequence's table, whose KV it was computed
                after; None for block 0.
            check: the :func:`~workers.kv_tier.prefix_check` of its token prefix; without
                one, the block is not kept by the second tier when evicted.

        Returns:
            False when the digest is held by a block with other tokens or another parent: a
            digest collision. The block stays private, and so must every later block of its
            sequence. Also False for a block that is already cached under another digest.

        Raises:
            ValueError: ``parent`` is neither a cached copy nor a duplicate of one (check
                :meth:`has_cached_copy` first).
        """
        if block.digest is not None:
            return block.digest == digest
        link = None
        if parent is not None:
            link = self._cached_copy(parent)
            if link is None:
                raise ValueError(f"block {parent.block_id} is no cached copy to extend")
        holder_id = self._by_digest.get(digest)
        if holder_id is not None:
            holder = self.blocks[holder_id]
            if (holder.token_ids, holder.parent_digest) != (tuple(token_ids), parent_digest):
                return False
            if self._is_current(holder.parent):
                if holder.parent != link:
                    return False
                block.copy_of = holder.ref
                return True
            self._uncache(holder)  # unreachable: the copy it was computed after is gone
        block.digest, block.token_ids, block.check = digest, tuple(token_ids), check
        block.parent_digest, block.parent, block.copy_of = parent_digest, link, None
        self._by_digest[digest] = block.block_id
        self._emit("stored", digest, "pool")
        return True

    def reset_cache(self) -> None:
        """Forget every reusable prefix (blocks in use keep their KV, but become private).

        Emits one ``cleared`` event: the index then credits this worker with nothing.
        """
        for block_id in self._evictable:
            self._free[block_id] = None
        self._evictable.clear()
        for block_id in self._by_digest.values():
            self._forget(self.blocks[block_id])
        self._by_digest.clear()
        if self.tier is not None:
            self.tier.clear()
        self._events.append(KVEvent("cleared"))

    def cached_digests(self) -> list[bytes]:
        """Every digest the pool, or its second tier, can currently serve a hit for (for tests
        and debugging; the index hears it per medium through :meth:`held_state`)."""
        held = list(self._by_digest)
        if self.tier is not None:
            held += [digest for digest in self.tier.digests() if digest not in self._by_digest]
        return held

    def held_state(self) -> list[KVEvent]:
        """What the worker holds, as ``stored`` events per medium: the index's whole view of
        it after a ``cleared`` (a resync). A copy, safe to take from another thread, since
        copying a dict's keys does not release the GIL."""
        state = [KVEvent("stored", list(self._by_digest), "pool")]
        if self.tier is not None:
            state.append(KVEvent("stored", self.tier.digests(), "tier"))
        return state

    def cached_block(self, digest: bytes) -> Block | None:
        """The cached copy held under ``digest`` in the working pool, if any."""
        block_id = self._by_digest.get(digest)
        return None if block_id is None else self.blocks[block_id]

    def tier_wrote(self, digest: bytes, written: TierWrite) -> None:
        """Tells the index what storing ``digest`` in the second tier did (a block evicted
        from the pool, or fetched from another worker): the entry it dropped, if any, and
        whether the tier holds ``digest`` now."""
        if written.dropped is not None:
            self.forget_in_tier(written.dropped)
        if written.stored:
            self._emit("stored", digest, "tier")

    def forget_in_tier(self, digest: bytes) -> None:
        """The second tier lost ``digest`` (dropped, or failed its check)."""
        self._emit("removed", digest, "tier")

    def drain_events(self) -> list[KVEvent]:
        """Events since the last drain, consecutive ones of a kind and medium merged, in
        order."""
        events, self._events = self._events, []
        return events

    def check_invariants(self) -> None:
        """Check the pool's bookkeeping (for tests and debugging; O(num_blocks)).

        Every block is in exactly one state: free (unreferenced, no digest), evictable
        (unreferenced, with a digest) or in use (referenced); reference counts are never
        negative; the digest map names exactly the blocks that carry a digest, under it; a
        cached copy's parent, while current, holds its parent digest; only private blocks
        duplicate a cached copy, and a free block duplicates none.

        Raises:
            AssertionError: naming the first broken invariant.
        """
        free, evictable = set(self._free), set(self._evictable)
        for block in self.blocks:
            state = (block.block_id in free, block.block_id in evictable, block.ref_count > 0)
            assert block.ref_count >= 0, f"block {block.block_id} has ref_count < 0"
            assert sum(state) == 1, f"block {block.block_id} is in {sum(state)} states"
            if block.block_id in free:
                assert block.digest is None and block.copy_of is None, (
                    f"free block {block.block_id} has a digest or duplicates a cached copy")
            if block.block_id in evictable:
                assert block.digest is not None, f"evictable block {block.block_id} has no digest"
            if block.digest is None:
                assert (block.token_ids, block.parent_digest, block.parent, block.check,
                        block.fetched) == ((), None, None, b"", False), (
                    f"private block {block.block_id} keeps a cached copy's identity")
            else:
                self._check_cached(block)
        assert all(self.blocks[i].digest == d for d, i in self._by_digest.items()), (
            "the digest map names a block that no longer holds that digest")

    def _check_cached(self, block: Block) -> None:
        assert self._by_digest.get(block.digest) == block.block_id, (
            f"block {block.block_id}'s digest maps elsewhere")
        assert len(block.token_ids) == self.block_size
        assert block.parent_digest is not None and block.copy_of is None
        if block.parent is not None and self._is_current(block.parent):
            assert self.blocks[block.parent.block_id].digest == block.parent_digest, (
                f"block {block.block_id}'s parent copy holds another digest")

    def _cached_copy(self, block: Block) -> BlockRef | None:
        """The cached copy ``block`` is, or duplicates; None if there is none (any more)."""
        if block.digest is not None:
            return block.ref
        return block.copy_of if self._is_current(block.copy_of) else None

    def _is_current(self, ref: BlockRef | None) -> bool:
        """Whether ``ref`` still names a cached copy (None, block 0's parent, always does)."""
        return ref is None or self.blocks[ref.block_id].generation == ref.generation

    def _spill(self, block: Block) -> None:
        """Copy an evicted cached block into the second tier, if there is one."""
        if self.tier is None or not block.check:
            return
        self.tier_wrote(block.digest, self.tier.save(block.block_id, block.digest,
                                                     block.token_ids, block.parent_digest,
                                                     block.check))

    def _uncache(self, block: Block) -> None:
        """Evict or replace a cached copy: it becomes private (free, if nobody holds it)."""
        del self._by_digest[block.digest]
        self._emit("removed", block.digest, "pool")
        self._forget(block)
        if block.block_id in self._evictable:
            del self._evictable[block.block_id]
            self._free[block.block_id] = None

    @staticmethod
    def _forget(block: Block) -> None:
        block.digest, block.token_ids, block.parent_digest, block.parent = None, (), None, None
        block.check, block.fetched = b"", False
        block.generation += 1

    def _emit(self, kind: str, digest: bytes, medium: Medium) -> None:
        last = self._events[-1] if self._events else None
        if last is not None and (last.kind, last.medium) == (kind, medium):
            last.digests.append(digest)
        else:
            self._events.append(KVEvent(kind, [digest], medium))
