"""The cluster's configuration schema: one validated object from the CLI to every deployment."""

from __future__ import annotations

import math
import os
import secrets
from collections.abc import Iterable
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, SecretStr, field_validator, model_validator

from contract.identity import adapter_name_fault
from workers import devices
from workers.config import EngineConfig, MiB
from workers.host_cores import available_cores
from workers.model_source import served_name
from workers.speculative.config import SpeculativeConfig
from workers.step_time import AUTO

INDEX_ACTOR_NAMESPACE = "nalar"
"""Ray namespace of the embedded index actor, so the driver and Serve replicas find one actor."""


def default_num_workers() -> int:
    """One worker per visible CUDA device, else 2 (CPU workers)."""
    return devices.visible_gpu_count() or 2


def default_worker_gpus() -> float:
    """With CUDA visible each worker replica asks Ray for one GPU; on a CPU machine for none."""
    return 1.0 if devices.cuda_available() else 0.0


def workers_per_gpu(worker_gpus: float) -> int:
    """How many worker replicas asking for ``worker_gpus`` (a fraction) Ray places on one
    GPU: 2 at 0.5, 3 at 0.3, 1 at 0.6 or at one or more GPUs each."""
    return max(1, math.floor(1 / worker_gpus + 1e-9)) if worker_gpus > 0 else 1


def split_api_keys(values: str | Iterable[str]) -> list[str]:
    """API keys given as one comma-separated string or several (``--api-key a,b --api-key c``),
    as a list; blanks dropped."""
    values = [values] if isinstance(values, str) else values
    return [key.strip() for value in values for key in value.split(",") if key.strip()]


def _api_keys_from_env() -> list[SecretStr]:
    """``$NALAR_API_KEY`` (comma-separated), read where the configuration is built."""
    return [SecretStr(key) for key in split_api_keys(os.environ.get("NALAR_API_KEY", ""))]


class ClusterConfig(BaseModel):
    """Everything ``nalar serve`` can be told.

    Sizes are in tokens unless named ``*_bytes``/``*_mib``; times in seconds.

    Speculative decoding (``workers.speculative``): ``speculative`` is the proposer (``off``,
    ``ngram``, ``suffix``), ``num_speculative_tokens`` the most draft tokens verified per step,
    ``ngram_min``/``ngram_max`` the suffix lengths ``ngram`` matches, ``adaptive_speculation``
    lets each request's draft length follow measured acceptance and costs.
    ``speculative_remote`` moves ``ngram`` onto draft replicas (``suffix`` always runs there);
    ``draft_replicas`` of ``draft_cpus`` CPUs each; a draft call slower than
    ``draft_deadline_s`` gives no proposals for that step.

    GPUs: with CUDA visible, ``num_workers`` defaults to the visible devices and each worker
    replica asks Ray for ``worker_gpus`` (default 1) of them; ``cluster.runtime`` refuses to
    deploy more than the Ray cluster has (:class:`~cluster.runtime.NotEnoughGPUsError`).
    ``kv_cache_mib`` None sizes each worker's KV cache automatically (``workers.kv_budget``):
    512 MiB on a CPU; on CUDA what is left of ``gpu_memory_utilization`` of the device's memory
    after the weights and a step's activations. Workers sharing a GPU (``worker_gpus`` < 1)
    must fit their utilizations in one device. ``kv_tier_mib`` (0: off) gives each worker a
    second KV tier of that size (``workers.kv_tier``): host memory on a GPU worker, a file in
    ``kv_tier_dir`` on a CPU worker, or as ``kv_tier_medium`` says (``host``, ``disk``).

    Each worker computes on ``worker_threads`` threads (default: the cores shared evenly);
    with ``borrow_idle_cores`` a step of many prompt tokens also takes the cores of the host's
    workers that are idle then (``workers.host_cores``).

    ``worker_resources`` are Ray custom resources each worker replica asks for: giving every
    node one unit of a resource (``{"nalar_target": 1}``) places one worker per node.
    ``ingress_resources`` do the same for the ingress replica. A lost ingress cuts every
    stream it writes (no process is left to send an SSE error event), so on a cluster whose
    worker nodes come and go, pin it to a node whose loss is the cluster's anyway (the head).

    Steps: ``max_num_batched_tokens`` caps a step's tokens; ``step_time_target_ms`` caps,
    while sequences decode, the prompt tokens a step adds beside them by the step costs
    measured on the worker (``workers.step_time``), so a prompt's arrival holds the running
    streams for about that long rather than for its whole prefill; 0 turns it off. None, the
    default, chooses by the worker's weights (``workers.step_time.auto_target_s``): 250 ms on
    a CPU with dense weights, where it cost no throughput and halved the ITL tail under a
    burst; for weights kept as stored (the default Q4_1), where it cost 17-20% of the
    throughput applied to every prompt, 500 ms on the chunks of prompts longer than
    ``max_num_batched_tokens`` only, which halved the streams' ITL p99 beside a 6,000-token
    prompt (docs/performance.md, "A step-time target"). ``max_step_time_ms`` caps the
    same way the chunks of a prompt longer than ``max_num_batched_tokens``, with or without
    decodes, so a request that arrives while a long prompt is prefilled waits about that long
    for the step in progress rather than for a 2,048-token chunk (seconds on a CPU core); 0
    turns it off. None, the default, is 1,000 ms on a CPU and off on a GPU
    (``workers.step_time.auto_cap_s``; docs/performance.md, "A step-time cap").

    ``routing`` is the request-routing policy: ``prefix`` (longest cached prefix weighed
    against load, the default), ``round-robin`` or ``power-of-two`` (the less loaded of two
    random workers), the latter two as baselines to compare against.

    Overload and stops: the ingress admits a request only while the work it holds, in tokens
    (prompt tokens not yet prefilled plus every output token a request may still produce, the
    routing load unit), stays within ``pending_tokens_per_worker`` per worker replica
    (:meth:`max_pending_tokens`); beyond, it answers 503 with ``Retry-After`` at once, never
    queueing (``router.api.admission``). The default, 131,072, is 64 sequences
    (``max_num_seqs``' default) of 2,048 tokens each per worker. ``max_queue_delay_s`` bounds
    the same work in time: a request is refused while the work in flight would take longer
    than that to drain at the rate the ingress measures (none by default). On SIGTERM or Ctrl-C,
    ``nalar serve`` drains: new requests get 503, those in flight get up to
    ``drain_timeout_s`` to finish before they end with an error, then Serve stops.

    Authentication (``router.api.auth``): ``api_keys`` (default ``$NALAR_API_KEY``,
    comma-separated) are accepted for the server's life; ``api_keys_file`` names a file of keys
    (one per line, ``#`` comments) that the ingress reads and re-reads when it changes, so it
    must be readable where the ingress runs. With neither, the API is open. The keys are
    ``SecretStr``: a printed or logged configuration shows ``**********``.

    LoRA (``workers.lora``): ``lora_modules`` maps a ``model`` name to a PEFT adapter
    directory every worker loads at start (absolute paths: the workers do not share the CLI's
    working directory); ``max_lora_rank`` is the largest rank accepted, ``max_loras`` the most
    adapters resident on a worker (the least recently used idle one makes room for another),
    ``max_cpu_loras`` the most it holds counting those moved to host memory (None:
    ``max_loras``); one held nowhere is read again from its directory when a request needs it.
    ``admin_api_key`` (default ``$NALAR_ADMIN_API_KEY``) turns on ``POST /v1/load_lora_adapter``
    and ``/v1/unload_lora_adapter`` for that key only; they read adapters only from under
    ``lora_dirs``.

    Raises:
        pydantic.ValidationError: a field out of range, ``ngram_min > ngram_max``, workers
            sharing a GPU whose memory utilizations add up past 1, or an adapter named as the
            served model.
    """

    model: str = "embedded"
    served_model_name: str | None = None
    dtype: str = "auto"
    device: str | None = None
    quantization: Literal["auto", "none", "gguf", "int8"] = "auto"
    num_workers: int = Field(default_factory=default_num_workers, ge=1)
    redis_url: str | None = Field(default_factory=lambda: os.environ.get("REDIS_URL") or None)
    key_prefix: str = "nalar"
    index_actor_name: str = "nalar-digest-index"
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    block_size: int = Field(16, ge=1)
    kv_cache_mib: int | None = Field(None, ge=1)
    kv_tier_mib: int = Field(0, ge=0)
    kv_tier_medium: Literal["auto", "host", "disk"] = "auto"
    kv_tier_dir: str | None = None
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    max_num_seqs: int = Field(64, ge=1)
    max_num_batched_tokens: int = Field(2048, ge=1)
    max_num_partial_prefills: int = Field(1, ge=1)
    long_prefill_token_threshold: int | None = Field(None, ge=1)
    step_time_target_ms: float | None = Field(None, ge=0)
    max_step_time_ms: float | None = Field(None, ge=0)
    scheduling_policy: Literal["fcfs", "prefix"] = "fcfs"
    max_model_len: int | None = Field(None, ge=2)
    worker_cpus: float = Field(0.5, gt=0)
    worker_gpus: float = Field(default_factory=default_worker_gpus, ge=0)
    worker_threads: int | None = Field(None, ge=1)
    borrow_idle_cores: bool = True
    worker_resources: dict[str, float] = Field(default_factory=dict)
    ingress_resources: dict[str, float] = Field(default_factory=dict)
    worker_max_ongoing_requests: int = Field(128, ge=1)
    worker_max_queued_requests: int = Field(256, ge=1)
    pending_tokens_per_worker: int = Field(131_072, ge=1)
    max_queue_delay_s: float | None = Field(None, gt=0)
    drain_timeout_s: float = Field(30.0, gt=0)
    routing: Literal["prefix", "round-robin", "power-of-two"] = "prefix"
    routing_stats_period_s: float = Field(0.5, gt=0)
    worker_ttl_s: float = Field(30.0, gt=0)
    api_keys: list[SecretStr] = Field(default_factory=_api_keys_from_env)
    api_keys_file: str | None = None
    namespace_secret: str = Field(
        default_factory=lambda: os.environ.get("NALAR_NAMESPACE_SECRET") or secrets.token_hex(32))
    speculative: Literal["off", "ngram", "suffix", "model"] = "ngram"
    draft_model: str | None = None
    num_speculative_tokens: int = Field(4, ge=1, le=16)
    ngram_min: int = Field(1, ge=1)
    ngram_max: int = Field(4, ge=1)
    adaptive_speculation: bool = True
    speculative_remote: bool = False
    draft_replicas: int = Field(1, ge=1)
    draft_cpus: float = Field(0.1, gt=0)
    draft_deadline_s: float = Field(0.05, gt=0)
    lora_modules: dict[str, str] = Field(default_factory=dict)
    max_lora_rank: int = Field(64, ge=1)
    max_loras: int = Field(8, ge=1)
    max_cpu_loras: int | None = Field(None, ge=1)
    lora_dirs: list[str] = Field(default_factory=list)
    admin_api_key: SecretStr | None = Field(
        default_factory=lambda: SecretStr(os.environ["NALAR_ADMIN_API_KEY"])
        if os.environ.get("NALAR_ADMIN_API_KEY") else None)

    @field_validator("dtype")
    @classmethod
    def _known_dtype(cls, value: str) -> str:
        known = {"auto", "bfloat16", "bf16", "float16", "fp16", "float32", "fp32"}
        if value not in known:
            raise ValueError(f"dtype must be one of {sorted(known)}")
        return value

    @field_validator("api_keys", mode="before")
    @classmethod
    def _split_api_keys(cls, value: object) -> object:
        if isinstance(value, str) or (isinstance(value, list)
                                      and all(isinstance(key, str) for key in value)):
            return split_api_keys(value)
        return value

    @field_validator("api_keys_file")
    @classmethod
    def _absolute_keys_file(cls, value: str | None) -> str | None:
        # Absolute: the ingress replica does not share the CLI's working directory.
        return None if value is None else str(Path(value).expanduser().absolute())

    @field_validator("lora_modules", mode="before")
    @classmethod
    def _one_path_per_name(cls, value: object) -> object:
        """``--lora-modules`` gives ``(name, path)`` pairs: a name given twice is refused, as
        a second load of a loaded name is at run time (a dict would keep the last path)."""
        if not isinstance(value, list | tuple):
            return value
        names = [name for name, _ in value]
        twice = next((name for name in names if names.count(name) > 1), None)
        if twice is not None:
            raise ValueError(f"adapter name {twice!r} is given twice")
        return dict(value)

    @field_validator("lora_modules")
    @classmethod
    def _absolute_lora_paths(cls, value: dict[str, str]) -> dict[str, str]:
        return {name: str(Path(path).expanduser().absolute()) for name, path in value.items()}

    @field_validator("lora_dirs")
    @classmethod
    def _absolute_lora_dirs(cls, value: list[str]) -> list[str]:
        return [str(Path(path).expanduser().absolute()) for path in value]

    @model_validator(mode="after")
    def _adapter_names_are_names(self) -> ClusterConfig:
        taken = {self.model, self.served_model_name or served_name(self.model)} & set(
            self.lora_modules)
        if taken:
            raise ValueError(f"adapter name {taken.pop()!r} is the served model's name")
        for name in self.lora_modules:
            fault = adapter_name_fault(name)
            if fault is not None:
                raise ValueError(f"adapter name {name!r}: {fault}")
        return self

    @model_validator(mode="after")
    def _host_tier_holds_the_resident(self) -> ClusterConfig:
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"--max-cpu-loras {self.max_cpu_loras} is below --max-loras "
                             f"{self.max_loras}: it counts the resident adapters too")
        return self

    @model_validator(mode="after")
    def _valid_speculation(self) -> ClusterConfig:
        self.speculative_config()
        return self

    @model_validator(mode="after")
    def _shared_gpu_memory_fits(self) -> ClusterConfig:
        # Workers that share a GPU each size their KV cache to gpu_memory_utilization of it.
        sharing = workers_per_gpu(self.worker_gpus)
        if (self.worker_gpus > 0 and self.kv_cache_mib is None and sharing > 1
                and sharing * self.gpu_memory_utilization > 1 + 1e-9):
            fit = math.floor(100 * 0.9 / sharing) / 100
            raise ValueError(
                f"--gpus-per-worker {self.worker_gpus:g} puts {sharing} workers on a GPU, and "
                f"each may use gpu_memory_utilization {self.gpu_memory_utilization:g} of its "
                f"memory ({sharing * self.gpu_memory_utilization:g} of it in all): pass "
                f"--gpu-memory-utilization {fit:g} (or less), or a fixed --kv-memory-mib")
        return self

    def engine_config(self) -> EngineConfig:
        """The per-worker engine configuration."""
        return EngineConfig(
            model=self.model, dtype=self.dtype, device=self.device,
            quantization=self.quantization, block_size=self.block_size,
            kv_cache_bytes=None if self.kv_cache_mib is None else self.kv_cache_mib * MiB,
            kv_tier_bytes=self.kv_tier_mib * MiB, kv_tier_medium=self.kv_tier_medium,
            kv_tier_dir=self.kv_tier_dir,
            gpu_memory_utilization=self.gpu_memory_utilization, max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_partial_prefills=self.max_num_partial_prefills,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            step_time_target_s=_seconds_or_auto(self.step_time_target_ms),
            max_step_time_s=_seconds_or_auto(self.max_step_time_ms),
            scheduling_policy=self.scheduling_policy,
            max_model_len=self.max_model_len, num_threads=self.threads_per_worker(),
            borrow_idle_cores=self.borrow_idle_cores,
            speculative=self.speculative_config(), lora_modules=self.lora_modules,
            max_lora_rank=self.max_lora_rank, max_loras=self.max_loras,
            max_cpu_loras=self.max_cpu_loras, lora_dirs=self.lora_dirs)

    def speculative_config(self) -> SpeculativeConfig:
        """The workers' speculative decoding settings.

        ``suffix`` always runs on draft replicas (its index spans every worker's requests),
        and so does ``model`` (a draft model on its own replicas, as on its own GPUs);
        ``ngram`` runs inside each worker unless ``speculative_remote``.

        Raises:
            ValueError: an out-of-range combination (e.g. ``ngram_min > ngram_max``).
        """
        config = SpeculativeConfig(
            method=self.speculative, num_speculative_tokens=self.num_speculative_tokens,
            ngram_min=self.ngram_min, ngram_max=self.ngram_max,
            adaptive=self.adaptive_speculation,
            remote=self.speculative in ("suffix", "model") or self.speculative_remote,
            draft_replicas=self.draft_replicas, deadline_s=self.draft_deadline_s,
            draft_model=self.draft_model)
        config.validate()
        return config

    @property
    def draft_is_remote(self) -> bool:
        """Whether the application deploys draft replicas."""
        config = self.speculative_config()
        return config.enabled and config.remote

    def max_pending_tokens(self) -> int:
        """The ingress's bound on admitted, unfinished work: ``pending_tokens_per_worker``
        times the worker replicas, in tokens."""
        return self.pending_tokens_per_worker * self.num_workers

    def max_requests_in_flight(self) -> int:
        """The ingress's bound on requests in flight: what the workers' Serve queues hold,
        ``worker_max_ongoing_requests`` per worker replica plus the handle's
        ``worker_max_queued_requests`` (Serve bounds its queue per handle, and the ingress's
        is the one handle sending generations)."""
        return self.num_workers * self.worker_max_ongoing_requests + self.worker_max_queued_requests

    def threads_per_worker(self) -> int:
        """``worker_threads``, else this machine's cores shared evenly among the workers
        (:func:`~workers.host_cores.available_cores`: a container's CPU limit counts, not its
        node's cores).

        torch would otherwise give every worker all the cores: on 2 cores, 2 workers of 2
        OpenMP threads each ran a lone request at 14 output tokens/s through HTTP, against
        20 in process on 1 thread (docs/design-decisions.md).
        """
        return self.worker_threads or max(1, available_cores() // self.num_workers)


def _seconds_or_auto(milliseconds: float | None) -> float | str | None:
    """A step-time setting in the engine's terms: None (unset) is ``auto``, 0 is off."""
    return AUTO if milliseconds is None else milliseconds / 1000 or None
