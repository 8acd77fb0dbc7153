"""The engine: continuous batching over a paged KV cache with identity-checked prefix reuse.

Synchronous core; ``workers.async_engine`` runs it in a thread and streams its outputs.
"""

from __future__ import annotations

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
from workers.paged_attention import ATTN_IMPLEMENTATION
from workers.request import (
    DECODE_HORIZON,
    GenerationChunk,
    GenerationRequest,
    InvalidRequestError,
    TokenLogprob,
)
from workers.sampler import SampledToken, SamplingRow, sample
from workers.scheduler import ScheduledBatch, Scheduler
from workers.sequence import Sequence


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
    """

    steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    batch_sizes: Counter = field(default_factory=Counter)


class LLMEngine:
    """One worker's engine.

    Args:
        config: engine configuration.
        loaded: an already loaded model (tests share one); None loads ``config.model``.
    """

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None):
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
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
        # The runner's path (compact or transformers modules) changes rounding, so the KV it
        # computes is only reusable by workers running the same path.
        attention = f"{ATTN_IMPLEMENTATION}/{self.runner.implementation}"
        self.identity = CacheIdentity(self.loaded.model_digest,
                                      numerics_tag(self.loaded.device, attention),
                                      config.block_size)
        self.vocab_size = model_config.vocab_size
        self.eos_token_ids = self._eos_token_ids()
        self.counters = EngineCounters()
        self._seqs: dict[str, Sequence] = {}
        self._choices: dict[str, list[Sequence]] = {}
        self._held_siblings: dict[str, list[Sequence]] = {}
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
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

    def add_request(self, request: GenerationRequest) -> None:
        """Validate and queue a request (raises as :meth:`validate`).

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
        """Schedule, run one forward pass, sample, and commit. Returns one chunk per sequence
        that sampled a token this step (prefill chunks that end mid-prompt sample nothing).

        Raises:
            StepFailedError: the forward pass, commit or sampling raised. Every request with a
                sequence in this step's batch is aborted (its blocks freed) and named in the
                error; every other request is untouched and the engine keeps serving.
        """
        batch = self.scheduler.schedule()
        if not batch.seqs:
            return []
        try:
            return self._run_batch(batch)
        except Exception as exc:
            raise StepFailedError(self._abort_batch(batch), exc) from exc

    def _run_batch(self, batch: ScheduledBatch) -> list[GenerationChunk]:
        sample_rows = [i for i, (seq, num_new) in enumerate(_pairs(batch))
                       if seq.num_computed_tokens + num_new == seq.num_tokens]
        logits = self.runner.execute(batch, sample_rows)
        self._count(batch)
        for seq, num_new in _pairs(batch):
            self.block_manager.commit(seq, num_new)
        self._release_siblings()
        sampled_seqs = [batch.seqs[i] for i in sample_rows]
        rows = [SamplingRow(s.sampling, s.token_ids, s.num_prompt_tokens, s.stop_token_ids,
                            s.generator) for s in sampled_seqs]
        sampled = sample(logits, rows, self._generator)
        return [self._append(seq, token) for seq, token in zip(sampled_seqs, sampled, strict=True)]

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
        """Work queued or running here, in tokens, per request id: uncomputed tokens plus the
        output tokens the request may still produce, capped at :data:`DECODE_HORIZON`."""
        load: dict[str, int] = {}
        for seq in list(self._seqs.values()):
            rid = seq.request.request_id
            load[rid] = load.get(rid, 0) + seq.num_uncomputed_tokens + min(
                seq.sampling.max_tokens - seq.num_output_tokens, DECODE_HORIZON)
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

    def _append(self, seq: Sequence, sampled: SampledToken) -> GenerationChunk:
        """Commits one sampled token and decides, as OpenAI defines ``finish_reason``:
        "stop" when it is EOS / a stop token or completes a stop string (even on the
        ``max_tokens``-th token), else "length" at ``max_tokens`` or the context limit."""
        token = sampled.token_id
        seq.token_ids.append(token)
        sampling = seq.sampling
        detokenizer = self._detokenizers[seq.request_id]
        # min_tokens: the sampler masks stop tokens until then; a logit_bias cannot unmask them.
        is_stop_token = (token in seq.stop_token_ids
                         and seq.num_output_tokens > sampling.min_tokens)
        text = "" if is_stop_token else detokenizer.add(token)
        if is_stop_token or detokenizer.stopped:
            seq.finish("stop")
        elif (seq.num_output_tokens >= sampling.max_tokens
              or seq.num_tokens >= self.max_model_len):
            seq.finish("length")
        logprobs = None if sampled.logprobs is None else [sampled.logprobs]
        if seq.is_finished:
            return self._finish(seq, text + detokenizer.flush(), logprobs)
        return self._chunk(seq, [token], text, logprobs)

    def _finish(self, seq: Sequence, text: str,
                logprobs: list[TokenLogprob] | None = None) -> GenerationChunk:
        self.scheduler.finish(seq)
        del self._seqs[seq.request_id]
        del self._detokenizers[seq.request_id]
        rid = seq.request.request_id
        choices = self._choices[rid]
        choices.remove(seq)
        if not choices:
            del self._choices[rid]
            self._held_siblings.pop(rid, None)
        self._release_siblings()
        tokens = [seq.token_ids[-1]] if seq.finish_reason != "abort" else []
        return self._chunk(seq, tokens, text, logprobs)

    def _chunk(self, seq: Sequence, tokens: list[int], text: str,
               logprobs: list[TokenLogprob] | None = None) -> GenerationChunk:
        rid = seq.request.request_id
        return GenerationChunk(rid, tokens, text, seq.finish_reason,
                               seq.num_prompt_tokens, seq.num_cached_tokens,
                               seq.num_output_tokens, index=seq.choice_index,
                               logprobs=logprobs, choices_left=len(self._choices.get(rid, ())))

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
