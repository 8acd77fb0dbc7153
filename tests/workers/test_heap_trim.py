"""Heap trimming: free C-heap pages go back to the OS, at most once per interval, and the
engine loop trims between steps."""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import threading

import psutil

from contract.request import GenerationRequest, SamplingParams
from workers.async_engine import AsyncEngine
from workers.heap_trim import HeapTrimmer

LIBC = ctypes.CDLL(ctypes.util.find_library("c"))
LIBC.malloc.restype = ctypes.c_void_p
LIBC.malloc.argtypes = [ctypes.c_size_t]
LIBC.free.argtypes = [ctypes.c_void_p]
CHUNK = 100 * 1024  # under glibc's initial mmap threshold: served from an arena


def rss_mib() -> float:
    return psutil.Process().memory_info().rss / 2**20


def fragment_a_thread_arena(chunks: int) -> list[int]:
    """Touches ``chunks`` x 100 KiB from a thread's arena, then frees 9 of every 10: the freed
    pages lie between live chunks, so free() alone cannot return them."""
    kept: list[int] = []

    def run():
        blocks = [LIBC.malloc(CHUNK) for _ in range(chunks)]
        for block in blocks:
            ctypes.memset(block, 1, CHUNK)
        for i, block in enumerate(blocks):
            (LIBC.free if i % 10 else kept.append)(block)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return kept


def test_a_trim_returns_the_free_pages_between_live_chunks():
    trimmer = HeapTrimmer(interval_s=0)
    trimmer.maybe_trim()
    kept = fragment_a_thread_arena(2000)  # 195 MiB touched, 176 MiB of it freed
    before = rss_mib()
    assert trimmer.maybe_trim()
    released = before - rss_mib()
    for block in kept:
        LIBC.free(block)
    assert released > 120, f"only {released:.0f} MiB of 176 MiB freed went back"


def test_trims_happen_at_most_once_per_interval():
    now = [0.0]
    trimmer = HeapTrimmer(interval_s=10, clock=lambda: now[0])
    for t in (1, 9.9, 10, 15, 19.9, 20.5, 21):
        now[0] = t
        trimmer.maybe_trim()
    assert trimmer.trims == 2  # at 10 and at 20.5


async def test_the_engine_loop_trims_between_steps(tiny_qwen, make_engine):
    trimmer = HeapTrimmer(interval_s=0)
    engine = AsyncEngine(make_engine(tiny_qwen, num_blocks=32), heap_trimmer=trimmer)
    try:
        request = GenerationRequest("r", list(range(3, 23)), SamplingParams(
            temperature=0.0, max_tokens=5, ignore_eos=True))
        chunks = [chunk async for chunk in engine.generate(request)]
        await asyncio.sleep(0)
    finally:
        engine.shutdown()
    steps = sum(len(c.token_ids) for c in chunks)
    assert steps == 5
    assert trimmer.trims >= steps - 1  # one per step; the last may race the stream's end


def test_no_trim_without_glibc(monkeypatch):
    monkeypatch.setattr("workers.heap_trim._glibc_malloc_trim", lambda: None)
    assert not HeapTrimmer(interval_s=0).maybe_trim()
