"""The router's own record of which prompt prefixes it sent where (``SentPrefixes``): leading
runs, the cap with its eviction order, age-out and forgetting workers."""

from __future__ import annotations

import hashlib

import pytest

from router.routing.sent_prefixes import SentPrefixes


def chain(n_blocks: int, salt: str) -> list[bytes]:
    return [hashlib.sha256(f"{salt}/{i}".encode()).digest() for i in range(n_blocks)]


def test_leading_run_per_worker_stops_at_the_first_block_not_sent():
    record = SentPrefixes()
    shared = chain(40, "system")
    record.record("a", shared, now=0.0)
    record.record("b", shared[:10], now=0.0)
    longer = shared + chain(5, "question")
    assert record.leading_blocks(longer, ["a", "b", "c"], now=1.0) == {"a": 40, "b": 10, "c": 0}
    # A prompt that parts from the record after 3 blocks matches 3, whatever follows.
    parted = shared[:3] + chain(37, "other")
    assert record.leading_blocks(parted, ["a", "b"], now=1.0) == {"a": 3, "b": 3}
    assert len(record) == 50


def test_cap_is_respected_and_evicts_a_prefix_tail_before_its_head():
    record = SentPrefixes(max_entries=50)
    first, second = chain(40, "first"), chain(20, "second")
    record.record("a", first, now=0.0)
    record.record("b", second, now=1.0)
    assert len(record) == 50
    # The 10 least recently sent pairs were the first prompt's last 10 blocks: its head stays.
    assert record.leading_blocks(first, ["a"], now=2.0) == {"a": 30}
    assert record.leading_blocks(second, ["b"], now=2.0) == {"b": 20}
    for i in range(10):
        record.record("c", chain(40, f"more{i}"), now=3.0 + i)
        assert len(record) == 50
    assert record.workers() == {"c"}


def test_resending_a_prefix_makes_it_the_most_recent():
    record = SentPrefixes(max_entries=40)
    old, new = chain(20, "old"), chain(20, "new")
    record.record("a", old, now=0.0)
    record.record("a", new, now=1.0)
    record.record("a", old, now=2.0)  # sent again: now the newest
    record.record("b", chain(20, "third"), now=3.0)
    assert record.leading_blocks(old, ["a"], now=4.0) == {"a": 20}
    assert record.leading_blocks(new, ["a"], now=4.0) == {"a": 0}


def test_a_shorter_window_counts_only_the_blocks_sent_within_it():
    record = SentPrefixes(max_age_s=60.0)
    prompt = chain(12, "p")
    record.record("a", prompt[:8], now=100.0)
    record.record("a", prompt, now=109.5)  # resent longer: every block touched again
    record.record("b", prompt[:4], now=100.0)
    assert record.leading_blocks(prompt, "ab", now=110.0, within_s=1.0) == {"a": 12, "b": 0}
    assert record.leading_blocks(prompt, "ab", now=110.6, within_s=1.0) == {"a": 0, "b": 0}
    assert record.leading_blocks(prompt, "ab", now=110.6) == {"a": 12, "b": 4}
    record.record("a", prompt[:5], now=111.0)  # only the leading 5 are fresh
    assert record.leading_blocks(prompt, "a", now=111.5, within_s=1.0) == {"a": 5}


def test_entries_age_out():
    record = SentPrefixes(max_age_s=60.0)
    early, late = chain(8, "early"), chain(8, "late")
    record.record("a", early, now=100.0)
    record.record("a", late, now=130.0)
    assert record.leading_blocks(early, ["a"], now=160.0) == {"a": 8}  # exactly 60 s: counts
    assert record.leading_blocks(early, ["a"], now=160.5) == {"a": 0}
    assert len(record) == 8
    assert record.leading_blocks(late, ["a"], now=190.5) == {"a": 0}
    assert len(record) == 0 and record.workers() == set()


def test_dead_or_removed_workers_are_forgotten():
    record = SentPrefixes()
    prompt = chain(16, "p")
    for worker in "abc":
        record.record(worker, prompt, now=0.0)
    record.drop_worker("a")
    record.drop_worker("never-seen")
    assert record.leading_blocks(prompt, "abc", now=1.0) == {"a": 0, "b": 16, "c": 16}
    record.retain({"c"})
    assert record.workers() == {"c"} and len(record) == 16


@pytest.mark.parametrize("kwargs", [{"max_entries": 0}, {"max_age_s": 0.0},
                                    {"max_age_s": float("nan")}])
def test_bounds_must_be_positive(kwargs):
    with pytest.raises(ValueError):
        SentPrefixes(**kwargs)


def test_other_prefixes_counts_distinct_leading_blocks_besides_the_prompts_own():
    record = SentPrefixes(max_entries=100, max_age_s=10.0)
    tenant_a, tenant_b = chain(8, "tenant-a"), chain(8, "tenant-b")
    record.record("w", tenant_a + chain(2, "turn-1"), now=0.0)
    record.record("w", tenant_a + chain(2, "turn-2"), now=1.0)  # the same prefix again
    record.record("w", tenant_b, now=2.0)
    assert record.other_prefixes("w", tenant_a, now=3.0) == 1  # tenant b's only
    assert record.other_prefixes("w", chain(4, "new"), now=3.0) == 2
    assert record.other_prefixes("elsewhere", tenant_a, now=3.0) == 0
    assert record.other_prefixes("w", [], now=3.0) == 2
    # Aged out, evicted or forgotten prefixes no longer count.
    assert record.other_prefixes("w", chain(4, "new"), now=11.5) == 1  # tenant a's aged out
    record.record("v", chain(100, "big"), now=12.0)  # the cap evicts every pair of w's
    assert record.other_prefixes("w", chain(4, "new"), now=12.0) == 0
    record.drop_worker("v")
    assert record.other_prefixes("v", chain(4, "new"), now=12.0) == 0
