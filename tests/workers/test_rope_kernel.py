"""The native RoPE (``workers/kernels/rope.cpp``) is bit-identical to transformers'
``apply_rotary_pos_emb`` with its own rotary tables, on strided views as the fused q/k/v
projection hands them over. Skipped without a C++ compiler."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from workers.kernels import rope
from workers.kv_cache import PagedKVCache
from workers.models.rotary import rotate, rotate_and_store, rotate_with_torch, split_heads

pytestmark = pytest.mark.skipif(rope() is None, reason="no C++ compiler here")
HEADS, KV_HEADS, DIM = 9, 3, 64  # SmolLM2-135M's attention


def projection(tokens: int, dtype: torch.dtype):
    """q and k as strided views of one fused projection output, and their positions' tables."""
    generator = torch.Generator().manual_seed(tokens)
    fused = (4 * torch.randn(tokens, (HEADS + 2 * KV_HEADS) * DIM, generator=generator)).to(dtype)
    q = fused[:, :HEADS * DIM].view(tokens, HEADS, DIM)
    k = fused[:, HEADS * DIM:(HEADS + KV_HEADS) * DIM].view(tokens, KV_HEADS, DIM)
    config = LlamaConfig(hidden_size=HEADS * DIM, num_attention_heads=HEADS,
                         num_key_value_heads=KV_HEADS, max_position_embeddings=8192)
    positions = torch.randint(0, 8192, (1, tokens), generator=generator)
    cos, sin = LlamaRotaryEmbedding(config)(q, positions)
    return q, k, cos[0], sin[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 16, 700])  # 700 x 9 heads: more than one thread's task
def test_rope_is_bit_identical_to_transformers(dtype, tokens):
    q, k, cos, sin = projection(tokens, dtype)
    assert tokens == 1 or not q.is_contiguous()  # one token's view counts as contiguous
    # transformers' layout: [batch, heads, T, dim], tables unsqueezed at dim 1
    q_ref, k_ref = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                        cos[None], sin[None])
    q_ours, k_ours = rotate(q, cos, sin), rotate(k, cos, sin)
    assert q_ours.dtype == dtype and q_ours.shape == q.shape
    assert torch.equal(q_ours, q_ref[0].transpose(0, 1))
    assert torch.equal(k_ours, k_ref[0].transpose(0, 1))
    assert torch.equal(q_ours, rotate_with_torch(q, cos, sin))  # the fallback, too


def caches(dtype: torch.dtype) -> tuple[PagedKVCache, PagedKVCache]:
    """Two identical 2-layer caches of 32 blocks of 4 slots, filled with noise."""
    pair = []
    for _ in range(2):
        cache = PagedKVCache(2, 32, 4, KV_HEADS, DIM, dtype, torch.device("cpu"))
        generator = torch.Generator().manual_seed(7)
        for tensor in cache.keys + cache.values:
            tensor.copy_(torch.randn(tensor.shape, generator=generator))
        pair.append(cache)
    return pair[0], pair[1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 5, 70])  # 70 x 15 heads x 64: more than one task
@pytest.mark.parametrize("path", ["kernel", "torch", "head norms"])
def test_rotate_and_store_is_the_split_rotations_and_cache_writes(dtype, tokens, path,
                                                                   monkeypatch):
    """The kernel, the torch ops where it is not built, and Qwen3's per-head norms before the
    rotation (always the torch ops) all store and return what the separate steps give."""
    from workers.models import rotary

    if path == "torch":
        monkeypatch.setattr(rotary, "rope", lambda: None)
    norms = None
    if path == "head norms":
        norms = tuple(Qwen3RMSNorm(DIM, eps=1e-6).to(dtype) for _ in range(2))
        for seed, norm in enumerate(norms):
            norm.weight.data.copy_(1 + torch.randn(DIM, generator=torch.Generator()
                                                   .manual_seed(seed)))
    generator = torch.Generator().manual_seed(tokens)
    width = (HEADS + 2 * KV_HEADS) * DIM
    wide = (4 * torch.randn(tokens, width + 32, generator=generator)).to(dtype)
    qkv = wide[:, :width]  # rows strided, as a LoRA-added or sliced projection may be
    _, _, cos, sin = projection(tokens, dtype)
    slots = torch.randperm(32 * 4, generator=generator)[:tokens]
    fused_cache, plain_cache = caches(dtype)

    with torch.no_grad():
        q, k, v = rotate_and_store(qkv, cos, sin, HEADS, KV_HEADS, fused_cache, 1, slots, norms)
        q_ref, k_ref, v_ref = split_heads(qkv, HEADS, KV_HEADS)
        if norms is not None:
            q_ref, k_ref = norms[0](q_ref), norms[1](k_ref)
    q_ref, k_ref = rotate_with_torch(q_ref, cos, sin), rotate_with_torch(k_ref, cos, sin)
    plain_cache.write(1, slots, k_ref, v_ref)
    assert torch.equal(q, q_ref) and torch.equal(k, k_ref) and torch.equal(v, v_ref)
    for fused, plain in zip(fused_cache.keys + fused_cache.values,
                            plain_cache.keys + plain_cache.values, strict=True):
        assert torch.equal(fused, plain)  # the slots written, and nothing else
    assert not torch.equal(fused_cache.keys[1], caches(dtype)[0].keys[1])


def test_rope_store_refusals():
    kernel = rope()
    cache, _ = caches(torch.float32)
    keys, values = cache.keys[0], cache.values[0]
    qkv = torch.zeros(2, (HEADS + 2 * KV_HEADS) * DIM)
    cos, sin = torch.zeros(2, DIM), torch.zeros(2, DIM)
    slots = torch.tensor([0, 5])
    with pytest.raises(RuntimeError, match="slots inside the cache"):
        kernel.rope_store(qkv, cos, sin, HEADS, KV_HEADS, keys, values, torch.tensor([0, 33 * 4]))
    with pytest.raises(RuntimeError, match="slots inside the cache"):
        kernel.rope_store(qkv, cos, sin, HEADS, KV_HEADS, keys, values, torch.tensor([-1, 0]))
    with pytest.raises(RuntimeError, match=r"slots \[T\] int64"):
        kernel.rope_store(qkv, cos, sin, HEADS, KV_HEADS, keys, values, slots.int())
    with pytest.raises(RuntimeError, match="of one dtype"):
        kernel.rope_store(qkv, cos, sin, HEADS, KV_HEADS, keys.bfloat16(), values, slots)
    with pytest.raises(RuntimeError, match="with unit stride along a row"):
        kernel.rope_store(qkv[:, :-DIM], cos, sin, HEADS, KV_HEADS, keys, values, slots)
    with pytest.raises(RuntimeError, match=r"contiguous caches \[KV, slots, D\]"):
        kernel.rope_store(qkv, cos, sin, HEADS, KV_HEADS, keys[:, ::2], values[:, ::2], slots)


def test_refusals():
    kernel = rope()
    q, _, cos, sin = projection(4, torch.float32)
    with pytest.raises(RuntimeError, match="of one dtype"):
        kernel.rope(q, cos.bfloat16(), sin)
    with pytest.raises(RuntimeError, match=r"cos and sin \[T, D\]"):
        kernel.rope(q, cos[:3], sin[:3])
    with pytest.raises(RuntimeError, match="unit stride within a head"):
        kernel.rope(q.transpose(1, 2), cos, sin)
    with pytest.raises(RuntimeError, match="an even head size"):
        kernel.rope(torch.zeros(4, 2, 5), torch.zeros(4, 5), torch.zeros(4, 5))
    with pytest.raises(RuntimeError, match="CPU tensors"):
        kernel.rope(torch.zeros(4, 2, 8, device="meta"), torch.zeros(4, 8, device="meta"),
                    torch.zeros(4, 8, device="meta"))
