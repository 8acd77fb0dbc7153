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
    architecture has none.

    Built once per model and kept on it while its parameters stay the same tensors: the
    build fuses projections and packs the weights for the matmul kernels (two more copies of
    them), which every engine over the model can share, since the decoder holds no state of
    its own between calls. A test process building engine after engine over one model held
    each engine's copies until the collector ran (16 GB for the worker tests in fp32)."""
    if model.config.model_type not in COMPACT_MODEL_TYPES:
        return None
    cached = getattr(model, _CACHE_ATTRIBUTE, None)
    if cached is not None and cached[0] == _parameters_fingerprint(model):
        return cached[1]
    decoder = LlamaStyleDecoder(model)
    setattr(model, _CACHE_ATTRIBUTE, (_parameters_fingerprint(model), decoder))
    return decoder


_CACHE_ATTRIBUTE = "_nalar_compact_decoder"


def _parameters_fingerprint(model: PreTrainedModel) -> tuple:
    """Which tensors ``model``'s parameters are: another dtype, device or a reloaded weight
    (a new tensor) means the decoder built from them is stale."""
    return tuple((p.data_ptr(), p.dtype, p.device, p.shape) for p in model.parameters())
