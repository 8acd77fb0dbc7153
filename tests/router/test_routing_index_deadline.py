"""The lookup deadline benchmark (``benchmarks/index_deadline.py``): its rule for the deadline on
known rows, and a quick run against Redis (every setting measured, this run's keys deleted)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import redis

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import index_deadline  # noqa: E402
from router.routing.index_lookup import DEFAULT_LOOKUP_DEADLINE_S  # noqa: E402


def row(workers: int, concurrency: int, p999_ms: float, digests: int = 256) -> dict:
    return {"workers": workers, "digests": digests, "concurrency": concurrency,
            "p99.9_ms": p999_ms}


def test_deadline_is_the_worst_p999_at_router_concurrency_with_headroom():
    rows = [row(2, 4, 30.0, digests=1), row(2, 4, 96.3), row(2, 64, 400.0), row(2, 1, 120.0),
            row(8, 16, 900.0), row(8, 64, 1500.0)]
    # 2 workers: Ray runs 4 routing tasks. 96.3 ms x 1.5 = 144.45 ms, rounded up to 150 ms;
    # the 400 ms tail is at 64 concurrent lookups (more than one router runs), 120 ms at 1.
    recommended = index_deadline.recommend(rows, headroom=1.5)
    assert recommended["deadline_s"] == 0.15
    assert recommended["worst_p99.9_at_router_concurrency"] == row(2, 4, 96.3)
    assert recommended["worst_p99.9_at_concurrency_64_ms"] == 1500.0
    assert index_deadline.recommend(rows, 1.0, cluster_workers=8)["deadline_s"] == 0.9
    assert index_deadline.recommend(rows, 1.0, 8, max_deadline_ms=500)["deadline_s"] == 0.5
    with pytest.raises(ValueError):
        index_deadline.recommend(rows, 1.0, cluster_workers=4)
    assert [index_deadline.router_concurrency(w) for w in (2, 8, 25, 40)] == [4, 16, 50, 50]


def test_quick_run_measures_every_setting_and_leaves_no_keys(redis_url, redis_key_prefix,
                                                            tmp_path):
    out = tmp_path / "index_deadline.json"
    result = index_deadline.main(["--quick", "--redis-url", redis_url,
                                  "--key-prefix", redis_key_prefix, "--out", str(out),
                                  "--seconds-per-setting", "60"])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result, default=str))
    settings = {(r["workers"], r["digests"], r["concurrency"]) for r in result["rows"]}
    assert len(result["rows"]) == len(settings) == 3 * 4 * 3
    assert {(w, c) for w, _, c in settings} == {(2, 1), (2, 4), (2, 64), (4, 1), (4, 8),
                                               (4, 64), (8, 1), (8, 16), (8, 64)}
    for measured in result["rows"]:
        assert measured["n"] == 20
        assert measured["prompt_tokens"] == measured["digests"] * 16
        assert 0 < measured["p50_ms"] <= measured["p90_ms"] <= measured["p99_ms"] \
            <= measured["p99.9_ms"] <= measured["max_ms"]
    assert result["recommended"] == index_deadline.recommend(result["rows"], 1.0, 2, 500.0)
    for measured in result["rows"]:
        assert measured["client_cpu_ms_per_lookup"] > 0
    assert result["code_deadline_s"] == DEFAULT_LOOKUP_DEADLINE_S
    client = redis.Redis.from_url(redis_url)
    try:
        assert list(client.scan_iter(match=f"{redis_key_prefix}*")) == []
    finally:
        client.close()
