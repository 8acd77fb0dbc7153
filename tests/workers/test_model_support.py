"""``check_supported`` refuses every feature the engine would silently drop, naming it and its
config key, and lets the verified families through (configs only: nothing is instantiated,
except one tiny module carrying attention sinks)."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from transformers import (
    BloomConfig,
    FalconConfig,
    Gemma2Config,
    GptOssConfig,
    Llama4TextConfig,
    LlamaConfig,
    MistralConfig,
    MistralForCausalLM,
    MptConfig,
    Phi3Config,
    Qwen2Config,
    Qwen2VLTextConfig,
    Qwen3Config,
    T5Config,
)

from workers.model_loader import LoadedModel, model_digest
from workers.model_support import (
    UnsupportedModelError,
    check_supported,
    find_unsupported_features,
)

LONGROPE = {"rope_type": "longrope", "short_factor": [1.0] * 48, "long_factor": [4.0] * 48,
            "rope_theta": 10000.0}


def refusal(config, max_model_len: int, model=None) -> UnsupportedModelError:
    with pytest.raises(UnsupportedModelError) as caught:
        check_supported(config, max_model_len, model)
    assert isinstance(caught.value, ValueError)
    return caught.value


@pytest.mark.parametrize("config, max_model_len", [
    (LlamaConfig(), 2048),
    (MistralConfig(sliding_window=None), 32768),
    (Qwen2Config(), 32768),
    (Qwen3Config(), 32768),
    (Phi3Config(), 4096),
    # a window as long as the served context never binds
    (MistralConfig(sliding_window=4096), 4096),
    # Qwen2.5 configs carry a sliding_window but use_sliding_window=False: every layer is full
    (Qwen2Config(sliding_window=4096, use_sliding_window=False), 32768),
], ids=["llama", "mistral", "qwen2", "qwen3", "phi3", "mistral-window=context",
        "qwen2-window-unused"])
def test_verified_families_pass(config, max_model_len):
    check_supported(config, max_model_len)
    assert find_unsupported_features(config, max_model_len) == []


def test_binding_sliding_window_is_refused_with_its_key():
    error = refusal(MistralConfig(sliding_window=4096), 8192)
    assert error.features == [
        "sliding-window attention (`sliding_window` = 4096 < max_model_len 8192; serve with "
        "max_model_len <= 4096 or a config without it)"]
    assert "mistral" in str(error) and "sliding_window" in str(error)
    # Phi-3-mini-4k ships a 2047-token window
    assert "`sliding_window` = 2047" in str(refusal(Phi3Config(sliding_window=2047), 4096))


def test_sliding_window_on_some_layers_counts_those_layers():
    config = Qwen2Config(use_sliding_window=True, sliding_window=1024, max_window_layers=20,
                         num_hidden_layers=24)
    error = refusal(config, 2048)
    assert error.features == ["sliding-window attention on 4 of 24 layers (`sliding_window` = "
                              "1024 < max_model_len 2048, `layer_types`)"]
    check_supported(config, 1024)


def test_every_unsupported_feature_is_named_at_once():
    """Gemma 2: an unverified family with soft-capping of both kinds and sliding layers."""
    error = refusal(Gemma2Config(), 8192)
    message = str(error)
    for key in ("`model_type` = 'gemma2'", "`attn_logit_softcapping` = 50.0",
                "`final_logit_softcapping` = 30.0", "`sliding_window` = 4096", "`layer_types`"):
        assert key in message, key
    assert len(error.features) == 4


def test_soft_capping_is_refused_in_a_verified_family():
    config = LlamaConfig(attn_logit_softcapping=50.0, final_logit_softcapping=30.0)
    assert refusal(config, 2048).features == [
        "logit soft-capping (`attn_logit_softcapping` = 50.0)",
        "logit soft-capping (`final_logit_softcapping` = 30.0)"]


def test_attention_sinks_are_refused_from_the_config_or_the_modules():
    assert "attention sinks (`sinks`" in str(refusal(GptOssConfig(), 4096))

    class AttentionWithSinks(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.sinks = torch.nn.Parameter(torch.zeros(4))

    model = torch.nn.ModuleDict({"self_attn": AttentionWithSinks()})
    error = refusal(LlamaConfig(), 2048, model)
    assert error.features == [
        "attention sinks (`sinks` parameters, passed to attention as `s_aux`)"]


@pytest.mark.parametrize("rope, max_position_embeddings, max_model_len", [
    ({"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}, 4096, 4096),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192,
      "rope_theta": 1e6}, 32768, 32768),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 8192, "rope_theta": 5e5}, 131072, 131072),
    # dynamic NTK recomputes only past max_position_embeddings
    ({"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}, 2048, 2048),
], ids=["linear", "yarn", "llama3", "dynamic-within-limit"])
def test_static_rope_scaling_passes(rope, max_position_embeddings, max_model_len):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = LlamaConfig(rope_parameters=rope, max_position_embeddings=max_position_embeddings)
    check_supported(config, max_model_len)


def test_dynamic_rope_past_its_limit_is_refused():
    config = LlamaConfig(rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                          "rope_theta": 1e4}, max_position_embeddings=2048)
    error = refusal(config, 4096)
    assert error.features == [
        "dynamic NTK RoPE scaling (`rope_parameters.rope_type` = 'dynamic'): its rotation "
        "changes with the batch's longest sequence past max_position_embeddings 2048"]


def test_longrope_binds_past_its_original_context():
    """Phi-3-128k: short factors up to 4096 tokens, long ones beyond, chosen per batch."""
    config = Phi3Config(max_position_embeddings=131072, original_max_position_embeddings=4096,
                        rope_parameters=dict(LONGROPE))
    check_supported(config, 4096)
    error = refusal(config, 8192)
    assert len(error.features) == 1
    assert "LongRoPE scaling (`rope_parameters.rope_type` = 'longrope')" in error.features[0]
    assert "max_model_len <= 4096" in error.features[0]


def test_unknown_rope_type_is_refused():
    config = LlamaConfig()
    config.rope_parameters = {"rope_type": "made_up", "rope_theta": 1e4}
    assert refusal(config, 2048).features == [
        "an unverified RoPE type (`rope_parameters.rope_type` = 'made_up')"]


def test_multimodal_rope_is_refused():
    config = Qwen2VLTextConfig(rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                                "mrope_section": [16, 24, 24]})
    assert "multimodal RoPE (`rope_parameters.mrope_section`)" in refusal(config, 4096).features


@pytest.mark.parametrize("config, feature", [
    (FalconConfig(alibi=True), "ALiBi position biases (`alibi`)"),
    (MptConfig(), "ALiBi position biases (`attn_config.alibi`)"),
    (BloomConfig(), "ALiBi position biases (always on for `model_type` = 'bloom')"),
], ids=["falcon", "mpt", "bloom"])
def test_alibi_is_refused(config, feature):
    assert feature in refusal(config, 2048).features


@pytest.mark.parametrize("config, feature", [
    (T5Config(), "an encoder-decoder structure (`is_encoder_decoder`)"),
    (LlamaConfig(add_cross_attention=True), "cross-attention (`add_cross_attention`)"),
    (LlamaConfig(use_bidirectional_attention=True),
     "non-causal attention (`use_bidirectional_attention`)"),
    (Llama4TextConfig(), "chunked local attention (`attention_chunk_size` = 8192)"),
    (Llama4TextConfig(), "layers of type 'chunked_attention' (`layer_types`)"),
], ids=["encoder-decoder", "cross-attention", "bidirectional", "chunked", "chunked-layers"])
def test_structures_other_than_causal_self_attention_are_refused(config, feature):
    assert feature in refusal(config, 4096).features


def test_the_engine_refuses_at_load(make_engine, smollm_tokenizer):
    """A tiny Mistral whose 16-token window binds at the engine's context: no engine is built."""
    config = MistralConfig(vocab_size=1000, hidden_size=64, intermediate_size=128,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           max_position_embeddings=512, sliding_window=16)
    torch.manual_seed(0)
    model = MistralForCausalLM(config).eval()
    loaded = LoadedModel(model, smollm_tokenizer, model_digest(model), "tiny-mistral-window",
                         Path("tiny-mistral-window"))
    with pytest.raises(UnsupportedModelError, match=r"`sliding_window` = 16 < max_model_len 512"):
        make_engine(loaded, num_blocks=32)
