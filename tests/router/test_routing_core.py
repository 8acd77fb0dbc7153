"""Tests of the Ray-free routing core: the policies (prefix, round-robin, power-of-two) on
synthetic replica views with known answers, stats parsing and the sent-request ledger.
Cases R4 and R5 are from ``shared/cases/routing.md``."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from contract.load import ReplicaMetadata, RoutingStats
from router.routing.ledger import SentEntry, SentLedger
from router.routing.policies import (
    POLICY_NAMES,
    PowerOfTwoPolicy,
    PrefixPolicy,
    ReplicaView,
    RoundRobinPolicy,
    make_policy,
)
from router.routing.request_input import RoutingInput, uncached_tokens

BLOCK = 16


def assert_spread(counts: Counter, workers: list[str]):
    shares = [counts.get(w, 0) for w in workers]
    assert min(shares) > 0, shares
    assert max(shares) <= 1.5 * min(shares), shares


# ---- prefix ---------------------------------------------------------------------------------


def test_uncached_tokens_never_below_one():
    assert uncached_tokens(100, 0, BLOCK) == 100
    assert uncached_tokens(100, 2, BLOCK) == 68
    assert uncached_tokens(64, 4, BLOCK) == 1  # whole prompt cached: last token recomputed
    assert uncached_tokens(64, 9, BLOCK) == 1


def test_block_size_must_be_positive():
    with pytest.raises(ValueError):
        PrefixPolicy(0)


def test_rank_needs_candidates():
    with pytest.raises(ValueError):
        PrefixPolicy(BLOCK).rank([], 10)


def test_longer_prefix_wins_when_loads_equal():
    policy = PrefixPolicy(BLOCK, random.Random(0))
    views = [ReplicaView("a", 2, 0), ReplicaView("b", 5, 0), ReplicaView("c", 0, 0)]
    assert policy.rank(views, 200) == ["b", "a", "c"]


def test_r4_hit_never_wins_on_overloaded_replica():
    # A holds the whole 600-token prompt but has 20 requests x ~600 tokens queued; B is idle.
    policy = PrefixPolicy(BLOCK, random.Random(0))
    views = [ReplicaView("A", 600 // BLOCK, 20 * 600), ReplicaView("B", 0, 0)]
    assert policy.rank(views, 600)[0] == "B"


def test_a_worker_that_can_fetch_is_scored_by_the_fetch_and_takes_a_busy_holders_prefix():
    # A holds 62 of a 1,024-token prompt's blocks with 900 tokens queued. B and C are idle;
    # B measured a fetch at 2 tokens of work per block, C cannot fetch.
    policy = PrefixPolicy(BLOCK, random.Random(0))
    holder = ReplicaView("A", 62, 900)
    fetcher = ReplicaView("B", 0, 0, fetch_tokens_per_block=2)
    computer = ReplicaView("C", 0, 0)
    assert policy.score(fetcher, 1024, held_elsewhere=62) == 2 * 62 + 32
    assert policy.score(computer, 1024, held_elsewhere=62) == 1024
    assert policy.rank([holder, fetcher, computer], 1024) == ["B", "A", "C"]
    # Without a busy holder, the hit stays where it is.
    assert policy.rank([ReplicaView("A", 62, 50), fetcher, computer], 1024)[0] == "A"
    # A fetch dearer than computing is never counted.
    dear = ReplicaView("B", 0, 0, fetch_tokens_per_block=40)
    assert policy.score(dear, 1024, held_elsewhere=62) == 1024


def test_blocks_held_only_in_a_second_tier_cost_their_measured_load():
    # A 1,024-token prompt; A holds all 64 blocks but 40 only in its tier, B holds 64 in its pool.
    policy = PrefixPolicy(BLOCK, random.Random(0))
    pooled = ReplicaView("B", 64, 0)
    assert policy.score(ReplicaView("A", 64, 0, tier_blocks=40), 1024) == 1  # not measured yet
    cheap = ReplicaView("A", 64, 0, tier_blocks=40, tier_load_tokens_per_block=2)
    assert policy.score(cheap, 1024) == 1 + 40 * 2
    assert policy.rank([cheap, pooled], 1024) == ["B", "A"]
    # Slower than computing: the engine computes those blocks, so they cost a block's tokens.
    slow = ReplicaView("A", 64, 0, tier_blocks=40, tier_load_tokens_per_block=500)
    assert policy.score(slow, 1024) == 1 + 40 * BLOCK
    # A tier hit still beats recomputing on an idle worker with nothing cached.
    assert policy.rank([cheap, ReplicaView("C", 0, 0)], 1024)[0] == "A"


def test_hit_wins_over_small_load_gap():
    policy = PrefixPolicy(BLOCK, random.Random(0))
    views = [ReplicaView("A", 600 // BLOCK, 100), ReplicaView("B", 0, 0)]
    assert policy.rank(views, 600)[0] == "A"


@pytest.mark.parametrize("seed", range(50))
def test_r5_cache_misses_spread_on_every_seed(seed):
    rng = random.Random(seed)
    policy = PrefixPolicy(BLOCK, random.Random(seed))
    workers = ["w0", "w1", "w2"]
    counts = Counter()
    for _ in range(30):
        prompt_len = rng.randint(1, 400)
        views = [ReplicaView(w, 0, 0) for w in rng.sample(workers, 3)]
        counts[policy.choose(views, prompt_len)[0]] += 1
    assert_spread(counts, workers)


def test_equal_candidates_not_always_first():
    firsts = Counter()
    for seed in range(20):
        policy = PrefixPolicy(BLOCK, random.Random(seed))
        firsts[policy.rank([ReplicaView(w, 0, 0) for w in "abc"], 10)[0]] += 1
    assert len(firsts) > 1


def test_two_choices_without_index_answer():
    policy = PrefixPolicy(BLOCK, random.Random(0))
    loads = {"a": 0, "b": 500, "c": 1000}
    for _ in range(200):
        ranked = policy.rank([ReplicaView(w, None, load) for w, load in loads.items()], 50)
        assert sorted(ranked) == ["a", "b", "c"]
        assert ranked[0] != "c"  # the most loaded never wins a pair
    assert policy.rank([ReplicaView("solo", None, 9)], 50) == ["solo"]


def test_prefix_longest_cached_prefix_unless_load_outweighs_it():
    # 320-token prompt: a holds 15 blocks (80 tokens to prefill), b 5 blocks (240), c none.
    policy = PrefixPolicy(BLOCK, random.Random(0))
    views = [ReplicaView("a", 15, 100), ReplicaView("b", 5, 0), ReplicaView("c", 0, 0)]
    assert policy.rank(views, 320) == ["a", "b", "c"]  # scores 180, 240, 320
    assert [policy.score(v, 320) for v in views] == [180, 240, 320]
    heavier = [ReplicaView("a", 15, 161), ReplicaView("b", 5, 0), ReplicaView("c", 0, 0)]
    assert policy.rank(heavier, 320) == ["b", "a", "c"]  # 241 > 240: the load outweighs it


# ---- round-robin ----------------------------------------------------------------------------


def test_round_robin_cycles_in_worker_order_whatever_cache_and_load():
    policy = RoundRobinPolicy(random.Random(0))
    views = [ReplicaView("c", 9, 0), ReplicaView("a", 0, 5000), ReplicaView("b", 3, 10)]
    chosen = [policy.choose(views, 200)[0] for _ in range(7)]
    assert chosen == ["a", "b", "c", "a", "b", "c", "a"]
    assert policy.rank(views, 200) == ["b", "c", "a"]  # the whole order: next in turn first


def test_round_robin_new_worker_is_next_and_gone_one_is_skipped():
    policy = RoundRobinPolicy()
    views = [ReplicaView(w, None, 0) for w in "ab"]
    assert [policy.choose(views, 10)[0] for _ in range(3)] == ["a", "b", "a"]
    joined = [*views, ReplicaView("z", None, 0)]
    assert [policy.choose(joined, 10)[0] for _ in range(3)] == ["z", "b", "a"]
    policy.retain({"b", "z"})
    left = [ReplicaView(w, None, 0) for w in "bz"]
    assert [policy.choose(left, 10)[0] for _ in range(2)] == ["z", "b"]


# ---- power-of-two -----------------------------------------------------------------------------


def test_power_of_two_picks_the_less_loaded_of_the_sampled_pair():
    loads = {"a": 300, "b": 100, "c": 200, "d": 0}
    views = [ReplicaView(w, 40, load) for w, load in loads.items()]  # the cache is ignored
    for seed in range(30):
        pair = random.Random(seed).sample(views, 2)
        ranked = PowerOfTwoPolicy(random.Random(seed)).rank(views, 500)
        assert set(ranked[:2]) == {v.worker_id for v in pair}
        assert ranked[0] == min(pair, key=lambda v: v.load_tokens).worker_id
        assert sorted(ranked) == sorted(loads)


def test_power_of_two_never_picks_the_most_loaded_and_favours_the_least():
    policy = PowerOfTwoPolicy(random.Random(7))
    views = [ReplicaView(w, None, load) for w, load in zip("abcd", (0, 100, 200, 300), strict=True)]
    firsts = Counter(policy.rank(views, 10)[0] for _ in range(6000))
    assert firsts["d"] == 0
    # The least loaded wins every pair it is in: 3 of the 6 pairs; the next 2 of 6; then 1.
    assert abs(firsts["a"] / 6000 - 0.5) < 0.03
    assert abs(firsts["b"] / 6000 - 1 / 3) < 0.03
    assert abs(firsts["c"] / 6000 - 1 / 6) < 0.03


def test_make_policy_names_each_policy():
    assert POLICY_NAMES == ("prefix", "round-robin", "power-of-two")
    made = [make_policy(name, BLOCK) for name in POLICY_NAMES]
    assert [type(p) for p in made] == [PrefixPolicy, RoundRobinPolicy, PowerOfTwoPolicy]
    assert [p.uses_index for p in made] == [True, False, False]
    with pytest.raises(ValueError, match="unknown routing policy 'random'"):
        make_policy("random")


# ---- stats and the ledger ---------------------------------------------------------------------


def _queued_and_time(stats) -> tuple[int, float | None]:
    report = RoutingStats.from_wire(stats)
    return report.queued_tokens, report.time


def test_parse_routing_stats_is_defensive():
    assert _queued_and_time({"queued_tokens": 12, "time": 5.0}) == (12, 5.0)
    assert _queued_and_time({}) == (0, None)
    assert _queued_and_time(None) == (0, None)
    assert _queued_and_time({"queued_tokens": "lots", "time": True}) == (0, None)
    assert _queued_and_time({"queued_tokens": -3, "time": float("nan")}) == (0, None)


def test_parse_request_tokens_skips_malformed_entries():
    requests = {"a": 5, "b": -1, 3: 4, "c": "x"}
    assert RoutingStats.from_wire({"requests": requests}).requests == {"a": 5}
    assert RoutingStats.from_wire({"queued_tokens": 3}).requests is None
    assert RoutingStats.from_wire(None).requests is None


def test_routing_stats_round_trip_their_wire_form():
    """The worker writes and the router reads one type: every field survives the dict Serve
    carries, and the model key and worker id are read back; blanks read as unknown."""
    stats = RoutingStats(queued_tokens=40, requests={"r1": 30, "r2": 10}, running=1, waiting=1,
                         time=12.5, model_key="ab" * 32, worker_id="w1",
                         adapters=["cd" * 32], host_adapters=["ef" * 32],
                         adapter_read_tokens=12, adapter_swap_tokens=2, adapter_slots=4,
                         adapter_slots_busy=3, adapter_slot_wait_tokens=90,
                         kv_fetch_tokens_per_block=3, kv_tier_load_tokens_per_block=1)
    assert RoutingStats.from_wire(stats.to_wire()) == stats
    assert RoutingStats.from_wire({"kv_fetch_tokens_per_block": -1}).kv_fetch_tokens_per_block \
        is None
    malformed = RoutingStats.from_wire({"adapters": "cd", "adapter_read_tokens": -3})
    assert (malformed.adapters, malformed.adapter_read_tokens) == (None, 0)
    assert RoutingStats.from_wire({"adapters": ["a", "", 7]}).adapters == ["a"]
    metadata = ReplicaMetadata("k", "w")
    assert ReplicaMetadata.from_wire(metadata.to_wire()) == metadata
    assert ReplicaMetadata.from_wire({"model_key": "", "worker_id": 3}) == ReplicaMetadata()


def test_ledger_snapshot_and_age_clear_entries():
    ledger = SentLedger(max_age_s=10.0)
    ledger.record("r1", SentEntry("a", 100, 1.0, None, {}))
    ledger.record("r2", SentEntry("a", 50, 3.0, None, {}))
    assert ledger.outstanding("a", None) == 150
    assert ledger.outstanding("a", 2.0) == 50  # the snapshot at t=2 already counts r1
    assert ledger.get("r1") is not None  # kept until completion, which must name the request
    ledger.expire(now=20.0)
    assert ledger.outstanding("a", None) == 0
    assert len(ledger) == 0


def test_ledger_remove_only_on_named_worker():
    ledger = SentLedger()
    ledger.record("r", SentEntry("b", 10, 1.0, None, {}))
    ledger.remove("r", "a")  # a stale completion from an earlier, rejected attempt on "a"
    assert ledger.outstanding("b", None) == 10
    ledger.remove("r", "b")
    assert len(ledger) == 0


def test_ledger_knows_the_prompt_blocks_in_flight_on_each_worker():
    ledger = SentLedger()
    shared = [bytes([i]) * 32 for i in range(6)]
    plan = RoutingInput(96, shared, 16, "r1")
    other = RoutingInput(64, shared[:2] + [b"x" * 32, b"y" * 32], 16, "r2")
    ledger.record("r1", SentEntry("a", 10, 1.0, plan, {}))
    ledger.record("r2", SentEntry("a", 10, 1.0, other, {}))
    assert ledger.leading_blocks_in_flight("a", shared) == 6
    assert ledger.leading_blocks_in_flight("a", shared[:3] + [b"z" * 32]) == 3
    assert ledger.leading_blocks_in_flight("b", shared) == 0
    ledger.remove("r1")  # finished: only r2's first two blocks remain pinned
    assert ledger.leading_blocks_in_flight("a", shared) == 2
    ledger.move("r2", "b", 10)  # Ray sent it elsewhere
    assert ledger.leading_blocks_in_flight("a", shared) == 0
    assert ledger.leading_blocks_in_flight("b", shared) == 2
    ledger.drop_worker("b")
    assert ledger.leading_blocks_in_flight("b", shared) == 0


def test_ledger_takes_prompts_shorter_than_a_block():
    """Prompts shorter than one block have no digests. Two of them alone on a worker, then
    beside a long one: every removal goes through and the long one's blocks stay counted
    (the second short removal raised KeyError, a logged traceback for most short requests of
    a 300-request burst through HTTP)."""
    ledger = SentLedger()

    def short(key: str) -> SentEntry:
        return SentEntry("a", 5, 1.0, RoutingInput(5, [], 16, key), {})

    ledger.record("short1", short("short1"))
    ledger.record("short2", short("short2"))
    ledger.remove("short1")
    ledger.remove("short2")
    assert len(ledger) == 0
    shared = [bytes([i]) * 32 for i in range(3)]
    ledger.record("long", SentEntry("a", 48, 1.0, RoutingInput(48, shared, 16, "long"), {}))
    ledger.record("short3", short("short3"))
    ledger.remove("short3")
    assert ledger.leading_blocks_in_flight("a", shared) == 3
    ledger.remove("long")
    assert len(ledger) == 0 and ledger.leading_blocks_in_flight("a", shared) == 0
