"""The KV budget on a CPU and, through a fake device probe, on CUDA; the weights digest taken
before the model moves to its device."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from workers import devices, kv_budget
from workers import model_loader as loader
from workers.config import EngineConfig, MiB
from workers.kv_budget import (
    activation_reserve,
    device_kv_budget,
    max_logit_rows,
    plan_kv_budget,
)
from workers.kv_cache import PagedKVCache
from workers.speculative.config import SpeculativeConfig

GiB = 1 << 30


def on_cuda(model: torch.nn.Module) -> SimpleNamespace:
    """``model`` as :func:`plan_kv_budget` sees a model on ``cuda:0`` (the weights stay on the
    CPU: only their sizes are read)."""
    return SimpleNamespace(device=torch.device("cuda", 0), config=model.config,
                           dtype=model.dtype, parameters=model.parameters,
                           buffers=model.buffers)


def weights_bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


@pytest.fixture
def device_memory(monkeypatch):
    """Fakes the probe: ``device_memory(free, total)``; records the devices asked about."""
    asked: list[torch.device] = []

    def fake(free: int, total: int) -> list[torch.device]:
        def probe(device):
            asked.append(device)
            return free, total

        monkeypatch.setattr(devices, "device_memory", probe)
        return asked

    return fake


def test_an_explicit_budget_is_kept_anywhere(tiny_qwen, device_memory):
    asked = device_memory(0, 0)
    config = EngineConfig(kv_cache_bytes=3 * MiB)
    for model in (tiny_qwen.model, on_cuda(tiny_qwen.model)):
        budget = plan_kv_budget(config, model)
        assert (budget.bytes, budget.source) == (3 * MiB, "explicit")
    assert asked == []


def test_the_cpu_default_is_512_mib(tiny_qwen, device_memory):
    asked = device_memory(0, 0)
    budget = plan_kv_budget(EngineConfig(), tiny_qwen.model)
    assert (budget.bytes, budget.source) == (512 * MiB, "cpu-default")
    assert asked == []


def test_activation_reserve_of_the_tiny_qwen(tiny_qwen):
    # hidden 64, intermediate 128, 4 heads and 2 KV heads of 16 dims, vocabulary 1000, fp32
    per_token = 2 * 64 + (4 + 2 * 2) * 16 + 4 * 16 + 3 * 128
    expected = 2 * (2048 * per_token * 4 + 2 * 64 * 1000 * 4)
    assert activation_reserve(tiny_qwen.model.config, torch.float32, 2048, 64) == expected
    assert activation_reserve(tiny_qwen.model.config, torch.bfloat16, 2048, 64) == (
        2 * (2048 * per_token * 2 + 2 * 64 * 1000 * 4))


def test_logit_rows_count_verification_rows_and_stay_within_the_step():
    assert max_logit_rows(EngineConfig()) == 64
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=4)
    assert max_logit_rows(EngineConfig(speculative=spec)) == 64 * 5
    assert max_logit_rows(EngineConfig(speculative=spec, max_num_batched_tokens=100)) == 100


def test_on_cuda_the_budget_is_the_worker_share_less_weights_and_activations(
        tiny_qwen, device_memory, caplog):
    model = tiny_qwen.model
    total = 80 * GiB
    asked = device_memory(79 * GiB, total)
    config = EngineConfig(gpu_memory_utilization=0.9)
    weights = weights_bytes(model)
    reserve = activation_reserve(model.config, torch.float32, 2048, 64)
    with caplog.at_level(logging.INFO, logger="workers.kv_budget"):
        budget_bytes = kv_budget.kv_cache_budget(config, SimpleNamespace(model=on_cuda(model)))
    # 2 layers: 2/3 of what is left, 1/3 for decode's gather of one layer
    assert budget_bytes == (int(0.9 * total) - weights - reserve) * 2 // 3
    assert asked == [torch.device("cuda", 0)]
    line = caplog.records[-1].getMessage()
    assert "(device-memory)" in line and "0.9 x 80.00 GiB total" in line
    assert "2048 tokens, 64 logit rows" in line


def test_other_processes_holding_the_device_bound_the_budget_by_what_is_free(tiny_qwen):
    model = tiny_qwen.model
    config = EngineConfig(gpu_memory_utilization=0.9)
    reserve = activation_reserve(model.config, torch.float32, 2048, 64)
    budget = device_kv_budget(config, model.config, torch.float32, 1 * GiB, free=10 * GiB,
                              total=80 * GiB)
    assert budget.bytes == (10 * GiB - reserve) * 2 // 3


def test_workers_sharing_a_device_each_take_their_own_fraction(tiny_qwen):
    """Two workers at 0.45 of an 80 GiB device: the second, measuring after the first took
    its share, gets the same budget."""
    model = tiny_qwen.model
    config = EngineConfig(gpu_memory_utilization=0.45)
    first = device_kv_budget(config, model.config, torch.float32, 1 * GiB, free=78 * GiB,
                             total=80 * GiB)
    reserve = activation_reserve(model.config, torch.float32, 2048, 64)
    used_by_first = 1 * GiB + first.bytes + reserve
    second = device_kv_budget(config, model.config, torch.float32, 1 * GiB,
                              free=78 * GiB - used_by_first, total=80 * GiB)
    assert second.bytes == first.bytes == (int(0.45 * 80 * GiB) - 1 * GiB - reserve) * 2 // 3


def test_a_device_without_room_for_one_block_is_refused(tiny_qwen):
    model = tiny_qwen.model
    config = EngineConfig()
    reserve = activation_reserve(model.config, torch.float32, 2048, 64)
    block = PagedKVCache.bytes_per_block(model.config, 16, torch.float32)
    with pytest.raises(ValueError, match=r"less than one block of 16 tokens.*"
                                         r"--gpu-memory-utilization.*--kv-memory-mib"):
        device_kv_budget(config, model.config, torch.float32, 1 * GiB,
                         free=reserve + block, total=80 * GiB)  # 2/3 of a block is left
    fits = device_kv_budget(config, model.config, torch.float32, 1 * GiB,
                            free=reserve + 2 * block, total=80 * GiB)
    assert fits.bytes == 2 * block * 2 // 3 >= block
    with pytest.raises(ValueError, match="less than one block"):  # the weights fill the share
        device_kv_budget(config, model.config, torch.float32, 72 * GiB, free=8 * GiB,
                         total=80 * GiB)


def test_the_engine_takes_its_budget_from_the_sizing(tiny_qwen, make_engine, caplog):
    with caplog.at_level(logging.INFO, logger="workers.kv_budget"):
        engine = make_engine(tiny_qwen, num_blocks=32)
    assert engine.pool.num_blocks == 32
    assert "(explicit)" in caplog.text


def test_the_model_draft_gets_a_quarter_of_512_mib_when_the_target_sizes_automatically(
        monkeypatch, tiny_qwen):
    from workers.speculative import draft_model

    built = []
    monkeypatch.setattr(draft_model, "load_model", lambda *args: tiny_qwen)
    monkeypatch.setattr(draft_model.DraftModelProposer, "for_target",
                        classmethod(lambda cls, draft, target, config: built.append(config)))
    spec = SpeculativeConfig(method="model", draft_model="tiny-draft")
    for target_bytes, draft_bytes in ((None, 128 * MiB), (64 * MiB, 16 * MiB)):
        draft_model.DraftModelProposer.load(spec, tiny_qwen,
                                            EngineConfig(kv_cache_bytes=target_bytes))
        assert built[-1].kv_cache_bytes == draft_bytes


def test_load_model_hashes_the_weights_before_moving_them(tmp_path, monkeypatch, tiny_qwen,
                                                          smollm_tokenizer):
    """The digest is taken on the host, before ``.to(device)``, and is the one the loaded
    weights give."""
    directory = Path(tmp_path) / "tiny"
    tiny_qwen.model.save_pretrained(directory)
    smollm_tokenizer.save_pretrained(directory)
    events: list[str] = []
    digest, move = loader.model_digest, torch.nn.Module.to

    def recording_digest(model):
        events.append(f"digest on {next(model.parameters()).device.type}")
        return digest(model)

    def recording_move(module, *args, **kwargs):
        events.append("to")
        return move(module, *args, **kwargs)

    monkeypatch.setattr(loader, "model_digest", recording_digest)
    monkeypatch.setattr(torch.nn.Module, "to", recording_move)
    loaded = loader.load_model(str(directory), dtype="float32", device="cpu")
    monkeypatch.undo()
    assert events[:2] == ["digest on cpu", "to"]
    assert loaded.model_digest == loader.model_digest(loaded.model)  # what hashing after gives
