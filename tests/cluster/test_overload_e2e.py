"""Overload and errors end to end, through Ray Serve and HTTP.

A scripted worker deployment behind the real ingress raises each error kind before and after
the first chunk, so each crosses Ray (as ``RayTaskError``) and the HTTP app; the same
deployment, one request at a time with a queue of one, makes Serve refuse calls with
``BackPressureError``. Then a burst far past the ingress's token bound against the session's
real cluster gets only 200s and 503s, and no KV block leaks.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
import uuid

import httpx
import pytest
import ray.cloudpickle
from ray import serve
from ray.exceptions import RayTaskError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

from cluster.app import APP_NAME, WORKER_DEPLOYMENT
from cluster.config import ClusterConfig
from cluster.ingress_deployment import NalarIngress, serve_error
from contract.description import WorkerDescription
from contract.request import GenerationChunk, InvalidRequestError
from router.errors import OverloadedError

SCRIPTED_APP = "nalar-overload-test"
SCRIPTED_ROUTE = "/overload-test"

# The scripted worker runs in a replica that cannot import this test module.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

# Error kinds the scripted worker raises, picked by the prompt's first token id:
# (error, HTTP status, OpenAI type, code, param).
KINDS = {
    1: (lambda: InvalidRequestError("the prompt is too long", "max_tokens",
                                    "context_length_exceeded"),
        400, "invalid_request_error", "context_length_exceeded", "max_tokens"),
    2: (lambda: InvalidRequestError("top_k must be positive", "top_k"),
        400, "invalid_request_error", "invalid_value", "top_k"),
    3: (lambda: OverloadedError("the engine is full", retry_after_s=2.0),
        503, "server_error", "overloaded", None),
    4: (lambda: RuntimeError("engine exploded: internal detail"),
        500, "server_error", "internal_error", None),
}
GATED = 9  # first token id of a request the scripted worker holds until its gate file exists


class ScriptedWorker:
    """Stands in for ``NalarWorker``: describes itself as the session's workers do, and plays
    a script chosen by the prompt: first token id = error kind (or ``GATED``), second token id
    = chunks sent before raising (0, or 2: the token-less first chunk and one token).
    A ``GATED`` request waits for ``gate`` to exist, so a test decides when its slot frees."""

    def __init__(self, description: WorkerDescription, gate: str):
        self.description = description
        self.gate = gate

    def describe(self) -> WorkerDescription:
        return self.description

    async def generate(self, request):
        kind, sent_first = request.token_ids[0], request.token_ids[1]
        first = GenerationChunk(request.request_id, [], "", None, len(request.token_ids), 0, 0,
                                "scripted")
        if kind == GATED:
            deadline = time.monotonic() + 60
            while not os.path.exists(self.gate) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
        if kind in KINDS and not sent_first:
            raise KINDS[kind][0]()
        yield first
        yield GenerationChunk(request.request_id, [42], "K", None, len(request.token_ids), 0, 1,
                              "scripted")
        if kind in KINDS:
            raise KINDS[kind][0]()
        yield GenerationChunk(request.request_id, [43], "!", "stop", len(request.token_ids), 0, 2,
                              "scripted")


@pytest.fixture(scope="module")
def scripted(cluster, tmp_path_factory):
    """The real ingress over one scripted worker that takes one call at a time and queues
    one more (so a third concurrent call is refused by Serve), served under
    ``SCRIPTED_ROUTE`` on the session's HTTP proxy; yields its URL and its gate file."""
    description = serve.get_deployment_handle(WORKER_DEPLOYMENT, APP_NAME).describe.remote()
    worker = serve.deployment(ScriptedWorker).options(
        name="ScriptedWorker", num_replicas=1, ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=1, max_queued_requests=1)
    ingress = serve.deployment(NalarIngress).options(
        name="ScriptedIngress", num_replicas=1, ray_actor_options={"num_cpus": 0})
    # The ingress only reads the index (for the dashboard): nothing is written under this.
    config = ClusterConfig(redis_url=cluster.config.redis_url,
                           key_prefix=f"nalar-test-{uuid.uuid4().hex[:8]}", num_workers=1,
                           worker_gpus=0)
    gate = tmp_path_factory.mktemp("scripted") / "gate"
    serve.run(ingress.bind(worker.bind(description.result(), str(gate)), config),
              name=SCRIPTED_APP, route_prefix=SCRIPTED_ROUTE)
    yield f"{cluster.base_url}{SCRIPTED_ROUTE}", gate
    serve.delete(SCRIPTED_APP)


def sse_events(text: str) -> list:
    assert text.endswith("data: [DONE]\n\n"), text
    return [json.loads(frame[len("data: "):]) for frame in text.split("\n\n")
            if frame.startswith("data: {")]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("sent_first", [0, 2])
@pytest.mark.parametrize("kind", KINDS)
async def test_each_error_kind_crosses_ray_with_its_answer(scripted, kind, sent_first, stream):
    _, status, error_type, code, param = KINDS[kind]
    body = {"prompt": [kind, sent_first, 7, 7], "max_tokens": 4, "stream": stream}
    async with httpx.AsyncClient(base_url=scripted[0], timeout=60) as client:
        response = await client.post("/v1/completions", json=body)
    if stream and sent_first:
        assert response.status_code == 200
        events = sse_events(response.text)
        assert events[0]["choices"][0]["text"] == "K"
        error = events[-1]["error"]
    else:
        assert response.status_code == status, response.text
        error = response.json()["error"]
    assert (error["type"], error["code"], error["param"]) == (error_type, code, param)
    # The worker's message, not Ray's remote traceback.
    assert "Traceback" not in error["message"] and "internal detail" not in error["message"]
    if kind in (1, 2):
        assert error["message"] == str(KINDS[kind][0]())
    if status == 503 and not (stream and sent_first):
        assert (response.headers["retry-after"], response.headers["retry-after-ms"]) == (
            "2", "2000")


async def test_serve_backpressure_is_a_503_never_a_500(scripted):
    url, gate = scripted
    body = {"prompt": [GATED, 0, 7, 7], "max_tokens": 4}
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        calls = [asyncio.ensure_future(client.post("/v1/completions", json=body))
                 for _ in range(8)]
        # While the gate is shut a call finishes only if Serve refuses it. Which calls and how
        # many is Serve's race, not ours: its router stops counting a call as queued while the
        # replica decides whether to take it, so on a busy machine several pass the queue bound
        # and retry until the gate opens (CI once saw fewer than six refused in a minute). Ours is
        # that every refusal is a well-formed 503 and every other call then completes.
        deadline = time.monotonic() + 30
        while not any(call.done() for call in calls) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        gate.touch()
        responses = await asyncio.gather(*calls)
    statuses = [response.status_code for response in responses]
    assert set(statuses) == {200, 503}, statuses
    for response in responses:
        if response.status_code == 503:
            error = response.json()["error"]
            assert (error["type"], error["code"]) == ("server_error", "overloaded")
            assert "the workers' queues are full" in error["message"]
            assert response.headers["retry-after"] == "1"
        else:
            assert response.json()["choices"][0]["text"] == "K!"


# -- a burst past the real cluster's bound -----------------------------------------------------

BURST = 300


async def held_stream(client: httpx.AsyncClient, body: dict, answered: list[int],
                      everyone: asyncio.Event) -> tuple[int, dict, bytes, float]:
    """One streaming request; a 200 keeps its stream (and its admitted work) open until every
    request of the burst has its answer, so the bound is what decides them."""
    started = time.perf_counter()
    async with client.stream("POST", "/v1/completions", json=body) as response:
        seconds = time.perf_counter() - started
        content = b"" if response.status_code == 200 else await response.aread()
        answered.append(response.status_code)
        if len(answered) == BURST:
            everyone.set()
        if response.status_code == 200:
            await everyone.wait()
    return response.status_code, dict(response.headers), content, seconds


async def blocks_in_use() -> dict[str, int]:
    handle = serve.get_deployment_handle(WORKER_DEPLOYMENT, APP_NAME)
    replies = await asyncio.gather(*(handle.engine_stats.remote() for _ in range(8)))
    return {reply["worker_id"]: reply["blocks_in_use"] for reply in replies}


async def test_a_burst_past_the_bound_gets_200s_and_503s_and_leaks_nothing(cluster):
    description = await serve.get_deployment_handle(WORKER_DEPLOYMENT, APP_NAME).describe.remote()
    prompt = [1, 2, 3, 4]
    max_tokens, choices = description.max_model_len - len(prompt), 4
    work = len(prompt) + max_tokens * choices  # tokens of work of each request
    fits = cluster.config.max_pending_tokens() // work
    assert 1 <= fits < BURST // 4  # the burst is far past the bound
    body = {"prompt": prompt, "max_tokens": max_tokens, "n": choices, "ignore_eos": True,
            "stream": True}
    answered: list[int] = []
    everyone = asyncio.Event()
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=cluster.base_url, timeout=120,
                                 limits=limits) as client:
        results = await asyncio.gather(*(held_stream(client, body, answered, everyone)
                                         for _ in range(BURST)))
    statuses = [status for status, _, _, _ in results]
    assert set(statuses) <= {200, 503}, statuses
    # Admitted streams give back only the tokens they have generated so far (a few).
    assert fits <= statuses.count(200) <= fits + 2, (fits, statuses.count(200))
    for status, headers, content, _ in results:
        if status == 503:
            assert b'"code":"overloaded"' in content
            assert (headers["retry-after"], headers["retry-after-ms"]) == ("1", "1000")
    deadline = time.monotonic() + 60
    while any((in_use := await blocks_in_use()).values()) and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    assert set(in_use.values()) == {0}, in_use


# -- Ray's wrapping, without a cluster ---------------------------------------------------------


def ray_task_error(cause: Exception) -> Exception:
    """What a worker's exception looks like at the ingress: a RayTaskError that is also an
    instance of the cause's class, whose message is the remote traceback."""
    return RayTaskError("generate", "Traceback (most recent call last): ...",
                        cause).as_instanceof_cause()


def test_a_workers_refusal_is_answered_with_its_own_message():
    error = serve_error(ray_task_error(InvalidRequestError("too long", "max_tokens",
                                                           "context_length_exceeded")))
    assert type(error) is InvalidRequestError
    assert (str(error), error.param, error.code) == ("too long", "max_tokens",
                                                     "context_length_exceeded")


def test_serve_refusals_become_overloaded_errors():
    error = serve_error(BackPressureError(num_queued_requests=3, max_queued_requests=2,
                                          status_code=429, retry_after_s=5.0))
    assert isinstance(error, OverloadedError)
    assert (error.status_code, error.retry_after_s) == (429, 5.0)
    assert str(error) == "the server is overloaded (the workers' queues are full); retry later"
    assert serve_error(BackPressureError(3, 2)).retry_after_s == 1.0
    assert isinstance(serve_error(DeploymentUnavailableError("w")), OverloadedError)


def test_an_unknown_worker_failure_keeps_its_remote_traceback():
    wrapped = ray_task_error(RuntimeError("engine died"))
    assert serve_error(wrapped) is wrapped
