"""The attention itself, over the paged KV cache.

:func:`paged_attention` stores a step's new keys and values and attends every new token to its
sequence's context, as the step's :class:`~workers.attention.metadata.AttentionMetadata` says:
a span with torch's flash kernel (plus a log-sum-exp merge over cached context) or our bf16
prefill kernel, decodes with our native kernel in place or over a gathered copy with torch's
SDPA, verification blocks over a gathered copy under a causal mask. :func:`attend_stored` only
attends, for callers that stored the keys and values themselves.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from workers.attention.metadata import AttentionMetadata, DecodeGroup, PrefillSpan
from workers.kernels import paged_decode, prefill_attention
from workers.kv_cache import PagedKVCache


def paged_attention(layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    metadata: AttentionMetadata, scale: float) -> torch.Tensor:
    """Store the step's new KV and attend every new token to its sequence's context.

    Args:
        layer: the cache layer.
        query: ``[T, num_heads, head_dim]``, RoPE applied.
        key, value: ``[T, num_kv_heads, head_dim]``, the step's new tokens.
        metadata: the step's :class:`AttentionMetadata`.
        scale: softmax scale.

    Returns:
        ``[T, num_heads, head_dim]``, in ``query``'s dtype.
    """
    metadata.kv_cache.write(layer, metadata.slot_mapping, key, value)
    return attend_stored(layer, query, key, value, metadata, scale)


def attend_stored(layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  metadata: AttentionMetadata, scale: float) -> torch.Tensor:
    """:func:`paged_attention` for a step whose new keys and values are in the cache already
    (``key`` and ``value``, the same, are read by prefill spans); the same arguments."""
    cache = metadata.kv_cache
    groups = metadata.decode_groups
    if (not metadata.spans and len(groups) == 1 and isinstance(groups[0].row_index, slice)
            and groups[0].row_index == slice(0, len(query))):  # a pure decode step, in order
        return _attend_decodes(layer, query, groups[0], cache, scale)
    out = torch.empty_like(query)
    for span in metadata.spans:
        attend = _attend_span_native if metadata.native_prefill else _attend_span
        out[span.start:span.end] = attend(layer, query, key, value, span, cache, scale)
    for group in groups:
        out[group.row_index] = _attend_decodes(layer, query, group, cache, scale)
    return out


def _attend_span(layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 span: PrefillSpan, cache: PagedKVCache, scale: float) -> torch.Tensor:
    rows = slice(span.start, span.end)
    # Strided views straight from the fused projection: head-major copies measured no faster
    # (benchmarks/kernel_choices.py).
    q = query[rows].transpose(0, 1).unsqueeze(0)  # [1, heads, n, dim]
    k_new = key[rows].transpose(0, 1).unsqueeze(0)
    v_new = value[rows].transpose(0, 1).unsqueeze(0)
    if span.cached_blocks is None:
        out = F.scaled_dot_product_attention(q, k_new, v_new, is_causal=True, scale=scale,
                                             enable_gqa=True)
        return out[0].transpose(0, 1)
    k_old, v_old = cache.gather(layer, span.cached_blocks)
    if q.device.type != "cpu":  # one call with a bottom-right causal mask
        k_all = torch.cat([k_old[:, :span.num_cached].unsqueeze(0), k_new], dim=2)
        v_all = torch.cat([v_old[:, :span.num_cached].unsqueeze(0), v_new], dim=2)
        mask = causal_lower_right(q.shape[2], k_all.shape[2])
        out = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, scale=scale,
                                             enable_gqa=True)
        return out[0].transpose(0, 1)
    new_out, new_lse = _flash(q, k_new, v_new, scale, causal=True)
    old_out, old_lse = _flash(q, k_old[:, :span.num_cached].unsqueeze(0),
                              v_old[:, :span.num_cached].unsqueeze(0), scale, causal=False)
    merged = _merge(old_out, old_lse, new_out, new_lse)
    return merged[0].transpose(0, 1).to(query.dtype)


def _attend_span_native(layer: int, query: torch.Tensor, key: torch.Tensor,
                        value: torch.Tensor, span: PrefillSpan, cache: PagedKVCache,
                        scale: float) -> torch.Tensor:
    """One call for the span's new tokens and its cached context, read where it lies."""
    rows = slice(span.start, span.end)
    blocks = span.cached_blocks if span.cached_blocks is not None else _NO_BLOCKS
    return prefill_attention().prefill_attention(query[rows], key[rows], value[rows],
                                                 cache.keys[layer], cache.values[layer], blocks,
                                                 span.num_cached, cache.block_size, scale)


_NO_BLOCKS = torch.empty(0, dtype=torch.int64)


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
           causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused attention that also returns its log-sum-exp ``[1, heads, n]`` (float32), so
    partial results over disjoint key sets can be merged exactly. Takes GQA as is."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal,
                                                                       scale=scale)


def _merge(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
           lse_b: torch.Tensor) -> torch.Tensor:
    """Softmax over the union of two key sets from each set's output and log-sum-exp."""
    lse = torch.logaddexp(lse_a, lse_b)
    weight_a = torch.exp(lse_a - lse).unsqueeze(-1)
    weight_b = torch.exp(lse_b - lse).unsqueeze(-1)
    return out_a.float() * weight_a + out_b.float() * weight_b



def _attend_decodes(layer: int, query: torch.Tensor, group: DecodeGroup, cache: PagedKVCache,
                    scale: float) -> torch.Tensor:
    if group.native:
        return _attend_decodes_in_place(layer, query, group, cache, scale)
    return _attend_gathered(layer, query, group, cache, scale)


def _attend_gathered(layer: int, query: torch.Tensor, group: DecodeGroup, cache: PagedKVCache,
                     scale: float) -> torch.Tensor:
    """The group's blocks gathered into a copy, then one SDPA call (any ``q_len``)."""
    q_len = group.q_len
    num_seqs = len(group.rows) // q_len
    _, heads, head_dim = query.shape
    k, v = cache.gather(layer, group.block_ids)  # [kv_heads, seqs * ctx, dim], a copy
    if group.padding is not None and len(group.padding):
        k.index_fill_(1, group.padding, 0.0)
        v.index_fill_(1, group.padding, 0.0)
    kv_heads = k.shape[0]
    per_kv = heads // kv_heads
    k = k.view(kv_heads, num_seqs, -1, head_dim).transpose(0, 1)  # [seqs, kv_heads, ctx, dim]
    v = v.view(kv_heads, num_seqs, -1, head_dim).transpose(0, 1)
    # Fold GQA: the query heads of one KV head (for every query row of the sequence) are that
    # head's query rows, ordered (row j, head h) as j * per_kv + h.
    q = (query[group.rows].view(num_seqs, q_len, kv_heads, per_kv, head_dim)
         .transpose(1, 2).reshape(num_seqs, kv_heads, q_len * per_kv, head_dim))
    mask = group.mask
    if mask is not None and q_len > 1:
        mask = mask.repeat_interleave(per_kv, dim=2)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    out = out.view(num_seqs, kv_heads, q_len, per_kv, head_dim).transpose(1, 2)
    return out.reshape(num_seqs * q_len, heads, head_dim)


def _attend_decodes_in_place(layer: int, query: torch.Tensor, group: DecodeGroup,
                             cache: PagedKVCache, scale: float) -> torch.Tensor:
    """The group's rows attended by the native kernel over the cache itself, in one call; the
    scratch-block padding of the tables is never read (the kernel stops at each row's length).

    GQA is folded as on the gather path: the query heads of KV head h, for each of a
    sequence's ``q_len`` tokens, are that head's query rows, ordered (token j, head i) as
    ``j * per_kv + i``, and all of them share each block's reads (a verification block's
    tokens read its context once, not once each). Where a block's rows would outnumber the
    kernel's ``max_rows``, each token goes as a sequence of its own instead.
    """
    kernel = paged_decode()
    q_len = group.q_len
    num_seqs = len(group.rows) // q_len
    _, heads, head_dim = query.shape
    kv_heads = cache.keys[layer].shape[0]
    per_kv = heads // kv_heads
    rows = query[group.row_index].reshape(num_seqs, q_len, kv_heads, per_kv, head_dim)
    tables = group.block_ids.view(num_seqs, -1)
    if q_len * per_kv > kernel.max_rows:
        q = rows.reshape(num_seqs * q_len, kv_heads, per_kv, head_dim)
        out = kernel.paged_decode_attention(q, cache.keys[layer], cache.values[layer],
                                            tables.repeat_interleave(q_len, 0), group.lengths,
                                            cache.block_size, scale)
        return out.view(num_seqs * q_len, heads, head_dim)
    q = rows.transpose(1, 2).reshape(num_seqs, kv_heads, q_len * per_kv, head_dim)
    out = kernel.paged_decode_attention(q, cache.keys[layer], cache.values[layer], tables,
                                        group.lengths.view(num_seqs, q_len), cache.block_size,
                                        scale)
    out = out.view(num_seqs, kv_heads, q_len, per_kv, head_dim).transpose(1, 2)
    return out.reshape(num_seqs * q_len, heads, head_dim)
