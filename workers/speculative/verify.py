"""Verification of draft tokens against the target model's logits.

The target computes logits at every position of a verification block (the pending token and
``k`` drafts) in one forward pass. Position ``j`` is then sampled exactly as plain decoding
would sample it, with the same logits processors, filters and random draw, given the committed
tokens followed by the drafts before ``j``. The draft token ``d_j`` is accepted when it equals
that sample, and verification stops at the first position where it does not, whose sample is
committed instead (the corrected token); when every draft is accepted, the last position's
sample is the bonus token.

For a draft that proposes a single token (``ngram``, ``suffix``, a greedy draft model: a one-hot
draft distribution ``q``), this is the rejection sampling of Leviathan et al. 2023 and Chen et
al. 2023: ``d_j`` is accepted with probability ``p_j(d_j) = min(1, p_j(d_j) / q_j(d_j))``, and
on rejection the committed token is distributed as ``p_j`` without ``d_j``, renormalised, which
is ``norm(max(0, p_j - q_j))``. So every committed token has the target's distribution.
Because each position consumes its random draw only when it is reached, a seeded request draws
from its generator exactly as it would without speculation: its output does not depend on
what was proposed, and with fp32 logits it equals its non-speculative output token for token.
Greedy rows are the temperature-0 case of the same rule (accept while equal to the argmax).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from workers.sampler import SampledToken, SamplingRow, needs_processing, sample
from workers.structured.masks import PositionMask


def verify_drafts(logits: torch.Tensor, drafts: list[int], row: SamplingRow,
                  default_generator: torch.Generator,
                  masks: list[PositionMask] | None = None) -> list[SampledToken]:
    """The tokens a verification block commits: accepted drafts, then one corrected or bonus
    token.

    Args:
        logits: ``[len(drafts) + 1, V]`` float32: row ``j`` predicts the token after the
            committed tokens and ``drafts[:j]``.
        drafts: the proposed tokens.
        row: the sequence's sampling row; ``token_ids`` are its committed tokens.
        default_generator: the engine's RNG, for rows without their own.
        masks: a structured-output constraint's masks at each position (``len(drafts) + 1``;
            :meth:`GrammarMatcher.masks_along`), so each position samples from the
            constrained target distribution; None for free text.

    Returns:
        ``a + 1`` tokens, where ``a`` is the number of accepted drafts (``0 <= a <=
        len(drafts)``): ``drafts[:a]`` (with their logprobs when asked for) and the target's
        own token at position ``a``. Stop conditions are the caller's to apply.
    """
    if row.params.greedy and row.params.logprobs is None and not needs_processing(row):
        return _verify_argmax(logits, drafts)
    history = list(row.token_ids)
    committed: list[SampledToken] = []
    for j in range(len(drafts) + 1):
        position = replace(row, token_ids=history)
        if masks is not None:
            position = replace(position, allowed=masks[j].allowed, narrowed=masks[j].narrowed)
        token = sample(logits[j:j + 1], [position], default_generator)[0]
        committed.append(token)
        if j == len(drafts) or token.token_id != drafts[j]:
            break
        history.append(drafts[j])
    return committed


def _verify_argmax(logits: torch.Tensor, drafts: list[int]) -> list[SampledToken]:
    """Greedy rows without logits processors: one argmax over the whole block."""
    targets = logits.argmax(dim=-1).tolist()
    committed = []
    for target, draft in zip(targets, drafts + [None], strict=True):
        committed.append(SampledToken(target))
        if target != draft:
            break
    return committed
