"""Load shedding and draining at the ingress: who gets in, and how the in-flight work ends.

The ingress counts its own admitted, unfinished work in tokens, in the routing load unit
(:mod:`router.routing.request_input`): prompt tokens not yet prefilled plus every output token
a request may still produce (``max_tokens × n``). A request whose work would take that count
past the bound is refused at once with 503 and ``Retry-After``, before it reaches any queue
and before it is tokenized: the decision is taken on the work its body asks for
(:func:`requested_work`), so a burst is refused without queueing for the tokenizer. Once
tokenized, a request counts its exact work; the bound may then be passed by the text prompts
of the requests admitted in that same instant, never by more.

A second bound is on requests: what the workers' queues can hold (Serve's ``max_ongoing_requests``
per replica plus the handle's ``max_queued_requests``). Past it, Serve itself refuses a request
with its backpressure error, but only once the request reaches the handle, after it was
templated and tokenized: short prompts fill Serve's queues long before the token bound (in a
burst of 900 short chat requests against the default 2 workers, 387 were tokenized only to be
refused there). Refused here, a request the queues cannot hold is never tokenized. Serve may
still refuse first where its router holds requests in the handle's queue.

A third, optional bound is on time (``max_queue_delay_s``): a token count means nothing to a
client until it is divided by how fast the cluster gets through it, and on a slow cluster a
token bound that fits the fast one lets the queue grow to minutes, where clients time out
instead of being told to retry. So the ingress also measures its drain rate
(:class:`DrainRate`: tokens of admitted work done per second of busy time) and refuses a
request while the work ahead of it would take longer than the bound to drain at that rate.
Until the rate has been observed (a cold start), only the token bound applies.

Why the ingress's own count and not the workers' routing stats: the count is exact and
current at the instant of the decision, while the workers' ``queued_tokens`` arrive every
routing-stats period (0.5 s by default), so a burst (the case shedding exists for) would be
judged on a picture from before it began; nor do those stats see requests still waiting in the
handle's queue for a replica. The deployment runs one ingress replica, so its count is the
cluster's HTTP work.

Why 503 and not 429: OpenAI answers 429 when *a client* exceeds its rate limit or quota and
503 when the service is overloaded; vLLM's servers and Ray Serve's backpressure also use 503
for a full server. Here nobody exceeded a quota: the cluster is full for everyone. The OpenAI
clients retry both, honouring ``retry-after-ms`` (sent alongside ``Retry-After``).

A drain (a clean stop) refuses new requests with 503 ``shutting_down``, lets the admitted ones
finish, and after its deadline ends each one still running with an error (an SSE error event
for a stream), closing its backend stream so the worker frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import anyio

from contract.load import work_tokens
from contract.request import GenerationChunk, GenerationRequest
from router.api.disconnect import close_stream
from router.errors import APIError, OverloadedError, retry_after_headers
from router.protocol import ChatCompletionRequest, CompletionRequest

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 1.0
"""What a refused client is told to wait, in seconds: about the time a few short requests
take to leave a busy cluster."""

CUT_GRACE_S = 5.0
"""After a drain's deadline, how long the cut requests get to send their error and close."""


def request_work(request: GenerationRequest) -> int:
    """Tokens of work ``request`` brings (:func:`contract.load.work_tokens`): its prompt plus
    ``max_tokens`` for each of its ``n`` choices."""
    return work_tokens(len(request.token_ids), request.sampling.max_tokens, request.sampling.n)


def requested_work(body: ChatCompletionRequest | CompletionRequest, max_model_len: int) -> int:
    """The work a request body asks for, read before tokenizing, in tokens
    (:func:`contract.load.work_tokens`): its output limit (``max_completion_tokens`` or
    ``max_tokens``; at most the context length, which is also the limit when none is set) for
    each of its ``n`` choices, plus the prompt when it is token ids. A text prompt's tokens are
    not known yet; they are counted once it is tokenized (:meth:`AdmittedStream.start`)."""
    limit = getattr(body, "max_completion_tokens", None)
    if limit is None:
        limit = body.max_tokens
    prompt = getattr(body, "prompt", None)
    # Capped at the context: a larger limit is refused with a 400 once tokenized, not a 503.
    return work_tokens(len(prompt) if isinstance(prompt, list) else 0,
                       min(max_model_len, limit or max_model_len), body.n or 1)


def shutting_down() -> APIError:
    """The 503 of a server that is draining: retry elsewhere or once it is back."""
    return APIError(503, "the server is shutting down; retry later", code="shutting_down",
                    headers=retry_after_headers(RETRY_AFTER_S))


@dataclass(frozen=True)
class DrainReport:
    """How a drain ended.

    Attributes:
        finished: requests in flight when the drain began that ended on their own.
        cut: requests still running at the deadline, ended with a ``shutting_down`` error.
        left: requests that had not closed even ``CUT_GRACE_S`` after being cut (0 normally).
    """

    finished: int
    cut: int
    left: int


class DrainRate:
    """How fast admitted work is done, in tokens per second of *busy* time (seconds while any
    request is in flight), over the last ``window_s`` busy seconds.

    Idle time is left out, so a burst after a quiet spell is judged on the rate the cluster
    reaches when it has work, not diluted by the quiet. Work counts when it is done: the
    prompt with the first output token, output tokens as their chunks arrive, and the rest of
    a request's output limit when it finishes early (that work left the queue too); a
    cancelled request's remainder is not evidence of speed and does not count.

    Args:
        window_s: busy seconds the rate is averaged over.
        min_observed_s: busy seconds of observation before a rate is given.
        clock: monotonic seconds (injectable for tests).
    """

    def __init__(self, window_s: float = 30.0, min_observed_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic):
        self.window_s = window_s
        self.min_observed_s = min_observed_s
        self._clock = clock
        self._busy_before = 0.0
        self._busy_since: float | None = None
        self._done: deque[tuple[float, int]] = deque()
        self._done_in_window = 0

    def busy_seconds(self) -> float:
        """Busy seconds observed so far."""
        running = 0.0 if self._busy_since is None else self._clock() - self._busy_since
        return self._busy_before + running

    def set_busy(self, busy: bool) -> None:
        """Marks the start (``True``) or end of a busy spell."""
        if busy and self._busy_since is None:
            self._busy_since = self._clock()
        elif not busy and self._busy_since is not None:
            self._busy_before = self.busy_seconds()
            self._busy_since = None

    def record(self, tokens: int) -> None:
        """``tokens`` of admitted work done now."""
        if tokens > 0:
            self._done.append((self.busy_seconds(), tokens))
            self._done_in_window += tokens

    def tokens_per_s(self) -> float | None:
        """The rate over the window, or ``None`` before ``min_observed_s`` busy seconds or
        before any work was done."""
        now = self.busy_seconds()
        while self._done and self._done[0][0] < now - self.window_s:
            self._done_in_window -= self._done.popleft()[1]
        if now < self.min_observed_s or self._done_in_window == 0:
            return None
        return self._done_in_window / min(now, self.window_s)


class Admission:
    """Admits requests while their work fits under a token bound and their number under a
    request bound and, optionally, drains within a time bound at the measured rate; drains on
    a clean stop.

    Args:
        max_pending_tokens: the bound on admitted, unfinished work in tokens, or ``None`` for
            no bound. A request larger than the bound on its own is still admitted when
            nothing else is in flight (it could never run otherwise; the engine refuses what
            exceeds the context).
        max_queue_delay_s: the bound on the seconds the admitted work would take at the
            measured :class:`DrainRate`, or ``None`` for none.
        drain_rate: the rate estimator (a default one when omitted).
        max_requests: the bound on admitted, unclosed worker requests (each prompt of a batch
            is one), or ``None`` for none.
    """

    def __init__(self, max_pending_tokens: int | None = None,
                 max_queue_delay_s: float | None = None, drain_rate: DrainRate | None = None,
                 max_requests: int | None = None):
        self.max_pending_tokens = max_pending_tokens
        self.max_requests = max_requests
        self.max_queue_delay_s = max_queue_delay_s
        self.drain_rate = drain_rate or DrainRate()
        self.pending_tokens = 0
        self.draining = False
        self._last_chunk_at: float | None = None
        self._streams: set[AdmittedStream] = set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._cut = False

    @property
    def in_flight(self) -> int:
        """Requests admitted and not yet closed."""
        return len(self._streams)

    def chunk_arrived(self) -> None:
        """A worker's chunk reached an admitted request now."""
        self._last_chunk_at = time.monotonic()

    def answered_within(self, seconds: float) -> bool:
        """Whether a worker's chunk reached an admitted request in the last ``seconds``: the
        workers are serving."""
        return (self._last_chunk_at is not None
                and time.monotonic() - self._last_chunk_at <= seconds)

    def admit(self, tokens: int) -> AdmittedStream:
        """Admits a request asking for ``tokens`` of work (:func:`requested_work`) if it fits,
        counting that work until the returned stream is closed; the caller must close it
        (:func:`router.api.disconnect.close_stream`), started or not.

        Raises:
            APIError: 503 ``shutting_down`` while draining.
            OverloadedError: the work or the request does not fit under a bound (503).
        """
        if self.draining:
            raise shutting_down()
        if self.in_flight > 0:
            self._check_requests()
            self._check_tokens(tokens)
            self._check_delay()
        stream = AdmittedStream(self, tokens)
        self._streams.add(stream)
        self.pending_tokens += tokens
        self._idle.clear()
        self.drain_rate.set_busy(True)
        return stream

    def _check_requests(self) -> None:
        if self.max_requests is not None and self.in_flight >= self.max_requests:
            raise OverloadedError(
                f"the server is overloaded ({self.in_flight} requests in flight, bound "
                f"{self.max_requests}); retry later", retry_after_s=RETRY_AFTER_S)

    def _check_tokens(self, tokens: int) -> None:
        if (self.max_pending_tokens is not None
                and self.pending_tokens + tokens > self.max_pending_tokens):
            raise OverloadedError(
                f"the server is overloaded ({self.pending_tokens} tokens of work in flight, "
                f"bound {self.max_pending_tokens}); retry later", retry_after_s=RETRY_AFTER_S)

    def _check_delay(self) -> None:
        rate = self.drain_rate.tokens_per_s()
        if self.max_queue_delay_s is None or rate is None:
            return
        delay_s = self.pending_tokens / rate
        if delay_s > self.max_queue_delay_s:
            # Retry once the work over the bound should have drained.
            wait_s = max(RETRY_AFTER_S, math.ceil(delay_s - self.max_queue_delay_s))
            raise OverloadedError(
                f"the server is overloaded (the work in flight takes about {delay_s:.0f} s at "
                f"{rate:.0f} tokens/s, bound {self.max_queue_delay_s:g} s); retry later",
                retry_after_s=wait_s)

    def give_back(self, tokens: int, done: bool = False) -> None:
        """Work of an admitted request that is ``done``, or will not be done, in tokens;
        negative for work found to be larger than requested."""
        self.pending_tokens -= tokens
        if done:
            self.drain_rate.record(tokens)

    def release(self, stream: AdmittedStream) -> None:
        """Forgets a closed stream (its work was given back)."""
        self._streams.discard(stream)
        if not self._streams:
            self._idle.set()
            self.drain_rate.set_busy(False)

    @property
    def cut(self) -> bool:
        """Whether a drain's deadline has passed: running requests end with an error."""
        return self._cut

    async def drain(self, timeout_s: float) -> DrainReport:
        """Refuses new requests from now on, waits up to ``timeout_s`` seconds for the admitted
        ones to end, then cuts the rest (each ends with a ``shutting_down`` error) and waits up
        to ``CUT_GRACE_S`` for them to close."""
        self.draining = True
        running = self.in_flight
        logger.info("draining: %d requests in flight, deadline %.1f s", running, timeout_s)
        if await self._wait_idle(timeout_s):
            return DrainReport(finished=running, cut=0, left=0)
        self._cut = True
        cut = list(self._streams)
        for stream in cut:
            stream.cut()
        left = 0 if await self._wait_idle(CUT_GRACE_S) else self.in_flight
        logger.warning("drain deadline passed: %d requests cut, %d not closed", len(cut), left)
        return DrainReport(finished=running - len(cut), cut=len(cut), left=left)

    async def _wait_idle(self, timeout_s: float) -> bool:
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True


class AdmittedStream:
    """The backend's chunk stream of one admitted request, once :meth:`start` ed.

    Counts the work the request asked for until it is started, then its exact work, given back
    as it is done (the prompt with the first token, then each output token) and the rest when
    closed. Once a drain's deadline passes, it ends with a ``shutting_down`` error instead of
    the next chunk. Errors of the backend pass through unchanged.
    """

    def __init__(self, admission: Admission, tokens: int):
        self._admission = admission
        self._chunks: AsyncIterator[GenerationChunk] | None = None
        self._remaining = tokens
        self._prompt_tokens = 0
        self._waiting: anyio.CancelScope | None = None
        self._closed = False
        self._finished = False

    def start(self, request: GenerationRequest,
              generate: Callable[[GenerationRequest], AsyncIterator[GenerationChunk]]) -> None:
        """Counts ``request``'s exact work from now on and starts ``generate(request)``.

        Raises:
            APIError: 503 ``shutting_down`` when a drain's deadline has passed meanwhile.
        """
        if self._admission.cut:
            raise shutting_down()
        exact = request_work(request)
        self._admission.give_back(self._remaining - exact)
        self._remaining = exact
        self._prompt_tokens = len(request.token_ids)
        self._chunks = generate(request)

    def __aiter__(self) -> AdmittedStream:
        return self

    async def __anext__(self) -> GenerationChunk:
        if self._chunks is None:
            raise RuntimeError("an admitted stream was read before it was started")
        if self._admission.cut:
            raise shutting_down()
        # ``cut()`` cancels this scope, which interrupts a wait already under way (for the next
        # token, or in a worker's queue); the backend's generator sees the cancellation and
        # cancels the worker's request.
        try:
            with anyio.CancelScope() as self._waiting:
                chunk = await anext(self._chunks)
        finally:
            self._waiting = None
        if self._admission.cut:  # the scope was cancelled, or the cut came with the chunk
            raise shutting_down()
        self._admission.chunk_arrived()
        # The worker's first chunk only says it accepted the request: the prompt is done
        # with the first token (or the end), which may come long after, from its queue.
        if chunk.token_ids or chunk.is_last:
            self._spend(self._prompt_tokens + len(chunk.token_ids), done=True)
            self._prompt_tokens = 0
        self._finished = self._finished or chunk.is_last
        return chunk

    def _spend(self, tokens: int, done: bool) -> None:
        tokens = min(tokens, self._remaining)
        self._remaining -= tokens
        self._admission.give_back(tokens, done)

    def cut(self) -> None:
        """Ends the wait for the next chunk now (a drain's deadline passed)."""
        if self._waiting is not None:
            self._waiting.cancel()

    async def aclose(self) -> None:
        """Gives the request's remaining work back and closes the backend's stream (which
        tells the worker to stop and free the request's blocks). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._spend(self._remaining, done=self._finished)
        self._admission.release(self)
        if self._chunks is not None:
            await close_stream(self._chunks)
