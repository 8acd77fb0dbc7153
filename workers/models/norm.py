"""RMSNorm of the compact path: the native kernel where it is built, else the model's module.

transformers' Llama-family RMSNorm takes eight torch ops per call (to float32, pow, mean, add,
rsqrt, mul, to the input dtype, mul by the weight); at decode batch sizes each op's dispatch
costs more than its arithmetic, and a layer calls two norms. The kernel
(``workers/kernels/rms_norm.cpp``) does the same arithmetic in one call, rounding at the same
points; only the variance's summation order differs, so the choice is part of the cache
identity's numerics. The residual add before a norm joins it in the same call.
"""

from __future__ import annotations

import torch
from torch import nn

from workers.kernels import rms_norm

SAME_FORMULA = frozenset({"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm"})
"""transformers RMSNorm classes that compute ``weight * (x / sqrt(mean(x²) + eps))`` exactly
as the kernel does (Gemma's ``1 + weight``, say, does not)."""

NATIVE_NORM, TORCH_NORM = "native", "torch"


def norm_kernel(dtype: torch.dtype, device: torch.device) -> str:
    """What the compact path's norms run on for a model in ``dtype`` on ``device``:
    :data:`NATIVE_NORM` (CPU, float32 or bfloat16, the kernel built) or :data:`TORCH_NORM`."""
    native = (device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)
              and rms_norm() is not None)
    return NATIVE_NORM if native else TORCH_NORM


class RMSNorm:
    """One of the model's RMSNorm modules, run by the kernel when ``native`` and the module's
    class is in :data:`SAME_FORMULA`, else by the module itself.

    Args:
        module: a transformers RMSNorm (its ``weight`` ``[H]`` and ``variance_epsilon``).
        native: whether the kernel serves (see :func:`norm_kernel`).
    """

    def __init__(self, module: nn.Module, native: bool):
        self.module = module
        self._kernel = rms_norm() if native and type(module).__name__ in SAME_FORMULA else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[T, H]`` -> ``[T, H]`` in ``x``'s dtype."""
        if self._kernel is None:
            return self.module(x)
        return self._kernel.rms_norm(x, self.module.weight, self.module.variance_epsilon)

    def add_then_norm(self, x: torch.Tensor,
                      residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` and ``residual`` ``[T, H]`` -> ``(residual + x, norm(residual + x))``, in one
        native call where the kernel serves (vLLM's fused add-and-norm), bit-identical to the
        add and the norm one after the other."""
        if self._kernel is None:
            total = residual + x
            return total, self.module(total)
        total, normed = self._kernel.add_rms_norm(x, residual, self.module.weight,
                                                  self.module.variance_epsilon)
        return total, normed
