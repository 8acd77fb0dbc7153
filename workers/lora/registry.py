"""The adapters one engine holds, least recently used first, and how a request's adapter gets
there.

At most ``max_loras`` adapters are held. A request names its adapter by name, content digest
and source directory (:class:`~contract.identity.AdapterRef`): one held under that name with
that digest serves it at once; one not held (evicted, or never loaded on this replica: a
replacement, or a load that reached other replicas only) is read from its source first, and
served only when the digest read equals the one the request was hashed for. Making room evicts
the least recently used adapter that no sequence is using; when every held adapter is in use,
the load fails with :class:`AdapterSlotsFull`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import torch

from contract.identity import AdapterRef
from contract.request import InvalidRequestError
from workers.lora.adapter import AdapterError, BaseShapes, LoraAdapter, load_adapter
from workers.lora.paths import checked_adapter_dir

log = logging.getLogger(__name__)


class AdapterSlotsFull(RuntimeError):
    """Every adapter slot holds an adapter some sequence is using: retry later (a 503)."""


class AdapterRegistry:
    """Adapters loaded on one base model, by name, least recently used first.

    Args:
        shapes: the base model's (:meth:`BaseShapes.of`).
        dtype: the model's activation dtype: adapters are held in bf16 under bf16, else in
            float32 (``workers.lora.adapter``).
        device: the model's device.
        max_rank: ``--max-lora-rank``.
        max_loras: most adapters held at once (``--max-loras``).
        lora_dirs: the directories adapters loaded at run time may be read from.
        in_use: the names of the adapters some sequence is using now (never evicted).
        refusal: why this engine cannot apply adapters (its model runs on transformers'
            modules), or None: every load is refused with it.

    Attributes:
        loads, evictions: adapters read and evicted since start.
        load_s: seconds spent reading adapters since start.
    """

    def __init__(self, shapes: BaseShapes, dtype: torch.dtype, device: torch.device,
                 max_rank: int,
                 max_loras: int, lora_dirs: list[str] | None = None,
                 in_use: Callable[[], set[str]] = set, refusal: str | None = None):
        self.shapes = shapes
        self.weight_dtype = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
        self.device = device
        self.max_rank = max_rank
        self.max_loras = max_loras
        self.lora_dirs = list(lora_dirs or [])
        self._in_use = in_use
        self._refusal = refusal
        self._adapters: OrderedDict[str, LoraAdapter] = OrderedDict()
        self._known: dict[str, AdapterRef] = {}
        self._lock = threading.Lock()  # loads run off the engine thread
        self.loads = self.evictions = 0
        self.load_s = 0.0

    def load(self, name: str, path: str | Path, runtime: bool = False) -> LoraAdapter:
        """Read the adapter at ``path`` and hold it as ``name``.

        Args:
            runtime: asked for through the API: ``path`` must lie under ``lora_dirs``
                (:func:`~workers.lora.paths.checked_adapter_dir`); the operator's start-time
                ``--lora-modules`` may be anywhere.

        Raises:
            AdapterError: this engine cannot apply adapters, the path is not allowed, the
                adapter is malformed or does not fit (``load_adapter``), or another adapter is
                known under ``name``.
            AdapterSlotsFull: no slot can be freed.
        """
        adapter = self._read(name, path, runtime)
        with self._lock:
            known = self._known.get(name)
            if known is not None and known.weights_digest != adapter.digest:
                raise AdapterError(f"an adapter named {name!r} is already loaded; unload it "
                                   "first")
            self._hold(adapter)
            self._known[name] = adapter.ref
        return adapter

    def unload(self, name: str) -> AdapterRef:
        """Forget ``name``: sequences already running under it finish; requests that name it
        afterwards are refused.

        Raises:
            KeyError: no adapter of that name is known.
        """
        with self._lock:
            self._adapters.pop(name, None)
            return self._known.pop(name)

    def ensure(self, ref: AdapterRef | None) -> None:
        """Hold the adapter ``ref`` names, reading it from ``ref.source`` when it is not held
        (blocking: call it off the engine thread). A source the operator gave (a known
        adapter's, evicted since) is read as given; any other must lie under ``lora_dirs``.

        Raises:
            InvalidRequestError: ``model_not_found``: the source cannot be read, is not
                allowed, or holds other content than ``ref``'s digest (it changed on disk).
            AdapterSlotsFull: it must be read and no slot can be freed.
        """
        if ref is None or not ref.source:
            return
        with self._lock:
            held = self._adapters.get(ref.adapter_id)
            if held is not None and held.digest == ref.weights_digest:
                return
            trusted = self._known.get(ref.adapter_id) == ref
        try:
            adapter = self._read(ref.adapter_id, ref.source, runtime=not trusted)
        except AdapterError as exc:
            raise InvalidRequestError(f"The adapter '{ref.adapter_id}' cannot be loaded: "
                                      f"{exc}", "model", "model_not_found") from exc
        if adapter.digest != ref.weights_digest:
            raise InvalidRequestError(
                f"The adapter '{ref.adapter_id}' at {ref.source} changed since it was loaded; "
                "load it again", "model", "model_not_found")
        with self._lock:
            self._hold(adapter)
            self._known.setdefault(ref.adapter_id, adapter.ref)

    def resolve(self, ref: AdapterRef | None) -> LoraAdapter | None:
        """The held adapter a request names (None for the base model), now the most recently
        used.

        Raises:
            InvalidRequestError: code ``model_not_found`` when no adapter of that name is
                held, or the one held under it has other content than the request was hashed
                for (the name was reloaded with other weights in between).
        """
        if ref is None:
            return None
        with self._lock:
            adapter = self._adapters.get(ref.adapter_id)
            if adapter is not None:
                self._adapters.move_to_end(ref.adapter_id)
        if adapter is None:
            raise InvalidRequestError(f"The model '{ref.adapter_id}' does not exist",
                                      "model", "model_not_found")
        if adapter.digest != ref.weights_digest:
            raise InvalidRequestError(
                f"The adapter '{ref.adapter_id}' was reloaded with other weights; retry",
                "model", "model_not_found")
        return adapter

    def held(self) -> list[str]:
        """Names of the adapters held now, least recently used first."""
        with self._lock:
            return list(self._adapters)

    def held_digests(self) -> list[str]:
        """Content digests of the adapters held now."""
        with self._lock:
            return [adapter.digest for adapter in self._adapters.values()]

    def mean_read_s(self) -> float:
        """Mean seconds an adapter read took here (0 before the first)."""
        with self._lock:
            return self.load_s / self.loads if self.loads else 0.0

    def refs(self) -> dict[str, AdapterRef]:
        """Name → :class:`AdapterRef` of every adapter known: held, or evicted and read again
        from its source when a request needs it."""
        with self._lock:
            return dict(self._known)

    def _read(self, name: str, path: str | Path, runtime: bool) -> LoraAdapter:
        if self._refusal is not None:
            raise AdapterError(self._refusal)
        directory = checked_adapter_dir(str(path), self.lora_dirs) if runtime else Path(path)
        started = time.perf_counter()
        adapter = load_adapter(name, directory, self.shapes, self.max_rank, self.weight_dtype,
                               self.device)
        seconds = time.perf_counter() - started
        with self._lock:
            self.loads += 1
            self.load_s += seconds
        log.info("LoRA adapter %s (rank %d, %.1f MiB, digest %s) read from %s in %.2f s",
                 name, adapter.rank, adapter.nbytes / 2**20, adapter.digest[:12], directory,
                 seconds)
        return adapter

    def _hold(self, adapter: LoraAdapter) -> None:
        """Hold ``adapter``, most recently used, replacing one of its name (lock held)."""
        if adapter.name not in self._adapters:
            self._make_room()
        self._adapters[adapter.name] = adapter
        self._adapters.move_to_end(adapter.name)

    def _make_room(self) -> None:
        """Evict least recently used idle adapters until one more fits (lock held)."""
        busy = self._in_use()
        while len(self._adapters) >= self.max_loras:
            idle = next((name for name in self._adapters if name not in busy), None)
            if idle is None:
                raise AdapterSlotsFull(f"all {self.max_loras} adapter slots (--max-loras) are "
                                       "in use by running requests")
            evicted = self._adapters.pop(idle)
            self.evictions += 1
            log.info("LoRA adapter %s evicted (least recently used)", evicted.name)
