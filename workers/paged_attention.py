"""Attention over the paged KV cache, plugged into transformers through ``AttentionInterface``.

A step flattens every scheduled sequence's new tokens into one ``[1, T]`` batch (as vLLM does),
so the model's projections and MLPs run once for all of them. Only attention needs to know
which tokens belong to which sequence: this module writes each new token's key and value into its
cache slot, then attends each sequence's queries to that sequence's whole context. Sequences with
one query token (decodes) are attended together in one padded call; longer ones (prefills,
chunks, verification of drafts) one by one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from workers.kv_cache import PagedKVCache

ATTN_IMPLEMENTATION = "nalar_paged"


@dataclass
class SequenceSpan:
    """One multi-token query run: rows ``[start, end)`` of the flat batch attend to
    ``context_slots`` (the cache slots of the sequence's tokens ``0 .. context_len - 1``)."""

    start: int
    end: int
    context_slots: torch.Tensor  # [context_len] int64
    mask: torch.Tensor | None  # [q_len, context_len] bool, None when purely causal over new KV
    attends_only_new: bool


@dataclass
class PagedAttentionMetadata:
    """Where a step's tokens go in the cache and what each attends to; built once per step,
    read by every layer.

    Attributes:
        kv_cache: the cache to read and write.
        slot_mapping: ``[T]`` cache slot of each new token.
        spans: multi-token queries, attended one by one.
        decode_rows: ``[B]`` rows of single-token queries, or None when there are none.
        decode_slots: ``[B, max_context]`` their context slots, padded with slot 0.
        decode_mask: ``[B, 1, 1, max_context]`` True where a padded slot is real context.
    """

    kv_cache: PagedKVCache
    slot_mapping: torch.Tensor
    spans: list[SequenceSpan]
    decode_rows: torch.Tensor | None = None
    decode_slots: torch.Tensor | None = None
    decode_mask: torch.Tensor | None = None


def build_metadata(kv_cache: PagedKVCache, block_tables: list[list[int]],
                   num_computed: list[int], num_new: list[int],
                   device: torch.device) -> PagedAttentionMetadata:
    """Metadata for a step where sequence ``i`` already has ``num_computed[i]`` tokens cached
    and computes ``num_new[i]`` more.

    Returns the metadata and fills ``slot_mapping`` in the same order the tokens are flattened.
    """
    block_size = kv_cache.block_size
    slot_rows, spans, decodes = [], [], []
    row = 0
    for table, computed, new in zip(block_tables, num_computed, num_new, strict=True):
        context_len = computed + new
        positions = torch.arange(context_len)
        table_tensor = torch.tensor(table, dtype=torch.long)
        slots = table_tensor[positions // block_size] * block_size + positions % block_size
        slot_rows.append(slots[computed:])
        if new == 1:
            decodes.append((row, slots))
        else:
            spans.append(_span(row, computed, new, slots, device))
        row += new
    metadata = PagedAttentionMetadata(kv_cache, torch.cat(slot_rows).to(device), spans)
    if decodes:
        _add_decodes(metadata, decodes, device)
    return metadata


def _span(row: int, computed: int, new: int, slots: torch.Tensor,
          device: torch.device) -> SequenceSpan:
    mask = None
    if computed:
        # Query i sits at position computed + i and sees keys 0 .. computed + i.
        query_pos = torch.arange(computed, computed + new).unsqueeze(1)
        mask = (torch.arange(computed + new).unsqueeze(0) <= query_pos).to(device)
    return SequenceSpan(row, row + new, slots.to(device), mask, attends_only_new=computed == 0)


def _add_decodes(metadata: PagedAttentionMetadata, decodes: list[tuple[int, torch.Tensor]],
                 device: torch.device) -> None:
    max_context = max(len(slots) for _, slots in decodes)
    padded = torch.zeros(len(decodes), max_context, dtype=torch.long)
    valid = torch.zeros(len(decodes), max_context, dtype=torch.bool)
    for i, (_, slots) in enumerate(decodes):
        padded[i, :len(slots)] = slots
        valid[i, :len(slots)] = True
    metadata.decode_rows = torch.tensor([row for row, _ in decodes], device=device)
    metadata.decode_slots = padded.to(device)
    metadata.decode_mask = valid[:, None, None, :].to(device)


def paged_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                            value: torch.Tensor, attention_mask: torch.Tensor | None,
                            scaling: float | None = None, dropout: float = 0.0,
                            paged: PagedAttentionMetadata | None = None,
                            **_: object) -> tuple[torch.Tensor, None]:
    """transformers attention function over the paged cache.

    Args:
        module: the attention module (its ``layer_idx`` selects the cache layer).
        query: ``[1, num_heads, T, head_dim]``, RoPE applied.
        key, value: ``[1, num_kv_heads, T, head_dim]`` for the step's new tokens.
        attention_mask: ignored; masks come from ``paged``.
        scaling: softmax scale.
        paged: the step's metadata, passed through the model's forward kwargs.

    Returns:
        ``([1, T, num_heads, head_dim], None)``.

    Raises:
        ValueError: called without paged metadata (the model was run outside the engine).
    """
    if paged is None:
        raise ValueError("nalar_paged attention needs the engine's paged metadata")
    layer = module.layer_idx
    cache_k, cache_v = paged.kv_cache.keys[layer], paged.kv_cache.values[layer]
    new_k, new_v = key[0].transpose(0, 1), value[0].transpose(0, 1)  # [T, kv_heads, dim]
    cache_k.index_copy_(0, paged.slot_mapping, new_k)
    cache_v.index_copy_(0, paged.slot_mapping, new_v)

    out = torch.empty_like(query[0].transpose(0, 1))  # [T, heads, dim]
    for span in paged.spans:
        q = query[:, :, span.start:span.end]
        if span.attends_only_new:
            k, v = key[:, :, span.start:span.end], value[:, :, span.start:span.end]
            result = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling,
                                                    enable_gqa=True)
        else:
            k = cache_k[span.context_slots].transpose(0, 1).unsqueeze(0)
            v = cache_v[span.context_slots].transpose(0, 1).unsqueeze(0)
            result = F.scaled_dot_product_attention(q, k, v, attn_mask=span.mask, scale=scaling,
                                                    enable_gqa=True)
        out[span.start:span.end] = result[0].transpose(0, 1)
    if paged.decode_rows is not None:
        q = query[0][:, paged.decode_rows].transpose(0, 1).unsqueeze(2)  # [B, heads, 1, dim]
        k = cache_k[paged.decode_slots].transpose(1, 2)  # [B, kv_heads, ctx, dim]
        v = cache_v[paged.decode_slots].transpose(1, 2)
        result = F.scaled_dot_product_attention(q, k, v, attn_mask=paged.decode_mask,
                                                scale=scaling, enable_gqa=True)
        out[paged.decode_rows] = result[:, :, 0]
    return out.unsqueeze(0), None


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
