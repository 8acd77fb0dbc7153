"""The native decode-attention kernel (``workers.kernels``) on its own: what the paged
attention tests cannot see through the layer (batch invariance, refusals, which models take
it). Skipped where it cannot be built (no C++ compiler); CI's machine has one."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import torch

from workers.attention.kernel_choice import GATHER_DECODE, NATIVE_DECODE, decode_kernel
from workers.attention.metadata import build_metadata
from workers.kernels import paged_decode

HEADS, KV_HEADS, DIM, BLOCK = 4, 2, 32, 4
CPU = torch.device("cpu")

pytestmark = pytest.mark.skipif(paged_decode() is None, reason="no C++ compiler here")


def random_cache(dtype: torch.dtype, seed: int):
    generator = torch.Generator().manual_seed(seed)
    keys = torch.randn(KV_HEADS, 8 * BLOCK, DIM, generator=generator).to(dtype)
    values = torch.randn(KV_HEADS, 8 * BLOCK, DIM, generator=generator).to(dtype)
    query = torch.randn(3, KV_HEADS, HEADS // KV_HEADS, DIM, generator=generator).to(dtype)
    return query, keys, values


TABLES = torch.tensor([[5, 2, 7], [0, 1, 3], [6, 4, 4]])
LENGTHS = torch.tensor([11, 9, 5])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_decode_matches_softmax_attention_over_the_table(dtype):
    """Against attention computed in float64 from the same (bf16-valued) tensors: fp32 to
    float32 rounding; bf16 to the rounding of its bf16 output."""
    query, keys, values = random_cache(dtype, 4)
    out = paged_decode().paged_decode_attention(query, keys, values, TABLES, LENGTHS, BLOCK,
                                                0.3)
    assert out.dtype == dtype
    for row, (table, length) in enumerate(zip(TABLES.tolist(), LENGTHS.tolist(), strict=True)):
        slots = torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in range(length)])
        k, v = keys[:, slots].double(), values[:, slots].double()  # [kv_heads, length, dim]
        probs = (query[row].double() @ k.transpose(1, 2) * 0.3).softmax(-1)
        tolerance = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(out[row].double(), probs @ v, atol=tolerance,
                                   rtol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [64, 80])
def test_native_decode_in_blocks_of_16_matches_softmax_attention(dtype, dim):
    """Blocks of 16 tokens, where bf16 takes a whole-block path (pair products or tiles, where
    the CPU has them, for heads of 32-dim chunks: 64, not 80) whose lanes past a sequence's
    length must be masked: lengths of 1, 16, 37 and 50 tokens, 3 and 5 query rows a KV head,
    against float64 attention."""
    generator = torch.Generator().manual_seed(dim)
    keys = torch.randn(2, 8 * 16, dim, generator=generator).to(dtype)
    values = torch.randn(2, 8 * 16, dim, generator=generator).to(dtype)
    tables = torch.tensor([[5, 2, 7, 0], [0, 1, 3, 6], [6, 4, 2, 1], [3, 7, 1, 2]])
    lengths = torch.tensor([37, 16, 1, 50])
    for rows in (3, 5):
        query = torch.randn(4, 2, rows, dim, generator=generator).to(dtype)
        out = paged_decode().paged_decode_attention(query, keys, values, tables, lengths, 16,
                                                    dim ** -0.5)
        for row, (table, length) in enumerate(zip(tables.tolist(), lengths.tolist(),
                                                  strict=True)):
            slots = torch.tensor([table[p // 16] * 16 + p % 16 for p in range(length)])
            k, v = keys[:, slots].double(), values[:, slots].double()
            probs = (query[row].double() @ k.transpose(1, 2) * dim ** -0.5).softmax(-1)
            tolerance = 1e-5 if dtype == torch.float32 else 1e-2
            torch.testing.assert_close(out[row].double(), probs @ v, atol=tolerance,
                                       rtol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_decode_is_batch_invariant_and_refuses_bad_tables(dtype):
    """A row's result is bit for bit the same alone and beside other rows (each sequence and KV
    head is computed on its own), and tables or lengths outside the cache are refused."""
    kernel = paged_decode()
    query, keys, values = random_cache(dtype, 3)
    batched = kernel.paged_decode_attention(query, keys, values, TABLES, LENGTHS, BLOCK, 0.3)
    for row in range(3):
        alone = kernel.paged_decode_attention(query[row:row + 1], keys, values,
                                              TABLES[row:row + 1], LENGTHS[row:row + 1],
                                              BLOCK, 0.3)
        assert torch.equal(alone[0], batched[row])
    with pytest.raises(RuntimeError, match="block id outside the cache"):
        kernel.paged_decode_attention(query[:1], keys, values, torch.tensor([[8, 0, 0]]),
                                      LENGTHS[:1], BLOCK, 0.3)
    with pytest.raises(RuntimeError, match="length outside the block table"):
        kernel.paged_decode_attention(query[:1], keys, values, TABLES[:1],
                                      torch.tensor([13]), BLOCK, 0.3)
    with pytest.raises(RuntimeError, match="all of one dtype"):
        kernel.paged_decode_attention(query[:1].half(), keys, values, TABLES[:1],
                                      LENGTHS[:1], BLOCK, 0.3)
    with pytest.raises(RuntimeError, match="CPU tensors"):
        kernel.paged_decode_attention(query[:1].to("meta"), keys.to("meta"), values.to("meta"),
                                      TABLES[:1], LENGTHS[:1], BLOCK, 0.3)


def test_the_native_path_is_taken_on_a_cpu_for_its_dtypes_and_head_sizes():
    assert decode_kernel(torch.float32, CPU, 64) == NATIVE_DECODE
    assert decode_kernel(torch.bfloat16, CPU, 64) == NATIVE_DECODE
    assert decode_kernel(torch.float16, CPU, 64) == GATHER_DECODE
    assert decode_kernel(torch.float32, torch.device("meta"), 64) == GATHER_DECODE
    assert decode_kernel(torch.float32, CPU, 8) == GATHER_DECODE  # no such head size
    with pytest.raises(RuntimeError, match="head_dim 8"):
        paged_decode().paged_decode_attention(torch.zeros(1, 1, 1, 8), torch.zeros(1, 4, 8),
                                              torch.zeros(1, 4, 8), torch.tensor([[0]]),
                                              torch.tensor([1]), 4, 1.0)


def test_native_decode_groups_are_chosen_once_per_step_and_carry_no_mask():
    from workers.kv_cache import PagedKVCache
    cache = PagedKVCache(1, 8, BLOCK, KV_HEADS, DIM, torch.float32, CPU)
    tables, computed = [[0, 1, 2], [3, 4]], [10, 5]  # contexts 11 and 6: padded to 12
    native = build_metadata(cache, tables, computed, [1, 1], CPU)
    gathered = build_metadata(cache, tables, computed, [1, 1], CPU, native_decode=False)
    [group] = native.decode_groups
    assert group.native and group.mask is None and group.padding is None
    assert group.lengths.tolist() == [11, 6]
    [group] = gathered.decode_groups
    assert not group.native and group.mask is not None and len(group.padding) == 1 + 6
    # A verification block (q_len 2) takes the native path with its sequence's table once:
    # each row has its own causal length, so it needs no mask either.
    verify = build_metadata(cache, tables, computed, [2, 1], CPU, verify=[True, False])
    assert [(g.q_len, g.native) for g in verify.decode_groups] == [(1, True), (2, True)]
    rows = verify.decode_groups[1]
    assert rows.mask is None and rows.lengths.tolist() == [11, 12]
    assert rows.block_ids.tolist() == [0, 1, 2]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("block", "heads", "kv_heads", "dim", "q_len", "computed"), [
    (BLOCK, HEADS, KV_HEADS, DIM, 3, 7),  # rows see 8, 9 and 10 tokens
    (16, 9, 3, 64, 5, 29),  # SmolLM2's shape, 4 drafts: 15 rows a KV head, in one call
    (16, 9, 3, 64, 6, 29),  # 5 drafts: 18 rows, more than the kernel takes at once
])
def test_a_verification_row_attends_exactly_as_a_plain_decode_of_its_position(
        dtype, block, heads, kv_heads, dim, q_len, computed):
    """Speculation stays exact on the native path: row j of a verification block (a decode
    token and its drafts, sharing each block's reads, each row over its own causal length)
    gets the bits a plain decode step at that position gets, across a block boundary in
    blocks of 16 (bf16 there takes tile or pair products where the CPU has them); where the
    rows outnumber the kernel's, each token goes as a sequence of its own."""
    from workers.attention.paged import paged_attention
    from workers.kv_cache import PagedKVCache
    cache = PagedKVCache(1, 8, block, kv_heads, dim, dtype, CPU)
    generator = torch.Generator().manual_seed(q_len)
    for tensor in (cache.keys[0], cache.values[0]):
        tensor.copy_(torch.randn(tensor.shape, generator=generator).to(dtype))
    table = [4, 0, 6]
    query = torch.randn(q_len, heads, dim, generator=generator).to(dtype)
    key = torch.randn(q_len, kv_heads, dim, generator=generator).to(dtype)
    value = torch.randn(q_len, kv_heads, dim, generator=generator).to(dtype)
    verified = paged_attention(0, query, key, value, build_metadata(
        cache, [table], [computed], [q_len], CPU, verify=[True]), scale=dim ** -0.5)
    for j in range(q_len):
        plain = paged_attention(0, query[j:j + 1], key[j:j + 1], value[j:j + 1],
                                build_metadata(cache, [table], [computed + j], [1], CPU),
                                scale=dim ** -0.5)
        assert torch.equal(verified[j:j + 1], plain)


def test_native_plain_decodes_are_one_group_in_row_order_whatever_their_lengths():
    from workers.kv_cache import PagedKVCache
    cache = PagedKVCache(1, 16, BLOCK, KV_HEADS, DIM, torch.float32, CPU)
    # contexts 2, 13 and 7 (more than 2x apart), then a verification block of 2 rows
    tables, computed, new = [[0], [1, 2, 3, 4], [5, 6], [7, 8]], [1, 12, 6, 6], [1, 1, 1, 2]
    native = build_metadata(cache, tables, computed, new, CPU,
                            verify=[False, False, False, True])
    plain, verify = native.decode_groups
    assert plain.native and plain.lengths.tolist() == [2, 13, 7]
    assert plain.row_index == slice(0, 3)  # a view of the batch, not a gather
    assert verify.native and verify.rows.tolist() == [3, 4] and verify.lengths.tolist() == [7, 8]
    gathered = build_metadata(cache, tables, computed, new, CPU,
                              verify=[False, False, False, True], native_decode=False)
    assert [g.lengths.tolist() for g in gathered.decode_groups] == [[8], [13, 7], [2]]
    assert gathered.decode_groups[1].rows.tolist() == [1, 2]


@pytest.mark.skipif(paged_decode() is None or not paged_decode().score_products(16, 64),
                    reason="neither AMX-BF16 nor AVX512-BF16 here")
@pytest.mark.parametrize(("dim", "group"), [(64, 3), (32, 1), (128, 5), (64, 16), (64, 6),
                                           (64, 7)])
def test_bf16_score_products_match_softmax_attention_whatever_a_block_tail_holds(dim, group):
    """bf16, blocks of 16: scores from tile or pair products (whichever this CPU has) against
    float64 attention, for SmolLM2's shape (head size 64, 3 query heads per KV head) and head
    sizes 32 and 128 with 1, 5, 6, 7 and 16 query heads per KV head (the pair path takes query
    heads in fours, zero-padded); a row alone equals it batched; a stale NaN or inf past a
    sequence's length in its last block (both paths load all 16 rows) changes nothing."""
    kernel, block = paged_decode(), 16
    generator = torch.Generator().manual_seed(16)
    keys = torch.randn(KV_HEADS, 12 * block, dim, generator=generator).bfloat16()
    values = torch.randn(KV_HEADS, 12 * block, dim, generator=generator).bfloat16()
    query = torch.randn(3, KV_HEADS, group, dim, generator=generator).bfloat16()
    tables, lengths = torch.tensor([[5, 2, 7], [0, 1, 3], [6, 4, 4]]), torch.tensor([40, 33, 9])
    out = kernel.paged_decode_attention(query, keys, values, tables, lengths, block, 0.125)
    for row, (table, length) in enumerate(zip(tables.tolist(), lengths.tolist(), strict=True)):
        slots = torch.tensor([table[p // block] * block + p % block for p in range(length)])
        k, v = keys[:, slots].double(), values[:, slots].double()
        probs = (query[row].double() @ k.transpose(1, 2) * 0.125).softmax(-1)
        torch.testing.assert_close(out[row].double(), probs @ v, atol=1e-2, rtol=1e-2)
        alone = kernel.paged_decode_attention(query[row:row + 1], keys, values,
                                              tables[row:row + 1], lengths[row:row + 1], block,
                                              0.125)
        assert torch.equal(alone[0], out[row])
    stale_keys, stale_values = keys.clone(), values.clone()
    stale_keys[:, 7 * block + 8:8 * block] = float("nan")  # row 0 reads 8 tokens of block 7
    stale_values[:, 7 * block + 8:8 * block] = float("inf")
    stale = kernel.paged_decode_attention(query, stale_keys, stale_values, tables, lengths,
                                          block, 0.125)
    assert torch.equal(stale, out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("per_kv", "q_len"), [(3, 5), (1, 16), (5, 3)])
def test_rows_with_their_own_lengths_equal_each_row_alone(dtype, per_kv, q_len):
    """Lengths [B, Q]: a sequence's Q tokens (each with its per_kv query heads) share each
    block's reads, token j seeing its own number of tokens. Every row gets the bits it gets as
    a sequence of its own, in blocks of 16 (bf16 takes tile or pair products where the CPU has
    them), with the tokens crossing a block boundary (lengths 30 to 34 of 16-token blocks), and
    a stale NaN or inf in the last block past the longest changes nothing."""
    kernel, block, dim = paged_decode(), 16, 64
    generator = torch.Generator().manual_seed(per_kv * q_len)
    keys = torch.randn(KV_HEADS, 8 * block, dim, generator=generator).to(dtype)
    values = torch.randn(KV_HEADS, 8 * block, dim, generator=generator).to(dtype)
    tables = torch.tensor([[5, 2, 7], [0, 1, 3]])
    lengths = torch.tensor([[34 - q_len + 1 + j for j in range(q_len)],
                            [16 - q_len + 1 + j for j in range(q_len)]]).clamp(min=1)
    query = torch.randn(2, KV_HEADS, q_len * per_kv, dim, generator=generator).to(dtype)
    shared = kernel.paged_decode_attention(query, keys, values, tables, lengths, block, 0.125)
    for b in range(2):
        for j in range(q_len):
            heads = slice(j * per_kv, (j + 1) * per_kv)
            alone = kernel.paged_decode_attention(query[b:b + 1, :, heads], keys, values,
                                                  tables[b:b + 1], lengths[b, j:j + 1], block,
                                                  0.125)
            assert torch.equal(shared[b:b + 1, :, heads], alone)
    keys[:, 7 * block + 2:8 * block] = float("nan")  # sequence 0 reads 2 tokens of block 7
    values[:, 7 * block + 2:8 * block] = float("inf")
    stale = kernel.paged_decode_attention(query, keys, values, tables, lengths, block, 0.125)
    assert torch.equal(stale, shared)
    with pytest.raises(RuntimeError, match="the rows a multiple of Q"):
        kernel.paged_decode_attention(query, keys, values, tables,
                                      torch.ones(2, q_len * per_kv + 1, dtype=torch.long),
                                      block, 0.125)


@pytest.mark.skipif(paged_decode() is None or shutil.which("objdump") is None,
                    reason="no native kernel or no objdump here")
def test_the_built_decode_kernel_prefetches_the_blocks_ahead_into_l2():
    """GCC 12 dropped every __builtin_prefetch of the block loop once inlined, so the kernel
    ran without the prefetch its source asks for (a batch-16 step's decode attention measured
    25.6 ms without, 16.8 ms with, on an AMD EPYC with AVX512-BF16). The blocks ahead go into
    L2 (prefetcht1): into L1 they gained far less (paged_decode.cpp's prefetch_ahead)."""
    listing = subprocess.run(["objdump", "-d", paged_decode().__file__], capture_output=True,
                             text=True, check=True).stdout
    assert "prefetcht1" in listing and "prefetcht0" not in listing


def test_one_kernel_can_be_left_out_by_name(monkeypatch):
    """NALAR_DISABLE_KERNELS names kernels to leave out; the others still load."""
    from workers import kernels
    monkeypatch.setenv(kernels.DISABLE_ONE_VARIABLE, "rope,silu_mul")
    build = kernels._build.__wrapped__  # past the per-process cache
    assert build("rope") is None and build("silu_mul") is None
    assert build("paged_decode") is not None
