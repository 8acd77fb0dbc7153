"""The Ray Serve glue: :class:`PrefixAwareRequestRouter`, a ``RequestRouter`` that ranks each
request's candidate replicas with a policy (:mod:`router.routing.policies`), reading the request
(:mod:`~router.routing.request_input`), the replicas' stats (:class:`contract.load.RoutingStats`)
and the digest index (:mod:`~router.routing.index_lookup`), keeping the work it sent in a ledger
(:mod:`~router.routing.ledger`), the prefixes it sent where (:mod:`~router.routing.sent_prefixes`,
its fallback while the index is down or late) and every decision in the telemetry
(:mod:`~router.routing.telemetry`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib
import logging
import random
import time
from collections.abc import Mapping
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from contract.kv_transfer import KVExportRequest, KVSource
from contract.load import ReplicaMetadata, RoutingStats
from contract.request import GenerationRequest
from router.routing import finished_requests, replica_keys, telemetry
from router.routing.index_lookup import (
    DEFAULT_LOOKUP_DEADLINE_S,
    INDEX_RETRY_S,
    IndexLookup,
    Lookup,
)
from router.routing.ledger import SentEntry, SentLedger
from router.routing.policies import DEFAULT_BLOCK_SIZE, PrefixPolicy, ReplicaView, make_policy
from router.routing.request_input import RoutingInput, routing_input
from router.routing.sent_prefixes import (
    DEFAULT_INDEX_LAG_S,
    DEFAULT_MAX_AGE_S,
    DEFAULT_MAX_ENTRIES,
    SentPrefixes,
)
from router.routing.telemetry import RoutingDecision, RoutingTelemetry

logger = logging.getLogger(__name__)

# Ray Serve pickles this module by value to ship the router class (RequestRouterConfig), and a
# global it captured would travel as a copy: the process-wide singletons are therefore always
# reached through their modules (``telemetry.TELEMETRY``), which are pickled by reference.


def worker_id_of(replica_id: Any) -> str:
    """The worker id a replica publishes under: ``ReplicaID.unique_id`` (``str(...)`` else)."""
    unique_id = getattr(replica_id, "unique_id", None)
    return unique_id if isinstance(unique_id, str) else str(replica_id)


def _credited(lookup: Lookup, recorded: Mapping[str, int] | None, worker_id: str) -> int | None:
    """Leading prompt blocks routing credits ``worker_id`` with: the index's answer, else this
    router's own record, else ``None`` (neither: the policy routes on load alone)."""
    if lookup.cached is not None:
        return lookup.cached.get(worker_id, 0)
    return None if recorded is None else recorded.get(worker_id, 0)


def _export_target(pending_request: Any) -> str | None:
    """The holder a :class:`~contract.kv_transfer.KVExportRequest` names, if the call is one."""
    args = getattr(pending_request, "args", None)
    first = args[0] if args else None
    return first.worker_id if isinstance(first, KVExportRequest) else None


def _holder_or_any(replicas: list[Any], holder: str) -> list[Any]:
    """The replica of worker ``holder``; every replica when it is gone (dead, or scaled
    down), so that one of them refuses the export at once. Ray Serve retries an empty choice
    until the call is cancelled, which would hold the fetch for its whole deadline (as long as
    computing the blocks) before the requester computed them anyway."""
    named = [r for r in replicas if worker_id_of(r.replica_id) == holder]
    return named or list(replicas)


def _stats(replica: Any) -> RoutingStats:
    """``replica``'s last routing report (defaults where it sent none)."""
    return RoutingStats.from_wire(getattr(replica, "routing_stats", None))


def _tier_blocks_past(lookup: Lookup, worker_id: str, in_pool: int) -> int:
    """Of the leading blocks the index credits ``worker_id`` with, those held only in its
    second tier and not among the first ``in_pool``, which a request this router sent there
    just now holds in its working pool. A pool evicts a chain's later blocks first, so the
    tier's are taken to be the last of the credited run."""
    credited = (lookup.cached or {}).get(worker_id, 0)
    return min(lookup.tier.get(worker_id, 0), max(0, credited - in_pool))


def _note_kv_source(pending_request: Any, views: list[ReplicaView], chosen: str) -> None:
    """Tells the chosen worker where more of the prompt's prefix is held, if anywhere: the
    worker crediting the most blocks, when that is more than the chosen one holds."""
    args = getattr(pending_request, "args", None)
    request = args[0] if args else None
    if not isinstance(request, GenerationRequest):
        return
    blocks = {view.worker_id: view.cached_blocks or 0 for view in views}
    holder = max(blocks, key=blocks.__getitem__)
    request.kv_source = (KVSource(holder, blocks[holder])
                         if blocks[holder] > blocks.get(chosen, 0) else None)


LOOKUP_REUSE_S = 1.0
"""Seconds the index's answer for a request is reused while Ray asks again for the same routing
attempt (every replica full, backing off). The holdings barely move in that time, and asking
the index once per retry multiplied its load when the cluster was saturated: a burst of 700
requests made 787 lookups for 482 decisions, at 43 ms each on average."""


def _request_key(pending_request: Any) -> str:
    """Ray's ``internal_request_id`` (stable across retries), else the object's identity."""
    metadata = getattr(pending_request, "metadata", None)
    key = getattr(metadata, "internal_request_id", None)
    return key if isinstance(key, str) and key else f"pending-{id(pending_request)}"


class PrefixAwareRequestRouter(RequestRouter):
    """Ray Serve request router: by default prefix-cache affinity weighed against load, in
    tokens; ``routing="round-robin"`` or ``"power-of-two"`` select the cache-blind baselines.

    Attach to the worker deployment with
    ``@serve.deployment(request_router_config=RequestRouterConfig(
    request_router_class=PrefixAwareRequestRouter, request_router_kwargs={...},
    request_routing_stats_period_s=...))``; the kwargs are those of :meth:`initialize_state`.
    The worker deployment's ``record_routing_stats()`` must return
    ``{"queued_tokens": int, "time": time.time()}`` (see :class:`SentLedger` for the unit), it
    publishes its digests under ``serve.get_replica_context().replica_id.unique_id``, and, unless
    ``model_key`` is configured, its ``record_replica_metadata()`` returns
    ``{"model_key": identity.model_key}``; the keys seen are published to
    :data:`~router.routing.replica_keys.REPLICA_MODEL_KEYS` for the ingress.

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
        routing: str = PrefixPolicy.name,
        block_size: int = DEFAULT_BLOCK_SIZE,
        index_timeout_s: float = DEFAULT_LOOKUP_DEADLINE_S,
        index_first_timeout_s: float = 1.0,
        index_retry_s: float = INDEX_RETRY_S,
        worker_ttl_s: float = 30.0,
        sent_max_age_s: float = 60.0,
        record_max_blocks: int = DEFAULT_MAX_ENTRIES,
        record_max_age_s: float = DEFAULT_MAX_AGE_S,
        index_lag_s: float = DEFAULT_INDEX_LAG_S,
        seed: int | None = None,
        telemetry_sink: RoutingTelemetry | None = None,
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
            routing: the policy, one of ``router.routing.policies.POLICY_NAMES``; only
                ``"prefix"`` asks the index.
            block_size: tokens per KV block; must equal the workers'.
            index_timeout_s: seconds one index lookup may take before routing falls back to
                this router's own record of the prefixes it sent (default sized by
                ``benchmarks/index_deadline.py``, see
                :data:`~router.routing.index_lookup.DEFAULT_LOOKUP_DEADLINE_S`).
            index_first_timeout_s: seconds the first lookup may take: it also connects to the
                index (Redis, or the index actor's handle), which takes longer than a lookup.
            index_retry_s: seconds to route without the index after a failed lookup before
                asking it again (so an outage costs one timeout per period, not per request).
            worker_ttl_s: seconds a worker's index entries live without a refresh.
            sent_max_age_s: seconds after which work this router sent stops counting as load
                even without a completion or a newer stats snapshot.
            record_max_blocks: most ``(worker, block digest)`` pairs kept in the router's own
                record of the prefixes it sent (:class:`SentPrefixes`).
            record_max_age_s: seconds a sent prefix keeps counting in that record.
            index_lag_s: seconds after a request is sent or finishes during which its prompt
                still counts as held by its worker when the index answers without it: the
                worker's events may not have reached the index yet.
            seed: seeds the random choices (tests).
            telemetry_sink: where decisions are recorded (``None``: the process-wide
                :data:`~router.routing.telemetry.TELEMETRY`).

        Raises:
            ValueError: ``routing`` names no policy, or ``block_size``, ``record_max_blocks``
                or ``record_max_age_s`` is not positive. A failure to build the index does not
                raise: it is logged and routing goes without the index.
        """
        self._policy = make_policy(routing, block_size, random.Random(seed))
        self._block_size = block_size
        self._ledger = SentLedger(sent_max_age_s)
        self._sent_prefixes = SentPrefixes(record_max_blocks, record_max_age_s)
        self._index_lag_s = index_lag_s
        # Request id → when it finished; reports older than that still list it.
        self._finished: dict[str, float] = {}
        self._loop: asyncio.AbstractEventLoop | None = None  # the one routing runs on
        finished_requests.FINISHED_REQUESTS.listen(self)
        self._model_key = model_key
        self._worker_model_keys: dict[str, str] = {}
        # Request key → the pending request's future this router watches (one per attempt).
        self._watched: dict[str, asyncio.Future] = {}
        # Request key → (when, the index's answer) for the attempt watched under that key.
        self._attempt_lookups: dict[str, tuple[float, Lookup]] = {}
        self._telemetry = telemetry_sink or telemetry.TELEMETRY
        index = self._build_index(
            redis_url=redis_url,
            key_prefix=key_prefix,
            worker_ttl_s=worker_ttl_s,
            actor_name=index_actor_name,
            actor_namespace=index_actor_namespace,
        ) if self._policy.uses_index else None
        self._lookup = IndexLookup(index, self._telemetry, index_timeout_s,
                                   index_first_timeout_s, index_retry_s, self._get_curr_time_s)

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
        self._loop = asyncio.get_running_loop()
        self._enable_backoff(pending_request)
        if not candidate_replicas:
            return []
        holder = _export_target(pending_request)
        if holder is not None:  # a worker fetching KV: the named holder, or anyone to refuse
            return [_holder_or_any(candidate_replicas, holder)]
        try:
            ranked = await self._rank(candidate_replicas, pending_request)
        except Exception:
            logger.exception("Request routing failed; routing this request on load only.")
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
        self._note_model_keys(by_id)
        plan = routing_input(pending_request)
        key = _request_key(pending_request)
        lookup = await self._attempt_lookup(key, pending_request, plan, by_id, now)
        # From here to recording the choice nothing awaits, so each routing sees every
        # request routed before it, those routed while its lookup was awaited included.
        loads = {wid: self._load_tokens(wid, replica) for wid, replica in by_id.items()}
        recorded = self._recorded_blocks(plan, lookup, by_id, now)
        views = [self._view(wid, plan, lookup, recorded, loads[wid], now,
                            self._adapter_tokens(wid, replica, plan), _stats(replica))
                 for wid, replica in by_id.items()]
        ranked = self._policy.choose(views, plan.prompt_len if plan else 0)
        _note_kv_source(pending_request, views, ranked[0])
        self._record_sent(key, ranked[0], plan, lookup, now, recorded)
        self._watch(key, pending_request)
        self._keep_lookup(key, lookup, now)
        return [by_id[wid] for wid in ranked]

    def _adapter_tokens(self, worker_id: str, replica: Any, plan: RoutingInput | None) -> int:
        """What making the request's adapter resident costs on ``replica``, in tokens of work.

        0 for a base request, a replica that reports nothing, and an adapter in use there by a
        request this router has in flight. Else, for an adapter not resident, its measured
        swap cost from the host tier or its measured read cost; plus, for any adapter not in
        use there, its share of the slots: the wait for a free slot when every one is busy,
        else that wait times the fraction of slots busy once it takes one (bringing other
        adapters' requests closer to a wait). Busy: by the replica's report, or by this router's own
        requests in flight there (fresher). The wait is the larger of the replica's reported
        cost and the work until the first of this router's adapters there frees, while its
        running sequences share steps.
        """
        if plan is None or plan.adapter_digest is None:
            return 0
        stats = RoutingStats.from_wire(getattr(replica, "routing_stats", None))
        in_flight = self._ledger.adapters_in_flight(worker_id, stats.requests)
        if stats.adapters is None or plan.adapter_digest in in_flight:
            return 0
        move = 0
        if plan.adapter_digest not in stats.adapters:
            hosted = plan.adapter_digest in (stats.host_adapters or ())
            move = stats.adapter_swap_tokens if hosted else stats.adapter_read_tokens
        if not stats.adapter_slots:
            return move
        busy = max(stats.adapter_slots_busy, len(in_flight))
        wait = stats.adapter_slot_wait_tokens
        if in_flight:
            wait = max(wait, min(in_flight.values()) * max(1, stats.running))
        if busy >= stats.adapter_slots:
            return move + wait
        # Taking a free slot brings the next request for another adapter closer to a wait
        # (the last one: to a certain wait), so an adapter gathers where it is in use.
        return move + wait * (busy + 1) // stats.adapter_slots

    def _view(self, worker_id: str, plan: RoutingInput | None, lookup: Lookup,
              recorded: Mapping[str, int] | None, load_tokens: int, now: float,
              adapter_tokens: int = 0, stats: RoutingStats | None = None) -> ReplicaView:
        """What the policy sees of one candidate. Its credited blocks are at least those of a
        request in flight there (they are pinned or being computed, and the index hears of
        them only once they are) and those of one sent or finished there within the index's
        lag (an identical request right after a completion would otherwise go anywhere).
        ``stats``: its last routing report, for what fetching and loading KV cost there."""
        credited = _credited(lookup, recorded, worker_id)
        if plan is None:
            return ReplicaView(worker_id, credited, load_tokens)
        tier_blocks = 0
        if credited is not None:
            recent = self._sent_prefixes.leading_blocks(plan.digests, [worker_id], now,
                                                        within_s=self._index_lag_s)
            in_pool = max(recent[worker_id],
                          self._ledger.leading_blocks_in_flight(worker_id, plan.digests))
            tier_blocks = _tier_blocks_past(lookup, worker_id, in_pool)
            credited = max(credited, in_pool)
        # A prompt under one block leaves nothing cached: where it goes is a matter of load.
        other = (self._sent_prefixes.other_prefixes(worker_id, plan.digests, now)
                 if plan.digests else 0)
        stats = stats or RoutingStats()
        return ReplicaView(worker_id, credited, load_tokens, other, adapter_tokens,
                           stats.kv_fetch_tokens_per_block, tier_blocks,
                           stats.kv_tier_load_tokens_per_block)

    async def _attempt_lookup(self, key: str, pending_request: PendingRequest | None,
                              plan: RoutingInput | None, candidates: Mapping[str, Any],
                              now: float) -> Lookup:
        """The index's answer for this routing attempt: the one it got less than
        :data:`LOOKUP_REUSE_S` ago (see :meth:`_keep_lookup`), else a new one."""
        asked_at, lookup = self._attempt_lookups.get(key, (0.0, None))
        if (lookup is not None and now - asked_at < LOOKUP_REUSE_S
                and self._watched.get(key) is getattr(pending_request, "future", None)):
            return lookup
        return await self._look_up(plan, candidates)

    def _keep_lookup(self, key: str, lookup: Lookup, now: float) -> None:
        """Keeps a watched attempt's new index answer for its retries (dropped when the
        attempt ends, in :meth:`_on_routing_done`)."""
        if key in self._watched and self._attempt_lookups.get(key, (None, None))[1] is not lookup:
            self._attempt_lookups[key] = (now, lookup)

    async def _look_up(self, plan: RoutingInput | None, candidates: Mapping[str, Any]) -> Lookup:
        """The index's answer for this request, as far as the policy wants one.

        One lookup per model key among the candidates; a candidate whose key is not known yet
        is left out of it, and so credited with nothing.
        """
        if not self._policy.uses_index:
            return Lookup({})  # a cache-blind policy: nothing to ask, nothing to fall back from
        if plan is None:
            return Lookup(None, "no_prompt")
        groups: dict[str, list[str]] = {}
        for worker_id in candidates:
            model_key = self._worker_model_keys.get(worker_id)
            if model_key:
                groups.setdefault(model_key, []).append(worker_id)
        return await self._lookup.cached_blocks(plan.digests, groups)

    def _recorded_blocks(self, plan: RoutingInput | None, lookup: Lookup,
                         candidates: Mapping[str, Any], now: float) -> dict[str, int] | None:
        """Without the index's answer, the leading blocks of the prompt this router itself sent
        to each candidate; ``None`` when the index answered, the request is unreadable, or
        nothing of the prompt was sent to any candidate (routing is then on load alone)."""
        if lookup.cached is not None or plan is None:
            return None
        recorded = self._sent_prefixes.leading_blocks(plan.digests, candidates, now)
        return recorded if any(recorded.values()) else None

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
        stats = RoutingStats.from_wire(getattr(replica, "routing_stats", None))
        queued = stats.queued_tokens
        if stats.requests is not None:
            queued = sum(tokens for rid, tokens in stats.requests.items()
                         if rid not in self._finished)
        return queued + self._ledger.outstanding(worker_id, stats.time, stats.requests,
                                                 self._finished)

    # ---- model keys ----------------------------------------------------------------------

    def _note_model_keys(self, replicas: Mapping[str, RunningReplica]) -> None:
        """Learns each replica's model key (kept until it dies, for the index's ``forget``)
        and publishes the set of them for the ingress."""
        live_keys = set()
        for worker_id, replica in replicas.items():
            model_key = self._model_key_of(replica)
            if model_key:
                self._worker_model_keys[worker_id] = model_key
                live_keys.add(model_key)
        deployment = (self._deployment_id.app_name, self._deployment_id.name)
        replica_keys.REPLICA_MODEL_KEYS.update(deployment, live_keys)

    def _model_key_of(self, replica: RunningReplica) -> str | None:
        """The configured model key, else the one the replica reports.

        Read from ``replica_metadata`` (the deployment's ``record_replica_metadata()``), then
        from ``routing_stats``: the key hashes the loaded weights, so only the replicas know it.
        """
        if self._model_key:
            return self._model_key
        return (ReplicaMetadata.from_wire(getattr(replica, "replica_metadata", None)).model_key
                or RoutingStats.from_wire(getattr(replica, "routing_stats", None)).model_key)

    # ---- accounting ----------------------------------------------------------------------

    def _record_sent(
        self,
        key: str,
        worker_id: str,
        plan: RoutingInput | None,
        lookup: Lookup,
        now: float,
        recorded: dict[str, int] | None = None,
    ) -> SentEntry:
        """Counts the request's work on ``worker_id`` from now; returns its ledger entry.
        ``recorded``: the blocks this router's own record credited, when it was used."""
        # Recorded at choice time, before Ray confirms the send: requests routed concurrently
        # must already see each other's load.
        entry = SentEntry(worker_id, 0, now, plan, lookup.cached or {}, lookup.fallback,
                          recorded or {})
        entry.tokens = self._work_tokens(plan, entry.credited_blocks(worker_id))
        self._ledger.record(key, entry)
        if plan is not None and plan.request_id:
            self._finished.pop(plan.request_id, None)  # routed again: live work once more
        return entry

    def _work_tokens(self, plan: RoutingInput | None, cached_blocks: int) -> int:
        """Work one request adds to a worker, in tokens (1 for an unreadable request)."""
        return 1 if plan is None else plan.work_tokens(cached_blocks, self._block_size)

    def _watch(self, key: str, pending_request: PendingRequest | None) -> None:
        """Follows the pending request's future: Ray resolves it with the replica it picked,
        or cancels it when the caller gave up before dispatch.

        Calls without arguments (``describe``, health and stats probes) are routed too but
        are not requests: they are kept out of the telemetry's decisions.
        """
        future = getattr(pending_request, "future", None)
        if not isinstance(future, asyncio.Future) or self._watched.get(key) is future:
            return  # backoff asks again for the same attempt: already watched
        self._watched[key] = future
        is_request = bool(getattr(pending_request, "args", None))
        future.add_done_callback(functools.partial(self._on_routing_done, key, is_request))

    def _on_routing_done(self, key: str, is_request: bool, future: asyncio.Future) -> None:
        """The routing attempt ended: settle its entry where Ray sent it (and record the
        decision of a request), or drop it when it was never dispatched (cancelled). Never
        raises."""
        try:
            if self._watched.get(key) is future:
                del self._watched[key]
                self._attempt_lookups.pop(key, None)
            if future.cancelled() or future.exception() is not None:
                self._ledger.remove(key)  # never sent: its work must not count as load
                return
            entry = self._settle(key, worker_id_of(future.result().replica_id))
            if entry is not None:
                self._remember_prefix(entry)
                if is_request:
                    self._record_decision(entry)
        except Exception:
            logger.exception("Routing bookkeeping failed; load accounting may drift briefly.")

    def _settle(self, key: str, worker_id: str) -> SentEntry | None:
        """Moves the entry for ``key`` to ``worker_id`` if Ray sent it elsewhere than the
        first choice (which was full); returns it (``None`` when there is none)."""
        entry = self._ledger.get(key)
        if entry is not None and entry.worker_id != worker_id:
            self._policy.mark_chosen(worker_id)
            tokens = self._work_tokens(entry.plan, entry.credited_blocks(worker_id))
            self._ledger.move(key, worker_id, tokens)
        return entry

    def _remember_prefix(self, entry: SentEntry) -> None:
        """Adds the request's prompt to this router's record of what it sent where."""
        if entry.plan is not None and entry.plan.digests:
            self._sent_prefixes.record(entry.worker_id, entry.plan.digests,
                                       self._get_curr_time_s())

    def _record_decision(self, entry: SentEntry) -> None:
        blocks = entry.cached.get(entry.worker_id, 0)
        self._telemetry.record(RoutingDecision(
            at=time.time(),
            worker_id=entry.worker_id,
            policy=self._policy.name,
            prompt_tokens=entry.plan.prompt_len if entry.plan is not None else 0,
            cached_blocks=blocks,
            cached_tokens=blocks * self._block_size,
            fallback=entry.fallback,
            record_blocks=entry.recorded.get(entry.worker_id, 0),
        ))

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any
    ) -> None:
        """Ray Serve hook: the replica accepted the request. Counts its work there from now.

        A replica that rejected the request first has already reported it completed, which
        removed its entry; it is recorded again here, as live work on the accepting replica.
        Never raises.
        """
        try:
            worker_id = worker_id_of(replica_id)
            key = _request_key(pending_request)
            now = self._get_curr_time_s()
            entry = self._settle(key, worker_id)
            if entry is None:
                entry = self._record_sent(key, worker_id, routing_input(pending_request),
                                          Lookup({}), now)
            else:
                entry.sent_at = now
            self._remember_prefix(entry)
        except Exception:
            logger.exception("on_request_routed failed; load accounting may drift briefly.")

    def request_finished(self, request_id: str) -> None:
        """The ingress has request ``request_id``'s last chunk; its work stops counting as load
        from now, before Ray Serve's completion reaches this router
        (:mod:`~router.routing.finished_requests`). Callable from any thread; never raises."""
        loop = self._loop
        if loop is None:
            return  # this router has routed nothing yet
        with contextlib.suppress(RuntimeError):  # a closed loop: the router is gone
            loop.call_soon_threadsafe(self._mark_finished, request_id)

    def _mark_finished(self, request_id: str) -> None:
        self._finished[request_id] = self._get_curr_time_s()

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        """Ray Serve hook: the request finished (or was rejected or cancelled). Never raises."""
        try:
            entry = self._ledger.get(internal_request_id)
            if entry is None or entry.worker_id != worker_id_of(replica_id):
                return
            # A rejected attempt lands here too; on_request_routed then records it again.
            if entry.plan is not None and entry.plan.request_id:
                self._finished[entry.plan.request_id] = self._get_curr_time_s()
            # Its blocks are now held there, and the index may not have heard of them yet.
            self._remember_prefix(entry)
            self._ledger.remove(internal_request_id)
        except Exception:
            logger.exception("on_request_completed failed; the entry will age out.")

    # ---- replica lifecycle ---------------------------------------------------------------

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        """Ray Serve hook: the replica set changed. Drops state of replicas that are gone and
        publishes the live replicas' model keys (a redeploy shows here first)."""
        super().update_replicas(replicas)
        by_id = {worker_id_of(replica.replica_id): replica for replica in replicas}
        live = set(by_id)
        self._policy.retain(live)
        self._ledger.retain(live)
        self._sent_prefixes.retain(live)
        for worker_id in [w for w in self._worker_model_keys if w not in live]:
            del self._worker_model_keys[worker_id]
        self._note_model_keys(by_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        """Ray Serve hook: the replica's actor died. Forgets it locally and in the index.

        The index call runs in the background (fire and forget); its failure is logged, and the
        index's worker TTL removes the entries anyway. Never raises.
        """
        super().on_replica_actor_died(replica_id)
        try:
            worker_id = worker_id_of(replica_id)
            self._policy.forget(worker_id)
            self._ledger.drop_worker(worker_id)
            self._sent_prefixes.drop_worker(worker_id)
            model_key = self._worker_model_keys.pop(worker_id, None) or self._model_key
            if model_key is not None:  # else its key is unknown here; the index TTL expires it
                self._lookup.forget_in_background(model_key, worker_id)
        except Exception:
            logger.exception("Could not forget dead replica %s.", replica_id)
