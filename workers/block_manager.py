"""Per-sequence block tables over the shared :class:`~workers.block_pool.BlockPool`.

Finds a sequence's cached prefix, grows its table as tokens are scheduled, registers blocks
once all their tokens are computed, and returns everything to the pool when it ends.
"""

from __future__ import annotations

from workers.block_pool import Block, BlockPool
from workers.sequence import Sequence


class BlockManager:
    """Maps sequences to KV blocks.

    Args:
        pool: the block pool shared by every sequence of the engine.
    """

    def __init__(self, pool: BlockPool):
        self.pool = pool
        self.block_size = pool.block_size

    def cached_prefix(self, seq: Sequence) -> list[Block]:
        """The longest run of leading full blocks of ``seq`` that the cache verifiably holds.

        The last token is never covered: a request whose whole prompt is cached still computes
        it to get logits.
        """
        hits: list[Block] = []
        for index in range((seq.num_tokens - 1) // self.block_size):
            block = self.pool.lookup(seq.digest(index), seq.block_tokens(index),
                                     seq.parent_digest(index), hits[-1] if hits else None)
            if block is None:
                break
            hits.append(block)
        return hits

    def can_admit(self, seq: Sequence, hits: list[Block], num_new_tokens: int) -> bool:
        """Whether the pool can hold ``hits`` plus blocks for ``num_new_tokens`` more tokens."""
        fresh = seq.blocks_needed(len(hits) * self.block_size + num_new_tokens) - len(hits)
        taken_from_lru = sum(1 for block in hits if self.pool.is_evictable(block))
        return fresh + taken_from_lru <= self.pool.num_available

    def admit(self, seq: Sequence, hits: list[Block], num_new_tokens: int) -> None:
        """Give ``seq`` its cached prefix and room for its next ``num_new_tokens`` tokens.

        Call :meth:`can_admit` first; the hits are referenced before any allocation, so
        allocating cannot evict them.
        """
        for block in hits:
            self.pool.acquire(block)
        seq.block_table = [block.block_id for block in hits]
        seq.num_computed_tokens = len(hits) * self.block_size
        seq.num_registered_blocks = len(hits)
        self._grow(seq, seq.num_computed_tokens + num_new_tokens)

    def reserve(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Grow ``seq``'s table to hold ``num_new_tokens`` more tokens; all or nothing."""
        target = seq.num_computed_tokens + num_new_tokens
        if seq.blocks_needed(target) - len(seq.block_table) > self.pool.num_available:
            return False
        self._grow(seq, target)
        return True

    def commit(self, seq: Sequence, num_new_tokens: int) -> None:
        """Record that the KV of ``num_new_tokens`` more tokens is written; register full blocks.

        Only blocks whose every token is computed get a digest, so a cached block never holds
        a token whose KV was not produced by the forward pass. A block is registered only as
        the extension of its parent's cached copy; when that copy has been evicted meanwhile
        (the parent was a private duplicate of it), the parent is registered again first.
        """
        seq.num_computed_tokens += num_new_tokens
        full_blocks = seq.num_computed_tokens // self.block_size
        index = seq.num_registered_blocks
        while index < full_blocks:
            parent = self.pool.blocks[seq.block_table[index - 1]] if index else None
            if parent is not None and not self.pool.has_cached_copy(parent):
                index -= 1
                continue
            block = self.pool.blocks[seq.block_table[index]]
            if not self.pool.register(block, seq.digest(index), seq.block_tokens(index),
                                      seq.parent_digest(index), parent):
                # A digest collision: this block and every later one chain from a digest whose
                # cached copy holds other tokens, so none may be found under it. Retried on
                # the next commit, in case the colliding copy has been evicted meanwhile.
                break
            index += 1
        seq.num_registered_blocks = index

    def trim(self, seq: Sequence) -> None:
        """Return the blocks past what ``seq``'s tokens need: after a verification step they
        held only rejected draft tokens' KV (never registered, so never published)."""
        keep = seq.blocks_needed(seq.num_tokens)
        if len(seq.block_table) > keep:
            self.pool.release(reversed(seq.block_table[keep:]))
            del seq.block_table[keep:]

    def free(self, seq: Sequence) -> None:
        """Return all of ``seq``'s blocks, tail first, and forget its computed state."""
        self.pool.release(reversed(seq.block_table))
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_registered_blocks = 0

    def _grow(self, seq: Sequence, num_tokens: int) -> None:
        while len(seq.block_table) < seq.blocks_needed(num_tokens):
            seq.block_table.append(self.pool.allocate().block_id)
