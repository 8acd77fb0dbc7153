"""The cores of one host, shared by the workers on it: a worker about to run a long step borrows
the threads of workers that sit idle.

Each worker computes on cores ÷ workers threads (``cluster.config.threads_per_worker``): on a
2-core host with the default 2 workers, a lone request's prefill runs on one core while the
other idles. Giving every worker all the cores instead made 16 concurrent requests slower
(docs/performance.md, "Worker threads"). So each worker keeps its share, and a step with many
prompt tokens also takes the share of every worker that has nothing to run at that moment.
Decode steps do not borrow: through HTTP a lone request's decode ran slower on two threads than
on one, its tokens also needing the ingress and Ray on the other core.

Each worker process keeps one file in a host-wide directory, named by its pid: the threads it
computes on now (0 while idle) and the process's start time. A worker that dies leaves its file
behind; the next reader that finds no process of that pid and start time removes it (the start
time tells a later process given the same pid from the worker). Workers of any application
on the host count, since they share the cores; a worker that does not borrow keeps no file and
is not seen. A claim is a best effort, not a lock: a worker that wakes up while its share is
lent computes beside the borrower until the borrower's step ends (one step). A grace period
before an idle worker's share may be lent was tried and dropped: when the router alternates one
client's requests between two workers, each is idle only for the moment between two requests,
and the grace stopped every borrow (docs/performance.md, "Borrowing idle cores").

The prompt-token cost the engine fits (``workers.step_time.PromptCostModel``, which the
step-time limits, the second tier and fetches from other workers weigh against) is that of the
worker's own cores: a step that borrowed is counted as if its threads' work had run on them.
"""

from __future__ import annotations

import contextlib
import math
import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

DIRECTORY_VARIABLE = "NALAR_HOST_CORES_DIR"
"""Overrides where the host's claims are kept (default: ``/dev/shm/nalar-host-cores``, else the
system's temporary directory)."""

BORROW_MIN_PROMPT_TOKENS = 128
"""A step borrows idle workers' cores only when it computes at least this many prompt tokens:
one that long is bound by arithmetic and splits well over threads."""

CGROUP_V2_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")
"""cgroup v2's CPU limit of this process's cgroup (``quota period``, or ``max``)."""

CGROUP_V1_CPU = Path("/sys/fs/cgroup/cpu")
"""cgroup v1's CPU controller, whose ``cpu.cfs_quota_us`` (-1: none) and ``cpu.cfs_period_us``
set the limit."""

_CLAIM_BYTES = 8


def available_cores() -> int:
    """The cores this process may compute on: those it may be scheduled on, capped by its
    cgroup's CPU quota (a container's CPU limit, which the affinity mask does not show: a
    pod limited to 4 CPUs on a 64-core node sees 64), at least 1."""
    cores = len(os.sched_getaffinity(0))
    quota = _cgroup_cpu_quota()
    return max(1, min(cores, math.floor(quota)) if quota is not None else cores)


def _cgroup_cpu_quota() -> float | None:
    """CPUs' worth of time per period the cgroup allows (v2's ``cpu.max``, else v1's CFS
    quota); None where there is no limit or no cgroup to read."""
    try:
        quota, period = CGROUP_V2_CPU_MAX.read_text().split()[:2]
    except (OSError, ValueError):
        try:
            quota = (CGROUP_V1_CPU / "cpu.cfs_quota_us").read_text().strip()
            period = (CGROUP_V1_CPU / "cpu.cfs_period_us").read_text().strip()
        except OSError:
            return None
    if quota in ("max", "-1"):
        return None
    try:
        return int(quota) / int(period)
    except (ValueError, ZeroDivisionError):
        return None


def default_directory() -> Path:
    """Where the workers of this host keep their claims: :data:`DIRECTORY_VARIABLE`, else
    ``/dev/shm`` (memory, per host or container), else the temporary directory."""
    if os.environ.get(DIRECTORY_VARIABLE):
        return Path(os.environ[DIRECTORY_VARIABLE])
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    return base / "nalar-host-cores"


class HostCores:
    """This worker's claim on the host's cores, and what it may borrow of the others'.

    Args:
        base_threads: the threads this worker computes on when it borrows nothing (its share).
        set_threads: sets the threads this worker computes on (``torch.set_num_threads``).
        directory: where the host's workers keep their claims (:func:`default_directory`).
        cores: the host's cores; None: :func:`available_cores`.

    Raises:
        ValueError: ``base_threads`` is below 1.
        OSError: the directory cannot be made or written.
    """

    def __init__(self, base_threads: int, set_threads: Callable[[int], None],
                 directory: Path | None = None, cores: int | None = None):
        if base_threads < 1:
            raise ValueError(f"base_threads must be at least 1, got {base_threads}")
        self.base_threads = base_threads
        self.set_threads = set_threads
        self.cores = cores or available_cores()
        self.directory = directory or default_directory()
        if not self.directory.is_dir():
            self.directory.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(OSError):  # every user's workers share it, as /tmp
                self.directory.chmod(0o1777)
        self._started = _start_time(os.getpid())
        if self._started is None:
            raise OSError("no /proc to tell a worker's process from a later one of its pid")
        self._path = self.directory / str(os.getpid())
        self._fd = os.open(self._path, os.O_RDWR | os.O_CREAT, 0o644)
        self._claimed: int | None = None
        self.claim(0)

    def busy(self, has_work: bool) -> None:
        """Claim this worker's share while it has work; lend it while it has none."""
        self.claim(self.base_threads if has_work else 0)

    def claim(self, threads: int) -> None:
        """Record that this worker computes on ``threads`` threads now (a write only when
        the claim changes)."""
        if threads != self._claimed:
            os.pwrite(self._fd, b"%*d %s" % (_CLAIM_BYTES, threads, self._started.encode()), 0)
            self._claimed = threads

    def spare(self) -> int:
        """Cores that no worker of the host claims now, this worker's share aside."""
        claimed = self.base_threads
        for entry in os.scandir(self.directory):
            if entry.name != self._path.name:
                claimed += _claim_of(entry)
        return max(0, self.cores - claimed)

    @contextmanager
    def borrowing(self) -> Iterator[int]:
        """Run the block on this worker's share plus every spare core, claimed meanwhile;
        yields the threads it runs on."""
        threads = self.base_threads + self.spare()
        if threads == self.base_threads:
            yield threads
            return
        self.claim(threads)
        self.set_threads(threads)
        try:
            yield threads
        finally:
            self.set_threads(self.base_threads)
            self.claim(self.base_threads)

    def close(self) -> None:
        """Withdraw this worker's claim (its file) from the host."""
        os.close(self._fd)
        self._path.unlink(missing_ok=True)


def _claim_of(entry: os.DirEntry) -> int:
    """Threads claimed by the worker whose file ``entry`` is; 0 for a worker that is gone
    (its file is removed) or a file that is no claim."""
    try:
        pid = int(entry.name)
        with open(entry.path, "rb") as claim:
            threads, started = claim.read().split()
        threads = int(threads)
    except (OSError, ValueError):
        return 0
    if _start_time(pid) != started.decode():  # gone, its pid perhaps another process's now
        Path(entry.path).unlink(missing_ok=True)
        return 0
    return threads


def _start_time(pid: int) -> str | None:
    """When process ``pid`` started, in clock ticks since boot (``/proc/<pid>/stat``'s 22nd
    field); None where there is no such process or no ``/proc``."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # fields from the 3rd on follow the name's ")"
