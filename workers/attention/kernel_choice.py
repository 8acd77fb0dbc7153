"""Which kernel a model's attention takes, chosen once from its dtype, device and head size.

Each choice rounds differently, so each is part of the cache identity's numerics (the engine
puts them in its numerics tag).
"""

from __future__ import annotations

import torch

from workers.kernels import paged_decode, prefill_attention

NATIVE_DECODE, GATHER_DECODE = "native-paged", "gather-sdpa"
FLASH_PREFILL = "sdpa-flash"


def prefill_kernel(dtype: torch.dtype, device: torch.device, head_dim: int) -> str:
    """What spans (prompts, prefill chunks) of a model in ``dtype`` on ``device`` attend with:
    our causal flash kernel for bf16 on CPUs, reading the cached context in place, named by
    what computes its products (``"amx-tiles"`` with AMX-BF16, ``"avx512-bf16"`` with
    AVX512-BF16 alone; head sizes 64, 128, 192, 256), or :data:`FLASH_PREFILL` (torch's fused
    attention, with a second call and a log-sum-exp merge over cached context). They round
    differently, so the choice is part of the cache identity's numerics.

    Our kernel's key blocks start at fixed positions and each query row is computed on its
    own, so a prompt gets bit-identical attention chunked or not, and over a cached prefix or
    cold; torch's kernel splits its work by the span's length. Measured against torch's kernel
    per causal layer of SmolLM2's shape (9 heads, 3 KV heads, head size 64,
    ``benchmarks/kernel_choices.py``): on an AMX Xeon, faster up to 1k tokens and level at
    4k-8k; on a Zen 5 EPYC with AVX512-BF16, about 4x faster at 1k-8k (see the README)."""
    kernel = prefill_attention() if device.type == "cpu" and dtype == torch.bfloat16 else None
    return kernel.backend if kernel is not None and head_dim in kernel.head_dims else FLASH_PREFILL


def decode_kernel(dtype: torch.dtype, device: torch.device, head_dim: int) -> str:
    """What plain decodes of a model in ``dtype`` on ``device`` with ``head_dim``-wide heads
    attend with: :data:`NATIVE_DECODE` (the kernel reading the paged cache in place, where it
    is built, for its head sizes) or :data:`GATHER_DECODE` (blocks gathered into a copy, then
    torch's SDPA). The two round differently, so the choice is part of the cache identity's
    numerics.

    Native in fp32 and bf16 on every CPU, where it measured faster
    (``benchmarks/kernel_choices.py``): with AVX512-BF16 alone, and with AMX too: on an AMX
    Xeon it took 0.55 ms per layer at 16 x 330 tokens in bf16 against 0.85 for the gathered
    copy in oneDNN's AMX-backed SDPA (which beat only an earlier kernel that made one serial
    dot per token)."""
    if device.type != "cpu":
        return GATHER_DECODE
    pays = dtype in (torch.float32, torch.bfloat16)
    kernel = paged_decode() if pays else None
    native = kernel is not None and head_dim in kernel.head_dims
    return NATIVE_DECODE if native else GATHER_DECODE


def decode_score_products(dtype: torch.dtype, block_size: int, head_dim: int) -> str:
    """What the native kernel computes bf16 decode scores with, for blocks of ``block_size``
    tokens and ``head_dim``-wide heads: ``"tiles"`` (one AMX tile product per block of 16
    tokens for all the query heads of a KV head), ``"pairs"`` (AVX512-BF16 pair products: the
    block's keys transposed once in registers into one vector per dim pair, then one product
    per dim pair and query head gives the 16 tokens' scores as one vector, and the softmax
    runs on vectors), or ``""`` (a dot product of widened keys and a horizontal sum per token
    and head). The first two need blocks of 16 and heads of 32-dim chunks; each rounds
    differently, so the choice is part of the cache identity's numerics."""
    kernel = paged_decode()
    if dtype != torch.bfloat16 or kernel is None:
        return ""
    return kernel.score_products(block_size, head_dim)
