"""Workload generators and the arrival process: seeded, and shaped as documented."""

from __future__ import annotations

import collections
import itertools
import json
import math
import statistics
import sysconfig
from pathlib import Path

import pytest

from bench.arrival import poisson_gaps
from bench.records import RequestRecord
from bench.workloads import WorkloadConfig, sessions
from bench.workloads.json_schema import SCHEMAS, output_is_valid


def _requests(config, count):
    return [session.next_request(None) for session in itertools.islice(sessions(config), count)]


def test_shared_prefix_tenants():
    config = WorkloadConfig(name="shared-prefix", tenants=4, prefix_tokens=50, input_tokens=10,
                            output_tokens=7, seed=3)
    requests = _requests(config, 200)
    by_tenant: dict[str, list] = {}
    for request in requests:
        by_tenant.setdefault(request.label, []).append(request)
    assert sorted(by_tenant) == [f"tenant-{i}" for i in range(4)]
    keys = {label: {r.api_key for r in group} for label, group in by_tenant.items()}
    assert all(len(k) == 1 for k in keys.values())  # one key per tenant ...
    assert len({next(iter(k)) for k in keys.values()}) == 4  # ... distinct across tenants
    prompts = {label: {r.messages[0]["content"] for r in group}
               for label, group in by_tenant.items()}
    assert all(len(p) == 1 for p in prompts.values())  # the prefix is identical per tenant
    assert len({next(iter(p)) for p in prompts.values()}) == 4
    assert all(len(next(iter(p)).split()) == 52 for p in prompts.values())  # "Tenant i." + 50
    users = [r.messages[1]["content"] for r in requests]
    assert len(set(users)) == 200 and all(len(u.split()) == 10 for u in users)
    assert {r.max_tokens for r in requests} == {7}
    assert [r.messages for r in _requests(config, 20)] == [r.messages for r in requests[:20]]


def test_a_hot_tenant_takes_its_share_and_the_rest_spread():
    config = WorkloadConfig(name="shared-prefix", tenants=5, prefix_tokens=8, input_tokens=4,
                            output_tokens=2, seed=1, hot_share=0.8)
    counts = collections.Counter(r.label for r in _requests(config, 4000))
    assert 0.77 < counts["tenant-0"] / 4000 < 0.83
    others = [counts[f"tenant-{i}"] for i in range(1, 5)]
    assert min(others) > 0.8 * max(others)
    with pytest.raises(ValueError):
        WorkloadConfig(name="shared-prefix", tenants=1, hot_share=0.8)


def test_multi_turn_history_grows_with_the_replies():
    config = WorkloadConfig(name="multi-turn", turns=3, input_tokens=5, think_time_s=0.5)
    conversation = next(sessions(config))
    assert (conversation.max_requests, conversation.think_time_s) == (3, 0.5)
    first = conversation.next_request(None)
    assert [m["role"] for m in first.messages] == ["user"]
    reply = RequestRecord(label="c", start_s=0, output_text="reply one", completion_tokens=2)
    second = conversation.next_request(reply)
    assert [m["role"] for m in second.messages] == ["user", "assistant", "user"]
    assert second.messages[:1] == first.messages
    assert second.messages[1]["content"] == "reply one"
    assert second.estimated_prompt_tokens == 5 + 2 + 5
    third = conversation.next_request(
        RequestRecord(label="c", start_s=0, output_text="reply two", completion_tokens=2))
    assert len(third.messages) == 5 and third.messages[:3] == second.messages
    assert conversation.next_request(RequestRecord(label="c", start_s=0)) is None  # 3 turns


def test_multi_turn_failure_ends_the_conversation():
    conversation = next(sessions(WorkloadConfig(name="multi-turn", turns=5)))
    conversation.next_request(None)
    failed = RequestRecord(label="c", start_s=0, failure="http", error="HTTP 500: x")
    assert conversation.next_request(failed) is None


def test_multi_turn_conversations_differ():
    firsts = [r.messages[0]["content"] for r in
              _requests(WorkloadConfig(name="multi-turn", input_tokens=8), 10)]
    assert len(set(firsts)) == 10


def test_copy_tasks_quote_real_stdlib_source():
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    requests = _requests(WorkloadConfig(name="copy", input_tokens=100, seed=1), 5)
    corpus = "\n".join(p.read_text(errors="replace") for p in stdlib.rglob("*.py")
                       if "site-packages" not in p.parts)
    for request in requests:
        content = request.messages[0]["content"]
        assert content.startswith("Rewrite this code")
        snippet = content.split("```python\n", 1)[1].rsplit("\n```", 1)[0]
        assert snippet in corpus
        assert snippet.lstrip().startswith(("def ", "class ", "async def "))
    # ~100 tokens of 4 characters: whole lines until 400 characters (newlines included) are
    # reached, unless the file ends first.
    lengths = [len(r.messages[0]["content"].split("```python\n", 1)[1]) - 4 for r in requests]
    assert sum(399 <= n < 600 for n in lengths) >= 4


def test_random_lengths_stay_in_range():
    config = WorkloadConfig(name="random", input_tokens=100, output_tokens=50, range_ratio=0.5)
    requests = _requests(config, 300)
    inputs = [len(r.messages[0]["content"].split()) for r in requests]
    outputs = [r.max_tokens for r in requests]
    assert min(inputs) >= 50 and max(inputs) <= 150 and len(set(inputs)) > 50
    assert min(outputs) >= 25 and max(outputs) <= 75
    fixed = _requests(WorkloadConfig(name="random", input_tokens=30), 10)
    assert {len(r.messages[0]["content"].split()) for r in fixed} == {30}


def test_bad_workload_settings():
    with pytest.raises(ValueError):
        WorkloadConfig(range_ratio=1.0)
    with pytest.raises(ValueError):
        WorkloadConfig(tenants=0)
    with pytest.raises(ValueError):
        sessions(WorkloadConfig(name="nope"))


def test_poisson_inter_arrival_times():
    gaps = list(itertools.islice(poisson_gaps(rate=4.0, seed=11), 20_000))
    mean = statistics.fmean(gaps)
    assert mean == pytest.approx(0.25, rel=0.03)
    # Exponential gaps: standard deviation equals the mean, P(gap > mean) = 1/e.
    assert statistics.pstdev(gaps) / mean == pytest.approx(1.0, rel=0.05)
    assert sum(g > 0.25 for g in gaps) / len(gaps) == pytest.approx(math.exp(-1), abs=0.015)
    assert list(itertools.islice(poisson_gaps(4.0, seed=11), 5)) == gaps[:5]
    assert list(itertools.islice(poisson_gaps(math.inf, seed=0), 3)) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError):
        next(poisson_gaps(0.0, seed=0))


def test_lora_adapters_uniform_and_zipf_per_session():
    from collections import Counter

    from bench.adapters import AdapterMix, with_adapters

    names = ["a", "b", "c", "d"]
    config = WorkloadConfig(name="multi-turn", turns=3, input_tokens=8, output_tokens=4, seed=1)
    for distribution, weights in (("uniform", [1, 1, 1, 1]),
                                  ("zipf", [1, 1 / 2, 1 / 3, 1 / 4])):
        stream = with_adapters(sessions(config), AdapterMix(names, distribution, seed=5))
        counts = Counter()
        for session in itertools.islice(stream, 4000):
            first = session.next_request(None)
            second = session.next_request(RequestRecord(label=first.label, start_s=0.0,
                                                        output_text="ok"))
            assert second is not None and second.model == first.model  # one per session
            counts[first.model] += 1
        expected = [4000 * w / sum(weights) for w in weights]
        for name, share in zip(names, expected, strict=True):
            assert abs(counts[name] - share) < 4 * math.sqrt(share), (distribution, counts)
    again = with_adapters(sessions(config), AdapterMix(names, "zipf", seed=5))
    assert [s.next_request(None).model for s in itertools.islice(again, 20)] == [
        s.next_request(None).model for s in itertools.islice(
            with_adapters(sessions(config), AdapterMix(names, "zipf", seed=5)), 20)]
    with pytest.raises(ValueError, match="unknown --lora-distribution"):
        AdapterMix(names, "pareto")


VALID_JSON = {
    "order": {"id": "ORD-004211", "items": [{"sku": "BK-7", "quantity": 2, "price": 12.5}],
              "status": "paid"},
    "person": {"name": "Ada", "age": 36, "email": "ada@example.org",
               "address": {"city": "London", "country": "GB"}},
    "event": {"title": "Jazz night", "starts": "2026-12-06T20:00:00Z", "location": None,
              "attendees": ["Ben"]},
    "review": {"rating": 4, "pros": ["quiet"], "cons": [], "recommend": True},
    "tool_call": {"name": "search_web", "arguments": {"query": "bakeries", "limit": 3}},
}


def test_json_requests_ask_for_every_schema_and_outputs_are_checked_against_it():
    config = WorkloadConfig(name="json", output_tokens=200, seed=4)
    requests = _requests(config, 100)
    assert {r.label for r in requests} == {f"json-{name}" for name in SCHEMAS}
    assert [r.messages for r in _requests(config, 10)] == [r.messages for r in requests[:10]]
    for request in requests:
        name = request.label.removeprefix("json-")
        assert request.response_format == {"type": "json_schema", "json_schema": {
            "name": name, "schema": SCHEMAS[name], "strict": True}}
        assert request.max_tokens == 200
    formats = {r.label.removeprefix("json-"): r.response_format for r in requests}
    for name, value in VALID_JSON.items():
        assert output_is_valid(formats[name], json.dumps(value)), name
    invalid = [
        ("order", {**VALID_JSON["order"], "status": "lost"}),  # outside the enum
        ("order", {**VALID_JSON["order"], "id": "ORD-42"}),  # off the pattern
        ("person", {**VALID_JSON["person"], "email": "not an address"}),  # format checked
        ("event", {**VALID_JSON["event"], "starts": "tonight"}),
        ("review", {k: v for k, v in VALID_JSON["review"].items() if k != "rating"}),
        ("tool_call", {**VALID_JSON["tool_call"], "extra": 1}),  # no additional properties
    ]
    for name, value in invalid:
        assert not output_is_valid(formats[name], json.dumps(value)), (name, value)
    text = json.dumps(VALID_JSON["review"])
    assert not output_is_valid(formats["review"], text[:-1])  # cut short: does not parse
    assert not output_is_valid(formats["review"], text + " and more")
    assert output_is_valid({"type": "json_object"}, text)
    assert not output_is_valid({"type": "json_object"}, "[1, 2]")
