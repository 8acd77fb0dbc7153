"""A small OpenAI-compatible server for the client's tests, started on a real socket.

It is not Nalar: it answers chat and text completions by streaming ``max_tokens`` chunks of one
word each, so every figure a test checks is known in advance:

* ``usage.prompt_tokens`` is the number of words in the prompt (all message contents);
* ``cached_tokens`` is the longest word prefix shared with an earlier prompt of the same API key;
* ``completion_tokens_details`` reports 3 accepted and 1 rejected draft tokens per request;
* ``x-nalar-worker`` alternates ``stub-0`` / ``stub-1`` (left out when ``worker_header`` is off);
* API keys choose a failure: ``http-500`` (an HTTP 500), ``sse-error`` (an error event after one
  chunk), ``truncate`` (no ``[DONE]``).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from helpers import free_port

MODEL = "stub-model"
CHUNK_DELAY_S = 0.002


@dataclass
class StubState:
    """What the stub saw: request bodies and keys in arrival order, and the most requests it
    had in flight at once."""

    bodies: list[dict] = field(default_factory=list)
    keys: list[str | None] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0
    worker_header: bool = True
    seen_prompts: dict[str | None, list[list[str]]] = field(default_factory=dict)


def _prompt_words(body: dict) -> list[str]:
    if "messages" in body:
        return " ".join(m["content"] for m in body["messages"]).split()
    return body["prompt"].split()


def _cached(previous: list[list[str]], words: list[str]) -> int:
    best = 0
    for earlier in previous:
        shared = 0
        for a, b in zip(earlier, words, strict=False):
            if a != b:
                break
            shared += 1
        best = max(best, shared)
    return best


def build_app(state: StubState) -> FastAPI:
    """The stub's routes over ``state``."""
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": MODEL, "object": "model"}]}

    async def complete(request: Request, chat: bool):
        body = await request.json()
        key = request.headers.get("authorization", "").removeprefix("Bearer ") or None
        state.bodies.append(body)
        state.keys.append(key)
        if key == "http-500":
            return JSONResponse({"error": {"message": "stub exploded", "type": "server_error"}},
                                status_code=500)
        words = _prompt_words(body)
        cached = _cached(state.seen_prompts.setdefault(key, []), words)
        state.seen_prompts[key].append(words)
        headers = {"x-nalar-worker": f"stub-{len(state.bodies) % 2}"} if state.worker_header \
            else {}
        return StreamingResponse(_events(state, body, key, chat, len(words), cached),
                                 media_type="text/event-stream", headers=headers)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await complete(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await complete(request, chat=False)

    return app


async def _events(state: StubState, body: dict, key: str | None, chat: bool,
                  prompt_tokens: int, cached: int):
    state.in_flight += 1
    state.max_in_flight = max(state.max_in_flight, state.in_flight)
    try:
        count = body["max_tokens"]
        for i in range(count):
            await asyncio.sleep(CHUNK_DELAY_S)
            choice = ({"index": 0, "delta": {"content": f"w{i} "}} if chat
                      else {"index": 0, "text": f"w{i} "})
            choice["finish_reason"] = "length" if i == count - 1 else None
            yield f"data: {json.dumps({'choices': [choice], 'usage': None})}\n\n"
            if key == "sse-error":
                yield 'data: {"error": {"message": "worker died", "code": 500}}\n\n'
                yield "data: [DONE]\n\n"
                return
        if key == "truncate":
            return
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = {"prompt_tokens": prompt_tokens, "completion_tokens": count,
                     "total_tokens": prompt_tokens + count,
                     "prompt_tokens_details": {"cached_tokens": cached},
                     "completion_tokens_details": {"accepted_prediction_tokens": 3,
                                                   "rejected_prediction_tokens": 1}}
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        state.in_flight -= 1


@contextmanager
def running_stub(worker_header: bool = True) -> Iterator[tuple[str, StubState]]:
    """Serves a fresh stub under uvicorn in a thread; yields its base URL and state."""
    state = StubState(worker_header=worker_header)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(state), host="127.0.0.1", port=port,
                                           log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("the stub server did not start within 10 s")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}", state
    finally:
        server.should_exit = True
        thread.join(timeout=10)
