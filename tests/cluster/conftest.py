"""One Nalar cluster for the whole test session: two workers, the real Redis index, HTTP."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from helpers import CLUSTER_ADMIN_KEY, CLUSTER_LORA_ADAPTERS, free_port, write_lora_adapter

from cluster.config import ClusterConfig
from router.index.redis_index import delete_key_prefix


@dataclass
class ClusterUnderTest:
    config: ClusterConfig
    base_url: str


@pytest.fixture(scope="session")
def cluster(ray_session, redis_url: str, tmp_path_factory) -> Iterator[ClusterUnderTest]:
    """Deploys the application once, with the ``CLUSTER_LORA_ADAPTERS``; its Redis keys live
    under a prefix of this run only."""
    from ray import serve

    from cluster.app import APP_NAME
    from cluster.runtime import start_cluster

    prefix = f"nalar-test-{uuid.uuid4().hex[:8]}"
    adapters = tmp_path_factory.mktemp("adapters")
    lora_modules = {name: str(write_lora_adapter(adapters / name, seed))
                    for name, seed in CLUSTER_LORA_ADAPTERS.items()}
    runtime = tmp_path_factory.mktemp("runtime-adapters")  # what the admin key may load
    config = ClusterConfig(num_workers=2, redis_url=redis_url, key_prefix=prefix,
                           port=free_port(), dtype="float32", quantization="none", kv_cache_mib=128,
                           kv_tier_mib=64, kv_tier_dir=str(tmp_path_factory.mktemp("kv-tier")),
                           worker_threads=1, routing_stats_period_s=0.2, worker_ttl_s=10,
                           lora_modules=lora_modules, lora_dirs=[str(runtime)],
                           admin_api_key=CLUSTER_ADMIN_KEY)
    start_cluster(config)
    yield ClusterUnderTest(config, f"http://127.0.0.1:{config.port}")
    serve.delete(APP_NAME)
    delete_key_prefix(redis_url, prefix)
