"""Starting and stopping a Nalar cluster on Ray (used by the CLI, tests and benchmarks)."""

from __future__ import annotations

import asyncio
import os
import socket

import ray
from ray import serve
from ray.serve.handle import DeploymentHandle

from cluster.app import APP_NAME, build_app
from cluster.config import INDEX_ACTOR_NAMESPACE, ClusterConfig

OBJECT_STORE_BYTES = 256 << 20


class PortInUseError(OSError):
    """The HTTP port is taken by another process."""


def check_port_free(host: str, port: int) -> None:
    """Raises :class:`PortInUseError` when ``host:port`` cannot be bound."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise PortInUseError(f"{host}:{port} is already in use ({exc.strerror})") from exc


def init_ray(num_cpus: int | None = None, log_to_driver: bool = True) -> None:
    """Join the Ray cluster named by ``$RAY_ADDRESS`` (a ``ray start`` cluster), else start a
    local Ray sized for a small machine (no dashboard, small object store).

    Never joins a cluster by discovery: another process's local Ray (a test run, a benchmark)
    would otherwise be joined, and its ``nalar`` application replaced by ours.
    """
    if ray.is_initialized():
        return
    address = os.environ.get("RAY_ADDRESS")
    if address and address != "local":
        ray.init(address=address, log_to_driver=log_to_driver, namespace=INDEX_ACTOR_NAMESPACE)
        return
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False,
             log_to_driver=log_to_driver, object_store_memory=OBJECT_STORE_BYTES,
             namespace=INDEX_ACTOR_NAMESPACE)


_OWNED_INDEXES: dict[str, object] = {}
"""The embedded index clients this process created, by actor name: their handles keep the
actors alive. Ray collects a named, non-detached actor once no handle to it exists, so a
handle dropped here (as it once was) let the driver's actor go within half a second, and
the first worker to call created it anew as its owner: it then died with that worker."""


def start_index_actor(config: ClusterConfig) -> None:
    """Create the embedded index actor from this long-lived process, which owns it and holds
    a handle to it until :func:`stop_cluster`, so the index survives any single replica.
    Nothing to do with Redis."""
    if config.redis_url:
        return
    from router.index import ActorIndex

    index = ActorIndex(config.index_actor_name, config.worker_ttl_s,
                       namespace=INDEX_ACTOR_NAMESPACE)
    asyncio.run(index.heartbeat("", "driver"))
    _OWNED_INDEXES[config.index_actor_name] = index


def start_cluster(config: ClusterConfig, http: bool = True) -> DeploymentHandle:
    """Deploy the application and wait until every replica is up.

    Args:
        config: the cluster configuration.
        http: serve HTTP on ``config.host:config.port`` (off for handle-only tests).

    Returns:
        A handle to the ingress deployment.

    Raises:
        PortInUseError: the HTTP port is taken.
    """
    if http:
        check_port_free(config.host, config.port)
    init_ray()
    start_index_actor(config)
    http_options = {"host": config.host, "port": config.port} if http else None
    serve.start(http_options=http_options)
    return serve.run(build_app(config), name=APP_NAME, route_prefix="/" if http else None)


def stop_cluster() -> None:
    """Tear down Serve and Ray, leaving no processes behind."""
    _OWNED_INDEXES.clear()
    if ray.is_initialized():
        serve.shutdown()
        ray.shutdown()
