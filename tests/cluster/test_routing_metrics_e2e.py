"""Router telemetry end to end: requests through HTTP show up in ``GET /metrics`` as routing
decisions with the blocks the index credited to the chosen worker."""

from __future__ import annotations

import asyncio

import httpx
from prometheus_client.parser import text_string_to_metric_families

SYSTEM = " ".join(f"Clause {i}: the tenant pays on the first of the month." for i in range(40))


def routing_samples(text: str) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            if family.name.startswith(("nalar:router", "nalar:index"))
            for s in family.samples}


def total(samples: dict, name: str, **labels) -> float:
    return sum(value for (sample, sample_labels), value in samples.items()
               if sample == name and labels.items() <= dict(sample_labels).items())


async def test_metrics_count_decisions_and_credited_blocks(cluster):
    body = {"messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": "When is rent due?"}],
            "max_tokens": 4, "temperature": 0}
    async with httpx.AsyncClient(base_url=cluster.base_url, timeout=120) as client:
        before = routing_samples((await client.get("/metrics")).text)
        first = await client.post("/v1/chat/completions", json=body)
        assert first.status_code == 200, first.text
        holder = first.headers["x-nalar-worker"]
        for _ in range(100):  # the first request's blocks reach the index asynchronously
            second = await client.post("/v1/chat/completions", json=body)
            assert second.status_code == 200, second.text
            if second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0:
                break
            await asyncio.sleep(0.1)
        after = routing_samples((await client.get("/metrics")).text)
    assert second.headers["x-nalar-worker"] == holder
    decided = (total(after, "nalar:router_decisions_total", policy="prefix")
               - total(before, "nalar:router_decisions_total", policy="prefix"))
    assert decided >= 2
    credited = (total(after, "nalar:router_cached_blocks_total", worker=holder)
                - total(before, "nalar:router_cached_blocks_total", worker=holder))
    assert credited >= 8  # the ~500-token system prompt: dozens of 16-token blocks
    assert after[("nalar:index_up", ())] == 1
    assert total(after, "nalar:index_lookup_seconds_count") >= decided
