"""A request's state inside the engine: its tokens, its block table, how much KV is computed."""

from __future__ import annotations

import enum

import torch

from contract.identity import block_digest
from contract.request import FinishReason, GenerationRequest, SpecUsage, TokenLogprob
from workers.kv_tier import prefix_check
from workers.lora.adapter import LoraAdapter
from workers.structured.grammar import GrammarMatcher


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """One request being served.

    ``token_ids`` holds the prompt followed by every committed output token. The first
    ``num_computed_tokens`` of them have their KV in the blocks of ``block_table``; the rest are
    fed to the model in the coming steps (a whole prompt, a prefill chunk, or one decode token).

    Attributes:
        request: the request as received.
        root_digest: the identity root its block digests chain from (model, adapter,
            namespace).
        adapter: the LoRA adapter its rows run under, None for the base model.
        num_tier_tokens: of ``num_cached_tokens``, those loaded from the second KV tier
            after their eviction here.
        num_transfer_tokens: of ``num_cached_tokens``, those fetched from another worker.
        num_cached_tokens: prompt tokens reused from the prefix cache at first admission;
            re-admission after preemption never changes it, so hits are counted once.
        generator: per-request RNG when the request is seeded, so the output does not depend
            on which other requests share its batch.
        choice_index: which of the request's ``n`` choices this is. With ``n > 1`` each choice
            has its own id (``<request id>#<index>``) and sampling parameters (seed + index).
        prompt_digests: the digests of the prompt's full blocks under ``root_digest``, already
            verified (:meth:`contract.identity.PromptDigests.verified`); the chain is extended
            from them, never recomputed.
        stop_reason: what ended it with ``finish_reason`` "stop": the stop string matched, or
            the requested stop token; None for the model's end-of-sequence token, a grammar's
            end and every other finish (vLLM's ``stop_reason``).
        prompt_logprobs: when the request asked for them, the prompt tokens' log-probabilities
            computed so far, one entry per prompt token from the first (None: nothing precedes
            it); delivered once, with its first output (:meth:`take_prompt_logprobs`).
        queued_at_step: the scheduler step at which it last joined the waiting queue.
        spec_token_ids: draft tokens proposed for the coming step, verified in it; never part
            of ``token_ids`` until verification commits them.
        spec: its speculative decoding counts.
        arrived_at, scheduled_at, first_token_at, last_token_at, finished_at: monotonic
            seconds of its arrival at the engine, first scheduled step, first and latest steps
            that committed output tokens, and finish (None until then); stamped by
            :class:`~workers.request_metrics.RequestMetrics`.
    """

    def __init__(self, request: GenerationRequest, root_digest: bytes, block_size: int,
                 choice_index: int = 0, prompt_digests: list[bytes] | None = None,
                 adapter: LoraAdapter | None = None):
        self.request = request
        self.adapter = adapter
        self.grammar: GrammarMatcher | None = None  # a structured-output constraint's state
        self.choice_index = choice_index
        self.request_id = (request.request_id if request.sampling.n == 1
                           else f"{request.request_id}#{choice_index}")
        self.sampling = request.sampling.for_choice(choice_index)
        self.queued_at_step = 0
        self.root_digest = root_digest
        self.block_size = block_size
        self.token_ids: list[int] = list(request.token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.block_table: list[int] = []
        self.num_computed_tokens = 0
        self.num_registered_blocks = 0
        self.num_cached_tokens = 0
        self.num_tier_tokens = 0
        self.num_transfer_tokens = 0
        self.admitted = False
        self.status = SequenceStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | str | None = None
        self.stop_token_ids = frozenset(self.sampling.stop_token_ids)
        self.prompt_logprobs: list[TokenLogprob | None] | None = (
            None if self.sampling.prompt_logprobs is None else [None])
        self._prompt_logprobs_sent = False
        self._digests: list[bytes] = list(prompt_digests or ())
        self._checks: list[bytes] = []
        self.spec_token_ids: list[int] = []
        self.spec = SpecUsage()
        self.arrived_at = 0.0
        self.scheduled_at: float | None = None
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.finished_at: float | None = None
        self.generator: torch.Generator | None = None
        if self.sampling.seed is not None:
            self.generator = torch.Generator().manual_seed(generator_seed(self.sampling.seed))

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def num_reusable_blocks(self) -> int:
        """Leading full blocks a cache hit may cover: every one but a block ending on the
        last token, which is always computed again for its logits; none when the request asked
        for prompt logprobs, which need every prompt position's logits (as vLLM)."""
        if self.sampling.prompt_logprobs is not None:
            return 0
        return (self.num_tokens - 1) // self.block_size

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Whether prompt tokens' log-probabilities remain to be computed."""
        return (self.prompt_logprobs is not None
                and len(self.prompt_logprobs) < self.num_prompt_tokens)

    def take_prompt_logprobs(self) -> list[TokenLogprob | None] | None:
        """The prompt logprobs, once all are computed and only the first time asked."""
        if self._prompt_logprobs_sent or self.prompt_logprobs is None or self.wants_prompt_logprobs:
            return None
        self._prompt_logprobs_sent = True
        return self.prompt_logprobs

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def budget(self, max_model_len: int) -> int:
        """Tokens this sequence may still produce: within ``max_tokens`` and the context of
        ``max_model_len`` tokens."""
        return min(self.sampling.max_tokens - self.num_output_tokens,
                   max_model_len - self.num_tokens)

    def block_tokens(self, index: int) -> list[int]:
        """Token ids of full block ``index``."""
        start = index * self.block_size
        return self.token_ids[start:start + self.block_size]

    def digest(self, index: int) -> bytes:
        """Chained digest of full block ``index``, extending the chain lazily."""
        while len(self._digests) <= index:
            parent = self._digests[-1] if self._digests else self.root_digest
            self._digests.append(block_digest(parent, self.block_tokens(len(self._digests))))
        return self._digests[index]

    def parent_digest(self, index: int) -> bytes:
        """The digest block ``index``'s chain extends: the previous block's, or the root's."""
        return self.digest(index - 1) if index else self.root_digest

    def prefix_check(self, index: int) -> bytes:
        """:func:`~workers.kv_tier.prefix_check` of full block ``index``'s token prefix,
        extending the chain lazily (the second KV tier checks hits against it)."""
        while len(self._checks) <= index:
            parent = self._checks[-1] if self._checks else self.root_digest
            self._checks.append(prefix_check(parent, self.block_tokens(len(self._checks))))
        return self._checks[index]

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks to hold the KV of the first ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def finish(self, reason: FinishReason) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason


def generator_seed(seed: int) -> int:
    """The seed a request's ``seed`` gives its torch generator: SplitMix64 (Steele et al.
    2014) of ``seed`` mod 2**64.

    torch's CPU generator (MT19937) keeps only a seed's low 32 bits, so seeds 5 and 5 + 2**32
    would draw the same tokens. Mixed first, every bit of the 64 takes part: two seeds still
    share a stream with a chance of 2**-32, not for a whole family of them. ``-1`` and
    ``2**64 - 1``, one value mod 2**64, share one.
    """
    z = (seed + 0x9E3779B97F4A7C15) % 2**64
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 % 2**64
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB % 2**64
    return z ^ (z >> 31)
