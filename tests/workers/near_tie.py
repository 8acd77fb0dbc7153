"""Greedy comparisons that hold "up to the first near-tie" (/work/shared/cases/README.md).

In reduced precision (bf16) a token's logits depend on the shapes of the matmuls it went
through (rows in the step, chunk boundaries, cached vs recomputed prefix), so two correct
implementations can pick different tokens where the top two logits are closer than that
rounding noise. The comparison therefore follows the reference step by step, records its
top-1/top-2 logit margin, and lets the tokens part from it only at a step whose margin is below
``epsilon`` (so they are equal at least up to the first near-tie); logits must agree within a
tolerance at every step whose prefix is still shared. Nothing is asserted after the tokens
part: from there the continuations legitimately differ.

The speculative-decoding tests reuse this for bf16 verification against plain decoding.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
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


def assert_matches_until_near_tie(tokens: list[int], logits: torch.Tensor | None,
                                  reference: GreedyTrace, epsilon: float, atol: float,
                                  label: str = "") -> int:
    """Assert greedy ``tokens`` follow the reference until they part at a near-tie, if ever.

    Stronger than "equal up to the first near-tie": the tokens may differ from the reference
    only at a step whose reference margin is below ``epsilon`` (so they are equal up to the
    first near-tie, and past it for as long as no near-tie flips), and ``logits`` (when given,
    ``[steps, vocab]``, the rows that chose ``tokens``) agree within ``atol`` at every step up
    to and including that one, where both still share the prefix.

    Returns:
        The number of steps compared (shared prefix, plus the parting step if any).

    Raises:
        AssertionError: tokens part where the reference margin is at least ``epsilon``, the
            output ends at a different length without parting, or a logit differs by more
            than ``atol`` within the shared prefix.
    """
    pairs = zip(tokens, reference.tokens, strict=False)  # an early end is judged below
    shared = next((i for i, (a, b) in enumerate(pairs) if a != b), None)
    if shared is None:
        assert len(tokens) == len(reference.tokens), (
            f"{label}: {len(tokens)} tokens, reference {len(reference.tokens)}")
        steps = len(tokens)
    else:
        margin = reference.margins[shared]
        assert margin < epsilon, (
            f"{label}: token {shared} is {tokens[shared]}, reference {reference.tokens[shared]} "
            f"with margin {margin} >= epsilon {epsilon} (first near-tie at step "
            f"{reference.first_near_tie(epsilon)})")
        steps = shared + 1
    if logits is not None:
        diff = (logits[:steps].float() - reference.logits[:steps]).abs().amax(dim=-1)
        assert bool((diff <= atol).all()), (
            f"{label}: logits differ by up to {diff.tolist()} (atol {atol}) over the "
            f"{steps} steps sharing a prefix")
    return steps


@contextlib.contextmanager
def captured_logits(engine) -> Iterator[dict[str, list[torch.Tensor]]]:
    """Record, per request id, every logits row the engine's runner returns for sampling
    (``[vocab]`` float32 each, in step order) while the context is open."""
    captured: dict[str, list[torch.Tensor]] = {}
    execute = engine.runner.execute

    def recording(batch, num_logits):
        logits = execute(batch, num_logits)
        rows = iter(logits)
        for seq, count in zip(batch.seqs, num_logits, strict=True):
            for _ in range(count):
                captured.setdefault(seq.request_id, []).append(next(rows).detach().clone())
        return logits

    engine.runner.execute = recording
    try:
        yield captured
    finally:
        engine.runner.execute = execute
