"""Huge pages under the weights and the KV cache (``workers.huge_pages``): the kernel really
backs an advised tensor with 2 MiB pages where transparent huge pages are on (``madvise`` or
``always``), its values unchanged, and the engine's KV cache and large weights are advised."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from workers import huge_pages

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
needs_thp = pytest.mark.skipif(not THP.exists() or "[never]" in THP.read_text(),
                               reason="transparent huge pages are off here")


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
