"""Greedy engine output equals transformers ``generate`` token for token (fp32).

For SmolLM2-135M and a tiny random Qwen2 (GQA, qkv bias): cold single requests, cold requests
batched four at a time, and warm requests whose prompt prefix really is reused from the cache.
"Batched" is proved by the engine's sequences-per-step histogram and "warm" by the prefilled
token counter, never by timing.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from helpers import greedy, output_ids

from workers.model_loader import LoadedModel

NEW_TOKENS = 16
BLOCK = 16

SMOL_TEXTS = [
    "The history of the printing press begins in the fifteenth century, when Johannes "
    "Gutenberg in Mainz",
    "Photosynthesis is the process by which green plants, algae and some bacteria use the "
    "energy of sunlight, captured by chlorophyll in their chloroplasts, to",
    'def merge_sort(items):\n    """Sort a list of integers in ascending order."""\n    '
    "if len(items)",
    "Dear hiring manager, I am writing to apply for the position of software engineer at your",
    "In 1969, the Apollo 11 mission landed the first humans on the Moon. The astronauts who "
    "walked on the surface were",
    "Here is a simple recipe for pancakes. First, in a large bowl, mix two cups of flour with",
    "Mitochondria are often called the powerhouse of the cell because they produce most of the",
    "Question: What is the largest planet in our solar system? Answer: The largest planet is",
]


@dataclass
class Case:
    loaded: LoadedModel
    prompts: list[list[int]]
    references: list[list[int]]
    eos_token_ids: set[int]


def tiny_prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(11)
    lengths = [17, 20, 24, 29, 33, 36, 41, 47]
    return [torch.randint(3, 1000, (n,), generator=generator).tolist() for n in lengths]


@pytest.fixture(scope="module", params=["smollm", "tiny_qwen"])
def case(request, hf_greedy) -> Case:
    loaded: LoadedModel = request.getfixturevalue(request.param)
    if request.param == "smollm":
        prompts = [loaded.tokenizer.encode(t, add_special_tokens=False) for t in SMOL_TEXTS]
    else:
        prompts = tiny_prompts()
    eos = {loaded.tokenizer.eos_token_id, loaded.model.generation_config.eos_token_id}
    references = hf_greedy(loaded, prompts, NEW_TOKENS, eos)
    # the prompts have distinct first blocks (no reuse between them), at least one full block
    assert len({tuple(p[:BLOCK]) for p in prompts}) == len(prompts) == 8
    assert min(len(p) for p in prompts) > BLOCK
    assert all(1 <= len(r) <= NEW_TOKENS for r in references)
    return Case(loaded, prompts, references, eos)


def cached_when_warm(prompt: list[int]) -> int:
    """Full blocks of the prompt short of its last token: what a warm cache must serve."""
    return (len(prompt) - 1) // BLOCK * BLOCK


def test_single_requests_cold_then_warm_match_hf(case, make_engine):
    engine = make_engine(case.loaded, num_blocks=64, max_num_seqs=4)
    assert engine.eos_token_ids == case.eos_token_ids  # HF stops where the engine stops
    for i, prompt in enumerate(case.prompts):
        before = engine.counters.prefill_tokens
        request = greedy(f"cold-{i}", prompt, NEW_TOKENS, ignore_eos=False)
        chunks = engine.generate([request])[f"cold-{i}"]
        assert output_ids(chunks) == case.references[i], f"cold prompt {i}"
        assert chunks[-1].finish_reason == (
            "stop" if case.references[i][-1] in case.eos_token_ids else "length")
        assert chunks[-1].cached_tokens == 0
        assert chunks[-1].prompt_tokens == len(prompt)
        assert engine.counters.prefill_tokens - before == len(prompt)

    for i, prompt in enumerate(case.prompts):
        before = engine.counters.prefill_tokens
        request = greedy(f"warm-{i}", prompt, NEW_TOKENS, ignore_eos=False)
        chunks = engine.generate([request])[f"warm-{i}"]
        assert output_ids(chunks) == case.references[i], f"warm prompt {i}"
        assert chunks[-1].cached_tokens == cached_when_warm(prompt) >= BLOCK
        # the prefilled-token counter proves the hit: only the uncached tail was computed
        assert engine.counters.prefill_tokens - before == len(prompt) - cached_when_warm(prompt)
    assert set(engine.counters.batch_sizes) == {1}
    assert engine.pool.num_in_use == 0


def test_batched_cold_then_warm_requests_match_hf(case, make_engine):
    engine = make_engine(case.loaded, num_blocks=64, max_num_seqs=4)
    total_prompt = sum(len(p) for p in case.prompts)

    cold = engine.generate([greedy(f"b{i}", p, NEW_TOKENS, ignore_eos=False)
                            for i, p in enumerate(case.prompts)])
    for i in range(len(case.prompts)):
        assert output_ids(cold[f"b{i}"]) == case.references[i], f"cold batched prompt {i}"
        assert cold[f"b{i}"][-1].cached_tokens == 0
    assert engine.counters.prefill_tokens == total_prompt
    assert engine.scheduler.counters.prefix_hit_tokens == 0
    # really batched: two waves of four sequences per step
    assert max(engine.counters.batch_sizes) == 4
    assert engine.counters.batch_sizes[4] >= NEW_TOKENS
    cold_steps = engine.counters.steps
    assert cold_steps <= 2 * NEW_TOKENS

    warm = engine.generate([greedy(f"w{i}", p, NEW_TOKENS, ignore_eos=False)
                            for i, p in enumerate(case.prompts)])
    expected_cached = [cached_when_warm(p) for p in case.prompts]
    for i in range(len(case.prompts)):
        assert output_ids(warm[f"w{i}"]) == case.references[i], f"warm prompt {i}"
        assert [c.cached_tokens for c in warm[f"w{i}"]] == [expected_cached[i]] * len(
            warm[f"w{i}"])
    assert min(expected_cached) >= BLOCK
    # the warm pass prefilled only the uncached tails
    assert engine.counters.prefill_tokens - total_prompt == total_prompt - sum(expected_cached)
    assert engine.scheduler.counters.prefix_hit_tokens == sum(expected_cached)
    assert engine.scheduler.counters.prefix_query_tokens == 2 * total_prompt
    assert engine.counters.batch_sizes[4] >= 2 * NEW_TOKENS
    assert engine.pool.num_in_use == 0


def test_prompts_longer_than_the_token_budget_are_prefilled_in_chunks(case, make_engine):
    """A step budget of 8 tokens splits every prompt into chunks; steps that run only a middle
    chunk sample nothing. Output still equals HF, alone and batched."""
    engine = make_engine(case.loaded, max_num_batched_tokens=8)
    alone = engine.generate([greedy("alone", case.prompts[-1], NEW_TOKENS, ignore_eos=False)])
    assert output_ids(alone["alone"]) == case.references[-1]
    assert engine.counters.prefill_tokens == len(case.prompts[-1])
    assert engine.counters.steps >= len(case.prompts[-1]) // 8 + len(case.references[-1]) - 1

    requests = [greedy(f"c{i}", p, NEW_TOKENS, ignore_eos=False)
                for i, p in enumerate(case.prompts[:4])]
    outputs = engine.generate(requests)
    assert [output_ids(outputs[r.request_id]) for r in requests] == case.references[:4]
    assert max(engine.counters.batch_sizes) >= 2  # chunks and decodes shared steps
