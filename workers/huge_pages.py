"""Backs the large tensors a decode step streams (the weights, the KV cache) with 2 MiB pages.

A decode step reads every weight once, and attention reads each sequence's KV blocks. On 4 KiB
pages that is a TLB miss every 4 KiB, and under a hypervisor each miss walks two page tables:
on a KVM guest with AMX, one thread summed 256 MiB of bf16 at 8.4 GB/s on 4 KiB pages and at
15.8 GB/s on 2 MiB pages (a throwaway loop); the step profiles in docs/performance.md measure
what it gives a step. Linux's transparent huge pages give those pages without reserving any,
but where they are set to ``madvise`` (Ubuntu's and Debian's default) only to memory that asks:
``madvise(MADV_HUGEPAGE)`` marks a range, and ``MADV_COLLAPSE`` (Linux 6.1) turns the pages it
already has into huge ones now rather than whenever ``khugepaged`` gets to them. Where they are
``always`` this changes nothing; where ``never``, or off Linux, the calls fail and nothing
changes either.
"""

from __future__ import annotations

import ctypes
import logging
import sys
from collections.abc import Iterable, Iterator

import torch

from workers.libc import libc

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
"""Bytes of an x86-64 (and arm64 4K-granule) transparent huge page."""
MADV_HUGEPAGE, MADV_COLLAPSE = 14, 25
"""``madvise`` advice values from Linux's ``mman-common.h``."""


def _has_storage(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` has an untyped storage of its own bytes (not sparse, not oneDNN's
    opaque layout)."""
    return tensor.layout == torch.strided and not tensor.is_mkldnn


def advise(tensor: torch.Tensor, collapse: bool = True) -> int:
    """Asks for huge pages under the whole 2 MiB pages inside ``tensor``'s storage, and with
    ``collapse`` for the pages it already has to become huge now. Only a strided CPU tensor
    of at least one huge page is touched.

    Returns:
        the bytes advised (0 where nothing was, or the kernel refused: nothing changes then).
    """
    clib = libc() if sys.platform.startswith("linux") else None
    if clib is None or tensor.device.type != "cpu" or not _has_storage(tensor):
        return 0
    storage = tensor.untyped_storage()
    start = storage.data_ptr()
    first = -(-start // HUGE_PAGE) * HUGE_PAGE
    last = (start + storage.nbytes()) // HUGE_PAGE * HUGE_PAGE
    if last <= first:
        return 0
    span = ctypes.c_size_t(last - first)
    if clib.madvise(ctypes.c_void_p(first), span, MADV_HUGEPAGE) != 0:
        log.debug("madvise(MADV_HUGEPAGE) refused (errno %d)", ctypes.get_errno())
        return 0
    if collapse and clib.madvise(ctypes.c_void_p(first), span, MADV_COLLAPSE) != 0:
        log.debug("madvise(MADV_COLLAPSE) refused (errno %d)", ctypes.get_errno())
    return last - first


def advise_all(tensors: Iterable[torch.Tensor], skip: Iterable[int] = ()) -> int:
    """:func:`advise` over ``tensors``, each storage once, but those starting at an address in
    ``skip`` (already on huge pages: a :class:`WeightArena`'s chunks); the bytes advised."""
    seen = set(skip)
    advised = 0
    for tensor in tensors:
        if not _has_storage(tensor):
            continue
        key = tensor.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            advised += advise(tensor)
    return advised


ARENA_CHUNK = 64 << 20
"""Bytes a :class:`WeightArena` takes from the system at a time (more for a larger tensor)."""


class WeightArena:
    """Copies of tensors packed one after another into chunks on huge pages, for weights made
    as many allocations of under 2 MiB each (a layer's projections), which :func:`advise`
    cannot help: no whole huge page lies inside any of them. A chunk lives while any copy in
    it does.

    Attributes:
        storages: the start address of each chunk's storage (for :func:`advise_all`'s ``skip``).
    """

    def __init__(self, chunk_bytes: int = ARENA_CHUNK):
        self._chunk_bytes = chunk_bytes
        self._chunk: torch.Tensor | None = None
        self._used = 0
        self.storages: set[int] = set()

    def place(self, tensor: torch.Tensor) -> torch.Tensor:
        """A contiguous copy of ``tensor`` (same dtype and shape) in the arena, 64-byte
        aligned; a tensor off the CPU is returned as it is."""
        if tensor.device.type != "cpu":
            return tensor
        nbytes = tensor.numel() * tensor.element_size()
        size = -(-nbytes // 64) * 64
        if self._chunk is None or self._used + size > self._chunk.numel():
            self._chunk = _huge_zeros(max(self._chunk_bytes, size))
            self._used = 0
            self.storages.add(self._chunk.untyped_storage().data_ptr())
        block = self._chunk[self._used:self._used + nbytes]
        self._used += size
        return block.view(tensor.dtype).view(tensor.shape).copy_(tensor)


def _huge_zeros(nbytes: int) -> torch.Tensor:
    """``[nbytes]`` zeroed uint8 starting on a 2 MiB boundary, on huge pages: asked for before
    any of its pages exist (so the kernel makes them huge as they are first touched), then
    collapsed (where no free 2 MiB block was at hand at that touch, a page stayed small)."""
    raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)
    advise(raw, collapse=False)
    advise(raw.zero_())
    start = -raw.data_ptr() % HUGE_PAGE
    return raw[start:start + nbytes]


def objects_of(root: object) -> Iterator[object]:
    """Every object held by ``root`` (a torch module, or one of our model wrappers) through
    its attributes, lists, tuples and dicts, ``root`` included, each once; a module's own
    parameters and buffers, not its submodules' attributes."""
    stack, seen = [root], set()
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        yield obj
        if isinstance(obj, torch.Tensor):
            continue
        if isinstance(obj, torch.nn.Module):
            stack.extend(obj.parameters())
            stack.extend(obj.buffers())
        elif isinstance(obj, list | tuple):
            stack.extend(obj)
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif type(obj).__module__.startswith("workers.") and hasattr(obj, "__dict__"):
            stack.extend(vars(obj).values())


def tensors_of(root: object) -> Iterator[torch.Tensor]:
    """Every tensor held by ``root`` (:func:`objects_of`): the weights in every form a step
    reads them (parameters, stored bytes, packed copies)."""
    return (obj for obj in objects_of(root) if isinstance(obj, torch.Tensor))
