"""Attention over the paged KV cache.

A step flattens every scheduled sequence's new tokens into one batch of ``T`` rows (as vLLM
does), so projections and MLPs run once for all of them. Only attention needs to know which
rows belong to which sequence. Per layer it writes the new tokens' keys and values into their
cache slots, then:

- a *span* (a prompt or a prefill chunk: several new tokens of one sequence) attends
  causally to its own new tokens with torch's fused CPU/GPU flash kernel, and, when the
  sequence already has cached context, to that context in a second, unmasked flash call; the
  two partial results are merged by their log-sum-exp (the split-softmax merge of
  flash-decoding, Dao et al. 2023). No mask or score matrix is ever materialised, and a chunk
  over a long cached context costs what the same tokens cost unchunked. In bf16 on CPUs with
  AMX-BF16 or AVX512-BF16 a span is instead one call to our prefill kernel
  (:func:`~workers.attention.kernel_choice.prefill_kernel`), which reads the cached context
  where it lies.
- *decodes* (one new token each) attend to their sequences' blocks with GQA folded: the query
  heads that share a KV head become rows of one query, so K/V are never expanded per query
  head. On a CPU (fp32 and bf16) all of a step's decodes go to our native kernel
  (``workers.kernels``) in one call; it reads the blocks where they lie, each sequence to its
  own length. Otherwise (GPUs, other dtypes, no compiler) decodes are grouped by context length
  and each group's blocks are gathered into a padded copy for torch's attention
  (:func:`~workers.attention.kernel_choice.decode_kernel`).
- *verification blocks* (a decode token followed by ``k`` draft tokens, speculative decoding)
  take the decode path with ``k + 1`` query rows per sequence and a causal mask over the
  gathered context, so every speculating sequence of a step is verified in the same batched
  call as the plain decodes, and its context is gathered once, not once per query row.

The modules, one concept each: ``metadata`` (a step's slots, spans and decode groups, built
once per step), ``kernel_choice`` (which prefill and decode kernels a model takes),
``paged`` (the attention itself) and ``transformers_adapter`` (the same attention as a
transformers attention function). Two entry points share the attention:
:func:`~workers.attention.paged.paged_attention` for the compact models in
``workers.models``, and
:func:`~workers.attention.transformers_adapter.paged_attention_forward`, registered with
transformers' ``AttentionInterface`` for every other architecture when its module is imported
(``workers.model_runner`` imports it for the name it sets models to).
"""
