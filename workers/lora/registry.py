"""The adapters one engine holds, by name, and the check that a request's adapter is one."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from contract.identity import AdapterRef
from contract.request import InvalidRequestError
from workers.lora.adapter import AdapterError, BaseShapes, LoraAdapter, load_adapter

log = logging.getLogger(__name__)


class AdapterRegistry:
    """Adapters loaded on one base model, by name.

    Args:
        shapes: the base model's (:meth:`BaseShapes.of`).
        dtype: the model's activation dtype; adapters are held in it.
        device: the model's device.
        max_rank: ``--max-lora-rank``.
        max_loras: most adapters held at once (``--max-loras``).
    """

    def __init__(self, shapes: BaseShapes, dtype: torch.dtype, device: torch.device,
                 max_rank: int, max_loras: int):
        self.shapes = shapes
        self.dtype = dtype
        self.device = device
        self.max_rank = max_rank
        self.max_loras = max_loras
        self._adapters: dict[str, LoraAdapter] = {}

    def load(self, name: str, path: str | Path) -> LoraAdapter:
        """Read the adapter at ``path`` and serve it as ``name``.

        Raises:
            AdapterError: the adapter is malformed or does not fit (``load_adapter``), the name
                is taken, or ``max_loras`` adapters are already held.
        """
        if name in self._adapters:
            raise AdapterError(f"an adapter named {name!r} is already loaded")
        if len(self._adapters) >= self.max_loras:
            raise AdapterError(f"{self.max_loras} adapters are loaded (--max-loras)")
        started = time.perf_counter()
        adapter = load_adapter(name, path, self.shapes, self.dtype, self.max_rank, self.device)
        self._adapters[name] = adapter
        log.info("LoRA adapter %s (rank %d, %.1f MiB, digest %s) loaded from %s in %.2f s",
                 name, adapter.rank, adapter.nbytes / 2**20, adapter.digest[:12], path,
                 time.perf_counter() - started)
        return adapter

    def resolve(self, ref: AdapterRef | None) -> LoraAdapter | None:
        """The loaded adapter a request names (None for the base model).

        Raises:
            InvalidRequestError: code ``model_not_found`` when no adapter of that name is
                loaded, or the one loaded under it has other content than the request was
                hashed for (the name was reloaded with other weights in between).
        """
        if ref is None:
            return None
        adapter = self._adapters.get(ref.adapter_id)
        if adapter is None:
            raise InvalidRequestError(f"The model '{ref.adapter_id}' does not exist",
                                      "model", "model_not_found")
        if adapter.digest != ref.weights_digest:
            raise InvalidRequestError(
                f"The adapter '{ref.adapter_id}' was reloaded with other weights; retry",
                "model", "model_not_found")
        return adapter

    def refs(self) -> dict[str, AdapterRef]:
        """Name → :class:`AdapterRef` of every adapter held."""
        return {name: adapter.ref for name, adapter in self._adapters.items()}

