"""Step metadata: where a step's new tokens go in the paged cache and what each attends to.

:func:`build_metadata` runs once per step; every layer reads what it builds. A step's rows
split into spans (:class:`PrefillSpan`: a prompt or a prefill chunk, several new tokens of one
sequence, attended one span at a time) and short queries (a decode token, or a verification
block: a decode token and its draft tokens), batched into decode groups (:class:`DecodeGroup`)
by query rows and context length. Unless the caller says, the step's decode and prefill
kernels are chosen here, once per step, by ``workers.attention.kernel_choice``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from workers.attention.kernel_choice import (
    FLASH_PREFILL,
    NATIVE_DECODE,
    decode_kernel,
    prefill_kernel,
)
from workers.kv_cache import PagedKVCache

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
        lengths: ``[B]`` int64 tokens each sequence's last query row sees (its context); for
            a native group ``[B * q_len]``, the tokens each row sees.
        native: attended by the native kernel in place (the kernel chosen for this cache); it
            needs no ``mask`` or ``padding``, so they are None. With ``q_len > 1`` the rows of
            a sequence share its blocks' reads, each over its own length, and a verification
            row computes exactly what a plain decode of that position would.
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
                   native_prefill: bool | None = None,
                   prompt: list[bool] | None = None) -> AttentionMetadata:
    """Metadata for a step where sequence ``i`` already has ``num_computed[i]`` tokens cached
    and computes ``num_new[i]`` more, its rows following those of sequence ``i - 1``.

    ``verify[i]`` marks a verification block (a decode token and its draft tokens): its rows
    take the batched short-query path instead of the per-sequence span path, as does a single
    new token, unless ``prompt[i]`` marks it as a prompt's: a prompt's last token after a
    cache hit then attends as in a cold prefill of the whole prompt (the span path's result
    does not depend on where a span starts; the short-query path sums its keys in other
    blocks, which in bf16 moved SmolLM2's first-token logprob by 0.04 and changed a greedy
    answer). Work is
    proportional to the step's new tokens and block-table lengths, never to a sequence's whole
    context in slots.

    ``native_decode``: whether plain decodes take the native kernel; by default
    :func:`decode_kernel`'s choice for the cache, made here once per step rather than per
    layer. ``native_prefill``: whether spans take our bf16 prefill kernel; by default
    :func:`prefill_kernel`'s choice.
    """
    block_size = kv_cache.block_size
    verify = verify or [False] * len(num_new)
    prompt = prompt or [False] * len(num_new)
    slots: list[int] = []
    spans: list[PrefillSpan] = []
    short: list[_ShortQuery] = []
    row = 0
    for table, computed, new, is_verify, is_prompt in zip(
            block_tables, num_computed, num_new, verify, prompt, strict=True):
        slots.extend(table[pos // block_size] * block_size + pos % block_size
                     for pos in range(computed, computed + new))
        if is_verify or (new == 1 and not is_prompt):
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
    # The native kernel reads each sequence to its own length, so it needs no grouping by
    # length: one call per q_len (plain decodes, then verification blocks), in row order. The
    # gather path pads each group to its longest context, so it groups contexts of similar
    # length.
    if native_decode:
        by_q_len: dict[int, list[_ShortQuery]] = {}
        for query in short:
            by_q_len.setdefault(query.q_len, []).append(query)
        groups = [by_q_len[q_len] for q_len in sorted(by_q_len)]
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
                  native: bool) -> DecodeGroup:
    q_len = group[0].q_len
    # query row j of a sequence sees its first length - q_len + 1 + j tokens
    visible = [[query.length - q_len + 1 + j for j in range(q_len)] for query in group]
    blocks_per_row = max(len(query.table) for query in group)
    padded_len = blocks_per_row * kv_cache.block_size
    block_ids = []
    for query in group:
        pad = blocks_per_row - len(query.table)
        block_ids.extend(query.table + [kv_cache.scratch_block] * pad)
    mask = padding = None
    if not native and (q_len > 1 or any(query.length != padded_len for query in group)):
        mask = (torch.arange(padded_len) < torch.tensor(visible)[..., None])[:, None].to(device)
        padding = torch.tensor([i * padded_len + pos for i, query in enumerate(group)
                                for pos in range(query.length, padded_len)], device=device)
    row_list = [query.row + j for query in group for j in range(q_len)]
    rows = torch.tensor(row_list, device=device)
    consecutive = row_list == list(range(row_list[0], row_list[0] + len(row_list)))
    row_index = slice(row_list[0], row_list[0] + len(row_list)) if consecutive else rows
    lengths = torch.tensor([seen for row in visible for seen in (row if native else row[-1:])],
                           device=device)
    return DecodeGroup(rows, q_len, torch.tensor(block_ids, device=device), lengths, native,
                       mask, padding, row_index)

