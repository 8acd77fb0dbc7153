"""The cluster configuration's derived settings."""

from __future__ import annotations

import pytest

import cluster.config
from cluster.config import ClusterConfig


@pytest.mark.parametrize(("workers", "expected"), [(1, 8), (2, 4), (3, 2), (16, 1)])
def test_workers_share_the_cores_by_default(monkeypatch, workers, expected):
    monkeypatch.setattr(cluster.config, "available_cores", lambda: 8)
    config = ClusterConfig(num_workers=workers, namespace_secret="s")
    assert config.engine_config().num_threads == expected


def test_worker_threads_overrides_the_share(monkeypatch):
    monkeypatch.setattr(cluster.config, "available_cores", lambda: 8)
    config = ClusterConfig(num_workers=2, worker_threads=3, namespace_secret="s")
    assert config.engine_config().num_threads == 3


def test_quantization_reaches_the_engine_and_defaults_to_auto():
    """``auto`` lets the loader serve a GGUF model's weights as stored (on a CPU); the flag's
    other values pass through, and a name outside them is refused before anything starts."""
    assert ClusterConfig(namespace_secret="s").engine_config().quantization == "auto"
    config = ClusterConfig(quantization="int8", namespace_secret="s")
    assert config.engine_config().quantization == "int8"
    with pytest.raises(ValueError, match="quantization"):
        ClusterConfig(quantization="q3_k", namespace_secret="s")


def test_the_second_kv_tier_is_off_by_default_and_sized_in_mib():
    engine = ClusterConfig(namespace_secret="s").engine_config()
    assert (engine.kv_tier_bytes, engine.kv_tier_dir) == (0, None)
    engine = ClusterConfig(kv_tier_mib=64, kv_tier_dir="/var/tmp",
                           namespace_secret="s").engine_config()
    assert (engine.kv_tier_bytes, engine.kv_tier_dir) == (64 << 20, "/var/tmp")
    assert engine.kv_tier_medium == "auto"
    with pytest.raises(ValueError, match="kv_tier_mib"):
        ClusterConfig(kv_tier_mib=-1, namespace_secret="s")
    with pytest.raises(ValueError, match="kv_tier_medium"):
        ClusterConfig(kv_tier_medium="tape", namespace_secret="s")


@pytest.mark.parametrize(("workers", "ongoing", "queued", "expected"), [
    (2, 128, 256, 2 * 128 + 256),  # the defaults
    (3, 8, 4, 3 * 8 + 4),
])
def test_the_ingress_admits_what_the_workers_serve_queues_hold(workers, ongoing, queued,
                                                               expected):
    """Serve bounds a replica's ongoing requests and the (one) handle's queue: the ingress's
    request bound is their sum, so a request those queues cannot hold is refused before it is
    tokenized (Serve may still refuse first while its router holds requests in its queue)."""
    config = ClusterConfig(num_workers=workers, worker_max_ongoing_requests=ongoing,
                           worker_max_queued_requests=queued)
    assert config.max_requests_in_flight() == expected


@pytest.mark.parametrize(("name", "fault"), [
    ("SmolLM2-135M-Instruct", "is the served model's name"),
    ("SmolLM2-135M-Instruct ", "whitespace"),
    ("sq\tl", "control characters")])
def test_an_adapter_name_a_client_could_not_tell_apart_is_refused(name, fault):
    with pytest.raises(ValueError, match=fault):
        ClusterConfig(served_model_name="SmolLM2-135M-Instruct", lora_modules={name: "/a"})
    assert ClusterConfig(lora_modules={"sql v2": "/a"}).lora_modules.keys() == {"sql v2"}
