"""A proposer on draft replicas (``cluster.draft_deployment.DraftProposer``), seen by the engine
as any other :class:`~workers.speculative.proposer.Proposer`.

The draft/target protocol (DESIGN §Speculation): token ids only on the wire; one batched call
per engine step for every speculating sequence; a deadline per call. A late or failed call
gives zero proposals for that step (plain decoding, never different output) and never raises.
After a late or failed call the proposer backs off: it skips the draft replicas for a growing
interval, so a killed replica costs plain decoding, not a deadline per step, until a replica
answers again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from workers.speculative.proposer import ProposalRequest

log = logging.getLogger(__name__)

WireItem = tuple[str, list[int], int, int, str]
"""One request on the wire: (request_id, token_ids, num_prompt_tokens, k, scope)."""

BACKOFF_INITIAL_S = 0.5
"""Seconds without remote calls after the first late or failed call."""

BACKOFF_MAX_S = 8.0
"""The back-off doubles after each late or failed call, up to this many seconds."""

MAX_PENDING_FINISHES = 4096
"""Finished request ids held for the draft replicas while they do not answer; older ones are
dropped (a replica that died lost their state anyway)."""


def to_wire(requests: list[ProposalRequest]) -> list[WireItem]:
    """The batch as plain tuples of ints and strings (what crosses to a draft replica)."""
    return [(r.request_id, [int(t) for t in r.token_ids], int(r.num_prompt_tokens), int(r.k),
             r.scope) for r in requests]


def from_wire(reply: Any, requests: list[ProposalRequest]) -> list[list[int]]:
    """Checks a draft replica's reply against the batch it answers.

    Returns:
        One list of draft token ids per request, each cut to the request's ``k``.

    Raises:
        ValueError: the reply is not one list of ints per request.
    """
    if not isinstance(reply, list) or len(reply) != len(requests):
        raise ValueError(f"draft reply has {len(reply) if isinstance(reply, list) else '?'} "
                         f"entries for {len(requests)} requests")
    return [[int(t) for t in tokens][:request.k]
            for tokens, request in zip(reply, requests, strict=True)]


class RemoteProposer:
    """Proposes through a handle to the draft deployment, within a deadline.

    Called from the engine's own thread (not an asyncio loop), so it blocks on the call for at
    most ``deadline_s``.

    Args:
        handle: a ``DeploymentHandle`` to ``DraftProposer`` (or anything with the same
            ``propose.remote(items).result(timeout_s=...)`` and ``finish.remote(ids)``; tests
            pass fakes).
        deadline_s: the most seconds one step waits for its drafts.
        name: what the engine's metrics call this proposer.
        clock: monotonic seconds (injectable for tests).

    Attributes:
        calls: remote propose calls made.
        timeouts: calls that missed the deadline.
        failures: calls that raised or answered malformed replies.
        skipped: propose() batches answered with no drafts, without a call, while backing off.
    """

    def __init__(self, handle: Any, deadline_s: float, name: str = "remote",
                 clock: Callable[[], float] = time.monotonic):
        if deadline_s <= 0:
            raise ValueError("deadline_s must be > 0")
        self.handle = handle
        self.deadline_s = deadline_s
        self.name = name
        self._clock = clock
        self.calls = 0
        self.timeouts = 0
        self.failures = 0
        self.skipped = 0
        self._backoff_s = 0.0
        self._resume_at = 0.0
        self._pending_finishes: list[str] = []

    @property
    def backing_off(self) -> bool:
        """Whether remote calls are being skipped now."""
        return self._clock() < self._resume_at

    def propose(self, requests: list[ProposalRequest]) -> list[list[int]]:
        """Drafts for the batch from one remote call; ``[]`` for every request if the call is
        late, fails or is skipped while backing off. Never raises."""
        if not requests:
            return []
        if self.backing_off:
            self.skipped += 1
            return [[] for _ in requests]
        self._flush_finishes()
        self.calls += 1
        response = None
        try:
            response = self.handle.propose.remote(to_wire(requests))
            drafts = from_wire(response.result(timeout_s=self.deadline_s), requests)
        except TimeoutError:
            self.timeouts += 1
            self._cancel(response)
            self._back_off("missed its %.0f ms deadline" % (self.deadline_s * 1000))
            return [[] for _ in requests]
        except Exception as exc:  # noqa: BLE001 - any draft failure means plain decoding
            self.failures += 1
            self._back_off(f"failed: {exc!r}")
            return [[] for _ in requests]
        self._backoff_s = 0.0
        return drafts

    def finish(self, request_ids: list[str]) -> None:
        """Tells the draft replicas the sequences ended, with the next call that goes out
        (fire and forget; never raises)."""
        self._pending_finishes.extend(request_ids)
        del self._pending_finishes[:-MAX_PENDING_FINISHES]
        if not self.backing_off:
            self._flush_finishes()

    def _flush_finishes(self) -> None:
        if not self._pending_finishes:
            return
        ids, self._pending_finishes = self._pending_finishes, []
        try:
            self.handle.finish.remote(ids)
        except Exception as exc:  # noqa: BLE001 - losing a finish only leaks draft-side state
            log.debug("draft finish call failed: %r", exc)

    def _back_off(self, what: str) -> None:
        self._backoff_s = min(BACKOFF_MAX_S, max(BACKOFF_INITIAL_S, 2 * self._backoff_s))
        self._resume_at = self._clock() + self._backoff_s
        log.warning("draft call %s; plain decoding for %.1f s", what, self._backoff_s)

    @staticmethod
    def _cancel(response: Any) -> None:
        """Cancels a late call so it does not hold a draft replica's queue."""
        try:
            if response is not None:
                response.cancel()
        except Exception as exc:  # noqa: BLE001
            log.debug("cancelling a late draft call failed: %r", exc)
