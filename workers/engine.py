"""The engine: continuous batching over a paged KV cache with identity-checked prefix reuse.

Synchronous core; ``workers.async_engine`` runs it in a thread and streams its outputs.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from itertools import accumulate, chain

import torch

from contract.identity import CacheIdentity
from contract.kv_events import KVEvent
from contract.kv_transfer import KVBlock
from contract.load import work_tokens
from contract.request import (
    FinishReason,
    GenerationChunk,
    GenerationRequest,
    InvalidRequestError,
    SamplingParams,
    SpecUsage,
    TokenLogprob,
)
from workers.block_manager import BlockManager
from workers.block_pool import BlockPool
from workers.choices import Choices
from workers.config import EngineConfig
from workers.detokenizer import IncrementalDetokenizer
from workers.host_cores import BORROW_MIN_PROMPT_TOKENS, HostCores
from workers.kv_budget import kv_cache_budget
from workers.kv_cache import PagedKVCache
from workers.kv_tier import FileSlots, HostSlots, KVTier
from workers.kv_transfer import TransferCounters, export_blocks, import_blocks
from workers.lora.adapter import BaseShapes
from workers.lora.registry import AdapterRegistry
from workers.model_loader import LoadedModel, load_model, numerics_tag
from workers.model_runner import ModelRunner
from workers.model_support import check_supported
from workers.models.linear import bound_primitive_caches
from workers.request_metrics import RequestMetrics
from workers.sampler import SampledToken, SamplingRow, prompt_logprobs, sample
from workers.scheduler import ScheduledBatch, Scheduler, SchedulerCounters
from workers.sequence import Sequence
from workers.speculative.build import build_proposer
from workers.speculative.decoding import SpeculativeDecoding
from workers.speculative.proposer import Proposer
from workers.step_time import (
    AUTO,
    PromptCostModel,
    StepCostModel,
    StepTimeTarget,
    auto_cap_s,
    auto_target_long_prompts_only,
    auto_target_s,
)
from workers.structured.grammar import GrammarCompiler
from workers.structured.masks import PositionMask
from workers.structured.step_masks import MaskJob, StepMasks

log = logging.getLogger(__name__)

WARM_UP_PROMPT_TOKENS = 256
"""Length of :meth:`LLMEngine.warm_up`'s prompt: a prefill long enough to take the prompt
kernels and to measure a prompt token's cost, 0.15-0.4 s on one CPU core for SmolLM2."""

WARM_UP_FIRST_ID = 1000
"""The warm-up prompt's token ids count up from here, past the special tokens of the
vocabularies we serve (from the middle of a vocabulary smaller than twice this)."""


class StepFailedError(RuntimeError):
    """An engine step raised; only the requests it names were aborted.

    A failure of the whole step (the forward pass, the block commit) names every request of
    its batch. A failure of one row after the forward pass (its structured-output mask, its
    sampling, committing its tokens) names only that row's request: the step's other rows
    committed their tokens as usual, and their chunks are in :attr:`chunks`.

    Attributes:
        request_ids: the aborted requests.
        cause: the original exception (a failed row's, where rows failed: the first's).
        causes: each aborted request's own cause, where rows failed (its row's exception:
            two requests may fail in one step for reasons of their own).
        chunks: the step's chunks for every request not aborted, to deliver as
            :meth:`LLMEngine.step` would have returned them.
    """

    def __init__(self, request_ids: list[str], cause: BaseException,
                 chunks: list[GenerationChunk] | None = None,
                 causes: dict[str, BaseException] | None = None):
        super().__init__(f"engine step failed for {len(request_ids)} request(s): "
                         f"{type(cause).__name__}: {cause}")
        self.request_ids = request_ids
        self.cause = cause
        self.causes = causes or {}
        self.chunks = chunks or []

    def cause_of(self, request_id: str) -> BaseException:
        """Why ``request_id`` was aborted."""
        return self.causes.get(request_id, self.cause)


@dataclass
class EngineCounters:
    """Monotonic engine counts.

    Attributes:
        steps: forward passes run.
        borrowed_core_steps: steps that also ran on idle workers' cores
            (``workers.host_cores``).
        prefill_tokens: tokens computed at prompt positions (a prefix hit skips them).
        decode_tokens: tokens computed at output positions.
        batch_sizes: histogram: sequences per step → number of steps.
        spec: speculative decoding summed over every request (committed tokens only).
    """

    steps: int = 0
    borrowed_core_steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    batch_sizes: Counter = field(default_factory=Counter)
    spec: SpecUsage = field(default_factory=SpecUsage)


@dataclass
class StepRows:
    """A computed step's outputs, per row of its batch.

    Attributes:
        logits: ``[N, V]`` float32: each row's ``num_logits[i]`` rows, in batch order.
        num_logits: logit rows per batch row.
        starts: each row's computed tokens before the step.
        samples: whether each row samples (or verifies) this step.
        masks: per constrained row that samples, its position masks, or the exception its
            matcher raised.
        elapsed: the forward pass's seconds.
    """

    logits: torch.Tensor
    num_logits: list[int]
    starts: list[int]
    samples: list[bool]
    masks: dict[int, list[PositionMask] | Exception]
    elapsed: float
    offsets: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.offsets = [0, *accumulate(self.num_logits)]

    def of(self, i: int) -> torch.Tensor:
        """Row ``i``'s logits, ``[num_logits[i], V]``."""
        return self.logits[self.offsets[i]:self.offsets[i + 1]]


class LLMEngine:
    """One worker's engine: continuous batching (Orca, Yu et al. 2022) over a paged KV cache
    (vLLM, Kwon et al. 2023), with chunked prefill, identity-checked prefix reuse and
    speculative decoding.

    A request enters through :meth:`add_request` (or :meth:`validate` then :meth:`admit`, as
    the async engine does across threads) and leaves in the chunks :meth:`step` returns.

    Args:
        config: engine configuration.
        loaded: an already loaded model (tests share one); None loads ``config.model``.
        proposer: the draft proposer when ``config.speculative`` is on (a draft replica's
            client, or a test's); None builds the configured local one (``ngram``,
            ``suffix``; the ``model`` proposer must be given).

    Raises:
        ValueError: an invalid speculative configuration, the ``model`` proposer asked for
            without being given, or a ``step_time_target_s`` or ``max_step_time_s`` that is
            neither seconds, None nor ``auto``.
    """

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None,
                 proposer: Proposer | None = None):
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        bound_primitive_caches()
        self.config = config
        self.loaded = loaded or load_model(config.model, config.dtype, config.device,
                                            quantization=config.quantization)
        self.tokenizer = self.loaded.tokenizer
        model_config = self.loaded.model.config
        kv_cache = PagedKVCache.from_budget(model_config, kv_cache_budget(config, self.loaded),
                                            config.block_size, self.loaded.dtype,
                                            self.loaded.device)
        self.pool = BlockPool(kv_cache.num_blocks, config.block_size)
        self.pool.tier = _second_tier(config, kv_cache)
        self.prompt_costs = PromptCostModel()
        self.block_manager = BlockManager(self.pool, self.prompt_costs)
        self.decode_steps = StepCostModel()
        self.step_masks = StepMasks()
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs,
                                   config.max_num_batched_tokens,
                                   config.max_num_partial_prefills,
                                   config.long_prefill_token_threshold,
                                   config.scheduling_policy, step_target=self._step_target())
        model_limit = getattr(model_config, "max_position_embeddings", None) or 1 << 30
        self.max_model_len = min(config.max_model_len or model_limit, model_limit,
                                 kv_cache.num_blocks * config.block_size)
        if config.max_model_len and self.max_model_len < config.max_model_len:
            log.warning("max_model_len %d lowered to %d tokens: the model's limit is %d and "
                        "the KV cache holds %d (%d blocks of %d)", config.max_model_len,
                        self.max_model_len, model_limit, kv_cache.num_blocks * config.block_size,
                        kv_cache.num_blocks, config.block_size)
        # Refuse, naming them, features the paged runner would silently drop; before the
        # runner fuses the model's weights.
        check_supported(model_config, self.max_model_len, self.loaded.model)
        self.runner = ModelRunner(self.loaded.model, kv_cache)
        self.host_cores = _host_cores(config, self.loaded.device)
        refusal = (None if self.runner.implementation == "compact" else
                   f"LoRA adapters need a Llama-style model; "
                   f"{type(self.loaded.model).__name__} runs on transformers' modules")
        self.adapters = AdapterRegistry(BaseShapes.of(self.loaded.model), self.loaded.dtype,
                                        self.loaded.device, config.max_lora_rank,
                                        config.max_loras, config.lora_dirs,
                                        self.adapters_in_use, refusal, config.max_cpu_loras)
        self.identity = CacheIdentity(self.loaded.model_digest,
                                      numerics_tag(self.loaded.device, self.runner.kernels),
                                      config.block_size)
        self.vocab_size = model_config.vocab_size
        self.eos_token_ids = self._eos_token_ids()
        self._zero_counts()
        self._seqs: dict[str, Sequence] = {}
        self._choices = Choices()
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        spec = config.speculative
        spec.validate()
        self.speculation = None
        if spec.enabled:
            self.speculation = SpeculativeDecoding(proposer or build_proposer(spec), spec,
                                                   self.vocab_size, self.counters.spec,
                                                   self.decode_steps)
        self._generator = torch.Generator()
        if config.seed is None:
            self._generator.seed()  # OS entropy: unseeded requests differ across workers
        else:
            self._generator.manual_seed(config.seed)
        for name, path in config.lora_modules.items():
            self.adapters.load(name, path)

    def _step_target(self) -> StepTimeTarget | None:
        device, quantization = self.loaded.device.type, self.loaded.quantization
        seconds = _step_limit("step_time_target_s", self.config.step_time_target_s,
                              lambda: auto_target_s(device, quantization))
        cap_s = _step_limit("max_step_time_s", self.config.max_step_time_s,
                            lambda: auto_cap_s(device))
        if seconds is None and cap_s is None:
            return None
        long_only = (self.config.step_time_target_s == AUTO
                     and auto_target_long_prompts_only(quantization))
        return StepTimeTarget(seconds, cap_s, self.decode_steps, self.prompt_costs,
                              self.config.block_size, long_prompts_only=long_only)

    def adapters_in_use(self) -> set[str]:
        """Names of the adapters some sequence (running, waiting or preempted) is using; safe
        to call off the engine thread (it reads a copy of the sequence table)."""
        seqs = self._seqs.copy()
        return {seq.adapter.name for seq in seqs.values() if seq.adapter is not None}

    def adapter_slots_busy(self) -> tuple[int, int]:
        """Resident adapter slots in use, and what a request for another adapter would wait
        for one once none is free, in tokens of work (the router's unit): until the busy
        adapter whose last sequence ends first is free, while the running sequences share
        steps, so each computes about as many tokens as that one has left (0 when none is
        busy). Safe to call off the engine thread (it reads a copy of the sequence table)."""
        left: dict[str, int] = {}
        for seq in self._seqs.copy().values():
            if seq.adapter is not None:
                work = work_tokens(seq.num_uncomputed_tokens,
                                   seq.sampling.max_tokens - seq.num_output_tokens)
                left[seq.adapter.name] = max(left.get(seq.adapter.name, 0), work)
        busy = self.adapters.max_loras - self.adapters.free_slots()
        return busy, min(left.values(), default=0) * max(1, len(self.scheduler.running))

    @functools.cached_property
    def grammars(self) -> GrammarCompiler:
        """Structured-output constraints compiled for this model's tokenizer (built at the
        first constrained request: it reads the whole vocabulary)."""
        return GrammarCompiler(self.tokenizer, self.vocab_size)

    @property
    def proposer(self) -> Proposer | None:
        """The draft proposer, or None when speculative decoding is off."""
        return self.speculation.proposer if self.speculation else None

    def validate(self, request: GenerationRequest) -> None:
        """The engine's door: every check of a request that does not depend on the engine's
        state (so it may run off the engine's thread). Run once per request in this process.

        Raises:
            InvalidRequestError: empty prompt, a prompt or ``logit_bias`` token id outside the
                vocabulary, invalid sampling values, a prompt or prompt + max_tokens over
                ``max_model_len`` (code ``context_length_exceeded``), or an adapter not held
                with the digest the request names (code ``model_not_found``).
        """
        self.adapters.resolve(request.adapter)
        prompt = request.token_ids
        if not prompt:
            raise InvalidRequestError("the prompt is empty", "prompt")
        self._check_token_ids(prompt, "prompt")
        self._check_token_ids(request.sampling.logit_bias, "logit_bias")
        self._check_token_ids(request.sampling.allowed_token_ids or (), "allowed_token_ids")
        self._check_token_ids(chain.from_iterable(request.sampling.bad_words_token_ids),
                              "bad_words")
        request.sampling.validate()
        if request.sampling.structured is not None:
            self.grammars.compile(request.sampling.structured)
        request.sampling.check_context(len(prompt), self.max_model_len)

    def add_request(self, request: GenerationRequest, arrived_at: float | None = None) -> None:
        """Make the request's adapter resident (``AdapterRegistry.ensure``), then
        :meth:`validate` and :meth:`admit` (raises as they do)."""
        self.adapters.ensure(request.adapter)
        try:
            self.validate(request)
        except Exception:
            self.adapters.release(request.adapter)
            raise
        self.admit(request, arrived_at)

    def admit(self, request: GenerationRequest, arrived_at: float | None = None) -> None:
        """Queue a request that has passed :meth:`validate`.

        ``arrived_at`` (:func:`time.monotonic` seconds) is when it reached the engine's front
        (the async engine's inbox); by default now. Request latencies count from it. A request
        with ``n > 1`` becomes ``n`` sibling sequences (:class:`~workers.choices.Choices`).

        The prompt's block digests are the ingress's when they verify against this engine's
        identity (``PromptDigests.verified``), else hashed here.

        Ends the adapter reservation ``AdapterRegistry.ensure`` made for it, admitted or not:
        from here its sequences keep the adapter in use.

        Raises:
            InvalidRequestError: the request id is in use.
        """
        try:
            self._admit(request, arrived_at)
        finally:
            self.adapters.release(request.adapter)

    def _admit(self, request: GenerationRequest, arrived_at: float | None) -> None:
        if request.request_id in self._choices:
            raise InvalidRequestError(f"request id {request.request_id!r} is in use", "id")
        adapter = self.adapters.resolve(request.adapter)
        root, prompt_digests = self._prompt_digests(request)
        choices = []
        for index in range(request.sampling.n):
            seq = Sequence(request, root, self.config.block_size, index, prompt_digests,
                           adapter)
            if request.sampling.structured is not None:
                seq.grammar = self.grammars.matcher(request.sampling.structured,
                                                    request.sampling.min_tokens)
            self.request_metrics.arrived(seq, arrived_at)
            if not request.sampling.ignore_eos:
                seq.stop_token_ids |= self.eos_token_ids
            self._seqs[seq.request_id] = seq
            self._detokenizers[seq.request_id] = IncrementalDetokenizer(
                self.tokenizer, request.sampling.stop, request.sampling.min_tokens,
                request.sampling.include_stop_str_in_output,
                request.sampling.skip_special_tokens, request.token_ids)
            choices.append(seq)
        self._choices.add(request.request_id, choices)
        for seq in choices:
            self.scheduler.add(seq)

    def _prompt_digests(self, request: GenerationRequest) -> tuple[bytes, list[bytes]]:
        """The request's identity root, and its prompt's block digests where the ingress's
        verify against it (else none: the sequence hashes its prompt itself)."""
        root = self.identity.root_for(request.namespace, request.adapter)
        digests = request.prompt_digests
        return root, (digests.digests if digests is not None and digests.verified(
            root, request.token_ids, self.config.block_size) else [])

    def fetch_range(self, request: GenerationRequest, credited: int) -> tuple[int, int]:
        """The prompt blocks ``[first, end)`` of ``request`` worth fetching from a worker the
        index credits with its first ``credited``: from the blocks this worker holds now
        (working pool or second tier, as admission would find them) to the last a hit may
        cover (a block ending on the last token is computed again anyway)."""
        seq = self._probe(request)
        return (len(self.block_manager.cached_prefix(seq)),
                min(credited, seq.num_reusable_blocks))

    def export_blocks(self, digests: list[bytes]) -> list[KVBlock]:
        """Copies of the blocks held under ``digests``, for another worker
        (:func:`workers.kv_transfer.export_blocks`); counted."""
        started = time.perf_counter()
        blocks = export_blocks(self.pool, self.runner.kv_cache, digests)
        counters = self.transfers
        counters.exported_blocks += len(blocks)
        counters.exported_bytes += sum(block.kv.nbytes for block in blocks)
        counters.export_seconds += time.perf_counter() - started
        return blocks

    def import_blocks(self, request: GenerationRequest, first: int,
                      blocks: list[KVBlock]) -> int:
        """Stores ``blocks`` (prompt block ``first`` onwards) of ``request`` from another
        worker, each checked against the request's own prompt, in the working pool where it
        has room for them, else in the second tier
        (:func:`workers.kv_transfer.import_blocks`); returns how many were accepted. None is
        without a second tier. Blocks it came to hold meanwhile are accepted, not counted as
        imported."""
        if self.pool.tier is None:
            return 0
        seq = self._probe(request)
        imported = import_blocks(self.pool, self.runner.kv_cache, seq,
                                 self.block_manager.cached_prefix(seq), first, blocks)
        counters = self.transfers
        counters.imported_blocks += imported.stored
        counters.imported_bytes += imported.stored * self.pool.tier.block_bytes
        counters.already_held_blocks += imported.accepted - imported.stored
        counters.rejected_blocks += len(blocks) - imported.accepted
        return imported.accepted

    def _probe(self, request: GenerationRequest) -> Sequence:
        """A sequence of ``request``'s prompt, for lookups (never scheduled)."""
        root, digests = self._prompt_digests(request)
        return Sequence(request, root, self.config.block_size, 0, digests)

    def abort(self, request_id: str) -> GenerationChunk | None:
        """Stop a request and free its blocks; returns its last chunk, or None if unknown."""
        chunk = None
        for seq in self._choices.of(request_id):
            seq.finish("abort")
            chunk = self._finish(seq, "")
        self._claim_cores()
        return chunk

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[GenerationChunk]:
        """Propose drafts, schedule, run one forward pass, sample or verify, and commit.
        Returns one chunk per sequence that committed tokens this step (prefill chunks that
        end mid-prompt commit nothing; a verification step may commit several tokens).

        Raises:
            StepFailedError: the forward pass or the block commit raised, and every request
                with a sequence in this step's batch is aborted (its blocks freed) and named
                in the error; or one row's mask, sampling or commit raised, and only that
                row's request is aborted, the error carrying the other rows' chunks. Every
                request not named is untouched and the engine keeps serving.
        """
        self._claim_cores()
        drafted = self._propose()
        try:
            batch = self.scheduler.schedule()
            if not batch.seqs:
                return []
            self.request_metrics.scheduled(batch.seqs)
            try:
                return self._run_batch(batch)
            except StepFailedError:
                raise
            except Exception as exc:
                raise StepFailedError(self._abort_batch(batch), exc) from exc
        finally:
            for seq in drafted:
                seq.spec_token_ids = []
            self._claim_cores()

    def _claim_cores(self) -> None:
        """Claim this worker's share of the host's cores while it has work, lend it while
        it has none (:class:`~workers.host_cores.HostCores`)."""
        if self.host_cores is not None:
            self.host_cores.busy(self.has_work())

    def _threads_for(self, prompt_tokens: int) -> AbstractContextManager:
        """A step of ``prompt_tokens`` prompt tokens computes on the idle workers' cores
        too when it has at least :data:`~workers.host_cores.BORROW_MIN_PROMPT_TOKENS`."""
        if self.host_cores is None or prompt_tokens < BORROW_MIN_PROMPT_TOKENS:
            return nullcontext()
        return self.host_cores.borrowing()

    def _propose(self) -> list[Sequence]:
        """Drafts for the running decodes (:meth:`SpeculativeDecoding.propose`); returns the
        sequences that got drafts."""
        if self.speculation is None:
            return []
        decodes = [seq for seq in self.scheduler.running if seq.num_uncomputed_tokens == 1]
        drafted = self.speculation.propose(decodes, self.max_model_len)
        for seq in drafted:  # a draft is cut at its first token the constraint rejects
            if seq.grammar is not None:
                del seq.spec_token_ids[seq.grammar.valid_prefix(seq.spec_token_ids):]
        return drafted

    def _run_batch(self, batch: ScheduledBatch) -> list[GenerationChunk]:
        starts = [seq.num_computed_tokens for seq in batch.seqs]
        samples = [bool(seq.spec_token_ids) or start + num_new == seq.num_tokens
                   for (seq, num_new), start in zip(_pairs(batch), starts, strict=True)]
        num_logits = [_num_logits(seq, num_new, sampled)
                      for (seq, num_new), sampled in zip(_pairs(batch), samples, strict=True)]
        prompt_tokens = _prompt_tokens(batch)
        pending = self.step_masks.start(self._mask_job(batch, samples),
                                        lambda: self._core_beside_forward(prompt_tokens))
        started = time.perf_counter()
        try:
            with self._threads_for(prompt_tokens) as threads:
                logits = self.runner.execute(batch, num_logits)
            elapsed = time.perf_counter() - started
        finally:
            StepMasks.settle(pending)
        masks = pending.result() if pending is not None else {}
        self._count(batch, prompt_tokens)
        borrowed = bool(threads and threads > self.config.num_threads)
        self.counters.borrowed_core_steps += borrowed
        if prompt_tokens >= batch.num_tokens // 2 and prompt_tokens >= self.config.block_size:
            # Costs are kept for the worker's own cores, as if the step had run on them: the
            # next step may find no core to borrow, and the step-time limits must hold then.
            # A prompt's arithmetic splits over threads nearly evenly, so this overstates it a
            # little (a 1,024-token Q4_1 prefill on a Zen 4: 1,130 tokens/s on 2 threads, 618
            # on 1; docs/performance.md, "Where a decode step goes").
            own_s = elapsed * threads / self.config.num_threads if borrowed else elapsed
            self.prompt_costs.observe(_prompt_chunks(batch, starts), own_s, batch.num_tokens)
        if all(n == 1 or seq.spec_token_ids for seq, n in _pairs(batch)):
            self.decode_steps.observe(batch.num_tokens, elapsed)
        for seq, num_new in _pairs(batch):
            if not seq.spec_token_ids:  # a verification commits what it accepts, later
                self.block_manager.commit(seq, num_new)
        return self._commit_rows(batch.seqs, StepRows(logits, num_logits, starts, samples,
                                                      masks, elapsed))

    def _commit_rows(self, seqs: list[Sequence], rows: StepRows) -> list[GenerationChunk]:
        """Each row's share of a computed step: prompt logprobs, then its sampled token or
        verified drafts committed. A row whose mask, sampling or commit raises fails alone.

        Raises:
            StepFailedError: some rows failed (their requests aborted; every other row's
                chunk carried in the error).
        """
        failed = {i: mask for i, mask in rows.masks.items() if isinstance(mask, Exception)}
        _each_row(failed, [i for i, seq in enumerate(seqs) if seq.wants_prompt_logprobs],
                  lambda i: _record_prompt_logprobs(seqs[i], rows.of(i), rows.starts[i]))
        sampled = [i for i, seq in enumerate(seqs) if rows.samples[i] and i not in failed]
        chunks = _each_row(failed, [i for i in sampled if not seqs[i].sampling.max_tokens],
                           lambda i: self._end_at_prompt(seqs[i]))
        plain = [i for i in sampled if not seqs[i].spec_token_ids and seqs[i].sampling.max_tokens]
        tokens = dict(zip(plain, self._sample_rows(rows, plain, seqs), strict=True))
        failed |= {i: token for i, token in tokens.items() if isinstance(token, Exception)}
        chunks += _each_row(failed, plain, lambda i: self._append(seqs[i], [tokens[i]]))
        chunks += _each_row(failed, [i for i in sampled if seqs[i].spec_token_ids],
                            lambda i: self._verify(seqs[i], rows.of(i), rows.elapsed,
                                                   rows.masks.get(i)))
        if failed:
            error = self._abort_rows(seqs, failed, chunks)
            raise error from error.cause
        return chunks

    def _sample_rows(self, rows: StepRows, plain: list[int],
                     seqs: list[Sequence]) -> list[SampledToken | Exception]:
        """One token for each ``plain`` row, sampled in one call; if that call raises, row by
        row, so that a row that fails alone fails alone (its entry is its exception)."""
        if not plain:
            return []
        params = [self._sampling_row(seqs[i], rows.masks.get(i, [None])[0]) for i in plain]
        last = [rows.offsets[i + 1] - 1 for i in plain]
        try:
            return list(sample(rows.logits[last], params, self._generator))
        except Exception:
            log.exception("sampling %d rows failed; sampling them one at a time", len(plain))
        return [_or_exception(lambda r=r, p=p: sample(rows.logits[[r]], [p], self._generator)[0])
                for r, p in zip(last, params, strict=True)]

    def _abort_rows(self, seqs: list[Sequence], failed: dict[int, Exception],
                    chunks: list[GenerationChunk]) -> StepFailedError:
        """Aborts the requests of the ``failed`` rows (every choice of theirs) and returns the
        error that names them, carrying the step's chunks for every other request."""
        causes: dict[str, Exception] = {}
        for i in sorted(failed):
            causes.setdefault(seqs[i].request.request_id, failed[i])
        for request_id in causes:
            self.abort(request_id)
        kept = [chunk for chunk in chunks if chunk.request_id not in causes]
        return StepFailedError(list(causes), failed[min(failed)], kept, causes)

    def _end_at_prompt(self, seq: Sequence) -> GenerationChunk:
        """Ends a request that only scores its prompt (``max_tokens`` 0) once the prompt is
        computed: nothing is sampled; its last chunk carries the prompt logprobs."""
        seq.finish("length")
        return self._finish(seq, "")

    def _core_beside_forward(self, prompt_tokens: int) -> bool:
        """Whether a core is free while a step of ``prompt_tokens`` prompt tokens runs its
        forward pass: on a GPU worker, the host's; on a CPU worker, a core no worker of the
        host claims, unless the step borrows every such core
        (:meth:`_threads_for`). Unknown (borrowing off) counts as none."""
        if self.loaded.device.type != "cpu":
            return True
        return (self.host_cores is not None and prompt_tokens < BORROW_MIN_PROMPT_TOKENS
                and self.host_cores.spare() > 0)

    def _mask_job(self, batch: ScheduledBatch, samples: list[bool]) -> MaskJob:
        """The constrained rows of a step that sample (:class:`StepMasks`)."""
        return {i: (seq.grammar, seq.spec_token_ids, seq.budget(self.max_model_len))
                for i, (seq, sampled) in enumerate(zip(batch.seqs, samples, strict=True))
                if seq.grammar is not None and sampled}

    def _sampling_row(self, seq: Sequence, mask: PositionMask | None) -> SamplingRow:
        allowed, narrowed = mask if mask is not None else (None, None)
        return SamplingRow(seq.sampling, seq.token_ids, seq.num_prompt_tokens,
                           seq.stop_token_ids, seq.generator, allowed, narrowed)

    def _verify(self, seq: Sequence, logits: torch.Tensor, step_s: float,
                masks: list[PositionMask] | None) -> GenerationChunk:
        """Commits what verification of ``seq``'s drafts accepts, under its constraint's
        ``masks`` (one per position; None for free text), then retires the rest: the KV of
        rejected drafts lies past ``num_computed_tokens`` (never hashed, overwritten later)
        and blocks that held only rejected positions go back to the pool."""
        proposed = len(seq.spec_token_ids)
        row = self._sampling_row(seq, masks[0] if masks is not None else None)
        committed = self.speculation.verify(seq, logits, row, self._generator, masks)
        accepted = len(committed) - 1
        chunk = self._append(seq, committed, accepted_drafts=accepted)
        self.speculation.count(seq, proposed, min(accepted, len(chunk.token_ids)), step_s)
        return chunk

    def _abort_batch(self, batch: ScheduledBatch) -> list[str]:
        """Abort every request with a sequence in ``batch``; returns their ids.

        Requests that finished earlier in the failed step are named too: their last chunk was
        never delivered, so their streams must get the error as well.
        """
        request_ids = list(dict.fromkeys(seq.request.request_id for seq in batch.seqs))
        for request_id in request_ids:
            self.abort(request_id)
        return request_ids

    def warm_up(self, num_tokens: int = WARM_UP_PROMPT_TOKENS) -> float:
        """Serve one made-up prompt of ``num_tokens`` tokens (fewer where the context is
        shorter) before any request, and leave no trace of it: the prefix cache is reset and
        its KV events dropped, the counts start at zero. The step-time limits then have a
        measured prompt cost from the first request on. Without one, a long prompt's first
        chunk had no cap: 2,048 tokens in 3.1 s on one Zen 4 core (Q4_1), and through HTTP on a
        fresh server the short chats sent meanwhile waited up to 6.4 s for a first token.
        Returns the seconds it took.

        Raises:
            RuntimeError: called with requests in the engine.
        """
        if self.has_work():
            raise RuntimeError("warm_up runs before any request")
        started = time.perf_counter()
        num_tokens = max(1, min(num_tokens, self.max_model_len - 1))
        first = min(WARM_UP_FIRST_ID, self.vocab_size // 2)
        prompt = [first + i % (self.vocab_size - first) for i in range(num_tokens)]
        self.generate([GenerationRequest("warm-up", prompt, SamplingParams(
            max_tokens=1, temperature=0.0, ignore_eos=True))])
        self.reset_prefix_cache()
        self.drain_events()
        self.scheduler.counters = SchedulerCounters()
        self._zero_counts(spec=self.counters.spec)  # one token: no drafts counted
        return time.perf_counter() - started

    def _zero_counts(self, spec: SpecUsage | None = None) -> None:
        """Fresh engine, transfer and per-request counts; ``spec``: the speculation's counts
        to keep (the same object, which the speculation controller holds), else fresh ones."""
        self.counters = EngineCounters() if spec is None else EngineCounters(spec=spec)
        self.transfers = TransferCounters()
        self.request_metrics = RequestMetrics()

    def drain_events(self) -> list[KVEvent]:
        """KV events (stored / removed / cleared digests) since the last call."""
        return self.pool.drain_events()

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix; the index is told with a ``cleared`` event."""
        self.pool.reset_cache()

    def load_by_request(self) -> dict[str, int]:
        """Work queued or running here, in tokens (:func:`contract.load.work_tokens`), per
        request id: its choices' uncomputed tokens and every output token they may still
        produce (the router counts in the same unit)."""
        load: dict[str, int] = {}
        for seq in list(self._seqs.values()):
            rid = seq.request.request_id
            load[rid] = load.get(rid, 0) + work_tokens(
                seq.num_uncomputed_tokens, seq.sampling.max_tokens - seq.num_output_tokens)
        return load

    def sequence(self, request_id: str) -> Sequence | None:
        return self._seqs.get(request_id)

    def generate(self, requests: list[GenerationRequest]) -> dict[str, list[GenerationChunk]]:
        """Run requests to completion, batched together (for tests, benchmarks and
        :meth:`warm_up`)."""
        for request in requests:
            self.add_request(request)
        chunks: dict[str, list[GenerationChunk]] = {r.request_id: [] for r in requests}
        while self.has_work():
            for chunk in self.step():
                chunks[chunk.request_id].append(chunk)
        return chunks

    def _append(self, seq: Sequence, sampled: list[SampledToken],
                accepted_drafts: int | None = None) -> GenerationChunk:
        """Commits sampled tokens in order until one ends the sequence, as OpenAI defines
        ``finish_reason``: "stop" when it is EOS / a stop token or completes a stop string (even
        on the ``max_tokens``-th token), else "length" at ``max_tokens`` or the context limit.
        Tokens after the one that ends the sequence are dropped, unreturned and uncounted.

        Args:
            seq: the sequence.
            sampled: its new tokens (one, or a verification's accepted drafts and last token).
            accepted_drafts: for a verification step, how many of ``sampled`` are accepted
                drafts (the rest is the corrected or bonus token). The computed positions that
                hold kept tokens (the pending token and the kept drafts) are committed to the
                block table before the sequence can finish (and free its blocks).
        """
        sampling = seq.sampling
        detokenizer = self._detokenizers[seq.request_id]
        tokens, texts, logprobs = [], [], []
        for token in sampled:
            seq.token_ids.append(token.token_id)
            tokens.append(token.token_id)
            if token.logprobs is not None:
                logprobs.append(token.logprobs)
            # min_tokens: the sampler masks stop tokens until then; logit_bias cannot unmask.
            if (token.token_id in seq.stop_token_ids
                    and seq.num_output_tokens > sampling.min_tokens):
                if seq.grammar is not None:
                    seq.grammar.end(token.steered)
                if token.token_id not in self.eos_token_ids or sampling.ignore_eos:
                    seq.finish("stop")  # a requested stop token, not EOS: steered or not
                    seq.stop_reason = token.token_id
                else:
                    seq.finish(_stop_reason(seq))
                break
            if seq.grammar is not None:
                seq.grammar.consume(token.token_id, token.steered)
            texts.append(detokenizer.add(token.token_id))
            if detokenizer.stopped:  # a requested stop string: "stop", steered or not
                seq.finish("stop")
                seq.stop_reason = detokenizer.matched
            elif seq.grammar is not None and seq.grammar.is_stopped:
                seq.finish(_stop_reason(seq))
            elif (seq.num_output_tokens >= sampling.max_tokens
                  or seq.num_tokens >= self.max_model_len):
                seq.finish("length")
            if seq.is_finished:
                break
        self.request_metrics.committed(seq, len(tokens))
        if accepted_drafts is not None:
            self.block_manager.commit(seq, 1 + min(accepted_drafts, len(tokens)))
            self.block_manager.trim(seq)
        text = "".join(texts)
        if seq.is_finished:
            return self._finish(seq, text + detokenizer.flush(), tokens, logprobs or None)
        return self._chunk(seq, tokens, text, logprobs or None)

    def _finish(self, seq: Sequence, text: str, tokens: list[int] | None = None,
                logprobs: list[TokenLogprob] | None = None) -> GenerationChunk:
        if seq.finish_reason != "abort":
            self.request_metrics.finished(seq)
        self.scheduler.finish(seq)
        if self.speculation is not None:
            self.speculation.finish(seq)
        del self._seqs[seq.request_id]
        del self._detokenizers[seq.request_id]
        self._choices.remove(seq)
        return self._chunk(seq, tokens or [], text, logprobs)

    def _chunk(self, seq: Sequence, tokens: list[int], text: str,
               logprobs: list[TokenLogprob] | None = None) -> GenerationChunk:
        rid = seq.request.request_id
        spec = seq.spec if seq.is_finished and seq.spec.k_decisions else None
        return GenerationChunk(rid, tokens, text, seq.finish_reason,
                               seq.num_prompt_tokens, seq.num_cached_tokens,
                               seq.num_output_tokens, index=seq.choice_index,
                               logprobs=logprobs, choices_left=self._choices.left(rid),
                               spec=spec, tier_tokens=seq.num_tier_tokens,
                               transfer_tokens=seq.num_transfer_tokens,
                               stop_reason=seq.stop_reason,
                               prompt_logprobs=seq.take_prompt_logprobs())

    def _check_token_ids(self, token_ids: Iterable[int], param: str) -> None:
        """Raises :class:`InvalidRequestError` naming ``param`` for the first id (of a list,
        or the keys of a dict) outside this model's vocabulary."""
        bad = next((t for t in token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(
                f"{param}: token id {bad} is outside the vocabulary [0, {self.vocab_size})",
                param)

    def _count(self, batch: ScheduledBatch, prompt_tokens: int) -> None:
        """Counts the step, of which ``prompt_tokens`` are prompt tokens."""
        self.counters.steps += 1
        self.counters.batch_sizes[len(batch.seqs)] += 1
        self.counters.decode_tokens += batch.num_tokens - prompt_tokens
        self.counters.prefill_tokens += prompt_tokens

    def _eos_token_ids(self) -> set[int]:
        ids: set[int] = set()
        for source in (self.loaded.model.generation_config, self.tokenizer):
            value = getattr(source, "eos_token_id", None)
            ids.update(value if isinstance(value, list) else [] if value is None else [value])
        return ids


def _second_tier(config: EngineConfig, kv_cache: PagedKVCache) -> KVTier | None:
    """The second KV tier ``config`` asks for; None when off, or when its store cannot be had
    (a read-only or full disk, too little host memory: the worker serves without it, and says
    so)."""
    num_blocks = config.kv_tier_bytes // kv_cache.block_bytes
    if num_blocks < 1:
        return None
    device = kv_cache.keys[0].device
    medium = config.tier_medium(device.type)
    try:
        if medium == "host":
            slots = HostSlots(num_blocks, kv_cache.block_bytes, pinned=device.type == "cuda")
        else:
            slots = FileSlots(num_blocks, kv_cache.block_bytes, config.kv_tier_dir)
    except (OSError, RuntimeError) as exc:
        where = ("host memory" if medium == "host"
                 else f"a file in {config.kv_tier_dir or 'the temporary directory'}")
        log.warning("no second KV tier: its %d bytes of %s could not be had (%s)",
                    config.kv_tier_bytes, where, exc)
        return None
    log.info("second KV tier: %d blocks in %s", num_blocks, medium)
    return KVTier(kv_cache, slots)


def _host_cores(config: EngineConfig, device: torch.device) -> HostCores | None:
    """This worker's claim on the host's cores when ``config.borrow_idle_cores`` (a CPU
    worker with a set thread count); None where it is off or its directory is unusable."""
    if not (config.borrow_idle_cores and config.num_threads and device.type == "cpu"):
        return None
    try:
        return HostCores(config.num_threads, torch.set_num_threads)
    except OSError as exc:
        log.warning("idle workers' cores will not be borrowed: %s", exc)
        return None


def _step_limit(name: str, value: float | str | None,
                auto: Callable[[], float | None]) -> float | None:
    """A step-time limit in seconds from its setting: seconds, None (off) or ``auto``.

    Raises:
        ValueError: any other string.
    """
    if isinstance(value, str):
        if value != AUTO:
            raise ValueError(f"{name} is seconds, None or {AUTO!r}; got {value!r}")
        return auto()
    return value


def _prompt_chunks(batch: ScheduledBatch, starts: list[int]) -> list[tuple[int, int]]:
    """``(first position, tokens)`` of each chunk of more than one token that ``batch``
    computes without drafts (prompts, or a preempted sequence's recompute)."""
    return [(start, num_new) for (seq, num_new), start in zip(_pairs(batch), starts, strict=True)
            if num_new > 1 and not seq.spec_token_ids]


def _prompt_tokens(batch: ScheduledBatch) -> int:
    """The prompt tokens ``batch`` computes (the rest are decode and draft tokens)."""
    return sum(max(0, min(seq.num_computed_tokens + num_new, seq.num_prompt_tokens)
                   - seq.num_computed_tokens) for seq, num_new in _pairs(batch))


def _num_logits(seq: Sequence, num_new: int, sampled: bool) -> int:
    """Logit rows ``seq`` needs from a step computing ``num_new`` of its tokens: its
    verification block's, every row of a prompt chunk while prompt logprobs are computed (the
    last one samples when the chunk ends the prompt), else one where it samples."""
    if seq.spec_token_ids:
        return 1 + len(seq.spec_token_ids)
    if seq.wants_prompt_logprobs:
        return num_new
    return int(sampled)


def _record_prompt_logprobs(seq: Sequence, logits: torch.Tensor, start: int) -> None:
    """Appends the prompt logprobs that ``logits`` (``[n, V]``, the rows of positions
    ``start ..``) give and ``seq`` lacks: position ``p``'s row gives prompt token ``p + 1``'s.
    A recompute after preemption gives none twice."""
    first = len(seq.prompt_logprobs) - 1  # the next position whose row is needed
    end = min(start + len(logits), seq.num_prompt_tokens - 1)
    if first < start or first >= end:
        return
    seq.prompt_logprobs += prompt_logprobs(logits[first - start:end - start],
                                           seq.token_ids[first + 1:end + 1],
                                           seq.sampling.prompt_logprobs)


def _each_row(failed: dict[int, Exception], rows: list[int],
              work: Callable[[int], GenerationChunk | None]) -> list[GenerationChunk]:
    """``work(i)`` for each row not yet ``failed``; the chunks it returns, in order. A row
    whose work raises is entered in ``failed`` and skipped by every later stage of the step."""
    chunks = []
    for i in rows:
        if i in failed:
            continue
        try:
            chunk = work(i)
        except Exception as exc:
            failed[i] = exc
            continue
        if chunk is not None:
            chunks.append(chunk)
    return chunks


def _or_exception(work: Callable[[], SampledToken]) -> SampledToken | Exception:
    try:
        return work()
    except Exception as exc:
        return exc


def _pairs(batch: ScheduledBatch):
    return zip(batch.seqs, batch.num_new_tokens, strict=True)


def _stop_reason(seq: Sequence) -> FinishReason:
    """How the model's own end (EOS, or its constraint complete) finishes ``seq``: ``stop``,
    unless closing steered the constrained output to end before the model would have
    (``workers/structured/closing.py``): then ``length``, for the budget ended it. A stop
    string or stop token the client asked for is always ``stop``."""
    return "length" if seq.grammar is not None and seq.grammar.steered else "stop"
