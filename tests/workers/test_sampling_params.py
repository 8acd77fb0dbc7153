"""Sampling parameters through the engine (tiny random Qwen2, fp32): min_tokens, logit_bias,
repetition penalty against transformers, raw logprobs, n > 1 choices sharing the prompt's
blocks, seeds, OpenAI's finish_reason rules, and vLLM's allowed_token_ids and bad words."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from tiny_models import reference_attention

from contract.request import GenerationChunk, GenerationRequest, SamplingParams
from workers.model_loader import LoadedModel

EOS = 2  # the tiny model's EOS
PROMPT = list(range(100, 140))  # 40 tokens: two full 16-token blocks plus 8


def tokens(chunks: list[GenerationChunk], index: int = 0) -> list[int]:
    return [t for c in chunks if c.index == index for t in c.token_ids]


def run(engine, sampling: SamplingParams, prompt: list[int] = PROMPT) -> list[GenerationChunk]:
    return engine.generate([GenerationRequest("r", prompt, sampling)])["r"]


def hf_generate(loaded: LoadedModel, prompt: list[int], **kwargs) -> list[int]:
    """transformers ``generate``, greedy, with plain SDPA attention (restored afterwards)."""
    ids = torch.tensor([prompt])
    with reference_attention(loaded.model), torch.inference_mode():
        out = loaded.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                    eos_token_id=[EOS], pad_token_id=EOS, **kwargs)
    return out[0, len(prompt):].tolist()


def test_min_tokens_masks_eos_until_reached(tiny_qwen, make_engine):
    engine = make_engine(tiny_qwen, num_blocks=32)
    eos_forced = SamplingParams(temperature=0.0, max_tokens=20, logit_bias={EOS: 100.0})
    assert tokens(run(engine, eos_forced)) == [EOS]
    chunks = run(engine, SamplingParams(temperature=0.0, max_tokens=20, min_tokens=5,
                                        logit_bias={EOS: 100.0}))
    out = tokens(chunks)
    assert len(out) == 6 and out[-1] == EOS and EOS not in out[:-1]
    assert chunks[-1].finish_reason == "stop"
    # stop_token_ids are masked too
    chunks = run(engine, SamplingParams(temperature=0.0, max_tokens=20, min_tokens=3,
                                        stop_token_ids=[7], logit_bias={7: 100.0},
                                        ignore_eos=True))
    assert tokens(chunks)[-1] == 7 and len(tokens(chunks)) == 4


def test_logit_bias_moves_the_argmax(tiny_qwen, make_engine):
    engine = make_engine(tiny_qwen, num_blocks=32)
    plain = tokens(run(engine, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)))
    forced = tokens(run(engine, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True,
                                               logit_bias={321: 100.0})))
    assert forced == [321] * 4
    banned = tokens(run(engine, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True,
                                               logit_bias={plain[0]: -100.0})))
    assert banned[0] != plain[0]


def test_logit_bias_outside_the_vocabulary_is_refused(tiny_qwen, make_engine):
    from contract.request import InvalidRequestError
    engine = make_engine(tiny_qwen, num_blocks=32)
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request(GenerationRequest("r", PROMPT, SamplingParams(logit_bias={1000: 1})))
    assert info.value.param == "logit_bias"


@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_repetition_penalty_matches_transformers(tiny_qwen, make_engine, penalty):
    engine = make_engine(tiny_qwen, num_blocks=32)
    prompt = [5, 6, 7, 8] * 6  # repeated tokens, so the penalty bites
    got = tokens(run(engine, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                            repetition_penalty=penalty), prompt))
    want = hf_generate(tiny_qwen, prompt, max_new_tokens=12, repetition_penalty=penalty,
                       min_new_tokens=12)
    plain = hf_generate(tiny_qwen, prompt, max_new_tokens=12, min_new_tokens=12)
    assert got == want
    assert want != plain  # the penalty changed the output, so the test can fail


def reference_logits(loaded: LoadedModel, ids: list[int]) -> torch.Tensor:
    """``[len(ids), V]`` float32 logits of transformers' forward pass with SDPA attention."""
    with reference_attention(loaded.model), torch.inference_mode():
        return loaded.model(torch.tensor([ids])).logits[0].float()


def test_logprobs_are_of_the_raw_model_distribution(tiny_qwen, make_engine):
    engine = make_engine(tiny_qwen, num_blocks=32)
    sampling = SamplingParams(temperature=0.7, top_k=5, max_tokens=6, ignore_eos=True,
                              logprobs=3, seed=5, repetition_penalty=1.2)
    chunks = run(engine, sampling)
    out = tokens(chunks)
    entries = [lp for c in chunks for lp in (c.logprobs or [])]
    assert [e.token_id for e in entries] == out
    logits = reference_logits(tiny_qwen, PROMPT + out)
    raw = logits.log_softmax(-1)[len(PROMPT) - 1:-1]  # the rows that predicted each output
    for step, entry in enumerate(entries):
        assert entry.logprob == pytest.approx(float(raw[step, entry.token_id]), abs=1e-4)
        values, ids = raw[step].topk(3)
        assert [t for t, _ in entry.top] == ids.tolist()
        assert [v for _, v in entry.top] == pytest.approx(values.tolist(), abs=1e-4)
    assert all(c.logprobs is None for c in run(engine, SamplingParams(max_tokens=2)))


def test_n_choices_share_the_prompt_and_count_usage(tiny_qwen, make_engine):
    engine = make_engine(tiny_qwen, num_blocks=32)
    sampling = SamplingParams(temperature=1.0, seed=100, n=3, max_tokens=5, ignore_eos=True)
    chunks = engine.generate([GenerationRequest("r", PROMPT, sampling)])["r"]
    # The prompt is prefilled once; each sibling recomputes only the 8 tokens after the two
    # full blocks it finds cached.
    assert engine.counters.prefill_tokens == 40 + 2 * 8
    assert {c.index for c in chunks} == {0, 1, 2}
    finals = [c for c in chunks if c.finish_reason is not None]
    assert sorted(c.index for c in finals) == [0, 1, 2]
    assert [c.is_last for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert sum(c.completion_tokens for c in finals) == 15
    assert [c.cached_tokens for c in finals if c.index > 0] == [32, 32]
    assert engine.pool.num_in_use == 0
    # Choice i is exactly the lone request seeded with seed + i.
    for index in range(3):
        alone = make_engine(tiny_qwen, num_blocks=32)
        lone = SamplingParams(temperature=1.0, seed=100 + index, max_tokens=5, ignore_eos=True)
        assert tokens(run(alone, lone)) == tokens(chunks, index)
    assert len({tuple(tokens(chunks, i)) for i in range(3)}) == 3


def test_aborting_an_n_request_frees_every_choice(tiny_qwen, make_engine):
    engine = make_engine(tiny_qwen, num_blocks=32)
    engine.add_request(GenerationRequest("r", PROMPT, SamplingParams(n=4, max_tokens=50)))
    for _ in range(3):
        engine.step()
    last = engine.abort("r")
    assert last is not None and last.is_last and last.finish_reason == "abort"
    assert engine.pool.num_in_use == 0 and not engine.has_work()


def test_seeded_request_is_the_same_beside_any_neighbours(tiny_qwen, make_engine):
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=4242, max_tokens=10,
                            ignore_eos=True)
    alone = tokens(run(make_engine(tiny_qwen, num_blocks=64), seeded))
    neighbours = [SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True),
                  SamplingParams(temperature=0.5, top_k=3, min_p=0.1, max_tokens=10),
                  SamplingParams(temperature=0.0, presence_penalty=1.0, max_tokens=10),
                  SamplingParams(temperature=1.3, top_p=0.5, frequency_penalty=0.5, n=2,
                                 max_tokens=10, seed=1)]
    engine = make_engine(tiny_qwen, num_blocks=64)
    chunks = engine.generate([GenerationRequest("s", PROMPT, seeded)]
                             + [GenerationRequest(f"n{i}", list(range(300 + i, 330)), p)
                                for i, p in enumerate(neighbours)])
    assert max(engine.counters.batch_sizes) >= 5
    assert tokens(chunks["s"]) == alone
    # Again on the same engine: the prompt's two full blocks now come from the cache.
    again = engine.generate([GenerationRequest("s2", PROMPT, seeded)])["s2"]
    assert again[-1].cached_tokens == 32
    assert tokens(again) == alone


def test_unseeded_engines_differ_unless_seeded_explicitly(tiny_qwen, make_engine):
    sampling = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    default = [tokens(run(make_engine(tiny_qwen, num_blocks=32), sampling)) for _ in range(2)]
    assert default[0] != default[1]
    fixed = [tokens(run(make_engine(tiny_qwen, num_blocks=32, seed=3), sampling))
             for _ in range(2)]
    assert fixed[0] == fixed[1]


def test_finish_reasons(tiny_qwen, make_engine):
    engine = make_engine(tiny_qwen, num_blocks=32, max_model_len=48)
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    chunks = run(engine, greedy)
    assert chunks[-1].finish_reason == "length" and len(tokens(chunks)) == 6
    # max_tokens that exactly fills the context (40 + 8 = max_model_len) ends with "length".
    limited = run(engine, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert limited[-1].finish_reason == "length" and len(tokens(limited)) == 8
    # A stop string completed by the max_tokens-th token is "stop", and is not returned.
    deltas = [c.text for c in chunks]  # no stop strings: each token's text as it completed
    last = max(i for i, d in enumerate(deltas) if d and d not in "".join(deltas[:i]))
    before = "".join(deltas[:last])
    chunks = run(engine, SamplingParams(temperature=0.0, max_tokens=last + 1, ignore_eos=True,
                                        stop=[deltas[last]]))
    assert chunks[-1].finish_reason == "stop" and len(tokens(chunks)) == last + 1
    assert "".join(c.text for c in chunks) == before
    chunks = run(engine, SamplingParams(temperature=0.0, max_tokens=last, ignore_eos=True,
                                        stop=[deltas[last]]))
    assert chunks[-1].finish_reason == "length"
    # A stop string inside the first min_tokens tokens is ignored.
    chunks = run(engine, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                                        stop=[deltas[0]], min_tokens=2))
    assert "".join(c.text for c in chunks) == "".join(deltas)
    assert chunks[-1].finish_reason == "length"
    # EOS is "stop"
    chunks = run(engine, SamplingParams(temperature=0.0, max_tokens=6, logit_bias={EOS: 100}))
    assert chunks[-1].finish_reason == "stop" and tokens(chunks) == [EOS]


def test_waiting_siblings_do_not_block_unrelated_requests(tiny_qwen, make_engine):
    engine = make_engine(tiny_qwen, num_blocks=32)
    # ignore_eos: a request that sampled EOS at its first token would leave the second step
    # (unseeded sampling draws from OS entropy: the test failed so, once in CI)
    engine.add_request(GenerationRequest("n", PROMPT, SamplingParams(n=3, max_tokens=2,
                                                                     ignore_eos=True)))
    engine.add_request(GenerationRequest("other", list(range(500, 520)),
                                         SamplingParams(max_tokens=2, ignore_eos=True)))
    engine.step()
    # The first choice and the unrelated request prefill together; the siblings wait one
    # step for the prompt's blocks, then join as cache hits.
    assert engine.counters.prefill_tokens == 40 + 20
    assert engine.counters.batch_sizes == {2: 1}
    engine.step()
    assert engine.counters.prefill_tokens == 40 + 20 + 2 * 8
    assert engine.counters.batch_sizes[4] == 1


@pytest.mark.parametrize(("skip", "text"), [(True, ""), (False, "<|im_start|>" * 3)])
def test_special_tokens_reach_the_text_only_when_not_skipped(tiny_qwen, make_engine, skip, text):
    engine = make_engine(tiny_qwen, num_blocks=32)
    special = engine.tokenizer.convert_tokens_to_ids("<|im_start|>")  # not a stop token
    chunks = run(engine, SamplingParams(temperature=0.0, max_tokens=3, allowed_token_ids=[special],
                                        skip_special_tokens=skip))
    assert tokens(chunks) == [special] * 3
    assert "".join(chunk.text for chunk in chunks) == text


def test_allowed_token_ids_restrict_greedy_and_sampled_output(tiny_qwen, make_engine):
    engine = make_engine(tiny_qwen, num_blocks=32)
    allowed = [321, 400, 777]
    greedy = tokens(run(engine, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                                               allowed_token_ids=allowed)))
    # Each token is transformers' argmax over the allowed ids given everything before it.
    rows = reference_logits(tiny_qwen, PROMPT + greedy)[len(PROMPT) - 1:-1, allowed]
    assert greedy == [allowed[i] for i in rows.argmax(dim=-1).tolist()]
    sampled = tokens(run(engine, SamplingParams(temperature=1.0, seed=7, max_tokens=24,
                                                ignore_eos=True, allowed_token_ids=allowed)))
    assert set(sampled) <= set(allowed) and len(set(sampled)) > 1
    plain = tokens(run(engine, SamplingParams(temperature=1.0, seed=7, max_tokens=24,
                                              ignore_eos=True)))
    assert not set(plain) <= set(allowed)  # unrestricted, it leaves the set


@pytest.mark.parametrize(("field", "value", "param", "message"), [
    ("allowed_token_ids", [], "allowed_token_ids", "must not be empty"),
    ("allowed_token_ids", [5, 1000], "allowed_token_ids", "outside the vocabulary"),
    ("bad_words_token_ids", [[5], []], "bad_words", "empty word"),
    ("bad_words_token_ids", [[5, 1000]], "bad_words", "outside the vocabulary")])
def test_token_bans_are_checked(tiny_qwen, make_engine, field, value, param, message):
    from contract.request import InvalidRequestError
    engine = make_engine(tiny_qwen, num_blocks=8)
    with pytest.raises(InvalidRequestError, match=message) as info:
        engine.add_request(GenerationRequest("r", PROMPT, SamplingParams(**{field: value})))
    assert info.value.param == param


def test_bad_words_ban_a_sequences_last_token_after_the_rest(tiny_qwen, make_engine):
    engine = make_engine(tiny_qwen, num_blocks=32)
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    plain = tokens(run(engine, greedy))
    first, second = plain[0], plain[1]
    banned_once = tokens(run(engine, replace(greedy, bad_words_token_ids=[[first]])))
    assert banned_once[0] != first and first not in banned_once
    # A two-token word bans its second token only right after its first: the output keeps
    # the first token, then parts from the plain run where the second would come.
    pair = tokens(run(engine, replace(greedy, bad_words_token_ids=[[first, second]])))
    assert pair[0] == first and pair[1] != second
    # A word whose first token never came out changes nothing.
    absent = tokens(run(engine, replace(greedy, bad_words_token_ids=[[999, first]])))
    assert absent == plain


def test_bans_give_way_rather_than_leave_the_allowed_set(tiny_qwen, make_engine):
    """Only EOS allowed, and min_tokens masking it: the output stays EOS, never token 0 (the
    argmax of a row of -inf), as a fresh user's break test found."""
    engine = make_engine(tiny_qwen, num_blocks=32)
    out = tokens(run(engine, SamplingParams(temperature=0.0, max_tokens=6, min_tokens=3,
                                            allowed_token_ids=[EOS])))
    assert out == [EOS] * 4  # EOS ends it only once min_tokens are out
    banned = tokens(run(engine, SamplingParams(temperature=1.0, seed=2, max_tokens=3,
                                               ignore_eos=True, allowed_token_ids=[400],
                                               bad_words_token_ids=[[400]])))
    assert banned == [400] * 3
