"""The worker: a Ray Serve replica that owns one engine (one GPU in production, CPU here)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from collections.abc import AsyncIterator, Callable

import ray
from ray import serve
from ray.serve.handle import DeploymentHandle

from cluster.config import INDEX_ACTOR_NAMESPACE, ClusterConfig
from cluster.event_publisher import EventPublisher
from cluster.replica_logs import route_to_serve_logger
from contract.description import WorkerDescription
from contract.identity import AdapterRef
from contract.kv_transfer import KVBlock, KVExportRequest
from contract.load import ReplicaMetadata, RoutingStats
from contract.request import GenerationChunk, GenerationRequest, InvalidRequestError
from router.errors import OverloadedError
from router.index import make_index
from workers.async_engine import AsyncEngine
from workers.block_manager import BlockManager
from workers.engine import LLMEngine
from workers.lora.admission import AdapterAdmission
from workers.lora.errors import AdapterError
from workers.lora.registry import AdapterSlotsFull
from workers.speculative.remote import RemoteProposer

log = logging.getLogger(__name__)


class TokenRate:
    """Tokens this worker computes per second while it computes: an exponentially weighted
    mean of the rate between two readings of its token counter, over readings in which the
    counter moved (an idle worker keeps its last rate). 0 until the first such reading.

    Args:
        weight: the newest rate's share of the mean, in (0, 1].
    """

    def __init__(self, weight: float = 0.3):
        self.weight = weight
        self.rate = 0.0
        self._last: tuple[int, float] | None = None

    def update(self, tokens: int, now: float) -> float:
        """The rate after a reading of ``tokens`` computed in all at ``now`` (seconds)."""
        if self._last is not None:
            last_tokens, last_time = self._last
            if tokens > last_tokens and now > last_time:
                rate = (tokens - last_tokens) / (now - last_time)
                self.rate = rate if not self.rate else (
                    self.weight * rate + (1 - self.weight) * self.rate)
        self._last = (tokens, now)
        return self.rate


class TransferCost:
    """Whether fetching KV blocks from another worker beats computing them, from measured
    rates: the moving average of a fetch's seconds per block, against what the engine measures
    a prompt token to cost at its depth (``BlockManager.recompute_s``). Once fetches measure
    slower, one fetch is still tried every :attr:`RETRY_S` (a circuit breaker's half-open
    state): a fetch that was slow while the holder was busy would otherwise stop fetching for
    the worker's lifetime, since without fetches the average never moves again.

    Args:
        block_manager: the engine's, which predicts what computing blocks costs.
        weight: the newest fetch's share of the average, in (0, 1].
        clock: seconds, monotonic.
    """

    MIN_DEADLINE_S = 0.25
    UNMEASURED_DEADLINE_S = 5.0
    RETRY_S = 30.0

    def __init__(self, block_manager: BlockManager, weight: float = 0.3,
                 clock: Callable[[], float] = time.monotonic):
        self.block_manager = block_manager
        self.weight = weight
        self.clock = clock
        self.fetch_s_per_block: float | None = None
        self._last_try = -math.inf

    def deadline_s(self, first_block: int, num_blocks: int) -> float | None:
        """How long a fetch of a prompt's ``num_blocks`` blocks from block ``first_block`` on
        may take: what computing them would (at least :attr:`MIN_DEADLINE_S`); None when the
        last fetches were slower than computing and a fetch was tried within
        :attr:`RETRY_S`. Returning a deadline counts as a try: ask only for a fetch that will
        be made."""
        compute_s = self.block_manager.recompute_s(first_block, num_blocks)
        if compute_s is None:
            return self.UNMEASURED_DEADLINE_S
        now = self.clock()
        if (self.fetch_s_per_block is not None and self.fetch_s_per_block * num_blocks >= compute_s
                and now - self._last_try < self.RETRY_S):
            return None
        self._last_try = now
        return max(self.MIN_DEADLINE_S, compute_s)

    def observe(self, num_blocks: int, seconds: float) -> None:
        """A fetch brought ``num_blocks`` in ``seconds``, the round trip included."""
        self._last_try = self.clock()
        if num_blocks:
            sample = seconds / num_blocks
            last = self.fetch_s_per_block
            self.fetch_s_per_block = sample if last is None else (
                self.weight * sample + (1 - self.weight) * last)


class ClientErrorLogFilter(logging.Filter):
    """Turns Ray Serve's "Request failed." record for a request the worker refused (an
    :class:`InvalidRequestError`, an :class:`OverloadedError` or an adapter's
    :class:`AdapterError`: the client gets its 4xx or 503) into one INFO line without a
    traceback. Serve logs every exception a replica method raises with ``logger.exception``,
    so a misspelt schema read as a worker failure with a traceback, and each refused adapter
    load as one on every worker. Every other record passes as it is."""

    REFUSED = (InvalidRequestError, OverloadedError, AdapterError)

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, self.REFUSED):
            record.msg, record.args = "Request refused (%s): %s", (type(exc).__name__, exc)
            record.levelno, record.levelname = logging.INFO, "INFO"
            record.exc_info = record.exc_text = None
        return True

    @classmethod
    def install(cls, logger: logging.Logger) -> None:
        """Adds the filter to ``logger`` unless it already has one (a process may host more
        than one replica)."""
        if not any(isinstance(f, cls) for f in logger.filters):
            logger.addFilter(cls())


def replica_worker_id() -> str:
    """The id the router knows this replica by (Ray Serve gives a replacement a new one)."""
    return serve.get_replica_context().replica_id.unique_id


class NalarWorker:
    """One engine behind a Serve replica; publishes its KV digests to the index.

    Args:
        config: the cluster configuration.
        draft: handle to the draft deployment when the proposer runs remotely (the engine then
            proposes through a :class:`~workers.speculative.remote.RemoteProposer`); else ``None``
            and the engine builds its proposer in process.
    """

    async def __init__(self, config: ClusterConfig, draft: DeploymentHandle | None = None):
        started = time.perf_counter()
        route_to_serve_logger()
        ClientErrorLogFilter.install(logging.getLogger("ray.serve"))  # Serve's replica logger
        self.worker_id = replica_worker_id()
        self.served_model_name = config.served_model_name
        engine_config = config.engine_config()
        self.proposer = None
        if draft is not None:
            self.proposer = RemoteProposer(draft, config.draft_deadline_s,
                                           name=f"remote-{config.speculative}")
        self.engine = LLMEngine(engine_config, proposer=self.proposer)
        warm_up_s = self.engine.warm_up()  # before the index hears of anything
        self.identity = self.engine.identity
        index = make_index(config.redis_url, config.key_prefix, config.worker_ttl_s,
                           config.index_actor_name, actor_namespace=INDEX_ACTOR_NAMESPACE)
        self.publisher = EventPublisher(index, self.identity.model_key, self.worker_id,
                                        self.engine.pool.held_state,
                                        config.worker_ttl_s / 3)
        self.async_engine = AsyncEngine(self.engine, self.publisher.submit_threadsafe)
        self._token_rate = TokenRate()
        self._worker_handle: DeploymentHandle | None = None
        self.transfer_cost = TransferCost(self.engine.block_manager)
        self.adapter_admission = AdapterAdmission(self.engine.adapters)
        if self.engine.pool.tier is not None:  # transfers land in the tier: none without it
            self._peers_ready = asyncio.get_running_loop().create_task(self._connect_to_peers())
        self.startup_s = time.perf_counter() - started
        log.info("worker %s ready in %.1f s (warm-up %.2f s): %d KV blocks of %d tokens, dtype %s",
                 self.worker_id, self.startup_s, warm_up_s, self.engine.pool.num_blocks,
                 config.block_size, self.engine.loaded.dtype)

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        """Stream the request's chunks, each stamped with this worker's id.

        The first chunk carries no tokens: it confirms the request was accepted (an invalid one
        raises InvalidRequestError instead) and names the worker before any token is ready.
        A dead engine raises ``EngineDeadError`` before that chunk.
        """
        await self._ensure_adapter(request)
        await self._fetch_prefix(request)
        try:
            chunks = self.async_engine.submit(request)
        except BaseException:
            self.engine.adapters.release(request.adapter)  # never reaches the engine's admit
            raise
        try:
            yield GenerationChunk(request.request_id, [], "", None, len(request.token_ids), 0,
                                  0, self.worker_id)
            async for chunk in chunks:
                chunk.worker_id = self.worker_id
                yield chunk
        finally:
            chunks.close()  # a cancelled or abandoned stream aborts its request

    async def _fetch_prefix(self, request: GenerationRequest) -> None:
        """Fetches the prompt's blocks that another worker holds and this one does not
        (``request.kv_source``, set by the router) into the working pool (or, where it has no
        room for them, the second tier), where admission finds them: when there is a tier,
        and the last fetches were faster than computing the blocks. A fetch gets as long as
        computing them would take; a holder that fails or is slower means they are computed.
        Never raises."""
        source = request.kv_source
        if (source is None or source.worker_id == self.worker_id
                or self.engine.pool.tier is None or request.prompt_digests is None):
            return
        try:
            held, end = await self.async_engine.call(self.engine.fetch_range, request,
                                                     source.blocks)
            wanted = request.prompt_digests.digests[held:end]
            if not wanted:
                return
            deadline = self.transfer_cost.deadline_s(held, len(wanted))  # records a try
            if deadline is None:
                return
            started = time.perf_counter()
            blocks = await asyncio.wait_for(self._workers().export_kv.remote(
                KVExportRequest(source.worker_id, wanted)), deadline)
            accepted = await self.async_engine.call(self.engine.import_blocks, request, held,
                                                    blocks)
            elapsed = time.perf_counter() - started
            self.transfer_cost.observe(accepted, elapsed)
            self.engine.transfers.import_seconds += elapsed
        except Exception as exc:  # a dead or slow holder: the prompt is computed
            self.engine.transfers.failed_fetches += 1
            log.info("request %s: no KV from worker %s (%s: %s); computing it",
                     request.request_id, source.worker_id, type(exc).__name__, exc)

    async def export_kv(self, request: KVExportRequest) -> list[KVBlock]:
        """Copies of the blocks ``request`` names that this worker holds, leading ones first,
        for another worker; taken between two engine steps.

        An export of nothing is a peer handle's warm-up (``_connect_to_peers``), which the
        router may send to another replica while it does not know the caller yet: answered
        empty, never refused (a refusal would log a replica error for a worker that starts).

        Raises:
            LookupError: ``request`` names another worker and some blocks: its holder is gone,
                and the router sent the call here so that the requester computes the blocks
                at once.
        """
        if not request.digests:
            return []
        if request.worker_id != self.worker_id:
            raise LookupError(f"worker {request.worker_id} is gone (asked {self.worker_id})")
        return await self.async_engine.call(self.engine.export_blocks, request.digests)

    async def _connect_to_peers(self) -> None:
        """Sets up the handle KV is fetched through, with an empty export from this replica
        itself once it serves: the first call's setup (the handle's router learning the
        replicas, about a second) would otherwise count against the first fetch's deadline,
        which is as short as computing the blocks. Never raises."""
        try:
            await self._workers().export_kv.remote(KVExportRequest(self.worker_id, []))
        except Exception as exc:  # the first fetch sets it up instead
            log.info("worker %s: peer handle not set up (%s: %s)", self.worker_id,
                     type(exc).__name__, exc)

    def _workers(self) -> DeploymentHandle:
        """A handle to this worker's own deployment, for calls to other replicas."""
        if self._worker_handle is None:
            context = serve.get_replica_context()
            self._worker_handle = serve.get_deployment_handle(context.deployment,
                                                              context.app_name)
        return self._worker_handle

    async def _ensure_adapter(self, request: GenerationRequest) -> None:
        """Make the request's adapter resident (:class:`AdapterAdmission`): moved back from
        the host tier, or read if this replica does not hold it (evicted, or loaded on other
        replicas only), in a thread while the engine keeps stepping; while every slot is in
        use, the request waits for one.

        Raises:
            OverloadedError: every adapter slot stayed in use (503, retry).
            InvalidRequestError: the adapter cannot be read or changed on disk (404).
        """
        try:
            await self.adapter_admission.ensure(request.adapter)
        except AdapterSlotsFull as exc:
            raise OverloadedError(str(exc), retry_after_s=1.0) from exc

    async def load_lora_adapter(self, name: str, path: str) -> AdapterRef:
        """Read an adapter from ``path`` (under ``--lora-dir``) and hold it as ``name``, in a
        thread (the engine keeps stepping); returns its :class:`AdapterRef`.

        Raises:
            AdapterError: the path is not allowed, the adapter does not fit or is malformed, or
                another adapter is loaded under ``name``.
            OverloadedError: every adapter slot is in use.
        """
        try:
            adapter = await asyncio.to_thread(self.engine.adapters.load, name, path, True)
        except AdapterSlotsFull as exc:
            raise OverloadedError(str(exc), retry_after_s=1.0) from exc
        return adapter.ref

    def lora_adapters(self) -> dict[str, AdapterRef]:
        """Every adapter this replica knows (``AdapterRegistry.refs``): what a restarted
        ingress recovers (``cluster.adapters.AdapterCatalog.recover``)."""
        return self.engine.adapters.refs()

    def unload_lora_adapter(self, name: str) -> bool:
        """Forget adapter ``name`` (requests running under it finish); False if unknown."""
        try:
            self.engine.adapters.unload(name)
        except KeyError:
            return False
        return True

    def check_health(self) -> None:
        """Ray Serve's periodic health probe: raises when the engine loop is dead, so Serve
        marks this replica unhealthy and starts a replacement (with a new replica id, so the
        router never credits it with this one's blocks)."""
        self.async_engine.check_health()

    def describe(self) -> WorkerDescription:
        """What the ingress needs to tokenize and hash exactly as this worker does."""
        loaded = self.engine.loaded
        return WorkerDescription(
            worker_id=self.worker_id, node_id=ray.get_runtime_context().get_node_id(),
            identity=self.identity, served_name=loaded.served_name,
            source_path=str(loaded.source_path), max_model_len=self.engine.max_model_len,
            vocab_size=self.engine.vocab_size, num_blocks=self.engine.pool.num_blocks,
            startup_s=self.startup_s, adapters=self.engine.adapters.refs())

    def record_routing_stats(self) -> dict:
        """This worker's :class:`~contract.load.RoutingStats`, every ``routing_stats_period_s``
        (as the dict Serve carries)."""
        scheduler = self.engine.scheduler
        per_request = self.engine.load_by_request()
        counters = self.engine.counters
        rate = self._token_rate.update(counters.prefill_tokens + counters.decode_tokens,
                                       time.monotonic())
        adapters = self.engine.adapters
        busy, estimate = self.engine.adapter_slots_busy()
        mean_wait_s = self.adapter_admission.mean_slot_wait_s()
        return RoutingStats(queued_tokens=sum(per_request.values()), requests=per_request,
                            running=len(scheduler.running), waiting=len(scheduler.waiting),
                            time=time.time(), model_key=self.identity.model_key,
                            worker_id=self.worker_id, adapters=adapters.held_digests(),
                            host_adapters=adapters.held_digests("host"),
                            adapter_read_tokens=round(adapters.mean_read_s() * rate),
                            adapter_swap_tokens=round(adapters.mean_swap_s() * rate),
                            adapter_slots=adapters.max_loras, adapter_slots_busy=busy,
                            adapter_slot_wait_tokens=max(estimate, round(mean_wait_s * rate)),
                            kv_fetch_tokens_per_block=self._tier_tokens(
                                self.transfer_cost.fetch_s_per_block, rate),
                            kv_tier_load_tokens_per_block=self._tier_tokens(
                                self._tier_load_s_per_block(), rate),
                            ).to_wire()

    def _tier_load_s_per_block(self) -> float | None:
        tier = self.engine.pool.tier
        return None if tier is None else tier.counters.load_s_per_block

    def _tier_tokens(self, seconds_per_block: float | None, rate: float) -> int | None:
        """What moving a KV block in (fetching it, or loading it from the second tier) costs
        here, in tokens of work at ``rate`` tokens per second, at least 1; None without a
        second tier or a measurement.

        Never 0: rounded down to nothing, a worker that would fetch a whole prefix scored the
        same as the worker holding it, and such a tie goes to the worker chosen less recently,
        so an idle client's repeated prompt went to the other worker to be fetched (CI,
        ``tests/cluster/test_routing_metrics_e2e.py``). A block moved in always costs some
        work, of this worker and of its holder."""
        if self.engine.pool.tier is None or seconds_per_block is None:
            return None
        return max(1, round(seconds_per_block * rate))

    def record_replica_metadata(self) -> dict:
        """Static facts the router reads once (:class:`~contract.load.ReplicaMetadata`): the
        key this worker's digests are indexed under."""
        return ReplicaMetadata(self.identity.model_key, self.worker_id).to_wire()

    def engine_stats(self) -> dict:
        """Counters for tests and ``/metrics`` (``cluster.metrics``): all monotonic except the
        pool's block states and the ``running``/``waiting`` sequence counts.

        ``spec`` is the engine's speculative decoding summed over every request (committed
        tokens only, as each request's ``usage.speculative`` counts them); ``draft_*`` at the
        top level are the remote draft client's counts (only when drafting remotely).
        ``histograms`` are the request-latency histograms by name, each as
        :meth:`workers.request_metrics.Histogram.snapshot` gives it; ``prompt_tokens`` and
        ``generation_tokens`` count what requests' ``usage`` counts. ``lora`` is the LoRA
        adapters held and in use (``_lora_stats``).
        """
        pool = self.engine.pool
        scheduler = self.engine.scheduler
        request_metrics = self.engine.request_metrics
        return {
            "worker_id": self.worker_id,
            "model_name": self.served_model_name or self.engine.loaded.served_name,
            "prompt_tokens": request_metrics.prompt_tokens,
            "generation_tokens": request_metrics.generation_tokens,
            "histograms": request_metrics.snapshot(),
            "prefill_tokens": self.engine.counters.prefill_tokens,
            "decode_tokens": self.engine.counters.decode_tokens,
            "steps": self.engine.counters.steps,
            "borrowed_core_steps": self.engine.counters.borrowed_core_steps,
            "prefix_query_tokens": self.engine.scheduler.counters.prefix_query_tokens,
            "prefix_hit_tokens": self.engine.scheduler.counters.prefix_hit_tokens,
            "tier_hit_tokens": self.engine.scheduler.counters.tier_hit_tokens,
            "transfer_hit_tokens": self.engine.scheduler.counters.transfer_hit_tokens,
            "preemptions": self.engine.scheduler.counters.preemptions,
            "shared_prefix_waits": self.engine.scheduler.counters.shared_prefix_waits,
            "blocks_total": pool.num_blocks,
            "blocks_free": pool.num_free,
            "blocks_evictable": pool.num_evictable,
            "blocks_in_use": pool.num_in_use,
            "running": len(scheduler.running),
            "waiting": len(scheduler.waiting),
            "spec": self._spec_stats(),
            "lora": self._lora_stats(),
            **self._tier_stats(),
            "kv_transfer": dataclasses.asdict(self.engine.transfers),
            **self._draft_stats(),
        }

    def _tier_stats(self) -> dict:
        """The second KV tier's counters (none without a tier)."""
        tier = self.engine.pool.tier
        if tier is None:
            return {}
        counters = dataclasses.asdict(tier.counters)
        del counters["load_s_per_block"]
        return {"kv_tier": {**counters, "blocks": len(tier), "capacity": tier.num_blocks}}

    def _lora_stats(self) -> dict:
        """Adapters held per tier, the limit, and those of running and waiting sequences
        (names)."""
        scheduler = self.engine.scheduler

        def names(seqs) -> list[str]:
            return sorted({seq.adapter.name for seq in seqs if seq.adapter is not None})
        adapters = self.engine.adapters
        held = adapters.held()
        return {"max_loras": adapters.max_loras, "loaded": len(held), "held": held,
                "hosted": adapters.hosted(), "known": len(adapters.refs()),
                "loads": adapters.loads, "load_seconds": adapters.load_s,
                "swaps": adapters.swaps, "swap_seconds": adapters.swap_s,
                "evictions": adapters.evictions, "host_evictions": adapters.host_evictions,
                "requests": self.adapter_admission.requests,
                "waits": dict(self.adapter_admission.by_source),
                "slot_wait_seconds": self.adapter_admission.slot_wait_s,
                "running": names(scheduler.running), "waiting": names(scheduler.waiting)}

    def _spec_stats(self) -> dict:
        """The engine's speculative totals (a snapshot: lists and dicts copied)."""
        spec = self.engine.counters.spec
        return {
            "method": self.engine.proposer.name if self.engine.proposer else None,
            "proposed_tokens": spec.proposed_tokens,
            "accepted_tokens": spec.accepted_tokens,
            "rejected_tokens": spec.rejected_tokens,
            "verification_steps": spec.verification_steps,
            "accepted_by_position": list(spec.accepted_by_position),
            "proposed_by_position": list(spec.proposed_by_position),
            "k_decisions": dict(spec.k_decisions),
            "draft_s": spec.draft_s,
            "verify_s": spec.verify_s,
            "draft_calls": self.engine.speculation.draft_calls if self.engine.speculation else 0,
        }

    def _draft_stats(self) -> dict:
        """Remote draft calls made, missed deadlines, failures and batches skipped while
        backing off (nothing when the proposer runs in process)."""
        proposer = self.proposer
        if proposer is None:
            return {}
        return {"draft_calls": proposer.calls, "draft_timeouts": proposer.timeouts,
                "draft_failures": proposer.failures, "draft_skipped": proposer.skipped}

    async def __del__(self):
        """Serve's clean shutdown: stop the engine (no more events), then remove this worker's
        index entries (the publisher's ``close``), so the router stops crediting it at once
        instead of one TTL later."""
        self.async_engine.shutdown()
        await self.publisher.close()
