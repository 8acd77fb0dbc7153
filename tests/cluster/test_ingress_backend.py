"""The ingress's backend over a worker handle, with a fake handle: overload becomes
OverloadedError (503 + Retry-After at the API), an early close cancels the worker call, and a
worker lost before the first chunk means the request is sent again; readiness is Serve's
controller's count of running worker replicas."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from ray import serve
from ray.exceptions import ActorDiedError, ActorUnavailableError
from ray.serve.exceptions import BackPressureError

from cluster.dashboard import Dashboard
from cluster.ingress_deployment import RESENDS_ON_WORKER_LOSS, NalarIngress
from cluster.metrics import WorkerScrape
from contract.request import GenerationChunk, GenerationRequest
from router.errors import APIError, OverloadedError
from router.routing.finished_requests import FINISHED_REQUESTS


class FakeStream:
    """What ``handle.options(stream=True).generate.remote()`` returns."""

    def __init__(self, chunks: list[GenerationChunk], error: Exception | None = None):
        self._chunks = list(chunks)
        self._error = error
        self.cancelled = False
        self.read = False

    def __aiter__(self):
        return self

    async def __anext__(self) -> GenerationChunk:
        self.read = True
        if self._error is not None:
            raise self._error
        if not self._chunks:
            raise StopAsyncIteration
        return self._chunks.pop(0)

    def cancel(self) -> None:
        # Ray's DeploymentResponseGenerator.cancel() fetches the call's result first, so a call
        # that failed (e.g. refused for backpressure) raises its error again here.
        self.cancelled = True
        if self._error is not None:
            raise self._error


def ingress_over(*streams: FakeStream) -> SimpleNamespace:
    """An ingress whose worker calls return ``streams`` in turn."""
    calls = iter(streams)
    method = SimpleNamespace(remote=lambda request: next(calls))

    def options(**opts):  # streamed over Serve's gRPC channel, not one Ray object a chunk
        assert opts == {"stream": True, "_by_reference": False}
        return SimpleNamespace(generate=method)

    handle = SimpleNamespace(options=options)

    async def current(request):  # the workers' identity never changes here
        return request

    return SimpleNamespace(workers=handle, dashboard=Dashboard(WorkerScrape, "m"),
                           worker_identity=SimpleNamespace(current=current))


def chunk(finish: str | None = None) -> GenerationChunk:
    return GenerationChunk("r", [5], "x", finish, 3, 0, 1, "w1")


async def test_full_worker_queues_become_overloaded_error():
    stream = FakeStream([], BackPressureError(num_queued_requests=9, max_queued_requests=8))
    with pytest.raises(OverloadedError):
        async for _ in NalarIngress.generate(ingress_over(stream), GenerationRequest("r", [1])):
            pass


async def test_closing_early_cancels_the_worker_call():
    stream = FakeStream([chunk(), chunk(), chunk("length")])
    generator = NalarIngress.generate(ingress_over(stream), GenerationRequest("r", [1]))
    assert (await generator.__anext__()).token_ids == [5]
    await generator.aclose()
    assert stream.cancelled


async def test_a_finished_stream_is_not_cancelled():
    stream = FakeStream([chunk(), chunk("stop")])
    got = [c async for c in NalarIngress.generate(ingress_over(stream),
                                                  GenerationRequest("r", [1]))]
    assert [c.finish_reason for c in got] == [None, "stop"]
    assert not stream.cancelled


class Listener:
    """A router's side of ``FINISHED_REQUESTS``."""

    def __init__(self):
        self.told: list[str] = []

    def request_finished(self, request_id: str) -> None:
        self.told.append(request_id)


async def test_routers_hear_of_the_last_chunk_before_the_client_gets_it():
    listener = Listener()
    FINISHED_REQUESTS.listen(listener)
    stream = FakeStream([chunk(), chunk("stop")])
    told = [list(listener.told) async for _ in NalarIngress.generate(
        ingress_over(stream), GenerationRequest("r-7", [1]))]
    assert told == [[], ["r-7"]]


class LostMidStream(FakeStream):
    """A worker that streams ``chunks`` and then is lost."""

    async def __anext__(self) -> GenerationChunk:
        if not self._chunks:
            raise ActorDiedError()
        return self._chunks.pop(0)


async def collect(ingress: SimpleNamespace) -> list[GenerationChunk]:
    return [c async for c in NalarIngress.generate(ingress, GenerationRequest("r", [1]))]


@pytest.mark.parametrize("lost", [ActorDiedError(), ActorUnavailableError("node gone", None)])
async def test_a_worker_lost_before_the_first_chunk_means_the_request_is_sent_again(lost):
    dead, alive = FakeStream([], lost), FakeStream([chunk(), chunk("stop")])
    got = await collect(ingress_over(dead, alive))
    assert [c.finish_reason for c in got] == [None, "stop"]
    assert dead.cancelled and not alive.cancelled  # an unreachable worker may still run it


async def test_a_worker_lost_after_its_first_chunk_ends_the_stream_with_a_retryable_error():
    """Tokens already sent cannot be taken back, so the request is not sent again here; the
    client is told to send it again: 503 ``worker_lost`` with Retry-After (an SSE error event
    with that body when streaming)."""
    lost, unused = LostMidStream([chunk()]), FakeStream([chunk("stop")])
    generator = NalarIngress.generate(ingress_over(lost, unused), GenerationRequest("r", [1]))
    assert (await generator.__anext__()).token_ids == [5]
    with pytest.raises(APIError) as raised:
        await generator.__anext__()
    error = raised.value
    assert (error.status_code, error.code, error.type) == (503, "worker_lost", "server_error")
    assert error.headers["Retry-After"] == "1" and "send the request again" in error.message
    assert isinstance(error.__cause__, ActorDiedError)
    assert not unused.read


async def test_resends_are_bounded_and_a_refusal_is_never_resent():
    dead = [FakeStream([], ActorDiedError()) for _ in range(RESENDS_ON_WORKER_LOSS + 2)]
    with pytest.raises(ActorDiedError):
        await collect(ingress_over(*dead))
    assert [s.read for s in dead] == [True] * (RESENDS_ON_WORKER_LOSS + 1) + [False]
    refused = FakeStream([], BackPressureError(num_queued_requests=9, max_queued_requests=8))
    spare = FakeStream([chunk("stop")])
    with pytest.raises(OverloadedError):
        await collect(ingress_over(refused, spare))
    assert not spare.read


def serve_status(replica_states: dict[str, int] | None) -> SimpleNamespace:
    """What ``serve.status()`` reports: the app ``nalar`` with its worker deployment in
    ``replica_states`` (None: no such application)."""
    deployments = {"NalarWorker": SimpleNamespace(replica_states=replica_states)}
    apps = {} if replica_states is None else {"nalar": SimpleNamespace(deployments=deployments)}
    return SimpleNamespace(applications=apps)


@pytest.mark.parametrize(("status", "ready"), [
    (serve_status({"RUNNING": 1, "STARTING": 1}), True),  # a replacement beside a live one
    (serve_status({"STARTING": 2}), False),
    (serve_status({}), False),
    (serve_status(None), False),
    (RuntimeError("controller unreachable"), False),
])
async def test_readiness_is_a_running_worker_replica_by_serves_controller(monkeypatch, status,
                                                                          ready):
    """Asked of Serve's controller, never of a worker (whose call would wait in its request
    queue behind the generations)."""
    def report():
        if isinstance(status, Exception):
            raise status
        return status

    monkeypatch.setattr(serve, "status", report)
    ingress = SimpleNamespace(workers=SimpleNamespace(app_name="nalar",
                                                      deployment_name="NalarWorker"))
    assert await NalarIngress.is_ready(ingress) is ready
