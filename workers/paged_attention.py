"""Attention over the paged KV cache.

A step flattens every scheduled sequence's new tokens into one batch of ``T`` rows (as vLLM
does), so projections and MLPs run once for all of them. Only attention needs to know which
rows belong to which sequence. Per layer it writes the new tokens' keys and values into their
cache slots, then:

- a *span* (a prompt, a prefill chunk, or a verification block: several new tokens of one
  sequence) attends causally to its own new tokens with torch's fused CPU/GPU flash kernel,
  and, when the sequence already has cached context, to that context in a second, unmasked
  flash call; the two partial results are merged by their log-sum-exp (the split-softmax merge
  of flash-decoding, Dao et al. 2023). No mask or score matrix is ever materialised, and a
  chunk over a long cached context costs what the same tokens cost unchunked. In bf16 on CPUs
  with AMX-BF16 or AVX512-BF16 a span is instead one call to our prefill kernel
  (:func:`prefill_kernel`), which reads the cached context where it lies.
- *decodes* (one new token each) attend to their sequences' blocks with GQA folded: the query
  heads that share a KV head become rows of one query, so K/V are never expanded per query
  head. On a CPU (fp32 and bf16) all of a step's decodes go to our native kernel
  (``workers.kernels``) in one call; it reads the blocks where they lie, each sequence to its
  own length. Otherwise (GPUs, other dtypes, no compiler) decodes are grouped by context length
  and each group's blocks are gathered into a padded copy for torch's attention
  (:func:`decode_kernel`).
- *verification blocks* (a decode token followed by ``k`` draft tokens, speculative decoding)
  take the decode path with ``k + 1`` query rows per sequence and a causal mask over the
  gathered context, so every speculating sequence of a step is verified in the same batched
  call as the plain decodes, and its context is gathered once, not once per query row.

Two entry points share this: :func:`paged_attention` for the compact models in
``workers.models``, and :func:`paged_attention_forward`, registered with transformers'
``AttentionInterface`` for every other architecture.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right
from transformers import AttentionInterface

from workers.kernels import paged_decode, prefill_attention
from workers.kv_cache import PagedKVCache

ATTN_IMPLEMENTATION = "nalar_paged"

NATIVE_DECODE, GATHER_DECODE = "native-paged", "gather-sdpa"
FLASH_PREFILL = "sdpa-flash"

DECODE_PADDING_RATIO = 2
"""A decode group's longest context is at most this many times its shortest: rows padded to
the group's longest length waste at most half their attention work."""


@dataclass
class PrefillSpan:
    """Rows ``[start, end)`` of the flat batch: one sequence's new tokens, attending causally to
    each other and to the sequence's ``num_cached`` earlier tokens, held in ``cached_blocks``
    (``[ceil(num_cached / block_size)]`` int64 block ids, or None when ``num_cached`` is 0)."""

    start: int
    end: int
    num_cached: int
    cached_blocks: torch.Tensor | None


@dataclass
class DecodeGroup:
    """Short queries (``q_len`` rows per sequence: a decode token, or a decode token and its
    draft tokens) of similar context length, attended in one call.

    Attributes:
        rows: ``[B * q_len]`` rows of the flat batch, sequence-major.
        q_len: query rows per sequence.
        block_ids: ``[B * M]`` each sequence's block table, padded with the cache's scratch
            block to the group's longest, ``M`` blocks.
        lengths: ``[B]`` int64 tokens each sequence's last query row sees (its context).
        native: attended by the native kernel in place (``q_len == 1`` and the kernel chosen
            for this cache); it needs no ``mask`` or ``padding``, so they are None.
        mask: ``[B, 1, q_len, M * block_size]`` True where query row ``j`` of a sequence may
            attend (its context up to and including its own position); None when
            ``q_len == 1`` and every context fills the padded length exactly.
        padding: flat positions (into ``B * M * block_size``) past each sequence's context,
            or None. Their gathered K/V are zeroed before attention: a masked position gets
            probability 0, but 0 times a stale inf or NaN (left in the unused tail of a block
            by an earlier request, or in another request's block) is NaN.
        row_index: ``rows`` as a slice when they are consecutive and ascending (indexing the
            flat batch is then a view, not a gather), else ``rows`` itself.
    """

    rows: torch.Tensor
    q_len: int
    block_ids: torch.Tensor
    lengths: torch.Tensor
    native: bool
    mask: torch.Tensor | None
    padding: torch.Tensor | None
    row_index: slice | torch.Tensor


@dataclass
class _ShortQuery:
    """A sequence's rows ``[row, row + q_len)`` over its first ``length`` tokens."""

    row: int
    q_len: int
    table: list[int]
    length: int


@dataclass
class AttentionMetadata:
    """Where a step's tokens go in the cache and what each attends to; built once per step,
    read by every layer.

    Attributes:
        kv_cache: the cache to read and write.
        slot_mapping: ``[T]`` cache slot of each new token.
        spans: multi-token queries.
        decode_groups: decodes and verification blocks, grouped by query rows and context
            length.
        native_prefill: spans attend with our bf16 prefill kernel (:func:`prefill_kernel`).
    """

    kv_cache: PagedKVCache
    slot_mapping: torch.Tensor
    spans: list[PrefillSpan] = field(default_factory=list)
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    native_prefill: bool = False


def build_metadata(kv_cache: PagedKVCache, block_tables: list[list[int]],
                   num_computed: list[int], num_new: list[int],
                   device: torch.device, verify: list[bool] | None = None,
                   native_decode: bool | None = None,
                   native_prefill: bool | None = None) -> AttentionMetadata:
    """Metadata for a step where sequence ``i`` already has ``num_computed[i]`` tokens cached
    and computes ``num_new[i]`` more, its rows following those of sequence ``i - 1``.

    ``verify[i]`` marks a verification block (a decode token and its draft tokens): its rows
    take the batched short-query path instead of the per-sequence span path. Work is
    proportional to the step's new tokens and block-table lengths, never to a sequence's whole
    context in slots.

    ``native_decode``: whether plain decodes take the native kernel; by default
    :func:`decode_kernel`'s choice for the cache, made here once per step rather than per
    layer. ``native_prefill``: whether spans take our bf16 prefill kernel; by default
    :func:`prefill_kernel`'s choice.
    """
    block_size = kv_cache.block_size
    verify = verify or [False] * len(num_new)
    slots: list[int] = []
    spans: list[PrefillSpan] = []
    short: list[_ShortQuery] = []
    row = 0
    for table, computed, new, is_verify in zip(block_tables, num_computed, num_new, verify,
                                               strict=True):
        slots.extend(table[pos // block_size] * block_size + pos % block_size
                     for pos in range(computed, computed + new))
        if new == 1 or is_verify:
            length = computed + new
            short.append(_ShortQuery(row, new, table[:-(-length // block_size)], length))
        else:
            spans.append(_span(row, computed, new, table, block_size, device))
        row += new
    keys = kv_cache.keys[0]
    if native_prefill is None:
        native_prefill = prefill_kernel(keys.dtype, keys.device, keys.shape[-1]) != FLASH_PREFILL
    metadata = AttentionMetadata(kv_cache, torch.tensor(slots, device=device), spans,
                                 native_prefill=native_prefill)
    if native_decode is None:
        native_decode = decode_kernel(keys.dtype, keys.device, keys.shape[-1]) == NATIVE_DECODE
    # The native kernel reads each sequence to its own length, so plain decodes need no
    # grouping by length: one call, in row order. The gather path pads each group to its
    # longest context, so it groups contexts of similar length.
    if native_decode:
        plain = [query for query in short if query.q_len == 1]
        groups = ([plain] if plain else []) + _group_short_queries(
            [query for query in short if query.q_len > 1])
    else:
        groups = _group_short_queries(short)
    metadata.decode_groups = [_decode_group(group, kv_cache, device, native_decode)
                              for group in groups]
    return metadata


def _span(row: int, computed: int, new: int, table: list[int], block_size: int,
          device: torch.device) -> PrefillSpan:
    cached_blocks = None
    if computed:
        cached_blocks = torch.tensor(table[:-(-computed // block_size)], device=device)
    return PrefillSpan(row, row + new, computed, cached_blocks)


def _group_short_queries(queries: list[_ShortQuery]) -> list[list[_ShortQuery]]:
    """Groups of equal ``q_len`` whose longest context is at most
    :data:`DECODE_PADDING_RATIO` times their shortest."""
    groups: list[list[_ShortQuery]] = []
    for query in sorted(queries, key=lambda q: (q.q_len, q.length), reverse=True):
        last = groups[-1][0] if groups else None
        if (last is not None and last.q_len == query.q_len
                and last.length <= DECODE_PADDING_RATIO * query.length):
            groups[-1].append(query)
        else:
            groups.append([query])
    return groups


def _decode_group(group: list[_ShortQuery], kv_cache: PagedKVCache, device: torch.device,
                  native_decode: bool) -> DecodeGroup:
    q_len = group[0].q_len
    native = native_decode and q_len == 1
    blocks_per_row = max(len(query.table) for query in group)
    padded_len = blocks_per_row * kv_cache.block_size
    block_ids = []
    for query in group:
        pad = blocks_per_row - len(query.table)
        block_ids.extend(query.table + [kv_cache.scratch_block] * pad)
    mask = padding = None
    if not native and (q_len > 1 or any(query.length != padded_len for query in group)):
        # query row j of a sequence sees its first length - q_len + 1 + j tokens
        visible = torch.tensor([[query.length - q_len + 1 + j for j in range(q_len)]
                                for query in group])
        mask = (torch.arange(padded_len) < visible[..., None])[:, None].to(device)
        padding = torch.tensor([i * padded_len + pos for i, query in enumerate(group)
                                for pos in range(query.length, padded_len)], device=device)
    row_list = [query.row + j for query in group for j in range(q_len)]
    rows = torch.tensor(row_list, device=device)
    consecutive = row_list == list(range(row_list[0], row_list[0] + len(row_list)))
    row_index = slice(row_list[0], row_list[0] + len(row_list)) if consecutive else rows
    lengths = torch.tensor([query.length for query in group], device=device)
    return DecodeGroup(rows, q_len, torch.tensor(block_ids, device=device), lengths, native,
                       mask, padding, row_index)


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
    cache = metadata.kv_cache
    cache.write(layer, metadata.slot_mapping, key, value)
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


def prefill_kernel(dtype: torch.dtype, device: torch.device, head_dim: int) -> str:
    """What spans (prompts, prefill chunks) of a model in ``dtype`` on ``device`` attend with:
    our causal flash kernel for bf16 on CPUs, reading the cached context in place, named by
    what computes its products (``"amx-tiles"`` with AMX-BF16, ``"avx512-bf16"`` with
    AVX512-BF16 alone; head sizes 64, 128, 192, 256), or :data:`FLASH_PREFILL` (torch's fused
    attention, with a second call and a log-sum-exp merge over cached context). They round
    differently, so the choice is part of the cache identity's numerics.

    Our kernel's key blocks start at fixed positions and each query row is computed on its
    own, so a prompt gets bit-identical attention chunked or not, and over a cached prefix or
    cold; torch's kernel splits its work by the span's length. Measured against torch's kernel
    per causal layer of SmolLM2's shape (9 heads, 3 KV heads, head size 64,
    ``benchmarks/kernel_choices.py``): on an AMX Xeon, faster up to 1k tokens and level at
    4k-8k; on a Zen 5 EPYC with AVX512-BF16, about 4x faster at 1k-8k (see the README)."""
    kernel = prefill_attention() if device.type == "cpu" and dtype == torch.bfloat16 else None
    return kernel.backend if kernel is not None and head_dim in kernel.head_dims else FLASH_PREFILL


def decode_kernel(dtype: torch.dtype, device: torch.device, head_dim: int) -> str:
    """What plain decodes of a model in ``dtype`` on ``device`` with ``head_dim``-wide heads
    attend with: :data:`NATIVE_DECODE` (the kernel reading the paged cache in place, where it
    is built, for its head sizes) or :data:`GATHER_DECODE` (blocks gathered into a copy, then
    torch's SDPA). The two round differently, so the choice is part of the cache identity's
    numerics.

    Native in fp32 and bf16 on every CPU, where it measured faster
    (``benchmarks/kernel_choices.py``): with AVX512-BF16 alone, and with AMX too, where stop 15
    measured 0.55 against 0.85 ms per layer at 16 x 330 tokens in bf16 (oneDNN's AMX-backed
    SDPA on the gathered copy beat only an earlier kernel that made one serial dot per token)."""
    if device.type != "cpu":
        return GATHER_DECODE
    pays = dtype in (torch.float32, torch.bfloat16)
    kernel = paged_decode() if pays else None
    native = kernel is not None and head_dim in kernel.head_dims
    return NATIVE_DECODE if native else GATHER_DECODE


def decode_score_products(dtype: torch.dtype, block_size: int, head_dim: int) -> str:
    """What the native kernel computes bf16 decode scores with, for blocks of ``block_size``
    tokens and ``head_dim``-wide heads: ``"tiles"`` (one AMX tile product per block of 16
    tokens for all the query heads of a KV head), ``"pairs"`` (AVX512-BF16 pair products: the
    block's keys transposed once in registers into one vector per dim pair, then one product
    per dim pair and query head gives the 16 tokens' scores as one vector, and the softmax
    runs on vectors), or ``""`` (a dot product of widened keys and a horizontal sum per token
    and head). The first two need blocks of 16 and heads of 32-dim chunks; each rounds
    differently, so the choice is part of the cache identity's numerics."""
    kernel = paged_decode()
    if dtype != torch.bfloat16 or kernel is None:
        return ""
    return kernel.score_products(block_size, head_dim)


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
    """One query row per sequence, attended by the native kernel over the cache itself; the
    scratch-block padding of the tables is never read (the kernel stops at each length)."""
    num_seqs = len(group.rows)
    _, heads, head_dim = query.shape
    kv_heads = cache.keys[layer].shape[0]
    # Fold GQA as the gather path does: the query heads of KV head h are rows of one query.
    q = query[group.row_index].reshape(num_seqs, kv_heads, heads // kv_heads, head_dim)
    out = paged_decode().paged_decode_attention(
        q, cache.keys[layer], cache.values[layer], group.block_ids.view(num_seqs, -1),
        group.lengths, cache.block_size, scale)
    return out.view(num_seqs, heads, head_dim)


def paged_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                            value: torch.Tensor, attention_mask: torch.Tensor | None,
                            scaling: float | None = None, dropout: float = 0.0,
                            paged: AttentionMetadata | None = None,
                            **_: object) -> tuple[torch.Tensor, None]:
    """transformers attention function over the paged cache (the path for architectures
    without a compact implementation; ``workers.model_support`` refuses at load the features
    this function would otherwise drop).

    Args:
        module: the attention module (its ``layer_idx`` selects the cache layer).
        query: ``[1, num_heads, T, head_dim]``, RoPE applied.
        key, value: ``[1, num_kv_heads, T, head_dim]`` for the step's new tokens.
        attention_mask: ignored; which token sees which comes from ``paged``.
        scaling: softmax scale.
        paged: the step's metadata, passed through the model's forward kwargs.

    Returns:
        ``([1, T, num_heads, head_dim], None)``.

    Raises:
        ValueError: called without paged metadata (the model was run outside the engine).
    """
    if paged is None:
        raise ValueError("nalar_paged attention needs the engine's paged metadata")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = paged_attention(module.layer_idx, query[0].transpose(0, 1), key[0].transpose(0, 1),
                          value[0].transpose(0, 1), paged, scale)
    return out.unsqueeze(0), None


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
