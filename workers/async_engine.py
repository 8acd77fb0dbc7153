"""Streams an :class:`~workers.engine.LLMEngine` to asyncio callers.

The engine's step loop runs in its own thread (torch and our native kernels release the GIL
while they compute), so the replica's event loop stays free to accept requests, stream tokens
and answer routing-stats calls while a forward pass runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from contract.kv_events import KVEvent
from contract.request import GenerationChunk, GenerationRequest, InvalidRequestError
from workers.engine import LLMEngine, StepFailedError
from workers.heap_trim import HeapTrimmer

log = logging.getLogger(__name__)


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    arrived_at: float  # time.monotonic() when the request reached this front door


class EngineDeadError(RuntimeError):
    """The engine loop has stopped (shut down, or died of an error): nothing more is served."""


MAX_CONSECUTIVE_LOOP_FAILURES = 3
"""Loop iterations in a row that may fail outside a step before the loop gives up and the
engine is declared dead (Serve's health check then replaces the replica)."""


class AsyncEngine:
    """Runs the engine loop in a background thread.

    Fault handling: a failed step (:class:`~workers.engine.StepFailedError`) fails only the
    streams of the requests it names (its whole batch's, or one row's); everyone else keeps
    going. Any other error inside the loop (taking in requests, publishing events, delivering
    chunks) leaves the engine's state in doubt, so every current stream is failed and the loop
    carries on with new requests. If the loop cannot carry on
    (:data:`MAX_CONSECUTIVE_LOOP_FAILURES` in a row, or an error while failing streams), the
    engine is dead: pending and later requests get :class:`EngineDeadError` at once (never a
    hang) and :meth:`check_health` raises.

    Args:
        engine: the engine to drive; only this class's thread touches it after construction.
        on_events: called from the engine thread with each step's KV events (must not block).
        heap_trimmer: returns the C heap's free pages between steps (default: every
            :data:`~workers.heap_trim.TRIM_INTERVAL_S` seconds).
    """

    def __init__(self, engine: LLMEngine,
                 on_events: Callable[[list[KVEvent]], None] | None = None,
                 heap_trimmer: HeapTrimmer | None = None):
        self.engine = engine
        self._on_events = on_events
        self.heap_trimmer = heap_trimmer or HeapTrimmer()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._stopped = threading.Event()
        self._dead: EngineDeadError | None = None
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    def submit(self, request: GenerationRequest) -> EngineStream:
        """Validate a request at the engine's door and queue it; returns its stream.

        Raises:
            InvalidRequestError: the request is invalid (nothing is queued).
            EngineDeadError: the engine loop is not running.
        """
        self.check_health()
        self.engine.validate(request)  # reads only immutable limits: safe off-thread
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue(), time.monotonic())
        self._inbox.put(("add", request, stream))
        # The loop fails what it finds in the inbox when it dies; this covers an "add" that
        # arrived after that last drain.
        self.check_health()
        return EngineStream(stream, lambda: self._inbox.put(("abort", request.request_id, None)))

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        """Yield the request's chunks until it finishes; closing the iterator aborts it.

        Raises:
            InvalidRequestError: before the first chunk, if the request is invalid.
            RuntimeError: if the engine failed while serving it (a failed step:
                ``StepFailedError``'s message), or :class:`EngineDeadError` if the engine loop
                is not running.
        """
        chunks = self.submit(request)
        try:
            async for chunk in chunks:
                yield chunk
        finally:
            chunks.close()

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Runs ``fn(*args)`` on the engine's thread between two steps (the engine is not
        thread-safe) and returns its result; KV events it causes are published.

        Raises:
            whatever ``fn`` raises; :class:`EngineDeadError` if the loop is not running.
        """
        self.check_health()
        future = asyncio.get_running_loop().create_future()
        self._inbox.put(("call", (fn, args), future))
        return await future

    def check_health(self) -> None:
        """Raises :class:`EngineDeadError` unless the engine loop is running."""
        if self._dead is not None:
            raise self._dead
        if self._stopped.is_set() or not self._thread.is_alive():
            raise EngineDeadError("the engine is shut down")

    def shutdown(self) -> None:
        """Stop the loop thread (pending requests get an error)."""
        self._stopped.set()
        self._inbox.put(("stop", None, None))
        self._thread.join(timeout=10)

    def _run(self) -> None:
        failures = 0
        try:
            while not self._stopped.is_set():
                try:
                    self._iterate()
                    failures = 0
                except Exception as exc:  # outside a step: the engine's state is in doubt
                    failures += 1
                    log.exception("engine loop iteration failed (%d in a row)", failures)
                    if failures >= MAX_CONSECUTIVE_LOOP_FAILURES:
                        raise
                    self._fail_all(exc)
        except BaseException as exc:
            log.exception("engine loop died")
            self._die(EngineDeadError(f"the engine loop died: {type(exc).__name__}: {exc}"))
            return
        self._die(EngineDeadError("the engine is shut down"))

    def _iterate(self) -> None:
        """One turn of the loop: take in commands, run a step, publish, deliver."""
        self._drain_inbox(block=not self.engine.has_work())
        if not self.engine.has_work():
            return
        failure = None
        try:
            chunks = self.engine.step()
        except StepFailedError as exc:  # only the requests it names fail; others go on
            _log_failure(exc)
            chunks, failure = exc.chunks, exc
        # Events are queued for publishing before the chunks are delivered, so a flush
        # requested after a request finished covers its blocks.
        self._publish(self.engine.drain_events())
        if failure is not None:
            self._fail(failure.request_ids, failure)
        for chunk in chunks:
            self._deliver(chunk)
        self.heap_trimmer.maybe_trim()

    def _die(self, error: EngineDeadError) -> None:
        """Mark the engine dead, then fail every stream and every queued request."""
        self._dead = error
        self._stopped.set()
        try:
            self._fail_all(error)
        except Exception:  # still drain the inbox below: no request may hang
            log.exception("failing the streams of a dead engine failed")
        while True:
            try:
                kind, _, stream = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                _send(stream, error)
            elif kind == "call":
                _settle(stream, error=error)

    def _drain_inbox(self, block: bool) -> None:
        try:
            command = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
            while True:
                self._apply(*command)
                command = self._inbox.get_nowait()
        except queue.Empty:
            return

    def _apply(self, kind: str, payload, stream: _Stream | None) -> None:
        if kind == "add":
            try:
                # Stamped before the inbox: time waiting there for a step to end is queue time.
                self.engine.admit(payload, arrived_at=stream.arrived_at)
                self._streams[payload.request_id] = stream
            except Exception as exc:
                _send(stream, exc)
        elif kind == "abort":
            self.engine.abort(payload)
            self._streams.pop(payload, None)
            self._publish(self.engine.drain_events())
        elif kind == "call":
            fn, args = payload
            try:
                _settle(stream, result=fn(*args))
            except Exception as exc:
                _settle(stream, error=exc)
            self._publish(self.engine.drain_events())

    def _deliver(self, chunk: GenerationChunk) -> None:
        stream = self._streams.get(chunk.request_id)
        if stream is None:
            return
        if chunk.is_last:
            del self._streams[chunk.request_id]
        _send(stream, chunk)

    def _fail(self, request_ids: list[str], exc: StepFailedError) -> None:
        """Fail these requests' streams (the engine has already aborted them): each with its
        own fault where that was its cause (an ``InvalidRequestError``: its constraint
        reached a dead end), else as the engine's."""
        for request_id in request_ids:
            stream = self._streams.pop(request_id, None)
            if stream is None:
                continue
            cause = exc.cause_of(request_id)
            _send(stream, cause if isinstance(cause, InvalidRequestError)
                  else RuntimeError(f"engine failed: {exc}"))

    def _fail_all(self, exc: BaseException) -> None:
        """Abort every request the engine holds and fail its stream."""
        for request_id, stream in list(self._streams.items()):
            try:
                self.engine.abort(request_id)
            except Exception:  # fail the stream anyway; its blocks may leak, the loop lives
                log.exception("aborting %s failed", request_id)
            error = exc if isinstance(exc, EngineDeadError) else RuntimeError(
                f"engine failed: {exc}")
            _send(stream, error)
        self._streams.clear()

    def _publish(self, events: list[KVEvent]) -> None:
        if events and self._on_events is not None:
            try:
                self._on_events(events)
            except Exception:
                log.exception("publishing KV events failed")


class EngineStream:
    """One request's chunks as the engine loop delivers them (an async iterator).

    Closing it (:meth:`close`) before its last chunk aborts the request, whether or not it
    was ever iterated.

    Args:
        stream: where the engine loop delivers the request's chunks and errors.
        abort: asks the engine loop to abort the request.
    """

    def __init__(self, stream: _Stream, abort: Callable[[], None]):
        self._stream = stream
        self._abort = abort
        self._backlog: deque[GenerationChunk | BaseException] = deque()
        self._finished = False

    def __aiter__(self) -> EngineStream:
        return self

    async def __anext__(self) -> GenerationChunk:
        """The next chunk, with the chunks of its choice already waiting behind it merged in.

        Raises:
            StopAsyncIteration: after the last chunk.
            Exception: the request was refused or failed (nothing of it runs any more).
        """
        if self._finished:
            raise StopAsyncIteration
        queue = self._stream.queue
        item = self._backlog.popleft() if self._backlog else await queue.get()
        if isinstance(item, BaseException):
            # Refused or failed: nothing of this request runs in the engine, so never
            # abort its id (another request may hold it: a refused duplicate id).
            self._finished = True
            raise item
        item = _coalesce(item, queue, self._backlog)
        self._finished = item.is_last
        return item

    def close(self) -> None:
        """Abort the request unless its stream has ended."""
        if not self._finished:
            self._finished = True
            self._abort()


def _log_failure(exc: StepFailedError) -> None:
    """A failed step with its traceback, unless every request it aborted failed for a fault
    of its own (a constraint's dead end): a client's error, logged as refusals are."""
    causes = [exc.cause_of(request_id) for request_id in exc.request_ids]
    if causes and all(isinstance(cause, InvalidRequestError) for cause in causes):
        for request_id, cause in zip(exc.request_ids, causes, strict=True):
            log.info("request %s refused mid-output: %s", request_id, cause)
    else:
        log.exception("engine step failed")


def _coalesce(chunk: GenerationChunk, inbox: asyncio.Queue,
              backlog: deque[GenerationChunk | BaseException]) -> GenerationChunk:
    """``chunk`` merged with the chunks of the same choice already waiting behind it.

    When the consumer (Serve's streaming, the HTTP client) falls behind the engine, tokens
    queue up; sending them as one message instead of one per token cuts the per-message cost
    exactly when it hurts, and costs nothing when the consumer keeps up. Whatever cannot be
    merged (another choice, an error) is kept, in order, in ``backlog``.
    """
    while not backlog and not inbox.empty():
        following = inbox.get_nowait()
        if (isinstance(following, BaseException) or following.index != chunk.index
                or chunk.finish_reason is not None):
            backlog.append(following)
        else:
            chunk = chunk.followed_by(following)
    return chunk


def _settle(future: asyncio.Future, result: Any = None,
            error: BaseException | None = None) -> None:
    """Resolves an awaiting :meth:`AsyncEngine.call` from the engine thread (unless its caller
    gave up on it)."""
    def settle() -> None:
        if future.done():
            return
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)
    future.get_loop().call_soon_threadsafe(settle)


def _send(stream: _Stream, item) -> None:
    """Hand a chunk or an error to a stream's event loop (thread-safe; a closed loop's
    client is gone, so there is nobody left to tell)."""
    with contextlib.suppress(RuntimeError):
        stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
