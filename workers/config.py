"""Engine configuration."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from workers.speculative.config import SpeculativeConfig

MiB = 1 << 20


@dataclass
class EngineConfig:
    """How one worker's engine is built.

    Attributes:
        model: ``embedded``, a ``.gguf`` path, a model directory or a cached hub id.
        dtype: ``auto`` (bf16 where the hardware has it natively, else fp32), or a dtype name.
        device: ``cuda``/``cpu``, None for CUDA when available.
        quantization: how weights are held: ``none`` (dense in ``dtype``), ``gguf`` (a GGUF
            file's Q8_0/Q4_0/Q4_1 tensors as stored), ``int8`` (per-channel weight-only) or
            ``auto`` (``gguf`` for a GGUF model). ``none`` here; ``nalar serve`` defaults to
            ``auto``.
        block_size: tokens per KV block.
        kv_cache_bytes: memory budget for the KV tensors, in bytes; None sizes it
            automatically (``workers.kv_budget``): 512 MiB on a CPU, from the device's free
            memory on CUDA.
        kv_tier_bytes: size of the second KV tier, in bytes: a file on local disk that blocks
            evicted from the KV cache move to (``workers.kv_tier``); 0 (the default) turns it
            off.
        kv_tier_medium: where the second tier keeps blocks: ``host`` (memory, page-locked on
            CUDA), ``disk`` (a file) or ``auto`` (the default: host memory on a GPU worker, a
            file on a CPU worker).
        kv_tier_dir: where the second tier's file is made; None: the system's temporary
            directory.
        gpu_memory_utilization: on CUDA with an automatic KV budget, the fraction of the
            device's total memory this worker may use in all (weights, KV cache, a step's
            activations), as vLLM's option of that name.
        max_num_seqs: most sequences running at once.
        max_num_batched_tokens: most tokens computed in one step (prefill chunks + decodes).
        max_num_partial_prefills: most prompts being prefilled in chunks at once (vLLM).
        long_prefill_token_threshold: most tokens a prompt being chunked computes per step
            while other requests wait (vLLM v1); None means half of max_num_batched_tokens.
        step_time_target_s: while sequences decode, a step takes prompt tokens only up to
            this many seconds in all, by the step costs measured as it runs
            (``workers.step_time``); the decodes themselves are never cut. None (the default
            in the engine) applies only ``max_num_batched_tokens``; ``auto`` (the server's
            default) chooses by the weights and device (``workers.step_time.auto_target_s``).
        max_step_time_s: the longest a step with chunks of a prompt longer than
            ``max_num_batched_tokens`` may take, in seconds, by the same measured costs
            (``workers.scheduler``): a request that arrives while a long prompt is prefilled
            waits about this long for the step in progress. None (the default in the engine)
            is no cap; ``auto`` (the server's default) is 1 s on a CPU and no cap on a GPU
            (``workers.step_time.auto_cap_s``).
        scheduling_policy: ``fcfs``, or ``prefix`` (longest cached prefix first, with aging);
            see ``workers.scheduler``.
        max_model_len: longest prompt + output in tokens; None uses the model's limit (always
            capped by what the KV budget holds, so a lone request can always finish).
        num_threads: torch CPU threads; None leaves torch's default.
        borrow_idle_cores: on a CPU with ``num_threads`` set, a step of many prompt tokens
            also computes on the cores of the host's workers that are idle then
            (``workers.host_cores``). Off in the engine; ``nalar serve`` turns it on.
        seed: seeds the generator of unseeded sampled requests; None (the default) seeds it
            from OS entropy, so unseeded requests differ across workers and restarts. Set
            it only for reproducible tests.
        speculative: speculative decoding (off by default in the engine; ``nalar serve``
            turns on ``ngram``).
        lora_modules: LoRA adapters to load at start, name → PEFT adapter directory
            (``workers.lora``); requests select one by name.
        max_lora_rank: largest adapter rank accepted.
        max_loras: most adapters resident at once, where steps use them
            (``workers.lora.registry``).
        max_cpu_loras: most adapters held counting the host tier; None: ``max_loras`` (no
            host tier). Adapters held nowhere are read again from their directory when a
            request needs them.
        lora_dirs: directories adapters loaded at run time (through the API, or named by a
            request's source) may be read from; empty allows none.
    """

    model: str = "embedded"
    dtype: str = "auto"
    device: str | None = None
    quantization: str = "none"
    block_size: int = 16
    kv_cache_bytes: int | None = None
    kv_tier_bytes: int = 0
    kv_tier_medium: Literal["auto", "host", "disk"] = "auto"
    kv_tier_dir: str | None = None
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_num_partial_prefills: int = 1
    long_prefill_token_threshold: int | None = None
    step_time_target_s: float | Literal["auto"] | None = None
    max_step_time_s: float | Literal["auto"] | None = None
    scheduling_policy: str = "fcfs"
    max_model_len: int | None = None
    num_threads: int | None = None
    borrow_idle_cores: bool = False
    seed: int | None = None
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    lora_modules: dict[str, str] = field(default_factory=dict)
    max_lora_rank: int = 64
    max_loras: int = 8
    max_cpu_loras: int | None = None
    lora_dirs: list[str] = field(default_factory=list)

    def tier_medium(self, device_type: str) -> str:
        """Where the second tier keeps blocks on a worker whose KV cache is on a
        ``device_type`` (``cpu``, ``cuda``) device: ``kv_tier_medium`` as asked, or for
        ``auto`` host memory beside a GPU's KV cache and a file on disk beside a CPU's (whose
        KV cache already is host memory)."""
        if self.kv_tier_medium != "auto":
            return self.kv_tier_medium
        return "host" if device_type == "cuda" else "disk"
