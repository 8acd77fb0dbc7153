"""Helpers shared by the test modules: a free port, random prompts, greedy engine requests and
their output tokens, a private ``redis-server``.

Imported as ``helpers`` from any test module: ``tests/`` is not a package, and pytest (default
``prepend`` import mode) puts the directory of ``tests/conftest.py`` on ``sys.path``, as it does
``tests/workers`` for ``near_tie`` and ``tests/router`` for ``openai_fakes``.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterable, Iterator

import pytest
import redis

from contract.identity import CacheNamespace
from contract.request import GenerationChunk, GenerationRequest, SamplingParams
from workers.step_time import PromptCostModel, StepCostModel


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (bound, read, released)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def random_prompt(seed: int, length: int, vocab: int = 1000) -> list[int]:
    """``length`` token ids drawn uniformly from ``[3, vocab)`` by a torch generator seeded with
    ``seed`` (ids 0-2 are left out: special tokens in the test models)."""
    import torch  # here, not above: the conftest imports this module, and most tests need no torch

    return torch.randint(3, vocab, (length,),
                         generator=torch.Generator().manual_seed(seed)).tolist()


def greedy(request_id: str, prompt: list[int], max_tokens: int = 8, *, ignore_eos: bool,
           namespace: CacheNamespace | None = None, **sampling) -> GenerationRequest:
    """A greedy (temperature 0) request for ``prompt``.

    Args:
        request_id: the request's id.
        prompt: its prompt token ids.
        max_tokens: most tokens to generate.
        ignore_eos: keep generating past the model's EOS. No default: whether a request may
            stop early changes what a test compares, so each call says which it wants.
        namespace: its cache namespace; None for the default (anonymous tenant, no salt).
        **sampling: any other :class:`~contract.request.SamplingParams` field.
    """
    return GenerationRequest(
        request_id, prompt,
        SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos,
                       **sampling),
        namespace=CacheNamespace() if namespace is None else namespace)


def held_blocks(matched: dict) -> dict[str, int]:
    """An index ``match`` answer as ``{worker id: leading blocks held, in either medium}``."""
    return {worker: held.blocks for worker, held in matched.items()}


def output_ids(chunks: Iterable[GenerationChunk]) -> list[int]:
    """The output token ids of a request's chunks, in order."""
    return [token for chunk in chunks for token in chunk.token_ids]


def step_through_failures(engine, requests: list[GenerationRequest],
                          ) -> tuple[dict[str, list[GenerationChunk]], list]:
    """Steps ``engine`` until it has no work, past steps in which some rows failed: each
    request's chunks (those a ``StepFailedError`` carried included) and the errors, in order."""
    from workers.engine import StepFailedError  # here: most tests need no torch

    chunks: dict[str, list[GenerationChunk]] = {r.request_id: [] for r in requests}
    failures = []
    while engine.has_work():
        try:
            step = engine.step()
        except StepFailedError as error:
            failures.append(error)
            step = error.chunks
        for chunk in step:
            chunks[chunk.request_id].append(chunk)
    return chunks, failures


def count_calls(monkeypatch: pytest.MonkeyPatch, owner: object,
                names: Iterable[str]) -> dict[str, int]:
    """Wraps the methods ``names`` of ``owner`` (a class or module) for the test's duration;
    returns the live count of calls to each."""
    calls = dict.fromkeys(names, 0)
    for name in calls:
        original = getattr(owner, name)

        def counted(*args, _name=name, _original=original, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)
        monkeypatch.setattr(owner, name, counted)
    return calls


class PrivateRedis:
    """A ``redis-server`` without persistence on a free port, killed and restarted (empty) on
    that same port at will. For tests that must kill and restart Redis, or that find no shared
    one (never the shared one).

    Args:
        binary: path of the ``redis-server`` executable.
    """

    def __init__(self, binary: str) -> None:
        self.binary = binary
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        """Start it, empty, and wait up to 10 s for PING.

        Raises:
            RuntimeError: it did not answer within 10 s.
        """
        self.process = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis.from_url(self.url, socket_connect_timeout=0.5)
        try:
            deadline = time.monotonic() + 10.0
            while time.monotonic() < deadline and self.process.poll() is None:
                try:
                    if client.ping():
                        return
                except redis.ConnectionError:
                    time.sleep(0.05)
        finally:
            client.close()
        self.kill()
        raise RuntimeError(f"redis-server on port {self.port} did not answer PING in 10 s")

    def kill(self) -> None:
        """Kill it (nothing is saved) and wait until it is gone."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)

    def restart(self) -> None:
        """Kill it and start it again, empty, on the same port."""
        self.kill()
        self.start()


def private_redis_server() -> Iterator[PrivateRedis]:
    """Body of a fixture: a started :class:`PrivateRedis`, killed afterwards; skips the test
    when no ``redis-server`` binary is installed."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("no redis-server binary")
    server = PrivateRedis(binary)
    server.start()
    yield server
    server.kill()


CLUSTER_ADMIN_KEY = "nalar-test-admin"
"""The shared test cluster's ``--admin-api-key``; ``--lora-dir`` is its config's
``lora_dirs[0]``."""

CLUSTER_LORA_ADAPTERS = {"lora-a": 1, "lora-b": 2}
"""The LoRA adapters the shared test cluster loads at start, by name: their seeds
(:func:`write_lora_adapter`)."""

SMOLLM2_PROJECTIONS = {"self_attn.q_proj": (576, 576), "self_attn.k_proj": (576, 192),
                       "self_attn.v_proj": (576, 192), "self_attn.o_proj": (576, 576),
                       "mlp.gate_proj": (576, 1536), "mlp.up_proj": (576, 1536),
                       "mlp.down_proj": (1536, 576)}
"""SmolLM2-135M's projections, ``(in_features, out_features)``; it has 30 layers."""


def write_lora_adapter(directory, seed: int, rank: int = 8, alpha: float = 16.0,
                       projections: dict[str, tuple[int, int]] = SMOLLM2_PROJECTIONS,
                       num_layers: int = 30, std: float = 0.05):
    """A LoRA adapter in PEFT's layout (``adapter_config.json``, ``adapter_model.safetensors``)
    with seeded normal A and B (B non-zero, so it changes the output), written without peft
    so cluster tests need no second copy of the base model; returns ``directory``."""
    import json
    from pathlib import Path

    import torch
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(num_layers):
        for path, (in_features, out_features) in projections.items():
            prefix = f"base_model.model.model.layers.{layer}.{path}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(
                rank, in_features, generator=generator) * std
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(
                out_features, rank, generator=generator) * std
    save_file(tensors, directory / "adapter_model.safetensors")
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "use_rslora": False,
              "target_modules": sorted({path.rsplit(".", 1)[1] for path in projections}),
              "bias": "none", "task_type": "CAUSAL_LM"}
    (directory / "adapter_config.json").write_text(json.dumps(config))
    return directory


def serve(engine, request: GenerationRequest) -> tuple[list[int], int, int]:
    """Run one request alone; returns (output ids, its cached_tokens, prompt tokens prefilled)."""
    before = engine.counters.prefill_tokens
    chunks = engine.generate([request])[request.request_id]
    assert chunks[-1].finish_reason is not None
    assert len({c.cached_tokens for c in chunks}) == 1
    return output_ids(chunks), chunks[-1].cached_tokens, engine.counters.prefill_tokens - before


def cold(engine, request: GenerationRequest) -> list[int]:
    """The same request on an empty cache (the engine's cache is reset first)."""
    engine.reset_prefix_cache()
    out, cached, prefilled = serve(engine, request)
    assert (cached, prefilled) == (0, len(request.token_ids))
    return out


def fitted_decode_costs(base_s: float, per_row_s: float) -> StepCostModel:
    """A decode step-time model fitted exactly on steps of 1-8 rows costing
    ``base_s + per_row_s * rows`` seconds."""
    model = StepCostModel()
    for rows in [1, 4, 2, 8, 3, 6] * 5:
        model.observe(rows, base_s + per_row_s * rows)
    return model


def fitted_prompt_costs(per_token_s: float, per_key_s: float = 0.0) -> PromptCostModel:
    """A prompt-token cost model fitted exactly on 16-token chunks at depths 0-3,584 whose
    tokens cost ``per_token_s + per_key_s * depth`` seconds each."""
    model = PromptCostModel()
    for start in [0, 1024, 256, 3584, 512, 2048] * 2:
        seconds = sum(per_token_s + per_key_s * (start + i + 0.5) for i in range(16))
        model.observe([(start, 16)], seconds, 16)
    return model
