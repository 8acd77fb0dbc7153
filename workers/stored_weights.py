"""Give a loaded model's linear layers and token embedding their stored (quantized) weights.

``--quantization gguf`` (the default for a ``.gguf`` model) reads the file's Q8_0, Q4_0 and
Q4_1 tensors with the ``gguf`` package (llama.cpp's own reader) and keeps their bytes; other
tensor types stay as transformers dequantized them. ``--quantization int8`` quantizes every
decoder linear layer per channel. Either way the dense weight each stored one replaces is
freed, so the worker holds the weights about at the stored size; the transformers modules
keep their structure (the compact decoder reads ``stored_weight`` off them).
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch
from torch import nn
from transformers import PreTrainedModel

from workers import kernels
from workers.models.weight_formats import (
    GGUF_FORMATS,
    StoredWeight,
    quantize_int8_per_channel,
)

log = logging.getLogger(__name__)

QUANTIZATIONS = ("auto", "none", "gguf", "int8")
"""``auto``: ``gguf`` for a GGUF file on the CPU, else ``none`` (dense weights in ``--dtype``)."""

_LAYER_TENSORS = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                  "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
                  "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                  "ffn_down": "mlp.down_proj"}
"""GGUF's per-layer tensor names (``blk.N.<name>.weight``) → transformers module paths."""

_PERMUTED_ARCHITECTURES = {"llama", "mistral"}
"""llama.cpp's converter reorders these architectures' q/k rows for its RoPE layout."""


def resolve_quantization(quantization: str, source: str, device: torch.device) -> str:
    """``auto`` → ``gguf`` for a ``.gguf`` (or the embedded) model on the CPU where the native
    kernel is available, else ``none`` (the stored-weight kernels are CPU kernels).

    Raises:
        ValueError: an unknown name, or ``gguf`` for a model that is not a GGUF file.
    """
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {quantization!r}: use one of "
                         f"{', '.join(QUANTIZATIONS)}")
    is_gguf = source.endswith(".gguf") or source == "embedded"
    if quantization == "auto":
        if not (is_gguf and device.type == "cpu"):
            return "none"
        if kernels.weight_linear() is None:  # no compiler, or kernels turned off
            log.warning("GGUF weights are served dequantized: the native weight_linear "
                        "kernel is unavailable")
            return "none"
        return "gguf"
    if quantization == "gguf" and not is_gguf:
        raise ValueError("--quantization gguf needs a .gguf model; use int8 for others")
    return quantization


def attach_gguf_weights(model: PreTrainedModel, gguf_path: Path) -> dict[str, int]:
    """Replace the dense weights of ``model`` with the GGUF file's stored ones where their
    type is served as stored.

    Returns:
        How many tensors of each GGUF type were attached (``{"Q4_1": 210, "Q8_0": 1}``).

    Raises:
        ValueError: a tensor's shape disagrees with the module it maps to.
    """
    import gguf

    reader = gguf.GGUFReader(str(gguf_path))
    field = reader.fields["general.architecture"]
    architecture = bytes(field.parts[field.data[0]]).decode()
    modules = _modules_by_gguf_name(model)
    attached: dict[str, int] = {}
    for tensor in reader.tensors:
        module = modules.get(tensor.name)
        fmt = GGUF_FORMATS.get(tensor.tensor_type.name)
        if module is None or fmt is None:
            continue
        rows = torch.from_numpy(np.array(tensor.data, copy=True))  # off the file's mapping
        if architecture in _PERMUTED_ARCHITECTURES:
            rows = _unpermute_rows(rows, tensor.name, model.config)
        _attach(module, StoredWeight.from_rows(rows, fmt, int(tensor.shape[0])))
        attached[tensor.tensor_type.name] = attached.get(tensor.tensor_type.name, 0) + 1
    _tie_lm_head(model, modules)
    log.info("serving %s as stored: %s", gguf_path.name, attached)
    return attached


def attach_int8_weights(model: PreTrainedModel) -> int:
    """Quantize every decoder linear layer per channel (int8, weight-only); the embedding and
    LM head stay dense. Returns how many layers were quantized.

    Raises:
        ValueError: a layer's in_features is not a multiple of 32.
    """
    count = 0
    for layer in model.model.layers:
        for path in _LAYER_TENSORS.values():
            module = layer.get_submodule(path)
            _attach(module, quantize_int8_per_channel(module.weight))
            count += 1
    return count


def _modules_by_gguf_name(model: PreTrainedModel) -> dict[str, nn.Module]:
    modules = {"token_embd.weight": model.model.embed_tokens}
    if not model.config.tie_word_embeddings:
        modules["output.weight"] = model.lm_head
    for index, layer in enumerate(model.model.layers):
        for gguf_name, path in _LAYER_TENSORS.items():
            modules[f"blk.{index}.{gguf_name}.weight"] = layer.get_submodule(path)
    return modules


def _attach(module: nn.Module, stored: StoredWeight) -> None:
    """Give ``module`` its stored weight and free the dense one (its dtype is kept: the
    decoder reads the activation dtype off it)."""
    shape = tuple(module.weight.shape)
    if shape != (stored.out_features, stored.in_features):
        raise ValueError(f"stored weight {stored.out_features}x{stored.in_features} does "
                         f"not fit a module of weight {shape}")
    module.stored_weight = stored
    module.weight.data = torch.empty(0, dtype=module.weight.dtype)


def _tie_lm_head(model: PreTrainedModel, modules: dict[str, nn.Module]) -> None:
    """A tied LM head multiplies by the stored embedding table."""
    if model.config.tie_word_embeddings:
        stored = getattr(modules["token_embd.weight"], "stored_weight", None)
        if stored is not None:
            model.lm_head.stored_weight = stored


def _unpermute_rows(rows: torch.Tensor, name: str, config) -> torch.Tensor:
    """Undo llama.cpp's q/k row order (each head's rotary pairs interleaved) on a tensor's
    rows of blocks ``[out_features, row bytes]``, as transformers' GGUF loader does on
    dequantized values."""
    if ".attn_q." in name:
        heads = config.num_attention_heads
    elif ".attn_k." in name:
        heads = config.num_key_value_heads
    else:
        return rows
    n = rows.shape[0]
    order = torch.arange(n).reshape(heads, n // heads // 2, 2).transpose(1, 2).reshape(n)
    return rows[order].contiguous()


def stored_formats(model: PreTrainedModel) -> set[str]:
    """Names of the formats of the stored weights attached to ``model`` (empty: none)."""
    return {module.stored_weight.fmt.name for module in model.modules()
            if getattr(module, "stored_weight", None) is not None}
