"""The paged KV tensors, preallocated from a memory budget."""

from __future__ import annotations

import numpy as np
import torch
from transformers import PretrainedConfig

from workers import huge_pages


class PagedKVCache:
    """Per layer, a key and a value tensor of shape
    ``[num_kv_heads, (num_blocks + 1) * block_size, head_dim]``: slot ``b * block_size + i``
    holds token ``i`` of block ``b``.

    Head-major, so that a run of slots is a strided view ``[kv_heads, run, head_dim]`` that
    attention reads without a copy, and gathering a sequence's blocks copies whole
    ``block_size * head_dim`` rows. Block ``num_blocks`` (:attr:`scratch_block`) is never handed
    out by the pool and stays zero: decode rows of different lengths are padded with it, so
    padding never reads another request's KV (attention also zeroes every padded position it
    gathers, since a stale inf or NaN times a masked probability of 0 is NaN).

    Every layer's keys and values are views into one tensor ``[layers, 2, kv_heads, slots,
    head_dim]``, so one block across all layers is one strided view (:meth:`layers_block`):
    the second tier and transfers copy it in one call, where 60 per-layer copies of a
    SmolLM2 block cost 0.7 ms of Python, about 5% of a 2-worker no-reuse workload's
    throughput with the tier on.

    Args:
        num_layers, num_blocks, block_size, num_kv_heads, head_dim: the geometry (``num_blocks``
            usable blocks; the scratch block comes on top).
        dtype, device: where and how the KV values are stored (the model's dtype and device).
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.scratch_block = num_blocks
        self._all = torch.empty((num_layers, 2, num_kv_heads, (num_blocks + 1) * block_size,
                                 head_dim), dtype=dtype, device=device)
        huge_pages.advise(self._all, collapse=False)  # before the pages exist: huge as made
        huge_pages.advise(self._all.zero_())  # a page made small (no free 2 MiB then) collapsed
        self.keys = list(self._all[:, 0].unbind(0))  # each [kv_heads, slots, head_dim]
        self.values = list(self._all[:, 1].unbind(0))

    @property
    def block_bytes(self) -> int:
        """Bytes one block takes across all layers, keys and values."""
        return 2 * len(self.keys) * self.keys[0][:, :self.block_size].numel() * \
            self.keys[0].element_size()

    def layers_block(self, block_id: int) -> torch.Tensor:
        """``[layers, 2, kv_heads, block_size, head_dim]`` view of one block across every
        layer, keys (index 0) and values (index 1)."""
        layers, _, heads, _, head_dim = self._all.shape
        return self._all.view(layers, 2, heads, -1, self.block_size, head_dim)[:, :, :, block_id]

    def write_block(self, block_id: int, kv: np.ndarray) -> None:
        """Stores one block's KV across every layer from its raw bytes: ``kv`` is
        :attr:`block_bytes` uint8, laid out as :meth:`layers_block`'s view made contiguous (a
        block another worker exported). It may be read-only (Ray's object store hands out
        read-only arrays), so numpy copies it, into the cache itself on a CPU.

        Raises:
            ValueError: ``kv`` is not one block's bytes.
        """
        target = self.layers_block(block_id)
        host = target if target.device.type == "cpu" else torch.empty_like(target, device="cpu")
        as_bytes = host.view(torch.uint8).numpy()  # strided: the block's rows in every layer
        np.copyto(as_bytes, np.asarray(kv, dtype=np.uint8).reshape(as_bytes.shape))
        if host is not target:
            target.copy_(host)

    def write(self, layer: int, slots: torch.Tensor, key: torch.Tensor,
              value: torch.Tensor) -> None:
        """Store new tokens' KV: ``key``/``value`` are ``[T, kv_heads, head_dim]``, ``slots``
        ``[T]`` int64."""
        self.keys[layer].index_copy_(1, slots, key.transpose(0, 1))
        self.values[layer].index_copy_(1, slots, value.transpose(0, 1))

    def gather(self, layer: int, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of ``block_ids`` (``[N]`` int64), concatenated in that order.

        Returns:
            two ``[kv_heads, N * block_size, head_dim]`` contiguous tensors.
        """
        return self._gather(self.keys[layer], block_ids), self._gather(self.values[layer],
                                                                        block_ids)

    def _gather(self, tensor: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
        heads, _, head_dim = tensor.shape
        blocks = tensor.view(heads, -1, self.block_size, head_dim)
        return blocks.index_select(1, block_ids).view(heads, -1, head_dim)

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
        """As many usable blocks as ``budget_bytes`` holds (the scratch block is extra).

        Raises:
            ValueError: the budget holds less than one block.
        """
        num_blocks = budget_bytes // cls.bytes_per_block(config, block_size, dtype)
        if num_blocks < 1:
            raise ValueError(f"KV memory budget of {budget_bytes} bytes holds no block")
        layers, kv_heads, head_dim = cls.geometry(config)
        return cls(layers, num_blocks, block_size, kv_heads, head_dim, dtype, device)
