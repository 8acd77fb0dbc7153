"""The fused gated activation (``workers/kernels/silu_mul.cpp`` through
``workers.models.gated``): bit for bit torch's ``F.silu(gate) * up``, on the strided halves of
a fused projection, with and without a scalar remainder per row. Skipped where the kernel
cannot be built (no C++ compiler); CI's machine has one."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

from workers.kernels import silu_mul
from workers.models.gated import GatedActivation

pytestmark = pytest.mark.skipif(silu_mul() is None, reason="no C++ compiler here")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "width"), [(1, 1536), (7, 1536), (16, 100), (3, 31)])
def test_silu_mul_is_bit_identical_to_torch(dtype, rows, width):
    """Widths 1,536 (SmolLM2: whole vectors), 100 and 31 (a remainder torch computes with
    std::exp); values spread over silu's range, including large negative and positive."""
    generator = torch.Generator().manual_seed(rows * width)
    gate_up = (torch.randn(rows, 2 * width, generator=generator) * 6).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    out = silu_mul().silu_mul(gate_up)
    assert out.dtype == dtype and out.shape == (rows, width)
    assert torch.equal(out, F.silu(gate) * up)


def test_gated_activation_serves_silu_and_keeps_other_activations():
    weight = torch.empty(4, 4)
    gate_up = torch.randn(5, 8)
    assert GatedActivation(ACT2FN["silu"], weight)._kernel is not None
    assert GatedActivation(nn.SiLU(), weight.bfloat16())._kernel is not None
    assert GatedActivation(ACT2FN["silu"], weight.half())._kernel is None
    gelu = GatedActivation(ACT2FN["gelu"], weight)
    assert gelu._kernel is None
    assert torch.equal(gelu(gate_up), F.gelu(gate_up[:, :4]) * gate_up[:, 4:])


def test_silu_mul_refuses_what_it_cannot_compute():
    kernel = silu_mul()
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        kernel.silu_mul(torch.randn(2, 8).half())
    with pytest.raises(RuntimeError, match=r"\[T, 2I\]"):
        kernel.silu_mul(torch.randn(2, 7))
    with pytest.raises(RuntimeError, match=r"\[T, 2I\]"):
        kernel.silu_mul(torch.randn(8, 2).t())
    with pytest.raises(RuntimeError, match="CPU tensors"):
        kernel.silu_mul(torch.randn(2, 8, device="meta"))
