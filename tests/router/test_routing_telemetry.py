"""Routing telemetry: the decision log, shares, index health and the Prometheus exposition
(parsed back with prometheus-client's own text parser)."""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from router.routing.telemetry import RoutingDecision, RoutingTelemetry


class Clock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def decision(worker: str, blocks: int = 0, fallback: str | None = None,
             policy: str = "prefix", at: float = 0.0) -> RoutingDecision:
    return RoutingDecision(at, worker, policy, 100, blocks, blocks * 16, fallback)


def scrape(telemetry: RoutingTelemetry) -> dict[tuple[str, tuple], float]:
    registry = CollectorRegistry()
    registry.register(telemetry)
    text = generate_latest(registry).decode()
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def test_recent_is_newest_first_and_bounded():
    telemetry = RoutingTelemetry(capacity=3)
    for i in range(5):
        telemetry.record(decision(f"w{i}", at=float(i)))
    assert [d.worker_id for d in telemetry.recent()] == ["w4", "w3", "w2"]
    assert [d.at for d in telemetry.recent(limit=2)] == [4.0, 3.0]
    assert telemetry.recent(limit=0) == []


def test_share_counts_decisions_per_worker_across_policies():
    telemetry = RoutingTelemetry()
    for worker, policy in [("a", "prefix"), ("a", "round-robin"), ("b", "prefix"),
                           ("a", "prefix")]:
        telemetry.record(decision(worker, policy=policy))
    assert telemetry.share() == {"a": 3, "b": 1}


def test_index_health_tracks_the_latest_lookup():
    clock = Clock()
    telemetry = RoutingTelemetry(clock=clock)
    assert telemetry.index_health() == {"healthy": True, "last_error": None,
                                        "last_ok_age_s": None, "lookups": 0, "fallbacks": {}}
    telemetry.record_lookup(0.002, ok=True)
    clock.now += 7.5
    telemetry.record_lookup(0.05, ok=False, error="TimeoutError: no answer within 50 ms")
    telemetry.record(decision("a", fallback="index_timeout"))
    telemetry.record(decision("b", fallback="index_timeout"))
    telemetry.record(decision("a", fallback="no_prompt"))
    assert telemetry.index_health() == {
        "healthy": False, "last_error": "TimeoutError: no answer within 50 ms",
        "last_ok_age_s": 7.5, "lookups": 2,
        "fallbacks": {"index_timeout": 2, "no_prompt": 1}}
    telemetry.record_lookup(0.001, ok=True)
    health = telemetry.index_health()
    assert health["healthy"] and health["last_ok_age_s"] == 0.0
    assert health["last_error"] == "TimeoutError: no answer within 50 ms"  # the latest failure


def test_exposition_parses_with_exact_values():
    telemetry = RoutingTelemetry()
    telemetry.record(decision("a", blocks=4))
    telemetry.record(decision("a", blocks=2))
    telemetry.record(decision("b", blocks=0, fallback="index_error"))
    telemetry.record(decision("b", policy="round-robin"))
    for seconds in (0.0004, 0.001, 0.003, 2.0):
        telemetry.record_lookup(seconds, ok=True)
    telemetry.record_lookup(0.05, ok=False, error="ConnectionError")
    samples = scrape(telemetry)

    def value(name, **labels):
        return samples[(name, tuple(sorted(labels.items())))]

    assert value("nalar:router_decisions_total", worker="a", policy="prefix") == 2
    assert value("nalar:router_decisions_total", worker="b", policy="prefix") == 1
    assert value("nalar:router_decisions_total", worker="b", policy="round-robin") == 1
    assert value("nalar:router_cached_blocks_total", worker="a") == 6
    assert value("nalar:router_cached_blocks_total", worker="b") == 0
    assert value("nalar:router_fallbacks_total", reason="index_error") == 1
    assert value("nalar:index_up") == 0
    assert value("nalar:index_lookup_seconds_count") == 5
    assert abs(value("nalar:index_lookup_seconds_sum") - 2.0544) < 1e-9
    assert value("nalar:index_lookup_seconds_bucket", le="0.0005") == 1
    assert value("nalar:index_lookup_seconds_bucket", le="0.001") == 2  # le: bound included
    assert value("nalar:index_lookup_seconds_bucket", le="0.005") == 3
    assert value("nalar:index_lookup_seconds_bucket", le="0.05") == 4
    assert value("nalar:index_lookup_seconds_bucket", le="1.0") == 4
    assert value("nalar:index_lookup_seconds_bucket", le="+Inf") == 5


def test_concurrent_recording_loses_nothing():
    telemetry = RoutingTelemetry(capacity=10)

    def record_many(worker):
        for _ in range(2000):
            telemetry.record(decision(worker, blocks=1))
            telemetry.record_lookup(0.001, ok=True)

    threads = [threading.Thread(target=record_many, args=(w,)) for w in "abcd"]
    for thread in threads:
        thread.start()
    for _ in range(20):
        scrape(telemetry)  # a scrape meanwhile, as the metrics thread does
    for thread in threads:
        thread.join()
    assert telemetry.share() == {w: 2000 for w in "abcd"}
    assert telemetry.index_health()["lookups"] == 8000
    assert scrape(telemetry)[("nalar:router_cached_blocks_total", (("worker", "c"),))] == 2000
