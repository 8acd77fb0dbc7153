"""A worker's second KV tier: cached blocks evicted from the working pool, kept under the same
digest in a bounded store, least recently used dropped first.

The idea is vLLM's KV offloading connector and SGLang's HiCache: eviction from the working
pool need not lose a prefix. Where the blocks go (:class:`HostSlots`, :class:`FileSlots`)
follows the worker's device: a GPU worker keeps them in host memory, page-locked so that a
block's copy to and from the device is direct; a CPU worker, whose working pool already is
host memory, keeps them in a file on local disk (the kernel's page cache keeps the hot part in
RAM, the rest on disk). ``--kv-tier-medium`` chooses otherwise.

A hit here is never taken on the digest alone. An entry keeps the block's tokens, the digest its
chain extends, a check of the whole token prefix it was computed after (a second hash chain,
independent of the digests: :func:`prefix_check`) and a checksum of its bytes. A load that
fails any of these is dropped and the tokens are computed instead.

The file is preallocated when the tier starts (``posix_fallocate``), so a full disk is found
then, not as a fault on a later write, and unlinked as soon as it is open, so a crashed worker
leaves nothing behind. Blocks move with ``pwrite`` and ``preadv`` through a one-block staging
buffer, not through a memory mapping: a disk that fails at run time (an I/O error, a remount
read-only) then fails a call, which is counted and costs a recompute, where a mapping would
take the worker down with SIGBUS.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import tempfile
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from contract.kv_transfer import KVBlock, kv_checksum
from workers.kv_cache import PagedKVCache

log = logging.getLogger(__name__)

LOAD_COST_SMOOTHING = 0.2
"""Weight of the newest sample in the moving average of load seconds per block."""


def prefix_check(parent_check: bytes, token_ids: Sequence[int]) -> bytes:
    """A 16-byte check of a block's whole token prefix: BLAKE2b over the previous block's check
    (the identity's root digest for block 0) and this block's token ids.

    A second chain, independent of the block digests (SHA-256), so a digest collision alone can
    never pass a block computed after other tokens as a hit.
    """
    tokens = np.asarray(token_ids, dtype="<u4").tobytes()
    return hashlib.blake2b(parent_check + tokens, digest_size=16).digest()


@dataclass(frozen=True)
class TierEntry:
    """One block held by the tier.

    Attributes:
        digest: the block's chained digest.
        token_ids: its tokens.
        parent_digest: the digest its chain extends.
        check: :func:`prefix_check` of its token prefix.
        slot: where its bytes are in the file.
        checksum: :func:`~contract.kv_transfer.kv_checksum` of its bytes as written.
        fetched: it came from another worker (else: evicted from this one's working pool).
    """

    digest: bytes
    token_ids: tuple[int, ...]
    parent_digest: bytes
    check: bytes
    slot: int
    checksum: int
    fetched: bool = False


@dataclass
class TierCounters:
    """Monotonic counts of the tier, in blocks and seconds.

    Attributes:
        saved_blocks: blocks written on eviction from the working pool.
        loaded_blocks: blocks read back for a hit.
        dropped_blocks: entries dropped to make room (least recently used).
        corrupt_blocks: loads refused because the bytes did not match their checksum.
        io_errors: reads and writes the disk failed (the block was not stored, or was dropped
            and recomputed).
        save_seconds, load_seconds: time spent writing and reading (checksums included).
        bytes_saved, bytes_loaded: bytes written and read.
    """

    saved_blocks: int = 0
    loaded_blocks: int = 0
    dropped_blocks: int = 0
    corrupt_blocks: int = 0
    io_errors: int = 0
    save_seconds: float = 0.0
    load_seconds: float = 0.0
    bytes_saved: int = 0
    bytes_loaded: int = 0
    load_s_per_block: float | None = field(default=None)
    """Moving average of one block's load, checksum included; None until the first load."""


class TierWrite(NamedTuple):
    """What storing a block did: whether the tier holds it now, and the digest of an entry
    dropped to make room (None if none was)."""

    stored: bool
    dropped: bytes | None


class HostSlots:
    """Block slots in host memory: a GPU worker's second tier.

    Args:
        num_blocks: slots.
        block_bytes: bytes of one block.
        pinned: page-lock the memory (where CUDA is), so that copies to and from the device
            need no bounce buffer.

    Raises:
        RuntimeError: the memory cannot be had: the caller runs without a second tier.
    """

    medium = "host"

    def __init__(self, num_blocks: int, block_bytes: int, pinned: bool = False):
        self.num_blocks, self.block_bytes = num_blocks, block_bytes
        self._slab = torch.empty((num_blocks, block_bytes), dtype=torch.uint8,
                                 pin_memory=pinned).numpy()

    def write(self, slot: int, data: memoryview) -> None:
        """Stores ``data`` (one block's bytes) in ``slot``."""
        self._slab[slot] = np.frombuffer(data, dtype=np.uint8)

    def read(self, slot: int, out: memoryview) -> None:
        """Copies ``slot``'s bytes into ``out``."""
        np.frombuffer(out, dtype=np.uint8)[:] = self._slab[slot]


class FileSlots:
    """Block slots in a file on local disk, preallocated and already unlinked: a CPU worker's
    second tier.

    Args:
        num_blocks: slots.
        block_bytes: bytes of one block.
        directory: where the file is made; None uses the system's temporary directory.

    Raises:
        OSError: the file cannot be made or its space reserved (read-only directory, full
            disk), when made; a read or write the disk fails, later.
    """

    medium = "disk"

    def __init__(self, num_blocks: int, block_bytes: int, directory: str | None = None):
        self.num_blocks, self.block_bytes = num_blocks, block_bytes
        self._fd = _reserved_file(directory, num_blocks * block_bytes)
        weakref.finalize(self, os.close, self._fd)

    def write(self, slot: int, data: memoryview) -> None:
        """Stores ``data`` (one block's bytes) in ``slot``, looping over short writes."""
        _whole(os.pwrite, self._fd, data, slot * self.block_bytes)

    def read(self, slot: int, out: memoryview) -> None:
        """Reads ``slot``'s bytes into ``out``, looping over short reads."""
        _whole(_pread, self._fd, out, slot * self.block_bytes)


class KVTier:
    """A bounded store of KV blocks, keyed by digest, in ``slots``.

    Args:
        kv_cache: the working pool's KV tensors, which blocks are copied from and to.
        slots: where the blocks' bytes are kept (:class:`HostSlots` or :class:`FileSlots`),
            ``kv_cache.block_bytes`` each.
    """

    def __init__(self, kv_cache: PagedKVCache, slots: HostSlots | FileSlots):
        if slots.num_blocks < 1:
            raise ValueError("a second KV tier needs room for at least one block")
        self.kv_cache = kv_cache
        self.slots = slots
        self.num_blocks = slots.num_blocks
        layers = len(kv_cache.keys)
        heads, _, head_dim = kv_cache.keys[0].shape
        self._staging = torch.empty((layers, 2, heads, kv_cache.block_size, head_dim),
                                    dtype=kv_cache.keys[0].dtype,
                                    pin_memory=kv_cache.keys[0].device.type == "cuda")
        self._staged = self._staging.view(-1).view(torch.uint8).numpy()
        self.block_bytes = self._staged.nbytes
        if self.block_bytes != slots.block_bytes:
            raise ValueError(f"slots of {slots.block_bytes} bytes for blocks of "
                             f"{self.block_bytes}")
        self._entries: OrderedDict[bytes, TierEntry] = OrderedDict()  # oldest first
        self._free_slots = list(range(self.num_blocks))
        self._reported_errors: set[tuple[str, int | None]] = set()
        self.counters = TierCounters()

    def __contains__(self, digest: bytes) -> bool:
        return digest in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def digests(self) -> list[bytes]:
        """Every digest the tier holds."""
        return list(self._entries)

    def lookup(self, digest: bytes, token_ids: Sequence[int], parent_digest: bytes,
               check: bytes) -> TierEntry | None:
        """The entry for ``digest`` if it holds ``token_ids``, extends ``parent_digest`` and
        was computed after the prefix ``check`` names; marks it recently used."""
        entry = self._entries.get(digest)
        if entry is None or (entry.token_ids, entry.parent_digest, entry.check) != (
                tuple(token_ids), parent_digest, check):
            return None
        self._entries.move_to_end(digest)
        return entry

    def save(self, block_id: int, digest: bytes, token_ids: Sequence[int],
             parent_digest: bytes, check: bytes) -> TierWrite:
        """Copies working-pool block ``block_id`` in under ``digest`` (before the pool hands
        the block to someone else)."""
        return self._store(digest, token_ids, parent_digest, check,
                           lambda: self._staging.copy_(self.kv_cache.layers_block(block_id)),
                           fetched=False)

    def put(self, block: KVBlock) -> TierWrite:
        """Stores a block fetched from another worker, which the caller has checked against
        its own prefix (``workers.kv_transfer``)."""
        return self._store(block.digest, block.token_ids, block.parent_digest, block.check,
                           lambda: np.copyto(self._staged, block.kv),
                           fetched=True)

    def export(self, digest: bytes) -> KVBlock | None:
        """A copy of the block held under ``digest``, for another worker; None if there is
        none, or its bytes cannot be read or fail their checksum (then it is dropped)."""
        entry = self._entries.get(digest)
        if entry is None or not self._read_intact(entry):
            return None
        return KVBlock(digest, entry.token_ids, entry.parent_digest, entry.check,
                       self._staged.copy(), entry.checksum)

    def _store(self, digest: bytes, token_ids: Sequence[int], parent_digest: bytes,
               check: bytes, stage: Callable[[], object], fetched: bool) -> TierWrite:
        """Writes the block ``stage`` puts in the staging buffer into a slot, dropping the
        least recently used entry when none is free. A digest already held is only marked
        recently used: its bytes on disk are already this prefix's KV."""
        if digest in self._entries:
            self._entries.move_to_end(digest)
            return TierWrite(True, None)
        started = time.perf_counter()
        dropped = None
        if not self._free_slots:
            dropped, oldest = self._entries.popitem(last=False)
            self._free_slots.append(oldest.slot)
            self.counters.dropped_blocks += 1
        slot = self._free_slots.pop()
        stage()
        if not self._transfer(self.slots.write, slot, "write"):
            self._free_slots.append(slot)
            return TierWrite(False, dropped)
        self._entries[digest] = TierEntry(digest, tuple(token_ids), parent_digest, check, slot,
                                          kv_checksum(self._staged), fetched)
        self.counters.saved_blocks += 1
        self.counters.bytes_saved += self.block_bytes
        self.counters.save_seconds += time.perf_counter() - started
        return TierWrite(True, dropped)

    def load(self, entry: TierEntry, block_id: int) -> bool:
        """Copies ``entry`` into working-pool block ``block_id``; False, with the entry
        dropped, if it is gone, or its bytes cannot be read or fail their checksum (the caller
        computes the tokens instead)."""
        started = time.perf_counter()
        if self._entries.get(entry.digest) is not entry or not self._read_intact(entry):
            return False
        self.kv_cache.layers_block(block_id).copy_(self._staging)
        elapsed = time.perf_counter() - started
        counters = self.counters
        counters.loaded_blocks += 1
        counters.bytes_loaded += self.block_bytes
        counters.load_seconds += elapsed
        counters.load_s_per_block = elapsed if counters.load_s_per_block is None else (
            LOAD_COST_SMOOTHING * elapsed
            + (1 - LOAD_COST_SMOOTHING) * counters.load_s_per_block)
        return True

    def _read_intact(self, entry: TierEntry) -> bool:
        """Reads ``entry``'s bytes into the staging buffer: whether they arrived and match
        their checksum. An entry that fails either is dropped."""
        if not self._transfer(self.slots.read, entry.slot, "read"):
            fault = "could not be read"
        elif kv_checksum(self._staged) != entry.checksum:
            fault = "failed its checksum"
            self.counters.corrupt_blocks += 1
        else:
            return True
        log.warning("KV tier: block %s %s; dropped and recomputed", entry.digest.hex()[:16],
                    fault)
        self.discard(entry.digest)
        return False

    def _transfer(self, move: Callable[[int, memoryview], None], slot: int,
                  action: str) -> bool:
        """Moves the staging buffer to (``slots.write``) or from (``slots.read``) ``slot``;
        False, counted and logged once per kind of fault, if the disk fails the call."""
        try:
            move(slot, memoryview(self._staged))
        except OSError as exc:
            self.counters.io_errors += 1
            fault = (action, exc.errno)
            if fault not in self._reported_errors:
                self._reported_errors.add(fault)
                log.warning("KV tier: a %s failed (%s); the block is recomputed when needed",
                            action, exc)
            return False
        return True

    def discard(self, digest: bytes) -> None:
        """Forgets ``digest`` (its slot is reused)."""
        entry = self._entries.pop(digest, None)
        if entry is not None:
            self._free_slots.append(entry.slot)

    def clear(self) -> None:
        """Forgets every block."""
        self._entries.clear()
        self._free_slots = list(range(self.num_blocks))


def _whole(call: Callable[[int, memoryview, int], int], fd: int, view: memoryview,
           offset: int) -> None:
    """``call`` (``os.pwrite`` or :func:`_pread`) until all of ``view`` is moved."""
    while view:
        done = call(fd, view, offset)
        view, offset = view[done:], offset + done


def _pread(fd: int, view: memoryview, offset: int) -> int:
    """``os.preadv`` into ``view``; an end of file before it is full is an error."""
    done = os.preadv(fd, [view], offset)
    if not done:
        raise OSError(errno.EIO, "the KV tier's file ended early")
    return done


def _reserved_file(directory: str | None, nbytes: int) -> int:
    """A descriptor of a new file in ``directory`` of ``nbytes`` bytes, its space reserved, the
    file already unlinked (the descriptor keeps it until it is closed)."""
    fd, path = tempfile.mkstemp(prefix="nalar-kv-tier-", suffix=".bin", dir=directory)
    try:
        os.unlink(path)
        os.posix_fallocate(fd, 0, nbytes)
    except OSError:
        os.close(fd)
        raise
    return fd
