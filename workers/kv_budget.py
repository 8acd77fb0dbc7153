"""The KV cache's memory budget: the one given (``--kv-memory-mib``), 512 MiB on a CPU, or on
CUDA what the device's memory leaves once the model is loaded.

On CUDA, with ``gpu_memory_utilization`` u (vLLM's option: the fraction of the device's total
memory this worker may use in all), the budget is::

    share  = u x total - weights       what this worker may use, less the weights it holds
    room   = min(share, free)          never more than the device has free now
    budget = (room - reserve) x L / (L + 1)

Alone on a device, ``free`` is about ``total - weights - CUDA context``, so ``share`` is the
smaller term and the worker ends up using u of the device (plus its CUDA context, a few hundred
MiB that no allocator counts); ``free`` only bounds the budget when other processes hold part of
the device. Workers sharing a device (``--gpus-per-worker 0.5``) each take their own u of it,
so their utilizations must add up to at most 1 (``cluster.config`` checks).

``reserve`` (:func:`activation_reserve`) is what one engine step needs besides the weights and
the KV, estimated from the model config rather than measured, and on the large side. The
factor ``L / (L + 1)`` (L layers) leaves room for decode attention on CUDA, which gathers the
running sequences' keys and values of one layer into a copy: about one layer's share of the
cache when they fill it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from transformers import PretrainedConfig, PreTrainedModel

from workers import devices
from workers.config import EngineConfig, MiB
from workers.kv_cache import PagedKVCache

if TYPE_CHECKING:
    from workers.model_loader import LoadedModel

log = logging.getLogger(__name__)

CPU_KV_CACHE_BYTES = 512 * MiB
"""The automatic budget on a CPU (host memory is not sized from what is free)."""

RESERVE_MARGIN = 2
"""The activation reserve is twice the tensors :func:`activation_reserve` itemizes: for the
temporaries it does not (norms' and RoPE's intermediates, the sampler's sorts), kernels'
workspaces and the allocator's fragmentation."""


@dataclass(frozen=True)
class KVBudget:
    """A KV budget and how it was arrived at.

    Attributes:
        bytes: the budget, in bytes.
        source: ``explicit`` (configured), ``cpu-default`` or ``device-memory``.
        derivation: one line saying how, for the worker's log.
    """

    bytes: int
    source: str
    derivation: str


def kv_cache_budget(config: EngineConfig, loaded: LoadedModel) -> int:
    """The KV budget in bytes for an engine over ``loaded`` (its model already on its
    device); logs it and how it was derived.

    Raises:
        ValueError: on CUDA, the device's memory leaves less than one KV block.
    """
    budget = plan_kv_budget(config, loaded.model)
    log.info("KV cache budget %s (%s): %s", _size(budget.bytes), budget.source,
             budget.derivation)
    return budget.bytes


def plan_kv_budget(config: EngineConfig, model: PreTrainedModel) -> KVBudget:
    """:func:`kv_cache_budget` without the log line."""
    if config.kv_cache_bytes is not None:
        return KVBudget(config.kv_cache_bytes, "explicit",
                        f"{_size(config.kv_cache_bytes)} as configured")
    if model.device.type != "cuda":
        return KVBudget(CPU_KV_CACHE_BYTES, "cpu-default",
                        f"{_size(CPU_KV_CACHE_BYTES)}, the default on {model.device.type}")
    free, total = devices.device_memory(model.device)
    weights = sum(t.numel() * t.element_size()
                  for t in [*model.parameters(), *model.buffers()])
    return device_kv_budget(config, model.config, model.dtype, weights, free, total,
                            str(model.device))


def device_kv_budget(config: EngineConfig, model_config: PretrainedConfig, dtype: torch.dtype,
                     weights_bytes: int, free: int, total: int,
                     device_name: str = "cuda") -> KVBudget:
    """The budget on a CUDA device with ``free`` of ``total`` bytes free after loading
    ``weights_bytes`` of weights (the formula in the module docstring).

    Raises:
        ValueError: ``gpu_memory_utilization`` out of (0, 1], or the budget holds no block.
    """
    utilization = config.gpu_memory_utilization
    if not 0 < utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    share = int(utilization * total) - weights_bytes
    room = min(share, free)
    rows = max_logit_rows(config)
    reserve = activation_reserve(model_config, dtype, config.max_num_batched_tokens, rows)
    layers = PagedKVCache.geometry(model_config)[0]
    budget = max(0, room - reserve) * layers // (layers + 1)
    derivation = (
        f"{device_name}: {utilization:g} x {_size(total)} total - {_size(weights_bytes)} "
        f"weights = {_size(share)} this worker may use, {_size(free)} free; "
        f"less {_size(reserve)} for a step's activations ({config.max_num_batched_tokens} "
        f"tokens, {rows} logit rows), {layers}/{layers + 1} of the rest (1/{layers + 1} for "
        f"decode's gather of one layer)")
    block = PagedKVCache.bytes_per_block(model_config, config.block_size, dtype)
    if budget < block:
        raise ValueError(
            f"no room for a KV cache on {derivation}: {_size(budget)}, less than one block "
            f"of {config.block_size} tokens ({_size(block)}). Raise --gpu-memory-utilization, "
            "lower --max-num-batched-tokens, free the device, or pass --kv-memory-mib")
    return KVBudget(budget, "device-memory", f"{derivation} = {_size(budget)}")


def max_logit_rows(config: EngineConfig) -> int:
    """Most rows of vocabulary logits one step computes: one per running sequence, ``1 + k``
    when speculation verifies ``k`` draft tokens, never more than the step's tokens."""
    spec = config.speculative
    per_seq = 1 + (spec.num_speculative_tokens if spec.enabled else 0)
    return min(config.max_num_batched_tokens, config.max_num_seqs * per_seq)


def activation_reserve(model_config: PretrainedConfig, dtype: torch.dtype, step_tokens: int,
                       logit_rows: int) -> int:
    """Bytes one engine step of ``step_tokens`` tokens needs besides weights and KV,
    :data:`RESERVE_MARGIN` times the sum of:

    - per token, in the model's dtype, what a decoder layer holds at once: the residual stream
      and its normed copy (2 x hidden), the fused QKV projection ((heads + 2 x KV heads) x
      head dim), the attention output (heads x head dim), and the MLP's gate, up and gated
      product (3 x intermediate). Layers run one after another, so one layer's worth.
    - the sampled rows' logits in float32 (``logit_rows`` x vocabulary), twice: the logits
      and the sampler's probabilities.

    Prefill attention runs in fused kernels that hold no score matrix; decode's gather of one
    layer is left to the budget's ``L / (L + 1)``.
    """
    _, kv_heads, head_dim = PagedKVCache.geometry(model_config)
    hidden = model_config.hidden_size
    heads = model_config.num_attention_heads
    intermediate = getattr(model_config, "intermediate_size", None) or 4 * hidden
    itemsize = torch.empty((), dtype=dtype).element_size()
    per_token = (2 * hidden + (heads + 2 * kv_heads) * head_dim + heads * head_dim
                 + 3 * intermediate)
    activations = step_tokens * per_token * itemsize
    logits = 2 * logit_rows * model_config.vocab_size * 4
    return RESERVE_MARGIN * (activations + logits)


def _size(num_bytes: int) -> str:
    """``1.25 GiB``, or ``300 MiB`` under a GiB."""
    if abs(num_bytes) >= 1 << 30:
        return f"{num_bytes / (1 << 30):.2f} GiB"
    return f"{num_bytes / MiB:.0f} MiB"
