"""What the HTTP layer needs from the cluster: the :class:`ServingBackend` protocol."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from typing import Any, Protocol

from contract.identity import AdapterRef, CacheIdentity
from contract.request import GenerationChunk, GenerationRequest
from router.api.auth import AdminKey

WORKER_HEADER = "x-nalar-worker"
"""Response header naming the worker replica that served the request."""


class ServingBackend(Protocol):
    """The cluster as the HTTP layer sees it; the Ray Serve ingress implements it over a
    ``DeploymentHandle``, tests with a fake.

    Attributes:
        served_model_name: the only ``model`` requests may name.
        max_model_len: context length in tokens (prompt plus output).
        identity: the worker deployment's cache identity (anonymous namespace); the app hashes
            each prompt under it once (:func:`contract.identity.prompt_digests`).
        namespace_secret: the key of :func:`~contract.identity.tenant_from_api_key`.
        tokenizer: the workers' transformers tokenizer, chat template included.
        adapters: the LoRA adapters the workers hold, by the ``model`` name that selects
            each (``contract.identity.AdapterRef``: name and content digest).
        admin_key: the key of the adapter routes (``router.api.auth.AdminKey``).
    """

    served_model_name: str
    max_model_len: int
    identity: CacheIdentity
    namespace_secret: bytes
    tokenizer: Any
    adapters: Mapping[str, AdapterRef]
    admin_key: AdminKey

    def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        """Streams the request's chunks (an async generator).

        The first chunk may carry no tokens, only ``worker_id``, ``prompt_tokens`` and
        ``cached_tokens``; the last has ``finish_reason`` set. Closing the generator early
        (``aclose()``) must cancel the request on its worker. May raise
        :class:`~contract.request.InvalidRequestError` (→ 400) or
        :class:`~router.errors.OverloadedError` (→ 503/429 with ``Retry-After``); anything else
        is a 500.
        """
        ...

    async def load_adapter(self, name: str, path: str) -> AdapterRef:
        """Load the adapter at ``path`` as ``name`` on every worker; once it returns, requests
        may select ``name``. Nothing changes when it raises.

        Raises:
            APIError: 400 naming the reason (path not allowed, malformed adapter, name taken),
                503 when a worker has no free adapter slot.
        """
        ...

    async def unload_adapter(self, name: str) -> None:
        """Stop serving ``name`` (requests running under it finish).

        Raises:
            APIError: 404 ``model_not_found`` for a name not loaded.
        """
        ...

    async def is_ready(self) -> bool:
        """Whether the cluster can serve requests now (drives ``GET /health``)."""
        ...
