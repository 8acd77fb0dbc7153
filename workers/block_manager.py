"""Per-sequence block tables over the shared :class:`~workers.block_pool.BlockPool`.

Finds a sequence's cached prefix (in the working pool, then in the second tier), grows its
table as tokens are scheduled, registers blocks once all their tokens are computed, and returns
everything to the pool when it ends.
"""

from __future__ import annotations

from workers.block_pool import Block, BlockPool
from workers.kv_tier import TierEntry
from workers.sequence import Sequence
from workers.step_time import PromptCostModel

Hit = Block | TierEntry
"""One block of a cached prefix: in the working pool, or in the second tier."""


class BlockManager:
    """Maps sequences to KV blocks.

    Args:
        pool: the block pool shared by every sequence of the engine.
        prompt_costs: the engine's fit of a prompt token's cost by its depth, which a
            second-tier load (and a fetch from another worker) is weighed against; a fresh,
            unmeasured one by default.
    """

    def __init__(self, pool: BlockPool, prompt_costs: PromptCostModel | None = None):
        self.pool = pool
        self.block_size = pool.block_size
        self.prompt_costs = prompt_costs or PromptCostModel()

    def cached_prefix(self, seq: Sequence) -> list[Hit]:
        """The longest run of leading full blocks of ``seq`` that the cache verifiably holds:
        working-pool blocks, then second-tier entries where loading one is measured to be
        cheaper than computing it.

        The last token is never covered: a request whose whole prompt is cached still computes
        it to get logits.
        """
        hits: list[Hit] = []
        tier = self.pool.tier
        for index in range(seq.num_reusable_blocks):
            key = (seq.digest(index), seq.block_tokens(index), seq.parent_digest(index))
            hit: Hit | None = None
            if not hits or isinstance(hits[-1], Block):
                hit = self.pool.lookup(*key, hits[-1] if hits else None)
            if hit is None and tier is not None and self._loading_pays(index):
                hit = tier.lookup(*key, seq.prefix_check(index))
            if hit is None:
                break
            hits.append(hit)
        return hits

    def recompute_s(self, first_block: int, num_blocks: int) -> float | None:
        """Predicted seconds to compute the KV of ``num_blocks`` blocks of a prompt from block
        ``first_block`` on, by the measured cost of a prompt token at its depth; None until a
        prefill has been measured."""
        if not self.prompt_costs.known:
            return None
        return self.prompt_costs.seconds(first_block * self.block_size,
                                         num_blocks * self.block_size)

    def can_admit(self, seq: Sequence, hits: list[Hit], num_new_tokens: int) -> bool:
        """Whether the pool can hold ``hits`` plus blocks for ``num_new_tokens`` more tokens
        (a second-tier hit needs a fresh block to be loaded into)."""
        in_pool = [hit for hit in hits if isinstance(hit, Block)]
        fresh = seq.blocks_needed(len(hits) * self.block_size + num_new_tokens) - len(in_pool)
        taken_from_lru = sum(1 for block in in_pool if self.pool.is_evictable(block))
        return fresh + taken_from_lru <= self.pool.num_available

    def admit(self, seq: Sequence, hits: list[Hit], num_new_tokens: int) -> None:
        """Give ``seq`` its cached prefix and room for its next ``num_new_tokens`` tokens.

        Call :meth:`can_admit` first; working-pool hits are referenced before any allocation,
        so allocating cannot evict them. Second-tier hits are loaded into fresh blocks and
        registered; the prefix ends at the first that fails to load (its tokens are computed).
        """
        in_pool = [hit for hit in hits if isinstance(hit, Block)]
        for block in in_pool:
            self.pool.acquire(block)
        seq.block_table = [block.block_id for block in in_pool]
        for index, entry in enumerate(hits[len(in_pool):], len(in_pool)):
            if not self._load(seq, index, entry):
                self._drop_from_tier(hits[index + 1:])
                break
        if not seq.admitted:  # sources count once, as the hit does
            taken = hits[:len(seq.block_table)]
            seq.num_transfer_tokens = sum(hit.fetched for hit in taken) * self.block_size
            seq.num_tier_tokens = sum(isinstance(hit, TierEntry) and not hit.fetched
                                      for hit in taken) * self.block_size
            for block in in_pool:  # from now on, a hit on this worker's own cache
                block.fetched = False
        seq.num_computed_tokens = len(seq.block_table) * self.block_size
        seq.num_registered_blocks = len(seq.block_table)
        self._grow(seq, seq.num_computed_tokens + num_new_tokens)

    def _load(self, seq: Sequence, index: int, entry: TierEntry) -> bool:
        """Loads block ``index`` of ``seq`` from the second tier into a fresh cached block."""
        parent = self.pool.blocks[seq.block_table[-1]] if index else None
        block = self.pool.allocate(after=None if parent is None else parent.block_id)
        if not self.pool.tier.load(entry, block.block_id):
            self.pool.forget_in_tier(entry.digest)
        elif self.pool.register(block, entry.digest, entry.token_ids, entry.parent_digest,
                                parent, entry.check):
            seq.block_table.append(block.block_id)
            return True
        self.pool.release([block.block_id])
        return False

    def _drop_from_tier(self, entries: list[TierEntry]) -> None:
        """Drops the second-tier entries of a prompt's blocks past one that failed to load:
        the prompt computes those blocks now. The tier keeps a digest it holds when the block
        is evicted again, so a kept entry would shadow the fresh copy; and where the failure
        was corruption (a damaged file), the entries after it are as suspect. Left in, each
        later request got one block further before the next failed check."""
        for entry in entries:
            self.pool.tier.discard(entry.digest)
            self.pool.forget_in_tier(entry.digest)

    def _loading_pays(self, index: int) -> bool:
        """Whether loading block ``index`` of a prompt from the second tier is cheaper than
        computing it at its depth, as measured (optimistic until both are). A deeper block
        costs more to compute and the same to load, so where a block's load does not pay,
        neither does that of any shallower one."""
        tier = self.pool.tier
        if not len(tier):
            return False
        load, recompute = tier.counters.load_s_per_block, self.recompute_s(index, 1)
        return load is None or recompute is None or load < recompute

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
                                      seq.parent_digest(index), parent,
                                      seq.prefix_check(index)):
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
        """Appends the blocks ``seq`` lacks for ``num_tokens`` tokens, adjacent to its last
        block where the pool can (a table read in one run is read faster)."""
        missing = seq.blocks_needed(num_tokens) - len(seq.block_table)
        if missing > 0:
            last = seq.block_table[-1] if seq.block_table else None
            seq.block_table += [block.block_id
                                for block in self.pool.allocate_run(missing, after=last)]
