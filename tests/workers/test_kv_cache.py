"""The paged KV tensors (``workers.kv_cache``): every layer's keys and values live in one
tensor, so a block across all layers is one view that the second tier and transfers copy in
one call."""

from __future__ import annotations

import torch

from workers.kv_cache import PagedKVCache

LAYERS, BLOCKS, BLOCK, KV_HEADS, DIM = 3, 5, 4, 2, 8


def filled() -> PagedKVCache:
    cache = PagedKVCache(LAYERS, BLOCKS, BLOCK, KV_HEADS, DIM, torch.float32,
                         torch.device("cpu"))
    generator = torch.Generator().manual_seed(0)
    for tensor in cache.keys + cache.values:
        tensor.copy_(torch.randn(tensor.shape, generator=generator))
    return cache


def test_a_layers_block_is_every_layers_keys_and_values_of_that_block():
    cache = filled()
    block = cache.layers_block(2)
    assert block.shape == (LAYERS, 2, KV_HEADS, BLOCK, DIM)
    slots = slice(2 * BLOCK, 3 * BLOCK)
    for layer in range(LAYERS):
        assert torch.equal(block[layer, 0], cache.keys[layer][:, slots])
        assert torch.equal(block[layer, 1], cache.values[layer][:, slots])
    assert all(t.is_contiguous() and t.shape == (KV_HEADS, (BLOCKS + 1) * BLOCK, DIM)
               for t in cache.keys + cache.values)  # what the native kernels require


def test_writing_a_layers_block_changes_that_block_only():
    cache, before = filled(), filled()
    cache.layers_block(4).copy_(cache.layers_block(1))
    for layer in range(LAYERS):
        for mine, theirs in ((cache.keys[layer], before.keys[layer]),
                             (cache.values[layer], before.values[layer])):
            assert torch.equal(mine[:, 4 * BLOCK:5 * BLOCK], theirs[:, BLOCK:2 * BLOCK])
            assert torch.equal(mine[:, :4 * BLOCK], theirs[:, :4 * BLOCK])
            assert torch.equal(mine[:, 5 * BLOCK:], theirs[:, 5 * BLOCK:])
    assert cache.block_bytes == cache.layers_block(0).numel() * 4
