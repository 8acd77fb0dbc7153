"""The OpenAI-compatible HTTP API of Nalar Serve, independent of Ray.

:func:`build_openai_app` turns a :class:`ServingBackend` (the cluster, seen from the ingress)
into a FastAPI app. Per request, the app:

1. validates the body (``router.protocol``; every refusal is a 400 naming the parameter);
2. derives the cache namespace from ``Authorization: Bearer <key>`` (a keyed hash: the raw key
   is never stored, forwarded or logged) and ``cache_salt``;
3. tokenizes once, with the worker's tokenizer: chat messages through the model's chat template,
   a string prompt with ``tokenizer.encode(prompt)`` (special tokens as the tokenizer is
   configured to add them, e.g. a BOS for Llama-style models and nothing for SmolLM2, which is
   the model's own convention for raw text), a token-id prompt as is after a range check;
4. computes the prompt's block digests under the deployment's identity for the prefix-aware
   router, and hands a :class:`~workers.request.GenerationRequest` to the backend;
5. awaits the backend's first chunk before answering, so that ``x-nalar-worker`` names the
   replica and a refusal (``InvalidRequestError``, ``OverloadedError``) is a proper HTTP error,
   then answers with JSON or an SSE stream ending in ``data: [DONE]``.

The backend's generator is closed whenever the request ends early (client disconnect, error,
cancellation), which is how a worker learns to cancel the request and free its KV blocks.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import suppress
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, TypeVar

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from jinja2 import TemplateError
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send
from transformers.convert_slow_tokenizer import bytes_to_unicode

from router.errors import (
    APIError,
    from_backend_exception,
    install_error_handlers,
    invalid_request,
)
from router.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    TopLogprob,
    Usage,
)
from workers.identity import CacheIdentity, CacheNamespace, block_digests, tenant_from_api_key
from workers.request import (
    GenerationChunk,
    GenerationRequest,
    InvalidRequestError,
    SamplingParams,
    SpecUsage,
    TokenLogprob,
)

logger = logging.getLogger(__name__)

WORKER_HEADER = "x-nalar-worker"
"""Response header naming the worker replica that served the request."""


HEALTH_TIMEOUT_S = 5.0
"""``GET /health`` answers 503 when the backend does not say it is ready within this time."""

_DONE_EVENT = "data: [DONE]\n\n"
_T = TypeVar("_T")


class ServingBackend(Protocol):
    """The cluster as the HTTP layer sees it; the Ray Serve ingress implements it over a
    ``DeploymentHandle``, tests with a fake.

    Attributes:
        served_model_name: the only ``model`` requests may name.
        max_model_len: context length in tokens (prompt plus output).
        identity: the worker deployment's cache identity (anonymous namespace); the app derives
            each request's root digest with ``identity.with_namespace(ns).root_digest``.
        namespace_secret: the key of :func:`~workers.identity.tenant_from_api_key`.
        tokenizer: the workers' transformers tokenizer, chat template included.
    """

    served_model_name: str
    max_model_len: int
    identity: CacheIdentity
    namespace_secret: bytes
    tokenizer: Any

    def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        """Streams the request's chunks (an async generator).

        The first chunk may carry no tokens, only ``worker_id``, ``prompt_tokens`` and
        ``cached_tokens``; the last has ``finish_reason`` set. Closing the generator early
        (``aclose()``) must cancel the request on its worker. May raise
        :class:`~workers.request.InvalidRequestError` (→ 400) or
        :class:`~router.errors.OverloadedError` (→ 503/429 with ``Retry-After``); anything else
        is a 500.
        """
        ...

    async def is_ready(self) -> bool:
        """Whether the cluster can serve requests now (drives ``GET /health``)."""
        ...


class ClientDisconnected(Exception):
    """The client went away before its answer was ready."""


@dataclass
class _Job:
    """A validated request, ready for the backend."""

    request: GenerationRequest
    model: str
    stream: bool
    include_usage: bool
    created: int = field(default_factory=lambda: int(time.time()))


@dataclass
class _ChoiceTally:
    """What the worker has streamed back for one choice so far."""

    completion_tokens: int = 0
    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    spec: SpecUsage | None = None


class CompletionTokensDetails(BaseModel):
    """``usage.completion_tokens_details``, OpenAI's predicted-output counts: the draft tokens
    speculative decoding committed (accepted) and discarded (rejected)."""

    accepted_prediction_tokens: int
    rejected_prediction_tokens: int


class SpeculativeUsage(BaseModel):
    """``usage.speculative``, Nalar's extension: one request's speculative decoding, summed
    over its choices (counts in tokens, times in seconds).

    ``acceptance_by_position[i]`` is the share of draft tokens at position ``i`` that were
    committed; ``k_decisions`` maps a chosen draft length (0: did not speculate) to steps.
    """

    proposed_tokens: int
    accepted_tokens: int
    rejected_tokens: int
    acceptance_rate: float
    verification_steps: int
    mean_accepted_length: float
    acceptance_by_position: list[float]
    k_decisions: dict[int, int]
    draft_s: float
    verify_s: float

    @classmethod
    def of(cls, spec: SpecUsage) -> SpeculativeUsage:
        """The extension object of one (summed) :class:`~workers.request.SpecUsage`."""
        by_position = [accepted / proposed if proposed else 0.0 for accepted, proposed
                       in zip(spec.accepted_by_position, spec.proposed_by_position, strict=True)]
        return cls(proposed_tokens=spec.proposed_tokens, accepted_tokens=spec.accepted_tokens,
                   rejected_tokens=spec.rejected_tokens, acceptance_rate=spec.acceptance_rate,
                   verification_steps=spec.verification_steps,
                   mean_accepted_length=spec.mean_accepted_length,
                   acceptance_by_position=by_position, k_decisions=dict(sorted(
                       spec.k_decisions.items())),
                   draft_s=spec.draft_s, verify_s=spec.verify_s)


class SpeculativeDecodingUsage(Usage):
    """``usage`` of a request that speculated: OpenAI's fields plus the draft counts.

    Serialised only where the app dumps with ``serialize_as_any`` (the response models
    declare plain :class:`~router.protocol.Usage`).
    """

    completion_tokens_details: CompletionTokensDetails
    speculative: SpeculativeUsage


def sum_spec_usage(specs: Sequence[SpecUsage]) -> SpecUsage:
    """The choices' speculative counts added up (per-position lists padded to the longest)."""
    total = SpecUsage()
    width = max((max(len(spec.proposed_by_position), len(spec.accepted_by_position))
                 for spec in specs), default=0)
    total.accepted_by_position = [0] * width
    total.proposed_by_position = [0] * width
    for spec in specs:
        total.proposed_tokens += spec.proposed_tokens
        total.accepted_tokens += spec.accepted_tokens
        total.verification_steps += spec.verification_steps
        total.draft_s += spec.draft_s
        total.verify_s += spec.verify_s
        for i, count in enumerate(spec.accepted_by_position):
            total.accepted_by_position[i] += count
        for i, count in enumerate(spec.proposed_by_position):
            total.proposed_by_position[i] += count
        for k, steps in spec.k_decisions.items():
            total.k_decisions[k] = total.k_decisions.get(k, 0) + steps
    return total


@dataclass
class _Tally:
    """What the worker has streamed back for one request (all its choices) so far."""

    prompt_tokens: int
    cached_tokens: int = 0
    choices: dict[int, _ChoiceTally] = field(default_factory=dict)

    def add(self, chunk: GenerationChunk) -> None:
        """Folds one chunk in."""
        # Counts are per choice (cumulative or fixed at admission); ``max`` keeps them right
        # whether a worker repeats them on every chunk or sends them once.
        self.prompt_tokens = chunk.prompt_tokens or self.prompt_tokens
        if chunk.index == 0:  # later choices reuse the first one's prompt blocks
            self.cached_tokens = max(self.cached_tokens, chunk.cached_tokens)
        choice = self.choices.setdefault(chunk.index, _ChoiceTally())
        choice.completion_tokens = max(choice.completion_tokens, chunk.completion_tokens)
        choice.text.append(chunk.text)
        choice.logprobs.extend(chunk.logprobs or ())
        choice.finish_reason = chunk.finish_reason or choice.finish_reason
        choice.spec = chunk.spec or choice.spec  # a choice's counts so far ride on its last chunk

    def usage(self) -> Usage:
        """The OpenAI ``usage`` object: the prompt once, the output tokens of every choice,
        and the prefix-cache hit as ``cached_tokens``; when a choice speculated, also the draft
        tokens accepted and rejected (``completion_tokens_details``) and the ``speculative``
        extension, summed over the choices."""
        completion = sum(c.completion_tokens for c in self.choices.values())
        fields = dict(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=completion,
            total_tokens=self.prompt_tokens + completion,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=self.cached_tokens),
        )
        specs = [c.spec for c in self.choices.values() if c.spec is not None]
        if not specs:
            return Usage(**fields)
        spec = sum_spec_usage(specs)
        details = CompletionTokensDetails(accepted_prediction_tokens=spec.accepted_tokens,
                                          rejected_prediction_tokens=spec.rejected_tokens)
        return SpeculativeDecodingUsage(**fields, completion_tokens_details=details,
                                        speculative=SpeculativeUsage.of(spec))

    def ordered(self) -> list[tuple[int, _ChoiceTally]]:
        return sorted(self.choices.items())


# Byte-level BPE vocabularies (GPT-2, Llama 3, Qwen, SmolLM2) spell each byte as one printable
# character (GPT-2's table); inverted, it turns a token's spelling back into its bytes.
_BYTE_DECODER = {char: byte for byte, char in bytes_to_unicode().items()}


class _TokenStrings:
    """Token id → (text, UTF-8 bytes) for logprobs, cached per id.

    Byte-level BPE tokens give their exact bytes (a token holding part of a multi-byte
    character has text ``�`` but its true bytes, as OpenAI reports them); other vocabularies
    fall back to decoding the single token.
    """

    def __init__(self, tokenizer: Any, lock: threading.Lock):
        self._tokenizer = tokenizer
        self._lock = lock
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        cached = self._cache.get(token_id)
        if cached is None:
            cached = self._cache[token_id] = self._lookup(token_id)
        return cached

    def _lookup(self, token_id: int) -> tuple[str, list[int]]:
        with self._lock:
            piece = self._tokenizer.convert_ids_to_tokens(token_id)
            special = token_id in set(getattr(self._tokenizer, "all_special_ids", ()))
            if special or not piece or any(c not in _BYTE_DECODER for c in piece):
                text = piece if special and piece else self._tokenizer.decode([token_id])
                return text, list(text.encode("utf-8"))
        raw = bytes(_BYTE_DECODER[c] for c in piece)
        return raw.decode("utf-8", errors="replace"), list(raw)


def build_openai_app(backend: ServingBackend) -> FastAPI:
    """The OpenAI-compatible FastAPI app serving ``backend``.

    Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``,
    ``GET /v1/models/{model}``, ``GET /health``, ``GET /metrics`` (Prometheus text of the
    backend's ``metrics_registry``, a ``prometheus_client.CollectorRegistry``; 404 for a
    backend without one).
    """
    # FastAPI's strict Content-Type check stays on: a JSON body needs ``application/json``,
    # so a web page cannot make a browser drive a local, key-less server without a CORS
    # preflight (FastAPI's CSRF guard). The 400 says what to send.
    app = FastAPI(title="Nalar Serve")
    install_error_handlers(app)
    ingress = _Ingress(backend)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        """Chat completion (OpenAI ``chat.completion``), streamed as SSE when ``stream``."""
        job = await ingress.chat_job(body, request.headers.get("authorization"))
        return await ingress.serve(job, _ChatFormat(job, ingress.token_strings),
                                   request.receive)

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        """Text completion of one prompt (a string or token ids), SSE when ``stream``."""
        job = await ingress.completion_job(body, request.headers.get("authorization"))
        return await ingress.serve(job, _CompletionFormat(job, ingress.token_strings),
                                   request.receive)

    @app.get("/v1/models")
    async def list_models() -> ModelList:
        """The served model."""
        return ModelList(data=[ingress.model_card()])

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str) -> ModelCard:
        """One model by id; 404 ``model_not_found`` for any other."""
        ingress.check_model(model)
        return ingress.model_card()

    @app.get("/health", response_model=None)
    async def health() -> Response:
        """200 when the cluster can serve, else 503."""
        if await ingress.ready():
            return JSONResponse({"status": "ok"})
        return APIError(503, "the cluster is not ready to serve", code="not_ready").response()

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
    """Request validation, tokenization and answer assembly for one backend."""

    def __init__(self, backend: ServingBackend):
        self.backend = backend
        self.created = int(time.time())
        # One tokenizer call at a time: a Rust tokenizer shared across threads can fail with
        # "Already borrowed" when calls overlap.
        self._tokenizer_lock = threading.Lock()

    @functools.cached_property
    def token_strings(self) -> _TokenStrings:
        """Token texts and bytes for logprobs (the tokenizer may load after the app)."""
        return _TokenStrings(self.backend.tokenizer, self._tokenizer_lock)

    @functools.cached_property
    def vocab_size(self) -> int:
        """Token ids a prompt may use. Read on first use, so a backend may finish loading its
        tokenizer after the app is built (``serve.ingress`` wants the app up front)."""
        return len(self.backend.tokenizer)

    # -- metadata -----------------------------------------------------------------------------

    def model_card(self) -> ModelCard:
        """The served model, as ``/v1/models`` lists it."""
        return ModelCard(id=self.backend.served_model_name, created=self.created,
                         max_model_len=self.backend.max_model_len)

    def check_model(self, model: str | None) -> None:
        """Raises 404 ``model_not_found`` unless ``model`` is the served model.

        A missing ``model`` means the served one (as vLLM allows): a one-model server has no
        other reading of it.
        """
        if model is not None and model != self.backend.served_model_name:
            raise APIError(404, f"The model '{model}' does not exist; this server serves "
                           f"'{self.backend.served_model_name}'", param="model",
                           code="model_not_found")

    async def ready(self) -> bool:
        """The backend's readiness; a slow or failing check counts as not ready."""
        try:
            return bool(await asyncio.wait_for(self.backend.is_ready(), HEALTH_TIMEOUT_S))
        except Exception:
            logger.warning("readiness check failed", exc_info=True)
            return False

    # -- building jobs ------------------------------------------------------------------------

    async def chat_job(self, body: ChatCompletionRequest, authorization: str | None) -> _Job:
        """Validates a chat request and tokenizes it through the chat template."""
        max_tokens, max_param = _chat_max_tokens(body)
        messages = [message.template_dict() for message in body.messages]
        return await self._job(body, lambda: self._chat_ids(messages), "messages",
                               max_tokens, max_param, authorization, "chatcmpl")

    async def completion_job(self, body: CompletionRequest,
                             authorization: str | None) -> _Job:
        """Validates a text-completion request and tokenizes its prompt."""
        prompt = body.prompt
        if isinstance(prompt, str):
            def tokenize() -> list[int]:
                return list(self.backend.tokenizer.encode(prompt))
        else:
            def tokenize() -> list[int]:
                return self._checked_ids(prompt, "prompt")
        return await self._job(body, tokenize, "prompt", body.max_tokens, "max_tokens",
                               authorization, "cmpl")

    async def _job(self, body: ChatCompletionRequest | CompletionRequest,
                   tokenize: Callable[[], list[int]], prompt_param: str,
                   max_tokens: int | None, max_param: str, authorization: str | None,
                   id_prefix: str) -> _Job:
        """Checks what needs no tokens first (cheap refusals), then tokenizes and hashes."""
        self.check_model(body.model)
        _check_stream_options(body)
        sampling = self._sampling(body, max_tokens, max_param)
        namespace = CacheNamespace(
            tenant=tenant_from_api_key(_bearer_key(authorization), self.backend.namespace_secret),
            cache_salt=body.cache_salt,
        )
        token_ids, digests = await anyio.to_thread.run_sync(self._tokens_and_digests, tokenize,
                                                            namespace, prompt_param)
        sampling = self._fit_context(sampling, len(token_ids), max_tokens is not None,
                                     prompt_param, max_param)
        request = GenerationRequest(f"{id_prefix}-{uuid.uuid4().hex}", token_ids, sampling,
                                    namespace, digests)
        # The tenant is a keyed hash; a prefix of it is enough to correlate logs.
        logger.debug("request %s: tenant %s, %d prompt tokens, %d digests", request.request_id,
                     namespace.tenant[:12], len(token_ids), len(digests))
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        return _Job(request, self.backend.served_model_name, bool(body.stream), include_usage)

    def _sampling(self, body: ChatCompletionRequest | CompletionRequest, max_tokens: int | None,
                  max_param: str) -> SamplingParams:
        """Sampling parameters, validated; ``max_tokens`` is provisional until the prompt's
        length is known (see :meth:`_fit_context`)."""
        if body.stop_token_ids:
            self._checked_ids(body.stop_token_ids, "stop_token_ids")
        logit_bias = body.logit_bias_ids()
        if logit_bias:
            self._checked_ids(list(logit_bias), "logit_bias")
        min_tokens = body.min_tokens or 0
        sampling = SamplingParams(
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=0 if body.top_k is None else body.top_k,
            min_p=body.min_p or 0.0,
            repetition_penalty=1.0 if body.repetition_penalty is None
            else body.repetition_penalty,
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            logit_bias=logit_bias,
            seed=body.seed,
            n=1 if body.n is None else body.n,
            max_tokens=max(1, min_tokens) if max_tokens is None else max_tokens,
            min_tokens=min_tokens,
            stop=list(body.stop or []),
            stop_token_ids=list(body.stop_token_ids or []),
            ignore_eos=bool(body.ignore_eos),
            logprobs=body.logprobs_count(),
        )
        # Chat asks for alternatives with ``top_logprobs``; completions with ``logprobs``.
        chat = isinstance(body, ChatCompletionRequest)
        _validate(sampling, max_param, "top_logprobs" if chat else "logprobs")
        return sampling

    def _fit_context(self, sampling: SamplingParams, prompt_len: int, explicit_max: bool,
                     prompt_param: str, max_param: str) -> SamplingParams:
        """Refuses prompts that leave no room to generate; defaults ``max_tokens`` to the rest
        of the context."""
        limit = self.backend.max_model_len
        if prompt_len == 0:
            raise invalid_request(f"{prompt_param}: the prompt has no tokens", prompt_param)
        if prompt_len >= limit:
            raise invalid_request(
                f"This model's maximum context length is {limit} tokens, and the prompt has "
                f"{prompt_len} tokens, leaving no room for output", prompt_param,
                "context_length_exceeded")
        if not explicit_max:
            sampling = replace(sampling, max_tokens=limit - prompt_len)
            _validate(sampling, max_param)  # min_tokens may exceed what the context leaves
            return sampling
        if prompt_len + sampling.max_tokens > limit:
            raise invalid_request(
                f"This model's maximum context length is {limit} tokens; the prompt has "
                f"{prompt_len} tokens and {max_param} asks for {sampling.max_tokens} more",
                max_param, "context_length_exceeded")
        return sampling

    def _tokens_and_digests(self, tokenize: Callable[[], list[int]], namespace: CacheNamespace,
                            prompt_param: str) -> tuple[list[int], list[bytes]]:
        """Runs in a worker thread: tokenization and hashing are CPU work the event loop
        should not wait on.

        Raises:
            APIError: 400 naming ``prompt_param`` when the tokenizer rejects the text (e.g. a
                lone UTF-16 surrogate, which no UTF-8 encoding can carry): case R6.
        """
        with self._tokenizer_lock:
            try:
                token_ids = tokenize()
            except (TypeError, ValueError, UnicodeError) as exc:
                raise invalid_request(f"the tokenizer rejected the {prompt_param}: {exc}",
                                      prompt_param) from exc
        identity = self.backend.identity
        root = identity.with_namespace(namespace).root_digest
        return token_ids, block_digests(root, token_ids, identity.block_size)

    def _chat_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of the chat template applied to ``messages``, with the assistant's turn
        opened (``add_generation_prompt``)."""
        tokenizer = self.backend.tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise invalid_request("this model has no chat template; use /v1/completions",
                                  "messages", "unsupported_value")
        try:
            encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                    tokenize=True)
        except TemplateError as exc:
            # Templates reject some conversations themselves (e.g. roles that do not alternate).
            raise invalid_request(f"messages: the model's chat template refused them: {exc}",
                                  "messages") from exc
        return plain_token_ids(encoded)

    def _checked_ids(self, token_ids: Sequence[int], param: str) -> list[int]:
        """``token_ids`` as a list, if every id is in the vocabulary."""
        for index, token_id in enumerate(token_ids):
            if not 0 <= token_id < self.vocab_size:
                raise invalid_request(f"{param}[{index}]: token id {token_id} is outside the "
                                      f"vocabulary [0, {self.vocab_size})", param)
        return list(token_ids)

    # -- serving ------------------------------------------------------------------------------

    async def serve(self, job: _Job, fmt: _Format, receive: Receive) -> Response:
        """Runs ``job`` on the backend and answers with JSON or an SSE stream."""
        request_id = job.request.request_id
        # No x-request-id of our own: the Serve proxy sets one; the body's ``id`` names the job.
        headers: dict[str, str] = {}
        chunks: AsyncIterator[GenerationChunk] | None = None
        streaming = False
        try:
            chunks = self.backend.generate(job.request)
            first = await _unless_disconnected(receive, _next_chunk(chunks))
            headers[WORKER_HEADER] = first.worker_id or "unknown"
            if job.stream:
                response = _ClosingStreamingResponse(
                    _sse_events(job, fmt, first, chunks), chunks, headers=headers)
                streaming = True  # the response owns ``chunks`` from here on
                return response
            tally = await _unless_disconnected(receive, _collect(job, first, chunks))
            body = fmt.response(tally).model_dump(mode="json", serialize_as_any=True)
            return JSONResponse(body, headers=headers)
        except ClientDisconnected:
            logger.info("request %s: client disconnected; cancelled", request_id)
            return Response(status_code=499)  # nobody is listening; the status is for logs
        except Exception as exc:
            raise from_backend_exception(exc, request_id, headers) from exc
        finally:
            if chunks is not None and not streaming:
                await _close(chunks)


def _validate(sampling: SamplingParams, max_param: str, logprobs_param: str = "logprobs",
              ) -> None:
    """:meth:`SamplingParams.validate`, as a 400 naming the request's parameter."""
    try:
        sampling.validate()
    except InvalidRequestError as exc:
        renamed = {"max_tokens": max_param, "logprobs": logprobs_param}
        param = renamed.get(exc.param, exc.param)
        message = str(exc)
        if exc.param and message.startswith(exc.param):  # name the field the client sent
            message = param + message[len(exc.param):]
        raise invalid_request(message, param, exc.code) from exc


def _bearer_key(authorization: str | None) -> str | None:
    """The API key of an ``Authorization: Bearer <key>`` header; ``None`` without a header.

    Keys are not checked against a list: a key only selects the cache namespace. A header in
    another form is refused (401) rather than served in the shared anonymous namespace, which
    the client did not ask for.
    """
    if authorization is None:
        return None
    scheme, _, key = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise APIError(401, "the Authorization header must be 'Bearer <api key>'",
                       code="invalid_api_key", error_type="invalid_request_error")
    return key.strip()


def _chat_max_tokens(body: ChatCompletionRequest) -> tuple[int | None, str]:
    """The output limit of a chat request and the parameter it came from.

    ``max_completion_tokens`` is OpenAI's current name and ``max_tokens`` the deprecated one;
    both are accepted, but not two different values.
    """
    if body.max_completion_tokens is None:
        return body.max_tokens, "max_tokens"
    if body.max_tokens is not None and body.max_tokens != body.max_completion_tokens:
        raise invalid_request("max_tokens and max_completion_tokens disagree; send only one",
                              "max_tokens")
    return body.max_completion_tokens, "max_completion_tokens"


def _check_stream_options(body: ChatCompletionRequest | CompletionRequest) -> None:
    """``stream_options`` only means something for a streaming request (as OpenAI rules)."""
    if body.stream_options is not None and not body.stream:
        raise invalid_request("stream_options is only allowed when stream is true",
                              "stream_options")


def plain_token_ids(encoded: Any) -> list[int]:
    """Token ids from whatever ``apply_chat_template(tokenize=True)`` returned.

    transformers 5 returns a ``BatchEncoding`` (a mapping with ``input_ids``); older versions a
    list, sometimes nested one level for a batch of one.
    """
    ids = encoded["input_ids"] if hasattr(encoded, "keys") else encoded
    ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
    if ids and isinstance(ids[0], list):
        ids = ids[0]
    return [int(token_id) for token_id in ids]


# -- talking to the backend -------------------------------------------------------------------


async def _next_chunk(chunks: AsyncIterator[GenerationChunk]) -> GenerationChunk:
    """The backend's next chunk; a stream that ends before a finish reason is a server error."""
    try:
        return await anext(chunks)
    except StopAsyncIteration:
        raise APIError(500, "the worker's stream ended before the request finished",
                       code="internal_error") from None


def _finish_reason(reason: str | None) -> str:
    """The OpenAI ``finish_reason`` of the worker's last chunk.

    ``abort`` means the worker gave the request up (drain, shutdown, preemption limit) without
    the client asking: that is not an answer, so it is a retryable 503 (or, mid-stream, an
    error event), never a truncated text passed off as finished.
    """
    if reason in ("stop", "length"):
        return reason
    raise APIError(503, "the request was aborted by the server before it finished; retry",
                   code="request_aborted", headers={"Retry-After": "1"})


async def _collect(job: _Job, first: GenerationChunk,
                   chunks: AsyncIterator[GenerationChunk]) -> _Tally:
    """Reads the backend's stream to its end (non-streaming answers)."""
    tally = _Tally(prompt_tokens=len(job.request.token_ids))
    chunk = first
    while True:
        tally.add(chunk)
        if chunk.finish_reason is not None:
            _finish_reason(chunk.finish_reason)
            if chunk.is_last:
                return tally
        chunk = await _next_chunk(chunks)


async def _sse_events(job: _Job, fmt: _Format, first: GenerationChunk,
                      chunks: AsyncIterator[GenerationChunk]) -> AsyncIterator[str]:
    """The SSE events of a streaming answer; always ends with ``data: [DONE]``.

    A failure after the headers went out cannot change the status any more, so it becomes an
    ``{"error": ...}`` event before ``[DONE]``: the client never hangs on a dead stream.
    """
    tally = _Tally(prompt_tokens=len(job.request.token_ids))
    try:
        for event in fmt.opening():
            yield _sse(event, job.include_usage)
        chunk = first
        while True:
            tally.add(chunk)
            if chunk.text or chunk.logprobs:
                yield _sse(fmt.text(chunk.index, chunk.text, chunk.logprobs),
                           job.include_usage)
            if chunk.finish_reason is not None:
                reason = _finish_reason(chunk.finish_reason)
                yield _sse(fmt.finish(chunk.index, reason), job.include_usage)
                if chunk.is_last:
                    break
            chunk = await _next_chunk(chunks)
        if job.include_usage:
            yield _sse(fmt.usage(tally.usage()), True)
    except Exception as exc:
        error = from_backend_exception(exc, job.request.request_id)
        yield f"data: {json.dumps(error.body())}\n\n"
    finally:
        await _close(chunks)
    yield _DONE_EVENT


def _sse(event: BaseModel, include_usage: bool) -> str:
    """One SSE event; ``usage`` appears (as null until the last event) only when asked for."""
    exclude = None if include_usage else {"usage"}
    return f"data: {event.model_dump_json(exclude=exclude, serialize_as_any=True)}\n\n"


async def _close(chunks: AsyncIterator[Any]) -> None:
    """Closes an async generator even while our task is being cancelled: closing is what tells
    the worker to stop and free the request's blocks."""
    aclose = getattr(chunks, "aclose", None)
    if aclose is None:
        return
    with anyio.CancelScope(shield=True):
        try:
            await aclose()
        except Exception:
            logger.warning("closing a response stream failed", exc_info=True)


async def _wait_for_disconnect(receive: Receive) -> None:
    """Returns when the ASGI server reports that the client went away."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(receive: Receive, work: Awaitable[_T]) -> _T:
    """Awaits ``work``, unless the client disconnects first: then ``work`` is cancelled and
    :class:`ClientDisconnected` raised.

    Plain ASGI endpoints never hear of a disconnect, so a request waiting in a queue or
    generating a long non-streaming answer would keep its worker busy for nobody.
    """
    work_task = asyncio.ensure_future(work)
    watch_task = asyncio.ensure_future(_wait_for_disconnect(receive))
    try:
        await asyncio.wait((work_task, watch_task), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch_task.cancel()
        work_task.cancel()
        # Let both cancellations land: the caller closes the backend's generator next, which
        # fails while ``work_task`` is still inside it.
        with anyio.CancelScope(shield=True):
            await asyncio.wait((work_task, watch_task))
    if not watch_task.cancelled():
        watch_task.exception()  # retrieved so asyncio does not warn about it
    if work_task.cancelled():
        raise ClientDisconnected
    return work_task.result()


class _ClosingStreamingResponse(StreamingResponse):
    """A streaming response that stops on client disconnect and always closes its iterator.

    Starlette's own leaves the body iterator suspended when the client goes away and, under
    ASGI 2.4, notices a disconnect only at its next send, so a request waiting for its next
    token would hold its worker's blocks. Closing the iterator runs its ``finally``, which
    closes the backend's generator.
    """

    def __init__(self, events: AsyncIterator[str], backend_chunks: AsyncIterator[Any],
                 headers: dict[str, str]):
        super().__init__(events, headers=headers, media_type="text/event-stream")
        self.backend_chunks = backend_chunks

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await _unless_disconnected(receive, self._stream(send))
        except ClientDisconnected:
            logger.info("streaming client disconnected; request cancelled")
        finally:
            await _close(self.body_iterator)
            # Also closed directly: an event generator cancelled before its first step never
            # runs its ``finally``.
            await _close(self.backend_chunks)

    async def _stream(self, send: Send) -> None:
        # An OSError from send is an ASGI 2.4 server saying the client is gone.
        with suppress(OSError):
            await self.stream_response(send)


# -- response shapes --------------------------------------------------------------------------


class _Format(Protocol):
    """The OpenAI shapes of one endpoint's answers."""

    def opening(self) -> list[BaseModel]:
        """Events sent before any text."""
        ...

    def text(self, index: int, text: str, logprobs: list[TokenLogprob] | None) -> BaseModel:
        """An event carrying new text (and its tokens' logprobs) of choice ``index``."""
        ...

    def finish(self, index: int, reason: str) -> BaseModel:
        """The event carrying the finish reason of choice ``index``."""
        ...

    def usage(self, usage: Usage) -> BaseModel:
        """The last event when ``include_usage``: no choices, only usage."""
        ...

    def response(self, tally: _Tally) -> BaseModel:
        """The whole non-streaming answer."""
        ...


TokenStrings = Callable[[int], tuple[str, list[int]]]


class _ChatFormat:
    """``chat.completion`` and ``chat.completion.chunk`` shapes."""

    def __init__(self, job: _Job, token_strings: TokenStrings):
        self.job = job
        self.token_strings = token_strings

    def _chunk(self, choices: list[ChatChunkChoice], usage: Usage | None = None,
               ) -> ChatCompletionChunk:
        job = self.job
        return ChatCompletionChunk(id=job.request.request_id, created=job.created,
                                   model=job.model, choices=choices, usage=usage)

    def opening(self) -> list[BaseModel]:
        """The first delta of each choice announces the assistant's turn."""
        return [self._chunk([ChatChunkChoice(index=i, delta=ChatDelta(role="assistant",
                                                                      content=""))])
                for i in range(self.job.request.sampling.n)]

    def text(self, index: int, text: str, logprobs: list[TokenLogprob] | None) -> BaseModel:
        """A content delta."""
        return self._chunk([ChatChunkChoice(index=index, delta=ChatDelta(content=text),
                                            logprobs=self._logprobs(logprobs))])

    def finish(self, index: int, reason: str) -> BaseModel:
        """An empty delta with the finish reason."""
        return self._chunk([ChatChunkChoice(index=index, delta=ChatDelta(),
                                            finish_reason=reason)])

    def usage(self, usage: Usage) -> BaseModel:
        """The usage-only chunk."""
        return self._chunk([], usage)

    def response(self, tally: _Tally) -> BaseModel:
        """The ``chat.completion`` object."""
        job = self.job
        choices = [ChatChoice(index=index, message=AssistantMessage(content="".join(c.text)),
                              logprobs=self._logprobs(c.logprobs), finish_reason=c.finish_reason)
                   for index, c in tally.ordered()]
        return ChatCompletionResponse(id=job.request.request_id, created=job.created,
                                      model=job.model, choices=choices, usage=tally.usage())

    def _logprobs(self, entries: list[TokenLogprob] | None) -> ChatLogprobs | None:
        if self.job.request.sampling.logprobs is None:
            return None
        return ChatLogprobs(content=[self._entry(e) for e in entries or ()])

    def _entry(self, entry: TokenLogprob) -> ChatTokenLogprob:
        text, raw = self.token_strings(entry.token_id)
        top = [TopLogprob(token=t, logprob=lp, bytes=b)
               for (t, b), lp in ((self.token_strings(i), lp) for i, lp in entry.top)]
        return ChatTokenLogprob(token=text, logprob=entry.logprob, bytes=raw, top_logprobs=top)


class _CompletionFormat:
    """``text_completion`` shapes (the same object streams, chunk by chunk)."""

    def __init__(self, job: _Job, token_strings: TokenStrings):
        self.job = job
        self.token_strings = token_strings
        self._offsets: dict[int, int] = {}  # per choice: text offset of its next token

    def _chunk(self, choices: list[CompletionChoice], usage: Usage | None = None,
               ) -> CompletionResponse:
        job = self.job
        return CompletionResponse(id=job.request.request_id, created=job.created,
                                  model=job.model, choices=choices, usage=usage)

    def opening(self) -> list[BaseModel]:
        """Text completions open with text directly."""
        return []

    def text(self, index: int, text: str, logprobs: list[TokenLogprob] | None) -> BaseModel:
        """A text chunk."""
        return self._chunk([CompletionChoice(index=index, text=text,
                                             logprobs=self._logprobs(index, logprobs))])

    def finish(self, index: int, reason: str) -> BaseModel:
        """An empty text chunk with the finish reason."""
        return self._chunk([CompletionChoice(index=index, text="", finish_reason=reason)])

    def usage(self, usage: Usage) -> BaseModel:
        """The usage-only chunk."""
        return self._chunk([], usage)

    def response(self, tally: _Tally) -> BaseModel:
        """The ``text_completion`` object."""
        choices = [CompletionChoice(index=index, text="".join(c.text),
                                    logprobs=self._logprobs(index, c.logprobs),
                                    finish_reason=c.finish_reason)
                   for index, c in tally.ordered()]
        return self._chunk(choices, tally.usage())

    def _logprobs(self, index: int, entries: list[TokenLogprob] | None,
                  ) -> CompletionLogprobs | None:
        """The legacy parallel-list shape; ``top_logprobs`` also holds the sampled token (as
        vLLM's do), and ``text_offset`` counts the token texts before each token."""
        if self.job.request.sampling.logprobs is None:
            return None
        result = CompletionLogprobs()
        offset = self._offsets.get(index, 0)
        for entry in entries or ():
            text = self.token_strings(entry.token_id)[0]
            top = {self.token_strings(i)[0]: lp for i, lp in entry.top}
            top.setdefault(text, entry.logprob)
            result.tokens.append(text)
            result.token_logprobs.append(entry.logprob)
            result.top_logprobs.append(top)
            result.text_offset.append(offset)
            offset += len(text)
        self._offsets[index] = offset
        return result
