"""KV blocks moved between workers: what a holder sends for each block a requester asks for by
digest (over Ray's object store, which carries the numpy payloads without copies)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import xxhash


def kv_checksum(kv: np.ndarray | memoryview) -> int:
    """XXH3-64 of one block's KV bytes: what catches a block corrupted on disk or in transit.

    Not a hash of identity (the digest chain and the prefix check are), so a fast
    non-cryptographic one. On one core of an AMX Xeon, XXH3 took 0.8 ms for the 23 MB of a
    992-token prefix of SmolLM2 in bf16, and zlib's CRC-32, used before, 11-14 ms (a throwaway
    timing, not committed); a second-tier load went from 0.25-0.26 to 0.20 ms a block
    (``benchmarks/results/xeon-amx/kv-reuse-3d7edfd/``, with the other changes of that run).
    """
    return xxhash.xxh3_64_intdigest(kv)


@dataclass(frozen=True)
class KVBlock:
    """One block's KV with what the receiver checks it against before any use.

    Attributes:
        digest: the block's chained digest.
        token_ids: its tokens.
        parent_digest: the digest its chain extends.
        check: the holder's check of the whole token prefix the KV was computed after
            (``workers.kv_tier.prefix_check``).
        kv: the KV values as raw bytes, ``[layers, 2 (keys, values), kv_heads, block_size,
            head_dim]`` in the holder's KV dtype, flattened (uint8).
        checksum: XXH3-64 of ``kv`` (:func:`contract.kv_transfer.kv_checksum`).
    """

    digest: bytes
    token_ids: tuple[int, ...]
    parent_digest: bytes
    check: bytes
    kv: np.ndarray
    checksum: int


@dataclass(frozen=True)
class KVSource:
    """A worker the router found holding more of a request's prefix than the worker it chose.

    Attributes:
        worker_id: the holder's worker id.
        blocks: leading prompt blocks the index credits it with.
    """

    worker_id: str
    blocks: int


@dataclass(frozen=True)
class KVExportRequest:
    """A worker's request to another for blocks by digest (routed to ``worker_id`` by the
    prefix-aware router, which reads it as the call's first argument).

    Attributes:
        worker_id: the holder asked.
        digests: the blocks wanted, leading block first.
    """

    worker_id: str
    digests: list[bytes]
