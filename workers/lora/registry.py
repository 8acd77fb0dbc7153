"""The adapters one engine holds, least recently used first, and how a request's adapter gets
there.

Two tiers, as vLLM's ``--max-loras`` and ``--max-cpu-loras``: at most ``max_loras`` adapters
are resident (on the model's device, where steps use them), and up to ``max_cpu_loras`` in all
counting those in host memory. A request names its adapter by name, content digest and source
directory (:class:`~contract.identity.AdapterRef`): one resident under that name with that
digest serves it at once; one in the host tier is moved back (a copy on a GPU, nothing on a
CPU, whose working memory is host memory); one held nowhere (evicted, or never loaded on this
replica: a replacement, or a load that reached other replicas only) is read from its source,
and served only when the digest read equals the one the request was hashed for.

Making room moves the least recently used resident adapter that no sequence is using, or
about to use, to the host tier, whose own least recently used adapter is dropped when it is
full. When every resident adapter is in use, :class:`AdapterSlotsFull`. "About to use": an
adapter :meth:`AdapterRegistry.ensure` made resident for a request stays reserved until the
engine admits or refuses that request (:meth:`AdapterRegistry.release`), so a concurrent read
for another request cannot evict it in between.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from pathlib import Path

import torch

from contract.identity import AdapterRef
from contract.request import InvalidRequestError
from workers.lora.adapter import BaseShapes, LoraAdapter, load_adapter
from workers.lora.errors import AdapterError
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
        max_loras: most adapters resident at once (``--max-loras``).
        max_cpu_loras: most adapters held in both tiers (``--max-cpu-loras``; None or less
            than ``max_loras``: ``max_loras``, no host tier).
        lora_dirs: the directories adapters loaded at run time may be read from.
        in_use: the names of the adapters some sequence is using now (never evicted).
        refusal: why this engine cannot apply adapters (its model runs on transformers'
            modules), or None: every load is refused with it.

    Attributes:
        loads, load_s: adapter reads from disk since start, and the seconds they took.
        swaps, swap_s: moves from the host tier back to resident, and their seconds.
        evictions: resident adapters evicted (to the host tier, or dropped without one).
        host_evictions: adapters dropped from the host tier.
    """

    def __init__(self, shapes: BaseShapes, dtype: torch.dtype, device: torch.device,
                 max_rank: int, max_loras: int, lora_dirs: list[str] | None = None,
                 in_use: Callable[[], set[str]] = set, refusal: str | None = None,
                 max_cpu_loras: int | None = None):
        self.shapes = shapes
        self.weight_dtype = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
        self.device = device
        self.max_rank = max_rank
        self.max_loras = max_loras
        self.max_cpu_loras = max(max_cpu_loras or max_loras, max_loras)
        self.lora_dirs = list(lora_dirs or [])
        self._in_use = in_use
        self._refusal = refusal
        self._adapters: OrderedDict[str, LoraAdapter] = OrderedDict()  # resident
        self._host: OrderedDict[str, LoraAdapter] = OrderedDict()
        self._known: dict[str, AdapterRef] = {}
        self._reserved: Counter[str] = Counter()
        self._reads: dict[str, threading.Lock] = {}  # one read per adapter name at a time
        self._lock = threading.Lock()  # loads run off the engine thread
        self.loads = self.swaps = self.evictions = self.host_evictions = 0
        self.load_s = self.swap_s = 0.0

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
            self._host.pop(name, None)
            return self._known.pop(name)

    def ensure(self, ref: AdapterRef | None) -> str:
        """Make the adapter ``ref`` names resident and reserve it for one request until
        :meth:`release`: moved back from the host tier, or read from ``ref.source`` (blocking:
        call it off the engine thread). A source the operator gave (a known adapter's, evicted
        since) is read as given; any other must lie under ``lora_dirs``. Concurrent requests
        for one adapter read it once: the others wait for that read.

        Returns:
            how: ``resident`` (or no adapter: nothing to do), ``host`` (moved back) or
            ``read`` (from disk, or waited for another request's read).

        Raises:
            InvalidRequestError: ``model_not_found``: the source cannot be read, is not
                allowed, or holds other content than ``ref``'s digest (it changed on disk).
            AdapterSlotsFull: no resident slot can be freed.
        """
        if ref is None or not ref.source:
            return "resident"
        with self._lock:
            held = self._adapters.get(ref.adapter_id)
            if held is not None and held.digest == ref.weights_digest:
                self._reserve_held(ref)
                return "resident"
            reading = self._reads.setdefault(ref.adapter_id, threading.Lock())
        with reading:
            return self._ensure_read(ref)

    def _ensure_read(self, ref: AdapterRef) -> str:
        """:meth:`ensure` for an adapter not resident, one request per name at a time."""
        with self._lock:
            hosted = ref.adapter_id in self._host
            if self._reserve_held(ref):
                return "host" if hosted else "read"
            if not self._free():
                raise AdapterSlotsFull(self._full_message())  # before a read it could not use
            trusted = self._known.get(ref.adapter_id) == ref
        try:
            adapter = self._read(ref.adapter_id, ref.source, runtime=not trusted)
        except AdapterError as exc:
            raise InvalidRequestError(f"The adapter '{ref.adapter_id}' cannot be loaded: "
                                      f"{exc}", "model", "model_not_found") from exc
        if adapter.digest != ref.weights_digest:
            raise InvalidRequestError(
                f"The adapter '{ref.adapter_id}' at {ref.source} changed since it was loaded; "
                "unload it (POST /v1/unload_lora_adapter) and load it again", "model",
                "model_not_found")
        with self._lock:
            self._hold(adapter)
            self._known.setdefault(ref.adapter_id, adapter.ref)
            self._reserved[ref.adapter_id] += 1
        return "read"

    def release(self, ref: AdapterRef | None) -> None:
        """End the reservation :meth:`ensure` made for one request: the engine has admitted it
        (its sequences now keep the adapter in use) or refused it."""
        if ref is None:
            return
        with self._lock:
            if self._reserved[ref.adapter_id] > 0:
                self._reserved[ref.adapter_id] -= 1
            if self._reserved[ref.adapter_id] == 0:
                del self._reserved[ref.adapter_id]

    def _reserve_held(self, ref: AdapterRef) -> bool:
        """Reserve ``ref``'s adapter if it is resident, or in the host tier (moved back);
        False when it must be read (lock held)."""
        name = ref.adapter_id
        held = self._adapters.get(name)
        if held is None or held.digest != ref.weights_digest:
            hosted = self._host.get(name)
            if hosted is None or hosted.digest != ref.weights_digest:
                return False
            self._host.pop(name)
            try:
                self._make_room()
            except AdapterSlotsFull:
                self._host[name] = hosted
                raise
            started = time.perf_counter()
            self._adapters[name] = hosted.to(self.device)
            self.swaps += 1
            self.swap_s += time.perf_counter() - started
        self._adapters.move_to_end(name)
        self._reserved[name] += 1
        return True

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

    def free_slots(self) -> int:
        """Resident slots another adapter could take now: empty, or holding an adapter no
        sequence uses and none is reserved for."""
        with self._lock:
            return self._free()

    def hosted(self) -> list[str]:
        """Names of the adapters in the host tier now, least recently used first."""
        with self._lock:
            return list(self._host)

    def held_digests(self, tier: str = "resident") -> list[str]:
        """Content digests of the adapters held now in ``tier``: ``resident`` or ``host``."""
        with self._lock:
            adapters = self._adapters if tier == "resident" else self._host
            return [adapter.digest for adapter in adapters.values()]

    def mean_read_s(self) -> float:
        """Mean seconds an adapter read from disk took here (0 before the first)."""
        with self._lock:
            return self.load_s / self.loads if self.loads else 0.0

    def mean_swap_s(self) -> float:
        """Mean seconds moving an adapter back from the host tier took here (0 before the
        first)."""
        with self._lock:
            return self.swap_s / self.swaps if self.swaps else 0.0

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
        """Hold ``adapter`` resident, most recently used, replacing one of its name in either
        tier (lock held)."""
        self._host.pop(adapter.name, None)
        if adapter.name not in self._adapters:
            self._make_room()
        self._adapters[adapter.name] = adapter
        self._adapters.move_to_end(adapter.name)

    def _make_room(self) -> None:
        """Free a resident slot, and a place in the two tiers, for one more (lock held)."""
        while len(self._adapters) >= self.max_loras:
            idle = self._idle()
            if not idle:
                raise AdapterSlotsFull(self._full_message())
            self._demote(self._adapters.pop(idle[0]))
        while self._host and len(self._adapters) + len(self._host) >= self.max_cpu_loras:
            dropped, _ = self._host.popitem(last=False)
            self.host_evictions += 1
            log.info("LoRA adapter %s dropped from the host tier", dropped)

    def _free(self) -> int:
        return self.max_loras - len(self._adapters) + len(self._idle())

    def _idle(self) -> list[str]:
        """Resident adapters no sequence uses and none is reserved for, least recently used
        first (lock held)."""
        busy = self._in_use() | set(self._reserved)
        return [name for name in self._adapters if name not in busy]

    def _full_message(self) -> str:
        return f"all {self.max_loras} adapter slots (--max-loras) are in use by running requests"

    def _demote(self, adapter: LoraAdapter) -> None:
        """Move an evicted resident adapter to the host tier, or drop it without one."""
        self.evictions += 1
        if self.max_cpu_loras > self.max_loras:
            self._host[adapter.name] = adapter.to(torch.device("cpu"))
            log.info("LoRA adapter %s moved to the host tier", adapter.name)
        else:
            log.info("LoRA adapter %s evicted (least recently used)", adapter.name)
