"""The ingress: the OpenAI HTTP API as a Serve deployment, talking to the workers through a
handle whose requests the prefix-aware router places."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
from collections.abc import AsyncIterator
from pathlib import Path

from ray import serve
from ray.exceptions import NodeDiedError, RayActorError, RayTaskError, WorkerCrashedError
from ray.serve import context as serve_context
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
from ray.serve.handle import DeploymentHandle

from cluster.adapters import AdapterCatalog
from cluster.config import INDEX_ACTOR_NAMESPACE, ClusterConfig
from cluster.dashboard import Dashboard, dashboard_router
from cluster.metrics import SCRAPE_TIMEOUT_S, build_registry, fetch_worker_stats
from cluster.replica_logs import route_to_serve_logger
from cluster.worker_identity import WorkerIdentity
from contract.identity import AdapterRef, CacheIdentity
from contract.request import GenerationChunk, GenerationRequest, InvalidRequestError
from router.api.admission import RETRY_AFTER_S, Admission
from router.api.app import build_openai_app
from router.api.auth import AdminKey, ApiKeys
from router.errors import APIError, OverloadedError, retry_after_headers, typed_error
from router.index import make_index
from router.routing.finished_requests import FINISHED_REQUESTS
from router.routing.replica_keys import REPLICA_MODEL_KEYS
from router.routing.telemetry import TELEMETRY
from workers.model_source import load_tokenizer

log = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 5.0
RESENDS_ON_WORKER_LOSS = 2
"""Times a request whose worker is lost before its first chunk is sent again (to another
worker: Serve's router drops a replica whose actor died)."""


@serve.ingress()
class NalarIngress:
    """Implements ``router.api.backend.ServingBackend`` over the worker deployment.

    The identity and tokenizer come from a worker at start-up, so the ingress tokenizes and
    hashes exactly as the workers do (all replicas of one deployment share them); the identity
    is read again when the router sees the workers' model key change (``cluster.worker_identity``).
    ``metrics_registry`` is what ``GET /metrics`` renders: at each scrape it asks every worker
    replica for its engine stats (``cluster.metrics``), plus the router's telemetry.
    ``dashboard`` feeds ``GET /dashboard`` (``cluster.dashboard``); every stream through
    :meth:`generate` adds its TTFT and ITL to it. ``admission`` sheds load past
    ``config.max_pending_tokens()`` (and ``config.max_queue_delay_s``) and drains on a clean
    stop (:meth:`drain`).

    Args:
        workers: handle to the worker deployment.
        config: the cluster configuration.
    """

    async def __init__(self, workers: DeploymentHandle, config: ClusterConfig):
        route_to_serve_logger()
        self.workers = workers
        description = await workers.describe.remote()
        live_keys = functools.partial(REPLICA_MODEL_KEYS.keys,
                                      (workers.app_name, workers.deployment_name))
        self.worker_identity = WorkerIdentity(workers.describe.remote, description, live_keys)
        self.served_model_name = config.served_model_name or description.served_name
        self.namespace_secret = bytes.fromhex(config.namespace_secret)
        # The keys file is read here, in the ingress process (a Secret volume on Kubernetes).
        self.api_keys = ApiKeys([key.get_secret_value() for key in config.api_keys],
                                config.api_keys_file)
        admin = config.admin_api_key
        self.admin_key = AdminKey(admin.get_secret_value() if admin is not None else None)
        self.adapter_catalog = AdapterCatalog(workers, description.adapters)
        await self.adapter_catalog.recover()
        self.admission = Admission(config.max_pending_tokens(), config.max_queue_delay_s,
                                   max_requests=config.max_requests_in_flight())
        source = Path(description.source_path)
        # Same machine: read the worker's converted copy; elsewhere, resolve the source again.
        self.tokenizer = load_tokenizer(str(source) if source.is_dir() else config.model)
        fetch = functools.partial(fetch_worker_stats, workers, SCRAPE_TIMEOUT_S)
        self.metrics_registry = build_registry(fetch)
        self.metrics_registry.register(TELEMETRY)
        # The dashboard's own view of the index (entries, age of the last event).
        self.index = make_index(config.redis_url, config.key_prefix, config.worker_ttl_s,
                                config.index_actor_name, actor_namespace=INDEX_ACTOR_NAMESPACE)
        self.dashboard = Dashboard(fetch, self.served_model_name, TELEMETRY,
                                   lambda: self.index.stats(self.identity.model_key))

    @property
    def identity(self) -> CacheIdentity:
        """The workers' cache identity, as last read."""
        return self.worker_identity.identity

    @property
    def adapters(self) -> dict[str, AdapterRef]:
        """The LoRA adapters requests may select (``cluster.adapters``)."""
        return self.adapter_catalog.adapters

    async def load_adapter(self, name: str, path: str) -> AdapterRef:
        """``ServingBackend.load_adapter``: on every worker replica."""
        return await self.adapter_catalog.load(name, path)

    async def unload_adapter(self, name: str) -> None:
        """``ServingBackend.unload_adapter``: on every worker replica."""
        await self.adapter_catalog.unload(name)

    @property
    def max_model_len(self) -> int:
        """The workers' context length in tokens, as last read."""
        return self.worker_identity.max_model_len

    def __serve_build_asgi_app__(self):
        app = build_openai_app(self, self.admission)
        app.include_router(dashboard_router(self.dashboard))
        return app

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        """Stream a request from whichever worker the router picks; closing cancels it.

        A worker lost before the request's first chunk (its process or node died) gets the
        request sent again, up to :data:`RESENDS_ON_WORKER_LOSS` times: nothing was streamed,
        so the client still gets one whole answer, and Serve's router has dropped the dead
        replica, so the request goes to another. A worker lost after its first chunk ends the
        stream with an error: its tokens cannot be taken back.

        The chunks come over Serve's gRPC channel to the replica (``_by_reference=False``)
        rather than as one Ray object each: a stream's chunks are small and many, and on a
        CPU host their per-chunk cost is taken from the engine's cores (``docs/performance.md``,
        "The token stream through Serve").

        Raises:
            OverloadedError: Serve refused the call (the workers' queues are full, or no
                replica is up): 503 with Retry-After.
            InvalidRequestError: the worker refused the request (400), as the worker raised it.
        """
        timer = self.dashboard.timer()
        _own_internal_request_id(request.request_id)
        for attempt in range(RESENDS_ON_WORKER_LOSS + 1):
            stream = None
            finished = streamed = False
            try:
                request = await self.worker_identity.current(request)
                stream = self.workers.options(stream=True, _by_reference=False).generate.remote(
                    request)
                async for chunk in stream:
                    timer.chunk(len(chunk.token_ids))
                    finished = chunk.is_last
                    if finished:  # before Serve's own word, which can come later
                        FINISHED_REQUESTS.finished(request.request_id)
                    streamed = True
                    yield chunk
                return
            except Exception as exc:
                # The call failed: nothing is left to cancel, and cancelling would raise its
                # error again (Ray fetches the call's result first), replacing this one.
                finished = True
                if not streamed and attempt < RESENDS_ON_WORKER_LOSS and worker_lost(exc):
                    log.warning("request %s: its worker was lost before its first token "
                                "(%s); sending it again", request.request_id,
                                type(typed_error(exc)).__name__)
                    if stream is not None:
                        # An unreachable worker may still be running it; a dead one's call
                        # raises its error again, which says nothing new.
                        with contextlib.suppress(Exception):
                            stream.cancel()
                    continue
                if streamed and worker_lost(exc):
                    raise lost_mid_stream(request.request_id, exc) from exc
                error = serve_error(exc)
                if error is exc:
                    raise
                raise error from exc
            finally:
                if stream is not None and not finished:
                    stream.cancel()  # reaches the worker as cancellation: it frees the blocks

    async def drain(self, timeout_s: float) -> dict[str, int]:
        """A clean stop's first step: refuse new requests (503 ``shutting_down``), let those in
        flight finish for up to ``timeout_s`` seconds, then end the rest with an error.

        Returns:
            ``router.api.admission.DrainReport`` as a dict (``finished``, ``cut``, ``left``).
        """
        return dataclasses.asdict(await self.admission.drain(timeout_s))

    async def is_ready(self) -> bool:
        """Whether Serve's controller counts a worker replica running (it checks each
        replica's health every 5 s, outside the replica's request queue). A call to a worker
        waits in that queue behind the generations: under a burst of 600 streams it timed
        out, and ``/health`` answered 503 after 5 s."""
        try:
            status = await asyncio.wait_for(asyncio.to_thread(serve.status), HEALTH_TIMEOUT_S)
        except Exception as exc:
            log.warning("health check failed: %s", exc)
            return False
        app = status.applications.get(self.workers.app_name)
        deployment = app.deployments.get(self.workers.deployment_name) if app else None
        return bool(deployment and deployment.replica_states.get("RUNNING", 0))


def worker_lost(exc: Exception) -> bool:
    """Whether a failed worker call means the worker itself is gone (its actor died or is
    unreachable, its node or process died), not that it refused or failed the request."""
    return isinstance(typed_error(exc), (RayActorError, NodeDiedError, WorkerCrashedError))


def lost_mid_stream(request_id: str, exc: Exception) -> APIError:
    """The answer when a request's worker is lost after its first tokens went out: those
    tokens cannot be taken back, so it is not sent again here, but the client can send it
    again at once (503 with ``Retry-After``, which the OpenAI SDKs retry by themselves when the
    answer is not streamed; an SSE error event with code ``worker_lost`` when it is)."""
    log.warning("request %s: its worker was lost mid-stream (%s)", request_id,
                type(typed_error(exc)).__name__)
    return APIError(503, f"the worker serving request {request_id} was lost mid-stream; "
                    "send the request again", code="worker_lost",
                    headers=retry_after_headers(1.0))


def serve_error(exc: Exception) -> Exception:
    """The error a failed worker call means to the API, out of Ray's wrapping.

    Serve's refusals (``BackPressureError``: the handle's queue is full;
    ``DeploymentUnavailableError``: no worker deployment) become :class:`OverloadedError`
    with Serve's status and retry delay, a full queue worded as the ingress's own bounds are
    (Serve's "Request dropped due to backpressure" names its internals, not the server's
    state). A worker's own refusal arrives as a ``RayTaskError``
    whose message is the remote traceback: its cause is what the client is answered with.
    Anything else is returned as it is (a 500, logged with the remote traceback).
    """
    cause = typed_error(exc)
    while isinstance(cause, RayTaskError) and isinstance(cause.cause, Exception):
        cause = cause.cause
    if isinstance(cause, BackPressureError):
        retry_after_s = RETRY_AFTER_S if cause.retry_after_s is None else cause.retry_after_s
        return OverloadedError("the server is overloaded (the workers' queues are full); "
                               "retry later", retry_after_s, cause.status_code)
    if isinstance(cause, DeploymentUnavailableError):
        return OverloadedError(str(cause), retry_after_s=RETRY_AFTER_S)
    if isinstance(cause, (InvalidRequestError, OverloadedError)):
        return cause
    return exc


def _own_internal_request_id(request_id: str) -> None:
    """Gives the worker calls made from here on in this task a Serve internal request id of
    their own, derived from the HTTP request's and ``request_id``.

    Every handle call made while serving one HTTP request inherits that request's internal id,
    and Serve's request router indexes the calls waiting for a replica by it. Two calls in
    flight at once (the prompts of a batch) shared one, and one of them was never routed: a
    batch of three prompts hung with two answered. Resends of one call keep the id, as Serve's
    own retries do.
    """
    context = serve_context._get_serve_request_context()
    serve_context._serve_request_context.set(dataclasses.replace(
        context, _internal_request_id=f"{context._internal_request_id}:{request_id}"))
