"""The LoRA adapters requests may select, as the ingress knows them, and their loading and
unloading on every worker replica at run time (``POST /v1/load_lora_adapter``,
``/v1/unload_lora_adapter``).

A load is broadcast to every replica (``DeploymentHandle.broadcast``); the name becomes
selectable only once every replica has read the adapter and they agree on its content digest.
If any replica refuses, the name is unloaded again wherever it was read, so nothing that was
loaded before changes. An unload removes the name here first (new requests get 404 at once),
then on the replicas; requests already running under it finish there. A replica that does not
hold an adapter a request names (a replacement, or one that evicted it) reads it again from
the source the request carries (``workers.lora.registry.AdapterRegistry.ensure``).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from ray.exceptions import RayTaskError

from contract.identity import AdapterRef
from router.errors import APIError, OverloadedError, invalid_request, overloaded, typed_error
from workers.lora.errors import AdapterError

log = logging.getLogger(__name__)

LOAD_TIMEOUT_S = 120.0
"""Seconds a load may take on the slowest replica before it counts as failed."""


class AdapterCatalog:
    """Name → :class:`AdapterRef` of every adapter requests may select.

    Args:
        workers: a ``DeploymentHandle`` to the worker deployment (anything with the same
            ``broadcast(method, *args).results(timeout_s=..., return_exceptions=True)``).
        adapters: those the workers loaded at start (``--lora-modules``); :meth:`recover`
            adds those loaded at run time.
    """

    def __init__(self, workers: Any, adapters: dict[str, AdapterRef]):
        self._workers = workers
        self.adapters = dict(adapters)
        self._lock = asyncio.Lock()  # one load or unload at a time

    async def recover(self) -> None:
        """Add the adapters the worker replicas hold beyond those given: loaded at run time
        before this ingress started (a restarted ingress). A name is added when every replica
        that knows it agrees on its content; one known with different content (a load or
        unload interrupted midway) is left out, with a warning. A replica that does not answer
        is skipped."""
        known: dict[str, set[AdapterRef]] = {}
        for answer in await self._broadcast("lora_adapters"):
            if isinstance(answer, dict):
                for name, ref in answer.items():
                    known.setdefault(name, set()).add(ref)
        async with self._lock:
            for name, refs in known.items():
                if name in self.adapters:
                    continue
                if len(refs) > 1:
                    log.warning("LoRA adapter %s left out: the replicas hold different "
                                "content under that name; unload and load it again", name)
                    continue
                self.adapters[name] = refs.pop()
                log.info("LoRA adapter %s recovered from the worker replicas", name)

    async def load(self, name: str, path: str) -> AdapterRef:
        """Load ``path`` as ``name`` on every replica.

        Raises:
            APIError: 400 for a name already loaded or an adapter a replica refused (the path
                is not allowed, the adapter is malformed or does not fit, replicas read
                different content); 503 when a replica has no free slot; 500 otherwise.
        """
        async with self._lock:
            if name in self.adapters:
                raise invalid_request(f"The lora adapter '{name}' has already been loaded",
                                      "lora_name")
            answers = await self._broadcast("load_lora_adapter", name, path)
            refs = {answer for answer in answers if isinstance(answer, AdapterRef)}
            failures = [answer for answer in answers if not isinstance(answer, AdapterRef)]
            if failures or len(refs) != 1:
                await self._broadcast("unload_lora_adapter", name)
                raise _load_error(failures, refs)
            (ref,) = refs
            self.adapters[name] = ref
        log.info("LoRA adapter %s (digest %s) loaded from %s on %d replica(s)", name,
                 ref.weights_digest[:12], path, len(answers))
        return ref

    async def unload(self, name: str) -> None:
        """Stop serving ``name``.

        Raises:
            APIError: 404 ``model_not_found`` for a name not loaded.
        """
        async with self._lock:
            if self.adapters.pop(name, None) is None:
                raise APIError(404, f"The lora adapter '{name}' is not loaded",
                               param="lora_name", code="model_not_found")
            await self._broadcast("unload_lora_adapter", name)
        log.info("LoRA adapter %s unloaded", name)

    async def _broadcast(self, method: str, *args: Any) -> list[Any]:
        """Every replica's answer, or the error it raised (unwrapped from Ray's)."""
        def call() -> list[Any]:
            return self._workers.broadcast(method, *args).results(
                timeout_s=LOAD_TIMEOUT_S, return_exceptions=True)
        return [_cause(answer) for answer in await asyncio.to_thread(call)]


def _cause(answer: Any) -> Any:
    if not isinstance(answer, BaseException):
        return answer
    cause = typed_error(answer)
    while isinstance(cause, RayTaskError) and isinstance(cause.cause, Exception):
        cause = cause.cause
    return cause


def _load_error(failures: list[Any], refs: set[AdapterRef]) -> APIError:
    for failure in failures:
        if isinstance(failure, AdapterError):
            return invalid_request(str(failure), "lora_path")
    for failure in failures:
        if isinstance(failure, OverloadedError):
            return overloaded(failure)
    if not failures:
        return invalid_request("the worker replicas read different content at lora_path "
                               "(is it the same directory on every node?)", "lora_path")
    log.error("LoRA adapter load failed: %r", failures[0])
    return APIError(500, "loading the adapter failed on a worker replica",
                    code="internal_error")
