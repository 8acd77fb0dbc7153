"""The tiny seeded models and the transformers reference attention the engine tests share
(imported by ``conftest.py`` and by test modules, which cannot import a conftest by name when
several test folders run together)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

TINY_SEED = 0


@contextlib.contextmanager
def reference_attention(model: torch.nn.Module) -> Iterator[None]:
    """Run ``model`` with plain transformers SDPA attention, then restore its implementation."""
    previous = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    try:
        yield
    finally:
        model.set_attn_implementation(previous)


def build_tiny_qwen2(dtype: torch.dtype = torch.float32) -> Qwen2ForCausalLM:
    """A 2-layer Qwen2 (GQA, qkv bias) with seeded random weights; same seed, same weights.

    ``initializer_range`` 0.2 keeps greedy logits away from near-ties, and the q/k/v biases
    (zero after init) are drawn too, so the bias path really contributes.
    """
    config = Qwen2Config(
        vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        initializer_range=0.2, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
        pad_token_id=2)
    torch.manual_seed(TINY_SEED)
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0.0, 0.2)
    model.set_attn_implementation("sdpa")
    return model.to(dtype).eval()
