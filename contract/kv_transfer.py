"""KV blocks moved between workers: what a holder sends for each block a requester asks for by
digest (over Ray's object store, which carries the numpy payloads without copies)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


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
        crc: CRC-32 of ``kv``.
    """

    digest: bytes
    token_ids: tuple[int, ...]
    parent_digest: bytes
    check: bytes
    kv: np.ndarray
    crc: int


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
