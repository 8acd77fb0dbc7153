"""The compact models' linear layer, the packed bf16 and fp32 kernel of its smallest batches,
and the process-wide bound on oneDNN's per-shape caches."""

from __future__ import annotations

import copy
import os

import pytest
import torch

from workers import kernels
from workers.models import linear as linear_module
from workers.models.linear import (
    PACKED_MAX_ROWS,
    PACKED_MAX_ROWS_AVX2,
    PACKED_MAX_ROWS_BF16_PAIRS,
    PRIMITIVE_CACHE_CAPACITY,
    PRIMITIVE_CACHES,
    Linear,
    bound_primitive_caches,
    linear_kernel,
    packed_max_rows,
    packs_small_batches,
)


def test_primitive_caches_are_bounded_unless_the_operator_sized_them(monkeypatch):
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "512")
    bound_primitive_caches()
    assert PRIMITIVE_CACHES == ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == str(PRIMITIVE_CACHE_CAPACITY) == "64"
    assert os.environ["LRU_CACHE_CAPACITY"] == "512"


# -- the packed kernel of small batches ---------------------------------------------------------

packed = kernels.packed_linear()
needs_packed = pytest.mark.skipif(packed is None or not packed.runs_bf16(),
                                  reason="no AVX2+FMA build of the packed kernel here")
needs_packed_f32 = pytest.mark.skipif(packed is None or not packed.runs_f32(),
                                      reason="no AVX2+FMA build of the packed kernel here")


def _bf16(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).bfloat16()


@needs_packed
@pytest.mark.parametrize(("n", "k", "rows"), [(960, 576, 1), (37, 64, 5), (3072, 576, 4),
                                              (576, 1536, 7), (16, 2, 3), (100, 30, 2),
                                              (200, 96, 13)])
def test_packed_kernel_is_the_float32_product_rounded_once_and_batch_invariant(n, k, rows):
    """Against float64: the kernel sums bf16 products in float32 (FMAs over widened weights,
    or AVX512-BF16 pair products) and rounds to bf16 once, so it is within one bf16 ulp (2^-8
    relative, checked against the output's scale). Feature counts off the 8- or 16-wide
    groups and the 4-group panels, a bias, rows over more than one pass, and each row alone
    equal to the same row in the batch, bit for bit."""
    weight, x, bias = _bf16(n, k, seed=n), _bf16(rows, k, seed=k), _bf16(n, seed=rows)
    weights, width = packed.pack(weight), packed.bf16_features
    assert weights.shape == ((n + width - 1) // width, k // 2, 2 * width)
    out = packed.linear(x, weights, n, bias)
    reference = x.double() @ weight.double().T + bias.double()
    scale = reference.abs() + reference.abs().mean()
    assert out.dtype == torch.bfloat16 and out.shape == (rows, n)
    assert ((out.double() - reference).abs() / scale).max() < 2 ** -8
    alone = torch.cat([packed.linear(x[r:r + 1], weights, n, bias) for r in range(rows)])
    assert torch.equal(alone, out)


@needs_packed
@pytest.mark.skipif(packed is not None and packed.bf16_pairs,
                    reason="AVX512-BF16's pair products round otherwise")
def test_widened_bf16_sums_are_the_same_on_avx2_and_avx512():
    """Where the weights are widened to fp32 (AVX2, or AVX-512 with AMX), each output sums its
    products in input order and rounds to bf16 once after the bias, whatever the vector width:
    equal bit for bit to that sum done in order here (a bf16 product is exact in fp32, so each
    FMA rounds only the addition). The cache identity's ``packed-bf16`` tag relies on it."""
    n, k, rows = 37, 96, 3
    weight, x, bias = _bf16(n, k, seed=11), _bf16(rows, k, seed=12), _bf16(n, seed=13)
    products = x.float()[:, None, :] * weight.float()[None, :, :]
    sums = torch.zeros(rows, n)
    for i in range(k):
        sums = sums + products[:, :, i]
    expected = (sums + bias.float()).bfloat16()
    assert torch.equal(packed.linear(x, packed.pack(weight), n, bias), expected)


@needs_packed
def test_packed_kernel_refuses_what_it_cannot_multiply():
    with pytest.raises(RuntimeError, match="K must be even"):
        packed.pack(_bf16(4, 3, seed=0))
    with pytest.raises(RuntimeError, match="bfloat16 or float32"):
        packed.pack(_bf16(4, 4, seed=0).half())
    weights = packed.pack(_bf16(20, 8, seed=0))
    with pytest.raises(RuntimeError, match="packed weight"):
        packed.linear(_bf16(1, 10, seed=1), weights, 20, None)
    with pytest.raises(RuntimeError, match="packed weight"):
        packed.linear(_bf16(1, 8, seed=1), weights, 40, None)
    with pytest.raises(RuntimeError, match="bias of 20"):
        packed.linear(_bf16(1, 8, seed=1), weights, 20, _bf16(7, seed=2))
    with pytest.raises(RuntimeError, match="of the packed weight's dtype"):
        packed.linear(_bf16(1, 8, seed=1).float(), weights, 20, None)


@pytest.mark.parametrize(("dtype", "inputs", "tag"), [
    pytest.param(torch.bfloat16, 64,
                 "packed-bf16-pairs" if packed is not None and packed.bf16_pairs
                 else "packed-bf16", marks=needs_packed),
    pytest.param(torch.float32, 63, "packed-fp32", marks=needs_packed_f32)])
def test_linear_takes_the_packed_kernel_below_its_rows_and_onednn_from_there(dtype, inputs, tag):
    """bf16 inputs go in pairs; fp32 ones may be any count."""
    weight = _f32(48, inputs, seed=3).to(dtype)
    linear, plain = Linear(weight, small_batches=True), Linear(weight)
    rows = packed_max_rows(dtype)
    if rows is None:
        pytest.skip("the packed kernel takes every row count here (next test)")
    small = _f32(rows - 1, inputs, seed=4).to(dtype)
    large = _f32(rows, inputs, seed=5).to(dtype)
    assert torch.equal(linear(small), packed.linear(small, packed.pack(weight), 48, None))
    assert linear.small_packed is not None and plain.small_packed is None
    assert torch.equal(linear(large), plain(large))
    assert linear_kernel(dtype, torch.device("cpu"), True).startswith(f"{tag}<{rows}+")


@needs_packed_f32
def test_the_row_thresholds_follow_the_kernels_path():
    """The 8-wide fp32 (AVX2) path keeps matmuls up to 31 rows, where oneDNN has no AVX-512;
    bf16 pair products keep them up to 127; bf16 without oneDNN's bf16 kernels, all."""
    width = packed.pack(_f32(3, 5, seed=7)).shape[2]
    assert width == packed.f32_features in (8, 16)
    assert packed_max_rows(torch.float32) == (PACKED_MAX_ROWS_AVX2 if width == 8
                                              else PACKED_MAX_ROWS)
    bf16_rows = PACKED_MAX_ROWS_BF16_PAIRS if packed.bf16_pairs else PACKED_MAX_ROWS
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        bf16_rows = None
    assert packed_max_rows(torch.bfloat16) == bf16_rows
    assert (PACKED_MAX_ROWS, PACKED_MAX_ROWS_AVX2, PACKED_MAX_ROWS_BF16_PAIRS) == (5, 32, 128)


@needs_packed
@pytest.mark.skipif(torch.ops.mkldnn._is_mkldnn_bf16_supported(),
                    reason="oneDNN has bf16 kernels for this CPU")
def test_without_onednn_bf16_the_packed_kernel_takes_bf16_matmuls_of_every_row_count():
    """On an AVX2-only CPU a prompt's 300 rows go through the packed kernel too (torch's own
    bf16 matmul was 2.5-9x slower), and the tag says so."""
    weight = _f32(48, 64, seed=3).bfloat16()
    linear = Linear(weight, small_batches=True)
    assert linear.packed is None
    prompt = _f32(300, 64, seed=4).bfloat16()
    assert torch.equal(linear(prompt), packed.linear(prompt, packed.pack(weight), 48, None))
    assert linear_kernel(torch.bfloat16, torch.device("cpu"), True) == "packed-bf16"


@needs_packed
def test_pair_products_serve_where_the_cpu_has_avx512_bf16_and_no_amx():
    """The build's choice (-march=native) against the CPU's own flags."""
    with open("/proc/cpuinfo") as cpuinfo:
        flags = next(line for line in cpuinfo if line.startswith("flags")).split()
    assert packed.bf16_pairs == ("avx512_bf16" in flags and "amx_bf16" not in flags)


@needs_packed
def test_only_bf16_models_of_even_inputs_within_the_bound_get_the_packed_copy(monkeypatch):
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 8)).bfloat16()
    assert not packs_small_batches(copy.deepcopy(model).half())
    assert packs_small_batches(model)
    assert not packs_small_batches(torch.nn.Linear(63, 8).bfloat16())  # inputs go in pairs
    with pytest.raises(RuntimeError, match="K must be even"):
        Linear(_bf16(8, 63, seed=6), small_batches=True)
    monkeypatch.setattr(linear_module, "PACKED_MAX_BYTES", (64 * 32 + 32 * 8) * 2 - 1)
    assert not packs_small_batches(model)


def _f32(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@needs_packed_f32
@pytest.mark.parametrize(("n", "k", "rows"), [(960, 576, 1), (37, 63, 5), (3072, 576, 4),
                                              (576, 1536, 3), (8, 1, 2), (100, 30, 7)])
def test_packed_f32_kernel_sums_in_input_order_and_is_batch_invariant(n, k, rows):
    """The fp32 path sums each output's products in input order with fused multiply-adds,
    then adds the bias: the same as a float64 reference within K float32 roundings. Odd
    inputs, features off the vector-wide groups and the 4-group panels, rows past one pass,
    and each row alone equal to the same row in the batch, bit for bit."""
    weight, x, bias = _f32(n, k, seed=n), _f32(rows, k, seed=k), _f32(n, seed=rows)
    weights = packed.pack(weight)
    width = weights.shape[2]
    assert width in (8, 16) and weights.shape == ((n + width - 1) // width, k, width)
    assert torch.equal(weights[0, 0, :min(n, width)], weight[:width, 0])  # [group][input][feature]
    out = packed.linear(x, weights, n, bias)
    reference = x.double() @ weight.double().T + bias.double()
    bound = (k + 1) * 2 ** -24 * ((x.double().abs() @ weight.double().abs().T) + bias.abs())
    assert out.dtype == torch.float32 and out.shape == (rows, n)
    assert ((out.double() - reference).abs() <= bound).all()
    alone = torch.cat([packed.linear(x[r:r + 1], weights, n, bias) for r in range(rows)])
    assert torch.equal(alone, out)


@needs_packed_f32
def test_fp32_models_of_any_input_count_get_the_packed_copy():
    model = torch.nn.Sequential(torch.nn.Linear(63, 32), torch.nn.Linear(32, 8))
    assert packs_small_batches(model)
    with pytest.raises(RuntimeError, match="packed weight"):
        packed.linear(_f32(1, 62, seed=1), packed.pack(_f32(40, 63, seed=7)), 40, None)
