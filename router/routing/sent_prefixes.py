"""The router's own record of which prompt prefixes it sent to which worker.

While the digest index is down or late, routing stays prefix-aware from this record, as SGLang's
router does with its approximate radix tree and Ray Serve's prefix-aware router with its
per-replica prefix tree: a worker that was sent a prompt most likely still holds that prompt's KV
blocks. It is a hint only. When the index answers, the record adds only what the index cannot
have heard of yet: prompts sent or finished within the index's lag, whose blocks are held but
whose events may still be on their way (``within_s`` of :meth:`SentPrefixes.leading_blocks`).

Entries are ``(worker, block digest)`` pairs. A block digest names the whole prefix up to that
block (digests are chained), so a worker's leading run over a prompt's digests is the longest
prefix of it this router sent there. Memory is bounded: at most ``max_entries`` pairs, least
recently sent first out; entries older than ``max_age_s`` no longer count (the worker may have
evicted those blocks since); a worker that dies or leaves loses its entries at once.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Iterable, Sequence

DEFAULT_MAX_ENTRIES = 65_536
"""Default cap on ``(worker, digest)`` pairs: about 8k blocks per worker at 8 workers, the order
of a worker's KV pool here, in about 17 MiB at the cap (≈270 bytes a pair with the digest it
keeps alive and the dict and set entries; measured with tracemalloc)."""

DEFAULT_MAX_AGE_S = 300.0
"""Default seconds a sent prefix keeps counting. A stale entry costs at most what load-only
routing costs (one miss), and load still weighs against it, so the bound is generous."""

DEFAULT_INDEX_LAG_S = 1.0
"""Default seconds after a send or a completion during which the record adds to the index's
answer. A worker publishes its KV events as its steps produce them, but they reach the index
through its publisher's queue and a Redis write, after the response may have reached the
client; on a busy 2-core CI host an identical follow-up request beat them there. Too long a
window only delays the index's word on an eviction by as much (one miss at worst)."""


def leading_run(digests: Sequence[bytes], held: Container[bytes]) -> int:
    """How many leading ``digests`` are in ``held``. Block digests are chained, so a held
    digest stands for the whole prefix up to its block."""
    count = 0
    for digest in digests:
        if digest not in held:
            break
        count += 1
    return count


class SentPrefixes:
    """Per worker, the block digests of the prompts this router sent there (LRU, bounded).

    Not thread-safe: the router uses it from its event loop only.

    Args:
        max_entries: most ``(worker, digest)`` pairs kept (positive); the least recently sent
            pair is dropped first.
        max_age_s: seconds after which a recorded pair no longer counts (positive).

    Raises:
        ValueError: ``max_entries`` or ``max_age_s`` is not positive.
    """

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES,
                 max_age_s: float = DEFAULT_MAX_AGE_S):
        if max_entries <= 0:
            raise ValueError(f"max_entries must be positive, got {max_entries}")
        if not max_age_s > 0:
            raise ValueError(f"max_age_s must be positive, got {max_age_s}")
        self.max_entries = max_entries
        self.max_age_s = max_age_s
        # (worker, digest) → when last sent, least recently sent first.
        self._sent_at: OrderedDict[tuple[str, bytes], float] = OrderedDict()
        self._per_worker: dict[str, set[bytes]] = {}
        self._roots: dict[str, set[bytes]] = {}  # the leading-block digests among them

    def __len__(self) -> int:
        return len(self._sent_at)

    def record(self, worker_id: str, digests: Sequence[bytes], now: float) -> None:
        """Notes that a prompt with block ``digests`` (leading block first) was sent to
        ``worker_id`` at ``now`` (seconds), then trims the record to its cap."""
        held = self._per_worker.setdefault(worker_id, set())
        # Touched last block first, so that the leading blocks are the most recently sent and
        # eviction takes a prefix's tail before its head (a leading run stays a leading run),
        # as a worker's own block pool evicts a chain's tail first.
        for digest in reversed(digests):
            key = (worker_id, digest)
            self._sent_at[key] = now
            self._sent_at.move_to_end(key)
            held.add(digest)
        if digests:
            self._roots.setdefault(worker_id, set()).add(digests[0])
        while len(self._sent_at) > self.max_entries:
            self._pop_oldest()

    def leading_blocks(self, digests: Sequence[bytes], worker_ids: Iterable[str],
                       now: float, within_s: float | None = None) -> dict[str, int]:
        """For each of ``worker_ids``, how many leading ``digests`` this router sent there
        within the last ``max_age_s`` seconds, or the last ``within_s`` seconds when that is
        given and shorter (0 for a worker it knows nothing of)."""
        self._expire(now)
        since = None if within_s is None else now - within_s
        return {worker_id: self._leading_run(worker_id, digests, since)
                for worker_id in worker_ids}

    def other_prefixes(self, worker_id: str, digests: Sequence[bytes], now: float) -> int:
        """Distinct prompt prefixes (leading blocks) this router sent to ``worker_id`` within
        the last ``max_age_s`` seconds, besides the one starting ``digests``: how many other
        prefixes it asked that worker to keep cached."""
        self._expire(now)
        roots = self._roots.get(worker_id, set())
        return len(roots) - (1 if digests and digests[0] in roots else 0)

    def drop_worker(self, worker_id: str) -> None:
        """Forgets everything sent to ``worker_id`` (it died or left the deployment)."""
        for digest in self._per_worker.pop(worker_id, ()):
            del self._sent_at[(worker_id, digest)]
        self._roots.pop(worker_id, None)

    def retain(self, worker_ids: set[str]) -> None:
        """Forgets every worker not in ``worker_ids``."""
        for worker_id in [w for w in self._per_worker if w not in worker_ids]:
            self.drop_worker(worker_id)

    def workers(self) -> set[str]:
        """The workers with at least one recorded digest."""
        return set(self._per_worker)

    def _leading_run(self, worker_id: str, digests: Sequence[bytes],
                     since: float | None = None) -> int:
        if since is None:
            return leading_run(digests, self._per_worker.get(worker_id, ()))
        count = 0
        for digest in digests:
            sent_at = self._sent_at.get((worker_id, digest))
            if sent_at is None or sent_at < since:
                break
            count += 1
        return count

    def _expire(self, now: float) -> None:
        # Oldest first: stop at the first pair young enough to count.
        horizon = now - self.max_age_s
        while self._sent_at and next(iter(self._sent_at.values())) < horizon:
            self._pop_oldest()

    def _pop_oldest(self) -> None:
        (worker_id, digest), _ = self._sent_at.popitem(last=False)
        held = self._per_worker[worker_id]
        held.discard(digest)
        roots = self._roots.get(worker_id)
        if roots is not None:
            roots.discard(digest)
        if not held:
            del self._per_worker[worker_id]
            self._roots.pop(worker_id, None)
