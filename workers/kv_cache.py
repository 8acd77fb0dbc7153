"""The paged KV tensors, preallocated from a memory budget."""

from __future__ import annotations

import torch
from transformers import PretrainedConfig


class PagedKVCache:
    """Per layer, a key and a value tensor of shape
    ``[num_blocks * block_size, num_kv_heads, head_dim]``: slot ``b * block_size + i`` holds token
    ``i`` of block ``b``. Flat slots let a step write all its new tokens with one index_copy_.

    Args:
        num_layers, num_blocks, block_size, num_kv_heads, head_dim: the geometry.
        dtype, device: where and how the KV values are stored (the model's dtype and device).
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device):
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (num_blocks * block_size, num_kv_heads, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @staticmethod
    def geometry(config: PretrainedConfig) -> tuple[int, int, int]:
        """(layers, KV heads, head dim) of a transformers decoder config."""
        head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads)
        num_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        return config.num_hidden_layers, num_kv_heads, head_dim

    @classmethod
    def bytes_per_block(cls, config: PretrainedConfig, block_size: int, dtype: torch.dtype) -> int:
        """Bytes one block takes across all layers, keys and values."""
        layers, kv_heads, head_dim = cls.geometry(config)
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * layers * block_size * kv_heads * head_dim * itemsize

    @classmethod
    def from_budget(cls, config: PretrainedConfig, budget_bytes: int, block_size: int,
                    dtype: torch.dtype, device: torch.device) -> PagedKVCache:
        """As many blocks as ``budget_bytes`` holds.

        Raises:
            ValueError: the budget holds less than one block.
        """
        num_blocks = budget_bytes // cls.bytes_per_block(config, block_size, dtype)
        if num_blocks < 1:
            raise ValueError(f"KV memory budget of {budget_bytes} bytes holds no block")
        layers, kv_heads, head_dim = cls.geometry(config)
        return cls(layers, num_blocks, block_size, kv_heads, head_dim, dtype, device)
