"""The HTTP side: one streamed request to any OpenAI-compatible server, measured.

Every request streams with ``stream_options.include_usage`` so the server's own token counts
(prompt, completion, cached, speculative) come back in the last event. Nothing here knows which
server it talks to: the ``x-nalar-worker`` header and speculative counts are read when present.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from dataclasses import dataclass
from typing import Any

import httpx

from bench.records import BenchRequest, RequestRecord
from bench.sse import aiter_events

WORKER_HEADER = "x-nalar-worker"
"""Response header naming the replica that served a request (Nalar Serve's; others omit it)."""

ENDPOINTS = {"chat": "/chat/completions", "completions": "/completions"}
"""``--endpoint`` choices and their paths under the ``/v1`` base."""


def api_base(url: str) -> str:
    """The ``/v1`` base of a server given by its root or its ``/v1`` URL."""
    url = url.rstrip("/")
    return url if url.endswith("/v1") else f"{url}/v1"


def auth_headers(api_key: str | None) -> dict[str, str]:
    """``Authorization: Bearer`` for a key; nothing without one."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def first_model(http: httpx.AsyncClient, base_url: str, api_key: str | None) -> str:
    """The first model ``GET /v1/models`` lists.

    Raises:
        httpx.HTTPError: the server cannot be reached or answers an error.
        LookupError: it lists no model.
    """
    response = await http.get(f"{api_base(base_url)}/models", headers=auth_headers(api_key))
    response.raise_for_status()
    models = response.json().get("data") or []
    if not models:
        raise LookupError(f"{base_url} lists no models")
    return models[0]["id"]


def completion_prompt(messages: list[dict[str, str]]) -> str:
    """Chat messages as one plain-text prompt for the completions endpoint."""
    lines = [f"{message['role'].capitalize()}: {message['content']}" for message in messages]
    return "\n\n".join(lines) + "\n\nAssistant:"


@dataclass
class OpenAIClient:
    """Sends :class:`BenchRequest` s to one server and measures each.

    Attributes:
        http: the connection pool (its limits must allow the run's concurrency).
        base_url: the server's root or ``/v1`` URL.
        model: the ``model`` field of every request.
        endpoint: ``chat`` or ``completions``.
        api_key: the key of requests that carry none of their own.
        temperature: sampling temperature (0: greedy).
        ignore_eos: ask the server to decode ``max_tokens`` tokens whatever it samples (a vLLM
            extension; off by default, so OpenAI's own API accepts the requests).
        timeout_s: the most one request may take, seconds.
    """

    http: httpx.AsyncClient
    base_url: str
    model: str
    endpoint: str = "chat"
    api_key: str | None = None
    temperature: float = 0.0
    ignore_eos: bool = False
    timeout_s: float = 600.0

    def body(self, request: BenchRequest) -> dict[str, Any]:
        """The JSON body of ``request``."""
        body: dict[str, Any] = {"model": request.model or self.model,
                                "max_tokens": request.max_tokens,
                                "temperature": self.temperature, "stream": True,
                                "stream_options": {"include_usage": True}}
        if self.endpoint == "chat":
            body["messages"] = request.messages
        else:
            body["prompt"] = completion_prompt(request.messages)
        if self.ignore_eos:
            body["ignore_eos"] = True
        if request.response_format is not None:
            body["response_format"] = request.response_format
        return body

    async def send(self, request: BenchRequest, origin: float) -> RequestRecord:
        """Sends ``request`` and measures it; never raises for a failed request.

        Args:
            request: what to send.
            origin: ``time.perf_counter()`` at the start of the phase (``start_s`` is relative
                to it).

        Returns:
            The record; ``failure`` says how it failed, if it did.
        """
        started = time.perf_counter()
        stream = _Stream(RequestRecord(label=request.label, start_s=started - origin), started)
        url = f"{api_base(self.base_url)}{ENDPOINTS[self.endpoint]}"
        headers = auth_headers(request.api_key or self.api_key)
        try:
            # httpx's timeout bounds each read; wait_for bounds the whole request.
            await asyncio.wait_for(self._exchange(url, request, headers, stream), self.timeout_s)
        except (httpx.TimeoutException, asyncio.TimeoutError):
            stream.fail("timeout", f"not finished within {self.timeout_s} s")
        except httpx.HTTPError as exc:
            stream.fail("broken_stream", f"{type(exc).__name__}: {exc}")
        return stream.finish(request.estimated_prompt_tokens)

    async def _exchange(self, url: str, request: BenchRequest, headers: dict[str, str],
                        stream: _Stream) -> None:
        async with self.http.stream("POST", url, json=self.body(request), headers=headers,
                                    timeout=self.timeout_s) as response:
            await stream.read(response)


class _Stream:
    """The state of one response being read."""

    def __init__(self, record: RequestRecord, started: float):
        self.record = record
        self.started = started
        self.chunk_times: list[float] = []
        self.text: list[str] = []
        self.saw_choice = False
        self.usage: dict[str, Any] | None = None

    def fail(self, kind: str, message: str) -> None:
        """Marks the request failed (the first failure wins)."""
        if self.record.failure is None:
            self.record.failure, self.record.error = kind, message

    async def read(self, response: httpx.Response) -> None:
        """Reads the whole response, event by event."""
        self.record.http_status = response.status_code
        self.record.worker = response.headers.get(WORKER_HEADER)
        if not response.is_success:
            await response.aread()
            self.fail("http", f"HTTP {response.status_code}: {_error_message(response.text)}")
            return
        async for event in aiter_events(response.aiter_lines()):
            if event.data == "[DONE]":
                return
            if not self._take(event.event, event.data):
                return
        self.fail("incomplete_stream", "the stream ended before [DONE]")

    def _take(self, name: str, data: str) -> bool:
        """Folds in one event; False when it ends the request (an error)."""
        try:
            payload = json.loads(data)
        except json.JSONDecodeError:
            self.fail("malformed_event", f"an event is not JSON: {data[:200]!r}")
            return False
        if name == "error" or (isinstance(payload, dict) and "error" in payload):
            self.fail("sse_error", _error_message(data))
            return False
        now = time.perf_counter()
        self.usage = payload.get("usage") or self.usage
        for choice in payload.get("choices") or []:
            self.saw_choice = True
            delta = choice.get("delta") or {}
            text = choice.get("text") or delta.get("content") or ""
            if text or delta.get("reasoning_content"):
                self.chunk_times.append(now)
                self.text.append(text)
        return True

    def finish(self, estimated_prompt_tokens: int) -> RequestRecord:
        """The record, with timings and token counts filled in."""
        record = self.record
        record.e2e_s = time.perf_counter() - self.started
        if record.ok and not self.saw_choice:
            self.fail("no_output", "the stream carried no choice")
        if self.chunk_times:
            record.ttft_s = self.chunk_times[0] - self.started
            record.itl_s = [b - a for a, b in itertools.pairwise(self.chunk_times)]
        record.output_text = "".join(self.text)
        record.prompt_tokens = estimated_prompt_tokens
        record.completion_tokens = len(self.chunk_times)
        if self.usage:
            _read_usage(record, self.usage)
        return record


def _read_usage(record: RequestRecord, usage: dict[str, Any]) -> None:
    """Copies the server's counts from an OpenAI ``usage`` object into ``record``."""
    record.usage_reported = True
    record.prompt_tokens = usage.get("prompt_tokens") or 0
    record.completion_tokens = usage.get("completion_tokens") or 0
    prompt_details = usage.get("prompt_tokens_details") or {}
    if prompt_details.get("cached_tokens") is not None:
        record.cached_tokens = prompt_details["cached_tokens"]
    completion_details = usage.get("completion_tokens_details") or {}
    record.accepted_prediction_tokens = completion_details.get("accepted_prediction_tokens")
    record.rejected_prediction_tokens = completion_details.get("rejected_prediction_tokens")


def _error_message(body: str) -> str:
    """The ``error.message`` of an OpenAI error body, else the body itself (cut short)."""
    try:
        error = json.loads(body).get("error")
    except (json.JSONDecodeError, AttributeError):
        return body[:500]
    if isinstance(error, dict):
        return str(error.get("message", error))
    return str(error)[:500]
