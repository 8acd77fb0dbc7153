"""Runs one engine step's forward pass over the paged KV cache.

Llama-style architectures run on the compact implementation in ``workers.models`` (fused
projections, no per-layer module dispatch); every other architecture runs transformers' own
modules with ``workers.attention`` plugged in through ``AttentionInterface``. Either way
only the rows that are sampled go through the LM head, so a 1,024-token prefill pays for one row
of vocabulary logits, not 1,024.
"""

from __future__ import annotations

import logging

import torch
from transformers import PreTrainedModel

from workers import huge_pages
from workers.attention.kernel_choice import (
    FLASH_PREFILL,
    NATIVE_DECODE,
    decode_kernel,
    decode_score_products,
    prefill_kernel,
)
from workers.attention.metadata import AttentionMetadata, build_metadata
from workers.attention.transformers_adapter import ATTN_IMPLEMENTATION
from workers.kv_cache import PagedKVCache
from workers.lora.batch import LoraBatch
from workers.models import compact_model_for
from workers.models.linear import (
    Linear,
    StoredLinear,
    linear_kernel,
    packs_small_batches,
    stored_kernel,
)
from workers.scheduler import ScheduledBatch
from workers.stored_weights import stored_formats

log = logging.getLogger(__name__)


class ModelRunner:
    """Owns the model in its serving form and the KV tensors.

    Args:
        model: a transformers causal LM (any architecture whose attention goes through
            ``ALL_ATTENTION_FUNCTIONS``, e.g. Llama, Qwen2, Mistral, Phi-3).
        kv_cache: the preallocated paged KV tensors.

    Attributes:
        implementation: ``"compact"`` or ``"transformers"``, the path this model runs on.
        linear_kernel: the small-batch matmul kernel of the compact path (``aten`` on the
            transformers path; ``weight-stream:<formats>/<simd>`` over stored quantized
            weights); see ``workers.models.linear``.
        decode_kernel: what plain decodes attend with (``native-paged`` or ``gather-sdpa``);
            see ``workers.attention.kernel_choice.decode_kernel``.
        decode_scores: what the native decode kernel computes bf16 scores with (``tiles``,
            ``pairs``, or empty for widened dot products); see
            ``workers.attention.kernel_choice.decode_score_products``.
        prefill_kernel: what prompts and prefill chunks attend with (``amx-tiles``,
            ``avx512-bf16`` or ``sdpa-flash``); see
            ``workers.attention.kernel_choice.prefill_kernel``.
        norm_kernel: what the compact path's RMSNorms run on (``native`` or ``torch``; ``torch``
            on the transformers path); see ``workers.models.norm``.
    """

    def __init__(self, model: PreTrainedModel, kv_cache: PagedKVCache):
        self.model = model
        self.kv_cache = kv_cache
        self.device = model.device
        self._compact = compact_model_for(model)
        # The weights in every form a step reads them, on 2 MiB pages (workers.huge_pages).
        arena, placed = _place_streamed_weights(self._compact)
        advised = huge_pages.advise_all(huge_pages.tensors_of((model, self._compact)),
                                        skip=arena.storages)
        log.info("weights: %.0f MiB moved and %.0f MiB asked onto huge pages", placed / 2**20,
                 advised / 2**20)
        self.implementation = "compact" if self._compact is not None else "transformers"
        self.linear_kernel = self._linear_kernel(model)
        head_dim = kv_cache.keys[0].shape[-1]
        self.decode_kernel = decode_kernel(model.dtype, model.device, head_dim)
        self.prefill_kernel = prefill_kernel(model.dtype, model.device, head_dim)
        self.decode_scores = (decode_score_products(model.dtype, kv_cache.block_size, head_dim)
                              if self.decode_kernel == NATIVE_DECODE else "")
        self.norm_kernel = self._compact.norm_kernel if self._compact is not None else "torch"
        model.set_attn_implementation(ATTN_IMPLEMENTATION)

    def _linear_kernel(self, model: PreTrainedModel) -> str:
        if self._compact is None:
            return "aten"
        formats = stored_formats(model)
        if formats:
            return stored_kernel(formats, model.dtype)
        return linear_kernel(model.dtype, model.device, packs_small_batches(model))

    @property
    def kernels(self) -> str:
        """The path and kernels this runner computes with, as one tag: they change rounding,
        so the KV it computes is only reusable by workers running the same ones (the cache
        identity's numerics carry it)."""
        scores = f"+{self.decode_scores}" if self.decode_scores else ""
        return (f"{ATTN_IMPLEMENTATION}/{self.implementation}|linear={self.linear_kernel}"
                f"|prefill={self.prefill_kernel}|decode={self.decode_kernel}{scores}"
                f"|norm={self.norm_kernel}")

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, num_logits: list[int]) -> torch.Tensor:
        """Compute the KV of every scheduled token and the logits of each sequence's last
        ``num_logits[i]`` new tokens.

        Args:
            batch: sequence ``i`` computes its tokens
                ``[num_computed_tokens, num_computed_tokens + num_new_tokens[i])``; past its
                committed tokens come its draft tokens (``spec_token_ids``), a verification
                block.
            num_logits: per sequence of the batch: 0 (a prefill chunk that ends mid-prompt),
                1 (the next token), or ``1 + len(spec_token_ids)`` (verification).

        Returns:
            ``[sum(num_logits), vocab_size]`` float32 logits, sequence by sequence, in row
            order.
        """
        input_ids, positions, logit_rows, adapter_spans = [], [], [], []
        for seq, num_new, wanted in zip(batch.seqs, batch.num_new_tokens, num_logits,
                                        strict=True):
            start = seq.num_computed_tokens
            tokens = seq.token_ids[start:start + num_new]
            tokens += seq.spec_token_ids[:num_new - len(tokens)]
            adapter_spans.append((seq.adapter, len(input_ids), len(input_ids) + num_new))
            input_ids.extend(tokens)
            positions.extend(range(start, start + num_new))
            logit_rows.extend(range(len(input_ids) - wanted, len(input_ids)))
        metadata = build_metadata(
            self.kv_cache, [seq.block_table for seq in batch.seqs],
            [seq.num_computed_tokens for seq in batch.seqs], batch.num_new_tokens, self.device,
            [bool(seq.spec_token_ids) for seq in batch.seqs],
            native_decode=self.decode_kernel == NATIVE_DECODE,
            native_prefill=self.prefill_kernel != FLASH_PREFILL,
            prompt=[seq.num_computed_tokens < seq.num_prompt_tokens for seq in batch.seqs])
        # int64 even when empty: a step that only runs a middle prefill chunk samples nothing.
        sample_index = torch.tensor(logit_rows, dtype=torch.long, device=self.device)
        ids = torch.tensor(input_ids, device=self.device)
        pos = torch.tensor(positions, device=self.device)
        lora = LoraBatch.of(adapter_spans, self.device)
        if self._compact is not None:
            return self._compact(ids, pos, metadata, sample_index, lora)
        return self._transformers_forward(ids, pos, metadata, sample_index)

    def _transformers_forward(self, ids: torch.Tensor, positions: torch.Tensor,
                              metadata: AttentionMetadata,
                              sample_index: torch.Tensor) -> torch.Tensor:
        output = self.model(input_ids=ids.unsqueeze(0), position_ids=positions.unsqueeze(0),
                            use_cache=False, logits_to_keep=sample_index, paged=metadata)
        return output.logits[0].float()


def _place_streamed_weights(decoder: object) -> tuple[huge_pages.WeightArena, int]:
    """Moves the weights a decode step streams (stored weights, small-batch packed copies)
    into one :class:`~workers.huge_pages.WeightArena`: each is an allocation of a few MiB at
    most, which huge pages cannot otherwise reach. Returns the arena and the bytes moved
    (0 without a compact decoder)."""
    arena, moved, rehomed = huge_pages.WeightArena(), 0, set()
    if decoder is None:
        return arena, 0
    for obj in list(huge_pages.objects_of(decoder)):
        if (isinstance(obj, StoredLinear) and id(obj.weight) not in rehomed
                and obj.weight.data.device.type == "cpu"):
            rehomed.add(id(obj.weight))  # a weight two layers share moves once
            obj.weight.rehome(arena.place(obj.weight.data))
            moved += obj.weight.nbytes
        elif isinstance(obj, Linear) and obj.small_packed is not None:
            obj.small_packed = arena.place(obj.small_packed)
            moved += obj.small_packed.numel() * obj.small_packed.element_size()
    return arena, moved
