"""Greedy engine output equals transformers token for token (fp32) for every supported family.

Each family is a tiny random model (2 layers, vocabulary 1000, seeded) that exercises what sets
the family apart: Llama (tied embeddings; and a variant with every bias on), Mistral
(sliding_window=None), Qwen2 (q/k/v bias), Qwen3 (q_norm/k_norm, head_dim != hidden/heads),
Phi-3 (fused qkv_proj and gate_up_proj, partial rotary). For each: cold single requests, four
batched (proved by the sequences-per-step histogram), a warm prefix hit (proved by the
prefilled-token counter), and chunked prefill. The engine may run the transformers module or a
compact implementation of the family: the tests go through ``LLMEngine`` and cover whichever it
picks, and name it in failure messages.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from helpers import greedy, output_ids
from near_tie import GreedyTrace, greedy_trace
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from workers.engine import LLMEngine
from workers.model_loader import LoadedModel, model_digest
from workers.model_support import check_supported

SEED = 0
NEW_TOKENS = 12
BLOCK = 16
PROMPT_LENGTHS = (17, 24, 33, 41)
# fp32 reorderings (batched vs single, chunked vs whole) move logits by ~1e-5; a margin this
# large means any token difference is a real bug, not rounding.
MIN_REFERENCE_MARGIN = 1e-3

SHAPE = dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
             initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=2)


def build_llama() -> PreTrainedModel:
    """Llama with tied input/output embeddings (as SmolLM2 and Llama-3.2-1B ship)."""
    return _seeded(LlamaForCausalLM, LlamaConfig(**SHAPE, tie_word_embeddings=True))


def build_llama_with_biases() -> PreTrainedModel:
    """Llama with ``attention_bias`` and ``mlp_bias``: every projection, o_proj and the MLP's
    included, carries a bias, drawn (they are zero after init) so each one contributes."""
    model = _seeded(LlamaForCausalLM, LlamaConfig(**SHAPE, attention_bias=True, mlp_bias=True,
                                                  tie_word_embeddings=False))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(".bias"):
                parameter.normal_(0.0, 0.2)
    return model


def build_mistral() -> PreTrainedModel:
    """Mistral without a sliding window (Mistral-7B-v0.2 onwards)."""
    return _seeded(MistralForCausalLM, MistralConfig(**SHAPE, sliding_window=None,
                                                      tie_word_embeddings=False))


def build_qwen3() -> PreTrainedModel:
    """Qwen3: RMSNorm on each head's q and k, and head_dim 32 while hidden/heads is 16."""
    return _seeded(Qwen3ForCausalLM, Qwen3Config(**SHAPE, head_dim=32, tie_word_embeddings=False))


def build_phi3() -> PreTrainedModel:
    """Phi-3: fused qkv_proj and gate_up_proj; RoPE on half of each head (as Phi-4-mini)."""
    config = Phi3Config(**SHAPE, tie_word_embeddings=False, original_max_position_embeddings=512,
                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                         "partial_rotary_factor": 0.5})
    return _seeded(Phi3ForCausalLM, config)


def _seeded(model_class: type[PreTrainedModel], config: PretrainedConfig) -> PreTrainedModel:
    torch.manual_seed(SEED)
    model = model_class(config)
    model.set_attn_implementation("sdpa")
    return model.float().eval()


# qwen2 is conftest's session-wide tiny Qwen2 (GQA, drawn q/k/v biases)
BUILDERS = {
    "llama": build_llama,
    "llama-bias": build_llama_with_biases,
    "mistral": build_mistral,
    "qwen3": build_qwen3,
    "phi3": build_phi3,
}
FAMILIES = sorted([*BUILDERS, "qwen2"])


@dataclass
class Family:
    name: str
    loaded: LoadedModel
    prompts: list[list[int]]
    references: list[GreedyTrace]
    eos_token_ids: set[int]

    def expected(self, i: int) -> list[int]:
        return self.references[i].tokens


def load_family(name: str, request, tokenizer) -> LoadedModel:
    if name == "qwen2":
        return request.getfixturevalue("tiny_qwen")
    model = BUILDERS[name]()
    return LoadedModel(model, tokenizer, model_digest(model), f"tiny-{name}",
                       Path(f"tiny-{name}"))


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, smollm_tokenizer) -> Family:
    loaded = load_family(request.param, request, smollm_tokenizer)
    model = loaded.model
    generator = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 1000, (n,), generator=generator).tolist()
               for n in PROMPT_LENGTHS]
    eos = {smollm_tokenizer.eos_token_id, model.generation_config.eos_token_id}
    references = [greedy_trace(model, p, NEW_TOKENS, eos) for p in prompts]
    # no near-ties: a token difference below would be a bug, never fp32 rounding
    assert min(m for r in references for m in r.margins) > MIN_REFERENCE_MARGIN
    return Family(request.param, loaded, prompts, references, eos)


def assert_same_tokens(engine: LLMEngine, family: Family, got: list[int], i: int,
                       what: str) -> None:
    assert got == family.expected(i), (
        f"{family.name} via {engine.runner.implementation}: {what} prompt {i}: engine {got}, "
        f"transformers {family.expected(i)}")


def test_family_is_supported(family):
    check_supported(family.loaded.model.config, max_model_len=512)


def test_family_runs_its_path_and_the_path_is_in_the_cache_identity(family, make_engine):
    engine = make_engine(family.loaded, num_blocks=8)
    expected = "transformers" if family.name == "phi3" else "compact"
    assert engine.runner.implementation == expected
    assert f"|attn=nalar_paged/{expected}|" in engine.identity.numerics


def test_cold_single_then_warm_prefix_hit(family, make_engine):
    engine = make_engine(family.loaded, num_blocks=32, max_num_seqs=4)
    for i, prompt in enumerate(family.prompts):
        before = engine.counters.prefill_tokens
        request = greedy(f"cold-{i}", prompt, NEW_TOKENS, ignore_eos=False)
        chunks = engine.generate([request])[f"cold-{i}"]
        assert_same_tokens(engine, family, output_ids(chunks), i, "cold")
        assert chunks[-1].cached_tokens == 0
        assert engine.counters.prefill_tokens - before == len(prompt)

    for i, prompt in enumerate(family.prompts):
        cached = (len(prompt) - 1) // BLOCK * BLOCK
        before = engine.counters.prefill_tokens
        request = greedy(f"warm-{i}", prompt, NEW_TOKENS, ignore_eos=False)
        chunks = engine.generate([request])[f"warm-{i}"]
        assert_same_tokens(engine, family, output_ids(chunks), i, "warm")
        assert chunks[-1].cached_tokens == cached >= BLOCK
        # the hit is real: only the uncached tail was computed
        assert engine.counters.prefill_tokens - before == len(prompt) - cached
    assert set(engine.counters.batch_sizes) == {1}
    assert engine.pool.num_in_use == 0


def test_four_requests_batched(family, make_engine):
    engine = make_engine(family.loaded, num_blocks=32, max_num_seqs=4)
    requests = [greedy(f"b{i}", p, NEW_TOKENS, ignore_eos=False)
                for i, p in enumerate(family.prompts)]
    outputs = engine.generate(requests)
    for i, request in enumerate(requests):
        assert_same_tokens(engine, family, output_ids(outputs[request.request_id]), i, "batched")
    # really batched: every step that decoded all four ran them together
    shortest = min(len(r.tokens) for r in family.references)
    assert engine.counters.batch_sizes[4] >= shortest
    assert max(engine.counters.batch_sizes) == 4
    assert engine.pool.num_in_use == 0


def test_chunked_prefill(family, make_engine):
    """A step budget of 8 tokens splits every prompt into chunks that share steps with other
    sequences' chunks and decodes."""
    engine = make_engine(family.loaded, num_blocks=32, max_num_seqs=4, max_num_batched_tokens=8)
    requests = [greedy(f"c{i}", p, NEW_TOKENS, ignore_eos=False)
                for i, p in enumerate(family.prompts)]
    outputs = engine.generate(requests)
    for i, request in enumerate(requests):
        assert_same_tokens(engine, family, output_ids(outputs[request.request_id]), i, "chunked")
    total_prompt = sum(len(p) for p in family.prompts)
    assert engine.counters.prefill_tokens == total_prompt
    # at most 8 tokens a step: the prompts alone needed this many steps
    assert engine.counters.steps >= total_prompt // 8
    assert max(engine.counters.batch_sizes) >= 2
    assert engine.pool.num_in_use == 0


def test_engines_over_one_model_share_its_compact_decoder_until_a_weight_changes(
        fresh_tiny_qwen):
    """The fused and packed weights are built once per model, not once per engine; a
    parameter that becomes another tensor (a reload, another dtype) makes a new build, which
    computes with the new weight."""
    from workers.models import compact_model_for

    model = fresh_tiny_qwen()
    first = compact_model_for(model)
    assert first is not None and compact_model_for(model) is first
    down = model.model.layers[0].mlp.down_proj
    down.weight = torch.nn.Parameter(torch.zeros_like(down.weight), requires_grad=False)
    rebuilt = compact_model_for(model)
    assert rebuilt is not first and compact_model_for(model) is rebuilt
    assert rebuilt.layers[0].down_proj.weight is down.weight
    assert first.layers[0].down_proj.weight is not down.weight
