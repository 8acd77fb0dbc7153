"""The load generator and ``nalar bench`` end to end, against the stub server."""

from __future__ import annotations

import json
import math

import pytest
from bench_stub_server import MODEL, running_stub

from bench.runner import BenchConfig, LoadConfig, run_benchmark
from bench.workloads import WorkloadConfig
from cluster.cli import main


@pytest.fixture
def stub():
    with running_stub() as (url, state):
        yield url, state


def _run(url, workload, **load):
    return run_benchmark(BenchConfig(base_url=url, workload=workload, load=LoadConfig(**load),
                                     progress=False))


def test_cli_shared_prefix_report_and_plot(stub, tmp_path, capsys):
    url, state = stub
    out, png = tmp_path / "run.json", tmp_path / "run.png"
    code = main(["bench", "--base-url", url, "--workload", "shared-prefix", "--tenants", "2",
                 "--prefix-tokens", "20", "--input-tokens", "5", "--output-tokens", "4",
                 "--num-requests", "10", "--warmup", "2", "--max-concurrency", "3",
                 "--goodput", "ttft:60000", "e2el:60000", "--output-json", str(out),
                 "--save-detailed", "--plot", str(png), "--no-progress"])
    assert code == 0
    assert "Serving Benchmark Result" in capsys.readouterr().out
    report = json.loads(out.read_text())
    assert len(state.bodies) == 12  # warm-up requests were sent ...
    assert (report["completed"], report["failed"]) == (10, 0)  # ... but are not counted
    assert len(report["records"]) == 10 and len(report["ttfts"]) == 10
    assert report["model_id"] == MODEL and report["request_rate"] == "inf"
    assert report["good_requests"] == 10
    assert report["request_goodput"] == pytest.approx(report["request_throughput"])
    assert report["total_output_tokens"] == 40
    assert report["total_input_tokens"] == sum(r["prompt_tokens"] for r in report["records"])
    assert set(report["worker_share"]) <= {"stub-0", "stub-1"}
    assert sum(report["worker_requests"].values()) == 10
    assert report["spec_acceptance_rate"] == pytest.approx(0.75)
    assert state.max_in_flight <= 3
    # Each tenant's 22-word system prompt ("Tenant i." and 20 words) is cached from its second
    # request on; the stub saw the requests in state.keys' order, warm-up first.
    first_seen = {key: state.keys.index(key) for key in set(state.keys)}
    cold = sum(first_seen[key] == i for i, key in enumerate(state.keys) if i >= 2)
    assert sum(r["cached_tokens"] >= 22 for r in report["records"]) == 10 - cold
    assert report["prefix_reuse_ratio"] == pytest.approx(
        report["total_cached_tokens"] / report["total_input_tokens"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for key in ("mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "std_ttft_ms", "p90_tpot_ms",
                "mean_itl_ms", "p99_e2el_ms", "output_throughput", "total_token_throughput"):
        assert report[key] > 0, key


def test_cli_exits_non_zero_when_every_request_fails(stub, tmp_path):
    url, _ = stub
    out = tmp_path / "failed.json"
    code = main(["bench", "--base-url", url, "--api-key", "http-500", "--num-requests", "4",
                 "--input-tokens", "3", "--output-tokens", "2", "--output-json", str(out),
                 "--no-progress"])
    assert code == 1
    report = json.loads(out.read_text())
    assert (report["completed"], report["failed"]) == (0, 4)
    assert report["failures"] == {"http": 4}
    assert report["request_throughput"] == 0 and report["mean_ttft_ms"] is None


def test_cli_unreachable_server_and_bad_flags(capsys):
    assert main(["bench", "--base-url", "http://127.0.0.1:9", "--no-progress"]) == 1
    assert main(["bench", "--goodput", "itl:5", "--no-progress"]) == 2
    assert "goodput" in capsys.readouterr().err


def test_multi_turn_sends_growing_history(stub):
    url, state = stub
    workload = WorkloadConfig(name="multi-turn", turns=3, input_tokens=4, output_tokens=4)
    result = _run(url, workload, num_requests=6)
    assert result.summary["completed"] == 6
    assert sorted(len(body["messages"]) for body in state.bodies) == [1, 1, 3, 3, 5, 5]
    assert {body["messages"][1]["content"] for body in state.bodies
            if len(body["messages"]) > 1} == {"w0 w1 w2 w3 "}
    assert sorted(r.label for r in result.records) == ["conversation-0"] * 3 + [
        "conversation-1"] * 3


def test_max_concurrency_bounds_requests_in_flight(stub):
    url, state = stub
    workload = WorkloadConfig(input_tokens=3, output_tokens=8)
    assert _run(url, workload, num_requests=12, max_concurrency=2).summary["completed"] == 12
    assert state.max_in_flight <= 2
    state.max_in_flight = 0
    assert _run(url, workload, num_requests=12).summary["completed"] == 12
    assert state.max_in_flight > 2  # the bound above was the semaphore's doing


def test_duration_bounds_the_run(stub):
    url, _ = stub
    workload = WorkloadConfig(input_tokens=3, output_tokens=2)
    result = _run(url, workload, num_requests=None, duration_s=0.5, request_rate=20.0)
    assert 1 <= len(result.records) <= 40
    assert max(r.start_s for r in result.records) < 0.5 + 0.1
    with pytest.raises(ValueError):
        LoadConfig(num_requests=None, duration_s=None)
    with pytest.raises(ValueError, match="warmup must be at least 0 requests, not -1"):
        LoadConfig(warmup=-1)
    assert math.isinf(LoadConfig().request_rate)


def test_json_workload_sends_its_schema_and_checks_every_output(stub):
    """The stub answers words, which are no JSON: every output is checked and none valid."""
    url, state = stub
    result = _run(url, WorkloadConfig(name="json", output_tokens=3, seed=1), num_requests=6,
                  max_concurrency=2)
    assert all(body["response_format"]["type"] == "json_schema" for body in state.bodies)
    summary = result.summary
    assert (summary["completed"], summary["checked_outputs"], summary["valid_outputs"]) == (
        6, 6, 0)
    assert summary["valid_output_fraction"] == 0.0
