"""The gated MLP's activation, ``act(gate) * up``, over the fused gate/up projection.

With SiLU (Llama, Mistral, Qwen2, Qwen3) on CPU in float32 or bfloat16 it is the native kernel
(``workers/kernels/silu_mul.cpp``): one pass over the projection's output where torch's two
ops make two passes and a ``[T, I]`` intermediate (at a 4,000-token SmolLM2 prefill they took
11.4 ms a layer, ``torch.profiler``). It rounds where torch rounds, so it is not part of the
cache identity's numerics; other activations keep the model's module.
"""

from __future__ import annotations

import torch
from torch import nn

from workers.kernels import silu_mul

SILU_CLASSES = frozenset({"SiLUActivation", "SiLU"})
"""Activation modules that compute ``x * sigmoid(x)`` as ``F.silu`` does."""


class GatedActivation:
    """``act(gate) * up`` for ``gate_up`` ``[T, 2I]`` (gate columns first), ``[T, I]`` out.

    Args:
        act: the MLP's activation module.
        weight: a weight of the model, for the device and dtype the kernel must serve.
    """

    def __init__(self, act: nn.Module, weight: torch.Tensor):
        self.act = act
        native = (weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16)
                  and type(act).__name__ in SILU_CLASSES)
        self._kernel = silu_mul() if native else None

    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self._kernel is not None:
            return self._kernel.silu_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act(gate) * up
