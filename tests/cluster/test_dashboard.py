"""The dashboard: its latency rings, counter rates and data document with known inputs (no
Ray), its routes, and the page itself in headless Chromium against the session's cluster under
load, with real numbers in the DOM and a screenshot kept as an artifact."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI
from prometheus_client.parser import text_string_to_metric_families

from cluster.dashboard import Dashboard, dashboard_router
from cluster.dashboard.latency import LatencyRing, StreamTimer
from cluster.dashboard.rates import CounterRates
from cluster.metrics import WorkerScrape
from router.index import IndexStats
from router.routing.telemetry import RoutingDecision, RoutingTelemetry
from workers.request_metrics import E2E, REQUEST_LATENCY_BUCKETS, Histogram


class Clock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_ring_gives_percentiles_per_window_over_the_span():
    clock = Clock()
    ring = LatencyRing(clock=clock)
    for at, value in [(1000.0, 0.1), (1001.0, 0.3), (1004.0, 0.2), (1005.0, 0.9),
                      (1350.0, 0.5), (1351.0, 0.7)]:
        clock.now = at
        ring.add(value)
    clock.now = 1352.0
    # 300 s back from 1352 starts at 1052: the window of 1000-1005 s is out of the span.
    assert ring.series(5.0, 300.0) == [
        {"t": 1350.0, "n": 2, "p50": 0.5, "p90": 0.7, "p99": 0.7}]
    assert ring.series(5.0, 400.0)[:2] == [
        {"t": 1000.0, "n": 3, "p50": 0.2, "p90": 0.3, "p99": 0.3},
        {"t": 1005.0, "n": 1, "p50": 0.9, "p90": 0.9, "p99": 0.9}]
    assert ring.recent(60.0) == {"n": 2, "p50": 0.5, "p90": 0.7, "p99": 0.7}
    assert LatencyRing(clock=clock).recent(60.0) == {"n": 0}


def test_ring_keeps_only_its_capacity():
    ring = LatencyRing(capacity=3, clock=Clock())
    for value in (1.0, 2.0, 3.0, 4.0):
        ring.add(value)
    assert ring.recent(10.0) == {"n": 3, "p50": 3.0, "p90": 4.0, "p99": 4.0}


def test_stream_timer_gives_ttft_then_per_token_gaps():
    clock = Clock(0.0)
    ttft, itl = LatencyRing(clock=Clock()), LatencyRing(clock=Clock())
    timer = StreamTimer(ttft, itl, clock=clock)
    for at, tokens in [(0.05, 0), (0.25, 1), (0.5, 2), (0.75, 1)]:
        clock.now = at
        timer.chunk(tokens)
    assert ttft.recent(1.0) == {"n": 1, "p50": 0.25, "p90": 0.25, "p99": 0.25}
    assert itl.recent(1.0) == {"n": 2, "p50": 0.125, "p90": 0.25, "p99": 0.25}


def test_counter_rates_over_the_window_and_after_a_restart():
    rates = CounterRates(window_s=10.0)
    assert rates.update("w1", 100, now=0.0) is None
    assert rates.update("w1", 150, now=2.0) == 25.0
    assert rates.update("w1", 250, now=4.0) == 37.5       # (250 - 100) / 4
    assert rates.update("w1", 450, now=14.0) == 20.0      # the sample at 0 s left the window
    assert rates.update("w1", 30, now=15.0) is None       # went down: a new replica, start over
    rates.keep_only(set())
    assert rates.update("w1", 40, now=16.0) is None


def worker(worker_id: str, generated: int, finished: int) -> dict:
    e2e = Histogram(REQUEST_LATENCY_BUCKETS)
    for _ in range(finished):
        e2e.observe(1.0)
    return {"worker_id": worker_id, "running": 2, "waiting": 1, "blocks_total": 80,
            "blocks_in_use": 20, "prefix_query_tokens": 400, "prefix_hit_tokens": 300,
            "generation_tokens": generated, "prompt_tokens": 500,
            "spec": {"proposed_tokens": 50, "accepted_tokens": 20},
            "lora": {"held": ["sql", "chat"], "hosted": ["qa"]} if worker_id == "w1" else {},
            "histograms": {E2E: e2e.snapshot()}}


def telemetry_with_decisions() -> RoutingTelemetry:
    telemetry = RoutingTelemetry(clock=Clock())
    for i, (worker_id, fallback) in enumerate([("w1", None), ("w2", None), ("w1", "no_index")]):
        telemetry.record(RoutingDecision(990.0 + i, worker_id, "prefix", 100, 4 - i,
                                         16 * (4 - i), fallback))
    telemetry.record_lookup(0.002, ok=True)
    return telemetry


async def test_data_document_from_known_sources():
    clock = Clock()
    scrapes = iter([WorkerScrape([worker("w2", 40, 1), worker("w1", 100, 3)], 1, 0.1),
                    WorkerScrape([worker("w2", 70, 2), worker("w1", 100, 3)], 0, 0.1)])

    async def index_stats() -> IndexStats:
        return IndexStats("redis", 2, 37, 0.5, 5)

    dashboard = Dashboard(lambda: next(scrapes), "smol", telemetry_with_decisions(),
                          index_stats, clock=clock)
    dashboard.ttft.add(0.25)
    first = await dashboard.data()
    clock.now += 2.0
    second = await dashboard.data()
    assert [row["worker"] for row in first["workers"]] == ["w1", "w2"]
    w1, w2 = second["workers"]
    assert w1 == {"worker": "w1", "running": 2, "waiting": 1, "kv_usage": 0.25,
                  "hit_ratio": 0.75, "tokens_per_s": 0.0, "acceptance": 0.4, "requests": 3,
                  "hits_by_source": {"local_cache_hit": 300, "second_tier": 0,
                                     "external_kv_transfer": 0},
                  "prompt_tokens": 500, "generation_tokens": 100,
                  "adapters": ["sql", "chat"], "hosted_adapters": ["qa"]}
    assert w2["adapters"] == w2["hosted_adapters"] == []
    assert first["workers"][1]["tokens_per_s"] is None and w2["tokens_per_s"] == 15.0
    assert w2["requests"] == 2
    assert first["scrape"] == {"answered": 2, "skipped": 1}
    assert second["model"] == "smol" and second["time"] == 1002.0
    assert second["latency"]["ttft"] == [{"t": 1000.0, "n": 1, "p50": 0.25, "p90": 0.25,
                                          "p99": 0.25}]
    routing = second["routing"]
    assert routing["share"] == {"w1": 2, "w2": 1}
    assert [(d["worker_id"], d["cached_tokens"], d["fallback"]) for d in routing["recent"]] == [
        ("w1", 32, "no_index"), ("w2", 48, None), ("w1", 64, None)]
    assert routing["health"]["lookups"] == 1 and routing["health"]["fallbacks"] == {
        "no_index": 1}
    assert second["index"] == {"backend": "redis", "workers": 2, "digests": 37,
                               "last_event_age_s": 0.5, "tier_digests": 5, "error": None}


async def test_an_unreachable_index_is_shown_not_raised():
    async def down() -> IndexStats:
        raise ConnectionError("redis is down")

    data = await Dashboard(WorkerScrape, "smol", None, down).data()
    assert data["index"] == {"error": "ConnectionError: redis is down"}
    assert data["routing"] == {"share": {}, "recent": [], "health": None}
    assert data["workers"] == []


async def test_routes_serve_the_page_its_assets_and_data():
    app = FastAPI()
    app.include_router(dashboard_router(Dashboard(WorkerScrape, "smol")))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        page = await client.get("/dashboard")
        script = await client.get("/dashboard/dashboard.js")
        style = await client.get("/dashboard/dashboard.css")
        data = await client.get("/dashboard/data")
        missing = await client.get("/dashboard/../metrics.py")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert '<script src="dashboard/dashboard.js">' in page.text
    assert "http" not in re.sub(r'xmlns="[^"]*"|"http://www.w3.org/2000/svg"', "",
                                page.text + script.text + style.text)  # nothing remote
    assert script.headers["content-type"].startswith("text/javascript")
    assert "fetch(\"dashboard/data\"" in script.text
    assert style.headers["content-type"].startswith("text/css")
    assert data.json()["model"] == "smol" and data.headers["cache-control"] == "no-store"
    assert missing.status_code == 404


# -- the page in headless Chromium, against the session's cluster under load ---------------

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                  "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--window-size=1400,1000",
                  "--virtual-time-budget=4000"]


def chromium_binary() -> str:
    binary = shutil.which("chromium")
    if binary is None:
        pytest.skip("no chromium binary: install Debian's `chromium` package (.ci/run does)")
    return binary


async def load_page(binary: str, url: str, screenshot: Path, profile: Path) -> str:
    """The page's DOM once its script has polled a few times; writes the screenshot."""
    process = await asyncio.create_subprocess_exec(
        binary, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", f"--screenshot={screenshot}",
        "--dump-dom", url, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    stdout, stderr = await asyncio.wait_for(process.communicate(), timeout=120)
    assert process.returncode == 0, stderr.decode()[-2000:]
    return stdout.decode()


async def worker_ids_and_finished(client: httpx.AsyncClient) -> tuple[set[str], int]:
    """The cluster's worker ids and its finished requests, from ``/metrics``."""
    response = await client.get("/metrics", timeout=30)
    samples = [sample for family in text_string_to_metric_families(response.text)
               for sample in family.samples]
    workers = {s.labels["worker"] for s in samples if s.name == "nalar:engine_steps_total"}
    finished = sum(s.value for s in samples
                   if s.name == "nalar:e2e_request_latency_seconds_count")
    return workers, int(finished)


def completion(n: int) -> dict:
    return {"prompt": f"List {n} prime numbers, separated by commas:", "max_tokens": 24 + n,
            "temperature": 0, "ignore_eos": True}


async def test_the_page_shows_live_numbers_in_chromium(cluster, tmp_path):
    binary = chromium_binary()
    artifacts = Path(os.environ.get("NALAR_TEST_ARTIFACTS", tmp_path))
    artifacts.mkdir(parents=True, exist_ok=True)
    screenshot = artifacts / "dashboard.png"
    async with httpx.AsyncClient(base_url=cluster.base_url, timeout=120) as client:
        done = await asyncio.gather(*(client.post("/v1/completions", json=completion(n))
                                      for n in range(4)))
        assert all(response.status_code == 200 for response in done)
        workers, finished_before = await worker_ids_and_finished(client)
        assert len(workers) == cluster.config.num_workers and finished_before >= 4
        load = [asyncio.create_task(client.post("/v1/completions", json=completion(n)))
                for n in range(4, 10)]
        dom = await load_page(binary, f"{cluster.base_url}/dashboard", screenshot,
                              tmp_path / "profile")
        await asyncio.gather(*load)
        _, finished_after = await worker_ids_and_finished(client)

    for worker_id in workers:
        assert f'data-worker="{worker_id}"' in dom
    total = int(re.search(r'id="total-requests">(\d+)<', dom).group(1))
    assert finished_before <= total <= finished_after
    ttft_samples = int(re.search(r'id="ttft-now"[^>]*>last minute \((\d+)\)', dom).group(1))
    assert ttft_samples >= 4                       # the ingress timed the requests above
    assert 'class="status ok"' in dom
    assert screenshot.stat().st_size > 10_000
