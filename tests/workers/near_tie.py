"""Greedy comparisons that hold "up to the first near-tie" (/work/shared/cases/README.md).

In reduced precision (bf16) a token's logits depend on the shapes of the matmuls it went
through (rows in the step, chunk boundaries, cached vs recomputed prefix), so two correct
implementations can pick different tokens where the top two logits are closer than that
rounding noise. The comparison therefore follows the reference step by step, records its
top-1/top-2 logit margin, and demands token equality only before the first step whose margin is
below ``epsilon``; logits must agree within a tolerance up to and including that step (the
prefix is still shared there). Nothing is asserted after it: the continuations may part.

The speculative-decoding tests reuse this for bf16 verification against plain decoding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel


@dataclass
class GreedyTrace:
    """A greedy continuation with the evidence needed to judge it.

    Attributes:
        tokens: the greedy token ids, ``[steps]`` (ends at an end-of-sequence id or the cap).
        logits: ``[steps, vocab]`` float32 logits that chose each token.
        margins: ``[steps]`` top-1 minus top-2 logit at each step (logit units, >= 0).
    """

    tokens: list[int]
    logits: torch.Tensor
    margins: list[float]

    def first_near_tie(self, epsilon: float) -> int:
        """Index of the first step whose margin is below ``epsilon``; ``len(tokens)`` if none."""
        return next((i for i, m in enumerate(self.margins) if m < epsilon), len(self.tokens))


def top2_margin(logits: torch.Tensor) -> torch.Tensor:
    """``[..., vocab]`` logits → ``[...]`` top-1 minus top-2 logit."""
    top = torch.topk(logits.float(), 2, dim=-1).values
    return top[..., 0] - top[..., 1]


def greedy_trace(model: PreTrainedModel, prompt: list[int], max_new_tokens: int,
                 eos_token_ids: set[int]) -> GreedyTrace:
    """Greedy decoding by the transformers model itself: its own ``DynamicCache``, batch of
    one, SDPA attention (the engine's attention implementation is restored afterwards), one
    forward per token. Equivalent to ``generate(do_sample=False)``, but keeps every step's
    logits.
    """
    previous = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    try:
        return _greedy_trace(model, prompt, max_new_tokens, eos_token_ids)
    finally:
        model.set_attn_implementation(previous)


@torch.inference_mode()
def _greedy_trace(model: PreTrainedModel, prompt: list[int], max_new_tokens: int,
                  eos_token_ids: set[int]) -> GreedyTrace:
    cache = DynamicCache(config=model.config)
    ids = torch.tensor([prompt], device=model.device)
    tokens, rows = [], []
    for _ in range(max_new_tokens):
        out = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
        row = out.logits[0, -1].float()
        token = int(row.argmax())
        tokens.append(token)
        rows.append(row)
        if token in eos_token_ids:
            break
        ids = torch.tensor([[token]], device=model.device)
    logits = torch.stack(rows)
    return GreedyTrace(tokens, logits, top2_margin(logits).tolist())


def assert_equal_until_near_tie(tokens: list[int], logits: torch.Tensor | None,
                                reference: GreedyTrace, epsilon: float, atol: float,
                                label: str = "") -> int:
    """Assert ``tokens`` (and ``logits``, ``[steps, vocab]``, when given) follow the reference
    up to its first near-tie.

    Returns:
        The index of the first near-tie (the number of tokens that had to be equal).

    Raises:
        AssertionError: a token differs before the near-tie, the output stopped early, or a
            logit differs by more than ``atol`` at a step up to and including the near-tie.
    """
    tie = reference.first_near_tie(epsilon)
    must_match = reference.tokens[:tie]
    assert tokens[:tie] == must_match, (
        f"{label}: tokens differ before the first near-tie (step {tie}, epsilon {epsilon}): "
        f"got {tokens[:tie]}, reference {must_match}, margins {reference.margins[:tie]}")
    if logits is not None:
        steps = min(tie + 1, len(reference.tokens), len(logits))
        diff = (logits[:steps].float() - reference.logits[:steps]).abs().amax(dim=-1)
        assert bool((diff <= atol).all()), (
            f"{label}: logits differ by {diff.tolist()} (> {atol}) within the first {steps} steps")
    return tie
