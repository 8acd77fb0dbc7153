"""The Ray Serve glue: :class:`PrefixAwareRequestRouter`, a ``RequestRouter`` that places each
request with :mod:`router.routing.policies`, reading requests, replica stats and the digest index.

The scoring core (:mod:`~router.routing.policies`, :mod:`~router.routing.ledger`,
:mod:`~router.routing.request_input`) has no Ray dependency.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import random
from collections.abc import Mapping
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from router.routing.checks import is_count
from router.routing.ledger import SentLedger, _Sent
from router.routing.policies import DEFAULT_BLOCK_SIZE, PrefixScorer, ReplicaView
from router.routing.replica_stats import (
    STATS_MODEL_KEY,
    parse_request_tokens,
    parse_routing_stats,
)
from router.routing.request_input import RoutingInput, routing_input

logger = logging.getLogger(__name__)


def worker_id_of(replica_id: Any) -> str:
    """The worker id a replica publishes under: ``ReplicaID.unique_id`` (``str(...)`` else)."""
    unique_id = getattr(replica_id, "unique_id", None)
    return unique_id if isinstance(unique_id, str) else str(replica_id)


def _request_key(pending_request: Any) -> str:
    """Ray's ``internal_request_id`` (stable across retries), else the object's identity."""
    metadata = getattr(pending_request, "metadata", None)
    key = getattr(metadata, "internal_request_id", None)
    return key if isinstance(key, str) and key else f"pending-{id(pending_request)}"


async def _bounded(awaitable: Any, timeout_s: float) -> Any:
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


class PrefixAwareRequestRouter(RequestRouter):
    """Ray Serve request router: prefix-cache affinity weighed against load, in tokens.

    Attach to the worker deployment with
    ``@serve.deployment(request_router_config=RequestRouterConfig(
    request_router_class=PrefixAwareRequestRouter, request_router_kwargs={...},
    request_routing_stats_period_s=...))``; the kwargs are those of :meth:`initialize_state`.
    The worker deployment's ``record_routing_stats()`` must return
    ``{"queued_tokens": int, "time": time.time()}`` (see :class:`SentLedger` for the unit), it
    publishes its digests under ``serve.get_replica_context().replica_id.unique_id``, and, unless
    ``model_key`` is configured, its ``record_replica_metadata()`` returns
    ``{"model_key": identity.model_key}``.

    Every hook here is failure-proof: routing never raises and never waits on the index for
    longer than ``index_timeout_s`` (``index_first_timeout_s`` for the very first lookup).
    """

    def initialize_state(
        self,
        redis_url: str | None = None,
        key_prefix: str = "nalar",
        index_actor_name: str | None = None,
        index_actor_namespace: str | None = None,
        model_key: str | None = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
        index_timeout_s: float = 0.05,
        index_first_timeout_s: float = 1.0,
        index_retry_s: float = 1.0,
        worker_ttl_s: float = 30.0,
        sent_max_age_s: float = 60.0,
        seed: int | None = None,
    ) -> None:
        """Called by Ray Serve with ``RequestRouterConfig.request_router_kwargs``.

        Args:
            redis_url: Redis index URL; ``None`` uses the embedded (Ray actor) index.
            key_prefix: per-cluster key prefix of the index.
            index_actor_name: without Redis, the name of the shared embedded index actor
                (``None``: ``router.index.DEFAULT_ACTOR_NAME``).
            index_actor_namespace: Ray namespace of that actor (``None``: this process's).
            model_key: ``CacheIdentity.model_key`` (hex) the workers publish digests under;
                ``None`` reads it from each replica's ``replica_metadata`` or ``routing_stats``
                (key ``"model_key"``), since it hashes weights only the replicas have loaded.
            block_size: tokens per KV block; must equal the workers'.
            index_timeout_s: seconds one index lookup may take before routing falls back to
                load alone.
            index_first_timeout_s: seconds the first lookup may take: it also connects to the
                index (Redis, or the index actor's handle), which takes longer than a lookup.
            index_retry_s: seconds to route on load alone after a failed lookup before asking
                the index again (so an outage costs one timeout per period, not per request).
            worker_ttl_s: seconds a worker's index entries live without a refresh.
            sent_max_age_s: seconds after which work this router sent stops counting as load
                even without a completion or a newer stats snapshot.
            seed: seeds the random choices (tests).

        Raises:
            ValueError: ``block_size`` is not positive. A failure to build the index does not
                raise: it is logged and routing uses load alone.
        """
        self._scorer = PrefixScorer(block_size, random.Random(seed))
        self._ledger = SentLedger(sent_max_age_s)
        # Request id → when it finished; reports older than that still list it.
        self._finished: dict[str, float] = {}
        self._model_key = model_key
        self._worker_model_keys: dict[str, str] = {}
        self._index_timeout_s = index_timeout_s
        self._index_first_timeout_s = max(index_timeout_s, index_first_timeout_s)
        self._index_tried = False
        self._index_retry_s = index_retry_s
        self._index_healthy = True
        self._index_failures = 0
        self._index_retry_at = 0.0
        self._background: set[asyncio.Task] = set()
        self._index = self._build_index(
            redis_url=redis_url,
            key_prefix=key_prefix,
            worker_ttl_s=worker_ttl_s,
            actor_name=index_actor_name,
            actor_namespace=index_actor_namespace,
        )

    def _build_index(
        self,
        redis_url: str | None,
        key_prefix: str,
        worker_ttl_s: float,
        actor_name: str | None,
        actor_namespace: str | None,
    ) -> Any | None:
        """The digest index, or ``None`` (logged) when it cannot be built."""
        try:
            # Imported here, not at module level, so that this module loads without the index
            # (and tests can put a fake ``router.index`` in ``sys.modules``).
            index_module = importlib.import_module("router.index")
            if not redis_url and not actor_name:
                # Without Redis the router must reach the shared index actor the workers
                # publish to; a private in-process index would never hold anything.
                actor_name = getattr(index_module, "DEFAULT_ACTOR_NAME", "nalar-digest-index")
            kwargs: dict[str, Any] = {"worker_ttl_s": worker_ttl_s, "actor_name": actor_name}
            if actor_namespace is not None:
                kwargs["actor_namespace"] = actor_namespace
            return index_module.make_index(redis_url, key_prefix, **kwargs)
        except Exception:
            logger.exception("Could not build the digest index; routing on load only.")
            return None

    # ---- choosing ------------------------------------------------------------------------

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        """Ranked tiers: ``[[best], [the others, best first]]``.

        Ray Serve tries the tiers in order and, within a tier, takes the replica with the
        fewest ongoing requests that is not full; a one-replica first tier keeps that choice
        ours, the second tier is the fallback when the best is full. Never raises.
        """
        self._enable_backoff(pending_request)
        if not candidate_replicas:
            return []
        try:
            ranked = await self._rank(candidate_replicas, pending_request)
        except Exception:
            logger.exception("Prefix-aware routing failed; routing this request on load only.")
            return [list(candidate_replicas)]
        return [tier for tier in (ranked[:1], ranked[1:]) if tier]

    @staticmethod
    def _enable_backoff(pending_request: PendingRequest | None) -> None:
        # Without this flag Ray's routing loop retries immediately, spinning on the CPU while
        # every replica is full.
        context = getattr(pending_request, "routing_context", None)
        if context is not None:
            context.should_backoff = True

    async def _rank(
        self, replicas: list[RunningReplica], pending_request: PendingRequest | None
    ) -> list[RunningReplica]:
        now = self._get_curr_time_s()
        self._ledger.expire(now)
        self._forget_finished_before(now - self._ledger.max_age_s)
        by_id = {worker_id_of(replica.replica_id): replica for replica in replicas}
        loads = {wid: self._load_tokens(wid, replica) for wid, replica in by_id.items()}
        plan = routing_input(pending_request)
        cached = await self._cached_blocks(plan, by_id) if plan is not None else None
        views = [
            ReplicaView(wid, None if cached is None else cached.get(wid, 0), loads[wid])
            for wid in by_id
        ]
        ranked = self._scorer.choose(views, plan.prompt_len if plan else 0)
        self._record_sent(_request_key(pending_request), ranked[0], plan, cached or {}, now)
        return [by_id[wid] for wid in ranked]

    def _forget_finished_before(self, horizon: float) -> None:
        # Insertion order is completion order: the oldest come first.
        while self._finished and next(iter(self._finished.values())) < horizon:
            del self._finished[next(iter(self._finished))]

    def _load_tokens(self, worker_id: str, replica: RunningReplica) -> int:
        """Reported queued tokens, less requests seen finishing since, plus what this router
        sent since that report.

        A report can be a whole stats period old: without the per-request breakdown, a worker
        that just finished a long prefill would still look busy with it, and the next request
        sharing that prefix would be sent away from the only worker holding it.
        """
        stats = getattr(replica, "routing_stats", None)
        queued, snapshot_at = parse_routing_stats(stats)
        per_request = parse_request_tokens(stats)
        if per_request is not None:
            queued = sum(tokens for rid, tokens in per_request.items()
                         if rid not in self._finished)
        return queued + self._ledger.outstanding(worker_id, snapshot_at, per_request)

    async def _cached_blocks(
        self, plan: RoutingInput, replicas: Mapping[str, RunningReplica]
    ) -> dict[str, int] | None:
        """Leading prompt blocks each worker holds, or ``None`` when the index did not answer.

        One index lookup per model key among the candidates (normally exactly one); a worker
        whose model key is not known yet is credited with nothing.
        """
        if not plan.digests:
            return {}  # shorter than one block: nothing can be cached, nothing to ask
        if self._index is None or self._get_curr_time_s() < self._index_retry_at:
            return None
        groups: dict[str, list[str]] = {}
        for worker_id, replica in replicas.items():
            model_key = self._model_key_of(replica)
            if model_key:
                groups.setdefault(model_key, []).append(worker_id)
                self._worker_model_keys[worker_id] = model_key  # for forget() after its death
        if not groups:
            return {}
        try:
            answers = await _bounded(
                asyncio.gather(
                    *(self._index.match(key, plan.digests, ids) for key, ids in groups.items())
                ),
                self._index_timeout_s if self._index_tried else self._index_first_timeout_s,
            )
            cached: dict[str, int] = {}
            for worker_ids, answer in zip(groups.values(), answers, strict=True):
                held = self._validated(answer, len(plan.digests))
                cached.update({wid: held.get(wid, 0) for wid in worker_ids})
        except Exception as exc:  # includes the timeout; cancellation still propagates
            self._on_index_failure(exc)
            return None
        self._on_index_success()
        return cached

    def _model_key_of(self, replica: RunningReplica) -> str | None:
        """The configured model key, else the one the replica reports.

        Read from ``replica_metadata`` (the deployment's ``record_replica_metadata()``), then
        from ``routing_stats``: the key hashes the loaded weights, so only the replicas know it.
        """
        if self._model_key:
            return self._model_key
        for source in (
            getattr(replica, "replica_metadata", None),
            getattr(replica, "routing_stats", None),
        ):
            key = source.get(STATS_MODEL_KEY) if isinstance(source, Mapping) else None
            if isinstance(key, str) and key:
                return key
        return None

    @staticmethod
    def _validated(answer: Any, max_blocks: int) -> dict[str, int]:
        """The index answer as ``{worker id: blocks}``, clamped to ``[0, max_blocks]``.

        Raises:
            TypeError: the answer is not a mapping.
        """
        if not isinstance(answer, Mapping):
            raise TypeError(f"index match returned {type(answer).__name__}, not a mapping")
        return {
            str(wid): min(int(blocks), max_blocks)
            for wid, blocks in answer.items()
            if is_count(blocks)
        }

    def _on_index_failure(self, exc: BaseException) -> None:
        self._index_tried = True  # only the very first lookup gets the longer bound
        self._index_failures += 1
        self._index_retry_at = self._get_curr_time_s() + self._index_retry_s
        if self._index_healthy:  # once per outage, not once per request
            self._index_healthy = False
            logger.warning(
                "Digest index lookup failed (%s: %s); routing on load only "
                "(power of two choices) until it answers again.",
                type(exc).__name__,
                exc,
            )

    def _on_index_success(self) -> None:
        self._index_tried = True
        if not self._index_healthy:
            logger.info(
                "Digest index answering again after %d failed lookups; "
                "prefix-aware routing resumed.",
                self._index_failures,
            )
            self._index_healthy = True
            self._index_failures = 0

    # ---- accounting ----------------------------------------------------------------------

    def _record_sent(
        self,
        key: str,
        worker_id: str,
        plan: RoutingInput | None,
        cached: dict[str, int],
        now: float,
    ) -> None:
        # Recorded at choice time, before Ray confirms the send: requests routed concurrently
        # must already see each other's load.
        tokens = self._work_tokens(plan, cached.get(worker_id, 0))
        self._ledger.record(key, _Sent(worker_id, tokens, now, plan, cached))
        if plan is not None and plan.request_id:
            self._finished.pop(plan.request_id, None)  # routed again: live work once more

    def _work_tokens(self, plan: RoutingInput | None, cached_blocks: int) -> int:
        """Work one request adds to a worker, in tokens (1 for an unreadable request)."""
        if plan is None:
            return 1
        prefill = self._scorer.uncached_tokens(plan.prompt_len, cached_blocks)
        return prefill + plan.decode_tokens

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any
    ) -> None:
        """Ray Serve hook: the replica accepted the request. Moves the ledger entry there.

        A replica that rejected the request first has already reported it completed, which
        removed its entry; it is recorded again here, as live work on the accepting replica.
        Never raises.
        """
        try:
            worker_id = worker_id_of(replica_id)
            key = _request_key(pending_request)
            entry = self._ledger.get(key)
            now = self._get_curr_time_s()
            if entry is None:
                plan = routing_input(pending_request)
                self._record_sent(key, worker_id, plan, {}, now)
                return
            if entry.worker_id != worker_id:  # the first choice was full; Ray fell back
                self._scorer.mark_chosen(worker_id)
                entry.tokens = self._work_tokens(entry.plan, entry.cached.get(worker_id, 0))
                entry.worker_id = worker_id
            entry.sent_at = now
            self._ledger.record(key, entry)
        except Exception:
            logger.exception("on_request_routed failed; load accounting may drift briefly.")

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        """Ray Serve hook: the request finished (or was rejected or cancelled). Never raises."""
        try:
            entry = self._ledger.get(internal_request_id)
            if entry is None or entry.worker_id != worker_id_of(replica_id):
                return
            # A rejected attempt lands here too; on_request_routed then records it again.
            if entry.plan is not None and entry.plan.request_id:
                self._finished[entry.plan.request_id] = self._get_curr_time_s()
            self._ledger.remove(internal_request_id)
        except Exception:
            logger.exception("on_request_completed failed; the entry will age out.")

    # ---- replica lifecycle ---------------------------------------------------------------

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        """Ray Serve hook: the replica set changed. Drops state of replicas that are gone."""
        super().update_replicas(replicas)
        live = {worker_id_of(replica.replica_id) for replica in replicas}
        self._scorer.retain(live)
        self._ledger.retain(live)
        for worker_id in [w for w in self._worker_model_keys if w not in live]:
            del self._worker_model_keys[worker_id]

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        """Ray Serve hook: the replica's actor died. Forgets it locally and in the index.

        The index call runs in the background (fire and forget); its failure is logged, and the
        index's worker TTL removes the entries anyway. Never raises.
        """
        super().on_replica_actor_died(replica_id)
        try:
            worker_id = worker_id_of(replica_id)
            self._scorer.forget(worker_id)
            self._ledger.drop_worker(worker_id)
            self._forget_in_index(worker_id)
        except Exception:
            logger.exception("Could not forget dead replica %s.", replica_id)

    def _forget_in_index(self, worker_id: str) -> None:
        model_key = self._worker_model_keys.pop(worker_id, None) or self._model_key
        if self._index is None or model_key is None:
            return  # its model key is unknown here; the index TTL expires its entries
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
            await _bounded(self._index.forget(model_key, worker_id), 5.0)
        except Exception as exc:
            logger.warning(
                "Index could not forget dead worker %s (%s); its TTL expires it.", worker_id, exc
            )
