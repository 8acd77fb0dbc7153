"""Builds the Serve application: ingress → prefix-aware router → N worker replicas, and the
draft replicas the workers call when speculation runs remotely."""

from __future__ import annotations

from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.deployment import Application

from cluster.config import INDEX_ACTOR_NAMESPACE, ClusterConfig
from cluster.draft_deployment import DRAFT_DEPLOYMENT, DraftProposer
from cluster.ingress_deployment import NalarIngress
from cluster.worker_deployment import NalarWorker
from router.routing.ray_router import PrefixAwareRequestRouter

APP_NAME = "nalar"
WORKER_DEPLOYMENT = "NalarWorker"
INGRESS_DEPLOYMENT = "NalarIngress"


def router_config(config: ClusterConfig) -> RequestRouterConfig:
    """Attach the request router to the worker deployment's handles, with the configured
    routing policy (``config.routing``: prefix, round-robin or power-of-two)."""
    return RequestRouterConfig(
        request_router_class=PrefixAwareRequestRouter,
        request_router_kwargs={
            "redis_url": config.redis_url,
            "key_prefix": config.key_prefix,
            "index_actor_name": config.index_actor_name,
            "index_actor_namespace": INDEX_ACTOR_NAMESPACE,
            "routing": config.routing,
            "block_size": config.block_size,
            "worker_ttl_s": config.worker_ttl_s,
        },
        request_routing_stats_period_s=config.routing_stats_period_s,
    )


SHUTDOWN_POLL_S = 0.5
"""How often a stopping replica counts its requests in flight, in seconds (Serve's
``graceful_shutdown_wait_loop_s``, 2 by default). Serve sleeps this long before the first
count, so that routers hear of the stop first. With the default every idle replica took 2 s
to stop, and an application's ``serve.delete`` 3 s."""


def draft_app(config: ClusterConfig) -> Application:
    """The draft replicas, bound to the workers' speculative configuration."""
    drafts = serve.deployment(DraftProposer).options(
        name=DRAFT_DEPLOYMENT,
        num_replicas=config.draft_replicas,
        ray_actor_options={"num_cpus": config.draft_cpus},
        max_ongoing_requests=max(8, 2 * config.num_workers),
        health_check_period_s=5,
        graceful_shutdown_wait_loop_s=SHUTDOWN_POLL_S,
    )
    return drafts.bind(config.speculative_config(), config.engine_config())


def gpu_demand(config: ClusterConfig) -> float:
    """GPUs the application asks Ray for: ``worker_gpus`` per worker replica. The ingress and
    the draft replicas ask for none (their ``ray_actor_options`` name no GPU)."""
    return config.num_workers * config.worker_gpus


def build_app(config: ClusterConfig) -> Application:
    """The application ``serve.run`` deploys.

    Workers get fractional CPUs (a 2-core machine still fits two) and a bounded queue, so
    overload is refused with 503 instead of queued without limit (DESIGN §5c). When the
    proposer is remote (``suffix``, or ``--speculative-remote``), the draft deployment is bound
    into the workers, which each call it through a
    :class:`~workers.speculative.remote.RemoteProposer`.
    """
    workers = serve.deployment(NalarWorker).options(
        name=WORKER_DEPLOYMENT,
        num_replicas=config.num_workers,
        ray_actor_options={"num_cpus": config.worker_cpus, "num_gpus": config.worker_gpus,
                           "resources": config.worker_resources},
        max_ongoing_requests=config.worker_max_ongoing_requests,
        max_queued_requests=config.worker_max_queued_requests,
        request_router_config=router_config(config),
        health_check_period_s=5,
        graceful_shutdown_wait_loop_s=SHUTDOWN_POLL_S,
    )
    ingress = serve.deployment(NalarIngress).options(
        name=INGRESS_DEPLOYMENT,
        num_replicas=1,
        ray_actor_options={"num_cpus": 0.1, "resources": config.ingress_resources},
        max_ongoing_requests=1024,
        graceful_shutdown_wait_loop_s=SHUTDOWN_POLL_S,
    )
    draft = (draft_app(config),) if config.draft_is_remote else ()
    return ingress.bind(workers.bind(config, *draft), config)
