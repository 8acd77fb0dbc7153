"""What LoRA adapters cost: 16 concurrent requests spread over adapters against the same
requests on the base model, on one ``nalar serve``, the two alternating round by round.

Adapters are made by peft (``get_peft_model`` on the embedded SmolLM2-135M, seeded,
``init_lora_weights=False`` so ``lora_B`` is non-zero) on every projection, rank ``--rank``,
and cached under ``--adapter-dir``. Each adapter's load (read, check, digest, fuse: what a
worker does at start) is timed in this process. The server runs the defaults (the embedded
Q4_1 weights as stored) plus ``--lora-modules`` for all of them; ``nalar bench`` sends random
256-token chat prompts, 128 output tokens, greedy, EOS ignored, with ``model`` the base model
and spread uniformly over the adapters (``--lora-adapters``), the kinds' order turning each
round. Base and adapter runs of a round send the same prompts: their block digests differ (the
adapter is in every digest), so neither reuses the other's prefix cache.

A third kind of run, ``loading``, sends the base model's requests while this script loads an
adapter over HTTP (``POST /v1/load_lora_adapter`` with the admin key, every
``LOAD_PERIOD_S``, each one unloaded again after), timing each load end to end: what a load
costs the requests being served (their ITL) and how long it takes through every replica.

Goal (issue 19): the adapter rounds reach at least 0.85× the base rounds' output tokens/s.

``--balance`` measures instead where adapter requests go: ``--adapters`` (8) spread zipf over
the server's workers (2 by default), each holding fewer resident (``--max-loras``, 4) than
there are adapters, plus whatever ``--nalar-args`` adds (``--max-cpu-loras 8`` for a host
tier). A warm-up run, then a measured one with other prompts; from ``/metrics`` before and
after it, per worker: the tokens computed (prefill and decode) and where its adapter requests
found their adapter. Goals: fewer than 5% of requests wait on an adapter (a read from disk or
a free slot; a move back from the host tier is counted apart), and the busiest worker computes
at most 1.3× the least busy one's tokens.

    .venv/bin/python benchmarks/lora.py [--adapters 4] [--rank 16] [--rounds 2] [--quick]
    .venv/bin/python benchmarks/lora.py --balance --adapters 8 [--max-loras 4]
"""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import torch

try:
    from benchmarks import common
    from benchmarks.llama_server import Server, checkout_env, free_port, nalar_executable
except ImportError:  # run as a script: benchmarks/ is on sys.path, the repo root is not
    import common
    from llama_server import Server, checkout_env, free_port, nalar_executable

ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LOAD = {"full": "--workload random --input-tokens 256 --output-tokens 128 "
                "--max-concurrency 16 --num-requests 32 --warmup 4",
        "quick": "--workload random --input-tokens 64 --output-tokens 16 "
                 "--max-concurrency 4 --num-requests 8 --warmup 1",
        "balance": "--workload random --input-tokens 256 --output-tokens 128 "
                   "--max-concurrency 16 --num-requests 96 --warmup 0"}
METRICS = {"output_tok_s": "output_throughput", "ttft_p50_ms": "median_ttft_ms",
           "tpot_p50_ms": "median_tpot_ms", "itl_p99_ms": "p99_itl_ms"}
KINDS = ("base", "adapters", "loading")
ADMIN_KEY = "lora-benchmark-admin"
LOAD_PERIOD_S = 2.0
"""Seconds between two adapter loads during a ``loading`` run."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--adapters", type=int, default=4, help="adapters to spread over")
    parser.add_argument("--rank", type=int, default=16, help="each adapter's rank")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--adapter-dir", default=str(common.OUT_DIR / "lora_adapters"))
    parser.add_argument("--nalar-args", default="", help="more flags for nalar serve")
    parser.add_argument("--start-timeout", type=float, default=300.0)
    parser.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    parser.add_argument("--balance", action="store_true",
                        help="measure routing instead: zipf over the adapters, 2 workers")
    parser.add_argument("--max-loras", type=int, default=4,
                        help="--balance: adapters resident per worker")
    parser.add_argument("--out", default=str(common.OUT_DIR / "lora.json"))
    return parser.parse_args(argv)


def make_adapters(directory: Path, count: int, rank: int) -> list[Path]:
    """``count`` peft adapters on SmolLM2-135M (made once, then reused from ``directory``)."""
    from peft import LoraConfig, get_peft_model

    from workers.model_loader import load_model

    paths = [directory / f"r{rank}-{seed}" for seed in range(count)]
    for seed, path in enumerate(paths):
        if (path / "adapter_model.safetensors").exists():
            continue
        common.log(f"making adapter {path.name}")
        base = load_model("embedded", dtype="float32", device="cpu").model
        torch.manual_seed(seed)
        config = LoraConfig(r=rank, lora_alpha=rank, target_modules=ALL_PROJECTIONS,
                            init_lora_weights=False)
        get_peft_model(base, config).save_pretrained(path)
    return paths


def load_times(paths: list[Path]) -> list[dict[str, Any]]:
    """Seconds each adapter's load takes in this process (as a worker loads it), and its size."""
    from workers.lora.adapter import BaseShapes, load_adapter
    from workers.model_loader import load_model

    loaded = load_model("embedded", dtype="auto", device="cpu")
    shapes = BaseShapes.of(loaded.model)
    times = []
    for path in paths:
        started = time.perf_counter()
        adapter = load_adapter(path.name, path, shapes, 64, loaded.dtype)
        times.append({"adapter": path.name, "load_s": time.perf_counter() - started,
                      "bytes": adapter.nbytes, "rank": adapter.rank})
    return times


def bench(server: Server, label: str, lora: list[str], seed: int, load: str, out: Path,
          load_paths: list[Path] | None = None, distribution: str = "uniform") -> dict[str, Any]:
    """One ``nalar bench`` run of ``LOAD[load]``: the base model (``lora`` empty) or spread
    over ``lora`` by ``distribution``; with ``load_paths``, those adapters are loaded and
    unloaded over HTTP meanwhile, in turn."""
    command = [nalar_executable(), "bench", "--base-url", server.url, "--output-json", str(out),
               "--no-progress", "--ignore-eos", "--temperature", "0", "--seed", str(seed),
               *shlex.split(LOAD[load])]
    if lora:
        command += ["--lora-adapters", ",".join(lora), "--lora-distribution", distribution]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env=checkout_env(), cwd=common.REPO_ROOT)
    load_s = load_while(server, process, load_paths) if load_paths else []
    _, stderr = process.communicate()
    if process.returncode != 0:
        raise RuntimeError(f"nalar bench failed: {shlex.join(command)}\n{stderr[-2000:]}")
    report = json.loads(out.read_text())
    figures = {name: report[key] for name, key in METRICS.items()}
    common.log(f"{label}: {figures['output_tok_s']:.1f} tok/s, TTFT p50 "
               f"{figures['ttft_p50_ms']:.0f} ms, ITL p99 {figures['itl_p99_ms']:.0f} ms"
               + (f", {len(load_s)} loads" if load_paths else ""))
    entry = {"command": shlex.join(command), "completed": report["completed"],
             "failed": report["failed"], **figures}
    if load_paths:
        entry["adapter_load_s"] = load_s
    return entry


def load_while(server: Server, process: subprocess.Popen, paths: list[Path]) -> list[float]:
    """Load (then unload) one of ``paths`` every ``LOAD_PERIOD_S`` until ``process`` ends;
    returns each load's seconds, request to answer (every replica has read it)."""
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    seconds = []
    with httpx.Client(base_url=server.url, headers=headers, timeout=120) as client:
        while process.poll() is None:
            time.sleep(LOAD_PERIOD_S)
            path = paths[len(seconds) % len(paths)]
            name = f"loaded-{len(seconds)}"
            started = time.perf_counter()
            answer = client.post("/v1/load_lora_adapter",
                                 json={"lora_name": name, "lora_path": str(path)})
            answer.raise_for_status()
            seconds.append(time.perf_counter() - started)
            client.post("/v1/unload_lora_adapter", json={"lora_name": name}).raise_for_status()
    return seconds


def worker_counters(url: str) -> dict[str, dict[str, float]]:
    """Per worker, from ``/metrics``: tokens computed (prefill and decode), adapter requests,
    and those requests by where they found their adapter (``source_*``)."""
    from prometheus_client.parser import text_string_to_metric_families

    wanted = {"nalar:computed_prefill_tokens_total": "work",
              "nalar:computed_decode_tokens_total": "work",
              "nalar:lora_requests_total": "requests",
              "nalar:lora_slot_wait_seconds_total": "slot_wait_s"}
    workers: dict[str, dict[str, float]] = {}
    text = httpx.get(f"{url}/metrics", timeout=30).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = wanted.get(sample.name)
            if sample.name == "nalar:lora_requests_by_adapter_source_total":
                key = f"source_{sample.labels['source']}"
            if key is not None:
                counts = workers.setdefault(sample.labels["worker"], {})
                counts[key] = counts.get(key, 0.0) + sample.value
    return workers


def balance_report(before: dict, after: dict) -> dict[str, Any]:
    """What the measured run did, per worker and in all: the differences of
    :func:`worker_counters` across it."""
    per_worker = {worker: {key: value - before.get(worker, {}).get(key, 0.0)
                           for key, value in counts.items()} for worker, counts in after.items()}
    work = [counts.get("work", 0.0) for counts in per_worker.values()]
    requests = sum(counts.get("requests", 0.0) for counts in per_worker.values())

    def total(source: str) -> float:
        return sum(counts.get(f"source_{source}", 0.0) for counts in per_worker.values())
    waited = total("read") + total("slot")
    slot_wait_s = sum(counts.get("slot_wait_s", 0.0) for counts in per_worker.values())
    return {"per_worker": per_worker, "adapter_requests": requests,
            "by_source": {s: total(s) for s in ("resident", "host", "read", "slot")},
            "mean_slot_wait_s": slot_wait_s / total("slot") if total("slot") else None,
            "waited_share": waited / requests if requests else None,
            "work_busiest_over_least": max(work) / min(work) if work and min(work) else None}


def balance(args: argparse.Namespace, paths: list[Path], server: Server,
            runs: Path) -> dict[str, Any]:
    """The ``--balance`` runs (module docstring) on a started ``server``."""
    names = [path.name for path in paths]
    warm = bench(server, "warm-up", names, 2000, "balance", runs / "warmup.json",
                 distribution="zipf")
    before = worker_counters(server.url)
    measured = bench(server, "measured", names, 2001, "balance", runs / "measured.json",
                     distribution="zipf")
    report = balance_report(before, worker_counters(server.url))
    common.log(f"waited on an adapter: {report['waited_share']}, sources "
               f"{report['by_source']}, mean slot wait {report['mean_slot_wait_s']} s, "
               f"busiest/least busy work "
               f"{report['work_busiest_over_least']}")
    goals = [common.goal("requests_waiting_on_an_adapter_share", report["waited_share"], 0.05,
                         at_least=False),
             common.goal("busiest_over_least_busy_worker_work",
                         report["work_busiest_over_least"], 1.3, at_least=False)]
    return {"warmup": warm, "measured": measured, **report, "goals": goals}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    paths = make_adapters(Path(args.adapter_dir), args.adapters, args.rank)
    loads = load_times(paths)
    names = [path.name for path in paths]
    out = Path(args.out)
    runs = out.with_name(out.stem + "_runs")
    runs.mkdir(parents=True, exist_ok=True)
    ray_tmp = Path(tempfile.mkdtemp(prefix="nalar-lora-", dir="/tmp"))
    port = free_port()
    modules = [f"{path.name}={path}" for path in paths]
    slots = ["--max-loras", str(args.max_loras)] if args.balance else []
    server = Server("ours", [nalar_executable(), "serve", "--port", str(port), "--lora-modules",
                             *modules, "--lora-dir", str(Path(args.adapter_dir).absolute()),
                             "--admin-api-key", ADMIN_KEY, *slots,
                             *shlex.split(args.nalar_args)],
                    port, "/v1/models", runs / "server.log",
                    env=checkout_env(RAY_TMPDIR=str(ray_tmp)), ray_tmp=ray_tmp)
    if args.balance:
        try:
            startup_s = server.start(args.start_timeout)
            result = balance(args, paths, server, runs)
        finally:
            server.stop()
        common.log_goals(result["goals"])
        result = {"benchmark": "lora_balance", "machine": common.machine_info(),
                  "argv": sys.argv, "adapters": loads, "server": shlex.join(server.command),
                  "startup_s": startup_s, "load": LOAD["balance"], **result}
        common.write_json(result, out)
        return result
    rounds = []
    try:
        startup_s = server.start(args.start_timeout)
        for index in range(args.rounds):
            order = list(KINDS[index % 3:] + KINDS[:index % 3])  # each kind leads in turn
            entry: dict[str, Any] = {"round": index + 1, "order": order}
            for kind in order:
                # base and loading both run the base model: other prompts (another seed), or
                # the second would hit the first's prefix cache
                seed = 1000 + index + (500 if kind == "loading" else 0)
                entry[kind] = bench(server, f"round {index + 1} {kind}",
                                    names if kind == "adapters" else [], seed,
                                    "quick" if args.quick else "full",
                                    runs / f"round{index + 1}-{kind}.json",
                                    paths if kind == "loading" else None)
            entry["ratio"] = {m: common.ratio(entry["adapters"][m], entry["base"][m])
                              for m in METRICS}
            entry["loading_ratio"] = {m: common.ratio(entry["loading"][m], entry["base"][m])
                                      for m in METRICS}
            rounds.append(entry)
    finally:
        server.stop()
    ratios = [r["ratio"]["output_tok_s"] for r in rounds]
    goals = [common.goal("adapters_over_base_output_tok_s", min(ratios), 0.85)]
    common.log_goals(goals)
    result = {"benchmark": "lora", "machine": common.machine_info(), "argv": sys.argv,
              "quick": args.quick, "adapters": loads, "server": shlex.join(server.command),
              "startup_s": startup_s, "load": LOAD["quick" if args.quick else "full"],
              "rounds": rounds, "goals": goals}
    common.write_json(result, out)
    return result


if __name__ == "__main__":
    main()
