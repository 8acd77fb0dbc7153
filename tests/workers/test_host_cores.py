"""Borrowing the cores of a host's idle workers: the claims each worker keeps, what a step may
borrow, and an engine whose long prefill runs on the borrowed threads with the same output."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers import greedy, output_ids

import workers.host_cores as host_cores
from workers.host_cores import (
    BORROW_MIN_PROMPT_TOKENS,
    DIRECTORY_VARIABLE,
    HostCores,
    _start_time,
)


@pytest.fixture()
def other_worker() -> Iterator[int]:
    """The pid of a live process standing in for another worker of the host."""
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield process.pid
    process.kill()
    process.wait()


@pytest.fixture()
def restore_threads() -> Iterator[None]:
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def claim_file(directory: Path, pid: int, threads: int, started: str | None = None) -> Path:
    """A claim of ``threads`` by process ``pid`` (started when it did, unless ``started``)."""
    path = directory / str(pid)
    path.write_bytes(b"%8d %s" % (threads, (started or _start_time(pid) or "0").encode()))
    return path


def read_claim(cores: HostCores) -> int:
    return int((cores.directory / str(os.getpid())).read_bytes().split()[0])


def test_a_step_borrows_an_idle_workers_share_and_gives_it_back(tmp_path, other_worker,
                                                                 restore_threads):
    torch.set_num_threads(1)
    cores = HostCores(1, torch.set_num_threads, tmp_path, cores=3)
    claim_file(tmp_path, other_worker, 0)
    cores.busy(True)
    assert read_claim(cores) == 1
    with cores.borrowing() as threads:
        assert threads == 3 and torch.get_num_threads() == 3
        assert read_claim(cores) == 3
    assert torch.get_num_threads() == 1 and read_claim(cores) == 1
    cores.busy(False)
    assert read_claim(cores) == 0
    cores.close()
    assert not (tmp_path / str(os.getpid())).exists()


def test_a_busy_workers_share_is_not_borrowed(tmp_path, other_worker, restore_threads):
    torch.set_num_threads(1)
    cores = HostCores(1, torch.set_num_threads, tmp_path, cores=3)
    claim_file(tmp_path, other_worker, 1)
    assert cores.spare() == 1
    claim_file(tmp_path, other_worker, 2)  # it borrowed the third core first
    with cores.borrowing() as threads:
        assert threads == 1 and torch.get_num_threads() == 1


def test_a_dead_workers_claim_is_removed_and_other_files_ignored(tmp_path):
    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                              capture_output=True, text=True, check=True)
    stale = claim_file(tmp_path, int(finished.stdout), 4)
    (tmp_path / "notes.txt").write_text("not a claim")
    cores = HostCores(2, torch.set_num_threads, tmp_path, cores=4)
    assert cores.spare() == 2
    assert not stale.exists()
    with pytest.raises(ValueError):
        HostCores(0, torch.set_num_threads, tmp_path)


def test_a_dead_workers_claim_under_a_reused_pid_is_removed(tmp_path, other_worker):
    """A worker killed mid-borrow whose pid now names another live process: its start time
    differs, so the claim is the dead worker's and no longer counts."""
    stale = claim_file(tmp_path, other_worker, 2, started="1")
    assert HostCores(1, torch.set_num_threads, tmp_path, cores=3).spare() == 2
    assert not stale.exists()


@pytest.mark.parametrize("v2, v1, cores", [
    ("max 100000", None, "all"),
    ("150000 100000", None, 1),  # a container limited to 1.5 CPUs: 1 thread, not 2
    (None, ("200000", "100000"), 2),
    (None, ("-1", "100000"), "all"),
    (None, None, "all"),
])
def test_available_cores_follow_the_cgroup_cpu_limit(tmp_path, monkeypatch, v2, v1, cores):
    v2_path, v1_dir = tmp_path / "cpu.max", tmp_path / "cpu"
    if v2 is not None:
        v2_path.write_text(v2 + "\n")
    if v1 is not None:
        v1_dir.mkdir()
        (v1_dir / "cpu.cfs_quota_us").write_text(v1[0] + "\n")
        (v1_dir / "cpu.cfs_period_us").write_text(v1[1] + "\n")
    monkeypatch.setattr(host_cores, "CGROUP_V2_CPU_MAX", v2_path)
    monkeypatch.setattr(host_cores, "CGROUP_V1_CPU", v1_dir)
    affinity = len(os.sched_getaffinity(0))
    assert host_cores.available_cores() == (affinity if cores == "all" else min(cores, affinity))


@pytest.mark.skipif(host_cores.available_cores() < 2, reason="needs two cores to borrow one")
def test_an_engines_long_prefill_borrows_and_its_output_is_unchanged(
        smollm, make_engine, tmp_path, monkeypatch, restore_threads):
    """The prefill step runs on every core of the host while no other worker claims one,
    the decode steps on the worker's one thread, and SmolLM2's greedy tokens in fp32 equal
    an engine that never borrows. 300 prompt tokens: a prefill of 256 rows or more
    multiplies through torch's GEMM, whose split over threads is not ours."""
    monkeypatch.setenv(DIRECTORY_VARIABLE, str(tmp_path))
    prompt = [(31 * i) % 20000 + 50 for i in range(300)]
    assert len(prompt) >= BORROW_MIN_PROMPT_TOKENS
    engine = make_engine(smollm, num_threads=1, borrow_idle_cores=True)
    cores, outputs = engine.host_cores, {}
    threads_per_step: list[int] = []
    seconds_per_step: list[float] = []
    execute = engine.runner.execute

    def counting(batch, num_logits):
        threads_per_step.append(torch.get_num_threads())
        started = time.perf_counter()
        try:
            return execute(batch, num_logits)
        finally:
            seconds_per_step.append(time.perf_counter() - started)

    engine.runner.execute = counting
    prefill_s = {}
    observe = engine.prompt_costs.observe
    engine.prompt_costs.observe = lambda chunks, seconds, num_tokens: (
        prefill_s.setdefault(borrow, seconds), observe(chunks, seconds, num_tokens))
    for borrow in (False, True):
        engine.host_cores = cores if borrow else None
        engine.reset_prefix_cache()
        threads_per_step.clear()
        seconds_per_step.clear()
        outputs[borrow] = output_ids(
            engine.generate([greedy(f"r{borrow}", prompt, 6, ignore_eos=True)])[f"r{borrow}"])
        assert threads_per_step == ([cores.cores] + [1] * 5 if borrow else [1] * 6)
        # The prefill's cost is kept as if computed on the worker's one thread: the
        # borrowed step's seconds times its threads.
        threads, seconds = threads_per_step[0], seconds_per_step[0]
        assert seconds * threads <= prefill_s[borrow] < (seconds + 0.05) * threads
    assert read_claim(cores) == 0  # idle again: its share is lent
    assert engine.counters.borrowed_core_steps == 1
    cores.close()
    assert outputs[True] == outputs[False] and len(outputs[True]) == 6
