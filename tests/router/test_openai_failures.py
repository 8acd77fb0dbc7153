"""Failures of the HTTP layer: backend errors before and during an answer, concurrency, and
client disconnects, each of which must close the backend's stream (the worker frees the
request's blocks)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import pytest
from openai_fakes import (
    CHAT,
    COMPLETIONS,
    HELLO,
    assert_error,
    chunk,
    hello_world,
    sse_events,
)

from contract.request import (
    InvalidRequestError,
)
from router.api.app import build_openai_app
from router.api.backend import WORKER_HEADER
from router.errors import OverloadedError

# -- backend errors ----------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
async def test_invalid_request_from_the_backend_is_a_400(client, backend, stream):
    backend.script = lambda request: [InvalidRequestError("adapter unknown", "model", "bad_x")]
    response = await client.post(CHAT, json={"messages": HELLO, "stream": stream})
    assert_error(response, 400, "model", "bad_x")
    assert backend.closed == [backend.requests[0].request_id]


@pytest.mark.parametrize(("status", "error_type"), [(503, "server_error"),
                                                    (429, "rate_limit_error")])
@pytest.mark.parametrize("stream", [False, True])
async def test_overload_is_refused_with_retry_after(client, backend, stream, status, error_type):
    overload = OverloadedError("queues full", retry_after_s=2.5, status_code=status)
    backend.script = lambda request: [overload]
    response = await client.post(CHAT, json={"messages": HELLO, "stream": stream})
    assert_error(response, status, None, "overloaded", error_type)
    assert response.headers["retry-after"] == "3"


@pytest.mark.parametrize("stream", [False, True])
async def test_unexpected_backend_failure_before_output_is_a_500(client, backend, stream):
    backend.script = lambda request: [RuntimeError("boom: internal detail")]
    response = await client.post(COMPLETIONS, json={"prompt": "x", "stream": stream})
    error = assert_error(response, 500, None, "internal_error", "server_error")
    assert "internal detail" not in error["message"]


async def test_failure_mid_stream_is_an_error_event_then_done(client, backend):
    backend.script = lambda request: [chunk(request), chunk(request, "Hel", completion=1),
                                      RuntimeError("worker died")]
    response = await client.post(CHAT, json={"messages": HELLO, "stream": True})
    assert response.status_code == 200
    events = sse_events(response)
    assert events[-1] == "[DONE]"
    error = events[-2]["error"]
    assert (error["type"], error["code"]) == ("server_error", "internal_error")
    assert events[1]["choices"][0]["delta"] == {"content": "Hel"}
    assert backend.closed == [backend.requests[0].request_id]


async def test_failure_mid_answer_without_streaming_is_a_500(client, backend):
    backend.script = lambda request: [chunk(request), chunk(request, "Hel", completion=1),
                                      RuntimeError("worker died")]
    response = await client.post(CHAT, json={"messages": HELLO})
    assert_error(response, 500, None, "internal_error", "server_error")
    assert response.headers[WORKER_HEADER] == "worker-7"


async def test_abort_is_a_retryable_error_not_a_finished_answer(client, backend):
    backend.script = lambda request: [chunk(request, "Hel", completion=1),
                                      chunk(request, "", "abort", completion=1)]
    response = await client.post(CHAT, json={"messages": HELLO})
    assert_error(response, 503, None, "request_aborted", "server_error")
    assert "retry-after" in response.headers
    streamed = await client.post(CHAT, json={"messages": HELLO, "stream": True})
    events = sse_events(streamed)
    assert events[-2]["error"]["code"] == "request_aborted"
    assert not any(e["choices"][0].get("finish_reason") for e in events[:-2])


@pytest.mark.parametrize("stream", [False, True])
async def test_stream_ending_without_finish_is_an_error(client, backend, stream):
    backend.script = lambda request: [chunk(request, "Hel", completion=1)]
    response = await client.post(CHAT, json={"messages": HELLO, "stream": stream})
    if stream:
        assert sse_events(response)[-2]["error"]["code"] == "internal_error"
    else:
        assert_error(response, 500, None, "internal_error", "server_error")




# -- concurrency and disconnects ---------------------------------------------------------------


async def test_bad_request_beside_a_good_one_does_not_disturb_it(client, backend):
    gate = asyncio.Event()
    backend.script = lambda request: [chunk(request), gate, *hello_world(request)[1:]]
    good = asyncio.create_task(client.post(CHAT, json={"messages": HELLO}))
    await asyncio.wait_for(backend.waiting.wait(), 5)
    bad = await client.post(CHAT, json={"messages": HELLO, "temperature": -1})
    assert_error(bad, 400, "temperature", "invalid_value")
    gate.set()
    response = await asyncio.wait_for(good, 5)
    assert response.status_code == 200
    assert response.json()["choices"][0]["message"]["content"] == "Hello world"
    assert len(backend.requests) == 1


async def test_concurrent_requests_each_get_their_own_answer(client, backend):
    backend.script = lambda request: [chunk(request, request.request_id, "stop", completion=1)]
    responses = await asyncio.gather(*(client.post(COMPLETIONS, json={"prompt": f"p{i}"})
                                       for i in range(8)))
    for response in responses:
        body = response.json()
        assert body["choices"][0]["text"] == body["id"]


def asgi_call(app: Any, path: str, body: dict[str, Any],
              disconnect_when: Callable[[list[dict[str, Any]]], bool] = lambda sent: False,
              stall_headers: bool = False) -> tuple[Any, list[dict[str, Any]]]:
    """One call of the ASGI app as a server would make it: the coroutine to run and the list
    of messages the app sends.

    The client is reported gone (``http.disconnect``) once ``disconnect_when(sent)`` holds.
    With ``stall_headers``, sending the response start never completes (a dead connection), so
    the body is never iterated.
    """
    sent: list[dict[str, Any]] = []
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
             "http_version": "1.1", "method": "POST", "scheme": "http", "path": path,
             "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"), (b"host", b"test")],
             "client": ("127.0.0.1", 5000), "server": ("test", 80)}
    messages = iter([{"type": "http.request", "body": json.dumps(body).encode(),
                      "more_body": False}])

    async def receive() -> dict[str, Any]:
        message = next(messages, None)
        if message is not None:
            return message
        while not disconnect_when(sent):
            await asyncio.sleep(0.005)
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
        if stall_headers and message["type"] == "http.response.start":
            await asyncio.Event().wait()

    return app(scope, receive, send), sent


async def call_until_disconnect(app: Any, path: str, body: dict[str, Any],
                                disconnect_when: Callable[[list[dict[str, Any]]], bool],
                                stall_headers: bool = False) -> list[dict[str, Any]]:
    """Runs :func:`asgi_call` to its end (which must come soon after the disconnect)."""
    call, sent = asgi_call(app, path, body, disconnect_when, stall_headers)
    await asyncio.wait_for(call, 5)
    return sent


@pytest.mark.parametrize("stream", [False, True])
async def test_disconnect_while_waiting_for_the_first_chunk_closes_the_backend(backend, stream):
    backend.script = lambda request: [asyncio.Event()]  # queued forever
    app = build_openai_app(backend)
    waiting = backend.waiting
    await call_until_disconnect(app, CHAT, {"messages": HELLO, "stream": stream},
                                lambda sent: waiting.is_set())
    assert backend.closed == [backend.requests[0].request_id]


async def test_disconnect_mid_answer_closes_the_backend(backend):
    backend.script = lambda request: [chunk(request), chunk(request, "Hel", completion=1),
                                      asyncio.Event()]
    app = build_openai_app(backend)
    waiting = backend.waiting
    await call_until_disconnect(app, CHAT, {"messages": HELLO}, lambda sent: waiting.is_set())
    assert backend.closed == [backend.requests[0].request_id]


async def test_disconnect_mid_stream_closes_the_backend(backend):
    backend.script = lambda request: [chunk(request), chunk(request, "Hel", completion=1),
                                      asyncio.Event()]
    app = build_openai_app(backend)

    def got_text(sent: list[dict[str, Any]]) -> bool:
        return any(b"Hel" in message.get("body", b"") for message in sent)

    sent = await call_until_disconnect(app, CHAT, {"messages": HELLO, "stream": True}, got_text)
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    assert (WORKER_HEADER.encode(), b"worker-7") in sent[0]["headers"]
    assert backend.closed == [backend.requests[0].request_id]


async def test_disconnect_while_sending_stream_headers_closes_the_backend(backend):
    backend.script = lambda request: [chunk(request), chunk(request, "Hel", completion=1)]
    app = build_openai_app(backend)

    def headers_sent(sent: list[dict[str, Any]]) -> bool:
        return any(message["type"] == "http.response.start" for message in sent)

    await call_until_disconnect(app, CHAT, {"messages": HELLO, "stream": True}, headers_sent,
                                stall_headers=True)
    assert backend.closed == [backend.requests[0].request_id]


@pytest.mark.parametrize("stream", [False, True])
async def test_cancelled_request_task_closes_the_backend(backend, stream):
    """Ray Serve reports a disconnected client by cancelling the replica's request task."""
    backend.script = lambda request: [chunk(request), chunk(request, "Hel", completion=1),
                                      asyncio.Event()]
    call, _ = asgi_call(build_openai_app(backend), CHAT, {"messages": HELLO, "stream": stream})
    task = asyncio.ensure_future(call)
    await asyncio.wait_for(backend.waiting.wait(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 5)
    assert backend.closed == [backend.requests[0].request_id]
