"""The engine: continuous batching over a paged KV cache with identity-checked prefix reuse.

Synchronous core; ``workers.async_engine`` runs it in a thread and streams its outputs.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from workers.block_manager import BlockManager
from workers.block_pool import BlockPool
from workers.config import EngineConfig
from workers.detokenizer import IncrementalDetokenizer
from workers.identity import CacheIdentity
from workers.kv_cache import PagedKVCache
from workers.kv_events import KVEvent
from workers.model_loader import LoadedModel, load_model, numerics_tag
from workers.model_runner import ModelRunner
from workers.model_support import check_supported
from workers.models.linear import bound_primitive_caches
from workers.paged_attention import ATTN_IMPLEMENTATION
from workers.request import (
    GenerationChunk,
    GenerationRequest,
    InvalidRequestError,
    SpecUsage,
    TokenLogprob,
)
from workers.request_metrics import RequestMetrics
from workers.sampler import SampledToken, SamplingRow, sample
from workers.scheduler import ScheduledBatch, Scheduler
from workers.sequence import Sequence
from workers.spec.build import build_proposer
from workers.spec.controller import DraftLengthController
from workers.spec.proposer import ProposalRequest, Proposer
from workers.spec.verify import verify_drafts


class StepFailedError(RuntimeError):
    """An engine step raised; only the requests of its batch were aborted.

    Attributes:
        request_ids: the requests whose sequences were in the failed step (now aborted).
        cause: the original exception.
    """

    def __init__(self, request_ids: list[str], cause: BaseException):
        super().__init__(f"engine step failed for {len(request_ids)} request(s): "
                         f"{type(cause).__name__}: {cause}")
        self.request_ids = request_ids
        self.cause = cause


@dataclass
class EngineCounters:
    """Monotonic engine counts.

    Attributes:
        steps: forward passes run.
        prefill_tokens: tokens computed at prompt positions (a prefix hit skips them).
        decode_tokens: tokens computed at output positions.
        batch_sizes: histogram: sequences per step → number of steps.
        spec: speculative decoding summed over every request (committed tokens only).
        draft_calls: batched proposer calls.
    """

    steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    batch_sizes: Counter = field(default_factory=Counter)
    spec: SpecUsage = field(default_factory=SpecUsage)
    draft_calls: int = 0


class LLMEngine:
    """One worker's engine.

    Args:
        config: engine configuration.
        loaded: an already loaded model (tests share one); None loads ``config.model``.
        proposer: the draft proposer when ``config.speculative`` is on (a draft replica's
            client, or a test's); None builds the configured one inside this process.
    """

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None,
                 proposer: Proposer | None = None):
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        bound_primitive_caches()
        self.config = config
        self.loaded = loaded or load_model(config.model, config.dtype, config.device)
        self.tokenizer = self.loaded.tokenizer
        model_config = self.loaded.model.config
        kv_cache = PagedKVCache.from_budget(model_config, config.kv_cache_bytes,
                                            config.block_size, self.loaded.dtype,
                                            self.loaded.device)
        self.pool = BlockPool(kv_cache.num_blocks, config.block_size)
        self.block_manager = BlockManager(self.pool)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs,
                                   config.max_num_batched_tokens,
                                   config.max_num_partial_prefills,
                                   config.long_prefill_token_threshold,
                                   config.scheduling_policy)
        model_limit = getattr(model_config, "max_position_embeddings", None) or 1 << 30
        self.max_model_len = min(config.max_model_len or model_limit, model_limit,
                                 kv_cache.num_blocks * config.block_size)
        # Refuse, naming them, features the paged runner would silently drop; before the
        # runner fuses the model's weights.
        check_supported(model_config, self.max_model_len, self.loaded.model)
        self.runner = ModelRunner(self.loaded.model, kv_cache)
        # The runner's path (compact or transformers modules) and its matmul, prefill and
        # decode attention and norm kernels change rounding, so the KV it computes is only
        # reusable by workers running the same ones.
        attention = (f"{ATTN_IMPLEMENTATION}/{self.runner.implementation}"
                     f"|linear={self.runner.linear_kernel}|prefill={self.runner.prefill_kernel}"
                     f"|decode={self.runner.decode_kernel}"
                     f"{'+' + self.runner.decode_scores if self.runner.decode_scores else ''}"
                     f"|norm={self.runner.norm_kernel}")
        self.identity = CacheIdentity(self.loaded.model_digest,
                                      numerics_tag(self.loaded.device, attention),
                                      config.block_size)
        self.vocab_size = model_config.vocab_size
        self.eos_token_ids = self._eos_token_ids()
        self.counters = EngineCounters()
        self.request_metrics = RequestMetrics()
        self._seqs: dict[str, Sequence] = {}
        self._choices: dict[str, list[Sequence]] = {}
        self._held_siblings: dict[str, list[Sequence]] = {}
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        spec = config.speculative
        spec.validate()
        self.proposer = None
        if spec.enabled:
            self.proposer = proposer or build_proposer(spec, self.loaded, config)
        self.draft_length = DraftLengthController(spec.num_speculative_tokens, spec.adaptive)
        self._generator = torch.Generator()
        if config.seed is None:
            self._generator.seed()  # OS entropy: unseeded requests differ across workers
        else:
            self._generator.manual_seed(config.seed)

    def validate(self, request: GenerationRequest) -> None:
        """Check a request before it is queued.

        Raises:
            InvalidRequestError: empty prompt, token id outside the vocabulary, prompt or
                prompt + max_tokens over ``max_model_len`` (code ``context_length_exceeded``),
                invalid sampling values, or a request id already in use.
        """
        prompt = request.token_ids
        if not prompt:
            raise InvalidRequestError("the prompt is empty", "prompt")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})", "prompt")
        request.sampling.validate()
        self._validate_token_params(request)
        total = len(prompt) + request.sampling.max_tokens
        if len(prompt) >= self.max_model_len or total > self.max_model_len:
            raise InvalidRequestError(
                f"this model's maximum context length is {self.max_model_len} tokens; the "
                f"request has {len(prompt)} prompt tokens and asks for up to "
                f"{request.sampling.max_tokens} more", "max_tokens", "context_length_exceeded")
        if request.request_id in self._choices:
            raise InvalidRequestError(f"request id {request.request_id!r} is in use", "id")

    def add_request(self, request: GenerationRequest, arrived_at: float | None = None) -> None:
        """Validate and queue a request (raises as :meth:`validate`).

        ``arrived_at`` (:func:`time.monotonic` seconds) is when it reached the engine's front
        (the async engine's inbox); by default now. Request latencies count from it.

        A request with ``n > 1`` becomes ``n`` sibling sequences ``{request_id}#{i}``. The
        first prefills the prompt; the others are held back until its full prompt blocks are
        registered, then admitted as prefix-cache hits, so the prompt's KV is computed once
        (plus each sibling's recomputed tail) and its blocks are shared by reference count.
        """
        self.validate(request)
        root = self.identity.with_namespace(request.namespace).root_digest
        num_choices = request.sampling.n
        choices = []
        for index in range(num_choices):
            seq = Sequence(request, root, self.config.block_size, index)
            self.request_metrics.arrived(seq, arrived_at)
            if not request.sampling.ignore_eos:
                seq.stop_token_ids |= self.eos_token_ids
            self._seqs[seq.request_id] = seq
            self._detokenizers[seq.request_id] = IncrementalDetokenizer(
                self.tokenizer, request.sampling.stop, request.sampling.min_tokens)
            choices.append(seq)
        self._choices[request.request_id] = choices
        self.scheduler.add(choices[0])
        if num_choices > 1:
            self._held_siblings[request.request_id] = choices[1:]

    def abort(self, request_id: str) -> GenerationChunk | None:
        """Stop a request and free its blocks; returns its last chunk, or None if unknown."""
        choices = self._choices.get(request_id)
        if not choices:
            return None
        for seq in list(choices):
            seq.finish("abort")
            chunk = self._finish(seq, "")
        return chunk

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[GenerationChunk]:
        """Propose drafts, schedule, run one forward pass, sample or verify, and commit.
        Returns one chunk per sequence that committed tokens this step (prefill chunks that
        end mid-prompt commit nothing; a verification step may commit several tokens).

        Raises:
            StepFailedError: the forward pass, commit or sampling raised. Every request with a
                sequence in this step's batch is aborted (its blocks freed) and named in the
                error; every other request is untouched and the engine keeps serving.
        """
        drafted = self._propose()
        try:
            batch = self.scheduler.schedule()
            if not batch.seqs:
                return []
            self.request_metrics.scheduled(batch.seqs)
            try:
                return self._run_batch(batch)
            except Exception as exc:
                raise StepFailedError(self._abort_batch(batch), exc) from exc
        finally:
            for seq in drafted:
                seq.spec_token_ids = []

    def _propose(self) -> list[Sequence]:
        """Asks the proposer, in one batched call, for the drafts of every running decode whose
        draft length (:class:`DraftLengthController`) is above 0; returns the sequences that
        got drafts. A proposer failure means no drafts this step, never different output."""
        if self.proposer is None:
            return []
        decodes = [seq for seq in self.scheduler.running if seq.num_uncomputed_tokens == 1]
        asks = []
        for seq in decodes:
            # A draft past max_tokens or the context limit could never be committed.
            room = min(seq.sampling.max_tokens - seq.num_output_tokens,
                       self.max_model_len - seq.num_tokens) - 1
            k = min(room, self.draft_length.choose(seq.request_id, seq.spec, len(decodes),
                                                   len(decodes)))
            seq.spec.k_decisions[k] = seq.spec.k_decisions.get(k, 0) + 1
            self.counters.spec.k_decisions[k] = self.counters.spec.k_decisions.get(k, 0) + 1
            if k > 0:
                asks.append((seq, ProposalRequest(seq.request_id, seq.token_ids,
                                                  seq.num_prompt_tokens, k)))
        if not asks:
            return []
        started = time.perf_counter()
        try:
            proposals = self.proposer.propose([ask for _, ask in asks])
        except Exception:  # a broken proposer costs speculation, never the step
            proposals = [[] for _ in asks]
        elapsed = time.perf_counter() - started
        self.draft_length.observe_draft(elapsed)
        self.counters.draft_calls += 1
        self.counters.spec.draft_s += elapsed
        drafted = []
        for (seq, ask), tokens in zip(asks, proposals, strict=True):
            seq.spec.draft_s += elapsed / len(asks)
            # a draft is a prefix: an id outside the vocabulary ends it
            seq.spec_token_ids = list(itertools.takewhile(
                lambda t: 0 <= t < self.vocab_size, map(int, tokens[:ask.k])))
            if seq.spec_token_ids:
                drafted.append(seq)
        return drafted

    def _run_batch(self, batch: ScheduledBatch) -> list[GenerationChunk]:
        num_logits = [1 + len(seq.spec_token_ids) if seq.spec_token_ids
                      else int(seq.num_computed_tokens + num_new == seq.num_tokens)
                      for seq, num_new in _pairs(batch)]
        started = time.perf_counter()
        logits = self.runner.execute(batch, num_logits)
        elapsed = time.perf_counter() - started
        self._count(batch)
        if all(n == 1 or seq.spec_token_ids for seq, n in _pairs(batch)):
            self.draft_length.observe_step(batch.num_tokens, elapsed)
        for seq, num_new in _pairs(batch):
            if not seq.spec_token_ids:  # a verification commits what it accepts, later
                self.block_manager.commit(seq, num_new)
        self._release_siblings()
        offsets = [0]
        for n in num_logits:
            offsets.append(offsets[-1] + n)
        plain = [i for i, n in enumerate(num_logits) if n == 1]  # verifications have n > 1
        chunks = []
        if plain:
            rows = [self._sampling_row(batch.seqs[i]) for i in plain]
            sampled = sample(logits[[offsets[i] for i in plain]], rows, self._generator)
            chunks += [self._append(batch.seqs[i], [token])
                       for i, token in zip(plain, sampled, strict=True)]
        for i, seq in enumerate(batch.seqs):
            if seq.spec_token_ids:
                chunks.append(self._verify(seq, logits[offsets[i]:offsets[i + 1]], elapsed))
        return chunks

    def _sampling_row(self, seq: Sequence) -> SamplingRow:
        return SamplingRow(seq.sampling, seq.token_ids, seq.num_prompt_tokens,
                           seq.stop_token_ids, seq.generator)

    def _verify(self, seq: Sequence, logits: torch.Tensor, step_s: float) -> GenerationChunk:
        """Commits what verification of ``seq``'s drafts accepts, then retires the rest: the
        KV of rejected drafts lies past ``num_computed_tokens`` (never hashed, overwritten
        later) and blocks that held only rejected positions go back to the pool."""
        drafts = seq.spec_token_ids
        committed = verify_drafts(logits, drafts, self._sampling_row(seq), self._generator)
        accepted = len(committed) - 1
        chunk = self._append(seq, committed, accepted_drafts=accepted)
        kept_drafts = min(accepted, len(chunk.token_ids))
        self._count_verification(seq.spec, len(drafts), kept_drafts, step_s)
        self._count_verification(self.counters.spec, len(drafts), kept_drafts, step_s)
        return chunk

    @staticmethod
    def _count_verification(usage: SpecUsage, proposed: int, accepted: int,
                            step_s: float) -> None:
        while len(usage.proposed_by_position) < proposed:
            usage.proposed_by_position.append(0)
            usage.accepted_by_position.append(0)
        for i in range(proposed):
            usage.proposed_by_position[i] += 1
            usage.accepted_by_position[i] += i < accepted
        usage.proposed_tokens += proposed
        usage.accepted_tokens += accepted
        usage.verification_steps += 1
        usage.verify_s += step_s

    def _abort_batch(self, batch: ScheduledBatch) -> list[str]:
        """Abort every request with a sequence in ``batch``; returns their ids.

        Requests that finished earlier in the failed step are named too: their last chunk was
        never delivered, so their streams must get the error as well.
        """
        request_ids = list(dict.fromkeys(seq.request.request_id for seq in batch.seqs))
        for request_id in request_ids:
            self.abort(request_id)
        return request_ids

    def drain_events(self) -> list[KVEvent]:
        """KV events (stored / removed / cleared digests) since the last call."""
        return self.pool.drain_events()

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix; the index is told with a ``cleared`` event."""
        self.pool.reset_cache()

    def load_by_request(self) -> dict[str, int]:
        """Work queued or running here, in tokens, per request id: uncomputed tokens plus every
        output token the request may still produce (the router counts in the same unit)."""
        load: dict[str, int] = {}
        for seq in list(self._seqs.values()):
            rid = seq.request.request_id
            load[rid] = load.get(rid, 0) + seq.num_uncomputed_tokens + (
                seq.sampling.max_tokens - seq.num_output_tokens)
        return load

    def sequence(self, request_id: str) -> Sequence | None:
        return self._seqs.get(request_id)

    def generate(self, requests: list[GenerationRequest]) -> dict[str, list[GenerationChunk]]:
        """Run requests to completion, batched together (for tests and benchmarks)."""
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
                seq.finish("stop")
                break
            texts.append(detokenizer.add(token.token_id))
            if detokenizer.stopped:
                seq.finish("stop")
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
        self.draft_length.forget(seq.request_id)
        if self.proposer is not None:
            self.proposer.finish([seq.request_id])
        del self._seqs[seq.request_id]
        del self._detokenizers[seq.request_id]
        rid = seq.request.request_id
        choices = self._choices[rid]
        choices.remove(seq)
        if not choices:
            del self._choices[rid]
            self._held_siblings.pop(rid, None)
        self._release_siblings()
        return self._chunk(seq, tokens or [], text, logprobs)

    def _chunk(self, seq: Sequence, tokens: list[int], text: str,
               logprobs: list[TokenLogprob] | None = None) -> GenerationChunk:
        rid = seq.request.request_id
        spec = seq.spec if seq.is_finished and seq.spec.k_decisions else None
        return GenerationChunk(rid, tokens, text, seq.finish_reason,
                               seq.num_prompt_tokens, seq.num_cached_tokens,
                               seq.num_output_tokens, index=seq.choice_index,
                               logprobs=logprobs, choices_left=len(self._choices.get(rid, ())),
                               spec=spec)

    def _release_siblings(self) -> None:
        """Queues the held siblings of every request whose first choice has registered its
        full prompt blocks (or finished), so they admit as prefix-cache hits."""
        for rid, siblings in list(self._held_siblings.items()):
            leader = self._seqs.get(f"{rid}#0")
            # The last prompt token is always recomputed, so only these blocks can be hits.
            full_blocks = (siblings[0].num_prompt_tokens - 1) // self.config.block_size
            if leader is None or leader.num_registered_blocks >= full_blocks:
                del self._held_siblings[rid]
                for sibling in siblings:
                    self.scheduler.add(sibling)

    def _validate_token_params(self, request: GenerationRequest) -> None:
        """``logit_bias`` keys must be token ids of this model's vocabulary."""
        bad = [t for t in request.sampling.logit_bias if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"logit_bias: token id {bad[0]} is outside the vocabulary "
                f"[0, {self.vocab_size})", "logit_bias")

    def _count(self, batch: ScheduledBatch) -> None:
        self.counters.steps += 1
        self.counters.batch_sizes[len(batch.seqs)] += 1
        for seq, num_new in _pairs(batch):
            start = seq.num_computed_tokens
            prompt_part = max(0, min(start + num_new, seq.num_prompt_tokens) - start)
            self.counters.prefill_tokens += prompt_part
            self.counters.decode_tokens += num_new - prompt_part

    def _eos_token_ids(self) -> set[int]:
        ids: set[int] = set()
        for source in (self.loaded.model.generation_config, self.tokenizer):
            value = getattr(source, "eos_token_id", None)
            ids.update(value if isinstance(value, list) else [] if value is None else [value])
        return ids


def _pairs(batch: ScheduledBatch):
    return zip(batch.seqs, batch.num_new_tokens, strict=True)
