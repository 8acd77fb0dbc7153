"""Refuse, at load, models whose forward pass needs something the engine would silently drop.

The engine runs a model's projections and MLPs as the model defines them, but replaces its
attention (``workers.attention``: plain causal softmax attention over the paged cache,
which ignores every extra keyword a transformers attention module passes: ``sliding_window``,
``softcap``, ``s_aux``, ...) and feeds one flat ``[1, T]`` batch of all scheduled sequences.
Anything that changes attention, or that depends on the batch's shape, would be dropped without
an error and give wrong tokens. This module lists those features in a config, naming each with
the config key that turned it on, and refuses the model if there are any.

Two layers of defence:
  * an allow-list of model families (``SUPPORTED_MODEL_TYPES``), each compared token for token
    with transformers in ``tests/workers/test_architectures.py``; an unknown family may need
    anything (multi-latent attention, state-space layers, multimodal positions), so it is
    refused rather than guessed at;
  * feature checks, which also apply inside allowed families (a Mistral config with a binding
    sliding window, a Phi-3 with LongRoPE past its original context, ...) and name the feature
    for any family.

A feature only counts when it would bind at the context we serve (``max_model_len``): a
sliding window no shorter than the longest sequence is plain causal attention.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from transformers import PretrainedConfig

# Families verified token for token against transformers (tests/workers/test_architectures.py).
SUPPORTED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "phi3"})

# RoPE types whose inverse frequencies are computed once from the config (transformers
# ``modeling_rope_utils``: their ``_compute_*_parameters`` ignore ``seq_len``), so a token's
# rotation depends only on its position.
STATIC_ROPE_TYPES = frozenset({"default", "linear", "yarn", "llama3", "proportional"})

# Layer kinds our attention computes exactly; "sliding_attention" only while the window does
# not bind (checked separately).
ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})

# Families whose attention adds learned per-head sink logits to the softmax (passed to the
# attention function as ``s_aux``), which the config does not announce.
SINK_MODEL_TYPES = frozenset({"gpt_oss"})

# Families that always add ALiBi biases to attention scores, without a config flag.
ALIBI_MODEL_TYPES = frozenset({"bloom"})


class UnsupportedModelError(ValueError):
    """The model needs features the engine does not implement; ``features`` lists each with
    the config key that enables it."""

    def __init__(self, model_type: str, features: list[str]):
        self.features = features
        listing = "; ".join(features)
        super().__init__(
            f"model type {model_type!r} cannot be served exactly: it needs {listing}. Serving "
            "it would silently drop these and produce wrong tokens.")


def check_supported(config: PretrainedConfig, max_model_len: int,
                    model: torch.nn.Module | None = None) -> None:
    """Refuse a model whose forward pass the engine would not reproduce exactly.

    Args:
        config: the model's transformers config.
        max_model_len: the longest sequence (prompt + output, tokens) the engine will serve.
        model: the loaded model, when available: its modules are inspected too (attention
            sinks live in parameters, not in the config).

    Raises:
        UnsupportedModelError: naming every unsupported feature and its config key.
    """
    features = find_unsupported_features(config, max_model_len, model)
    if features:
        raise UnsupportedModelError(getattr(config, "model_type", "?"), features)


def find_unsupported_features(config: PretrainedConfig, max_model_len: int,
                              model: torch.nn.Module | None = None) -> list[str]:
    """Every reason :func:`check_supported` would refuse, one description each (empty if none).
    """
    features = [*_family(config), *_attention_structure(config), *_sliding_window(config,
                max_model_len), *_soft_capping(config), *_sinks(config, model), *_alibi(config)]
    for where, params in _rope_parameter_sets(config):
        features.extend(_rope(config, where, params, max_model_len))
    return features


def _family(config: PretrainedConfig) -> Iterator[str]:
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        yield (f"an unverified architecture (`model_type` = {model_type!r}; verified: "
               f"{', '.join(sorted(SUPPORTED_MODEL_TYPES))})")


def _attention_structure(config: PretrainedConfig) -> Iterator[str]:
    if getattr(config, "is_encoder_decoder", False):
        yield "an encoder-decoder structure (`is_encoder_decoder`)"
    if getattr(config, "add_cross_attention", False):
        yield "cross-attention (`add_cross_attention`)"
    if getattr(config, "cross_attention_layers", None):
        yield "cross-attention layers (`cross_attention_layers`)"
    if getattr(config, "use_bidirectional_attention", False):
        yield "non-causal attention (`use_bidirectional_attention`)"
    if getattr(config, "is_causal", True) is False or getattr(config, "causal", True) is False:
        yield "non-causal attention (`is_causal`/`causal` = False)"
    for kind in sorted(set(getattr(config, "layer_types", None) or ()) - ATTENTION_LAYER_TYPES):
        yield f"layers of type {kind!r} (`layer_types`)"
    chunk = getattr(config, "attention_chunk_size", None)
    if chunk:
        yield f"chunked local attention (`attention_chunk_size` = {chunk})"


def _sliding_window(config: PretrainedConfig, max_model_len: int) -> Iterator[str]:
    """transformers' causal sliding mask lets a query at position q see keys q - W + 1 .. q
    (``masking_utils.sliding_window_overlay``): the window binds once a sequence is longer
    than W tokens."""
    window = getattr(config, "sliding_window", None)
    if not window or window >= max_model_len:
        return
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        # Qwen2/Qwen3/Gemma: only the layers typed "sliding_attention" use the window
        sliding = sum(kind == "sliding_attention" for kind in layer_types)
        if sliding:
            yield (f"sliding-window attention on {sliding} of {len(layer_types)} layers "
                   f"(`sliding_window` = {window} < max_model_len {max_model_len}, `layer_types`)")
    elif getattr(config, "use_sliding_window", True):
        # Mistral/Phi-3 pass config.sliding_window to every layer's attention
        yield (f"sliding-window attention (`sliding_window` = {window} < max_model_len "
               f"{max_model_len}; serve with max_model_len <= {window} or a config without it)")


def _soft_capping(config: PretrainedConfig) -> Iterator[str]:
    # Attention soft-capping is an argument our attention ignores. Final soft-capping is
    # applied in transformers' LM-head forward but not by the engine's compact model
    # implementations, and it changes sampled (not greedy) distributions: refused for both.
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        value = getattr(config, key, None)
        if value:
            yield f"logit soft-capping (`{key}` = {value})"


def _sinks(config: PretrainedConfig, model: torch.nn.Module | None) -> Iterator[str]:
    model_type = getattr(config, "model_type", None)
    has_sink_parameters = model is not None and any(
        name.rsplit(".", 1)[-1] == "sinks" for name, _ in model.named_parameters())
    if model_type in SINK_MODEL_TYPES or has_sink_parameters:
        yield "attention sinks (`sinks` parameters, passed to attention as `s_aux`)"


def _alibi(config: PretrainedConfig) -> Iterator[str]:
    attn_config = getattr(config, "attn_config", None)  # MPT: an object (or a dict)
    if isinstance(attn_config, dict):
        mpt_alibi = attn_config.get("alibi", False)
    else:
        mpt_alibi = getattr(attn_config, "alibi", False)
    if getattr(config, "alibi", False):
        yield "ALiBi position biases (`alibi`)"
    elif mpt_alibi:
        yield "ALiBi position biases (`attn_config.alibi`)"
    elif getattr(config, "position_embedding_type", None) == "alibi":
        yield "ALiBi position biases (`position_embedding_type` = 'alibi')"
    elif getattr(config, "model_type", None) in ALIBI_MODEL_TYPES:
        yield f"ALiBi position biases (always on for `model_type` = {config.model_type!r})"


def _rope_parameter_sets(config: PretrainedConfig) -> Iterator[tuple[str, dict]]:
    """(config key, RoPE parameters) for the model and, where RoPE is set per layer type
    (Gemma 3 style ``{"full_attention": {...}, "sliding_attention": {...}}``), for each type."""
    seen = []
    for key in ("rope_parameters", "rope_scaling"):
        params = getattr(config, key, None)
        if not isinstance(params, dict) or params in seen:
            continue
        seen.append(params)
        nested = {k: v for k, v in params.items() if isinstance(v, dict)}
        if nested and "rope_type" not in params and "type" not in params:
            yield from ((f"{key}[{k!r}]", v) for k, v in nested.items())
        else:
            yield key, params


def _rope(config: PretrainedConfig, where: str, params: dict,
          max_model_len: int) -> Iterator[str]:
    """transformers recomputes two RoPE types inside forward from ``max(position_ids) + 1``,
    which in our flat batch is the longest sequence in the step, not the token's own
    (``modeling_rope_utils.dynamic_rope_update``): ``dynamic`` grows its base past
    ``max_position_embeddings``; ``longrope`` switches to its long factors past
    ``original_max_position_embeddings``. Below those lengths both stay static."""
    rope_type = params.get("rope_type", params.get("type", "default"))
    if params.get("mrope_section"):
        yield f"multimodal RoPE (`{where}.mrope_section`)"
    if "dynamic" in rope_type:
        limit = getattr(config, "max_position_embeddings", None)
        if limit is None or max_model_len > limit:
            yield (f"dynamic NTK RoPE scaling (`{where}.rope_type` = {rope_type!r}): its "
                   f"rotation changes with the batch's longest sequence past "
                   f"max_position_embeddings {limit}")
    elif rope_type == "longrope":
        limit = params.get("original_max_position_embeddings") or getattr(
            config, "original_max_position_embeddings", None)
        if limit is None or max_model_len > limit:
            yield (f"LongRoPE scaling (`{where}.rope_type` = 'longrope'): it switches to its "
                   f"long factors once the batch's longest sequence passes "
                   f"original_max_position_embeddings {limit}; serve with max_model_len <= "
                   f"{limit}")
    elif rope_type not in STATIC_ROPE_TYPES:
        yield f"an unverified RoPE type (`{where}.rope_type` = {rope_type!r})"
