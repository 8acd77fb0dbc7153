"""Asking the digest index which workers hold a prompt's leading blocks, within a time bound.

An outage costs one bounded lookup per retry period, not one per request, is logged once, and
every lookup is recorded in the routing telemetry (latency, success, and on failure why).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from contract.load import is_count
from router.routing.telemetry import RoutingTelemetry

logger = logging.getLogger(__name__)

DEFAULT_LOOKUP_DEADLINE_S = 0.5
"""Seconds one index lookup may take before routing goes on without it.

Sized by ``benchmarks/index_deadline.py``
(``benchmarks/results/epyc-avx2-fp32/index_deadline.json``) on a 2-core machine while it was
shared (1-minute load average 15-16): with the default 2 workers the router runs 4 lookups at
once (Ray Serve's ``min(50, 2 x replicas)`` routing tasks), and their p99.9 was 736 ms for
4096-token prompts (256 digests), 377 ms at 1024 tokens and 127 ms at 256 (an earlier run at
the same load: 231 ms at 4096 tokens). The former 50 ms sat well inside these tails, as a
1,000-request burst saw (18 expiries). Waiting longer than a miss costs never pays, and a miss
of a 640-token prompt cost about 0.5 s there (~1,200 prefill tokens/s): that cap decides. An
expiry costs ``index_retry_s`` (1 s) without the index, during which routing stays
prefix-aware from the router's own record of the prefixes it sent."""


INDEX_RETRY_S = 1.0
"""Seconds a router goes without the index after a failed lookup before asking it again."""


@dataclass(frozen=True)
class Lookup:
    """The index's answer for one request.

    Attributes:
        cached: worker id → leading prompt blocks it holds, or ``None`` when the index did not
            answer (routing then uses the router's own record, else load alone).
        fallback: why the answer credits nothing or is missing (a ``RoutingDecision.fallback``
            reason), else ``None``.
        tier: worker id → how many of its ``cached`` blocks it holds only in its second tier
            (absent: none).
    """

    cached: dict[str, int] | None
    fallback: str | None = None
    tier: dict[str, int] = field(default_factory=dict)


class IndexLookup:
    """One bounded ``match`` per model key among the candidates (normally exactly one).

    Args:
        index: the digest index (``router.index.DigestIndex``), or ``None`` when none could be
            built (every lookup then reports ``"no_index"``).
        telemetry: where lookups are recorded.
        timeout_s: seconds one lookup may take.
        first_timeout_s: seconds the very first lookup may take (it also connects).
        retry_s: seconds to go without the index after a failed lookup before asking again.
        clock: monotonic-enough time in seconds (the router's ``_get_curr_time_s``).
    """

    def __init__(self, index: Any | None, telemetry: RoutingTelemetry,
                 timeout_s: float = DEFAULT_LOOKUP_DEADLINE_S,
                 first_timeout_s: float = 1.0, retry_s: float = INDEX_RETRY_S,
                 clock: Callable[[], float] = time.time):
        self.index = index
        self._telemetry = telemetry
        self._timeout_s = timeout_s
        self._first_timeout_s = max(timeout_s, first_timeout_s)
        self._retry_s = retry_s
        self._clock = clock
        self._tried = False
        self._healthy = True
        self._failures = 0
        self._retry_at = 0.0
        self._background: set[asyncio.Task] = set()

    async def cached_blocks(self, digests: list[bytes],
                            groups: Mapping[str, list[str]]) -> Lookup:
        """Leading blocks of ``digests`` each worker holds; ``groups`` maps each model key to
        its workers (a worker whose key is unknown is left out, and is credited nothing).

        Never raises, except cancellation.
        """
        if not digests:
            return Lookup({})  # shorter than one block: nothing can be cached, nothing to ask
        if self.index is None:
            return Lookup(None, "no_index")
        if self._clock() < self._retry_at:
            return Lookup(None, "index_down")
        if not groups:
            return Lookup({}, "no_model_key")
        started = time.perf_counter()
        try:
            answers = await bounded(
                asyncio.gather(*(self.index.match(key, digests, ids)
                                 for key, ids in groups.items())),
                self._timeout_s if self._tried else self._first_timeout_s,
            )
            cached: dict[str, int] = {}
            tier: dict[str, int] = {}
            for worker_ids, answer in zip(groups.values(), answers, strict=True):
                held = _validated(answer, len(digests))
                for wid in worker_ids:
                    cached[wid], tier[wid] = held.get(wid, (0, 0))
        except Exception as exc:  # includes the timeout; cancellation still propagates
            self._on_failure(exc, time.perf_counter() - started)
            return Lookup(None, "index_timeout" if isinstance(exc, TimeoutError)
                          else "index_error")
        self._on_success(time.perf_counter() - started)
        return Lookup(cached, tier={wid: blocks for wid, blocks in tier.items() if blocks})

    def forget_in_background(self, model_key: str, worker_id: str) -> None:
        """Tells the index ``worker_id`` is gone, without waiting (fire and forget).

        A failure is logged; the index's worker TTL removes the entries anyway.
        """
        if self.index is None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            logger.info("No event loop to tell the index %s died; its TTL expires it.", worker_id)
            return
        task = loop.create_task(self._forget(model_key, worker_id))
        self._background.add(task)  # keep a reference until done, or the task may vanish
        task.add_done_callback(self._background.discard)

    async def _forget(self, model_key: str, worker_id: str) -> None:
        try:
            await bounded(self.index.forget(model_key, worker_id), 5.0)
        except Exception as exc:
            logger.warning(
                "Index could not forget dead worker %s (%s); its TTL expires it.", worker_id, exc
            )

    def _on_failure(self, exc: BaseException, seconds: float) -> None:
        self._tried = True  # only the very first lookup gets the longer bound
        self._failures += 1
        self._retry_at = self._clock() + self._retry_s
        self._telemetry.record_lookup(seconds, ok=False, error=f"{type(exc).__name__}: {exc}")
        if self._healthy:  # once per outage, not once per request
            self._healthy = False
            logger.warning(
                "Digest index lookup failed (%s: %s); routing on this router's own record of "
                "the prefixes it sent, weighed against load (load only where it has none), "
                "until the index answers again.",
                type(exc).__name__,
                exc,
            )

    def _on_success(self, seconds: float) -> None:
        self._tried = True
        self._telemetry.record_lookup(seconds, ok=True)
        if not self._healthy:
            logger.info(
                "Digest index answering again after %d failed lookups; "
                "prefix-aware routing resumed.",
                self._failures,
            )
            self._healthy = True
            self._failures = 0


def _validated(answer: Any, max_blocks: int) -> dict[str, tuple[int, int]]:
    """The index answer as ``{worker id: (blocks, of which only in its second tier)}``, both
    clamped to ``[0, max_blocks]`` and the second to the first; a malformed entry is left out.

    Raises:
        TypeError: the answer is not a mapping.
    """
    if not isinstance(answer, Mapping):
        raise TypeError(f"index match returned {type(answer).__name__}, not a mapping")
    valid = {}
    for wid, held in answer.items():
        if isinstance(held, tuple) and len(held) == 2 and all(map(is_count, held)):
            blocks = min(int(held[0]), max_blocks)
            valid[str(wid)] = (blocks, min(int(held[1]), blocks))
    return valid


async def bounded(awaitable: Any, timeout_s: float) -> Any:
    """Awaits ``awaitable`` for at most ``timeout_s`` seconds.

    Unlike ``asyncio.wait_for``, it does not wait for a timed-out call to finish cancelling, so
    an index call that ignores cancellation cannot stall routing.

    Raises:
        TimeoutError: no result within ``timeout_s``.
        TypeError: ``awaitable`` is not awaitable.
        Exception: whatever the call raised.
    """
    task = asyncio.ensure_future(awaitable)
    task.add_done_callback(_consume_outcome)
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout_s)
    finally:
        if not task.done():
            task.cancel()  # on timeout, and when the caller itself is cancelled
    if not done:
        raise TimeoutError(f"no answer within {timeout_s * 1000:.0f} ms")
    return task.result()


def _consume_outcome(task: asyncio.Future) -> None:
    # A call abandoned after the timeout may still fail later; retrieving its exception here
    # keeps asyncio from logging "exception was never retrieved" for every such call.
    if not task.cancelled():
        task.exception()
