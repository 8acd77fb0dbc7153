"""Starting and stopping a Nalar cluster on Ray (used by the CLI, tests and benchmarks)."""

from __future__ import annotations

import asyncio
import logging
import math
import os
import shutil
import socket
import tempfile
from collections.abc import Mapping

import psutil
import ray
from ray import serve
from ray.serve.handle import DeploymentHandle

from cluster.app import APP_NAME, build_app, gpu_demand
from cluster.config import INDEX_ACTOR_NAMESPACE, ClusterConfig, workers_per_gpu

log = logging.getLogger(__name__)

OBJECT_STORE_BYTES = 256 << 20

SERVE_ENV = {"RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH": str((2 << 30) - 1)}
"""Ray Serve settings a local cluster starts with (a variable already set wins; a cluster
joined through ``$RAY_ADDRESS`` takes them from its nodes' environment: the image sets them).
The workers stream to the ingress over the replicas' gRPC channels, which refuse a message over
4 MiB by default; a chunk that gathered many tokens with their logprobs can be larger, and Ray
objects have no such limit, so the limit is gRPC's largest. The same limit lets an operator put
the HTTP proxy's hop on gRPC too (``RAY_SERVE_PROXY_USE_GRPC=1``, not set here: a request that
races an ingress restart then gets a 500 instead of waiting; ``docs/performance.md``, "The
token stream through Serve")."""


class PortInUseError(OSError):
    """The HTTP port is taken by another process."""


class TierStoreError(RuntimeError):
    """The second KV tier asked for cannot be had on this host: its directory is missing or
    read-only, or the disk or memory cannot hold every worker's."""


class NotEnoughGPUsError(RuntimeError):
    """The worker replicas ask Ray for more GPUs than the Ray cluster has: the ones left over
    would wait for a GPU forever, and the application would never be ready."""


def joins_existing_cluster() -> bool:
    """Whether :func:`init_ray` joins a running cluster (``$RAY_ADDRESS``) rather than
    starting a local one."""
    address = os.environ.get("RAY_ADDRESS")
    return bool(address) and address != "local"


def workers_that_fit(cluster_gpus: float, worker_gpus: float) -> int:
    """How many worker replicas asking for ``worker_gpus`` each Ray can place on
    ``cluster_gpus`` GPUs: a fraction of one GPU never spans two."""
    if worker_gpus < 1:
        return math.floor(cluster_gpus + 1e-9) * workers_per_gpu(worker_gpus)
    return math.floor(cluster_gpus / worker_gpus + 1e-9)


def check_gpus(config: ClusterConfig, cluster_resources: Mapping[str, float],
               may_grow: bool = False) -> None:
    """Refuses a deployment whose worker replicas do not all fit on the GPUs the Ray cluster
    declares, instead of waiting forever for the ones that do not.

    Args:
        config: the cluster configuration (``num_workers`` x ``worker_gpus`` are asked for;
            nothing else asks for a GPU, see :func:`cluster.app.gpu_demand`).
        cluster_resources: the Ray cluster's resources (``ray.cluster_resources()``).
        may_grow: the cluster was joined (``$RAY_ADDRESS``) and may add GPUs (an autoscaler):
            log a warning instead of refusing.

    Raises:
        NotEnoughGPUsError: the replicas do not fit, naming the GPUs asked for and had, and
            the flags that make them fit.
    """
    if gpu_demand(config) == 0:
        return
    have = float(cluster_resources.get("GPU", 0))
    fit = workers_that_fit(have, config.worker_gpus)
    if fit >= config.num_workers:
        return
    message = gpu_shortage_message(config, have, fit)
    if may_grow:
        log.warning("%s. Deploying anyway: the Ray cluster at $RAY_ADDRESS may add GPUs; "
                    "until it does, the application is not ready", message)
        return
    raise NotEnoughGPUsError(message)


def gpu_shortage_message(config: ClusterConfig, have: float, fit: int) -> str:
    """What :func:`check_gpus` says: the GPUs asked for and had, and what to pass instead."""
    workers, per_worker = config.num_workers, config.worker_gpus
    message = (f"{workers} workers ask Ray for {per_worker:g} GPU each "
               f"({gpu_demand(config):g} in all), but the Ray cluster has {have:g} GPU(s)")
    if gpu_demand(config) <= have + 1e-9:
        message += f", and {workers_per_gpu(per_worker)} such worker(s) fit on a GPU"
    whole = math.floor(have + 1e-9)
    if whole < 1:
        return (f"{message}: pass --gpus-per-worker 0 to run the workers on CPUs, or start "
                "Ray with GPUs")
    remedies = [f"--workers {fit}"] if fit >= 1 else []
    per_gpu = math.ceil(workers / whole)
    if per_gpu > 1:
        share = math.floor(100 / per_gpu) / 100
        utilization = math.floor(100 * config.gpu_memory_utilization / per_gpu) / 100
        remedies.append(f"--gpus-per-worker {share:g} --gpu-memory-utilization "
                        f"{utilization:g} to put {per_gpu} workers on each GPU")
    else:
        remedies.append("--gpus-per-worker 1")
    return f"{message}: pass {' or '.join(remedies)}"


def check_kv_tier(config: ClusterConfig, other_nodes: bool = False) -> None:
    """Refuses a deployment whose second KV tier this host cannot hold, instead of workers
    that each start without one, or one with and one without, and only log it: a worker
    whose tier's file or memory cannot be had serves without it (``workers.engine``), which
    suits a disk that fills later, not a flag that was wrong from the start.

    Args:
        config: the cluster configuration (``num_workers`` tiers of ``kv_tier_mib`` MiB, on
            the medium ``kv_tier_medium`` resolves to).
        other_nodes: the cluster was joined (``$RAY_ADDRESS``), so workers may run on other
            nodes than this one, with their own disks: log a warning instead of refusing.

    Raises:
        TierStoreError: the directory is missing, not one, or read-only; or its disk's free
            space (a disk tier) or the host's available memory (a host tier) is below every
            worker's tier together. The message names the flags to change.
    """
    if config.kv_tier_mib == 0:
        return
    engine = config.engine_config()
    medium = engine.tier_medium("cuda" if gpu_demand(config) else "cpu")
    need = config.num_workers * engine.kv_tier_bytes
    fault = (_tier_memory_fault(need) if medium == "host"
             else _tier_disk_fault(config.kv_tier_dir or tempfile.gettempdir(), need))
    if fault is None:
        return
    message = (f"the second KV tier ({config.num_workers} x --kv-tier-mib "
               f"{config.kv_tier_mib}, {medium}) cannot be had: {fault}")
    if other_nodes:
        log.warning("%s on this host; workers on other nodes may still have it", message)
        return
    raise TierStoreError(message)


def _tier_disk_fault(directory: str, need: int) -> str | None:
    if not os.path.isdir(directory):
        return f"{directory} is not a directory (--kv-tier-dir)"
    if not os.access(directory, os.W_OK | os.X_OK):
        return f"{directory} is not writable (--kv-tier-dir)"
    free = shutil.disk_usage(directory).free
    if free < need:
        return (f"{directory} has {free >> 20} MiB free, and the tiers need {need >> 20} MiB "
                "(pass a smaller --kv-tier-mib or another --kv-tier-dir)")
    return None


def _tier_memory_fault(need: int) -> str | None:
    available = psutil.virtual_memory().available
    if available < need:
        return (f"the host has {available >> 20} MiB of memory available, and the tiers need "
                f"{need >> 20} MiB (pass a smaller --kv-tier-mib, or --kv-tier-medium disk)")
    return None


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
    if joins_existing_cluster():
        ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=log_to_driver,
                 namespace=INDEX_ACTOR_NAMESPACE)
        return
    for name, value in SERVE_ENV.items():  # read by the processes Ray starts next
        os.environ.setdefault(name, value)
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
        NotEnoughGPUsError: the worker replicas ask for more GPUs than the Ray cluster has
            (a warning instead when the cluster was joined through ``$RAY_ADDRESS``).
        TierStoreError: this host cannot hold the second KV tier asked for (a warning
            instead when the cluster was joined).
    """
    if http:
        check_port_free(config.host, config.port)
    check_kv_tier(config, other_nodes=joins_existing_cluster())
    init_ray()
    check_gpus(config, ray.cluster_resources(), may_grow=joins_existing_cluster())
    start_index_actor(config)
    http_options = {"host": config.host, "port": config.port} if http else None
    serve.start(http_options=http_options)
    return serve.run(build_app(config), name=APP_NAME, route_prefix="/" if http else None)


def stop_cluster() -> None:
    """Tear down Serve and Ray, leaving no processes behind. The embedded index outlives the
    workers, which remove their entries from it as they stop."""
    if ray.is_initialized():
        serve.shutdown()
    _OWNED_INDEXES.clear()
    if ray.is_initialized():
        ray.shutdown()
