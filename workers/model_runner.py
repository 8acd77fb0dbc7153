"""Runs one engine step's forward pass over the paged KV cache.

The transformers model definition is reused as is; only its attention is swapped for
``workers.paged_attention`` (through ``AttentionInterface``), and only the rows that are sampled
go through the LM head (``logits_to_keep``), so a 1,024-token prefill pays for one row of
vocabulary logits, not 1,024.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from workers.kv_cache import PagedKVCache
from workers.paged_attention import ATTN_IMPLEMENTATION, build_metadata
from workers.scheduler import ScheduledBatch


class ModelRunner:
    """Owns the model in its serving form and the KV tensors.

    Args:
        model: a transformers causal LM (any architecture whose attention goes through
            ``ALL_ATTENTION_FUNCTIONS``, e.g. Llama, Qwen2, Mistral).
        kv_cache: the preallocated paged KV tensors.
    """

    def __init__(self, model: PreTrainedModel, kv_cache: PagedKVCache):
        self.model = model
        self.kv_cache = kv_cache
        self.device = model.device
        model.set_attn_implementation(ATTN_IMPLEMENTATION)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, sample_rows: list[int]) -> torch.Tensor:
        """Compute the KV of every scheduled token and the logits of ``sample_rows``.

        Args:
            batch: sequence ``i`` computes its tokens
                ``[num_computed_tokens, num_computed_tokens + num_new_tokens[i])``.
            sample_rows: indices into ``batch.seqs`` whose last new token gets logits.

        Returns:
            ``[len(sample_rows), vocab_size]`` float32 logits.
        """
        input_ids, positions, sample_index = [], [], []
        sampled = set(sample_rows)
        offset = 0
        for i, (seq, num_new) in enumerate(zip(batch.seqs, batch.num_new_tokens, strict=True)):
            start = seq.num_computed_tokens
            input_ids.extend(seq.token_ids[start:start + num_new])
            positions.extend(range(start, start + num_new))
            offset += num_new
            if i in sampled:
                sample_index.append(offset - 1)
        metadata = build_metadata(
            self.kv_cache, [seq.block_table for seq in batch.seqs],
            [seq.num_computed_tokens for seq in batch.seqs], batch.num_new_tokens, self.device)
        output = self.model(
            input_ids=torch.tensor([input_ids], device=self.device),
            position_ids=torch.tensor([positions], device=self.device),
            use_cache=False,
            # int64 even when empty: a step that only runs a middle prefill chunk samples nothing.
            logits_to_keep=torch.tensor(sample_index, dtype=torch.long, device=self.device),
            paged=metadata,
        )
        return output.logits[0].float()
