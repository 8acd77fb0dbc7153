"""The paged attention as a transformers attention function, for architectures without a
compact implementation in ``workers.models``.

Importing this module registers :func:`paged_attention_forward` with transformers'
``AttentionInterface`` as :data:`ATTN_IMPLEMENTATION`, which
``model.set_attn_implementation`` then accepts; callers take the name from here, so the
registration has happened whenever they can name it.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface

from workers.attention.metadata import AttentionMetadata
from workers.attention.paged import paged_attention

ATTN_IMPLEMENTATION = "nalar_paged"


def paged_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                            value: torch.Tensor, attention_mask: torch.Tensor | None,
                            scaling: float | None = None, dropout: float = 0.0,
                            paged: AttentionMetadata | None = None,
                            **_: object) -> tuple[torch.Tensor, None]:
    """transformers attention function over the paged cache (the path for architectures
    without a compact implementation; ``workers.model_support`` refuses at load the features
    this function would otherwise drop).

    Args:
        module: the attention module (its ``layer_idx`` selects the cache layer).
        query: ``[1, num_heads, T, head_dim]``, RoPE applied.
        key, value: ``[1, num_kv_heads, T, head_dim]`` for the step's new tokens.
        attention_mask: ignored; which token sees which comes from ``paged``.
        scaling: softmax scale.
        paged: the step's metadata, passed through the model's forward kwargs.

    Returns:
        ``([1, T, num_heads, head_dim], None)``.

    Raises:
        ValueError: called without paged metadata (the model was run outside the engine).
    """
    if paged is None:
        raise ValueError("nalar_paged attention needs the engine's paged metadata")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = paged_attention(module.layer_idx, query[0].transpose(0, 1), key[0].transpose(0, 1),
                          value[0].transpose(0, 1), paged, scale)
    return out.unsqueeze(0), None


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
