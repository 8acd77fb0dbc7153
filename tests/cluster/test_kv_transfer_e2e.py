"""KV blocks fetched from another worker, through the whole cluster: a prompt whose holder is
busy goes to the other worker, which fetches the prefix from the holder over Ray instead of
computing it; the answer equals cold in fp32, and both workers count the transfer."""

from __future__ import annotations

import json
import random
import threading
import time
import uuid

import httpx
from prometheus_client.parser import text_string_to_metric_families


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(length)]


def complete(client: httpx.Client, tokens: list[int], max_tokens: int, **extra) -> httpx.Response:
    body = {"prompt": tokens, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            **extra}
    return client.post("/v1/completions", json=body, timeout=120)


def per_worker(client: httpx.Client, family: str, label: str | None = None,
               ) -> dict[str, dict[str, float]]:
    """Samples of the counter ``family`` in /metrics, per worker: by ``label`` when given,
    else by sample name (without the family's prefix and ``_total``)."""
    found: dict[str, dict[str, float]] = {}
    for metric in text_string_to_metric_families(client.get("/metrics").text):
        for sample in metric.samples:
            if sample.name.startswith(family) and sample.name.endswith("_total"):
                key = sample.labels[label] if label else sample.name.removeprefix(
                    family).removesuffix("_total")
                found.setdefault(sample.labels["worker"], {})[key] = sample.value
    return found


def test_a_busy_holders_prefix_is_fetched_by_the_other_worker(cluster):
    salt = uuid.uuid4().hex
    shared = prompt(1, 992)
    with httpx.Client(base_url=cluster.base_url) as client:
        first = complete(client, shared + prompt(2, 32), 1, cache_salt=salt)
        holder = first.headers["x-nalar-worker"]
        # A long answer on the same prefix keeps the holder busy (it goes there: the prefix).
        busy_done = threading.Event()

        def keep_busy() -> None:
            body = {"prompt": shared + prompt(3, 32), "max_tokens": 1500, "temperature": 0,
                    "ignore_eos": True, "stream": True, "cache_salt": salt}
            with client.stream("POST", "/v1/completions", json=body, timeout=300) as answer:
                assert answer.headers["x-nalar-worker"] == holder
                for _ in answer.iter_lines():
                    if busy_done.is_set():
                        return
        busy = threading.Thread(target=keep_busy)
        busy.start()
        try:
            question = shared + prompt(4, 32)
            time.sleep(1.0)  # the holder's load reaches the router
            answer = complete(client, question, 8, cache_salt=salt)
            cold = complete(client, question, 8, cache_salt=uuid.uuid4().hex)
        finally:
            busy_done.set()
            busy.join()
        fetched = per_worker(client, "nalar:kv_transfer_")
        sources = per_worker(client, "nalar:prompt_tokens_by_source", "source")
    worker = answer.headers["x-nalar-worker"]
    assert worker != holder
    usage = answer.json()["usage"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": 992, "cached_tokens_by_source": {
        "local_cache_hit": 0, "second_tier": 0, "external_kv_transfer": 992}}, json.dumps(usage)
    assert answer.json()["choices"][0]["text"] == cold.json()["choices"][0]["text"]
    assert fetched[worker]["imported_blocks"] >= 62
    assert fetched[holder]["exported_blocks"] >= 62
    assert fetched[worker]["rejected_blocks"] == 0
    assert sources[worker]["external_kv_transfer"] >= 992

