"""The OpenAI ``usage`` object: what the worker has streamed back for a request, counted.

Counts are in tokens: the prompt once, the output tokens of every choice, and the prefix-cache
hit as ``prompt_tokens_details.cached_tokens``. A request that speculated also reports the draft
tokens accepted and rejected (OpenAI's ``completion_tokens_details``) and Nalar's
``speculative`` extension.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from pydantic import BaseModel

from contract.request import GenerationChunk, SpecUsage, TokenLogprob
from router.protocol import PromptTokensDetails, Usage


class CompletionTokensDetails(BaseModel):
    """``usage.completion_tokens_details``, OpenAI's predicted-output counts: the draft tokens
    speculative decoding committed (accepted) and discarded (rejected)."""

    accepted_prediction_tokens: int
    rejected_prediction_tokens: int


class SpeculativeUsage(BaseModel):
    """``usage.speculative``, Nalar's extension: one request's speculative decoding, summed
    over its choices (counts in tokens, times in seconds).

    ``acceptance_by_position[i]`` is the share of draft tokens at position ``i`` that were
    committed; ``k_decisions`` maps a chosen draft length (0: did not speculate) to steps.
    """

    proposed_tokens: int
    accepted_tokens: int
    rejected_tokens: int
    acceptance_rate: float
    verification_steps: int
    mean_accepted_length: float
    acceptance_by_position: list[float]
    k_decisions: dict[int, int]
    draft_s: float
    verify_s: float

    @classmethod
    def of(cls, spec: SpecUsage) -> SpeculativeUsage:
        """The extension object of one (summed) :class:`~contract.request.SpecUsage`."""
        by_position = [accepted / proposed if proposed else 0.0 for accepted, proposed
                       in zip(spec.accepted_by_position, spec.proposed_by_position, strict=True)]
        return cls(proposed_tokens=spec.proposed_tokens, accepted_tokens=spec.accepted_tokens,
                   rejected_tokens=spec.rejected_tokens, acceptance_rate=spec.acceptance_rate,
                   verification_steps=spec.verification_steps,
                   mean_accepted_length=spec.mean_accepted_length,
                   acceptance_by_position=by_position, k_decisions=dict(sorted(
                       spec.k_decisions.items())),
                   draft_s=spec.draft_s, verify_s=spec.verify_s)


class SpeculativeDecodingUsage(Usage):
    """``usage`` of a request that speculated: OpenAI's fields plus the draft counts.

    Serialised only where the app dumps with ``serialize_as_any`` (the response models
    declare plain :class:`~router.protocol.Usage`).
    """

    completion_tokens_details: CompletionTokensDetails
    speculative: SpeculativeUsage


def sum_spec_usage(specs: Sequence[SpecUsage]) -> SpecUsage:
    """The choices' speculative counts added up (per-position lists padded to the longest)."""
    total = SpecUsage()
    width = max((max(len(spec.proposed_by_position), len(spec.accepted_by_position))
                 for spec in specs), default=0)
    total.accepted_by_position = [0] * width
    total.proposed_by_position = [0] * width
    for spec in specs:
        total.proposed_tokens += spec.proposed_tokens
        total.accepted_tokens += spec.accepted_tokens
        total.verification_steps += spec.verification_steps
        total.draft_s += spec.draft_s
        total.verify_s += spec.verify_s
        for i, count in enumerate(spec.accepted_by_position):
            total.accepted_by_position[i] += count
        for i, count in enumerate(spec.proposed_by_position):
            total.proposed_by_position[i] += count
        for k, steps in spec.k_decisions.items():
            total.k_decisions[k] = total.k_decisions.get(k, 0) + steps
    return total


@dataclass
class ChoiceTally:
    """What the worker has streamed back for one choice so far; ``prompt_logprobs`` (one
    entry per prompt token) once its first output came with them."""

    completion_tokens: int = 0
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    spec: SpecUsage | None = None


@dataclass
class Tally:
    """What the worker has streamed back for one request (all its choices) so far."""

    prompt_tokens: int
    cached_tokens: int = 0
    tier_tokens: int = 0
    transfer_tokens: int = 0
    choices: dict[int, ChoiceTally] = field(default_factory=dict)

    def admit(self, chunk: GenerationChunk) -> None:
        """Records the prompt and prefix-cache counts a chunk carries, not its output (what
        is known when a request is admitted, before its first token)."""
        self.prompt_tokens = chunk.prompt_tokens or self.prompt_tokens
        if chunk.index == 0:  # later choices reuse the first one's prompt blocks
            self.cached_tokens = max(self.cached_tokens, chunk.cached_tokens)
            self.tier_tokens = max(self.tier_tokens, chunk.tier_tokens)
            self.transfer_tokens = max(self.transfer_tokens, chunk.transfer_tokens)

    def add(self, chunk: GenerationChunk) -> None:
        """Folds one chunk in."""
        # Counts are per choice (cumulative or fixed at admission); ``max`` keeps them right
        # whether a worker repeats them on every chunk or sends them once.
        self.admit(chunk)
        choice = self.choices.setdefault(chunk.index, ChoiceTally())
        choice.completion_tokens = max(choice.completion_tokens, chunk.completion_tokens)
        choice.text.append(chunk.text)
        choice.token_ids.extend(chunk.token_ids)
        choice.logprobs.extend(chunk.logprobs or ())
        if chunk.prompt_logprobs is not None:
            choice.prompt_logprobs = chunk.prompt_logprobs
        if chunk.finish_reason is not None:
            choice.finish_reason, choice.stop_reason = chunk.finish_reason, chunk.stop_reason
        choice.spec = chunk.spec or choice.spec  # a choice's counts so far ride on its last chunk

    @classmethod
    def merged(cls, tallies: list[Tally], n: int) -> Tally:
        """The tallies of a batch prompt's requests (``n`` choices each) as one: prompt and
        cached tokens summed, and request ``p``'s choice ``i`` as choice ``p * n + i``."""
        merged = cls(prompt_tokens=sum(t.prompt_tokens for t in tallies),
                     cached_tokens=sum(t.cached_tokens for t in tallies),
                     tier_tokens=sum(t.tier_tokens for t in tallies),
                     transfer_tokens=sum(t.transfer_tokens for t in tallies))
        for p, tally in enumerate(tallies):
            for i, choice in tally.choices.items():
                merged.choices[p * n + i] = choice
        return merged

    def usage(self) -> Usage:
        """The OpenAI ``usage`` object: the prompt once, the output tokens of every choice,
        and the prefix-cache hit as ``cached_tokens``; when a choice speculated, also the draft
        tokens accepted and rejected (``completion_tokens_details``) and the ``speculative``
        extension, summed over the choices."""
        completion = sum(c.completion_tokens for c in self.choices.values())
        fields = dict(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=completion,
            total_tokens=self.prompt_tokens + completion,
            prompt_tokens_details=PromptTokensDetails(
                cached_tokens=self.cached_tokens, cached_tokens_by_source=self._by_source()),
        )
        specs = [c.spec for c in self.choices.values() if c.spec is not None]
        if not specs:
            return Usage(**fields)
        spec = sum_spec_usage(specs)
        details = CompletionTokensDetails(accepted_prediction_tokens=spec.accepted_tokens,
                                          rejected_prediction_tokens=spec.rejected_tokens)
        return SpeculativeDecodingUsage(**fields, completion_tokens_details=details,
                                        speculative=SpeculativeUsage.of(spec))

    def _by_source(self) -> dict[str, int] | None:
        """The hit by source, when part of it came from the second tier or another worker."""
        if not self.tier_tokens and not self.transfer_tokens:
            return None
        local = self.cached_tokens - self.tier_tokens - self.transfer_tokens
        return {"local_cache_hit": local, "second_tier": self.tier_tokens,
                "external_kv_transfer": self.transfer_tokens}

    def ordered(self) -> list[tuple[int, ChoiceTally]]:
        """The choices by index."""
        return sorted(self.choices.items())
