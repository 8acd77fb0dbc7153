"""Two Nalar applications for the whole test session: the cluster (two SmolLM2 workers, the
real Redis index, HTTP) and, beside it, the side application over the tiny model, for the tests
that need a deployment of their own but not a realistic model. Each application's start costs
several seconds of the suite (its workers import torch and load a model), so the side
application serves three test files."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

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
    under a prefix of this run only. The session's Ray has 2 CPUs to schedule by: this
    application asks for 0.6 of them, the side application 0.35, and those of single test
    files (the chaos test's, 0.7) must fit beside both."""
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
                           worker_cpus=0.25, worker_threads=1, routing_stats_period_s=0.2,
                           worker_ttl_s=10,
                           lora_modules=lora_modules, lora_dirs=[str(runtime)],
                           admin_api_key=CLUSTER_ADMIN_KEY)
    start_cluster(config)
    yield ClusterUnderTest(config, f"http://127.0.0.1:{config.port}")
    serve.delete(APP_NAME)
    delete_key_prefix(redis_url, prefix)


@dataclass
class SideApplication:
    """The side application, as :func:`side_app` deployed it.

    Attributes:
        name: its Serve application name.
        config: its configuration.
        base_url: its HTTP root: the session cluster's proxy, under its route prefix.
        fixed_key: the API key given in its configuration.
        file_key: the API key its keys file held at the start.
        keys_file: the file it re-reads keys from.
    """

    name: str
    config: ClusterConfig
    base_url: str
    fixed_key: str
    file_key: str
    keys_file: Path


@pytest.fixture(scope="session")
def side_app(cluster: ClusterUnderTest, tiny_model_dir: Path,
             tmp_path_factory) -> Iterator[SideApplication]:
    """The side application: two tiny fp32 workers on the embedded index (no Redis), drafting
    through one ngram draft replica (n-grams of 1 to 3 tokens, a fixed draft length), behind
    API keys (one fixed, one in a keys file the tests may rewrite), served under ``/side`` by
    the session cluster's HTTP proxy."""
    from ray import serve

    from cluster.app import build_app
    from cluster.runtime import start_index_actor

    name, route, fixed_key, file_key = "nalar-side", "/side", "sk-side-7f3a", "sk-side-91c2"
    keys_file = tmp_path_factory.mktemp("side-keys") / "api-keys"
    keys_file.write_text(f"# side application\n{file_key}\n")
    config = ClusterConfig(model=str(tiny_model_dir), num_workers=2, redis_url=None,
                           dtype="float32", kv_cache_mib=32, worker_cpus=0.1, worker_threads=1,
                           routing_stats_period_s=0.2, index_actor_name=f"{name}-index",
                           speculative="ngram", speculative_remote=True, ngram_min=1,
                           ngram_max=3, draft_cpus=0.05, draft_deadline_s=2.0,
                           adaptive_speculation=False, api_keys=[fixed_key],
                           api_keys_file=str(keys_file))
    start_index_actor(config)
    serve.run(build_app(config), name=name, route_prefix=route)
    yield SideApplication(name, config, f"{cluster.base_url}{route}", fixed_key, file_key,
                          keys_file)
    serve.delete(name)
