"""Paged attention against a plain softmax-attention reference, and isolation between rows.

Random tensors, fp32, tiny geometry: each case builds a cache, writes known keys/values through
the metadata's slot mapping, and compares every row with attention computed directly from the
sequence's own tokens. Every case runs on both decode paths: the native kernel reading the
cache in place and the gather + SDPA path.
"""

from __future__ import annotations

import math

import pytest
import torch

from workers.attention import kernel_choice
from workers.attention.kernel_choice import GATHER_DECODE, NATIVE_DECODE, decode_kernel
from workers.attention.metadata import build_metadata
from workers.attention.paged import paged_attention
from workers.kernels import paged_decode
from workers.kv_cache import PagedKVCache

HEADS, KV_HEADS, DIM, BLOCK = 4, 2, 32, 4  # 32: the smallest head size the kernel takes
CPU = torch.device("cpu")


@pytest.fixture(autouse=True, params=[NATIVE_DECODE, GATHER_DECODE])
def decode_path(request, monkeypatch) -> str:
    """Runs the test on one decode path: the gather path by hiding the native kernel."""
    if request.param == GATHER_DECODE:
        monkeypatch.setattr(kernel_choice, "paged_decode", lambda: None)
    elif paged_decode() is None:
        pytest.skip("the native kernel could not be built here (no compiler)")
    assert decode_kernel(torch.float32, CPU, DIM) == request.param
    return request.param


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offset: int) -> torch.Tensor:
    """Causal attention of ``q`` ``[n, heads, dim]`` (positions ``offset ..``) over ``k``/``v``
    ``[ctx, kv_heads, dim]``, GQA by repeating KV heads."""
    group = HEADS // KV_HEADS
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(DIM)
    visible = torch.arange(k.shape[0])[None] <= (offset + torch.arange(q.shape[0]))[:, None]
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


def run_step(cache: PagedKVCache, tables: list[list[int]], computed: list[int], new: list[int],
             contexts: list[tuple[torch.Tensor, torch.Tensor]], queries: list[torch.Tensor]):
    """Write each sequence's earlier KV into its slots, then run one step of ``new`` tokens."""
    for table, (k, v), done in zip(tables, contexts, computed, strict=True):
        if done:
            slots = torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in range(done)])
            cache.write(0, slots, k[:done], v[:done])
    metadata = build_metadata(cache, tables, computed, new, torch.device("cpu"))
    key = torch.cat([k[d:d + n] for (k, _), d, n in zip(contexts, computed, new, strict=True)])
    value = torch.cat([v[d:d + n] for (_, v), d, n in zip(contexts, computed, new, strict=True)])
    out = paged_attention(0, torch.cat(queries), key, value, metadata, DIM ** -0.5)
    return out.split(new)


def random_sequence(generator: torch.Generator, length: int):
    k = torch.randn(length, KV_HEADS, DIM, generator=generator)
    v = torch.randn(length, KV_HEADS, DIM, generator=generator)
    return k, v


def test_mixed_step_matches_reference_for_decodes_chunks_and_fresh_prompts():
    generator = torch.Generator().manual_seed(0)
    cache = PagedKVCache(1, 32, BLOCK, KV_HEADS, DIM, torch.float32, torch.device("cpu"))
    # A decode at 13 tokens, a decode at 5 (same length group? no: 13 > 2 * 5), a decode at 9,
    # a chunk of 6 over 7 cached tokens (the log-sum-exp merge), a fresh 5-token prompt.
    lengths, computed = [13, 5, 9, 13, 5], [12, 4, 8, 7, 0]
    tables = [[3, 9, 1, 20], [30, 2], [5, 6, 7], [11, 12, 13, 14], [25, 26]]
    contexts = [random_sequence(generator, n) for n in lengths]
    new = [n - c for n, c in zip(lengths, computed, strict=True)]
    queries = [torch.randn(n, HEADS, DIM, generator=generator) for n in new]

    outputs = run_step(cache, tables, computed, new, contexts, queries)

    for out, query, (k, v), done in zip(outputs, queries, contexts, computed, strict=True):
        torch.testing.assert_close(out, reference(query, k, v, done), atol=1e-5, rtol=1e-5)


def test_a_poisoned_neighbour_never_reaches_a_shorter_decode_row():
    """Shorter decode rows are padded with the zeroed scratch block: inf/NaN in any other
    block of the cache (here: every block but the short row's own) cannot leak into it."""
    generator = torch.Generator().manual_seed(1)
    cache = PagedKVCache(1, 16, BLOCK, KV_HEADS, DIM, torch.float32, torch.device("cpu"))
    cache.keys[0][:, :16 * BLOCK] = float("nan")
    cache.values[0][:, :16 * BLOCK] = float("inf")
    lengths, computed = [12, 7], [11, 6]  # one decode group: 12 <= 2 * 7
    tables = [[0, 1, 2], [8, 9]]
    contexts = [random_sequence(generator, n) for n in lengths]
    contexts[0][0][3] = float("nan")  # the long row's own KV is poisoned too
    queries = [torch.randn(1, HEADS, DIM, generator=generator) for _ in lengths]

    long_out, short_out = run_step(cache, tables, computed, [1, 1], contexts, queries)

    # the gather path pads the short row's table with the scratch block, never another
    # request's block (slot 0 was the padding once)
    gathered = build_metadata(cache, tables, computed, [1, 1], torch.device("cpu"),
                              native_decode=False)
    (group,) = gathered.decode_groups
    assert group.block_ids.tolist() == [0, 1, 2, 8, 9, cache.scratch_block]
    assert torch.isnan(long_out).all()
    torch.testing.assert_close(short_out, reference(queries[1], *contexts[1], 6),
                               atol=1e-5, rtol=1e-5)
    assert not cache.keys[0][:, cache.scratch_block * BLOCK:].any()


def test_smollm2_geometry_decodes_match_the_reference_at_every_length_shape():
    """SmolLM2's attention geometry (9 query heads on 3 KV heads, dim 64, 16-token blocks):
    contexts of 1 token, a whole block, a block and one, and long ones, one decode group."""
    heads, kv_heads, dim, block = 9, 3, 64, 16
    generator = torch.Generator().manual_seed(2)
    cache = PagedKVCache(1, 64, block, kv_heads, dim, torch.float32, CPU)
    lengths = [33, 1, 16, 17, 40, 64]
    tables, next_block = [], 0
    for n in lengths:
        tables.append(list(range(next_block, next_block - (-n // block))))
        next_block = tables[-1][-1] + 1
    contexts = [(torch.randn(n, kv_heads, dim, generator=generator),
                 torch.randn(n, kv_heads, dim, generator=generator)) for n in lengths]
    for table, (k, v), n in zip(tables, contexts, lengths, strict=True):
        slots = torch.tensor([table[p // block] * block + p % block for p in range(n - 1)],
                             dtype=torch.long)
        cache.write(0, slots, k[:n - 1], v[:n - 1])
    metadata = build_metadata(cache, tables, [n - 1 for n in lengths], [1] * len(lengths), CPU)
    queries = torch.randn(len(lengths), heads, dim, generator=generator)
    out = paged_attention(0, queries, torch.stack([k[-1] for k, _ in contexts]),
                          torch.stack([v[-1] for _, v in contexts]), metadata, dim ** -0.5)
    for row, (k, v) in enumerate(contexts):
        group = heads // kv_heads
        kk, vv = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        probs = (torch.einsum("hd,khd->hk", queries[row], kk) * dim ** -0.5).softmax(-1)
        torch.testing.assert_close(out[row], torch.einsum("hk,khd->hd", probs, vv),
                                   atol=1e-5, rtol=1e-5)



def test_a_prompts_single_token_over_a_cached_prefix_attends_as_a_span():
    """A prompt's last token left after a cache hit takes the span (prefill) path, as the
    cold prefill of the whole prompt did; a decode's single token takes the short-query path.
    Both paths give the reference's attention."""
    generator = torch.Generator().manual_seed(3)
    cache = PagedKVCache(1, 16, BLOCK, KV_HEADS, DIM, torch.float32, CPU)
    tables, computed = [[0, 1, 2], [4, 5, 6]], [2 * BLOCK, 2 * BLOCK]
    metadata = build_metadata(cache, tables, computed, [1, 1], CPU, prompt=[True, False])
    assert [(span.start, span.end, span.num_cached) for span in metadata.spans] == [
        (0, 1, 2 * BLOCK)]
    assert [group.rows.tolist() for group in metadata.decode_groups] == [[1]]
    contexts = [random_sequence(generator, 2 * BLOCK + 1) for _ in tables]
    queries = [torch.randn(1, HEADS, DIM, generator=generator) for _ in tables]
    for table, (k, v) in zip(tables, contexts, strict=True):
        slots = torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in range(2 * BLOCK)])
        cache.write(0, slots, k[:2 * BLOCK], v[:2 * BLOCK])
    key = torch.cat([k[-1:] for k, _ in contexts])
    value = torch.cat([v[-1:] for _, v in contexts])
    outputs = paged_attention(0, torch.cat(queries), key, value, metadata, DIM ** -0.5).split(1)
    for out, query, (k, v) in zip(outputs, queries, contexts, strict=True):
        torch.testing.assert_close(out, reference(query, k, v, 2 * BLOCK), atol=1e-5, rtol=1e-5)
