"""Linear layers whose weights are laid out once for the CPU's matrix kernels.

On a CPU, ``F.linear`` in bf16 goes through oneDNN, which re-lays the weight out for its
AVX512-BF16/AMX kernels on every call. At decode batch sizes (1-16 rows) that repacking costs
about as much as the product itself: prepacking once (what torch's Inductor does when it freezes
weights) measured 1.3-1.6x faster per matmul on SmolLM2's shapes at 1-16 rows, with bit-identical
results. fp32 and GPU matmuls are left to ``F.linear``: oneDNN's fp32 kernels round differently
from MKL's, and the fp32 path is the one held to exact equality with transformers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _prepacking_pays(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16
            and torch.backends.mkldnn.is_available()
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


class Linear:
    """``y = x W^T + b``.

    Args:
        weight: ``[out_features, in_features]``.
        bias: ``[out_features]`` or None.

    Holds a prepacked copy of ``weight`` (same size in bytes) where that is faster, else a
    reference to it.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.bias = bias
        self.packed = _prepacking_pays(weight)
        self.weight = (torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
                       if self.packed else weight)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``[rows, in_features]`` → ``[rows, out_features]``."""
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    @classmethod
    def of(cls, module: torch.nn.Linear) -> Linear:
        """The fast form of a transformers ``nn.Linear``."""
        return cls(module.weight, module.bias)
