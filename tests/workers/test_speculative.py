"""Speculative decoding in the engine: the cases of ``shared/cases/speculative.md`` (S1-S4,
S6-S9; S5 is the draft model's) on the tiny random Qwen2 in fp32, S1 also on SmolLM2.

Drafts come from test proposers whose acceptance we control: an oracle that knows the plain
greedy continuation and proposes it, with chosen positions corrupted.
"""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare
from test_engine_equality import tiny_prompts

from contract.identity import block_digest
from contract.request import GenerationRequest, SamplingParams
from workers.sampler import SamplingRow, filtered_probs
from workers.speculative.config import SpeculativeConfig
from workers.speculative.ngram import NgramProposer
from workers.speculative.proposer import ProposalRequest
from workers.speculative.verify import verify_drafts

K = 4


class OracleProposer:
    """Proposes each request's true greedy continuation (from ``references``, keyed by prompt),
    with the draft at positions ``wrong`` (0-based, per call) replaced by a wrong token."""

    name = "oracle"

    def __init__(self, references: dict[tuple[int, ...], list[int]], wrong=(),
                 num_tokens: int | None = None):
        self.references = references
        self.wrong = set(wrong)
        self.num_tokens = num_tokens
        self.calls: list[list[int]] = []

    def propose(self, requests: list[ProposalRequest]) -> list[list[int]]:
        out = []
        for req in requests:
            prompt = tuple(req.token_ids[:req.num_prompt_tokens])
            truth = self.references[prompt][len(req.token_ids) - req.num_prompt_tokens:]
            draft = list(truth[:self.num_tokens or req.k])
            for i in self.wrong:
                if i < len(draft):
                    draft[i] = (draft[i] + 1) % 1000
            out.append(draft)
        self.calls.append([len(d) for d in out])
        return out

    def finish(self, request_ids: list[str]) -> None:
        pass


def spec_config(k: int = K, adaptive: bool = False) -> SpeculativeConfig:
    return SpeculativeConfig(method="ngram", num_speculative_tokens=k, adaptive=adaptive)


def run(engine, prompts, **sampling) -> list[list[int]]:
    requests = [GenerationRequest(f"r{i}", list(p), SamplingParams(**sampling))
                for i, p in enumerate(prompts)]
    chunks = engine.generate(requests)
    return [[t for c in chunks[r.request_id] for t in c.token_ids] for r in requests]


def last_chunks(engine, prompts, **sampling):
    requests = [GenerationRequest(f"r{i}", list(p), SamplingParams(**sampling))
                for i, p in enumerate(prompts)]
    chunks = engine.generate(requests)
    return [chunks[r.request_id] for r in requests]


@pytest.fixture(scope="module")
def plain(tiny_qwen, make_engine):
    """Plain greedy continuations (no speculation) of the tiny prompts, 24 tokens each."""
    prompts = tiny_prompts()[:4]
    outputs = run(make_engine(tiny_qwen), prompts, temperature=0.0, max_tokens=24,
                  ignore_eos=True)
    return prompts, {tuple(p): o for p, o in zip(prompts, outputs, strict=True)}


@pytest.mark.parametrize("wrong", [(), (1,), (0, 2), (3,)])
def test_greedy_ids_equal_whatever_is_rejected(tiny_qwen, make_engine, plain, wrong):
    prompts, references = plain
    proposer = OracleProposer(references, wrong)
    engine = make_engine(tiny_qwen, speculative=spec_config(), proposer=proposer)
    outputs = run(engine, prompts, temperature=0.0, max_tokens=24, ignore_eos=True)
    assert outputs == [references[tuple(p)] for p in prompts]
    spec = engine.counters.spec
    first_wrong = min(wrong, default=K)
    assert spec.verification_steps > 0
    # every verification accepts exactly the drafts before the first corrupted one
    assert spec.accepted_by_position[:first_wrong] == spec.proposed_by_position[:first_wrong]
    assert sum(spec.accepted_by_position[first_wrong:]) == 0
    assert max(engine.counters.batch_sizes) == len(prompts)  # verified batched
    engine.pool.check_invariants()
    assert engine.pool.num_in_use == 0


def test_s1_repeated_word_ngram_equals_plain(smollm, make_engine):
    tokens = smollm.tokenizer.encode("hello " * 48, add_special_tokens=False)
    expected = run(make_engine(smollm), [tokens], temperature=0.0, max_tokens=32)
    engine = make_engine(smollm, speculative=spec_config(), proposer=NgramProposer(1, 4))
    assert run(engine, [tokens], temperature=0.0, max_tokens=32) == expected
    assert engine.counters.spec.accepted_tokens > 0


def test_s2_eos_inside_accepted_block(tiny_qwen, make_engine, plain):
    prompts, references = plain
    prompt = prompts[0]
    stop = references[tuple(prompt)][2]
    expected = run(make_engine(tiny_qwen), [prompt], temperature=0.0, max_tokens=24,
                   stop_token_ids=[stop])
    assert expected == [references[tuple(prompt)][:3]]
    engine = make_engine(tiny_qwen, speculative=spec_config(8), proposer=OracleProposer(
        references))
    (chunks,) = last_chunks(engine, [prompt], temperature=0.0, max_tokens=24,
                            stop_token_ids=[stop])
    assert [t for c in chunks for t in c.token_ids] == expected[0]
    assert chunks[-1].finish_reason == "stop"
    assert chunks[-1].completion_tokens == 3
    assert engine.pool.num_in_use == 0


def test_s3_stop_beats_the_length_cap(tiny_qwen, make_engine, plain):
    prompts, references = plain
    prompt = prompts[1]
    truth = references[tuple(prompt)]
    engine = make_engine(tiny_qwen, speculative=spec_config(6), proposer=OracleProposer(
        {tuple(prompt): truth}))
    # prefill samples t1; one verification then accepts [t2, STOP, t4, t5, t6] + bonus
    (chunks,) = last_chunks(engine, [prompt], temperature=0.0, max_tokens=5,
                            stop_token_ids=[truth[2]])
    assert [t for c in chunks for t in c.token_ids] == truth[:3]
    assert chunks[-1].finish_reason == "stop"
    assert chunks[-1].completion_tokens == 3


def test_s6_acceptance_counters_count_committed_tokens(tiny_qwen, make_engine, plain):
    prompts, references = plain
    prompt = prompts[2]
    truth = references[tuple(prompt)]
    stop = truth[3]  # the 3rd draft of the first verification (t1 comes from the prefill)
    engine = make_engine(tiny_qwen, speculative=spec_config(5), proposer=OracleProposer(
        {tuple(prompt): truth}, num_tokens=5))
    (chunks,) = last_chunks(engine, [prompt], temperature=0.0, max_tokens=20,
                            stop_token_ids=[stop])
    assert [t for c in chunks for t in c.token_ids] == truth[:4]
    spec = chunks[-1].spec
    assert (spec.proposed_tokens, spec.accepted_tokens, spec.verification_steps) == (5, 3, 1)
    assert spec.acceptance_rate == pytest.approx(3 / 5)
    assert spec.mean_accepted_length == 3
    assert spec.accepted_by_position == [1, 1, 1, 0, 0]


def test_s7_exact_token_budget(tiny_qwen, make_engine, plain):
    prompts, references = plain
    engine = make_engine(tiny_qwen, speculative=spec_config(4), proposer=OracleProposer(
        references))
    outputs = last_chunks(engine, prompts, temperature=0.0, max_tokens=7, ignore_eos=True)
    for prompt, chunks in zip(prompts, outputs, strict=True):
        tokens = [t for c in chunks for t in c.token_ids]
        assert tokens == references[tuple(prompt)][:7]
        assert chunks[-1].completion_tokens == 7
        assert chunks[-1].finish_reason == "length"
        # drafts are capped by what max_tokens leaves: nothing proposed is past the cap
        assert chunks[-1].spec.rejected_tokens == 0


def test_s4_seeds_reproduce_and_match_plain_sampling(tiny_qwen, make_engine, plain):
    prompts, _ = plain
    sampling = {"temperature": 1.0, "max_tokens": 24, "ignore_eos": True}

    def seeded(seed, oracle=None, batch_prompts=prompts[:1]):
        config = spec_config() if oracle else SpeculativeConfig()
        engine = make_engine(tiny_qwen, speculative=config, proposer=oracle, seed=7)
        requests = [GenerationRequest("seeded", list(prompts[0]),
                                      SamplingParams(seed=seed, **sampling))]
        requests += [GenerationRequest(f"u{i}", list(p), SamplingParams(**sampling))
                     for i, p in enumerate(batch_prompts[1:])]
        chunks = engine.generate(requests)
        return [t for c in chunks["seeded"] for t in c.token_ids], engine

    plain_solo, _ = seeded(42)
    # drafts that know the sampled text, with every third draft wrong
    oracle = OracleProposer({tuple(p): plain_solo for p in prompts}, wrong=(2,))
    solo, engine = seeded(42, oracle)
    spec = engine.counters.spec
    assert 0 < spec.accepted_tokens < spec.proposed_tokens
    # each position consumes its draw only when reached: speculation does not change the text
    assert solo == plain_solo
    assert seeded(42, oracle)[0] == solo
    assert seeded(43, oracle)[0] != solo
    assert seeded(42, oracle, batch_prompts=prompts)[0] == solo


def test_s8_verification_is_lossless():
    """Fixed target logits (V = 8, temperature 0.5, top-k 3) and a one-hot draft: the first
    committed token's histogram over 6,000 verifications matches the target's p."""
    logits = torch.tensor([[1.0, 0.2, 0.9, -1.0, 0.5, 0.0, 0.4, -0.3]] * 2)
    params = SamplingParams(temperature=0.5, top_k=3)
    p = filtered_probs(logits[:1].clone(), [params])[0]
    draws = 6_000
    for draft in (0, 4, 3):  # the likeliest, a kept one, one top-k filters out
        counts = torch.zeros(8)
        generator = torch.Generator().manual_seed(draft)
        for _ in range(draws):
            row = SamplingRow(params, [5], 1, frozenset(), generator)
            counts[verify_drafts(logits, [draft], row, generator)[0].token_id] += 1
        support = p > 0
        assert counts[~support].sum() == 0
        result = chisquare(counts[support].numpy(), (p[support] * draws).numpy())
        assert result.pvalue > 1e-3, (draft, counts, p)
        assert torch.allclose(counts / draws, p, atol=0.02)  # 3 sigma at p = 0.5


def test_s9_rejected_state_is_gone(tiny_qwen, make_engine, plain):
    prompts, references = plain
    block = 4
    prompt = prompts[0][:7]
    (truth,) = run(make_engine(tiny_qwen, block_size=block), [prompt], temperature=0.0,
                   max_tokens=12, ignore_eos=True)
    # 8 drafts, the last 7 wrong: positions 8..15 span blocks 2 and 3
    proposer = OracleProposer({tuple(prompt): truth}, wrong=range(1, 8), num_tokens=8)
    engine = make_engine(tiny_qwen, block_size=block, speculative=spec_config(8),
                         proposer=proposer)
    engine.add_request(GenerationRequest("a", list(prompt), SamplingParams(
        temperature=0.0, max_tokens=12, ignore_eos=True)))
    engine.step()  # prefill: commits t1 at position 7
    engine.drain_events()
    engine.step()  # verifies [t1 | d0 ok, d1..d7 wrong]: commits d0 and the corrected token
    seq = engine.sequence("a")
    assert seq.token_ids == list(prompt) + truth[:3]
    assert seq.num_computed_tokens == 9  # prompt, t1, d0; the corrected token is pending
    assert len(seq.block_table) == 3  # the block of positions 12..15 went back to the pool
    assert engine.pool.num_in_use == 3
    stored = [d for e in engine.drain_events() if e.kind == "stored" for d in e.digests]
    root = seq.root_digest
    first = block_digest(root, seq.token_ids[0:4])
    second = block_digest(first, seq.token_ids[4:8])
    assert stored == [second]  # only the block whose tokens are all verified
    engine.abort("a")
    # a request sharing the committed prefix hits exactly the verified blocks
    later = list(prompt) + truth[:3] + [5, 6, 7]
    chunks = engine.generate([GenerationRequest("b", later, SamplingParams(
        temperature=0.0, max_tokens=1))])
    assert chunks["b"][-1].cached_tokens == 8
    engine.pool.check_invariants()


def test_a_draft_ends_at_its_first_id_outside_the_vocabulary(tiny_qwen, make_engine, plain):
    prompts, references = plain
    truth = references[tuple(prompts[0])]

    class Broken(OracleProposer):
        def propose(self, requests):  # the true next token, then an invalid id, then truth
            return [[truth[len(r.token_ids) - r.num_prompt_tokens], 10**6,
                     truth[len(r.token_ids) - r.num_prompt_tokens + 1]] for r in requests]

    engine = make_engine(tiny_qwen, speculative=spec_config(3), proposer=Broken({}))
    assert run(engine, [prompts[0]], temperature=0.0, max_tokens=6, ignore_eos=True) == [
        truth[:6]]
    spec = engine.counters.spec
    assert spec.proposed_by_position == [spec.verification_steps]  # only the valid prefix
    assert spec.accepted_tokens == spec.proposed_tokens > 0
