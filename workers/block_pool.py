"""The paged KV block pool: reference counts, prefix-cache lookup and LRU eviction.

Bookkeeping only; the KV tensors themselves live in ``workers.kv_cache``. The design follows
vLLM's block manager (and nano-vllm's): a block whose tokens are all committed gets a chained
digest; once unreferenced it stays reusable until the pool needs it back, least recently used
first. Every change to the set of reusable digests is an event for the index.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from workers.kv_events import KVEvent


class NoFreeBlocksError(RuntimeError):
    """The pool has no free or evictable block left."""


@dataclass
class Block:
    """One physical KV block.

    Attributes:
        block_id: index into the KV tensors' block dimension.
        ref_count: sequences whose block tables hold it.
        digest: chained digest once the block is full of committed tokens, else None.
        token_ids: the tokens it holds, kept to verify every prefix hit (digest collisions).
    """

    block_id: int
    ref_count: int = 0
    digest: bytes | None = None
    token_ids: tuple[int, ...] = ()


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
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # oldest first
        self._by_digest: dict[bytes, int] = {}
        self._events: list[KVEvent] = []

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

    def lookup(self, digest: bytes, token_ids: Sequence[int]) -> Block | None:
        """The cached block for ``digest``, only if it really holds ``token_ids``.

        The token comparison refuses a hit whose digest collides with another prefix's.
        """
        block_id = self._by_digest.get(digest)
        if block_id is None:
            return None
        block = self.blocks[block_id]
        return block if block.token_ids == tuple(token_ids) else None

    def is_evictable(self, block: Block) -> bool:
        return block.block_id in self._evictable

    def acquire(self, block: Block) -> None:
        """Take a reference on a cached block found by :meth:`lookup`."""
        if block.ref_count == 0:
            self._evictable.pop(block.block_id, None)
        block.ref_count += 1

    def allocate(self) -> Block:
        """A fresh, referenced, empty block; evicts the least recently used cached one if needed.

        Raises:
            NoFreeBlocksError: every block is in use.
        """
        if self._free:
            block = self.blocks[self._free.popleft()]
        elif self._evictable:
            block_id, _ = self._evictable.popitem(last=False)
            block = self.blocks[block_id]
            self._forget_digest(block)
        else:
            raise NoFreeBlocksError("no free KV block")
        block.ref_count = 1
        return block

    def release(self, block_ids: Iterable[int]) -> None:
        """Drop one reference on each block, in the order given.

        Callers pass a block table tail first, so a sequence's last blocks are evicted before
        its first ones: the head of a prefix is the part most likely to be shared.
        """
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count <= 0:
                raise RuntimeError(f"block {block_id} released more often than acquired")
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.digest is None:
                    self._free.append(block_id)
                else:
                    self._evictable[block_id] = None

    def register(self, block: Block, digest: bytes, token_ids: Sequence[int]) -> bool:
        """Mark a full block of committed tokens reusable under ``digest``.

        If another block already holds this digest (two sequences computed the same prefix
        at once), the first stays the cached copy and this one remains private, so the index
        sees one ``stored`` per digest.

        Returns:
            False when the digest is held by a block with other token ids: a digest collision.
            The block stays private, and so must every later block of its sequence, whose KV
            was computed after this block's tokens, not after the holder's.
        """
        holder = self._by_digest.get(digest)
        if holder is not None:
            return self.blocks[holder].token_ids == tuple(token_ids)
        if block.digest is not None:
            return True
        block.digest = digest
        block.token_ids = tuple(token_ids)
        self._by_digest[digest] = block.block_id
        self._emit("stored", digest)
        return True

    def reset_cache(self) -> None:
        """Forget every reusable prefix (blocks in use keep their KV, but become private).

        Emits one ``cleared`` event: the index then credits this worker with nothing.
        """
        for block_id in list(self._evictable):
            self._free.append(block_id)
        self._evictable.clear()
        for block in self.blocks:
            block.digest, block.token_ids = None, ()
        self._by_digest.clear()
        self._events.append(KVEvent("cleared"))

    def cached_digests(self) -> list[bytes]:
        """Every digest the pool can currently serve a hit for (a copy; safe to read from
        another thread, since copying a dict's keys does not release the GIL)."""
        return list(self._by_digest)

    def drain_events(self) -> list[KVEvent]:
        """Events since the last drain, consecutive ones of a kind merged, in order."""
        events, self._events = self._events, []
        return events

    def check_invariants(self) -> None:
        """Check the pool's bookkeeping (for tests and debugging; O(num_blocks)).

        Every block is in exactly one state: free (unreferenced, no digest), evictable
        (unreferenced, with a digest) or in use (referenced); reference counts are never
        negative; the digest map names exactly the blocks that carry a digest, under it.

        Raises:
            AssertionError: naming the first broken invariant.
        """
        free, evictable = set(self._free), set(self._evictable)
        assert len(free) == len(self._free), "a block is listed free twice"
        for block in self.blocks:
            state = (block.block_id in free, block.block_id in evictable, block.ref_count > 0)
            assert block.ref_count >= 0, f"block {block.block_id} has ref_count < 0"
            assert sum(state) == 1, f"block {block.block_id} is in {sum(state)} states"
            if block.block_id in free:
                assert block.digest is None, f"free block {block.block_id} has a digest"
            if block.block_id in evictable:
                assert block.digest is not None, f"evictable block {block.block_id} has no digest"
            if block.digest is not None:
                assert self._by_digest.get(block.digest) == block.block_id, (
                    f"block {block.block_id}'s digest maps elsewhere")
                assert len(block.token_ids) == self.block_size
        assert all(self.blocks[i].digest == d for d, i in self._by_digest.items()), (
            "the digest map names a block that no longer holds that digest")

    def _forget_digest(self, block: Block) -> None:
        if block.digest is not None:
            del self._by_digest[block.digest]
            self._emit("removed", block.digest)
            block.digest, block.token_ids = None, ()

    def _emit(self, kind: str, digest: bytes) -> None:
        if self._events and self._events[-1].kind == kind:
            self._events[-1].digests.append(digest)
        else:
            self._events.append(KVEvent(kind, [digest]))
