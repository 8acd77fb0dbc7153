"""The Llama-style decoder (Llama, SmolLM2, Mistral, Qwen2, Qwen3) over the paged KV cache.

Compared with running transformers' modules with our attention plugged in, this removes the
per-layer module dispatch and reshapes, fuses the q/k/v projections into one matmul and the
gate/up projections into another (4 instead of 7 matmuls per layer, as vLLM and nano-vllm do),
and runs each norm and each RoPE in one native call (``workers.models.norm``,
``workers.models.rotary``). The fused weights are built once; the transformers modules'
weights become views into them, so the model is held in memory once and the transformers
model keeps working (tests run it as the reference).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PreTrainedModel

from workers.attention.metadata import AttentionMetadata
from workers.attention.paged import attend_stored
from workers.lora.batch import LoraBatch
from workers.models.gated import GatedActivation
from workers.models.linear import Linear, StoredLinear, packs_small_batches
from workers.models.norm import NATIVE_NORM, RMSNorm, norm_kernel
from workers.models.rotary import rotate_and_store
from workers.models.weight_formats import StoredWeight


def _fuse(linears: list[nn.Linear], small_batches: bool) -> Linear | StoredLinear:
    """One linear layer computing ``linears``' outputs side by side; each of them has its
    weight (and bias) re-pointed at its slice of the fused tensors. Stored weights of one
    format fuse as stored; a mix of formats is dequantized into one plain weight.
    ``small_batches``: as :class:`Linear` takes it."""
    has_bias = linears[0].bias is not None
    bias = torch.cat([linear.bias.data for linear in linears]) if has_bias else None
    stored = [getattr(linear, "stored_weight", None) for linear in linears]
    if all(stored) and len({(w.fmt, w.in_features) for w in stored}) == 1:
        return StoredLinear(StoredWeight.concat(stored), bias)
    for linear, weight in zip(linears, stored, strict=True):
        if weight is not None:  # mixed formats: back to the plain path for this group
            linear.weight.data = weight.dequantize(dtype=linear.weight.dtype)
            linear.stored_weight = None
    weight = torch.cat([linear.weight.data for linear in linears])
    start = 0
    for linear in linears:
        end = start + linear.out_features
        linear.weight.data = weight[start:end]
        if has_bias:
            linear.bias.data = bias[start:end]
        start = end
    return Linear(weight, bias, small_batches)


class _Layer:
    """One decoder layer: pre-norm attention and pre-norm gated MLP, each with a residual."""

    def __init__(self, layer: nn.Module, index: int, native_norm: bool, small_batches: bool):
        attn, mlp = layer.self_attn, layer.mlp
        self.index = index
        self.input_norm = RMSNorm(layer.input_layernorm, native_norm)
        self.post_attention_norm = RMSNorm(layer.post_attention_layernorm, native_norm)
        self.num_heads = attn.q_proj.out_features // attn.head_dim
        self.num_kv_heads = attn.k_proj.out_features // attn.head_dim
        self.scale = attn.scaling
        self.qkv_proj = _fuse([attn.q_proj, attn.k_proj, attn.v_proj], small_batches)
        q_norm = getattr(attn, "q_norm", None)  # Qwen3: RMSNorm over each head
        self.head_norms = None if q_norm is None else (q_norm, attn.k_norm)
        self.o_proj = Linear.of(attn.o_proj, small_batches)
        self.gate_up_proj = _fuse([mlp.gate_proj, mlp.up_proj], small_batches)
        self.act = GatedActivation(mlp.act_fn, layer.input_layernorm.weight)
        self.down_proj = Linear.of(mlp.down_proj, small_batches)

    def __call__(self, hidden: torch.Tensor, normed: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, metadata: AttentionMetadata, lora: LoraBatch | None,
                 next_norm: RMSNorm | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``hidden`` ``[T, H]`` the residual stream and ``normed`` its input norm -> the
        stream after this layer and ``next_norm`` of it (None where ``next_norm`` is None).
        Each residual add is fused into the norm that follows it."""
        attention = self._attention(normed, cos, sin, metadata, lora)
        hidden, normed = self.post_attention_norm.add_then_norm(attention, hidden)
        out = self._mlp(normed, lora)
        if next_norm is None:
            return hidden + out, None
        return next_norm.add_then_norm(out, hidden)

    def _project(self, linear: Linear | StoredLinear, x: torch.Tensor, lora: LoraBatch | None,
                 projection: str) -> torch.Tensor:
        out = linear(x)
        if lora is not None:
            lora.add(out, x, self.index, projection)
        return out

    def _attention(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   metadata: AttentionMetadata, lora: LoraBatch | None) -> torch.Tensor:
        qkv = self._project(self.qkv_proj, x, lora, "qkv")
        q, k, v = rotate_and_store(qkv, cos, sin, self.num_heads, self.num_kv_heads,
                                   metadata.kv_cache, self.index, metadata.slot_mapping,
                                   self.head_norms)
        out = attend_stored(self.index, q, k, v, metadata, self.scale)
        return self._project(self.o_proj, out.view(x.shape[0], -1), lora, "o")

    def _mlp(self, x: torch.Tensor, lora: LoraBatch | None) -> torch.Tensor:
        gated = self.act(self._project(self.gate_up_proj, x, lora, "gate_up"))
        return self._project(self.down_proj, gated, lora, "down")


def _embedding(embed: nn.Embedding):
    """The token embedding: the module itself, or a lookup that dequantizes only the rows it
    needs from a stored table (cast to the model's activation dtype)."""
    stored = getattr(embed, "stored_weight", None)
    if stored is None:
        return embed
    dtype = embed.weight.dtype
    return lambda ids: stored.dequantize(ids, dtype)


class LlamaStyleDecoder:
    """A Llama-family causal LM run over one flat batch of rows.

    Args:
        model: a transformers ``*ForCausalLM`` of a Llama-style architecture (its modules and
            weights are reused; its q/k/v and gate/up weights become views of fused tensors).
    """

    def __init__(self, model: PreTrainedModel):
        inner = model.model
        self.norm_kernel = norm_kernel(model.dtype, model.device)
        native = self.norm_kernel == NATIVE_NORM
        self.embed = _embedding(inner.embed_tokens)
        self.rotary = inner.rotary_emb
        self.norm = RMSNorm(inner.norm, native)
        small_batches = packs_small_batches(model)
        self.lm_head = Linear.of(model.lm_head, small_batches)
        self.layers = [_Layer(layer, i, native, small_batches)
                       for i, layer in enumerate(inner.layers)]
        self._next_norms = [layer.input_norm for layer in self.layers[1:]] + [None]

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 metadata: AttentionMetadata, sample_index: torch.Tensor,
                 lora: LoraBatch | None = None) -> torch.Tensor:
        """Compute the KV of every row and the logits of the rows in ``sample_index``.

        Args:
            input_ids: ``[T]`` token ids of the step's rows.
            positions: ``[T]`` their positions in their sequences.
            metadata: where each row's KV goes and what it attends to.
            sample_index: ``[S]`` rows whose next-token logits are wanted.
            lora: the LoRA adapters of the step's rows (None: every row is the base model's).

        Returns:
            ``[S, vocab_size]`` float32 logits.
        """
        hidden = self.embed(input_ids)
        cos, sin = self.rotary(hidden, positions.unsqueeze(0))
        cos, sin = cos[0], sin[0]  # [T, head_dim]
        normed = self.layers[0].input_norm(hidden)
        for layer, next_norm in zip(self.layers, self._next_norms, strict=True):
            hidden, normed = layer(hidden, normed, cos, sin, metadata, lora, next_norm)
        # The final norm is per row: normalising only the sampled rows gives the same values.
        return self.lm_head(self.norm(hidden[sample_index])).float()
