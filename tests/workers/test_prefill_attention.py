"""The bf16 prefill-attention kernel (``workers.kernels.prefill_attention``) on its own: its
values against attention in float64, its invariance to chunking, its refusals, and which models
take it. It runs on whichever backend this CPU has (AMX tiles or AVX512-BF16 pair products);
skipped on CPUs with neither (CI's machine has what the session's machine has)."""

from __future__ import annotations

import pytest
import torch

from workers.attention.kernel_choice import FLASH_PREFILL, prefill_kernel
from workers.kernels import prefill_attention

CPU = torch.device("cpu")
BLOCK = 16

pytestmark = pytest.mark.skipif(prefill_attention() is None,
                                reason="neither AMX-BF16 nor AVX512-BF16 here")


class Sequence:
    """One sequence's keys and values ``[total, kv_heads, dim]`` (bf16), its first tokens
    written into a paged cache through a shuffled block table, and queries for every token."""

    def __init__(self, total: int, heads: int, kv_heads: int, dim: int, seed: int):
        generator = torch.Generator().manual_seed(seed)
        draw = lambda *shape: torch.randn(*shape, generator=generator).bfloat16()  # noqa: E731
        self.query = draw(total, heads, dim)
        self.keys, self.values = draw(total, kv_heads, dim), draw(total, kv_heads, dim)
        blocks = -(-total // BLOCK)
        self.table = torch.randperm(blocks + 3, generator=generator)[:blocks]
        self.key_cache = torch.zeros(kv_heads, (blocks + 3) * BLOCK, dim).bfloat16()
        self.value_cache = torch.zeros_like(self.key_cache)
        slots = self.table[torch.arange(total) // BLOCK] * BLOCK + torch.arange(total) % BLOCK
        self.key_cache[:, slots] = self.keys.transpose(0, 1)
        self.value_cache[:, slots] = self.values.transpose(0, 1)

    def attend(self, start: int, end: int) -> torch.Tensor:
        """Tokens ``[start, end)`` as a span over the ``start`` tokens before them."""
        table = self.table[:-(-start // BLOCK)] if start else torch.empty(0, dtype=torch.int64)
        return prefill_attention().prefill_attention(
            self.query[start:end], self.keys[start:end], self.values[start:end],
            self.key_cache, self.value_cache, table, start, BLOCK, 0.125)

    def reference(self, start: int, end: int) -> torch.Tensor:
        """Causal softmax attention of queries ``[start, end)`` in float64, GQA expanded."""
        group = self.query.shape[1] // self.keys.shape[1]
        q = self.query[start:end].double().transpose(0, 1)
        k = self.keys[:end].double().repeat_interleave(group, 1).transpose(0, 1)
        v = self.values[:end].double().repeat_interleave(group, 1).transpose(0, 1)
        scores = q @ k.transpose(1, 2) * 0.125
        visible = torch.ones(end - start, end, dtype=torch.bool).tril(start)
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        return (probs @ v).transpose(0, 1)


@pytest.mark.parametrize(("heads", "kv_heads", "dim", "start", "end"), [
    (9, 3, 64, 0, 1), (9, 3, 64, 0, 300), (9, 3, 64, 37, 300), (9, 3, 64, 250, 251),
    (4, 4, 128, 100, 1200), (4, 2, 192, 20, 90), (2, 1, 256, 0, 70)])
def test_prefill_attention_matches_softmax_attention(heads, kv_heads, dim, start, end):
    """Within bf16's rounding (the probabilities enter P.V as bf16, as in torch's bf16 flash
    kernel), for GQA groups of 3 and 2, MHA, head sizes 64, 128, 192 (one row of 12 accumulators
    in the pair path's P.V) and 256, spans over a cached context
    read through the block table, across key ranges (1,024 keys at head size 128)."""
    seq = Sequence(end, heads, kv_heads, dim, seed=end)
    out = seq.attend(start, end)
    assert out.dtype == torch.bfloat16 and out.shape == (end - start, heads, dim)
    torch.testing.assert_close(out.double(), seq.reference(start, end), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("start", [0, 37])
def test_prefill_attention_holds_on_a_peaked_softmax(start):
    """Queries 8x larger: scores of standard deviation 8, so a few keys take most of each
    row's weight and a wrong running maximum or correction would show (at the other tests'
    scale the softmax is nearly uniform and could hide one)."""
    seq = Sequence(300, 9, 3, 64, seed=8)
    seq.query = (seq.query.float() * 8).bfloat16()
    torch.testing.assert_close(seq.attend(start, 300).double(), seq.reference(start, 300),
                               atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize(("dim", "total", "cuts"), [(64, 300, [16, 100, 250]),
                                                    (128, 1300, [7, 1030, 1100])])
def test_chunked_spans_are_bit_identical_to_one_span(dim, total, cuts):
    """Key blocks start at fixed positions and each query row is computed alone, so attending
    in chunks (each chunk over the cached tokens before it) gives the same bits as one span,
    across key ranges too (1,024 keys at head size 128). (The whole model's output still
    depends on the chunking in bf16: its matmuls round by row count.)"""
    seq = Sequence(total, 8, 2, dim, seed=dim)
    whole = seq.attend(0, total)
    bounds = [0, *cuts, total]
    chunked = torch.cat([seq.attend(a, b) for a, b in zip(bounds, bounds[1:], strict=False)])
    assert torch.equal(chunked, whole)


def test_prefill_attention_refuses_what_it_cannot_compute():
    seq = Sequence(40, 4, 2, 64, seed=1)
    kernel = prefill_attention()
    args = (seq.key_cache, seq.value_cache, seq.table[:1], 16, BLOCK, 0.125)
    with pytest.raises(RuntimeError, match="bfloat16"):
        kernel.prefill_attention(seq.query[16:].float(), seq.keys[16:].float(),
                                 seq.values[16:].float(), *args)
    with pytest.raises(RuntimeError, match="block id outside"):
        kernel.prefill_attention(seq.query[16:], seq.keys[16:], seq.values[16:], seq.key_cache,
                                 seq.value_cache, torch.tensor([99]), 16, BLOCK, 0.125)
    with pytest.raises(RuntimeError, match="num_cached outside"):
        kernel.prefill_attention(seq.query[16:], seq.keys[16:], seq.values[16:], seq.key_cache,
                                 seq.value_cache, seq.table[:1], 17, BLOCK, 0.125)
    with pytest.raises(RuntimeError, match="multiple of 64"):
        kernel.prefill_attention(seq.query[16:, :, :32], seq.keys[16:, :, :32],
                                 seq.values[16:, :, :32], seq.key_cache[..., :32].contiguous(),
                                 seq.value_cache[..., :32].contiguous(), seq.table[:1], 16,
                                 BLOCK, 0.125)
    with pytest.raises(RuntimeError, match="CPU tensors"):
        kernel.prefill_attention(seq.query[16:].to("meta"), seq.keys[16:], seq.values[16:], *args)


def test_prefill_kernel_takes_ours_for_bf16_heads_of_64_and_names_its_backend():
    backend = prefill_attention().backend
    assert backend in ("amx-tiles", "avx512-bf16")
    assert prefill_kernel(torch.bfloat16, CPU, 64) == backend
    assert prefill_kernel(torch.bfloat16, CPU, 128) == backend
    assert prefill_kernel(torch.float32, CPU, 64) == FLASH_PREFILL
    assert prefill_kernel(torch.bfloat16, CPU, 16) == FLASH_PREFILL
    assert prefill_kernel(torch.bfloat16, torch.device("meta"), 64) == FLASH_PREFILL


def test_a_bf16_step_routes_its_spans_to_our_kernel():
    """Through build_metadata and paged_attention, as the model calls them: a bf16 cache's
    metadata takes our kernel, and a span over cached context (20 cached tokens, 30 new)
    gets exactly the kernel's output, beside a decode row in the same step."""
    from workers.attention.metadata import build_metadata
    from workers.attention.paged import paged_attention
    from workers.kv_cache import PagedKVCache

    heads, kv_heads, dim = 4, 2, 64
    cache = PagedKVCache(1, 8, BLOCK, kv_heads, dim, torch.bfloat16, CPU)
    generator = torch.Generator().manual_seed(5)
    cache.keys[0].copy_(torch.randn(cache.keys[0].shape, generator=generator))
    cache.values[0].copy_(torch.randn(cache.values[0].shape, generator=generator))
    tables, computed, new = [[3, 1, 6, 0], [2, 4]], [20, 17], [30, 1]
    metadata = build_metadata(cache, tables, computed, new, CPU)
    assert metadata.native_prefill and len(metadata.spans) == 1
    rows = sum(new)
    query = torch.randn(rows, heads, dim, generator=generator).bfloat16()
    key = torch.randn(rows, kv_heads, dim, generator=generator).bfloat16()
    value = torch.randn(rows, kv_heads, dim, generator=generator).bfloat16()
    out = paged_attention(0, query, key, value, metadata, 0.125)
    direct = prefill_attention().prefill_attention(query[:30], key[:30], value[:30],
                                                   cache.keys[0], cache.values[0],
                                                   torch.tensor([3, 1]), 20, BLOCK, 0.125)
    assert torch.equal(out[:30], direct)
