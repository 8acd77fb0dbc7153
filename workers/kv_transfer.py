"""KV blocks between workers: a holder exports the blocks a requester asks for by digest, and
the requester checks each against its own prompt before storing it: in its working pool, as a
cached copy that admission finds like one of its own, or, where the pool cannot take the run,
in its second tier, where admission finds it like any second-tier hit.

The design follows the KV connectors of vLLM and LMCache and Dynamo's block manager, with Ray
as the transport: the payloads are numpy arrays, which Ray's object store moves between
processes and nodes without copies of ours.

Nothing from another worker is trusted: a block is accepted only if its digest, tokens and
parent digest equal those of the requester's own prompt at that position, its prefix check
equals the requester's (so the holder computed it after exactly this token prefix, under this
identity), and its bytes match their checksum and the requester's block size. The first block
that fails ends the import; the rest of the prompt is computed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from contract.kv_transfer import KVBlock, kv_checksum
from workers.block_manager import Hit
from workers.block_pool import Block, BlockPool
from workers.kv_cache import PagedKVCache
from workers.sequence import Sequence

MAX_EXPORT_BLOCKS = 128
"""Most blocks one export copies: it runs between the holder's steps, so this bounds the pause
it adds to them (128 blocks of SmolLM2 in bf16 are 47 MB, tens of milliseconds to copy)."""


@dataclass
class TransferCounters:
    """Monotonic counts of block transfers, both directions.

    Attributes:
        exported_blocks, exported_bytes, export_seconds: blocks sent to other workers.
        imported_blocks, imported_bytes, import_seconds: blocks received and stored, and the
            time from asking to stored (the round trip included).
        already_held_blocks: received blocks that passed the checks but were not stored,
            since this worker had come to hold them meanwhile (it computed them, or another
            fetch brought them, while this fetch was under way).
        rejected_blocks: received blocks refused by a check.
        failed_fetches: fetches that failed or ran out of time (the prompt was computed).
    """

    exported_blocks: int = 0
    exported_bytes: int = 0
    export_seconds: float = 0.0
    imported_blocks: int = 0
    imported_bytes: int = 0
    import_seconds: float = 0.0
    already_held_blocks: int = 0
    rejected_blocks: int = 0
    failed_fetches: int = 0


def export_blocks(pool: BlockPool, kv_cache: PagedKVCache, digests: list[bytes],
                  ) -> list[KVBlock]:
    """Copies of the blocks held under ``digests``, in order, up to the first one not held
    (working pool or second tier) and at most :data:`MAX_EXPORT_BLOCKS`."""
    exported = []
    for digest in digests[:MAX_EXPORT_BLOCKS]:
        block = pool.cached_block(digest)
        if block is not None:
            kv = block_kv(kv_cache, block.block_id).view(-1).view(torch.uint8).cpu().numpy()
            exported.append(KVBlock(digest, block.token_ids, block.parent_digest, block.check,
                                    kv, kv_checksum(kv)))
            continue
        held = pool.tier.export(digest) if pool.tier is not None else None
        if held is None:
            if pool.tier is not None:
                pool.forget_in_tier(digest)
            break
        exported.append(held)
    return exported


class Imported(NamedTuple):
    """What an import did: the leading blocks accepted (checked, and held now), and how many
    of them it stored (the rest this worker held already)."""

    accepted: int
    stored: int


def import_blocks(pool: BlockPool, kv_cache: PagedKVCache, seq: Sequence, held: list[Hit],
                  first: int, blocks: list[KVBlock]) -> Imported:
    """Stores ``blocks``, block ``first`` of ``seq``'s prompt onwards, after checking each
    against ``seq`` (the first refusal, or the first block that cannot be stored, ends the
    import).

    They go into the working pool as cached copies, where admission finds them as it finds
    this worker's own, when ``held`` (the prefix this worker holds now, as
    ``BlockManager.cached_prefix`` finds it) is ``first`` working-pool blocks for them to
    extend and the pool has room for all of them; else into the second tier, where
    admission loads them back. The pool saves a write and a read of every block (on a CPU
    worker, to and from a file) on the request's way to its first token.
    """
    checked = []
    for index, block in enumerate(blocks, first):
        if not _matches(pool, seq, index, block):
            break
        checked.append(block)
    held_already = [pool.cached_block(block.digest) is not None or block.digest in pool.tier
                    for block in checked]
    in_pool = [hit for hit in held[:first] if isinstance(hit, Block)]
    accepted = _into_pool(pool, kv_cache, in_pool, checked) if len(in_pool) == first else None
    if accepted is None:
        accepted = _into_tier(pool, checked)
    return Imported(accepted, accepted - sum(held_already[:accepted]))


def _into_pool(pool: BlockPool, kv_cache: PagedKVCache, prefix: list[Block],
               blocks: list[KVBlock]) -> int | None:
    """Gives ``blocks`` cached copies in the working pool, each the extension of the one
    before (the first extends ``prefix``'s last), left evictable; returns how many it has, or
    None when the pool has no room for all of them."""
    for block in prefix:  # referenced, so that allocating cannot evict them
        pool.acquire(block)
    chain: list[Block] = []  # referenced too until the end
    try:
        if pool.num_available < len(blocks):
            return None
        parent = prefix[-1] if prefix else None
        for block in blocks:
            copy = _pool_copy(pool, kv_cache, block, parent)
            if copy is None:
                break
            chain.append(copy)
            parent = copy
        return len(chain)
    finally:
        pool.release(block.block_id for block in reversed(prefix + chain))


def _pool_copy(pool: BlockPool, kv_cache: PagedKVCache, block: KVBlock,
               parent: Block | None) -> Block | None:
    """The working pool's cached copy of ``block`` extending ``parent``, referenced: the one
    there already (computed here since the fetch was asked for), or a fresh block holding
    ``block``'s KV, marked fetched. None on a digest collision (the fresh block is freed)."""
    held = pool.lookup(block.digest, block.token_ids, block.parent_digest, parent)
    if held is not None:
        pool.acquire(held)
        return held
    target = pool.allocate(after=None if parent is None else parent.block_id)
    kv_cache.write_block(target.block_id, block.kv)
    if not pool.register(target, block.digest, block.token_ids, block.parent_digest, parent,
                         block.check):
        pool.release([target.block_id])
        return None
    target.fetched = True
    return target


def _into_tier(pool: BlockPool, blocks: list[KVBlock]) -> int:
    """Stores ``blocks`` in the second tier; returns how many it holds (the first the disk
    fails to write ends it)."""
    for stored, block in enumerate(blocks):
        if pool.cached_block(block.digest) is None:
            written = pool.tier.put(block)
            pool.tier_wrote(block.digest, written)
            if not written.stored:  # the disk failed: counted by the tier
                return stored
    return len(blocks)


def block_kv(kv_cache: PagedKVCache, block_id: int) -> torch.Tensor:
    """A copy of one block's KV: ``[layers, 2, kv_heads, block_size, head_dim]``, on the
    cache's device (the export moves it to host memory, where Ray's object store takes it)."""
    return kv_cache.layers_block(block_id).clone()


def _matches(pool: BlockPool, seq: Sequence, index: int, block: KVBlock) -> bool:
    """Whether ``block`` is block ``index`` of ``seq``'s own prefix, intact."""
    if index >= seq.num_reusable_blocks:
        return False
    expected = (seq.digest(index), tuple(seq.block_tokens(index)), seq.parent_digest(index),
                seq.prefix_check(index))
    return ((block.digest, tuple(block.token_ids), block.parent_digest, block.check) == expected
            and block.kv.nbytes == pool.tier.block_bytes
            and kv_checksum(block.kv) == block.checksum)
