"""The LoRA delta kernel (``workers/kernels/lora_sgmv.cpp``) against a float64 reference:
every dtype pair of activations and weights, odd shapes (remainders of the column blocks and
vectors), row blocks of 1 to 9 rows, rows of one adapter scattered among others', an adapter
with rank 0 (it skips the projection), and the torch fallback of ``LoraBatch`` agreeing with
it. Skipped where the kernel cannot be built (no C++ compiler); CI's machine has one."""

from __future__ import annotations

import pytest
import torch

from workers import kernels
from workers.lora.adapter import LoraAdapter, LoraDelta
from workers.lora.batch import LoraBatch

pytestmark = pytest.mark.skipif(kernels.lora_sgmv() is None, reason="no C++ compiler here")

# float32 sums of up to 576 x 48 products of N(0, 1) values, which cancel: relative to
# |value| + 1 they stay under this (2.4e-5 seen at SmolLM2's q/k/v shape)
FLOAT32_TOLERANCE = 1e-4
# bf16 output: one rounding of out + delta, half a bf16 ulp (2**-8) relative
BF16_TOLERANCE = 2.0 ** -8


def reference(out, x, rows, offsets, a, bt) -> torch.Tensor:
    expected = out.double().clone()
    for g in range(len(a)):
        group = rows[offsets[g]:offsets[g + 1]]
        expected[group] += (x[group].double() @ a[g].double().t()) @ bt[g].double()
    return expected


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double() - expected).abs() / (expected.abs() + 1)).max().item()


@pytest.mark.parametrize("activations", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weights", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("width_in", "width_out", "ranks", "rows_per_adapter"), [
    (576, 960, (48, 16, 8), (4, 1, 9)),    # SmolLM2's fused q/k/v: whole blocks
    (64, 100, (3, 0, 5), (2, 3, 5)),       # remainders of vectors and column blocks; rank 0
    (37, 19, (1, 2, 7), (1, 7, 2)),        # shorter than one vector
])
def test_kernel_matches_float64(activations, weights, width_in, width_out, ranks,
                                rows_per_adapter):
    generator = torch.Generator().manual_seed(width_in + width_out)
    total = sum(rows_per_adapter) + 3  # three base rows get nothing
    x = torch.randn(total, width_in, generator=generator).to(activations)
    out = torch.randn(total, width_out, generator=generator).to(activations)
    a = [torch.randn(r, width_in, generator=generator).to(weights) for r in ranks]
    bt = [torch.randn(r, width_out, generator=generator).to(weights) for r in ranks]
    order = torch.randperm(total, generator=generator)  # each adapter's rows scattered
    rows, offsets = [], [0]
    for count in rows_per_adapter:
        rows.extend(order[len(rows):len(rows) + count].tolist())
        offsets.append(len(rows))
    rows = torch.tensor(rows)
    expected = reference(out, x, rows, offsets, a, bt)
    untouched = sorted(set(range(total)) - set(rows.tolist()))
    before = out.clone()
    kernels.lora_sgmv().lora_delta(out, x, rows, offsets, a, bt)
    tolerance = FLOAT32_TOLERANCE if activations == torch.float32 else BF16_TOLERANCE
    assert relative_error(out, expected) < tolerance
    assert torch.equal(out[untouched], before[untouched])


def test_bad_arguments_raise():
    lora = kernels.lora_sgmv()
    x, out = torch.randn(4, 8), torch.randn(4, 6)
    a, bt = [torch.randn(2, 8)], [torch.randn(2, 6)]
    with pytest.raises(RuntimeError, match="row index out of range"):
        lora.lora_delta(out, x, torch.tensor([4]), [0, 1], a, bt)
    with pytest.raises(RuntimeError, match="must fit"):
        lora.lora_delta(out, x, torch.tensor([0]), [0, 1], [torch.randn(2, 7)], bt)
    with pytest.raises(RuntimeError, match="one dtype"):
        lora.lora_delta(out, x, torch.tensor([0]), [0, 1], a, [bt[0].bfloat16()])
    with pytest.raises(RuntimeError, match="out and x must both be float32 or both"):
        lora.lora_delta(out.bfloat16(), x, torch.tensor([0]), [0, 1], a, bt)


def test_torch_fallback_agrees_with_the_kernel(monkeypatch):
    generator = torch.Generator().manual_seed(3)

    def adapter(name: str, rank: int) -> LoraAdapter:
        delta = LoraDelta(torch.randn(rank, 64, generator=generator),
                          torch.randn(rank, 96, generator=generator))
        return LoraAdapter(name, None, rank, name * 32, {(0, "o"): delta}, 0)

    first, second = adapter("a", 4), adapter("b", 8)
    batch = LoraBatch.of([(first, 0, 3), (None, 3, 5), (second, 5, 6), (first, 6, 8)],
                         torch.device("cpu"))
    assert batch.offsets == [0, 5, 6] and batch.rows.tolist() == [0, 1, 2, 6, 7, 5]
    x = torch.randn(8, 64, generator=generator)
    native = torch.zeros(8, 96)
    batch.add(native, x, 0, "o")
    monkeypatch.setattr(kernels, "lora_sgmv", lambda: None)
    fallback = torch.zeros(8, 96)
    batch.add(fallback, x, 0, "o")
    torch.testing.assert_close(native, fallback, rtol=1e-5, atol=1e-5)
    assert native[3:5].abs().sum() == 0  # the base rows
    batch.add(fallback, x, 1, "o")  # a layer neither adapter touches: nothing changes
    torch.testing.assert_close(native, fallback, rtol=1e-5, atol=1e-5)
