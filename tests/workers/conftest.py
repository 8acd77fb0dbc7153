"""Fixtures for the engine tests: the embedded model, a tiny random Qwen2, and builders.

Models are loaded once per session and shared. The engine's runner swaps a model's attention
implementation for ``nalar_paged``; the Hugging Face references therefore run inside
:func:`reference_attention`, which switches the shared model back to ``sdpa`` for the duration
and restores whatever was set before (engines built earlier keep working).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from tiny_models import build_tiny_qwen2, reference_attention

from workers.config import EngineConfig
from workers.engine import LLMEngine
from workers.kv_cache import PagedKVCache
from workers.model_loader import LoadedModel, load_model, model_digest
from workers.model_source import load_tokenizer

BLOCK_SIZE = 16


@pytest.fixture(scope="session")
def smollm_tokenizer():
    """The embedded model's tokenizer (also serves the tiny model: its ids < 1000 decode)."""
    return load_tokenizer("embedded")


@pytest.fixture(scope="session")
def smollm() -> LoadedModel:
    """SmolLM2-135M-Instruct in fp32, loaded once per session."""
    return load_model("embedded", dtype="float32", device="cpu")


@pytest.fixture(scope="session")
def tiny_qwen(smollm_tokenizer) -> LoadedModel:
    """The tiny random Qwen2 in fp32."""
    model = build_tiny_qwen2(torch.float32)
    return LoadedModel(model, smollm_tokenizer, model_digest(model), "tiny-qwen2",
                       Path("tiny-qwen2"))


@pytest.fixture(scope="session")
def fresh_tiny_qwen() -> Callable[..., torch.nn.Module]:
    """Builds a new tiny Qwen2 (same seed, same weights) for a test that changes it."""
    return build_tiny_qwen2


@pytest.fixture(scope="session")
def tiny_qwen_bf16(smollm_tokenizer) -> LoadedModel:
    """The same tiny Qwen2 weights, loaded in bf16 (another numerics, so another identity)."""
    model = build_tiny_qwen2(torch.bfloat16)
    return LoadedModel(model, smollm_tokenizer, model_digest(model), "tiny-qwen2",
                       Path("tiny-qwen2"))


@pytest.fixture(scope="session")
def make_engine() -> Callable[..., LLMEngine]:
    """Build an engine over a loaded model with a KV pool of exactly ``num_blocks`` blocks."""

    def make(loaded: LoadedModel, num_blocks: int = 128, block_size: int = BLOCK_SIZE,
             proposer=None, **overrides) -> LLMEngine:
        per_block = PagedKVCache.bytes_per_block(loaded.model.config, block_size, loaded.dtype)
        config = EngineConfig(dtype=str(loaded.dtype).removeprefix("torch."), device="cpu",
                              block_size=block_size, kv_cache_bytes=num_blocks * per_block,
                              **overrides)
        engine = LLMEngine(config, loaded=loaded, proposer=proposer)
        assert engine.pool.num_blocks == num_blocks
        return engine

    return make


@pytest.fixture(scope="session")
def hf_greedy() -> Callable[..., list[list[int]]]:
    """Greedy continuations by transformers ``generate`` (batch of one, its own KV cache)."""

    def generate(loaded: LoadedModel, prompts: list[list[int]], max_new_tokens: int,
                 eos_token_ids: set[int]) -> list[list[int]]:
        model = loaded.model
        eos = sorted(eos_token_ids)
        outputs = []
        with reference_attention(model), torch.inference_mode():
            for prompt in prompts:
                ids = torch.tensor([prompt], device=model.device)
                out = model.generate(ids, attention_mask=torch.ones_like(ids),
                                     max_new_tokens=max_new_tokens, do_sample=False,
                                     eos_token_id=eos, pad_token_id=eos[0])
                outputs.append(out[0, len(prompt):].tolist())
        return outputs

    return generate
