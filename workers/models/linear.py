"""Linear layers whose weights are also laid out once for the CPU's small-batch kernels.

On a CPU, ``F.linear`` in bf16 goes through oneDNN, which re-lays the weight out for its
AVX512-BF16/AMX kernels on every call. At decode batch sizes that repacking costs about as much
as the product itself: prepacking once (what torch's Inductor does when it freezes weights)
measured 1.3-2.3x faster per matmul on SmolLM2's shapes at 1-16 rows (two runs), bit-identical.
From 512 rows on it is as often slower (``benchmarks/kernel_choices.py``), so prefills keep the
plain kernel. fp32 and GPU matmuls are left to ``F.linear``: oneDNN's fp32 kernels round
differently from MKL's, and the fp32 path is the one held to exact equality with transformers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

PREPACKED_MAX_ROWS = 256
"""Matmuls with fewer rows than this use the prepacked weight (measured crossover)."""


def _prepacking_pays(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16
            and torch.backends.mkldnn.is_available()
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


class Linear:
    """``y = x W^T + b``.

    Args:
        weight: ``[out_features, in_features]``.
        bias: ``[out_features]`` or None.

    Where prepacking pays, also holds a prepacked copy of ``weight`` (as many bytes again).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.weight = weight
        self.bias = bias
        self.packed = None
        if _prepacking_pays(weight):
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``[rows, in_features]`` → ``[rows, out_features]``."""
        if self.packed is not None and x.shape[0] < PREPACKED_MAX_ROWS:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    @classmethod
    def of(cls, module: torch.nn.Linear) -> Linear:
        """The fast form of a transformers ``nn.Linear``."""
        return cls(module.weight, module.bias)
