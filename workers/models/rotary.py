"""RoPE (Su et al. 2021) of the compact path, in transformers' half-split layout.

The native kernel (``workers/kernels/rope.cpp``) rotates a whole ``[T, heads, dim]`` tensor in
one call, rounding each product and the sum where torch's elementwise ops round them, so its
result is bit-identical to the torch expression below (tested); the torch expression takes
six ops per call, each dispatched on its own, which at decode batch sizes cost more than the
arithmetic. Without the kernel the torch expression serves.
"""

from __future__ import annotations

import torch

from workers.kernels import rope


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` ``[T, heads, dim]`` (unit stride within a head) rotated by its tokens' ``cos``
    and ``sin`` ``[T, dim]`` (of ``x``'s dtype); returns ``[T, heads, dim]``."""
    kernel = rope() if x.device.type == "cpu" else None
    if kernel is not None and x.dtype in (torch.float32, torch.bfloat16):
        return kernel.rope(x, cos, sin)
    return rotate_with_torch(x, cos, sin)


def rotate_with_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The same rotation in torch ops, as transformers' ``apply_rotary_pos_emb`` computes it."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)
