"""RoPE (Su et al. 2021) of the compact path, in transformers' half-split layout.

The native kernel (``workers/kernels/rope.cpp``) rotates a whole ``[T, heads, dim]`` tensor in
one call, rounding each product and the sum where torch's elementwise ops round them, so its
result is bit-identical to the torch expression below (tested); the torch expression takes
six ops per call, each dispatched on its own, which at decode batch sizes cost more than the
arithmetic. Without the kernel the torch expression serves.
"""

from __future__ import annotations

import torch
from torch import nn

from workers.kernels import rope
from workers.kv_cache import PagedKVCache


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` ``[T, heads, dim]`` (unit stride within a head) rotated by its tokens' ``cos``
    and ``sin`` ``[T, dim]`` (of ``x``'s dtype); returns ``[T, heads, dim]``."""
    kernel = rope() if x.device.type == "cpu" else None
    if kernel is not None and x.dtype in (torch.float32, torch.bfloat16):
        return kernel.rope(x, cos, sin)
    return rotate_with_torch(x, cos, sin)


def rotate_and_store(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int,
                     kv_heads: int, cache: PagedKVCache, layer: int, slots: torch.Tensor,
                     head_norms: tuple[nn.Module, nn.Module] | None = None,
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Queries and keys rotated out of a fused q/k/v projection, and the rotated keys and the
    values stored in ``layer``'s cache at ``slots``: one native call where the kernel serves
    and there are no ``head_norms``.

    Args:
        qkv: ``[T, (heads + 2 kv_heads) * D]``, q, k and v side by side.
        cos, sin: ``[T, D]`` of ``qkv``'s dtype.
        slots: ``[T]`` int64 cache slots of the rows.
        head_norms: Qwen3's RMSNorms over each query and each key head, applied before the
            rotation (the kernel does not take them).

    Returns:
        ``q`` ``[T, heads, D]``, ``k`` and ``v`` ``[T, kv_heads, D]``, k rotated.
    """
    kernel = rope() if qkv.device.type == "cpu" and head_norms is None else None
    if kernel is not None and qkv.dtype in (torch.float32, torch.bfloat16) and \
            qkv.stride(-1) == 1:
        return tuple(kernel.rope_store(qkv, cos, sin, heads, kv_heads, cache.keys[layer],
                                       cache.values[layer], slots))
    q, k, v = split_heads(qkv, heads, kv_heads)
    if head_norms is not None:
        q, k = head_norms[0](q), head_norms[1](k)
    q, k = rotate(q, cos, sin), rotate(k, cos, sin)
    cache.write(layer, slots, k, v)
    return q, k, v


def split_heads(qkv: torch.Tensor, heads: int,
                kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Views ``[T, heads, D]``, ``[T, kv_heads, D]`` and ``[T, kv_heads, D]`` of a fused
    projection's output ``qkv`` ``[T, (heads + 2 kv_heads) * D]``."""
    rows = qkv.shape[0]
    dim = qkv.shape[1] // (heads + 2 * kv_heads)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    return (q.view(rows, heads, dim), k.view(rows, kv_heads, dim),
            v.view(rows, kv_heads, dim))


def rotate_with_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The same rotation in torch ops, as transformers' ``apply_rotary_pos_emb`` computes it."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)
