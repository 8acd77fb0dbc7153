"""Load a causal LM and its tokenizer, and derive the identity of the KV state it computes.

Where the files come from (the embedded GGUF, a GGUF file, a directory, the local Hugging Face
cache) is :mod:`workers.model_source`.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from workers import devices
from workers.model_source import EMBEDDED_MODEL, embedded_gguf_path, resolve_source
from workers.stored_weights import (
    attach_gguf_weights,
    attach_int8_weights,
    resolve_quantization,
)

log = logging.getLogger(__name__)

# Config entries that name or describe the checkpoint but cannot change a hidden state.
_CONFIG_KEYS_WITHOUT_NUMERICS = {"_name_or_path", "transformers_version", "_commit_hash",
                                 "use_cache", "output_attentions", "output_hidden_states",
                                 "return_dict", "_attn_implementation_autoset"}


@dataclass
class LoadedModel:
    """A model ready for the runner.

    Attributes:
        model: the transformers causal LM, in eval mode on ``device``.
        tokenizer: its tokenizer (chat template included when the source has one).
        model_digest: hex sha256 of the weights' content, the numerics-relevant config and dtype.
        served_name: the model name the API reports.
        source_path: the directory the weights were loaded from.
        quantization: ``none`` (dense weights in ``dtype``), ``gguf`` (the GGUF file's Q8_0,
            Q4_0, Q4_1 tensors as stored) or ``int8`` (per-channel weight-only int8); see
            ``workers.stored_weights``.
    """

    model: PreTrainedModel
    tokenizer: Any
    model_digest: str
    served_name: str
    source_path: Path
    quantization: str = "none"

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype


def default_dtype(device: torch.device) -> torch.dtype:
    """bf16 where the hardware computes it natively, fp32 otherwise.

    On CPUs without AVX512-BF16 or AMX (AVX2 only), bf16 weights are widened to fp32 in
    registers: a lone decode step reads half the bytes and is faster than in fp32, but
    prompts are no faster (an AMD EPYC Zen 3, one thread, two rounds alternating: a lone
    decode step 25.8 and 24.1 against 36.3 and 38.6 ms, a 1,024-token prefill 203 and 237
    against 254 and 204 tokens/s; ``benchmarks/results/epyc-avx2-fp32/bf16-avx2-f752240/``).
    ``auto`` keeps fp32 there, what the exactness tests compare against transformers, and
    ``--dtype bfloat16`` is the operator's choice.
    """
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    flags = cpu_flags()
    return torch.bfloat16 if flags & {"avx512_bf16", "amx_bf16"} else torch.float32


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags (``/proc/cpuinfo``: ``avx2``, ``avx512_bf16``, ``amx_bf16``...);
    empty where they cannot be read."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def default_device() -> torch.device:
    """CUDA when a GPU is visible (a Ray replica sees the one it was given), else CPU."""
    return torch.device("cuda" if devices.cuda_available() else "cpu")


def parse_dtype(name: str | None, device: torch.device) -> torch.dtype:
    """``auto``/None → :func:`default_dtype`; else one of bfloat16, float16, float32.

    Raises:
        ValueError: an unknown dtype name.
    """
    if name in (None, "auto"):
        return default_dtype(device)
    aliases = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32",
               "float": "float32"}
    name = aliases.get(name, name)
    if name not in ("bfloat16", "float16", "float32"):
        raise ValueError(f"unknown dtype {name!r}: use auto, bfloat16, float16 or float32")
    return getattr(torch, name)


def model_digest(model: PreTrainedModel) -> str:
    """Hex sha256 of the weights' content, the numerics-relevant config, and the dtype.

    Content, not name: two checkpoints with one name but different weights never share KV.
    Hashes every parameter and buffer in name order (about 0.3 s for 135M parameters). Meant
    for a model on the host (:func:`load_model` hashes before moving it to its device): a
    model on a GPU would have every weight copied back first.
    """
    hasher = hashlib.sha256()
    config = {k: v for k, v in model.config.to_dict().items()
              if k not in _CONFIG_KEYS_WITHOUT_NUMERICS}
    hasher.update(json.dumps(config, sort_keys=True, default=str).encode())
    hasher.update(str(model.dtype).encode())
    for name, tensor in sorted(model.state_dict().items()):
        hasher.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        hasher.update(tensor.detach().contiguous().cpu().view(torch.uint8).numpy())  # no copy
    return hasher.hexdigest()


def numerics_tag(device: torch.device, attn_implementation: str) -> str:
    """What besides weights and dtype changes KV values: device, kernels, library versions."""
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return (f"{device.type}:{device_name}|attn={attn_implementation}"
            f"|torch={torch.__version__}|transformers={transformers.__version__}")


def load_model(model: str = EMBEDDED_MODEL, dtype: str | None = "auto",
               device: str | None = None, attn_implementation: str = "sdpa",
               quantization: str = "none") -> LoadedModel:
    """Load a causal LM for serving.

    Args:
        model: ``embedded``, a ``.gguf`` path, a model directory, or a cached hub id.
        dtype: the activation and KV dtype, and that of dense weights: ``auto`` (bf16 where
            native, else fp32), ``bfloat16``, ``float16``, ``float32``.
        device: ``cuda``/``cpu``; None picks CUDA when available.
        attn_implementation: the transformers attention implementation to load with; the
            engine's runner swaps in its paged attention for serving.
        quantization: how the weights are held: ``none``, ``gguf``, ``int8`` or ``auto``
            (``gguf`` for a GGUF model); see ``workers.stored_weights``.

    Raises:
        FileNotFoundError: the source cannot be found locally.
        ValueError: an unknown dtype or quantization, or a quantization this model or device
            cannot be served with.
    """
    torch_device = torch.device(device) if device else default_device()
    torch_dtype = parse_dtype(dtype, torch_device)
    quantization = resolve_quantization(quantization, model, torch_device)
    path, served_name = resolve_source(model)
    hf_model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch_dtype, attn_implementation=attn_implementation)
    # Hashed while still on the host, where transformers loads it: after the move, hashing
    # would copy every weight back from the device.
    digest = model_digest(hf_model)
    if quantization != "none":
        _attach_stored(hf_model, quantization, model, torch_device)
    hf_model.to(torch_device).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    return LoadedModel(hf_model, tokenizer, digest, served_name, path, quantization)


def _attach_stored(hf_model: PreTrainedModel, quantization: str, model: str,
                   device: torch.device) -> None:
    from workers.models import COMPACT_MODEL_TYPES

    if device.type != "cpu" or hf_model.config.model_type not in COMPACT_MODEL_TYPES:
        raise ValueError(f"--quantization {quantization} is served on the CPU for the "
                         f"{', '.join(sorted(COMPACT_MODEL_TYPES))} architectures; this is "
                         f"{hf_model.config.model_type} on {device.type}: use "
                         "--quantization none")
    if quantization == "gguf":
        gguf = embedded_gguf_path() if model == EMBEDDED_MODEL else Path(model).expanduser()
        attach_gguf_weights(hf_model, gguf)
    else:
        attach_int8_weights(hf_model)
