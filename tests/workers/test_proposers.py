"""Draft proposers: prompt lookup (``ngram``), the cross-request suffix index, the builder.

Hand-built token lists pin exact proposals; seeded random runs compare both proposers with
brute-force references that follow their definitions literally.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest

from workers.speculative.build import build_proposer
from workers.speculative.config import SpeculativeConfig
from workers.speculative.ngram import NgramProposer
from workers.speculative.proposer import ProposalRequest
from workers.speculative.suffix import ScopedSuffixProposer, SuffixProposer


def req(request_id: str, token_ids: list[int], k: int = 4, scope: str = "") -> ProposalRequest:
    return ProposalRequest(request_id=request_id, token_ids=list(token_ids),
                           num_prompt_tokens=len(token_ids), k=k, scope=scope)


# -- ngram ----------------------------------------------------------------------------------

def reference_ngram(tokens: list[int], k: int, ngram_min: int, ngram_max: int) -> list[int]:
    """Prompt lookup by definition: longest n first, then the latest earlier occurrence."""
    size = len(tokens)
    for n in range(ngram_max, ngram_min - 1, -1):
        suffix = tokens[size - n:]
        for end in range(size - 2, n - 2, -1):  # an occurrence ending before the last token
            if tokens[end - n + 1:end + 1] == suffix:
                return tokens[end + 1:end + 1 + k]
    return []


def test_ngram_longest_match_wins_over_a_more_recent_shorter_one():
    tokens = [1, 2, 3, 9, 7, 2, 3, 8, 1, 2, 3]
    assert NgramProposer(1, 3).propose_one(tokens, 3) == [9, 7, 2]
    # Capped at n = 2, the most recent (2, 3) wins instead.
    assert NgramProposer(1, 2).propose_one(tokens, 3) == [8, 1, 2]


def test_ngram_most_recent_occurrence_and_truncation_at_k():
    tokens = [1, 2, 5, 1, 2, 6, 1, 2]
    assert NgramProposer(1, 4).propose_one(tokens, 2) == [6, 1]


def test_ngram_truncates_at_the_end_of_the_sequence():
    assert NgramProposer(1, 2).propose_one([4, 5, 6, 4, 5], 5) == [6, 4, 5]
    # An occurrence may overlap the suffix: (5, 5) ends at index 1, one token follows.
    assert NgramProposer(1, 4).propose_one([5, 5, 5], 3) == [5]


def test_ngram_no_match_and_ngram_min():
    assert NgramProposer(1, 4).propose_one([1, 2, 3, 4], 3) == []
    assert NgramProposer(1, 4).propose_one([], 3) == []
    assert NgramProposer(1, 4).propose_one([7], 3) == []
    tokens = [1, 2, 9, 3, 2]
    assert NgramProposer(1, 3).propose_one(tokens, 3) == [9, 3, 2]
    assert NgramProposer(2, 3).propose_one(tokens, 3) == []
    assert NgramProposer(1, 3).propose_one(tokens, 0) == []


def test_ngram_batch_keeps_order_and_finish_is_a_no_op():
    proposer = NgramProposer()
    out = proposer.propose([req("a", [1, 2, 3, 1, 2], k=2), req("b", [4, 5, 6], k=2)])
    assert out == [[3, 1], []]
    proposer.finish(["a", "b"])
    assert proposer.propose([req("a", [1, 2, 3, 1, 2], k=2)]) == [[3, 1]]
    assert proposer.name == "ngram"


@pytest.mark.parametrize("vocab", [2, 5, 50])
def test_ngram_matches_the_reference_on_random_sequences(vocab):
    rng = random.Random(vocab)
    for _ in range(300):
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(0, 60))]
        ngram_min = rng.randint(1, 3)
        ngram_max = rng.randint(ngram_min, 6)
        k = rng.randint(1, 6)
        got = NgramProposer(ngram_min, ngram_max).propose_one(tokens, k)
        assert got == reference_ngram(tokens, k, ngram_min, ngram_max), (tokens, k)


@pytest.mark.parametrize("bounds", [(0, 4), (3, 2), (-1, 1)])
def test_ngram_rejects_bad_bounds(bounds):
    with pytest.raises(ValueError):
        NgramProposer(*bounds)


# -- suffix ---------------------------------------------------------------------------------

def reference_counts(seqs: list[list[int]], context: list[int], min_match: int,
                     max_match: int) -> tuple[int, dict[int, int]]:
    """The longest suffix of ``context`` followed by a token somewhere in ``seqs``, and the
    counts of those tokens (events are positions >= ``min_match``)."""
    for n in range(min(max_match, len(context)), min_match - 1, -1):
        suffix = context[len(context) - n:]
        counts = Counter(seq[pos] for seq in seqs for pos in range(n, len(seq))
                         if seq[pos - n:pos] == suffix)
        if counts:
            return n, dict(counts)
    return 0, {}


def counts_of(proposer: SuffixProposer, context: list[int]) -> tuple[int, dict[int, int]]:
    n, counts = proposer.continuation_counts(context)
    if not counts:
        return 0, {}
    return n, {token: entry[0] for token, entry in counts.items()}


def live_sequences(proposer: SuffixProposer) -> list[list[int]]:
    """What the index should hold: running and finished sequences not evicted."""
    seqs = list(proposer._active.values()) + list(proposer._finished.values())
    return [list(seq.tokens) for seq in seqs]


def assert_index_matches(proposer: SuffixProposer, seqs: list[list[int]], contexts) -> None:
    for context in contexts:
        expected = reference_counts(seqs, context, proposer.min_match, proposer.max_match)
        assert counts_of(proposer, context) == expected, context


def test_suffix_proposes_across_requests():
    proposer = SuffixProposer()
    assert proposer.propose([req("a", [10, 11, 12, 13, 14, 15])]) == [[]]
    proposer.finish(["a"])
    # b reaches (11, 12): a's continuation, stopping where a ended.
    assert proposer.propose([req("b", [99, 11, 12], k=5)]) == [[13, 14, 15]]
    assert proposer.propose([req("c", [99, 11, 12], k=2)]) == [[13, 14]]
    assert proposer.name == "suffix"


def test_suffix_longest_match_then_most_frequent_then_most_recent():
    proposer = SuffixProposer()
    proposer.propose([req("a", [1, 2, 3, 4]), req("b", [6, 2, 3, 5]), req("c", [7, 2, 3, 5])])
    # (2, 3) was followed by 5 twice and by 4 once.
    assert proposer.propose([req("q1", [8, 2, 3], k=1)]) == [[5]]
    # (1, 2, 3) is longer and only ever followed by 4.
    assert proposer.propose([req("q2", [1, 2, 3], k=1)]) == [[4]]

    tie = SuffixProposer()
    tie.propose([req("a", [1, 2, 3, 4])])
    tie.propose([req("b", [6, 2, 3, 5])])
    assert tie.propose([req("q", [8, 2, 3], k=1)]) == [[5]]  # the later one
    tie.propose([req("c", [7, 2, 3, 4])])
    assert tie.propose([req("q", [8, 2, 3], k=1)]) == [[4]]  # 4 now has two events
    tie.propose([req("d", [9, 2, 3, 5])])
    assert tie.propose([req("q", [8, 2, 3], k=1)]) == [[5]]  # two each, 5 indexed last


def test_suffix_own_end_is_not_a_match_but_its_earlier_tokens_are():
    proposer = SuffixProposer()
    assert proposer.propose([req("a", [1, 2, 3], k=3)]) == [[]]
    assert proposer.propose([req("b", [5, 6, 7, 5, 6], k=3)]) == [[7, 5, 6]]


def test_suffix_incremental_ingestion_equals_one_shot():
    rng = random.Random(1)
    seqs = [[rng.randrange(4) for _ in range(80)] for _ in range(3)]
    one_shot, incremental = SuffixProposer(), SuffixProposer()
    one_shot.propose([req(f"r{i}", seq) for i, seq in enumerate(seqs)])
    for cut in range(0, 81, 7):
        incremental.propose([req(f"r{i}", seq[:cut]) for i, seq in enumerate(seqs)])
    incremental.propose([req(f"r{i}", seq) for i, seq in enumerate(seqs)])
    assert one_shot.num_tokens == incremental.num_tokens == 240
    contexts = [seq[:end] for seq in seqs for end in range(0, 81, 3)]
    for context in contexts:
        assert counts_of(one_shot, context) == counts_of(incremental, context)
    assert_index_matches(incremental, seqs, contexts)


def test_suffix_divergence_reindexes_from_the_first_changed_token():
    proposer, fresh = SuffixProposer(), SuffixProposer()
    proposer.propose([req("a", [1, 2, 3, 4, 5, 1, 2])])
    assert proposer.propose([req("q", [0, 1, 2], k=1)]) == [[3]]
    proposer.propose([req("a", [1, 2, 9, 9, 5])])  # changed from index 2
    fresh.propose([req("a", [1, 2, 9, 9, 5]), req("q", [0, 1, 2])])
    assert proposer.num_tokens == fresh.num_tokens == 5 + 3
    contexts = [[1, 2], [2, 3], [3, 4], [4, 5], [2, 9], [9, 9], [0, 1, 2]]
    for context in contexts:
        assert counts_of(proposer, context) == counts_of(fresh, context)
    assert proposer.propose([req("q", [0, 1, 2], k=1)]) == [[9]]
    # A shorter list drops the tail too.
    proposer.propose([req("a", [1, 2])])
    assert proposer.num_tokens == 2 + 3
    assert counts_of(proposer, [2, 9]) == (0, {})


def test_suffix_finish_keeps_corpus_and_a_reused_id_starts_a_new_sequence():
    proposer = SuffixProposer()
    proposer.propose([req("a", [1, 2, 3, 4])])
    proposer.finish(["a", "never-seen"])
    proposer.propose([req("a", [1, 2, 3, 5])])
    assert proposer.num_tokens == 8
    assert counts_of(proposer, [2, 3]) == (2, {4: 1, 5: 1})


def test_suffix_evicts_finished_first_then_least_recent_running():
    proposer = SuffixProposer(max_tokens=10)
    proposer.propose([req("a", [1, 2, 3, 4, 5, 6])])
    proposer.finish(["a"])
    proposer.propose([req("b", [7, 8, 9, 7, 8, 9])])
    # 12 tokens > 10: finished a goes, with every count it contributed.
    assert proposer.num_tokens == 6
    assert counts_of(proposer, [2, 3]) == (0, {})
    assert_index_matches(proposer, [[7, 8, 9, 7, 8, 9]], [[7, 8], [8, 9], [9, 7], [1, 7, 8]])

    proposer.propose([req("c", [20, 21, 22, 23, 24, 25])])
    # Only running sequences left: b (least recently updated) goes and is not re-indexed.
    assert proposer.num_tokens == 6
    assert proposer.propose([req("b", [7, 8, 9, 7, 8, 9, 7], k=2)]) == [[]]
    assert proposer.num_tokens == 6
    assert proposer.propose([req("x", [0, 21, 22], k=2)]) == [[23, 24]]


def test_suffix_evicting_everything_leaves_an_empty_index():
    proposer = SuffixProposer(max_tokens=10)
    proposer.propose([req("a", [1, 2, 1, 2, 1, 2])])
    proposer.finish(["a"])
    # One running sequence bigger than the cap evicts a, then itself.
    assert proposer.propose([req("b", [1, 2, 1, 2, 1, 2, 1, 2, 1, 2, 1], k=3)]) == [[]]
    assert proposer.num_tokens == 0
    assert proposer._root.total == 0 and not proposer._root.children
    assert counts_of(proposer, [1, 2]) == (0, {})


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_suffix_matches_the_reference_under_random_growth_divergence_and_eviction(seed):
    rng = random.Random(seed)
    proposer = SuffixProposer(min_match=rng.randint(1, 2), max_match=rng.randint(3, 6),
                              max_tokens=rng.choice([40, 120, 10_000]))
    running: dict[str, list[int]] = {}
    next_id = 0
    for _ in range(60):
        if len(running) < 3 or rng.random() < 0.2:
            running[f"r{next_id}"] = [rng.randrange(3) for _ in range(rng.randrange(0, 12))]
            next_id += 1
        for tokens in running.values():
            if rng.random() < 0.1 and tokens:
                del tokens[rng.randrange(len(tokens)):]  # diverge: a new tail from here
            tokens.extend(rng.randrange(3) for _ in range(rng.randrange(0, 5)))
        drafts = proposer.propose([req(rid, tokens, k=3) for rid, tokens in running.items()])
        assert proposer.num_tokens <= proposer.max_tokens
        seqs = live_sequences(proposer)
        assert proposer.num_tokens == sum(map(len, seqs))
        for (rid, tokens), draft in zip(running.items(), drafts, strict=True):
            if rid not in proposer._unindexed:
                assert tokens in seqs
            assert_draft_is_greedy(proposer, seqs, tokens, draft)
        contexts = [[rng.randrange(3) for _ in range(rng.randrange(1, 8))] for _ in range(10)]
        assert_index_matches(proposer, seqs, contexts)
        if rng.random() < 0.3:
            done = rng.choice(sorted(running))
            proposer.finish([done])
            del running[done]


def assert_draft_is_greedy(proposer: SuffixProposer, seqs, tokens, draft) -> None:
    """Each draft token is a most frequent continuation of the longest match, and the draft
    stops only where nothing matches (or at k = 3)."""
    context = list(tokens)
    for token in draft:
        _, counts = reference_counts(seqs, context, proposer.min_match, proposer.max_match)
        assert counts.get(token) == max(counts.values())
        context.append(token)
    if len(draft) < 3:
        assert reference_counts(seqs, context, proposer.min_match, proposer.max_match)[1] == {}


@pytest.mark.parametrize("args", [(0, 4, 10), (3, 2, 10), (2, 16, 0)])
def test_suffix_rejects_bad_arguments(args):
    with pytest.raises(ValueError):
        SuffixProposer(*args)


# -- build ----------------------------------------------------------------------------------

def test_build_proposer():
    ngram = build_proposer(SpeculativeConfig(method="ngram", ngram_min=2, ngram_max=5))
    assert isinstance(ngram, NgramProposer)
    assert (ngram.ngram_min, ngram.ngram_max) == (2, 5)
    assert isinstance(build_proposer(SpeculativeConfig(method="suffix")), ScopedSuffixProposer)
    for method in ("off", "medusa"):
        with pytest.raises(ValueError):
            build_proposer(SpeculativeConfig(method=method))


def test_scoped_suffix_keeps_each_adapter_scopes_text_apart():
    """Text indexed under one adapter's scope never becomes drafts of another's requests or
    the base model's, and each scope matches what a plain index of its own text proposes."""
    proposer = ScopedSuffixProposer(min_match=2)
    taught = [1, 2, 3, 4, 5, 6]
    proposer.propose([req("a", taught, scope="adapter-a")])
    proposer.finish(["a"])
    asks = [req("same", [9, 1, 2, 3], scope="adapter-a"), req("other", [9, 1, 2, 3],
                                                                 scope="adapter-b"),
            req("base", [9, 1, 2, 3])]
    assert proposer.propose(asks) == [[4, 5, 6], [], []]
    alone = SuffixProposer(min_match=2)
    alone.propose([req("a", taught)])
    alone.finish(["a"])
    assert proposer.propose([req("again", [9, 1, 2, 3], scope="adapter-a")]) == alone.propose(
        [req("again", [9, 1, 2, 3])])
    assert proposer.index("adapter-b").num_tokens == 4 and proposer.index("missing") is None
    with pytest.raises(ValueError):
        ScopedSuffixProposer(min_match=0)
