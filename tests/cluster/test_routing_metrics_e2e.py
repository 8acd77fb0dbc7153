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


def credited_to(worker: str, before: dict, after: dict) -> float:
    """Blocks the index credited ``worker`` with between two scrapes."""
    return (total(after, "nalar:router_cached_blocks_total", worker=worker)
            - total(before, "nalar:router_cached_blocks_total", worker=worker))


async def test_metrics_count_decisions_and_credited_blocks(cluster):
    body = {"messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": "When is rent due?"}],
            "max_tokens": 4, "temperature": 0}
    async with httpx.AsyncClient(base_url=cluster.base_url, timeout=120) as client:
        before = routing_samples((await client.get("/metrics")).text)
        first = await client.post("/v1/chat/completions", json=body)
        assert first.status_code == 200, first.text
        holder = first.headers["x-nalar-worker"]
        for _ in range(100):  # until the index has heard of the first request's blocks
            second = await client.post("/v1/chat/completions", json=body)
            assert second.status_code == 200, second.text
            # Before the index hears, the router's record of what it sent keeps the repeat
            # with its prefix. CI saw it go to the other worker: the other reported fetching a
            # block as 0 tokens of work, so fetching the whole prefix there tied with the
            # holder, and the tie went to the worker chosen less recently (now at least 1).
            assert second.headers["x-nalar-worker"] == holder
            assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
            after = routing_samples((await client.get("/metrics")).text)
            if credited_to(holder, before, after) >= 8:
                break
            await asyncio.sleep(0.1)
    decided = (total(after, "nalar:router_decisions_total", policy="prefix")
               - total(before, "nalar:router_decisions_total", policy="prefix"))
    assert decided >= 2
    assert credited_to(holder, before, after) >= 8  # the ~500-token prompt: dozens of blocks
    assert after[("nalar:index_up", ())] == 1
    assert total(after, "nalar:index_lookup_seconds_count") >= decided
