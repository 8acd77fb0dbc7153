"""The weight-streaming linear kernel against dequantize-then-multiply references, on every SIMD
path this CPU and build run, with odd shapes and remainders.

The GGUF formats' reference is the ``gguf`` package's own dequantization (llama.cpp's formulas
in numpy) of the rows before packing, not ours; per-channel int8, bf16 and fp32 are dequantized
here in torch. Tolerance: the kernel sums in float32 in another order than torch's matmul, so
float32 outputs agree to about 1e-6 of the output's scale (checked at 2e-5); bfloat16 outputs
are the float32 result rounded once (checked at one bf16 ulp, 2^-7 relative). GGUF formats
multiply with int8 activations, held to the bound that rounding implies.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from workers import kernels
from workers.models.weight_formats import (
    BLOCK,
    StoredWeight,
    WeightFormat,
    quantize_int8_per_channel,
    row_bytes,
)

native = kernels.weight_linear()
pytestmark = pytest.mark.skipif(native is None, reason="weight_linear kernel not built here")
PATHS = {"scalar": 1, "avx2": 2, "avx512": 3}
FLOAT32, INT8, BF16_PAIRS = 0, 1, 2  # the kernel's products argument
AVAILABLE = native.paths() if native is not None else []
GGUF_TYPES = {WeightFormat.Q8_0: gguf.GGMLQuantizationType.Q8_0,
              WeightFormat.Q4_0: gguf.GGMLQuantizationType.Q4_0,
              WeightFormat.Q4_1: gguf.GGMLQuantizationType.Q4_1}
ROW_FORMATS = [fmt for fmt in WeightFormat if fmt not in GGUF_TYPES]


def _half_bytes(values: torch.Tensor) -> torch.Tensor:
    return values.to(torch.float16).contiguous().view(torch.uint8).reshape(*values.shape, 2)


def random_stored(fmt: WeightFormat, out_features: int, in_features: int,
                  seed: int, quant_byte: int | None = None) -> StoredWeight:
    """A weight of random stored bytes with sane scales (no fp16 NaN or infinity); a GGUF
    format's quant bytes all ``quant_byte`` where it is given."""
    g = torch.Generator().manual_seed(seed)
    blocks = in_features // BLOCK
    if fmt == WeightFormat.F32:
        data = torch.randn(out_features, in_features, generator=g).view(torch.uint8)
    elif fmt == WeightFormat.BF16:
        data = torch.randn(out_features, in_features, generator=g).bfloat16().view(torch.uint8)
    elif fmt == WeightFormat.INT8_CHANNEL:
        return quantize_int8_per_channel(torch.randn(out_features, in_features, generator=g))
    else:
        scale = _half_bytes(0.01 + 0.1 * torch.rand(out_features, blocks, generator=g))
        parts = [scale]
        if fmt == WeightFormat.Q4_1:
            parts.append(_half_bytes(torch.randn(out_features, blocks, generator=g) * 0.1))
        quant_bytes = 32 if fmt == WeightFormat.Q8_0 else 16
        quants = torch.randint(0, 256, (out_features, blocks, quant_bytes), generator=g,
                               dtype=torch.uint8)
        parts.append(quants.fill_(quant_byte) if quant_byte is not None else quants)
        data = torch.cat(parts, dim=2).reshape(out_features, -1)
    return StoredWeight.from_rows(data, fmt, in_features)


def reference_weight(weight: StoredWeight) -> torch.Tensor:
    """``[out, in]`` float32, dequantized without our kernel."""
    data = weight.rows()
    if weight.fmt in GGUF_TYPES:
        return torch.from_numpy(gguf.quants.dequantize(data.numpy(), GGUF_TYPES[weight.fmt]))
    if weight.fmt == WeightFormat.F32:
        return data.view(torch.float32).clone()
    if weight.fmt == WeightFormat.BF16:
        return data.view(torch.bfloat16).float()
    scale = data[:, :4].contiguous().view(torch.float32)
    return data[:, 4:].contiguous().view(torch.int8).float() * scale


@pytest.mark.parametrize("path", AVAILABLE)
@pytest.mark.parametrize("fmt", list(WeightFormat))
def test_dequantize_matches_the_reference(path, fmt):
    """All features (9: a whole group and a padded one), and a lookup of some."""
    weight = random_stored(fmt, 9, 96, seed=int(fmt))
    reference = reference_weight(weight)
    ours = native.dequantize(weight.data, int(fmt), 9, 96, None, PATHS[path])
    # Q4 values are d*q + m: one fused rounding in our kernel against two in numpy's.
    tolerance = 1e-6 * reference.abs().max().item()
    torch.testing.assert_close(ours, reference, rtol=0, atol=tolerance)
    rows = torch.tensor([8, 0, 3, 8])
    looked_up = native.dequantize(weight.data, int(fmt), 9, 96, rows, PATHS[path])
    torch.testing.assert_close(looked_up, reference[rows], rtol=0, atol=tolerance)
    with pytest.raises(RuntimeError, match="out of range"):
        native.dequantize(weight.data, int(fmt), 9, 96, torch.tensor([9]), PATHS[path])


@pytest.mark.parametrize("path", AVAILABLE)
@pytest.mark.parametrize("fmt", list(WeightFormat))
def test_dequantizing_to_bf16_rounds_as_torch_rounds_the_float32_weights(path, fmt):
    """All features (17: two whole groups and a padded one), and a lookup: bit for bit
    ``.to(torch.bfloat16)`` of the float32 dequantization, which a bf16 prefill multiplied
    before."""
    weight = random_stored(fmt, 17, 96, seed=int(fmt) + 1)
    float32 = native.dequantize(weight.data, int(fmt), 17, 96, None, PATHS[path])
    bf16 = native.dequantize(weight.data, int(fmt), 17, 96, None, PATHS[path], torch.bfloat16)
    assert bf16.dtype == torch.bfloat16
    assert torch.equal(bf16.view(torch.int16), float32.bfloat16().view(torch.int16))
    rows = torch.tensor([16, 2, 9])
    looked_up = native.dequantize(weight.data, int(fmt), 17, 96, rows, PATHS[path],
                                  torch.bfloat16)
    assert torch.equal(looked_up.view(torch.int16), float32[rows].bfloat16().view(torch.int16))
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        native.dequantize(weight.data, int(fmt), 17, 96, None, PATHS[path], torch.float16)


@pytest.mark.parametrize("fmt", list(GGUF_TYPES))
@pytest.mark.parametrize("out_features", [1, 8, 13])
def test_packing_keeps_every_byte_of_the_gguf_rows(fmt, out_features):
    """Packed groups of 8 features are the file's bytes reordered: unpacking gives them back,
    and the packed size is the rows' size (padded to whole groups)."""
    g = torch.Generator().manual_seed(out_features)
    rows = torch.randint(0, 256, (out_features, row_bytes(fmt, 64)), generator=g,
                         dtype=torch.uint8)
    packed = native.pack(rows, int(fmt), 64)
    groups = -(-out_features // 8)
    assert packed.shape == (groups, 8 * row_bytes(fmt, 64))
    assert torch.equal(native.unpack(packed, int(fmt), out_features, 64), rows)
    assert torch.equal(StoredWeight.from_rows(rows, fmt, 64).rows(), rows)


@pytest.mark.parametrize("path", AVAILABLE)
@pytest.mark.parametrize("fmt", ROW_FORMATS)
@pytest.mark.parametrize("rows,out_features,in_features",
                         [(1, 1, 32), (3, 5, 96), (5, 7, 544), (17, 33, 1056), (2, 258, 576)])
def test_linear_matches_dequantize_then_multiply(path, fmt, rows, out_features, in_features):
    """Odd rows (register-tile remainders), odd output features (column-tile remainders), and
    inputs past one 512-wide buffer fill (544: one fill and a 32-wide rest)."""
    weight = random_stored(fmt, out_features, in_features, seed=rows * 1000 + out_features)
    g = torch.Generator().manual_seed(in_features)
    x = torch.randn(rows, in_features, generator=g)
    bias = torch.randn(out_features, generator=g)
    expected = x @ reference_weight(weight).T + bias
    y = native.weight_linear(x, weight.data, int(fmt), out_features, bias, PATHS[path])
    scale = expected.abs().max().item()
    torch.testing.assert_close(y, expected, rtol=0, atol=2e-5 * scale)
    y16 = native.weight_linear(x.bfloat16(), weight.data, int(fmt), out_features, None,
                               PATHS[path])
    expected16 = x.bfloat16().float() @ reference_weight(weight).T
    assert y16.dtype == torch.bfloat16
    torch.testing.assert_close(y16.float(), expected16, rtol=2 ** -7, atol=2e-5 * scale)


def test_paths_end_with_scalar_and_a_missing_one_is_refused():
    assert AVAILABLE[-1] == "scalar"
    assert set(AVAILABLE) <= set(PATHS)
    weight = random_stored(WeightFormat.Q4_0, 4, 32, seed=0)
    for name in set(PATHS) - set(AVAILABLE):
        with pytest.raises(RuntimeError, match="not available"):
            native.weight_linear(torch.ones(1, 32), weight.data, 1, 4, None, PATHS[name], INT8)


def test_every_path_agrees_with_the_widest_on_one_layer():
    """The fallback computes the same layer: float32 paths differ only in summation order; the
    int8 paths compute the same integers and round alike, so they agree bit for bit."""
    x = torch.randn(4, 576, generator=torch.Generator().manual_seed(3))
    weight = random_stored(WeightFormat.F32, 96, 576, seed=3)
    results = [native.weight_linear(x, weight.data, int(WeightFormat.F32), 96, None, PATHS[p])
               for p in AVAILABLE]
    for result in results[1:]:
        torch.testing.assert_close(result, results[0], rtol=0,
                                   atol=2e-5 * results[0].abs().max().item())
    for fmt in GGUF_TYPES:
        weight = random_stored(fmt, 99, 576, seed=3)
        results = [native.weight_linear(x, weight.data, int(fmt), 99, None, PATHS[p], INT8)
                   for p in AVAILABLE]
        for result in results[1:]:
            assert torch.equal(result, results[0])


@pytest.mark.parametrize("fmt,quant_byte", [(WeightFormat.Q4_0, 0xFF), (WeightFormat.Q4_1, 0xFF),
                                             (WeightFormat.Q8_0, 0x80), (WeightFormat.Q8_0, 0x7F)])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_int8_paths_do_not_overflow_at_the_largest_products(fmt, quant_byte, sign):
    """Every quant at its largest magnitude (4-bit 15; Q8_0 -128 or 127) times activations
    that all round to +-127: the AVX2 path sums a 4-bit block's byte products in int16 (at
    most 8 x 3,810), which must neither wrap nor saturate, so every path agrees bit for bit
    and within the rounding bound."""
    weight = random_stored(fmt, 16, 256, seed=5, quant_byte=quant_byte)
    x = torch.full((5, 256), sign)
    reference = reference_weight(weight)
    results = [native.weight_linear(x, weight.data, int(fmt), 16, None, PATHS[p], INT8)
               for p in AVAILABLE]
    assert ((results[0] - x @ reference.T).abs() <= int8_error_bound(x, reference)).all()
    for result in results[1:]:
        assert torch.equal(result, results[0])


@pytest.mark.skipif(native is None or "avx512" not in AVAILABLE, reason="no AVX-512 here")
@pytest.mark.parametrize("fmt", list(GGUF_TYPES))
@pytest.mark.parametrize("rows,out_features", [(1, 16), (1, 99), (5, 258), (8, 99), (9, 24),
                                               (11, 258), (12, 16), (13, 99), (15, 258),
                                               (16, 16), (33, 99), (48, 258)])
def test_int8_pairs_of_groups_agree_bit_for_bit_with_the_avx2_path(fmt, rows, out_features):
    """The avx512 path takes groups in pairs: where AMX-INT8 runs, from int8_tile_min_rows
    rows, on tiles, 16 rows at a time (all of them in one shorter tile under 16; the rows past
    the last 16 take the register path); else, with AVX512-VNNI, through 512-bit dot
    products, 8 rows a pass, in steps of int8_pair_min_rows rows or more (5 on AMD CPUs; a
    9-row step's last row is then a one-row pass of pairs, and a lone row goes one group at a
    time). An odd last group goes alone. The same integers, scaled in the same order, so every
    row equals the AVX2 path's and the row alone. (Without VNNI the avx512 path is the
    register path, equal all the same.)"""
    if native.has_int8_tiles():
        assert native.int8_tile_min_rows <= 12  # else the tile cases here test nothing new
    assert native.int8_pair_min_rows() <= 5  # else the 5-row cases test nothing new
    weight = random_stored(fmt, out_features, 576, seed=rows)
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 576, generator=g)
    bias = torch.randn(out_features, generator=g)
    wide = native.weight_linear(x, weight.data, int(fmt), out_features, bias, PATHS["avx512"],
                                INT8)
    avx2 = native.weight_linear(x, weight.data, int(fmt), out_features, bias, PATHS["avx2"],
                                INT8)
    assert torch.equal(wide, avx2)
    for i in (0, min(15, rows - 1), rows - 1):
        alone = native.weight_linear(x[i:i + 1], weight.data, int(fmt), out_features, bias,
                                     PATHS["avx512"], INT8)
        assert torch.equal(alone[0], wide[i])


def test_bad_shapes_and_formats_raise_clearly():
    weight = random_stored(WeightFormat.Q8_0, 4, 64, seed=0)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        native.weight_linear(torch.ones(1, 48), weight.data, 0, 4, None, 0, INT8)
    with pytest.raises(RuntimeError, match="weight must be"):
        native.weight_linear(torch.ones(1, 64), weight.data, 2, 4, None, 0, INT8)  # Q4_1 size
    with pytest.raises(RuntimeError, match="unknown weight format"):
        native.weight_linear(torch.ones(1, 64), weight.data, 9, 4, None, 0, INT8)
    with pytest.raises(RuntimeError, match="int8 activations only"):
        native.weight_linear(torch.ones(1, 64), weight.data, 0, 4, None, 0, FLOAT32)
    with pytest.raises(ValueError, match="needs uint8"):
        StoredWeight(weight.data[:, :-1], WeightFormat.Q8_0, 64, 4)
    with pytest.raises(ValueError, match="rows of 64 inputs need"):
        StoredWeight.from_rows(weight.rows()[:, :-1], WeightFormat.Q8_0, 64)


def test_row_bytes_agree_with_the_kernel_and_gguf():
    for fmt in WeightFormat:
        assert row_bytes(fmt, 576) == native.row_bytes(int(fmt), 576)
    for fmt, ggml_type in GGUF_TYPES.items():
        block, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
        assert row_bytes(fmt, 576) == 576 // block * type_size


def test_int8_per_channel_rounds_each_weight_to_its_nearest_step():
    w = torch.randn(6, 64, generator=torch.Generator().manual_seed(1))
    stored = quantize_int8_per_channel(w)
    step = w.abs().amax(dim=1, keepdim=True) / 127
    assert (reference_weight(stored) - w).abs().le(step / 2 + 1e-7).all()
    assert np.array_equal(stored.dequantize().numpy(), reference_weight(stored).numpy())


def int8_error_bound(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``[rows, out]`` bound on |int8-activation result - float result|: each input is off by at
    most half its block's step sx = max|x| / 127, so a dot product by sum |w| sx / 2 (plus float
    summation slack)."""
    rows, in_features = x.shape
    step = x.abs().reshape(rows, in_features // BLOCK, BLOCK).amax(dim=2) / 127
    per_input = step.repeat_interleave(BLOCK, dim=1) / 2  # [rows, in]
    return per_input @ weight.abs().T * 1.001 + 1e-4


@pytest.mark.parametrize("path", AVAILABLE)
@pytest.mark.parametrize("fmt", list(GGUF_TYPES))
@pytest.mark.parametrize("rows,out_features,in_features", [(1, 1, 32), (3, 7, 96), (4, 258, 576),
                                                           (5, 33, 1056), (31, 16, 64)])
def test_int8_activations_stay_within_the_rounding_bound(path, fmt, rows, out_features,
                                                         in_features):
    """llama.cpp's way: x rounded to int8 per block, integer dot products, held to the bound
    that rounding implies; with a bias, in bf16, and for each row alone exactly as in the
    batch (odd rows: the 4-row register tile's remainders; odd features: a padded group)."""
    weight = random_stored(fmt, out_features, in_features, seed=rows + out_features)
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, in_features, generator=g)
    bias = torch.randn(out_features, generator=g)
    reference = reference_weight(weight)
    expected = x @ reference.T + bias
    y = native.weight_linear(x, weight.data, int(fmt), out_features, bias, PATHS[path], INT8)
    assert ((y - expected).abs() <= int8_error_bound(x, reference)).all()
    one_at_a_time = [native.weight_linear(x[i:i + 1], weight.data, int(fmt), out_features, bias,
                                          PATHS[path], INT8) for i in range(rows)]
    assert torch.equal(torch.cat(one_at_a_time), y)
    y16 = native.weight_linear(x.bfloat16(), weight.data, int(fmt), out_features, None,
                               PATHS[path], INT8)
    expected16 = x.bfloat16().float() @ reference.T
    bound16 = int8_error_bound(x.bfloat16().float(), reference) + expected16.abs() * 2 ** -8
    assert y16.dtype == torch.bfloat16
    assert ((y16.float() - expected16).abs() <= bound16).all()


def test_int8_activations_are_refused_for_other_formats():
    weight = random_stored(WeightFormat.BF16, 4, 32, seed=0)
    with pytest.raises(RuntimeError, match="int8 activations need"):
        native.weight_linear(torch.ones(1, 32), weight.data, int(WeightFormat.BF16), 4, None,
                             0, INT8)


@pytest.mark.skipif(native is None or not native.has_bf16_pairs(),
                    reason="no AVX512-BF16 on this CPU or in this build")
@pytest.mark.parametrize("fmt", ROW_FORMATS)
@pytest.mark.parametrize("rows,out_features,in_features", [(1, 1, 32), (5, 7, 544),
                                                           (17, 33, 1056)])
def test_bf16_pair_products_match_the_bf16_rounded_weights(fmt, rows, out_features,
                                                           in_features):
    """bf16 x times the weights rounded to bf16: every product exact in float32, so only the
    summation order and the output's rounding differ from the float32 reference. Per-channel
    int8 rows multiply their integers (exact in bf16) and scale the sum, so nothing rounds."""
    weight = random_stored(fmt, out_features, in_features, seed=rows)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows)).bfloat16()
    multiplied = reference_weight(weight)
    if fmt != WeightFormat.INT8_CHANNEL:
        multiplied = multiplied.bfloat16().float()
    expected = x.float() @ multiplied.T
    y = native.weight_linear(x, weight.data, int(fmt), out_features, None, 0, BF16_PAIRS)
    scale = expected.abs().max().item()
    torch.testing.assert_close(y.float(), expected, rtol=2 ** -7, atol=2e-5 * scale)


def test_bf16_pair_products_need_bf16_activations():
    weight = random_stored(WeightFormat.BF16, 4, 32, seed=0)
    with pytest.raises(RuntimeError, match="bf16 pair products need"):
        native.weight_linear(torch.ones(1, 32), weight.data, int(WeightFormat.BF16), 4, None, 0,
                             BF16_PAIRS)
