"""A run's report: the JSON document (``vllm bench serve``'s layout and key names where it has
them) and the text table printed at the end of a run."""

from __future__ import annotations

import json
import math
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from bench.runner import BenchResult


def _json_number(value: float | None) -> float | str | None:
    """Infinite rates as ``"inf"`` (as vLLM writes them; JSON has no infinity)."""
    return "inf" if value is not None and math.isinf(value) else value


def report(result: BenchResult, detailed: bool = False) -> dict[str, Any]:
    """The JSON document of ``result``: run settings, then the summary; with ``detailed``,
    also every measured request (``records``) and vLLM's per-request lists."""
    config = result.config
    workload, load = config.workload, config.load
    document: dict[str, Any] = {
        "date": datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S"),
        "base_url": config.base_url,
        "endpoint_type": config.endpoint,
        "model_id": result.model,
        "workload": workload.name,
        "workload_config": {k: v for k, v in vars(workload).items() if k != "api_key"},
        "num_prompts": load.num_requests,
        "request_rate": _json_number(load.request_rate),
        "max_concurrency": load.max_concurrency,
        "duration_limit_s": load.duration_s,
        "warmup": load.warmup,
        "seed": workload.seed,
        "ignore_eos": config.ignore_eos,
        "temperature": config.temperature,
    }
    document |= result.summary
    if detailed:
        done = [r for r in result.records if r.ok]
        document |= {"input_lens": [r.prompt_tokens for r in done],
                     "output_lens": [r.completion_tokens for r in done],
                     "ttfts": [r.ttft_s for r in done], "itls": [r.itl_s for r in done],
                     "errors": [r.error or "" for r in result.records],
                     "records": [r.to_dict() for r in result.records]}
    return document


def write_report(document: dict[str, Any], path: str | Path) -> Path:
    """Writes the document as indented JSON, creating folders; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=2))
    return path


def _fmt(value: Any) -> str:
    if value is None:
        return "n/a"
    return f"{value:.2f}" if isinstance(value, float) else str(value)


def summary_table(summary: dict[str, Any]) -> str:
    """The summary as aligned text lines, in the spirit of ``vllm bench serve``'s table."""
    rows = [("Successful requests", summary["completed"]),
            ("Failed requests", summary["failed"]),
            ("Benchmark duration (s)", summary["duration"]),
            ("Total input tokens", summary["total_input_tokens"]),
            ("Total generated tokens", summary["total_output_tokens"]),
            ("Request throughput (req/s)", summary["request_throughput"]),
            ("Request goodput (req/s)", summary["request_goodput"]),
            ("Output token throughput (tok/s)", summary["output_throughput"]),
            ("Total token throughput (tok/s)", summary["total_token_throughput"])]
    for metric, title in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"),
                          ("e2el", "E2E latency")):
        rows += [(f"{title} {stat} (ms)", summary[f"{key}_{metric}_ms"])
                 for stat, key in (("mean", "mean"), ("p50", "median"), ("p90", "p90"),
                                   ("p99", "p99"))]
    rows += [("Prefix reuse ratio (cached/prompt)", summary["prefix_reuse_ratio"]),
             ("Busiest / least busy worker", summary["worker_load_imbalance"]),
             ("Speculative acceptance rate", summary["spec_acceptance_rate"])]
    if summary.get("checked_outputs"):
        rows.append(("Valid structured outputs (fraction)", summary["valid_output_fraction"]))
    lines = [f"{name:<40}{_fmt(value):>14}" for name, value in rows]
    lines += [f"  worker {worker}: {share:.1%}" for worker, share in
              summary["worker_share"].items()]
    if summary["failures"]:
        lines.append("failures: " + ", ".join(f"{kind} {count}"
                                              for kind, count in summary["failures"].items()))
    return "\n".join(["=" * 22 + " Serving Benchmark Result " + "=" * 22, *lines, "=" * 70])
