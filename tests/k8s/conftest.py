"""Fixtures for the deployment tests: a tiny model saved to disk, as a deployment loads it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from workers.model_loader import load_tokenizer


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A 2-layer Llama with seeded random weights and SmolLM2's tokenizer, saved to disk.

    ``initializer_range`` 0.2 keeps greedy logits away from near-ties.
    """
    path = tmp_path_factory.mktemp("tiny-llama")
    tokenizer = load_tokenizer("embedded")
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, initializer_range=0.2,
                         tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
