"""LoRA adapters on one base model (Hu et al., 2021, "LoRA: Low-Rank Adaptation of Large
Language Models"), served batched: the base matmul runs once for every row of a step and each
row adds its own adapter's low-rank delta (the Punica / S-LoRA idea: Chen et al., 2023;
Sheng et al., 2023).

- :mod:`workers.lora.adapter`: reading a PEFT adapter directory, checking it against the base
  model, and the digest of its content that enters the cache identity.
- :mod:`workers.lora.errors`: the error of an adapter that cannot be served.
- :mod:`workers.lora.batch`: one step's rows grouped by adapter, and the deltas they add.
- :mod:`workers.lora.registry`: the adapters an engine holds, by name.
"""
