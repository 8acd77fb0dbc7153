"""One step's rows grouped by adapter, and the low-rank deltas they add to the base matmuls.

The base projection runs once over every row of the step; then each adapter present adds
``((x_rows @ A.T) @ B.T) * scale`` to its own rows only (the segmented gather-matmul-scatter
of Punica's SGMV and S-LoRA, here one pair of matmuls per adapter and projection). Base rows
take no extra work. Each delta is computed as PEFT computes it (``lora_B(lora_A(x)) *
scaling``, in the activation dtype), so a row's result does not depend on which other adapters
share its step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from workers.lora.adapter import LoraAdapter


@dataclass(frozen=True)
class LoraBatch:
    """The adapters of one step's rows.

    Attributes:
        segments: per adapter present, the rows it applies to: a ``slice`` when they are
            consecutive (indexing is then a view and the delta is added in place), else a
            ``[n]`` int64 index tensor.
    """

    segments: list[tuple[LoraAdapter, slice | torch.Tensor]]

    @classmethod
    def of(cls, spans: list[tuple[LoraAdapter | None, int, int]],
           device: torch.device) -> LoraBatch | None:
        """The batch of a step whose rows ``[start, end)`` belong to ``adapter`` (None: the
        base model), span by span; None when no row has an adapter."""
        by_adapter: dict[str, tuple[LoraAdapter, list[tuple[int, int]]]] = {}
        for adapter, start, end in spans:
            if adapter is not None and end > start:
                by_adapter.setdefault(adapter.digest, (adapter, []))[1].append((start, end))
        if not by_adapter:
            return None
        return cls([(adapter, _rows(ranges, device)) for adapter, ranges in by_adapter.values()])

    def add(self, out: torch.Tensor, x: torch.Tensor, layer: int, projection: str) -> None:
        """Add each adapter's delta of ``projection`` in ``layer`` to its rows of ``out``.

        Args:
            out: ``[T, out_features]`` the base projection's output, updated in place.
            x: ``[T, in_features]`` its input.
            layer: the decoder layer.
            projection: a key of ``workers.lora.adapter.FUSED_PROJECTIONS``.
        """
        for adapter, rows in self.segments:
            delta = adapter.deltas.get((layer, projection))
            if delta is None:
                continue
            update = F.linear(F.linear(x[rows], delta.a), delta.b) * delta.scale
            if isinstance(rows, slice):
                out[rows] += update
            else:
                out.index_add_(0, rows, update)


def _rows(ranges: list[tuple[int, int]], device: torch.device) -> slice | torch.Tensor:
    merged = [list(ranges[0])]
    for start, end in ranges[1:]:
        if start == merged[-1][1]:
            merged[-1][1] = end
        else:
            merged.append([start, end])
    if len(merged) == 1:
        return slice(*merged[0])
    return torch.cat([torch.arange(start, end, device=device) for start, end in merged])
