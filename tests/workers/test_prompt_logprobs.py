"""Prompt logprobs (vLLM's ``prompt_logprobs``) from the engine, against a transformers forward
pass over the same prompt: values, ranks and alternatives, across prefill chunks, past a
cached prefix, and with ``n`` choices."""

from __future__ import annotations

import pytest
import torch
from tiny_models import reference_attention

from contract.request import GenerationRequest, InvalidRequestError, SamplingParams
from workers import scheduler
from workers.model_loader import LoadedModel

PROMPT = list(range(100, 140))  # 40 tokens: two full 16-token blocks plus 8


def reference_logprobs(loaded: LoadedModel, prompt: list[int]) -> torch.Tensor:
    """``[len(prompt) - 1, V]``: row ``t`` is the distribution prompt token ``t + 1`` was
    drawn from, by transformers with plain SDPA attention."""
    with reference_attention(loaded.model), torch.inference_mode():
        logits = loaded.model(torch.tensor([prompt])).logits[0].float()
    return logits.log_softmax(-1)[:-1]


def assert_matches(entries, prompt: list[int], reference: torch.Tensor, top: int) -> None:
    assert len(entries) == len(prompt) and entries[0] is None
    for position, entry in enumerate(entries[1:]):
        row = reference[position]
        token = prompt[position + 1]
        assert entry.token_id == token
        assert entry.logprob == pytest.approx(float(row[token]), abs=1e-4)
        assert entry.rank == 1 + int((row > row[token]).sum())
        values, ids = row.topk(top)
        assert [t for t, _ in entry.top] == ids.tolist()
        assert [v for _, v in entry.top] == pytest.approx(values.tolist(), abs=1e-4)


def run(engine, sampling: SamplingParams, prompt: list[int] = PROMPT, rid: str = "r"):
    return engine.generate([GenerationRequest(rid, prompt, sampling)])[rid]


def test_prompt_logprobs_match_transformers_over_the_embedded_model(smollm, make_engine):
    engine = make_engine(smollm, num_blocks=16)
    prompt = smollm.tokenizer.encode("The capital of France is Paris, and the capital of "
                                     "Italy is Rome.")
    chunks = run(engine, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True,
                                        prompt_logprobs=5), prompt)
    assert_matches(chunks[0].prompt_logprobs, prompt, reference_logprobs(smollm, prompt), 5)
    assert all(c.prompt_logprobs is None for c in chunks[1:])
    # " Paris" after "The capital of France is" is the model's first choice.
    paris = prompt.index(smollm.tokenizer.encode(" Paris")[0])
    assert chunks[0].prompt_logprobs[paris].rank == 1


def test_prompt_logprobs_across_chunks_and_a_cached_prefix(tiny_qwen, make_engine,
                                                           monkeypatch):
    monkeypatch.setattr(scheduler, "PROMPT_LOGPROBS_CHUNK_TOKENS", 16)
    engine = make_engine(tiny_qwen, num_blocks=32)
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    plain = run(engine, greedy, rid="warm")  # caches the prompt's two full blocks
    computed = engine.counters.prefill_tokens
    steps = engine.counters.steps
    chunks = run(engine, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True,
                                        prompt_logprobs=2))
    # The whole prompt is computed again (a cached block has no logits), 16 tokens a step.
    assert engine.counters.prefill_tokens - computed == len(PROMPT)
    assert engine.counters.steps - steps == 3 + 3  # 16 + 16 + 8 prompt tokens, 3 decodes
    assert chunks[-1].cached_tokens == 0
    assert_matches(chunks[0].prompt_logprobs, PROMPT, reference_logprobs(tiny_qwen, PROMPT), 2)
    # The sampled tokens are those of the plain request, and its blocks serve the next one.
    assert [t for c in chunks for t in c.token_ids] == [t for c in plain for t in c.token_ids]
    after = run(engine, greedy, rid="again")
    assert after[-1].cached_tokens == 32
    assert engine.pool.num_in_use == 0


def test_each_choice_gets_the_prompt_logprobs_once(tiny_qwen, make_engine):
    engine = make_engine(tiny_qwen, num_blocks=32)
    chunks = run(engine, SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=3,
                                        ignore_eos=True, prompt_logprobs=0))
    reference = reference_logprobs(tiny_qwen, PROMPT)
    for index in (0, 1):
        given = [c.prompt_logprobs for c in chunks if c.index == index and c.prompt_logprobs]
        assert len(given) == 1
        assert_matches(given[0], PROMPT, reference, 0)
    assert all(c.prompt_logprobs is None for c in run(engine, SamplingParams(max_tokens=2)))


def test_a_one_token_prompt_has_only_its_leading_none(tiny_qwen, make_engine):
    engine = make_engine(tiny_qwen, num_blocks=8)
    chunks = run(engine, SamplingParams(max_tokens=1, prompt_logprobs=1), [7])
    assert chunks[0].prompt_logprobs == [None]


@pytest.mark.parametrize("value", [-1, 21])
def test_prompt_logprobs_out_of_range_are_refused(tiny_qwen, make_engine, value):
    engine = make_engine(tiny_qwen, num_blocks=8)
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request(GenerationRequest("r", PROMPT, SamplingParams(prompt_logprobs=value)))
    assert info.value.param == "prompt_logprobs"


def test_max_tokens_0_scores_the_prompt_and_generates_nothing(tiny_qwen, make_engine):
    engine = make_engine(tiny_qwen, num_blocks=32)
    chunks = run(engine, SamplingParams(max_tokens=0, prompt_logprobs=1))
    assert len(chunks) == 1
    (last,) = chunks
    assert (last.token_ids, last.text, last.finish_reason, last.completion_tokens) == (
        [], "", "length", 0)
    assert_matches(last.prompt_logprobs, PROMPT, reference_logprobs(tiny_qwen, PROMPT), 1)
    assert engine.counters.prefill_tokens == len(PROMPT) and engine.pool.num_in_use == 0
    with pytest.raises(InvalidRequestError) as info:  # nothing to score: nothing to do
        engine.add_request(GenerationRequest("r2", PROMPT, SamplingParams(max_tokens=0)))
    assert info.value.param == "max_tokens"
