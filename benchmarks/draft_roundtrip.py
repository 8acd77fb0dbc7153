"""What one ngram draft call costs in the worker's process versus through a draft replica,
next to the decode step it would speed up: the figures behind ngram's default placement
(a proposer as cheap as ngram may run inside the worker when measurement shows that the
round trip to a draft replica costs more than it saves).

- In process: ``NgramProposer.propose`` on decode contexts of real text (--context tokens of
  Python standard-library source each, as ``common.text_prompts`` builds them), at batch 1 and
  16, k = --k: what the engine's thread spends per step when ngram runs in the worker.
- Through a draft replica: a Serve application holding only ``DraftProposer`` (ngram, the
  same bounds) on this machine's Ray, called through ``RemoteProposer`` from a plain thread,
  as a worker's engine thread calls it: to_wire, the handle call, the replica's work, the
  reply, from_wire. The engine waits for it (drafting is not overlapped with verification).
- The decode step of SmolLM2 on this machine, from ``--step-profile`` (``step_profile.py``'s
  JSON; batch 1 and 16) when present, else measured here briefly.

Median and p99 over --calls calls each (after --warmup untimed ones). The JSON's
``conclusion`` says where ngram should run, by these numbers.

    .venv/bin/python benchmarks/draft_roundtrip.py [--calls 200] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

try:
    from benchmarks import common
except ImportError:  # run as a script: benchmarks/ is on sys.path, the repo root is not
    import common

APP_NAME = "nalar-draft-roundtrip"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common.add_common_args(parser, "draft_roundtrip")
    parser.add_argument("--calls", type=int, default=200, help="timed calls per setting")
    parser.add_argument("--warmup", type=int, default=20, help="untimed calls first")
    parser.add_argument("--batches", default="1,16", help="sequences per draft call")
    parser.add_argument("--context", type=int, default=1024, help="tokens per sequence")
    parser.add_argument("--k", type=int, default=4, help="draft tokens asked per sequence")
    parser.add_argument("--ngram-min", type=int, default=1)
    parser.add_argument("--ngram-max", type=int, default=4)
    parser.add_argument("--step-profile", default=str(common.OUT_DIR / "step_profile.json"),
                        help="decode step times to compare with (measured here if missing)")
    args = parser.parse_args(argv)
    if args.quick:
        args.calls, args.warmup, args.context, args.batches = 10, 2, 64, "1,2"
    args.batches = [int(b) for b in args.batches.split(",") if b]
    return args


def timings(call: Callable[[], Any], calls: int, warmup: int) -> list[float]:
    """Seconds of each of ``calls`` calls, after ``warmup`` untimed ones."""
    for _ in range(warmup):
        call()
    samples = []
    for _ in range(calls):
        begin = time.perf_counter()
        call()
        samples.append(time.perf_counter() - begin)
    return samples


def summary(samples_s: list[float]) -> dict[str, float | int | None]:
    """Median and p99 (plus mean and max), in milliseconds."""
    ms = [s * 1000 for s in samples_s]
    return {"median_ms": statistics.median(ms), "p99_ms": common.percentile(ms, 99),
            "mean_ms": statistics.fmean(ms), "max_ms": max(ms), "calls": len(ms)}


def in_thread(work: Callable[[], list[float]]) -> list[float]:
    """``work()`` run on a plain thread (the engine calls its proposer from its own thread,
    never from an event loop)."""
    out: list[float] = []
    thread = threading.Thread(target=lambda: out.extend(work()))
    thread.start()
    thread.join()
    return out


def contexts(args: argparse.Namespace, batch: int) -> list:
    """``batch`` decode contexts of --context real tokens: a prompt with its last quarter
    taken as output so far (the proposer scans both alike)."""
    from workers.speculative.proposer import ProposalRequest

    prompts = common.text_prompts(common.embedded_tokenizer(), batch, args.context)
    return [ProposalRequest(f"seq-{i}", ids, args.context * 3 // 4, args.k)
            for i, ids in enumerate(prompts)]


def in_process(args: argparse.Namespace) -> dict[str, dict]:
    """The ngram proposer called in this thread, as the engine calls it in the worker."""
    from workers.speculative.ngram import NgramProposer

    proposer = NgramProposer(args.ngram_min, args.ngram_max)
    rows = {}
    for batch in args.batches:
        requests = contexts(args, batch)
        drafts = proposer.propose(requests)
        rows[str(batch)] = {**summary(timings(lambda r=requests: proposer.propose(r),
                                              args.calls, args.warmup)),
                            "sequences_with_drafts": sum(bool(d) for d in drafts)}
        common.log(f"in process, batch {batch}: {rows[str(batch)]}")
    return rows


def through_replica(args: argparse.Namespace) -> dict[str, dict]:
    """The same calls through one ngram draft replica, from a plain thread."""
    from ray import serve

    from cluster.app import draft_app
    from cluster.config import ClusterConfig
    from cluster.draft_deployment import DRAFT_DEPLOYMENT
    from cluster.runtime import init_ray
    from workers.speculative.ngram import NgramProposer
    from workers.speculative.remote import RemoteProposer

    config = ClusterConfig(speculative="ngram", speculative_remote=True,
                           ngram_min=args.ngram_min, ngram_max=args.ngram_max,
                           num_speculative_tokens=args.k, draft_cpus=0.1, worker_gpus=0)
    init_ray(log_to_driver=False)
    started = time.perf_counter()
    serve.run(draft_app(config), name=APP_NAME, route_prefix=None)
    handle = serve.get_deployment_handle(DRAFT_DEPLOYMENT, APP_NAME)
    common.log(f"draft replica up in {time.perf_counter() - started:.1f} s")
    rows: dict[str, dict] = {}
    try:
        for batch in args.batches:
            requests = contexts(args, batch)
            proposer = RemoteProposer(handle, deadline_s=10.0, name="remote-ngram")
            expected = NgramProposer(args.ngram_min, args.ngram_max).propose(requests)
            samples = in_thread(lambda r=requests, p=proposer: timings(
                lambda: p.propose(r), args.calls, args.warmup))
            same = proposer.propose(requests) == expected
            rows[str(batch)] = {**summary(samples), "drafts_equal_in_process": same,
                                "timeouts": proposer.timeouts, "failures": proposer.failures}
            common.log(f"draft replica, batch {batch}: {rows[str(batch)]}")
    finally:
        serve.delete(APP_NAME)
    return rows


def decode_steps(args: argparse.Namespace) -> dict[str, Any]:
    """SmolLM2's decode step (median ms) at the benchmark's batch sizes: from the step
    profile when it has them, else measured here (few steps, --context tokens)."""
    try:
        profile = json.loads(Path(args.step_profile).read_text())
        steps = {str(b): profile["decode"][str(b)]["step_ms_median"] for b in args.batches}
        return {"source": args.step_profile, "step_ms_median": steps,
                "context_tokens": profile.get("context_tokens"),
                "dtype": profile.get("machine", {}).get("dtype"),
                "threads": profile.get("threads")}
    except (OSError, KeyError, ValueError):
        pass
    loaded = common.load(args.model, args.dtype)
    engine = common.build_engine(loaded, threads=args.threads, kv_cache_mib=args.kv_cache_mib)
    steps = {}
    for batch in args.batches:
        prompts = common.text_prompts(loaded.tokenizer, batch, args.context, offset=7)
        run = common.EngineRun(engine)
        for i, prompt in enumerate(prompts):
            run.add(common.greedy_request(f"b{batch}-{i}", prompt, 12))
        run.run()
        decode_only = [ms for _, ms, prefill, decode in run.steps
                       if prefill == 0 and decode == batch]
        steps[str(batch)] = statistics.median(decode_only) if decode_only else None
    return {"source": "measured", "step_ms_median": steps, "context_tokens": args.context,
            "dtype": str(loaded.dtype).removeprefix("torch."), "threads": args.threads}


def conclusion(local: dict, remote: dict, steps: dict) -> dict[str, Any]:
    """Where ngram should run: in the worker unless the replica's round trip costs the
    engine thread less than proposing in process does (it never saves more than that)."""
    rows, parts = {}, []
    for batch in local:
        here, there = local[batch]["median_ms"], remote[batch]["median_ms"]
        step = steps["step_ms_median"].get(batch)
        rows[batch] = {"in_process_ms": here, "replica_ms": there,
                       "replica_over_in_process": there / here if here else None,
                       "in_process_share_of_step": here / step if step else None,
                       "replica_share_of_step": there / step if step else None}
        parts.append(f"batch {batch}: {here:.3f} ms in process vs {there:.2f} ms median "
                     f"({remote[batch]['p99_ms']:.2f} ms p99) through a replica"
                     + (f", against a {step:.0f} ms decode step "
                        f"({100 * here / step:.2f}% vs {100 * there / step:.1f}%)"
                        if step else ""))
    worker = all(r["replica_ms"] >= r["in_process_ms"] for r in rows.values())
    verdict = ("ngram runs in the worker (the default): the round trip to a draft replica "
               "costs the engine thread more than proposing in process, and the engine waits "
               "for it, so a replica would add, not save, time per step. Draft replicas stay "
               "the path for suffix (a cross-request index) and model (its own accelerator)."
               if worker else
               "ngram is cheaper through a draft replica than in process on this machine: "
               "consider --speculative-remote as the default.")
    return {"placement": "worker" if worker else "replica", "by_batch": rows,
            "text": verdict + " " + "; ".join(parts) + "."}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    threads = common.set_threads(args.threads)
    steps = decode_steps(args)
    common.log(f"decode step: {steps}")
    local = in_process(args)
    remote = through_replica(args)
    result = {"benchmark": "draft_roundtrip", "machine": common.machine_info(args.dtype),
              "load_average_1m": os.getloadavg()[0], "threads": threads, "quick": args.quick,
              "calls": args.calls, "warmup": args.warmup, "context_tokens": args.context,
              "k": args.k, "ngram": [args.ngram_min, args.ngram_max], "in_process": local,
              "draft_replica": remote, "decode_step": steps,
              "conclusion": conclusion(local, remote, steps)}
    common.log(result["conclusion"]["text"])
    common.write_json(result, args.out)
    from cluster.runtime import stop_cluster

    stop_cluster()
    return result


if __name__ == "__main__":
    main()
