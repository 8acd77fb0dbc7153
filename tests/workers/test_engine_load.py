"""The engine's load report counts every output token a request may still produce.

The router weighs load in tokens and takes the workers' ``queued_tokens`` as the truth once a
report lists a request: a cap on the output budget there (it was 128 tokens) made a request
without ``max_tokens``, which may generate to the end of the context, look nearly free.
"""

from __future__ import annotations

from contract.request import GenerationRequest, SamplingParams


def test_load_is_uncomputed_prompt_plus_the_rest_of_the_output_budget(make_engine, tiny_qwen):
    engine = make_engine(tiny_qwen, num_blocks=64, max_num_batched_tokens=1024)
    prompt = list(range(10, 10 + 40))
    sampling = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    engine.add_request(GenerationRequest("long", prompt, sampling=sampling))
    assert engine.load_by_request() == {"long": 40 + 400}
    produced = 0
    while produced < 3:
        produced += sum(len(chunk.token_ids) for chunk in engine.step())
    seq = engine.sequence("long")
    assert seq.num_output_tokens == produced
    # Prefilled; what is left is the output budget less what was generated (and any token
    # sampled but not yet computed).
    assert engine.load_by_request() == {"long": seq.num_uncomputed_tokens + 400 - produced}
    assert seq.num_uncomputed_tokens <= 1
    engine.abort("long")
