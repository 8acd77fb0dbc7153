"""A first start on a GPU host, on a CPU: the defaults a GPU count gives (through a fake
device probe), and the refusal of more GPUs than the Ray cluster has (a fake
``ray.cluster_resources()``, then the real CLI on the test session's GPU-less Ray)."""

from __future__ import annotations

import logging
import time

import pydantic
import pytest
from helpers import free_port

from cluster.cli import build_parser, main, serve_config
from cluster.config import ClusterConfig, workers_per_gpu
from cluster.runtime import (
    NotEnoughGPUsError,
    check_gpus,
    joins_existing_cluster,
    workers_that_fit,
)
from workers import devices
from workers.config import MiB


@pytest.fixture
def gpus(monkeypatch):
    """Fakes the probe: ``gpus(n)`` makes this process see ``n`` CUDA devices."""
    def see(count: int) -> None:
        monkeypatch.setattr(devices, "visible_gpu_count", lambda: count)

    return see


def config(**fields) -> ClusterConfig:
    return ClusterConfig(namespace_secret="s", **fields)


def flags(*argv: str) -> ClusterConfig:
    return serve_config(build_parser().parse_args(["serve", *argv]))


@pytest.mark.parametrize(("visible", "workers", "gpus_each"), [(0, 2, 0.0), (1, 1, 1.0),
                                                               (4, 4, 1.0)])
def test_one_worker_per_visible_gpu_by_default(gpus, visible, workers, gpus_each):
    gpus(visible)
    for built in (config(), flags()):
        assert (built.num_workers, built.worker_gpus) == (workers, gpus_each)
    assert flags("--workers", "3").num_workers == 3


def test_the_kv_budget_is_automatic_unless_given():
    automatic = flags().engine_config()
    assert (automatic.kv_cache_bytes, automatic.gpu_memory_utilization) == (None, 0.9)
    given = flags("--kv-memory-mib", "64", "--gpu-memory-utilization", "0.5").engine_config()
    assert (given.kv_cache_bytes, given.gpu_memory_utilization) == (64 * MiB, 0.5)
    for bad in ("0", "1.5"):
        with pytest.raises(pydantic.ValidationError, match="gpu_memory_utilization"):
            flags("--gpu-memory-utilization", bad)
    assert flags("--gpu-memory-utilization", "1").gpu_memory_utilization == 1.0


@pytest.mark.parametrize(("share", "per_gpu"), [(0.5, 2), (0.3, 3), (0.25, 4), (0.6, 1),
                                                (1.0, 1), (2.0, 1)])
def test_workers_per_gpu(share, per_gpu):
    assert workers_per_gpu(share) == per_gpu


def test_workers_sharing_a_gpu_must_fit_their_memory_in_it():
    with pytest.raises(pydantic.ValidationError,
                       match=r"2 workers on a GPU.*1\.8 of it in all.*"
                             r"--gpu-memory-utilization 0\.45"):
        config(worker_gpus=0.5)
    assert config(worker_gpus=0.5, gpu_memory_utilization=0.45).worker_gpus == 0.5
    assert config(worker_gpus=0.5, kv_cache_mib=256).kv_cache_mib == 256  # no sizing
    assert config(worker_gpus=0.6).gpu_memory_utilization == 0.9  # one per GPU


def test_workers_that_fit():
    assert [workers_that_fit(gpus, 1.0) for gpus in (0, 1, 2.0, 3)] == [0, 1, 2, 3]
    assert workers_that_fit(2, 0.5) == 4
    assert workers_that_fit(2, 0.6) == 2  # 0.6 + 0.6 does not fit on one GPU
    assert workers_that_fit(4, 2.0) == 2


def test_more_gpus_than_the_cluster_has_is_refused_naming_both_and_the_way_out():
    with pytest.raises(NotEnoughGPUsError) as refusal:
        check_gpus(config(num_workers=2, worker_gpus=1.0), {"CPU": 16.0, "GPU": 1.0})
    message = str(refusal.value)
    assert message == (
        "2 workers ask Ray for 1 GPU each (2 in all), but the Ray cluster has 1 GPU(s): pass "
        "--workers 1 or --gpus-per-worker 0.5 --gpu-memory-utilization 0.45 to put 2 workers "
        "on each GPU")
    assert "\n" not in message


def test_enough_gpus_or_cpu_workers_pass():
    check_gpus(config(num_workers=2, worker_gpus=1.0), {"GPU": 2.0})
    check_gpus(config(num_workers=4, worker_gpus=0.5, gpu_memory_utilization=0.45),
               {"GPU": 2.0})
    check_gpus(config(num_workers=2, worker_gpus=0.0), {"CPU": 2.0})


def test_fractions_that_do_not_pack_are_refused():
    with pytest.raises(NotEnoughGPUsError,
                       match=r"3 workers ask Ray for 0\.6 GPU each \(1\.8 in all\), but the "
                             r"Ray cluster has 2 GPU\(s\), and 1 such worker\(s\) fit on a "
                             r"GPU: pass --workers 2 or --gpus-per-worker 0\.5 "
                             r"--gpu-memory-utilization 0\.45"):
        check_gpus(config(num_workers=3, worker_gpus=0.6), {"GPU": 2.0})


def test_no_gpu_at_all_points_to_cpu_workers():
    with pytest.raises(NotEnoughGPUsError, match="has 0 GPU.*--gpus-per-worker 0 to run the "
                                                 "workers on CPUs"):
        check_gpus(config(num_workers=1, worker_gpus=1.0), {"CPU": 8.0})


def test_a_joined_cluster_may_grow_so_only_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="cluster.runtime"):
        check_gpus(config(num_workers=2, worker_gpus=1.0), {"GPU": 1.0}, may_grow=True)
    assert "2 workers ask Ray for 1 GPU each" in caplog.text
    assert "may add GPUs" in caplog.text


def test_joining_means_an_address_other_than_local(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert not joins_existing_cluster()
    monkeypatch.setenv("RAY_ADDRESS", "local")
    assert not joins_existing_cluster()
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    assert joins_existing_cluster()


def test_serve_refuses_gpus_the_ray_cluster_lacks_in_one_line(ray_session, monkeypatch, capsys):
    """The test session's Ray has no GPU: asking for one fails at once, before anything is
    deployed, with one line on stderr and no traceback. (Other tests of the session may have
    deployed applications of their own: none of them is touched.)"""
    from ray import serve

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    before = deployed_at(serve)
    started = time.monotonic()
    code = main(["serve", "--port", str(free_port()), "--workers", "2", "--gpus-per-worker",
                 "1", "--kv-memory-mib", "16"])
    elapsed = time.monotonic() - started
    err = capsys.readouterr().err
    assert code == 1
    assert err.splitlines() == [
        "nalar: cannot serve: 2 workers ask Ray for 1 GPU each (2 in all), but the Ray cluster "
        "has 0 GPU(s): pass --gpus-per-worker 0 to run the workers on CPUs, or start Ray with "
        "GPUs"]
    assert elapsed < 30
    assert deployed_at(serve) == before


def deployed_at(serve) -> dict[str, float]:
    """When each Serve application now running was last deployed."""
    return {name: app.last_deployed_time_s
            for name, app in serve.status().applications.items()}
