"""Compact model implementations the engine runs instead of transformers' modules.

The step's structure is ours (one flat batch of rows, fused projections, paged attention), and
so are two small kernels that round where transformers' ops round: RoPE (bit-identical) and
RMSNorm (its variance summed in another order). The weights, activations and RoPE tables stay
transformers' own objects. Architectures without an entry here run through transformers'
modules with the paged attention plugged in (``workers.model_runner``).
"""

from __future__ import annotations

from transformers import PreTrainedModel

from workers.models.llama import LlamaStyleDecoder

COMPACT_MODEL_TYPES = {"llama", "mistral", "qwen2", "qwen3"}
"""``config.model_type`` values served by :class:`LlamaStyleDecoder`."""


def compact_model_for(model: PreTrainedModel) -> LlamaStyleDecoder | None:
    """The compact implementation of ``model``, sharing its weights, or None when its
    architecture has none."""
    if model.config.model_type not in COMPACT_MODEL_TYPES:
        return None
    return LlamaStyleDecoder(model)
