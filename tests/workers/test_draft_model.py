"""The ``model`` proposer: a tiny target drafted for by a cheaper tiny model (random weights,
the same vocabulary), in fp32. Case S5, greedy equality (S1), and the draft's rollback."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import greedy, output_ids
from test_engine_equality import tiny_prompts
from transformers import Qwen2Config, Qwen2ForCausalLM

from workers.config import EngineConfig
from workers.model_loader import LoadedModel, model_digest
from workers.speculative.config import SpeculativeConfig
from workers.speculative.draft_model import DraftModelProposer
from workers.speculative.proposer import ProposalRequest

SPEC = SpeculativeConfig(method="model", draft_model="tiny-draft", num_speculative_tokens=4,
                         adaptive=False)


def tiny_draft(tokenizer, vocab_size: int = 1000, seed: int = 5) -> LoadedModel:
    """A 1-layer random Qwen2: cheaper than the 2-layer target, same vocabulary."""
    config = Qwen2Config(vocab_size=vocab_size, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=512, initializer_range=0.2,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).eval()
    model.set_attn_implementation("sdpa")
    return LoadedModel(model, tokenizer, model_digest(model), "tiny-draft", Path("tiny-draft"))


def draft_config(num_blocks_bytes: int = 1 << 20) -> EngineConfig:
    return EngineConfig(dtype="float32", device="cpu", kv_cache_bytes=num_blocks_bytes)


def greedy_outputs(engine, prompts, max_tokens=20) -> list[list[int]]:
    """Each prompt's greedy output (past EOS), generated together as ``r0``, ``r1``, ..."""
    requests = [greedy(f"r{i}", list(p), max_tokens, ignore_eos=True)
                for i, p in enumerate(prompts)]
    chunks = engine.generate(requests)
    return [output_ids(chunks[r.request_id]) for r in requests]


def test_s5_vocabulary_mismatch_is_refused_naming_both(tiny_qwen, smollm_tokenizer):
    draft = tiny_draft(smollm_tokenizer, vocab_size=1024)
    with pytest.raises(ValueError, match=r"'tiny-draft'.*1024.*'tiny-qwen2'.*1000"):
        DraftModelProposer.for_target(draft, tiny_qwen, draft_config())


def test_s5_different_tokenizer_is_refused(tiny_qwen, smollm_tokenizer):
    class OtherTokenizer:
        def get_vocab(self):
            return {"a": 0}

    draft = tiny_draft(OtherTokenizer())
    with pytest.raises(ValueError, match="different tokenizers"):
        DraftModelProposer.for_target(draft, tiny_qwen, draft_config())


@pytest.mark.parametrize("draft_is_target", [False, True])
def test_greedy_ids_equal_with_a_draft_model(tiny_qwen, smollm_tokenizer, make_engine,
                                             draft_is_target):
    prompts = tiny_prompts()[:3] + [[17]]  # S1: a one-token prompt too
    expected = greedy_outputs(make_engine(tiny_qwen), prompts)
    draft = tiny_qwen if draft_is_target else tiny_draft(smollm_tokenizer)
    proposer = DraftModelProposer.for_target(draft, tiny_qwen, draft_config())
    engine = make_engine(tiny_qwen, speculative=SPEC, proposer=proposer)
    assert greedy_outputs(engine, prompts) == expected
    spec = engine.counters.spec
    assert spec.verification_steps > 0
    if draft_is_target:  # draft = target: every draft is accepted (S7's setting)
        assert spec.accepted_tokens == spec.proposed_tokens > 0
    else:
        assert spec.accepted_tokens < spec.proposed_tokens
    draft_engine = proposer.engine
    assert draft_engine.pool.num_in_use == 0  # every draft request ended with its call
    draft_engine.pool.check_invariants()


def test_draft_rolls_back_to_the_committed_prefix(tiny_qwen, smollm_tokenizer):
    """After the target rejects its drafts, the draft's next call reuses exactly the committed
    prefix's blocks and drafts what a fresh draft engine drafts for the committed tokens."""
    draft = tiny_draft(smollm_tokenizer)
    proposer = DraftModelProposer.for_target(draft, tiny_qwen, draft_config())
    committed = tiny_prompts()[4][:40]
    (first,) = proposer.propose([ProposalRequest("a", committed, len(committed), 8)])
    assert len(first) == 8
    hits_before = proposer.engine.scheduler.counters.prefix_hit_tokens
    rejected = (first[0] + 1) % 1000  # the target committed another token at position 40
    after = committed + [rejected]
    (second,) = proposer.propose([ProposalRequest("a", after, len(committed), 4)])
    # positions 0..31 (two full blocks) are reused; block 2 (32..47) held drafts and is not
    assert proposer.engine.scheduler.counters.prefix_hit_tokens - hits_before == 32
    fresh = DraftModelProposer.for_target(draft, tiny_qwen, draft_config())
    assert second == fresh.propose([ProposalRequest("a", after, len(committed), 4)])[0]
    proposer.engine.pool.check_invariants()
    assert proposer.engine.pool.num_in_use == 0
