"""The native RoPE (``workers/kernels/rope.cpp``) is bit-identical to transformers'
``apply_rotary_pos_emb`` with its own rotary tables, on strided views as the fused q/k/v
projection hands them over. Skipped without a C++ compiler."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from workers.kernels import rope
from workers.models.rotary import rotate, rotate_with_torch

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
