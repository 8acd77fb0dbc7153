"""One step's rows grouped by adapter, and the low-rank deltas they add to the base matmuls.

The base projection runs once over every row of the step; then each adapter present adds
``(x_rows @ A.T) @ (B * scaling).T`` to its own rows only: the segmented gather-matmul-scatter
of Punica's SGMV and S-LoRA, in float32. With the native kernel (``workers.kernels.lora_sgmv``)
that is one call per projection for every adapter of the step; without it, torch ops per
adapter. Base rows take no extra work. A row's delta depends only on its own input and
adapter, so its result does not depend on which other adapters share its step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers import kernels
from workers.lora.adapter import LoraAdapter, LoraDelta


@dataclass(frozen=True)
class LoraBatch:
    """The adapters of one step's rows.

    Attributes:
        adapters: the adapters present, in the order of ``offsets``.
        rows: ``[n]`` int64 the rows that have an adapter, grouped by adapter: adapter ``g``'s
            are ``rows[offsets[g]:offsets[g + 1]]``.
        offsets: ``len(adapters) + 1`` group boundaries in ``rows``.
    """

    adapters: list[LoraAdapter]
    rows: torch.Tensor
    offsets: list[int]

    @classmethod
    def of(cls, spans: list[tuple[LoraAdapter | None, int, int]],
           device: torch.device) -> LoraBatch | None:
        """The batch of a step whose rows ``[start, end)`` belong to ``adapter`` (None: the
        base model), span by span; None when no row has an adapter."""
        by_adapter: dict[str, tuple[LoraAdapter, list[int]]] = {}
        for adapter, start, end in spans:
            if adapter is not None:
                by_adapter.setdefault(adapter.digest, (adapter, []))[1].extend(range(start, end))
        if not by_adapter:
            return None
        adapters, offsets, rows = [], [0], []
        for adapter, adapter_rows in by_adapter.values():
            adapters.append(adapter)
            rows.extend(adapter_rows)
            offsets.append(len(rows))
        return cls(adapters, torch.tensor(rows, dtype=torch.long, device=device), offsets)

    def add(self, out: torch.Tensor, x: torch.Tensor, layer: int, projection: str) -> None:
        """Add each adapter's delta of ``projection`` in ``layer`` to its rows of ``out``.

        Args:
            out: ``[T, out_features]`` the base projection's output, updated in place.
            x: ``[T, in_features]`` its input.
            layer: the decoder layer.
            projection: a key of ``workers.lora.adapter.FUSED_PROJECTIONS``.
        """
        deltas = [adapter.deltas.get((layer, projection)) for adapter in self.adapters]
        if all(delta is None for delta in deltas):
            return
        native = kernels.lora_sgmv()
        if native is not None and out.device.type == "cpu":
            if any(delta is None for delta in deltas):  # rank 0: the kernel skips that group
                weights = self.adapters[0].dtype
                empty = (x.new_empty((0, x.shape[1]), dtype=weights),
                         x.new_empty((0, out.shape[1]), dtype=weights))
                deltas = [delta or LoraDelta(*empty) for delta in deltas]
            native.lora_delta(out, x.contiguous(), self.rows, self.offsets,
                              [delta.a for delta in deltas], [delta.bt for delta in deltas])
            return
        for g, delta in enumerate(deltas):
            if delta is not None:
                rows = self.rows[self.offsets[g]:self.offsets[g + 1]]
                update = (x[rows].float() @ delta.a.float().t()) @ delta.bt.float()
                out.index_add_(0, rows, update.to(out.dtype))
