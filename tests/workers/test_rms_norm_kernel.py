"""The native RMSNorm (``workers/kernels/rms_norm.cpp``) against transformers' own modules:
same rounding points, so fp32 agrees to float32 rounding and bf16 to one bf16 step, and it
takes over only the classes that share the formula. Skipped without a C++ compiler."""

from __future__ import annotations

import pytest
import torch
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.mistral.modeling_mistral import MistralRMSNorm
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from workers.kernels import rms_norm
from workers.models.norm import NATIVE_NORM, TORCH_NORM, RMSNorm, norm_kernel

pytestmark = pytest.mark.skipif(rms_norm() is None, reason="no C++ compiler here")
HIDDEN = 576  # SmolLM2-135M: not a multiple of every vector width's square


def module(cls, dtype: torch.dtype, seed: int = 0):
    norm = cls(HIDDEN, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.5 * torch.randn(HIDDEN, generator=torch.Generator()
                                                .manual_seed(seed)))
    return norm.to(dtype)


def rows(count: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (3 * torch.randn(count, HIDDEN, generator=generator)).to(dtype)


@pytest.mark.parametrize("cls", [LlamaRMSNorm, MistralRMSNorm, Qwen2RMSNorm, Qwen3RMSNorm])
@pytest.mark.parametrize("count", [1, 16, 2049])  # decode batches, and a prefill that forks
def test_fp32_matches_the_module_to_float32_rounding(cls, count):
    norm, x = module(cls, torch.float32), rows(count, torch.float32)
    ours = RMSNorm(norm, native=True)(x)
    theirs = norm(x)
    assert ours.dtype == torch.float32 and ours.shape == (count, HIDDEN)
    torch.testing.assert_close(ours, theirs, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("count", [1, 16, 2049])
def test_bf16_matches_the_module_to_one_rounding_step(count):
    norm, x = module(LlamaRMSNorm, torch.bfloat16), rows(count, torch.bfloat16)
    ours, theirs = RMSNorm(norm, native=True)(x), norm(x)
    assert ours.dtype == torch.bfloat16
    differ = ours != theirs
    # Only the variance's summation order differs: the normalised value may land across a
    # bf16 rounding boundary, one step (at most 2**-7 relative), and the weight's product,
    # rounded again, at most one more.
    assert differ.float().mean() < 0.01
    steps = theirs[differ].float().abs() * 2**-7
    assert torch.all((ours[differ].float() - theirs[differ].float()).abs() <= 2.02 * steps)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("count", [1, 2049])
def test_the_fused_residual_add_is_the_add_then_the_norm(dtype, native, count):
    norm = RMSNorm(module(LlamaRMSNorm, dtype), native=native)
    x, residual = rows(count, dtype), rows(count, dtype, seed=2)
    total, normed = norm.add_then_norm(x, residual)
    assert torch.equal(total, residual + x)  # rounded once, as torch's add rounds
    assert torch.equal(normed, norm(residual + x))


def test_other_formulas_keep_their_module():
    gemma = module(GemmaRMSNorm, torch.float32)  # weight applied as (1 + weight)
    x = rows(4, torch.float32)
    assert torch.equal(RMSNorm(gemma, native=True)(x), gemma(x))
    llama = module(LlamaRMSNorm, torch.float32)
    assert torch.equal(RMSNorm(llama, native=False)(x), llama(x))


def test_the_kernel_serves_cpu_fp32_and_bf16_only():
    cpu = torch.device("cpu")
    assert norm_kernel(torch.float32, cpu) == NATIVE_NORM
    assert norm_kernel(torch.bfloat16, cpu) == NATIVE_NORM
    assert norm_kernel(torch.float16, cpu) == TORCH_NORM
    assert norm_kernel(torch.float32, torch.device("meta")) == TORCH_NORM


def test_refusals():
    kernel = rms_norm()
    with pytest.raises(RuntimeError, match="of one dtype"):
        kernel.rms_norm(rows(2, torch.float32), torch.ones(HIDDEN, dtype=torch.bfloat16), 1e-5)
    with pytest.raises(RuntimeError, match=r"x \[T, H\] and weight \[H\]"):
        kernel.rms_norm(rows(2, torch.float32), torch.ones(HIDDEN + 1), 1e-5)
    with pytest.raises(RuntimeError, match="of one dtype"):
        kernel.rms_norm(rows(2, torch.float16), torch.ones(HIDDEN, dtype=torch.float16), 1e-5)
    with pytest.raises(RuntimeError, match="residual of x's shape and dtype"):
        kernel.add_rms_norm(rows(2, torch.float32), rows(3, torch.float32), torch.ones(HIDDEN),
                            1e-5)
    with pytest.raises(RuntimeError, match="residual of x's shape and dtype"):
        kernel.add_rms_norm(rows(2, torch.float32), rows(2, torch.bfloat16), torch.ones(HIDDEN),
                            1e-5)
    with pytest.raises(RuntimeError, match="CPU tensors"):
        kernel.rms_norm(torch.zeros(2, HIDDEN, device="meta"),
                        torch.zeros(HIDDEN, device="meta"), 1e-5)
