"""The FastAPI app of the OpenAI-compatible API: its routes, and the serving of one job.

Per request, the app:

1. validates the body (``router.protocol``; every refusal is a 400 naming the parameter);
2. derives the cache namespace from ``Authorization: Bearer <key>`` (a keyed hash: the raw key
   is never stored, forwarded or logged) and ``cache_salt``;
3. tokenizes once, with the worker's tokenizer: chat messages through the model's chat template,
   a string prompt with ``tokenizer.encode(prompt)`` (special tokens as the tokenizer is
   configured to add them, e.g. a BOS for Llama-style models and nothing for SmolLM2, which is
   the model's own convention for raw text), a token-id prompt as is after a range check;
4. computes the prompt's block digests under the deployment's identity for the prefix-aware
   router, and hands a :class:`~contract.request.GenerationRequest` to the backend
   (:mod:`router.api.jobs`);
5. admits the request only if the work it asks for, in tokens, fits under the ingress's
   bound, else answers 503 with ``Retry-After`` at once, before tokenizing
   (:mod:`router.api.admission`);
6. awaits the backend's first chunk before answering, so that ``x-nalar-worker`` names the
   replica and a refusal (``InvalidRequestError``, ``OverloadedError``) is a proper HTTP error,
   then answers with JSON or an SSE stream ending in ``data: [DONE]`` (:mod:`router.api.stream`).

The backend's generator is closed whenever the request ends early (client disconnect, error,
cancellation), which is how a worker learns to cancel the request and free its KV blocks.
"""

from __future__ import annotations

import asyncio
import functools
import importlib.metadata
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.types import Receive

from contract.request import GenerationChunk
from router.api.admission import Admission, AdmittedStream, requested_work, shutting_down
from router.api.auth import ApiKeyGuard
from router.api.backend import WORKER_HEADER, ServingBackend
from router.api.batch import BatchTally, MergedChunks
from router.api.disconnect import (
    ClientDisconnected,
    ClosingStreamingResponse,
    close_stream,
    unless_disconnected,
)
from router.api.formats import ChatFormat, CompletionFormat, Format
from router.api.jobs import Job, JobBuilder, resolve_model
from router.api.responses import (
    ResponsesFormat,
    chat_request,
    parse_request,
    response_events,
    responses_job,
)
from router.api.stream import collect, next_chunk, sse_events
from router.api.token_strings import TokenStrings
from router.api.tokenize import detokenize, tokenize
from router.errors import APIError, from_backend_exception, install_error_handlers, invalid_request
from router.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    LoadLoRAAdapterRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    UnloadLoRAAdapterRequest,
)

logger = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 5.0
"""``GET /health`` answers 503 when the backend does not say it is ready within this time."""

_Started = tuple[Job, GenerationChunk, AdmittedStream]
"""One prompt of a batch once started: its job, its first chunk, the rest of its stream."""


def build_openai_app(backend: ServingBackend, admission: Admission | None = None) -> FastAPI:
    """The OpenAI-compatible FastAPI app serving ``backend``.

    ``admission`` bounds the work in flight and drains on a clean stop (default: no bound).

    Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``,
    ``GET /v1/models/{model}``, ``POST /tokenize`` and ``POST /detokenize`` (vLLM's),
    ``POST /v1/load_lora_adapter`` and ``POST /v1/unload_lora_adapter`` (the admin key's
    only), ``GET /health``,
    ``GET /metrics`` (Prometheus text of the backend's ``metrics_registry``, a
    ``prometheus_client.CollectorRegistry``; 404 for a backend without one). When the
    backend's ``api_keys`` (:class:`~router.api.auth.ApiKeys`) requires keys, every route but
    ``/health``, ``/metrics``, ``/dashboard`` and the admin routes answers 401 to a request
    without an accepted key (:mod:`router.api.auth`).
    """
    # FastAPI's strict Content-Type check stays on: a JSON body needs ``application/json``,
    # so a web page cannot make a browser drive a local, key-less server without a CORS
    # preflight (FastAPI's CSRF guard). The 400 says what to send.
    app = FastAPI(title="Nalar Serve")
    install_error_handlers(app)
    # Read per request: a Serve ingress sets ``api_keys`` after the app is built; none = open.
    app.add_middleware(ApiKeyGuard, keys=lambda: getattr(backend, "api_keys", None))
    ingress = _Ingress(backend, admission or Admission())

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        """Chat completion (OpenAI ``chat.completion``), streamed as SSE when ``stream``."""
        admitted = ingress.admit(body)
        return await ingress.serve(
            admitted, lambda: ingress.jobs.chat_job(body, request.headers.get("authorization")),
            ChatFormat, request.receive)

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        """Text completion of a prompt (a string or token ids), SSE when ``stream``; or of a
        batch of prompts, answered at once."""
        authorization = request.headers.get("authorization")
        batch = body.batch()
        if batch is not None:
            return await ingress.serve_batch(batch, authorization, request.receive)
        admitted = ingress.admit(body)
        return await ingress.serve(
            admitted, lambda: ingress.jobs.completion_job(body, authorization),
            CompletionFormat, request.receive)

    @app.post("/v1/responses", response_model=None)
    async def responses(raw: dict[str, Any], request: Request) -> Response:
        """OpenAI's Responses API over the chat path (:mod:`router.api.responses`); not
        stored, streamed as the Responses events when ``stream``."""
        body = parse_request(raw)
        chat = chat_request(body)
        admitted = ingress.admit(chat)
        return await ingress.serve(
            admitted, lambda: responses_job(ingress.jobs.chat_job(
                chat, request.headers.get("authorization"), "resp")),
            lambda job, _: ResponsesFormat(job, body),
            request.receive, response_events)

    @app.get("/v1/models")
    async def list_models() -> ModelList:
        """The served model, then each LoRA adapter on it (``parent``: the served model)."""
        names = [backend.served_model_name, *sorted(backend.adapters)]
        return ModelList(data=[ingress.model_card(name) for name in names])

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str) -> ModelCard:
        """One model or adapter by id; 404 ``model_not_found`` for any other."""
        resolve_model(model, backend.served_model_name, backend.adapters)
        return ingress.model_card(model)

    @app.post("/tokenize")
    async def tokenize_prompt(body: TokenizeRequest) -> TokenizeResponse:
        """A prompt's or a chat's token ids, as the completion routes would give them
        (vLLM's route)."""
        return await tokenize(ingress.jobs, body)

    @app.post("/detokenize")
    async def detokenize_tokens(body: DetokenizeRequest) -> DetokenizeResponse:
        """Token ids back to text (vLLM's route)."""
        return await detokenize(ingress.jobs, body)

    @app.post("/v1/load_lora_adapter", response_model=None)
    async def load_lora_adapter(body: LoadLoRAAdapterRequest, request: Request) -> Response:
        """Serve a PEFT adapter directory as a new model (vLLM's route; admin key only)."""
        backend.admin_key.authorize(request.headers.get("authorization"))
        if body.lora_name == backend.served_model_name:
            raise invalid_request("lora_name is the base model's name", "lora_name")
        await backend.load_adapter(body.lora_name, body.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added "
                                 "successfully.")

    @app.post("/v1/unload_lora_adapter", response_model=None)
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, request: Request) -> Response:
        """Stop serving an adapter; requests running under it finish (admin key only)."""
        backend.admin_key.authorize(request.headers.get("authorization"))
        await backend.unload_adapter(body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed "
                                 "successfully.")

    # HEAD too, as load balancers' health checks send it (the server drops the body); not in
    # the schema, where it would repeat GET's operation. /ping is vLLM's name for the same
    # check (SageMaker's), POST included.
    @app.head("/health", response_model=None, include_in_schema=False)
    @app.get("/ping", response_model=None, include_in_schema=False)
    @app.post("/ping", response_model=None, include_in_schema=False)
    @app.get("/health", response_model=None)
    async def health() -> Response:
        """200 when the cluster can serve, else 503 (``shutting_down`` while draining)."""
        if ingress.admission.draining:
            return shutting_down().response()
        if await ingress.ready():
            return JSONResponse({"status": "ok"})
        return APIError(503, "the cluster is not ready to serve", code="not_ready").response()

    @app.get("/version")
    async def version() -> dict[str, str]:
        """The server's version (vLLM's route)."""
        return {"version": importlib.metadata.version("nalar-serve")}

    @app.head("/metrics", response_model=None, include_in_schema=False)
    @app.get("/metrics", response_model=None)
    async def metrics() -> Response:
        """Prometheus text exposition of the backend's registry, rendered in a worker thread
        (its collectors may block on the workers for a bounded time)."""
        # Read at scrape time: a Serve ingress builds the app before its __init__ finishes.
        registry = getattr(backend, "metrics_registry", None)
        if registry is None:
            raise APIError(404, "this server exports no metrics", code="not_found")
        body = await anyio.to_thread.run_sync(generate_latest, registry)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    return app


class _Ingress:
    """Job building, readiness and answer assembly for one backend."""

    def __init__(self, backend: ServingBackend, admission: Admission):
        self.backend = backend
        self.admission = admission
        self.created = int(time.time())
        # One tokenizer call at a time: a Rust tokenizer shared across threads can fail with
        # "Already borrowed" when calls overlap.
        self._tokenizer_lock = threading.Lock()
        self.jobs = JobBuilder(backend, self._tokenizer_lock)

    @functools.cached_property
    def token_strings(self) -> TokenStrings:
        """Token texts and bytes for logprobs (the tokenizer may load after the app)."""
        return TokenStrings(self.backend.tokenizer, self._tokenizer_lock)

    def model_card(self, name: str) -> ModelCard:
        """The served model or one of its adapters, as ``/v1/models`` lists it."""
        base = self.backend.served_model_name
        return ModelCard(id=name, created=self.created, parent=None if name == base else base,
                         max_model_len=self.backend.max_model_len)

    async def ready(self) -> bool:
        """The backend's readiness; a slow or failing check counts as not ready.

        Workers that sent an admitted request a chunk within :data:`HEALTH_TIMEOUT_S` are
        serving, and the check is not asked: it costs a call, and the cluster's first one (a
        call to a worker) waited behind the requests in the workers' queues until, under a
        full load, it timed out (a burst of 560 chat requests on 2 workers: ``/health``
        answered 503 after 5 s)."""
        if self.admission.answered_within(HEALTH_TIMEOUT_S):
            return True
        try:
            return bool(await asyncio.wait_for(self.backend.is_ready(), HEALTH_TIMEOUT_S))
        except Exception:
            logger.warning("readiness check failed", exc_info=True)
            return False

    def admit(self, body: ChatCompletionRequest | CompletionRequest) -> AdmittedStream:
        """Admits a request on the work its body asks for, before any tokenizing.

        Raises:
            OverloadedError: the work does not fit under the bound (503 + Retry-After).
            APIError: 503 ``shutting_down`` while draining.
        """
        return self.admission.admit(requested_work(body, self.backend.max_model_len))

    async def serve(self, admitted: AdmittedStream, build_job: Callable[[], Awaitable[Job]],
                    format_for: Callable[[Job, TokenStrings], Format],
                    receive: Receive, events: Callable[..., AsyncIterator[str]] = sse_events,
                    ) -> Response:
        """Builds the admitted request's job, runs it on the backend and answers with JSON or
        an SSE stream (``events(job, fmt, first_chunk, chunks)``: chat's and completions' by
        default); ``admitted`` is closed on every path (by the stream when streaming)."""
        try:
            job = await build_job()
        except BaseException:
            await close_stream(admitted)
            raise
        fmt = format_for(job, self.token_strings)
        request_id = job.request.request_id
        # No x-request-id of our own: the Serve proxy sets one; the body's ``id`` names the job.
        headers: dict[str, str] = {}
        chunks = admitted
        streaming = False
        try:
            chunks.start(job.request, self.backend.generate)
            first = await unless_disconnected(receive, next_chunk(chunks))
            headers[WORKER_HEADER] = first.worker_id or "unknown"
            if job.stream:
                response = ClosingStreamingResponse(
                    events(job, fmt, first, chunks), chunks, headers=headers)
                streaming = True  # the response owns ``chunks`` from here on
                return response
            tally = await unless_disconnected(receive, collect(job, first, chunks))
            body = fmt.response(tally).model_dump(mode="json", serialize_as_any=True)
            return JSONResponse(body, headers=headers)
        except ClientDisconnected:
            logger.info("request %s: client disconnected; cancelled", request_id)
            return Response(status_code=499)  # nobody is listening; the status is for logs
        except Exception as exc:
            raise from_backend_exception(exc, request_id, headers) from exc
        finally:
            if not streaming:
                await close_stream(chunks)

    async def serve_batch(self, bodies: list[CompletionRequest], authorization: str | None,
                          receive: Receive) -> Response:
        """A batch prompt, as vLLM and OpenAI serve one: each prompt a request of its own
        (admitted, tokenized and routed by its own prefix), all at once. Choice ``p * n + i``
        is prompt ``p``'s choice ``i``, in one JSON answer with the usage summed, or streamed
        (:mod:`router.api.batch`): events in the order the prompts' tokens arrive, the summed
        usage last when asked for. A failure before any prompt's first token answers for the
        whole batch, and one after it ends the stream with an error event; either way the
        other prompts are cancelled, which frees their KV blocks.

        Raises:
            APIError: as :meth:`serve` for any one prompt.
        """
        try:
            started = await unless_disconnected(receive, self._all(
                bodies, lambda p, body: self._start(p, body, authorization)))
        except ClientDisconnected:
            logger.info("a batch of %d prompts: client disconnected; cancelled", len(bodies))
            return Response(status_code=499)  # nobody is listening; the status is for logs
        jobs, firsts, streams = (list(column) for column in zip(*started, strict=True))
        n = bodies[0].n or 1
        fmt = CompletionFormat(jobs[0], self.token_strings, batch=jobs)
        headers = {WORKER_HEADER: ",".join(dict.fromkeys(
            first.worker_id or "unknown" for first in firsts))}
        chunks = MergedChunks(firsts, streams, n)
        tally = BatchTally([len(job.request.token_ids) for job in jobs], n)
        try:
            first = await anext(chunks)  # a prompt's first chunk, already read: at once
        except BaseException:
            await close_stream(chunks)
            raise
        if jobs[0].stream:
            events = sse_events(jobs[0], fmt, first, chunks, tally)
            return ClosingStreamingResponse(events, chunks, headers=headers)
        try:
            await unless_disconnected(receive, collect(jobs[0], first, chunks, tally))
        except ClientDisconnected:
            logger.info("a batch of %d prompts: client disconnected; cancelled", len(bodies))
            return Response(status_code=499)
        except Exception as exc:
            raise from_backend_exception(exc, jobs[0].request.request_id, headers) from exc
        finally:
            await close_stream(chunks)
        body = fmt.response(tally.merged()).model_dump(mode="json", serialize_as_any=True)
        return JSONResponse(body, headers=headers)

    @staticmethod
    async def _all(bodies: list[CompletionRequest],
                   one: Callable[[int, CompletionRequest], Awaitable[_Started]],
                   ) -> list[_Started]:
        """``one`` over every prompt of a batch (its index, its body) at once; on the first
        failure (or a cancellation) the others are cancelled, and the streams of those
        already started closed, before it is raised."""
        tasks = [asyncio.create_task(one(p, body)) for p, body in enumerate(bodies)]
        try:
            return await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                task.cancel()
            outcomes = await asyncio.gather(*tasks, return_exceptions=True)
            for outcome in outcomes:
                if isinstance(outcome, tuple):
                    await close_stream(outcome[2])
            raise

    async def _start(self, p: int, body: CompletionRequest,
                     authorization: str | None) -> _Started:
        """Prompt ``p`` of a batch admitted, tokenized and started, up to its first chunk
        (which names its worker); its stream is closed if that fails, and the error's message
        names the prompt."""
        admitted = self.admit(body)
        request_id = "batch"
        try:
            job = await self.jobs.completion_job(body, authorization)
            request_id = job.request.request_id
            admitted.start(job.request, self.backend.generate)
            return job, await next_chunk(admitted), admitted
        except BaseException as exc:
            await close_stream(admitted)
            if not isinstance(exc, Exception):
                raise
            error = from_backend_exception(exc, request_id, {})
            error.message = f"prompt {p} of the batch: {error.message}"
            raise error from exc
