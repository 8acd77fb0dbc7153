"""The long native kernels run without holding the GIL, as torch's own ops do.

A worker's event loop (Serve's streaming, routing stats, KV events) shares the process with
the engine thread. While a kernel held the GIL, a token the engine had finished waited for
the loop thread to get the GIL back: 15 ms at p90 in a lone request's stream on an AMX Xeon
(docs/performance.md, "A step's kernels and the GIL").
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
import torch

from workers import kernels
from workers.models.weight_formats import WeightFormat

LONG_CALL_S = 0.1
"""A kernel call at least this long makes a stall of the GIL unmistakable."""


@pytest.fixture
def one_thread():
    """One kernel thread: the test's own Python loop needs the other core of a 2-core CI."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def longest_stall(call: Callable[[], object]) -> tuple[float, float]:
    """Seconds: the longest this thread went without running Python while ``call`` ran in
    another thread, and how long ``call`` took there."""
    finished = threading.Event()
    took: list[float] = []

    def run() -> None:
        start = time.perf_counter()
        call()
        took.append(time.perf_counter() - start)
        finished.set()

    worker = threading.Thread(target=run)
    last, stall = time.perf_counter(), 0.0
    worker.start()
    while not finished.is_set():
        now = time.perf_counter()
        stall, last = max(stall, now - last), now
    worker.join()
    return stall, took[0]


def long_call(make: Callable[[int], Callable[[], object]]) -> Callable[[], object]:
    """``make(size)`` at the first size (doubling from 1) whose call takes LONG_CALL_S (on a Zen 5
    core the packed bf16 kernel needs 32,768 rows of 1,024 for that)."""
    for size in (2 ** i for i in range(15)):
        call = make(size)
        start = time.perf_counter()
        call()
        if time.perf_counter() - start >= LONG_CALL_S:
            return call
    raise AssertionError("no size made the kernel call long enough to measure")


def weight_linear_call(rows: int) -> Callable[[], object]:
    native = kernels.weight_linear()
    weight = torch.randn(1024, 1024).view(torch.uint8)  # fp32 rows: WeightFormat.F32
    x = torch.randn(8 * rows, 1024)
    return lambda: native.weight_linear(x, weight, int(WeightFormat.F32), 1024, None)


def packed_linear_call(rows: int) -> Callable[[], object]:
    """The dense small-batch kernel, in bf16 where it runs (AVX-512), else in fp32."""
    native = kernels.packed_linear()
    dtype = torch.bfloat16 if native.runs_bf16() else torch.float32
    weight = native.pack(torch.randn(1024, 1024).to(dtype))
    x = torch.randn(8 * rows, 1024).to(dtype)
    return lambda: native.linear(x, weight, 1024, None)


def paged_decode_call(batch: int) -> Callable[[], object]:
    """Every sequence's 2,048 tokens read from one block: compute-bound, a few KiB of KV."""
    native = kernels.paged_decode()
    keys, values = torch.randn(2, 16, 64), torch.randn(2, 16, 64)
    query = torch.randn(batch, 2, 4, 64)
    tables = torch.zeros(batch, 128, dtype=torch.int64)
    lengths = torch.full((batch,), 2048, dtype=torch.int64)
    return lambda: native.paged_decode_attention(query, keys, values, tables, lengths, 16, 0.1)


def runs(kernel: str) -> bool:
    native = getattr(kernels, kernel)()
    if kernel == "packed_linear":
        return native is not None and (native.runs_bf16() or native.runs_f32())
    return native is not None


@pytest.mark.parametrize(("kernel", "make"), [("weight_linear", weight_linear_call),
                                              ("packed_linear", packed_linear_call),
                                              ("paged_decode", paged_decode_call)])
def test_a_long_kernel_call_lets_other_threads_run_python(kernel, make, one_thread):
    if not runs(kernel):
        pytest.skip(f"{kernel} does not run here")
    stall, took = longest_stall(long_call(make))
    # Holding the GIL, the call stalls this thread for all of it; releasing it, for at most a
    # switch interval (5 ms) while the other thread runs its Python before and after.
    assert stall < took / 2, (stall, took)
