"""``nalar bench`` against the real cluster: the session cluster (two workers, Redis index)
serves a small shared-prefix run and every record names its worker and its cache hit."""

from __future__ import annotations

import uuid

from bench.runner import BenchConfig, LoadConfig, run_benchmark
from bench.workloads import WorkloadConfig


def test_shared_prefix_run_against_the_cluster(cluster):
    workload = WorkloadConfig(name="shared-prefix", tenants=2, prefix_tokens=64,
                              input_tokens=8, output_tokens=4, seed=5,
                              tenant_key_prefix=f"bench-{uuid.uuid4().hex[:8]}")
    # One request at a time: each tenant's repeat arrives after its first has been cached.
    load = LoadConfig(num_requests=8, max_concurrency=1)
    result = run_benchmark(BenchConfig(base_url=cluster.base_url, workload=workload,
                                       load=load, progress=False, timeout_s=120))
    summary = result.summary
    assert (summary["completed"], summary["failed"]) == (8, 0)
    records = result.records
    assert all(r.worker and r.worker != "unknown" for r in records)
    assert all(r.usage_reported and r.completion_tokens == 4 for r in records)
    seen: set[str] = set()
    for record in records:  # completion order is sending order at concurrency 1
        if record.label in seen:
            assert record.cached_tokens > 0, record
        else:
            assert record.cached_tokens == 0, record
        seen.add(record.label)
    assert len(seen) == 2
    assert summary["prefix_reuse_ratio"] > 0
    assert sum(summary["worker_requests"].values()) == 8
