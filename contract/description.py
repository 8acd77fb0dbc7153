"""What a worker replica tells the rest of the cluster about itself (its ``describe()``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from contract.identity import AdapterRef, CacheIdentity


@dataclass(frozen=True)
class WorkerDescription:
    """A worker's answer to ``describe()``: what the ingress needs to tokenize and hash exactly
    as the worker does, and facts for tests and start-up logs.

    Attributes:
        worker_id: the replica's id (Ray Serve gives a replacement a new one).
        node_id: the Ray node it runs on.
        identity: its cache identity, in the anonymous namespace.
        served_name: the model name the API reports unless ``--served-model-name`` is given.
        source_path: the directory its weights and tokenizer were loaded from.
        max_model_len: context length in tokens (prompt plus output).
        vocab_size: token ids a prompt may use.
        num_blocks: KV blocks in its pool.
        startup_s: seconds its start took (model load, KV allocation).
        adapters: the LoRA adapters it holds, by name.
    """

    worker_id: str
    node_id: str
    identity: CacheIdentity
    served_name: str
    source_path: str
    max_model_len: int
    vocab_size: int
    num_blocks: int
    startup_s: float
    adapters: dict[str, AdapterRef] = field(default_factory=dict)
