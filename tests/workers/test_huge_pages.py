"""Huge pages under the weights and the KV cache (``workers.huge_pages``): the kernel really
backs an advised tensor, and the arena's copies, with 2 MiB pages where transparent huge pages
are on (``madvise`` or ``always``), values unchanged; the engine's KV cache, large weights and
streamed weights are on them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from workers import huge_pages

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
needs_thp = pytest.mark.skipif(not THP.exists() or "[never]" in THP.read_text(),
                               reason="transparent huge pages are off here")


@pytest.fixture
def stored_weight_q4_1():
    from workers.models.weight_formats import StoredWeight, WeightFormat, row_bytes

    rows = torch.randint(0, 256, (16, row_bytes(WeightFormat.Q4_1, 64)), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(0))
    rows[:, :4] = 0  # zero scales and minima: no fp16 NaN in the header
    return StoredWeight.from_rows(rows, WeightFormat.Q4_1, 64)


def huge_bytes_at(address: int) -> int:
    """``AnonHugePages`` of the mapping holding ``address``, in bytes (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            start, end = (int(part, 16) for part in head.split("-"))
            inside = start <= address < end
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1]) * 1024
    return 0


@needs_thp
def test_an_advised_tensor_is_backed_by_huge_pages_and_keeps_its_values():
    values = torch.arange(8 << 20, dtype=torch.float32)  # 32 MiB, already touched
    expected = values.clone()
    advised = huge_pages.advise(values)
    assert advised >= 28 << 20  # all whole 2 MiB pages inside it
    assert huge_bytes_at(values.data_ptr() + (4 << 20)) >= 16 << 20
    assert torch.equal(values, expected)


def test_what_cannot_be_advised_is_left_alone():
    assert huge_pages.advise(torch.zeros(1000)) == 0  # under one huge page
    assert huge_pages.advise(torch.zeros(4 << 20, device="meta")) == 0


@needs_thp
def test_the_kv_cache_and_the_large_weights_are_advised(smollm, make_engine):
    engine = make_engine(smollm, num_blocks=512)  # 512 blocks of fp32 KV: 45 MiB
    kv = engine.runner.kv_cache._all
    assert huge_bytes_at(kv.data_ptr() + kv.nbytes // 2) > 0
    # The fused gate/up weight of each layer (3,072 x 576 fp32: 6.75 MiB), made by the engine.
    # (A weight still mapped from its safetensors file is file-backed: not this kind of page.)
    gate_up = engine.runner._compact.layers[0].gate_up_proj.weight
    storage = gate_up.untyped_storage()
    assert huge_bytes_at(storage.data_ptr() + storage.nbytes() // 2) > 0
    # What a decode step streams, each under 2 MiB, moved into the arena.
    packed = engine.runner._compact.layers[0].o_proj.small_packed
    if packed is not None:  # the fp32 packed kernel runs on this CPU
        assert huge_bytes_at(packed.data_ptr()) > 0


@needs_thp
def test_the_arena_copies_land_on_huge_pages_unchanged():
    arena = huge_pages.WeightArena(chunk_bytes=8 << 20)
    parts = [torch.randn(300, 577), torch.arange(1000, dtype=torch.int16).reshape(10, 100)]
    placed = [arena.place(part) for part in parts]
    for part, copy in zip(parts, placed, strict=True):
        assert torch.equal(copy, part) and copy.dtype == part.dtype and copy.is_contiguous()
        assert copy.data_ptr() % 64 == 0
    assert huge_bytes_at(placed[1].data_ptr()) > 0
    big = arena.place(torch.ones(3 << 20))  # 12 MiB: a chunk of its own
    assert torch.equal(big, torch.ones(3 << 20))
    meta = torch.empty(4, device="meta")
    assert arena.place(meta) is meta  # off the CPU: left where it is
    # Two chunks, each already on huge pages: advise_all passes over them.
    assert len(arena.storages) == 2
    assert huge_pages.advise_all([placed[0], big], skip=arena.storages) == 0
    assert huge_pages.advise_all([big]) >= 10 << 20


def test_a_stored_weight_rehomes_only_to_bytes_of_its_own_shape(stored_weight_q4_1):
    weight = stored_weight_q4_1
    copy = weight.data.clone()
    weight.rehome(copy)
    assert weight.data is copy
    with pytest.raises(ValueError, match="cannot move"):
        weight.rehome(copy[:1])
