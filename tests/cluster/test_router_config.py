"""``ClusterConfig.routing`` reaches the request router through ``router_config``."""

from __future__ import annotations

import pytest
from ray.serve._private.common import DeploymentHandleSource, DeploymentID

from cluster.app import router_config
from cluster.config import ClusterConfig
from router.routing.policies import POLICY_NAMES
from router.routing.ray_router import PrefixAwareRequestRouter


@pytest.mark.parametrize("routing", ["round-robin", "power-of-two"])
def test_each_policy_reaches_the_router(routing):
    config = ClusterConfig(routing=routing, redis_url=None, namespace_secret="s")
    kwargs = router_config(config).request_router_kwargs
    assert kwargs["routing"] == routing
    router = PrefixAwareRequestRouter(deployment_id=DeploymentID(name="w", app_name="a"),
                                      handle_source=DeploymentHandleSource.UNKNOWN)
    router.initialize_state(**kwargs)  # the cache-blind policies build no index: no Ray needed
    assert router._policy.name == routing
    assert router._lookup.index is None


def test_prefix_is_the_default():
    config = ClusterConfig(namespace_secret="s")
    assert router_config(config).request_router_kwargs["routing"] == "prefix" == POLICY_NAMES[0]


async def test_shipped_router_class_records_into_this_process_singletons():
    # Ray pickles the router's module by value; the copy must still reach the process-wide
    # telemetry and replica keys (the ingress reads those), not copies of them.
    from ray import cloudpickle

    from router.routing.replica_keys import REPLICA_MODEL_KEYS
    from router.routing.telemetry import TELEMETRY

    config = router_config(ClusterConfig(routing="round-robin", namespace_secret="s"))
    shipped = cloudpickle.loads(config.get_serialized_request_router_cls())
    router = shipped(deployment_id=DeploymentID(name="shipped", app_name="a"),
                     handle_source=DeploymentHandleSource.UNKNOWN)
    router.initialize_state(**config.request_router_kwargs)
    assert router._telemetry is TELEMETRY
    router._note_model_keys({"w1": type("Replica", (), {"replica_metadata": {"model_key": "k"}})})
    assert REPLICA_MODEL_KEYS.keys(("a", "shipped")) == {"k"}
