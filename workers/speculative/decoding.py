"""Speculative decoding inside one engine: ask for drafts, verify them, count what they saved.

Each step, before scheduling, the running decodes whose draft length
(:class:`~workers.speculative.controller.DraftLengthController`) is above 0 are asked for drafts
in one batched proposer call; the scheduler then gives each drafted sequence a verification
block (its pending token and the drafts), the model runs them with the rest of the batch, and
:func:`~workers.speculative.verify.verify_drafts` decides what is committed. A proposal is never
output (Leviathan et al. 2023; Chen et al. 2023).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence as Seq

import torch

from contract.request import SpecUsage
from workers.sampler import SampledToken, SamplingRow
from workers.sequence import Sequence
from workers.speculative.config import SpeculativeConfig
from workers.speculative.controller import DraftLengthController
from workers.speculative.proposer import ProposalRequest, Proposer
from workers.speculative.verify import verify_drafts
from workers.step_time import StepCostModel
from workers.structured.masks import PositionMask


class SpeculativeDecoding:
    """One engine's speculation: its proposer, draft lengths and counts.

    Args:
        proposer: proposes draft tokens (in process, or a draft replica's client).
        config: the speculative configuration (``num_speculative_tokens``, ``adaptive``).
        vocab_size: token ids a draft may hold; a draft stops at the first id outside.
        totals: the engine's speculative counts summed over every request (committed tokens
            only), updated in place.
        steps: the engine's fitted decode step time, which draft lengths are weighed with.

    Attributes:
        draft_calls: batched proposer calls made.
    """

    def __init__(self, proposer: Proposer, config: SpeculativeConfig, vocab_size: int,
                 totals: SpecUsage, steps: StepCostModel):
        self.proposer = proposer
        self.draft_length = DraftLengthController(config.num_speculative_tokens,
                                                  config.adaptive, steps=steps)
        self.vocab_size = vocab_size
        self.totals = totals
        self.draft_calls = 0

    def propose(self, decodes: list[Sequence], max_model_len: int) -> list[Sequence]:
        """Sets the drafts of every decode in ``decodes`` whose chosen draft length is above 0,
        in one batched proposer call; returns the sequences that got drafts. A proposer
        failure means no drafts this step, never different output."""
        asks = []
        for seq in decodes:
            # A draft past max_tokens or the context limit could never be committed.
            room = min(seq.sampling.max_tokens - seq.num_output_tokens,
                       max_model_len - seq.num_tokens) - 1
            k = min(room, self.draft_length.choose(seq.request_id, seq.spec, len(decodes)))
            for usage in (seq.spec, self.totals):
                usage.k_decisions[k] = usage.k_decisions.get(k, 0) + 1
            if k > 0:
                scope = seq.adapter.digest if seq.adapter is not None else ""
                asks.append((seq, ProposalRequest(seq.request_id, seq.token_ids,
                                                  seq.num_prompt_tokens, k, scope)))
        if not asks:
            return []
        proposals, elapsed = self._call([ask for _, ask in asks])
        drafted = []
        for (seq, ask), tokens in zip(asks, proposals, strict=True):
            seq.spec.draft_s += elapsed / len(asks)
            seq.spec_token_ids = self._draft_prefix(tokens[:ask.k])
            if seq.spec_token_ids:
                drafted.append(seq)
            else:
                self.draft_length.no_draft(seq.request_id)
        return drafted

    def verify(self, seq: Sequence, logits: torch.Tensor, row: SamplingRow,
               generator: torch.Generator,
               masks: list[PositionMask] | None) -> list[SampledToken]:
        """The tokens ``seq``'s verification block commits: accepted drafts, then one
        corrected or bonus token (``logits``: ``[len(drafts) + 1, V]``), under its
        structured-output constraint's mask at every position (``masks``, from
        :meth:`~workers.structured.grammar.GrammarMatcher.masks_along`; None for free
        text)."""
        return verify_drafts(logits, seq.spec_token_ids, row, generator, masks)

    def count(self, seq: Sequence, proposed: int, accepted: int, step_s: float) -> None:
        """One verification of ``proposed`` drafts of ``seq`` committed ``accepted`` of them
        in a step of ``step_s`` seconds; counted for the request and the engine."""
        for usage in (seq.spec, self.totals):
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

    def finish(self, seq: Sequence) -> None:
        """``seq`` ended: forget its draft length and tell the proposer."""
        self.draft_length.forget(seq.request_id)
        self.proposer.finish([seq.request_id])

    def _call(self, asks: list[ProposalRequest]) -> tuple[list[list[int]], float]:
        started = time.perf_counter()
        try:
            proposals = self.proposer.propose(asks)
        except Exception:  # a broken proposer costs speculation, never the step
            proposals = [[] for _ in asks]
        elapsed = time.perf_counter() - started
        self.draft_length.observe_draft(elapsed)
        self.draft_calls += 1
        self.totals.draft_s += elapsed
        return proposals, elapsed

    def _draft_prefix(self, tokens: Seq[int]) -> list[int]:
        """A draft is a prefix: an id outside the vocabulary ends it."""
        return list(itertools.takewhile(lambda t: 0 <= t < self.vocab_size, map(int, tokens)))
