"""Routing policies: how a request's candidate replicas are ranked.

``prefix`` (the default, :class:`PrefixPolicy`) sends each request where it costs the least work,
in tokens:

    score(replica) = prompt tokens the replica would still prefill
                     (uncached, at least 1: the last token is always recomputed for its logits)
                   + loading the blocks it holds only in its second tier, at its measured cost
                   + tokens of work already queued or running there
                   + for a LoRA request, making its adapter resident there: a read or a swap
                     where it is not, and its share of the replica's adapter slots, all from
                     times the replica measured (``PrefixAwareRequestRouter._adapter_tokens``)

The cached part comes from the digest index (which replicas hold the longest leading chain of the
prompt's block digests); the load part from each replica's periodic routing stats plus the work
this router itself has sent since that report. Weighing a cache hit against load in one unit is
the cache-aware routing of SGLang's router and the vLLM production-stack router, with load and
hit length expressed as the tokens they cost, so affinity never outweighs a large load gap.

A prompt no replica holds any of (a new tenant's system prompt, a new conversation) decides
where that prefix will live from then on, since later requests follow their cached prefix. So
among the replicas within one prefill's work of the least loaded, it goes to the one asked to
keep the fewest *other* prefixes (distinct leading blocks this router recently sent there).
Placing prefixes by load alone at such a moment can put five hot prefixes on one worker and
three on the other; the first then evicts, and misses, in turn (SGLang's cache-aware router
likewise sends a low-match request to the worker with the smallest tree). Counting prefixes,
not blocks, also spreads one-off prompts evenly by number (case R5).

Equal scores are broken by "least recently chosen" so that equal candidates spread (a plain
``min`` would pile everything on the first replica; a uniform random pick is too uneven). When
the index does not answer, the router credits each replica from its own record of the prefixes
it sent there instead (:mod:`router.routing.sent_prefixes`), scored the same way; when that
record holds nothing of the prompt either, or the request cannot be read, the choice falls back
to the power of two choices on load alone (M. Mitzenmacher, "The Power of Two Choices in
Randomized Load Balancing", IEEE TPDS 12(10), 2001).

The baselines it is compared against: ``round-robin`` (:class:`RoundRobinPolicy`) and
``power-of-two`` (:class:`PowerOfTwoPolicy`, Ray Serve's default router), both blind to the cache.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar

from router.routing.request_input import uncached_tokens

DEFAULT_BLOCK_SIZE = 16
"""Tokens per KV block, as the workers use by default."""


@dataclass(frozen=True)
class ReplicaView:
    """What a policy knows about one candidate replica.

    Attributes:
        worker_id: the replica's id (``ReplicaID.unique_id``).
        cached_blocks: leading prompt blocks the replica holds per the index (or, when the
            index did not answer, per the router's own record of what it sent there), or
            ``None`` when neither knows anything of the prompt.
        load_tokens: tokens of work queued or running there (reported plus sent since).
        other_prefixes: distinct prompt prefixes other than this one that this router
            recently sent there (``SentPrefixes.other_prefixes``).
        adapter_tokens: what making the request's LoRA adapter resident costs there, in
            tokens of work (0 where a request in flight uses it, or the request has none).
        fetch_tokens_per_block: what fetching a KV block from another worker costs there, in
            tokens of work; None where it cannot fetch or has not measured it.
        tier_blocks: of ``cached_blocks``, those held there only in the second tier.
        tier_load_tokens_per_block: what loading one of them costs there, in tokens of work;
            None where it has not measured it (then counted as free, as a pool hit).
    """

    worker_id: str
    cached_blocks: int | None
    load_tokens: int
    other_prefixes: int = 0
    adapter_tokens: int = 0
    fetch_tokens_per_block: int | None = None
    tier_blocks: int = 0
    tier_load_tokens_per_block: int | None = None


class RoutingPolicy(ABC):
    """Ranks candidate replicas, best first; remembers when each worker was last chosen.

    Args:
        rng: random source for samples and for ordering never-chosen ties; seed it for
            reproducible tests.
    """

    name: ClassVar[str]
    uses_index: ClassVar[bool] = False
    """Whether ranking needs the digest index's answer (``cached_blocks``)."""

    def __init__(self, rng: random.Random | None = None):
        self._rng = rng or random.Random()
        self._last_chosen: dict[str, int] = {}
        self._choices = 0

    def rank(self, views: Sequence[ReplicaView], prompt_len: int) -> list[str]:
        """Worker ids, best first.

        Raises:
            ValueError: ``views`` is empty.
        """
        if not views:
            raise ValueError("no candidate replicas to rank")
        return self._rank(views, prompt_len)

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
        """Drops what the policy remembers of a worker that is gone."""
        self._last_chosen.pop(worker_id, None)

    def retain(self, worker_ids: set[str]) -> None:
        """Drops what the policy remembers of every worker not in ``worker_ids``."""
        for worker_id in list(self._last_chosen):
            if worker_id not in worker_ids:
                del self._last_chosen[worker_id]

    @abstractmethod
    def _rank(self, views: Sequence[ReplicaView], prompt_len: int) -> list[str]:
        """Worker ids, best first, of a non-empty ``views``."""

    def _sorted(self, views: Sequence[ReplicaView],
                cost: Callable[[ReplicaView], int | tuple[int, ...]]) -> list[str]:
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


class PrefixPolicy(RoutingPolicy):
    """Least work in tokens: uncached prompt tokens there plus the load already there.

    By score when every view has a count of cached blocks (from the index, or from the router's
    own record when the index did not answer); by the power of two choices on load when any
    lacks one (nothing known of the prompt, or the request could not be read).

    Args:
        block_size: tokens per KV block (positive).
        rng: as for :class:`RoutingPolicy`.

    Raises:
        ValueError: ``block_size`` is not positive.
    """

    name = "prefix"
    uses_index = True

    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE, rng: random.Random | None = None):
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        super().__init__(rng)
        self.block_size = block_size

    def score(self, view: ReplicaView, prompt_len: int, held_elsewhere: int = 0) -> int:
        """Tokens of work ahead of this request's first output token on that replica (an
        estimated TTFT in tokens): the load there, making its adapter resident there, and its
        prompt from the cheapest source: what it holds (its second tier's blocks loaded, or
        computed where loading costs more), then computing the rest, or, where it can fetch,
        the blocks another worker holds (``held_elsewhere``) fetched, then computing the
        rest."""
        own = view.cached_blocks or 0
        load = min(view.tier_load_tokens_per_block or 0, self.block_size)
        loaded = view.tier_blocks * load
        prefill = uncached_tokens(prompt_len, own, self.block_size)
        if view.fetch_tokens_per_block is not None and held_elsewhere > own:
            fetched = view.fetch_tokens_per_block * (held_elsewhere - own)
            prefill = min(prefill, fetched + uncached_tokens(prompt_len, held_elsewhere,
                                                             self.block_size))
        return loaded + prefill + view.load_tokens + view.adapter_tokens

    def _rank(self, views: Sequence[ReplicaView], prompt_len: int) -> list[str]:
        if any(view.cached_blocks is None for view in views):
            return self._two_choices(views)
        if all(view.cached_blocks == 0 for view in views):
            return self._place_new_prefix(views, prompt_len)
        held = max(view.cached_blocks for view in views)
        return self._sorted(views, lambda view: self.score(view, prompt_len, held))

    def _place_new_prefix(self, views: Sequence[ReplicaView], prompt_len: int) -> list[str]:
        """A prompt cached nowhere: the fewest other prefixes among the replicas whose score is
        within one prefill of this prompt of the best, then the rest by score."""
        scores = {view.worker_id: self.score(view, prompt_len) for view in views}
        bound = min(scores.values()) + prompt_len
        near = [view for view in views if scores[view.worker_id] <= bound]
        far = [view for view in views if scores[view.worker_id] > bound]
        return (self._sorted(near, lambda view: (view.other_prefixes, scores[view.worker_id]))
                + self._sorted(far, lambda view: scores[view.worker_id]))


class RoundRobinPolicy(RoutingPolicy):
    """Each worker in turn, blind to cache and load: the least recently chosen first, workers
    never chosen in worker-id order. A worker that joins is next in turn."""

    name = "round-robin"

    def _rank(self, views: Sequence[ReplicaView], prompt_len: int) -> list[str]:
        ordered = sorted(views, key=lambda v: (self._last_chosen.get(v.worker_id, 0), v.worker_id))
        return [view.worker_id for view in ordered]


class PowerOfTwoPolicy(RoutingPolicy):
    """Two workers sampled at random, the less loaded first (Ray Serve's default router);
    blind to the cache."""

    name = "power-of-two"

    def _rank(self, views: Sequence[ReplicaView], prompt_len: int) -> list[str]:
        return self._two_choices(views)


POLICY_NAMES = (PrefixPolicy.name, RoundRobinPolicy.name, PowerOfTwoPolicy.name)
"""The policies ``ClusterConfig.routing`` may name."""


def make_policy(name: str, block_size: int = DEFAULT_BLOCK_SIZE,
                rng: random.Random | None = None) -> RoutingPolicy:
    """The policy called ``name`` (one of :data:`POLICY_NAMES`).

    Raises:
        ValueError: ``name`` is not a policy, or ``block_size`` is not positive.
    """
    if name == PrefixPolicy.name:
        return PrefixPolicy(block_size, rng)
    if name == RoundRobinPolicy.name:
        return RoundRobinPolicy(rng)
    if name == PowerOfTwoPolicy.name:
        return PowerOfTwoPolicy(rng)
    raise ValueError(f"unknown routing policy {name!r}; choose one of {', '.join(POLICY_NAMES)}")
