"""Linear layers whose weights are also laid out once for the CPU's small-batch kernels.

On a CPU, ``F.linear`` in bf16 goes through oneDNN, which re-lays the weight out for its
AVX512-BF16/AMX kernels on every call. At decode batch sizes that repacking costs about as much
as the product itself: prepacking once (what torch's Inductor does when it freezes weights)
measured 1.3-2.3x faster per matmul on SmolLM2's shapes at 1-16 rows (two runs), bit-identical.

In fp32, ``F.linear`` goes to MKL, whose small-row GEMMs are slow on an AVX2-only AMD EPYC
(2 threads, SmolLM2's gate/up shape: 1.46 ms at 5 rows against 0.43 ms at 1 row; oneDNN on a
prepacked weight: 0.47 ms at 5 rows, ``benchmarks/kernel_choices.py --dtype float32``). With
MKL, a SmolLM2 step verifying 4 draft tokens took 178 ms against 81 ms for a plain decode;
with prepacked weights, 98 ms. Rounding differs from MKL's (≈1e-6 relative), so the choice is
part of the cache identity's numerics (:func:`linear_kernel`).

From :data:`PREPACKED_MAX_ROWS` rows on, prefills keep the plain kernel.

A decode of a few rows reads every weight once and little else. There oneDNN read bf16 weights
at 8-10 GB/s where the memory gives 15 (an AMX Xeon), and fp32 weights at 12 GB/s where it
gives 17 (an AVX2-only EPYC), gaining nothing from a second thread: below
:data:`PACKED_MAX_ROWS` rows the weights go through our own kernel on a third copy packed for
it (``workers/kernels/packed_linear.cpp``), where the CPU runs it (AVX2 with FMA, or AVX-512)
and the model's weights are small enough for a third copy (:func:`packs_small_batches`). On a
CPU where oneDNN has no bf16 kernels (AVX2 only) it takes bf16 matmuls of every row count.

oneDNN, and ideep above it, cache a primitive per operation shape (1,024 each by default, at
up to about half a MiB apiece). Prompt and context lengths bring new shapes for as long as a
worker runs: under mixed prompt lengths its RSS grew by about 90 MiB a minute, and under
fixed lengths it stayed flat. With both caches bounded to :data:`PRIMITIVE_CACHE_CAPACITY` it
stayed flat at the same steps per second (``benchmarks/memory_growth.py``).
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from workers import kernels
from workers.models.weight_formats import GGUF_FORMATS, StoredWeight, WeightFormat, native

PREPACKED_MAX_ROWS = 256
"""Matmuls with fewer rows than this use the prepacked weight (measured crossover)."""

PACKED_MAX_ROWS = 5
"""bf16 matmuls, and fp32 ones on AVX-512, with fewer rows than this use
:func:`workers.kernels.packed_linear`. One SmolLM2 layer's four fused projections, one thread,
against oneDNN prepacked (``benchmarks/kernel_choices.py``, ``packed_small_ms``). bf16 on an
Intel Xeon with AMX: 0.18 against 0.29-0.31 ms at 1 row, 0.19 against 0.28 at 2, 0.27 against
0.28 at 4, 0.50 against 0.29 at 8 and 1.0 against 0.31 at 16, where oneDNN's AMX tiles take
over. fp32 on an AMD EPYC (Zen 4, AVX-512): 0.16 against 0.29 ms at 1 row, 0.18 against 0.28
at 2, 0.34 against 0.38 at 4, 0.66 against 0.69 at 8 and 1.22 against 1.15 at 16."""

PACKED_MAX_ROWS_AVX2 = 32
"""fp32 matmuls with fewer rows than this use the packed kernel where it runs 8-wide (AVX2):
there oneDNN has no AVX-512 kernels to pull ahead with. The same four projections on an AMD
EPYC (Zen 3, AVX2 only), one thread: 0.24 against 0.54 ms at 1 row, 0.49 against 0.82 at 4,
0.94 against 1.18 at 8, 1.71 against 2.28 at 16; two threads: 0.27 against 0.43 ms at 4, 0.40
against 0.54 at 8, 0.80 against 0.93 at 16, 1.69 against 1.71 at 32 and 3.12 against 3.13 at 64
(``benchmarks/results/epyc-avx2-fp32/packed-f32-62b52c9/``)."""

PACKED_MAX_ROWS_BF16_PAIRS = 128
"""bf16 matmuls with fewer rows than this use the packed kernel where it multiplies by
AVX512-BF16's pair products (a CPU without AMX). On a Zen 4 EPYC, two threads, SmolLM2's
gate/up projection with its weights warm in cache, oneDNN prepacked against the kernel (two
rounds): 0.048/0.022 and 0.051/0.024 ms at 1 row, 0.066/0.042 and 0.074/0.045 at 5,
0.157/0.129 and 0.158/0.131 at 16, 0.534/0.504 and 0.542/0.550 at 64, 1.063/1.045 and
1.103/1.063 at 128 (the down projection 0.528/0.558 and 0.521/0.553 there). A decode step
reads the weights from memory, where streaming each once gains more: its linear layers at 16
sequences took 17.2 and 16.5 ms against 20.5 and 21.7 with oneDNN
(``benchmarks/results/epyc-avx512bf16/bf16-pairs-85daadf/``). Every row below it is computed
the same way, so a verification block and a plain decode agree bit for bit."""

PACKED_MAX_BYTES = 4 << 30
"""Models with more linear-layer weight bytes than this get no packed copy: the copy holds the
weights a third time (beside the plain and the oneDNN-prepacked ones), which a model of up to
about 2 B parameters in bf16 can afford and a larger one should spend on KV blocks."""

FLOAT32_PRODUCTS, INT8_PRODUCTS, BF16_PAIR_PRODUCTS = 0, 1, 2
"""The native kernel's ``products``: float32 x times float32 weights; int8 x (per 32-input
block) times the stored integers of a GGUF format, packed in groups of 8 output features
(``workers/kernels/int8_dot.h``); bf16 x times the weights rounded to bf16 (AVX512-BF16's pair
products, what the dense bf16 model computes)."""

STREAMED_MAX_ROWS = 48
"""Stored weights: matmuls with fewer rows than this stream the stored weight through the
native kernel; from here on (a prefill) the layer's weight is dequantized into a temporary and
the plain kernel runs (oneDNN, on AMX tiles where the CPU has them).

Below it a GGUF format multiplies with int8 activations, as llama.cpp does. Each row is
computed the same way whatever the step's row count, so a decode and a verification of draft
tokens agree bit for bit. Where the dense kernel overtakes streaming depends on AMX:

- On an Intel Xeon with AMX (``benchmarks/results/xeon-amx/stored-rows-efd69b3/``, SmolLM2's
  four Q4_1 projections of a layer, bf16): streaming 1.20x (1 thread) and 1.16x (2 threads)
  faster at 40 rows, dense 1.05x and 1.04x faster at 48, 2x at 128, 3.7x at 512.
- On an AMD EPYC with AVX512-VNNI and no AMX, 2 threads, for the gate/up projection alone:
  streaming 305 against 551 µs at 32 rows, and no slower at any count up to 512 (1,128 against
  1,365 µs at 128 rows, 4,468 against 4,765 at 512, then 1,740 against 1,701 and 4,886 against
  5,083 in a second run; a 1,024-token prefill 1,209 and 1,191 tokens/s against 1,319 and
  1,201), so there the threshold cost nothing either way past 48. Since groups go in pairs
  there, streaming wins at every count, and :func:`streamed_max_rows` lifts the threshold.

The other formats stream with bf16 pair products where the CPU has AVX512-BF16 (878 against
1,362 µs in float32 for the same layer at 16 rows), else in float32.
"""

DEQUANTIZED_MAX_WEIGHTS = 8 << 20
"""Larger layers (the LM head) always stream: dequantizing SmolLM2's 49,152 x 576 head
took 89 ms a call at 32 rows against 22 ms streaming (its float copy spills every cache)."""

PRIMITIVE_CACHE_CAPACITY = 64
"""Primitives kept per cache: a decode step uses under a dozen matmul shapes."""

PRIMITIVE_CACHES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")
"""oneDNN's primitive cache, and ideep's (torch's oneDNN wrapper), sized from these variables
when the first primitive is made."""


def bound_primitive_caches() -> None:
    """Size oneDNN's and ideep's per-shape caches to :data:`PRIMITIVE_CACHE_CAPACITY` unless
    the environment already sets them. Effective only before this process's first oneDNN
    primitive (the caches read the variables then), so the engine calls it first thing."""
    for name in PRIMITIVE_CACHES:
        os.environ.setdefault(name, str(PRIMITIVE_CACHE_CAPACITY))


def _prepacking_pays(dtype: torch.dtype, device: torch.device) -> bool:
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()


@functools.cache
def _bf16_without_onednn() -> bool:
    """Whether oneDNN has no bf16 kernels for this CPU (AVX2 only), so that a bf16
    ``F.linear`` is torch's own, slow fallback: asked per call of a prompt's layers, so
    answered once."""
    return not _prepacking_pays(torch.bfloat16, torch.device("cpu"))


def _packed_kernel(dtype: torch.dtype, device: torch.device):
    """The packed kernel where it serves weights of ``dtype`` on ``device``, else None."""
    if dtype not in (torch.bfloat16, torch.float32) or device.type != "cpu":
        return None
    kernel = kernels.packed_linear()
    if kernel is None:
        return None
    runs = kernel.runs_bf16() if dtype == torch.bfloat16 else kernel.runs_f32()
    return kernel if runs else None


def packed_max_rows(dtype: torch.dtype) -> int | None:
    """Rows below which :class:`Linear` takes the packed kernel for weights of ``dtype``:
    :data:`PACKED_MAX_ROWS_AVX2` for fp32 on the kernel's 8-wide path,
    :data:`PACKED_MAX_ROWS_BF16_PAIRS` for bf16 where it multiplies by pair products, None
    (every row count) for bf16 where oneDNN has no bf16 kernels on this CPU, else
    :data:`PACKED_MAX_ROWS`.

    Without oneDNN's bf16 kernels (an AVX2-only CPU) a bf16 ``F.linear`` is torch's own
    fallback, which took 2.5-9x as long as the packed kernel on each of SmolLM2's projections
    at every row count from 1 to 256, on one and two threads, weights warm in cache; at 256
    rows the kernel made 28 G multiply-adds a second on one core for gate/up (an AMD EPYC Zen
    3; ``benchmarks/results/epyc-avx2-fp32/bf16-avx2-f752240/``)."""
    kernel = kernels.packed_linear()
    if kernel is not None and dtype == torch.float32 and kernel.f32_features == 8:
        return PACKED_MAX_ROWS_AVX2
    if dtype == torch.bfloat16 and _bf16_without_onednn():
        return None
    if dtype == torch.bfloat16 and _bf16_pair_products():
        return PACKED_MAX_ROWS_BF16_PAIRS
    return PACKED_MAX_ROWS


def _bf16_pair_products() -> bool:
    """Whether the packed kernel multiplies bf16 weights by pair products on this CPU."""
    kernel = kernels.packed_linear()
    return kernel is not None and kernel.bf16_pairs


def packs_small_batches(model: torch.nn.Module) -> bool:
    """Whether ``model``'s dense linear layers get a copy packed for the packed kernel: bf16
    or fp32 weights on a CPU it runs on, in bf16 each with an even ``in_features`` (inputs go
    in pairs), at most :data:`PACKED_MAX_BYTES` of them."""
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    if not linears:
        return False
    dtype = linears[0].weight.dtype
    if _packed_kernel(dtype, linears[0].weight.device) is None:
        return False
    if dtype == torch.bfloat16 and any(m.in_features % 2 for m in linears):
        return False
    return sum(m.weight.numel() * m.weight.element_size() for m in linears) <= PACKED_MAX_BYTES


def linear_kernel(dtype: torch.dtype, device: torch.device, small_batches: bool) -> str:
    """The kernels :class:`Linear` uses below :data:`PREPACKED_MAX_ROWS` rows for weights of
    ``dtype`` on ``device``: ``onednn-prepacked`` or ``aten`` (``F.linear``), after
    ``packed-bf16<R+``, ``packed-bf16-pairs<R+`` (pair products, which round otherwise) or
    ``packed-fp32<R+`` where ``small_batches`` (:func:`packs_small_batches`), R being
    :func:`packed_max_rows`, or the packed tag alone where it takes every row count. The
    vector width (8 or 16 features) does not change any sum's order, only the row
    threshold."""
    name = "onednn-prepacked" if _prepacking_pays(dtype, device) else "aten"
    if not small_batches:
        return name
    packed = "packed-fp32"
    if dtype == torch.bfloat16:
        packed = "packed-bf16-pairs" if _bf16_pair_products() else "packed-bf16"
    rows = packed_max_rows(dtype)
    return packed if rows is None else f"{packed}<{rows}+{name}"


class Linear:
    """``y = x W^T + b``.

    Args:
        weight: ``[out_features, in_features]``.
        bias: ``[out_features]`` or None.

        small_batches: also hold a copy packed for :func:`workers.kernels.packed_linear`, which
            takes matmuls of fewer than :func:`packed_max_rows` rows, or all of them (bf16 or
            fp32 weights on a CPU it runs on; ignored elsewhere). Callers decide it per model
            (:func:`packs_small_batches`).

    Raises:
        RuntimeError: ``small_batches`` for a bf16 weight with an odd ``in_features``.

    Where prepacking pays, also holds a prepacked copy of ``weight`` (as many bytes again).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 small_batches: bool = False):
        self.weight = weight
        self.bias = bias
        self.packed = None
        if _prepacking_pays(weight.dtype, weight.device):
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
        self.small_kernel = _packed_kernel(weight.dtype, weight.device) if small_batches else None
        self.small_packed = (self.small_kernel.pack(weight.detach())
                             if self.small_kernel is not None else None)
        self.small_max_rows = packed_max_rows(weight.dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``[rows, in_features]`` → ``[rows, out_features]``."""
        rows = x.shape[0]
        if self.small_packed is not None and (self.small_max_rows is None
                                              or rows < self.small_max_rows):
            return self.small_kernel.linear(x, self.small_packed, self.weight.shape[0], self.bias)
        if self.packed is not None and rows < PREPACKED_MAX_ROWS:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    @classmethod
    def of(cls, module: torch.nn.Linear, small_batches: bool = False) -> Linear | StoredLinear:
        """The fast form of a transformers ``nn.Linear``: a :class:`StoredLinear` where the
        loader attached a stored weight (``stored_weight``) to it."""
        stored = getattr(module, "stored_weight", None)
        if stored is not None:
            return StoredLinear(stored, module.bias)
        return cls(module.weight, module.bias, small_batches)


def streamed_max_rows(fmt: WeightFormat) -> int | None:
    """The row count from which :class:`StoredLinear` dequantizes a layer of ``fmt`` for the
    plain kernel: :data:`STREAMED_MAX_ROWS`, or None (streamed at every row count) for a GGUF
    format where the int8 kernel takes groups in pairs through AVX512-VNNI and has no AMX-INT8
    tiles, as on AMD EPYCs.

    There streaming beat dequantize-then-oneDNN at every count measured. On a Zen 4 EPYC, the
    four Q4_1 projections of a SmolLM2 layer (``benchmarks/kernel_choices.py --only
    stored_q4_1``, weights in cache, the dense side's dequantization included), streamed
    against dense: at one thread 0.91 against 2.07 ms at 32 rows, 3.71 against 5.78 at 128,
    7.24 against 9.94 at 256 and 29.8 against 37.6 at 1,024; at two threads 2.24 against
    3.52 ms at 128 and 19.1 against 23.2 at 1,024. A 1,024-token prefill then ran at 818 and
    785 against 679 and 702 tokens/s on one thread (both in ``benchmarks/results/
    epyc-avx512bf16/int8-prompts-9fb3d5c/``; docs/performance.md, "Zen 4, prompts through the
    int8 kernel"). Where AMX-BF16 runs oneDNN, dense wins from 48 rows; on AVX2
    alone (no VNNI) it was not measured."""
    kernel = native()
    pairs_without_tiles = kernel.int8_pair_min_rows() > 0 and not kernel.has_int8_tiles()
    if fmt in GGUF_FORMATS.values() and pairs_without_tiles:
        return None
    return STREAMED_MAX_ROWS


def dense_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype :class:`StoredLinear`'s dense path (from :func:`streamed_max_rows` rows)
    multiplies activations of ``dtype`` in: float32 for bf16 where oneDNN has no bf16 kernels,
    else ``dtype``. The product is rounded to ``dtype`` once. On an AVX2-only EPYC torch's own
    bf16 matmul made a 1,024-token prefill over the embedded Q4_1 GGUF run at 37 and 38
    tokens/s, against 226 and 213 in float32 (one thread, ``benchmarks/results/epyc-avx2-fp32/
    stored-bf16-prompts-0331e43/``)."""
    if dtype == torch.bfloat16 and _bf16_without_onednn():
        return torch.float32
    return dtype


def stored_kernel(fmt_names: set[str], dtype: torch.dtype) -> str:
    """The kernel tag of :class:`StoredLinear` over weights of the formats ``fmt_names`` for
    activations of ``dtype``: the formats, the GGUF layout, the SIMD path the native kernel
    runs on this CPU, the row threshold of each format and the dense path's dtype where it
    differs from ``dtype`` (together they decide every rounding)."""
    pairs = "/bf16-pairs" if native().has_bf16_pairs() else ""
    dense_from = ",".join(f"{name}:{streamed_max_rows(WeightFormat[name]) or 'never'}"
                          for name in sorted(fmt_names))
    dense = dense_dtype(dtype)
    dense_in = f"-in-{str(dense).removeprefix('torch.')}" if dense != dtype else ""
    return (f"weight-stream:{'+'.join(sorted(fmt_names))}/gguf-packed8-int8"
            f"/{native().paths()[0]}{pairs}/dense{dense_in}>={dense_from}")


class StoredLinear:
    """``y = x W^T + b`` over a weight kept as stored (``workers.models.weight_formats``).

    Args:
        weight: the stored ``[out_features, in_features]`` weight.
        bias: ``[out_features]`` or None.

    Below :func:`streamed_max_rows` rows the native kernel reads each stored weight once for
    all rows: a GGUF format's packed groups with int8 activations (llama.cpp's way), the
    others with bf16 pair products (bf16 activations on a CPU with AVX512-BF16) or in float32.
    From there on (unless the layer is larger than :data:`DEQUANTIZED_MAX_WEIGHTS`) the
    layer's weight is dequantized into a temporary in :func:`dense_dtype` for the plain
    kernel.
    """

    def __init__(self, weight: StoredWeight, bias: torch.Tensor | None = None):
        self.weight = weight
        self.bias = bias
        self._kernel = native()
        self._format, self._out_features = int(weight.fmt), weight.out_features  # per call
        self._int8 = weight.fmt in GGUF_FORMATS.values()
        self._bf16_pairs = self._kernel.has_bf16_pairs()
        dense_from = streamed_max_rows(weight.fmt)
        small = weight.out_features * weight.in_features <= DEQUANTIZED_MAX_WEIGHTS
        self._dense_from = dense_from if dense_from is not None and small else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``[rows, in_features]`` float32 or bfloat16 → ``[rows, out_features]``."""
        if self._dense_from is None or x.shape[0] < self._dense_from:
            return self._kernel.weight_linear(x, self.weight.data, self._format,
                                              self._out_features, self.bias, 0,
                                              self._products(x))
        dtype = dense_dtype(x.dtype)
        bias = self.bias.to(dtype) if self.bias is not None else None
        return F.linear(x.to(dtype), self.weight.dequantize(dtype=dtype), bias).to(x.dtype)

    def _products(self, x: torch.Tensor) -> int:
        if self._int8:
            return INT8_PRODUCTS
        if self._bf16_pairs and x.dtype == torch.bfloat16:
            return BF16_PAIR_PRODUCTS
        return FLOAT32_PRODUCTS
