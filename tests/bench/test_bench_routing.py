"""benchmarks/routing.py's figures and goals, on made-up runs with known answers (the
benchmark itself needs a quiet machine and minutes; it is not run here)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import routing  # noqa: E402


def _run(reuse, ttft_ms, imbalance, throughput=100.0):
    return [{"busiest_to_least_busy": imbalance,
             "bench": {"prefix_reuse_ratio": reuse, "median_ttft_ms": ttft_ms,
                       "output_throughput": throughput, "completed": 10, "failed": 0}}]


def test_figures_and_goals(tmp_path):
    runs = {routing.ORACLE: _run(0.8, 100.0, None), "prefix": _run(0.76, 80.0, 1.2),
            "round-robin": _run(0.4, 200.0, 1.0), "power-of-two": _run(0.42, 190.0, math.inf)}
    table = routing.figures(runs)
    assert table["prefix"]["fraction_of_oracle_reuse"] == pytest.approx(0.95)
    assert table["prefix"]["ttft_p50_to_round_robin"] == pytest.approx(0.4)
    assert table["round-robin"]["ttft_p50_to_round_robin"] == pytest.approx(1.0)
    assert table["power-of-two"]["busiest_to_least_busy"] == math.inf
    assert table[routing.ORACLE]["busiest_to_least_busy"] is None
    checks = routing.goals("shared-prefix", table)
    assert [check["met"] for check in checks] == [True, True, True]
    runs["prefix"] = _run(0.7, 120.0, 1.5)
    checks = routing.goals("shared-prefix", routing.figures(runs))
    assert [check["met"] for check in checks] == [False, False, False]
    png = routing.plot({"shared-prefix": table}, tmp_path / "routing.png")
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_rounds_are_compared_by_their_medians_and_no_reuse_has_its_own_goal():
    runs = {"prefix": _run(0.0, 90.0, 1.0, 100.0) + _run(0.0, 70.0, 1.4, 80.0)
            + _run(0.0, 80.0, 1.1, 120.0),
            "prefix+tier": _run(0.0, 85.0, 1.0, 99.5) + _run(0.0, 75.0, 1.0, 98.0)
            + _run(0.0, 95.0, 1.0, 130.0)}
    table = routing.figures(runs)
    assert table["prefix"]["output_throughput"] == 100.0
    assert table["prefix"]["output_throughput_by_round"] == [100.0, 80.0, 120.0]
    assert table["prefix"]["ttft_p50_ms"] == 80.0
    assert table["prefix"]["busiest_to_least_busy"] == 1.1
    assert table["prefix"]["completed"] == 30
    (check,) = routing.goals(routing.NO_REUSE, table)
    assert check["value"] == pytest.approx(0.995) and check["met"]
    runs["prefix+tier"] = _run(0.0, 85.0, 1.0, 98.0)
    (check,) = routing.goals(routing.NO_REUSE, routing.figures(runs))
    assert check["value"] == pytest.approx(0.98) and not check["met"]


def test_run_settings_from_flags():
    args = routing.parse_args(["--threads", "1"])
    assert (args.requests, args.tenants, args.prefix_tokens, args.workers) == (200, 8, 512, 2)
    config = routing.cluster_config(args, "round-robin", 2, "nalar-bench-routing-x")
    assert (config.routing, config.num_workers, config.key_prefix) == (
        "round-robin", 2, "nalar-bench-routing-x")
    assert config.redis_url == "redis://127.0.0.1:6379/0" and config.worker_threads == 1
    bench = routing.bench_config(args, "shared-prefix", 8123, "tenant-x")
    assert bench.base_url == "http://127.0.0.1:8123" and bench.ignore_eos
    assert bench.load.warmup == 0
    assert routing.bench_config(routing.parse_args(["--warmup", "50"]), "shared-prefix", 8123,
                                "tenant-x").load.warmup == 50
    with pytest.raises(ValueError, match="warmup must be at least 0"):
        routing.bench_config(routing.parse_args(["--warmup", "-1"]), "shared-prefix", 8123,
                             "tenant-x")
    assert (bench.workload.name, bench.workload.tenants, bench.workload.prefix_tokens) == (
        "shared-prefix", 8, 512)
    assert (bench.load.num_requests, bench.load.max_concurrency) == (200, 8)
    quick = routing.parse_args(["--quick"])
    assert (quick.requests, quick.prefix_tokens) == (12, 64)


METRICS = """\
# HELP nalar:kv_transfer_imported_blocks Blocks received and stored.
# TYPE nalar:kv_transfer_imported_blocks counter
nalar:kv_transfer_imported_blocks_total{worker="a"} 64.0
nalar:kv_transfer_imported_blocks_total{worker="b"} 128.0
nalar:kv_transfer_imported_blocks_created{worker="a"} 1.7e9
# HELP nalar:kv_transfer_import_seconds From asking to stored.
# TYPE nalar:kv_transfer_import_seconds counter
nalar:kv_transfer_import_seconds_total{worker="a"} 0.1
nalar:kv_transfer_import_seconds_total{worker="b"} 0.092
# HELP nalar:num_preemptions Sequences preempted.
# TYPE nalar:num_preemptions counter
nalar:num_preemptions_total{worker="a"} 3.0
# HELP nalar:kv_blocks_in_use Blocks in use.
# TYPE nalar:kv_blocks_in_use gauge
nalar:kv_blocks_in_use{worker="a"} 7.0
"""


def test_a_run_keeps_the_workers_transfer_and_preemption_counters(monkeypatch):
    class Response:
        text = METRICS

    monkeypatch.setattr(routing.httpx, "get", lambda url, timeout: Response)
    counters = routing.worker_counters(8123)
    assert counters == {"imported_blocks": 192.0, "import_seconds": pytest.approx(0.192),
                        "failed_fetches": 0.0, "preemptions": 3.0,
                        "import_ms_per_block": pytest.approx(1.0)}
