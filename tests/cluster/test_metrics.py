"""``GET /metrics``: the collector's families and labels, a worker that does not answer in
time left out of a scrape that still succeeds (no Ray), and end to end on the session's
cluster, the speculative counters moving by exactly what the responses' ``usage.speculative``
reports (committed tokens only, case S6)."""

from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from cluster.metrics import WorkerScrape, build_registry, fetch_worker_stats
from router.api.app import build_openai_app
from router.routing.telemetry import RoutingDecision, RoutingTelemetry
from workers.request_metrics import HISTOGRAM_BOUNDS, TTFT, TTFT_BUCKETS, Histogram

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse(text: str) -> Samples:
    """Sample name and sorted labels -> value, over every family in ``text``."""
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def value(samples: Samples, name: str, **labels: str) -> float:
    """The value of the one sample of ``name`` whose labels include ``labels`` (0 when there
    is none: a counter not yet exported counts nothing)."""
    wanted = set(labels.items())
    found = [v for (n, have), v in samples.items() if n == name and wanted <= set(have)]
    assert len(found) <= 1, f"{name}{labels} matches {len(found)} samples"
    return found[0] if found else 0.0


def worker_stats(worker_id: str, **spec) -> dict:
    base = {"proposed_tokens": 10, "accepted_tokens": 6, "rejected_tokens": 4,
            "verification_steps": 4, "accepted_by_position": [4, 2],
            "proposed_by_position": [4, 4, 2], "k_decisions": {0: 3, 2: 1, 3: 3},
            "draft_s": 0.25, "verify_s": 1.5, "draft_calls": 7, "method": "ngram"}
    return {"worker_id": worker_id, "model_name": "smol", "steps": 20, "borrowed_core_steps": 2,
            "prefill_tokens": 100,
            "decode_tokens": 30, "prefix_query_tokens": 100, "prefix_hit_tokens": 32,
            "preemptions": 1, "shared_prefix_waits": 3, "prompt_tokens": 120,
            "generation_tokens": 40,
            "blocks_total": 64, "blocks_free": 50, "blocks_evictable": 10, "blocks_in_use": 16,
            "running": 1, "waiting": 2, "spec": {**base, **spec},
            "histograms": ttft_histogram([0.003, 0.005, 0.05, 0.3, 3000.0])}


def ttft_histogram(values: list[float]) -> dict:
    histogram = Histogram(TTFT_BUCKETS)
    for v in values:
        histogram.observe(v)
    return {TTFT: histogram.snapshot()}


def test_vllm_names_with_worker_and_model_labels():
    registry = build_registry(lambda: WorkerScrape([worker_stats("w1")], 0, 0.0))
    samples = parse(generate_latest(registry).decode())
    labels = {"worker": "w1", "model_name": "smol"}
    assert samples[("nalar:num_requests_running", tuple(sorted(labels.items())))] == 1
    assert value(samples, "nalar:num_requests_waiting", **labels) == 2
    assert value(samples, "nalar:kv_cache_usage_perc", **labels) == 0.25
    assert value(samples, "nalar:prefix_cache_queries_total", **labels) == 100
    assert value(samples, "nalar:prefix_cache_hits_total", **labels) == 32
    assert value(samples, "nalar:prompt_tokens_total", **labels) == 120
    assert value(samples, "nalar:generation_tokens_total", **labels) == 40
    assert value(samples, "nalar:spec_decode_num_drafts_total", **labels) == 4
    assert value(samples, "nalar:spec_decode_num_accepted_tokens_per_pos_total", position="0",
                 **labels) == 4
    assert not any(name.startswith("nalar_") for name, _ in samples)


def test_lora_requests_info_has_vllms_labels_and_adapters_loaded_counts():
    stats = {**worker_stats("w1"), "lora": {
        "max_loras": 8, "loaded": 3, "hosted": ["d", "e"], "running": ["a", "b"],
        "waiting": ["c"], "waits": {"resident": 40, "host": 3, "read": 2, "slot": 1}}}
    before = time.time()
    samples = parse(generate_latest(build_registry(
        lambda: WorkerScrape([stats, worker_stats("w2")], 0, 0.0))).decode())
    info = value(samples, "nalar:lora_requests_info", worker="w1", max_lora="8",
                 running_lora_adapters="a,b", waiting_lora_adapters="c")
    assert before <= info <= time.time()  # vLLM's value: when it was read
    assert value(samples, "nalar:lora_adapters_loaded", worker="w1", tier="resident") == 3
    assert value(samples, "nalar:lora_adapters_loaded", worker="w1", tier="host") == 2
    assert value(samples, "nalar:lora_requests_by_adapter_source_total", worker="w1",
                 source="read") == 2
    assert value(samples, "nalar:lora_requests_by_adapter_source_total", worker="w1",
                 source="resident") == 40
    assert not [key for key in samples if dict(key[1]).get("worker") == "w2"
                and key[0].startswith("nalar:lora")]  # a worker without LoRA stats: none


def test_histograms_are_cumulative_with_inf_sum_and_count():
    registry = build_registry(lambda: WorkerScrape([worker_stats("w1")], 0, 0.0))
    text = generate_latest(registry).decode()
    family = next(f for f in text_string_to_metric_families(text)
                  if f.name == "nalar:time_to_first_token_seconds")
    assert family.type == "histogram"
    buckets = {s.labels["le"]: s.value for s in family.samples if s.name.endswith("_bucket")}
    assert list(buckets) == [str(float(b)) for b in TTFT_BUCKETS] + ["+Inf"]
    # 0.003 and 0.005 fall in le=0.005 (upper bound inclusive), 0.05 in le=0.06, 0.3 in
    # le=0.5, 3000 above every bound.
    assert buckets["0.001"] == 0 and buckets["0.005"] == 2 and buckets["0.04"] == 2
    assert buckets["0.06"] == 3 and buckets["0.5"] == 4 and buckets["2560.0"] == 4
    assert buckets["+Inf"] == 5
    counts = list(buckets.values())
    assert counts == sorted(counts)
    assert value(parse(text), "nalar:time_to_first_token_seconds_count", worker="w1") == 5
    assert value(parse(text), "nalar:time_to_first_token_seconds_sum",
                 worker="w1") == pytest.approx(3000.358)


def test_families_labelled_by_worker():
    remote = {**worker_stats("w2", accepted_tokens=0, rejected_tokens=10), "draft_calls": 5,
              "draft_timeouts": 2, "draft_failures": 1, "draft_skipped": 3}
    registry = build_registry(lambda: WorkerScrape([worker_stats("w1"), remote], 0, 0.01))
    samples = parse(generate_latest(registry).decode())
    assert value(samples, "nalar:engine_steps_total", worker="w1") == 20
    assert value(samples, "nalar:engine_steps_on_borrowed_cores_total", worker="w1") == 2
    assert value(samples, "nalar:kv_blocks_in_use", worker="w1") == 16
    assert value(samples, "nalar:kv_blocks_free", worker="w2") == 50
    assert value(samples, "nalar:num_preemptions_total", worker="w1") == 1
    assert value(samples, "nalar:shared_prefix_waits_total", worker="w1") == 3
    assert value(samples, "nalar:spec_decode_num_draft_tokens_total", worker="w1") == 10
    assert value(samples, "nalar:spec_decode_num_accepted_tokens_total", worker="w1") == 6
    assert value(samples, "nalar:spec_decode_num_accepted_tokens_total", worker="w2") == 0
    assert value(samples, "nalar:spec_decode_mean_accepted_length", worker="w1") == 1.5
    assert value(samples, "nalar:spec_decode_mean_accepted_length", worker="w2") == 0.0
    assert value(samples, "nalar:spec_decode_num_accepted_tokens_per_pos_total", worker="w1",
                 position="1") == 2
    assert value(samples, "nalar:spec_decode_num_draft_tokens_per_pos_total", worker="w1",
                 position="2") == 2
    assert value(samples, "nalar:spec_decode_k_decisions_total", worker="w1", k="3") == 3
    assert value(samples, "nalar:spec_decode_draft_seconds_total", worker="w1") == 0.25
    assert value(samples, "nalar:spec_decode_verify_seconds_total", worker="w1") == 1.5
    assert value(samples, "nalar:spec_decode_draft_calls_total", worker="w1") == 7
    # Remote draft client counts only where the worker drafts remotely.
    assert value(samples, "nalar:spec_decode_draft_timeouts_total", worker="w2") == 2
    assert value(samples, "nalar:spec_decode_draft_skipped_total", worker="w2") == 3
    assert value(samples, "nalar:spec_decode_remote_calls_total", worker="w2") == 5
    assert ("nalar:spec_decode_draft_timeouts_total", (("worker", "w1"),)) not in samples
    assert value(samples, "nalar:metrics_workers_answered") == 2


class FakeBroadcast:
    def __init__(self, answers):
        self.answers = answers
        self.calls = []

    def broadcast(self, method: str):
        self.calls.append(method)
        answers = self.answers

        class Response:
            def results(self, timeout_s, return_exceptions):
                assert return_exceptions and timeout_s == 0.5
                if isinstance(answers, Exception):
                    raise answers
                return answers

        return Response()


def test_a_late_worker_is_skipped_and_the_scrape_succeeds():
    handle = FakeBroadcast([worker_stats("w1"), TimeoutError("late")])
    scrape = fetch_worker_stats(handle, 0.5)
    assert handle.calls == ["engine_stats"]
    assert [w["worker_id"] for w in scrape.workers] == ["w1"] and scrape.skipped == 1
    samples = parse(generate_latest(build_registry(lambda: scrape)).decode())
    assert value(samples, "nalar:metrics_workers_skipped") == 1
    assert value(samples, "nalar:engine_steps_total", worker="w1") == 20

    nobody = fetch_worker_stats(FakeBroadcast(TimeoutError("no replica")), 0.5)
    assert nobody.workers == [] and nobody.skipped == 0


def test_registering_does_not_call_the_workers():
    calls = []
    build_registry(lambda: calls.append(1) or WorkerScrape())
    assert calls == []


async def test_route_serves_prometheus_text_or_404():
    def get(backend) -> httpx.AsyncClient:
        transport = httpx.ASGITransport(app=build_openai_app(backend))
        return httpx.AsyncClient(transport=transport, base_url="http://test")

    registry = build_registry(lambda: WorkerScrape([worker_stats("w1")], 0, 0.0))
    async with get(SimpleNamespace(metrics_registry=registry)) as client:
        response = await client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    assert value(parse(response.text), "nalar:engine_steps_total", worker="w1") == 20
    async with get(SimpleNamespace()) as client:
        missing = await client.get("/metrics")
    assert missing.status_code == 404 and missing.json()["error"]["message"]


# -- end to end on the session's cluster ------------------------------------------------------

PER_POS = "nalar:spec_decode_num_"
SPEC_TOTALS = {"proposed_tokens": "nalar:spec_decode_num_draft_tokens_total",
               "accepted_tokens": "nalar:spec_decode_num_accepted_tokens_total",
               "verification_steps": "nalar:spec_decode_num_drafts_total"}


async def scrape(client: httpx.AsyncClient) -> Samples:
    response = await client.get("/metrics", timeout=30)
    assert response.status_code == 200, response.text
    return parse(response.text)


def workers_in(samples: Samples) -> set[str]:
    return {dict(labels)["worker"] for name, labels in samples
            if name == "nalar:engine_steps_total"}


async def idle_scrape(client: httpx.AsyncClient, num_workers: int) -> Samples:
    """A scrape of every worker with nothing running (earlier tests' requests done)."""
    deadline = time.monotonic() + 60
    while True:
        samples = await scrape(client)
        workers = workers_in(samples)
        busy = sum(value(samples, f"nalar:num_requests_{state}", worker=w)
                   for w in workers for state in ("running", "waiting"))
        if len(workers) == num_workers and not busy or time.monotonic() > deadline:
            assert len(workers) == num_workers and not busy, samples
            return samples
        await asyncio.sleep(0.1)


def delta(after: Samples, before: Samples, name: str, **labels: str) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


async def test_spec_counters_equal_the_responses_usage(cluster):
    """Two repetitive greedy completions that SmolLM2 copies from their prompts (the second
    asks for two choices), one after the other: each moves its worker's counters by exactly
    its ``usage.speculative``, per position and per k, and leaves the other worker's
    untouched."""
    fox = "The quick brown fox jumps over the lazy dog. " * 4 + "The quick"
    count = "one, two, three, four, five, six, seven, eight, nine, ten. " * 3 + "one, two,"
    bodies = [{"prompt": fox, "max_tokens": 32, "temperature": 0, "ignore_eos": True},
              {"prompt": count, "max_tokens": 24, "temperature": 0, "ignore_eos": True,
               "n": 2}]
    async with httpx.AsyncClient(base_url=cluster.base_url) as client:
        for body in bodies:
            before = await idle_scrape(client, cluster.config.num_workers)
            response = await client.post("/v1/completions", json=body, timeout=120)
            assert response.status_code == 200, response.text
            after = await scrape(client)
            usage = response.json()["usage"]["speculative"]
            served = response.headers["x-nalar-worker"]
            assert usage["proposed_tokens"] > 0 and usage["accepted_tokens"] > 0
            for key, name in SPEC_TOTALS.items():
                assert delta(after, before, name, worker=served) == usage[key], name
            for k, steps in usage["k_decisions"].items():
                assert delta(after, before, "nalar:spec_decode_k_decisions_total", worker=served,
                             k=str(k)) == steps
            for position, rate in enumerate(usage["acceptance_by_position"]):
                labels = {"worker": served, "position": str(position)}
                proposed = delta(after, before, f"{PER_POS}draft_tokens_per_pos_total", **labels)
                accepted = delta(after, before, f"{PER_POS}accepted_tokens_per_pos_total",
                                 **labels)
                assert accepted / proposed == pytest.approx(rate)
            assert delta(after, before, "nalar:spec_decode_verify_seconds_total",
                         worker=served) == pytest.approx(usage["verify_s"], rel=1e-6)
            draft_s = delta(after, before, "nalar:spec_decode_draft_seconds_total", worker=served)
            assert draft_s == pytest.approx(usage["draft_s"], rel=1e-6)
            assert delta(after, before, "nalar:spec_decode_draft_calls_total", worker=served) > 0
            for other in workers_in(after) - {served}:
                assert delta(after, before, "nalar:spec_decode_num_draft_tokens_total",
                             worker=other) == 0
                assert delta(after, before, "nalar:computed_decode_tokens_total", worker=other) == 0
            assert value(after, "nalar:metrics_workers_skipped") == 0


LATENCY_HISTOGRAMS = ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                      "request_queue_time_seconds", "request_prefill_time_seconds",
                      "request_decode_time_seconds")


async def test_token_counters_and_histograms_follow_the_requests(cluster):
    """Four completions of different lengths at once: per worker, prompt and generation
    tokens move by the usage of the requests it served, each latency histogram counts each
    request once, and ITL counts at most one observation per token after the first."""
    async with httpx.AsyncClient(base_url=cluster.base_url) as client:
        before = await idle_scrape(client, cluster.config.num_workers)
        bodies = [{"prompt": f"Count to {n}: one, two,", "max_tokens": n, "temperature": 0,
                   "ignore_eos": True} for n in (3, 5, 8, 13)]
        responses = await asyncio.gather(*(client.post("/v1/completions", json=body,
                                                       timeout=120) for body in bodies))
        after = await idle_scrape(client, cluster.config.num_workers)
    served: dict[str, list[dict]] = {}
    for response in responses:
        assert response.status_code == 200, response.text
        served.setdefault(response.headers["x-nalar-worker"], []).append(
            response.json()["usage"])
    for worker in workers_in(after):
        usages = served.get(worker, [])
        assert delta(after, before, "nalar:prompt_tokens_total", worker=worker) == sum(
            u["prompt_tokens"] for u in usages)
        generated = sum(u["completion_tokens"] for u in usages)
        assert delta(after, before, "nalar:generation_tokens_total", worker=worker) == generated
        for name in LATENCY_HISTOGRAMS:
            assert delta(after, before, f"nalar:{name}_count", worker=worker) == len(usages)
            assert delta(after, before, f"nalar:{name}_bucket", worker=worker,
                         le="+Inf") == len(usages)
        itl = delta(after, before, "nalar:inter_token_latency_seconds_count", worker=worker)
        assert (itl > 0 if usages else itl == 0) and itl <= generated - len(usages)
        buckets = [v for (name, labels), v in after.items()
                   if name == "nalar:time_to_first_token_seconds_bucket"
                   and dict(labels)["worker"] == worker]
        assert buckets == sorted(buckets)


# -- the Grafana dashboard reads only what the server exports ---------------------------------

GRAFANA = Path(__file__).parents[2] / "k8s" / "grafana" / "nalar-dashboard.json"
METRIC = re.compile(r"\bnalar:[A-Za-z0-9_:]+")
GROUPING = re.compile(r"\bby \(([^)]*)\)")


def exported_series() -> dict[str, set[str]]:
    """Every sample name the server exports with workers and routing busy -> its label names."""
    histograms = {}
    for name, bounds in HISTOGRAM_BOUNDS.items():
        histogram = Histogram(bounds)
        histogram.observe(0.2)
        histograms[name] = histogram.snapshot()
    registry = build_registry(lambda: WorkerScrape(
        [{**worker_stats("w1"), "histograms": histograms}], 0, 0.0))
    telemetry = RoutingTelemetry()
    telemetry.record(RoutingDecision(0.0, "w1", "prefix", 64, 2, 32, "index_timeout"))
    telemetry.record_lookup(0.001, ok=True)
    registry.register(telemetry)
    series: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for sample in family.samples:
            series.setdefault(sample.name, set()).update(sample.labels)
    return series


def grafana_queries() -> list[str]:
    dashboard = json.loads(GRAFANA.read_text())
    queries = [target["expr"] for panel in dashboard["panels"]
               for target in panel.get("targets", ())]
    queries += [variable["definition"] for variable in dashboard["templating"]["list"]
                if "definition" in variable]
    return queries


def test_grafana_queries_name_only_exported_metrics_and_labels():
    series = exported_series()
    queries = grafana_queries()
    assert len(queries) >= 20
    for query in queries:
        names = METRIC.findall(query)
        assert names, query
        unknown = [name for name in names if name not in series]
        assert not unknown, f"{query}: not exported: {unknown}"
        labels = set().union(*(series[name] for name in names))
        for grouping in GROUPING.findall(query):
            wanted = {label.strip() for label in grouping.split(",")}
            assert wanted <= labels, f"{query}: no label {wanted - labels}"
    covered = {name for query in queries for name in METRIC.findall(query)}
    for needed in ("nalar:kv_cache_usage_perc", "nalar:prefix_cache_hits_total",
                   "nalar:time_to_first_token_seconds_bucket",
                   "nalar:inter_token_latency_seconds_bucket",
                   "nalar:e2e_request_latency_seconds_bucket", "nalar:generation_tokens_total",
                   "nalar:spec_decode_num_accepted_tokens_total",
                   "nalar:router_decisions_total", "nalar:router_fallbacks_total",
                   "nalar:index_up"):
        assert needed in covered, needed
