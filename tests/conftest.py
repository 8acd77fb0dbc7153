"""Shared test fixtures.

Redis: tests never flush a shared Redis. Each test gets its own key prefix and deletes only the
keys under it. The server comes from ``$REDIS_URL``, else a local one on 6379, else a private
``redis-server`` started for the session; without any, Redis tests are skipped, unless
``NALAR_REQUIRE_REDIS=1`` makes that a failure (for CI, where a skip would hide a gap).

Ray: ``ray_session`` starts one small local Ray instance for the whole session, on demand.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from helpers import PrivateRedis

_LOCAL_REDIS = "redis://127.0.0.1:6379/0"
_ORDER = ("workers", "bench", "benchmarks", "k8s", "cluster/test_drain.py", "router", "cluster")
"""Tests without Ray first; then those that start Ray instances of their own (``k8s``, the drain
test), before the session's; then Ray's (``router`` starts it for the index actor), then the
Serve clusters. An idle cluster keeps about 0.4 of a core busy: the engine tests run after one
took 3x as long (torch's threads wait on each other for the stolen core), and a Ray instance of
its own starts slower beside one."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Orders the tests by the first entry of :data:`_ORDER` their path starts with, keeping
    the collection's order within each."""
    tests = os.path.dirname(__file__)

    def rank(item: pytest.Item) -> int:
        path = os.path.relpath(item.path, tests).replace(os.sep, "/")
        return next((i for i, start in enumerate(_ORDER) if path.startswith(start)),
                    len(_ORDER))

    items.sort(key=rank)


def _answers_ping(url: str) -> bool:
    client = redis.Redis.from_url(url, socket_connect_timeout=0.5, socket_timeout=0.5)
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False
    finally:
        client.close()


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """URL of a reachable Redis server (see the module docstring for where it comes from)."""
    if os.environ.get("REDIS_URL"):
        yield os.environ["REDIS_URL"]
        return
    if _answers_ping(_LOCAL_REDIS):
        yield _LOCAL_REDIS
        return
    binary = shutil.which("redis-server")
    if binary is None:
        reason = "no Redis: $REDIS_URL unset, nothing on 127.0.0.1:6379, no redis-server binary"
        if os.environ.get("NALAR_REQUIRE_REDIS") == "1":
            pytest.fail(f"{reason} (NALAR_REQUIRE_REDIS=1)")
        pytest.skip(reason)
    server = PrivateRedis(binary)
    server.start()
    try:
        yield server.url
    finally:
        server.kill()


@pytest.fixture
def redis_key_prefix(redis_url: str) -> Iterator[str]:
    """A key prefix unique to this test; afterwards deletes only the keys under it."""
    prefix = f"nalar-test-{uuid.uuid4().hex[:8]}"
    yield prefix
    from router.index.redis_index import delete_key_prefix

    delete_key_prefix(redis_url, prefix)  # the random prefix holds no glob characters


@pytest.fixture(scope="session")
def ray_session() -> Iterator[None]:
    """One small local Ray instance for the whole session, shared by every test that needs Ray
    (the cluster tests deploy their Serve application on it)."""
    from cluster.runtime import init_ray, stop_cluster  # slow imports: only when Ray is needed

    init_ray(num_cpus=2, log_to_driver=False)
    yield
    stop_cluster()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A 2-layer Llama with seeded random weights and SmolLM2's tokenizer, saved to disk, as a
    deployment loads a model: for the tests whose application needs a model but not SmolLM2.

    ``initializer_range`` 0.2 keeps greedy logits away from near-ties.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from workers.model_source import load_tokenizer

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
