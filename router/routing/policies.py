"""The scoring policy: which replica a request costs the least work on, in tokens.

    score(replica) = prompt tokens the replica would still prefill
                     (uncached, at least 1: the last token is always recomputed for its logits)
                   + tokens of work already queued or running there

The cached part comes from the digest index (which replicas hold the longest leading chain of the
prompt's block digests); the load part from each replica's periodic routing stats plus the work
this router itself has sent since that report. Weighing a cache hit against load in one unit is
the cache-aware routing of SGLang's router and the vLLM production-stack router, with load and
hit length expressed as the tokens they cost, so affinity never outweighs a large load gap.

Equal scores are broken by "least recently chosen" so that equal candidates spread (a plain
``min`` would pile everything on the first replica; a uniform random pick is too uneven). When
the index does not answer, or the request cannot be read, the choice falls back to the power of
two choices on load alone (M. Mitzenmacher, "The Power of Two Choices in Randomized Load
Balancing", IEEE TPDS 12(10), 2001).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

DEFAULT_BLOCK_SIZE = 16
"""Tokens per KV block, as the workers use by default."""



@dataclass(frozen=True)
class ReplicaView:
    """What the scorer knows about one candidate replica.

    Attributes:
        worker_id: the replica's id (``ReplicaID.unique_id``).
        cached_blocks: leading prompt blocks the replica holds per the index, or ``None`` when
            the index did not answer.
        load_tokens: tokens of work queued or running there (reported plus sent since).
    """

    worker_id: str
    cached_blocks: int | None
    load_tokens: int


class PrefixScorer:
    """Ranks candidate replicas by the work a request would cost there, in tokens.

    Stateful only in what it needs for spreading: when each worker was last chosen.

    Args:
        block_size: tokens per KV block (positive).
        rng: random source for the power-of-two sample and for ordering never-chosen ties;
            seed it for reproducible tests.

    Raises:
        ValueError: ``block_size`` is not positive.
    """

    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE, rng: random.Random | None = None):
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self._rng = rng or random.Random()
        self._last_chosen: dict[str, int] = {}
        self._choices = 0

    def uncached_tokens(self, prompt_len: int, cached_blocks: int) -> int:
        """Prompt tokens still to prefill when ``cached_blocks`` leading blocks are cached.

        At least 1: a fully cached prompt still recomputes its last token to get logits.
        """
        return max(1, prompt_len - max(0, cached_blocks) * self.block_size)

    def score(self, view: ReplicaView, prompt_len: int) -> int:
        """Tokens of work ahead of this request's first output token on that replica."""
        return self.uncached_tokens(prompt_len, view.cached_blocks or 0) + view.load_tokens

    def rank(self, views: Sequence[ReplicaView], prompt_len: int) -> list[str]:
        """Worker ids, best first.

        By score when every view has an index answer; by the power of two choices on load when
        any lacks one (the index did not answer, or the request could not be read).

        Raises:
            ValueError: ``views`` is empty.
        """
        if not views:
            raise ValueError("no candidate replicas to rank")
        if any(view.cached_blocks is None for view in views):
            return self._two_choices(views)
        return self._sorted(views, lambda view: self.score(view, prompt_len))

    def choose(self, views: Sequence[ReplicaView], prompt_len: int) -> list[str]:
        """:meth:`rank`, then records the best as just chosen."""
        ranked = self.rank(views, prompt_len)
        self.mark_chosen(ranked[0])
        return ranked

    def mark_chosen(self, worker_id: str) -> None:
        """Records that a request went to ``worker_id`` now (for least-recently-chosen ties)."""
        self._choices += 1
        self._last_chosen[worker_id] = self._choices

    def forget(self, worker_id: str) -> None:
        """Drops what the scorer remembers of a worker that is gone."""
        self._last_chosen.pop(worker_id, None)

    def retain(self, worker_ids: set[str]) -> None:
        """Drops what the scorer remembers of every worker not in ``worker_ids``."""
        for worker_id in list(self._last_chosen):
            if worker_id not in worker_ids:
                del self._last_chosen[worker_id]

    def _sorted(self, views: Sequence[ReplicaView], cost) -> list[str]:
        # Ties go to the least recently chosen worker; among never-chosen workers the order is
        # random, so "first in the candidate list" never wins by position.
        keyed = [
            (cost(view), self._last_chosen.get(view.worker_id, 0), self._rng.random(), view)
            for view in views
        ]
        keyed.sort(key=lambda item: item[:3])
        return [item[3].worker_id for item in keyed]

    def _two_choices(self, views: Sequence[ReplicaView]) -> list[str]:
        # Mitzenmacher's power of two choices: sample two, keep the less loaded. Sampling keeps
        # several routers with the same stale view from all herding onto one replica.
        sample = self._rng.sample(list(views), min(2, len(views)))
        picked = self._sorted(sample, lambda view: view.load_tokens)
        rest = [view for view in views if view.worker_id not in picked]
        return picked + self._sorted(rest, lambda view: view.load_tokens)

