"""Weights kept in the format they are stored in, and multiplied without a full-size copy.

A GGUF file's Q8_0, Q4_0 and Q4_1 tensors (llama.cpp's block formats: 32 weights share an fp16
scale, and for Q4_1 an fp16 minimum) are held as their bytes, reordered once at load into
groups of 8 output features for the int8 kernel (``workers/kernels/int8_dot.h``), and
multiplied by ``workers.kernels.weight_linear`` without ever being widened to a full-size
copy. ``--quantization int8`` gives a safetensors model a stored path too: per-channel
weight-only int8 (one float32 scale per output feature, symmetric, round to nearest), as in
LLM.int8()'s weight half and most weight-only serving paths; its rows are dequantized a few
columns at a time into registers and a small buffer.

The format is part of the numerics a worker computes with, so it enters the cache identity
(``ModelRunner.kernels``): a quantized worker never shares KV blocks with a full-precision one.
"""

from __future__ import annotations

import enum
import functools
import logging
from dataclasses import dataclass

import torch

from workers import kernels

log = logging.getLogger(__name__)

BLOCK = 32
"""Weights per quantization block (GGUF's ``QK``); in_features must be a multiple of it."""


class WeightFormat(enum.IntEnum):
    """Stored weight formats, numbered as the native kernel numbers them."""

    Q8_0 = 0
    Q4_0 = 1
    Q4_1 = 2
    INT8_CHANNEL = 3
    BF16 = 4
    F32 = 5


GGUF_FORMATS = {"Q8_0": WeightFormat.Q8_0, "Q4_0": WeightFormat.Q4_0,
                "Q4_1": WeightFormat.Q4_1}
"""The GGUF tensor types served as stored; other types are dequantized at load."""

_BYTES_PER_BLOCK = {WeightFormat.Q8_0: 34, WeightFormat.Q4_0: 18, WeightFormat.Q4_1: 20,
                    WeightFormat.INT8_CHANNEL: BLOCK, WeightFormat.BF16: 2 * BLOCK,
                    WeightFormat.F32: 4 * BLOCK}


def row_bytes(fmt: WeightFormat, in_features: int) -> int:
    """Bytes one output feature's row of ``in_features`` weights takes in ``fmt`` (the
    per-channel int8 row starts with its float32 scale)."""
    header = 4 if fmt == WeightFormat.INT8_CHANNEL else 0
    return header + in_features // BLOCK * _BYTES_PER_BLOCK[fmt]


@functools.cache
def native():
    """The compiled kernel module; says once in the log which SIMD path it runs, and when that
    is a fallback (no AVX-512 on this CPU or in this build: AVX2, else scalar).

    Raises:
        RuntimeError: it could not be built here (no compiler) or is disabled; stored weights
            have no other path.
    """
    module = kernels.weight_linear()
    if module is None:
        raise RuntimeError("quantized weights need the native weight_linear kernel, which is "
                           "disabled or could not be built here (see the log); serve with "
                           "--quantization none")
    path = module.paths()[0]
    if path == "avx512":
        pairs = (f", two groups at a time in steps of {module.int8_pair_min_rows()}+ rows"
                 if module.int8_pair_min_rows() else "")
        tiles = (f", and AMX-INT8 tiles from {module.int8_tile_min_rows} rows a step"
                 if module.has_int8_tiles() else "")
        log.info("stored weights: the avx512 kernels serve (int8 dot products with VNNI "
                 "where the CPU has it%s%s)", pairs, tiles)
    else:
        log.warning("stored weights: no AVX-512 on this CPU or in this build; the %s kernels "
                    "serve instead", path)
    return module


GROUP = 8
"""Output features per packed group of a GGUF-format weight (``workers/kernels/int8_dot.h``)."""


def stored_shape(fmt: WeightFormat, out_features: int, in_features: int) -> tuple[int, int]:
    """The uint8 shape a weight is held in: a GGUF format's packed groups ``[ceil(out / 8),
    group bytes]`` (the file's bytes, reordered for the int8 kernel), else one row per output
    feature ``[out, row_bytes]``."""
    if fmt in GGUF_FORMATS.values():
        groups = -(-out_features // GROUP)
        return groups, in_features // BLOCK * GROUP * _BYTES_PER_BLOCK[fmt]
    return out_features, row_bytes(fmt, in_features)


@dataclass(frozen=True)
class StoredWeight:
    """A linear layer's weight as stored.

    Attributes:
        data: uint8, contiguous, of :func:`stored_shape`: a GGUF format's blocks packed in
            groups of :data:`GROUP` output features, the other formats' rows as they are.
        fmt: its format.
        in_features: weights per output feature (a multiple of :data:`BLOCK`).
        out_features: output features.
    """

    data: torch.Tensor
    fmt: WeightFormat
    in_features: int
    out_features: int

    def __post_init__(self):
        expected = stored_shape(self.fmt, self.out_features, self.in_features)
        if (self.data.dtype != torch.uint8 or tuple(self.data.shape) != expected
                or self.in_features % BLOCK):
            raise ValueError(f"{self.fmt.name} weight {self.out_features}x{self.in_features} "
                             f"needs uint8 {expected}, got {self.data.dtype} "
                             f"{tuple(self.data.shape)}")

    @classmethod
    def from_rows(cls, rows: torch.Tensor, fmt: WeightFormat, in_features: int) -> StoredWeight:
        """The weight whose rows are ``rows`` ``[out_features, row_bytes]`` uint8 (a GGUF
        tensor's bytes), packed where the format is a GGUF one.

        Raises:
            ValueError: rows that do not fit the format and size.
        """
        if tuple(rows.shape[1:]) != (row_bytes(fmt, in_features),) or rows.dtype != torch.uint8:
            raise ValueError(f"{fmt.name} rows of {in_features} inputs need uint8 "
                             f"[N, {row_bytes(fmt, in_features)}], got {rows.dtype} "
                             f"{tuple(rows.shape)}")
        data = rows.contiguous()
        if fmt in GGUF_FORMATS.values():
            data = native().pack(data, int(fmt), in_features)
        return cls(data, fmt, in_features, rows.shape[0])

    def rows(self) -> torch.Tensor:
        """``[out_features, row_bytes]`` uint8: the weight's rows as a GGUF file holds them."""
        if self.fmt in GGUF_FORMATS.values():
            return native().unpack(self.data, int(self.fmt), self.out_features, self.in_features)
        return self.data

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def rehome(self, data: torch.Tensor) -> None:
        """Points this weight at ``data``, a copy of its bytes elsewhere (on huge pages:
        ``workers.huge_pages``), so that every holder of it reads the copy and the old bytes
        are freed. The one change a stored weight takes after it is made.

        Raises:
            ValueError: ``data`` is not of the weight's shape and dtype.
        """
        if data.shape != self.data.shape or data.dtype != self.data.dtype:
            raise ValueError(f"a weight of {tuple(self.data.shape)} {self.data.dtype} cannot "
                             f"move to {tuple(data.shape)} {data.dtype}")
        object.__setattr__(self, "data", data)

    def dequantize(self, rows: torch.Tensor | None = None,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``[out_features, in_features]`` in ``dtype``, or only the output features ``rows``
        ``[T]`` (an embedding lookup) as ``[T, in_features]``. bfloat16 comes straight from the
        kernel, rounded as ``.to(torch.bfloat16)`` rounds the float32 weights (a prefill on a
        bf16 worker then makes no float32 copy of the layer); other dtypes are converted from
        float32."""
        native_dtype = dtype if dtype in (torch.float32, torch.bfloat16) else torch.float32
        weights = native().dequantize(self.data, int(self.fmt), self.out_features,
                                      self.in_features, rows, 0, native_dtype)
        return weights.to(dtype)

    @classmethod
    def concat(cls, parts: list[StoredWeight]) -> StoredWeight:
        """One weight whose rows are ``parts``' rows in order (fused projections).

        Raises:
            ValueError: parts of different formats or input sizes.
        """
        if len({(p.fmt, p.in_features) for p in parts}) != 1:
            raise ValueError("only weights of one format and input size can be fused")
        return cls.from_rows(torch.cat([p.rows() for p in parts]), parts[0].fmt,
                             parts[0].in_features)


def quantize_int8_per_channel(weight: torch.Tensor) -> StoredWeight:
    """Symmetric per-channel int8: each output feature's row is scaled so that its largest
    magnitude maps to 127, rounded to nearest.

    Args:
        weight: ``[out_features, in_features]`` of any float dtype, in_features a multiple of
            :data:`BLOCK`.

    Raises:
        ValueError: in_features not a multiple of :data:`BLOCK`.
    """
    out_features, in_features = weight.shape
    if in_features % BLOCK:
        raise ValueError(f"int8 weights need in_features a multiple of {BLOCK}, got "
                         f"{in_features}")
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / 127).clamp_min(torch.finfo(torch.float32).tiny)
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    data = torch.cat([scale[:, None].contiguous().view(torch.uint8), q.view(torch.uint8)], dim=1)
    return StoredWeight(data.contiguous(), WeightFormat.INT8_CHANNEL, in_features, out_features)
