"""Work this router sent to each worker and has not yet seen in the worker's stats."""

from __future__ import annotations

from collections import Counter
from collections.abc import Container, Mapping, Sequence
from dataclasses import dataclass, field

from router.routing.request_input import RoutingInput
from router.routing.sent_prefixes import leading_run


@dataclass
class SentEntry:
    """One request this router sent (or is about to send) to a worker.

    Attributes:
        worker_id: where it went.
        tokens: work it adds there (``RoutingInput.work_tokens``).
        sent_at: when it was chosen or accepted, in the router's clock (seconds).
        plan: what routing read from the request (``None``: unreadable).
        cached: the index's answer: worker id → leading prompt blocks held.
        fallback: why its routing went without the index's answer, if it did (a
            ``RoutingDecision`` reason).
        recorded: without the index's answer, worker id → leading prompt blocks this router's
            own record says it sent there (empty when the record was not used).
    """

    worker_id: str
    tokens: int
    sent_at: float
    plan: RoutingInput | None
    cached: dict[str, int]
    fallback: str | None = None
    recorded: dict[str, int] = field(default_factory=dict)

    def credited_blocks(self, worker_id: str) -> int:
        """Leading prompt blocks routing took ``worker_id`` to hold: the index's answer, or the
        router's own record when the index did not answer."""
        return self.cached.get(worker_id, self.recorded.get(worker_id, 0))


class SentLedger:
    """Tokens of work this router sent to each worker and has not yet seen in its stats.

    A replica's ``queued_tokens`` arrives only every stats period, so without this ledger a
    burst of requests would all see the same stale load. An entry stops counting once a stats
    snapshot taken after it was sent arrives (the snapshot already counts it), and leaves the
    ledger when the request completes or after ``max_age_s`` (a completion signal may be lost).

    Work tokens of one request = prompt tokens the worker still has to prefill + every output
    token it may produce (:mod:`router.routing.request_input`); this is the same unit the
    worker must report as ``queued_tokens`` (summed over its queued and running requests, minus
    what it already prefilled or generated).

    The ledger also knows the prompt blocks of the requests in flight on each worker
    (:meth:`leading_blocks_in_flight`): a running request's blocks are pinned in its worker's
    pool, and those of one still queued or prefilling will be, before the index hears of them.

    Args:
        max_age_s: seconds after which an entry is dropped regardless (positive).
    """

    def __init__(self, max_age_s: float = 60.0):
        self.max_age_s = max_age_s
        self._by_key: dict[str, SentEntry] = {}
        self._by_worker: dict[str, dict[str, SentEntry]] = {}
        self._digests_in_flight: dict[str, Counter[bytes]] = {}

    def __len__(self) -> int:
        return len(self._by_key)

    def get(self, key: str) -> SentEntry | None:
        """The entry for request ``key``, if any."""
        return self._by_key.get(key)

    def record(self, key: str, entry: SentEntry) -> None:
        """Adds (or replaces: a retried request is routed again) the entry for ``key``."""
        self.remove(key)
        self._by_key[key] = entry
        self._by_worker.setdefault(entry.worker_id, {})[key] = entry
        if _digests(entry):
            self._digests_in_flight.setdefault(entry.worker_id, Counter()).update(
                entry.plan.digests)

    def move(self, key: str, worker_id: str, tokens: int) -> None:
        """Moves the entry for ``key`` (if any) to ``worker_id``, now counting ``tokens``."""
        entry = self._by_key.get(key)
        if entry is None:
            return
        self.remove(key)
        entry.worker_id = worker_id
        entry.tokens = tokens
        self.record(key, entry)

    def remove(self, key: str, worker_id: str | None = None) -> None:
        """Drops the entry for ``key``; only if it is on ``worker_id`` when that is given."""
        entry = self._by_key.get(key)
        if entry is None or (worker_id is not None and entry.worker_id != worker_id):
            return
        del self._by_key[key]
        on_worker = self._by_worker.get(entry.worker_id, {})
        on_worker.pop(key, None)
        if not on_worker:
            self._by_worker.pop(entry.worker_id, None)
        if _digests(entry):
            in_flight = self._digests_in_flight[entry.worker_id]
            for digest in entry.plan.digests:
                in_flight[digest] -= 1
                if not in_flight[digest]:
                    del in_flight[digest]
            if not in_flight:
                del self._digests_in_flight[entry.worker_id]

    def leading_blocks_in_flight(self, worker_id: str, digests: Sequence[bytes]) -> int:
        """How many leading ``digests`` some request in flight on ``worker_id`` shares."""
        return leading_run(digests, self._digests_in_flight.get(worker_id, ()))

    def outstanding(self, worker_id: str, snapshot_at: float | None,
                    listed: Mapping[str, int] | None = None,
                    finished: Container[str] = ()) -> int:
        """Tokens sent to ``worker_id`` that the worker's last snapshot does not count, of
        requests not known to have finished (by request id, ``finished``).

        With the snapshot's per-request breakdown (``listed``), an entry counts until the
        snapshot lists its request: a replica may accept a request well before its engine
        queues it. Without one, entries sent before ``snapshot_at`` are taken as counted.
        Entries stay until completion either way, so that the completion can still name the
        request.
        """
        entries = self._by_worker.get(worker_id, {}).values()
        return sum(entry.tokens for entry in entries
                   if not _counted_by_snapshot(entry, snapshot_at, listed)
                   and not _finished(entry, finished))

    def adapters_in_flight(self, worker_id: str,
                           listed: Mapping[str, int] | None = None) -> dict[str, int]:
        """The LoRA adapters of the requests in flight on ``worker_id``: content digest → the
        most work one of them has left, in tokens (the worker's snapshot breakdown,
        ``listed``, where it lists the request; else the work it was sent with). Fresher than
        the worker's report of the adapters it holds: a request sent since is counted."""
        left: dict[str, int] = {}
        for entry in self._by_worker.get(worker_id, {}).values():
            digest = entry.plan.adapter_digest if entry.plan is not None else None
            if digest is not None:
                tokens = (listed or {}).get(entry.plan.request_id, entry.tokens)
                left[digest] = max(left.get(digest, 0), tokens)
        return left

    def expire(self, now: float) -> None:
        """Drops entries older than ``max_age_s`` seconds at time ``now``."""
        horizon = now - self.max_age_s
        for key in [k for k, e in self._by_key.items() if e.sent_at < horizon]:
            self.remove(key)

    def drop_worker(self, worker_id: str) -> None:
        """Drops every entry on ``worker_id``."""
        for key in list(self._by_worker.get(worker_id, {})):
            self.remove(key)

    def retain(self, worker_ids: set[str]) -> None:
        """Drops every entry on a worker not in ``worker_ids``."""
        for worker_id in [w for w in self._by_worker if w not in worker_ids]:
            self.drop_worker(worker_id)


def _digests(entry: SentEntry) -> bool:
    """Whether ``entry`` pins prompt blocks: a prompt shorter than one block has no digests,
    and must neither make nor, on removal, look up a worker's count of blocks in flight."""
    return entry.plan is not None and bool(entry.plan.digests)


def _finished(entry: SentEntry, finished: Container[str]) -> bool:
    return entry.plan is not None and entry.plan.request_id in finished


def _counted_by_snapshot(entry: SentEntry, snapshot_at: float | None,
                         listed: Mapping[str, int] | None) -> bool:
    request_id = entry.plan.request_id if entry.plan is not None else None
    if listed is not None and request_id:
        return request_id in listed
    return snapshot_at is not None and entry.sent_at < snapshot_at

