"""Sampling: greedy, temperature / top-k / top-p filtering, per-request seeds."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from contract.request import GenerationRequest, SamplingParams
from workers.sampler import SamplingRow, filtered_probs, sample
from workers.sequence import generator_seed

LOGITS = torch.tensor([2.0, 1.5, 1.2, 0.9, 0.3, 0.0, -0.4, -1.0, -2.0, -3.0])


def draw(logits: torch.Tensor, params: list[SamplingParams],
         generators: list[torch.Generator | None], default: torch.Generator) -> list[int]:
    """Token ids of one :func:`sample` call over rows without history."""
    rows = [SamplingRow(p, generator=g) for p, g in zip(params, generators, strict=True)]
    return [s.token_id for s in sample(logits, rows, default)]


def expected_probs(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """Reference filter, written independently: softmax(logits / T) over the top k, then the
    smallest set of most likely tokens whose mass reaches top_p, renormalised."""
    scaled = logits.astype(np.float64) / temperature
    order = np.argsort(-scaled, kind="stable")
    keep = order[:top_k] if top_k > 0 else order
    probs = np.exp(scaled[keep] - scaled[keep].max())
    probs /= probs.sum()
    cumulative = np.cumsum(probs)
    nucleus = int(np.searchsorted(cumulative, top_p) + 1)  # first index where mass >= top_p
    out = np.zeros_like(scaled)
    out[keep[:nucleus]] = probs[:nucleus] / probs[:nucleus].sum()
    return out


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [
    (1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 5, 1.0), (1.0, 0, 0.8), (0.8, 6, 0.9), (1.0, -1, 0.5)])
def test_filtered_probs_match_the_reference_filter(temperature, top_k, top_p):
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    got = filtered_probs(LOGITS.unsqueeze(0), [params])[0].double().numpy()
    want = expected_probs(LOGITS.numpy(), temperature, top_k, top_p)
    np.testing.assert_allclose(got, want, atol=1e-6)
    assert np.array_equal(got > 0, want > 0)


def test_top_p_keeps_the_minimal_nucleus():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().unsqueeze(0)

    def kept(top_p: float) -> list[int]:
        row = filtered_probs(logits, [SamplingParams(top_p=top_p)])[0]
        return torch.nonzero(row).flatten().tolist()

    assert kept(0.45) == [0]  # the first token alone already reaches it
    assert kept(0.75) == [0, 1]  # 0.8 >= 0.75 without the third
    assert kept(0.85) == [0, 1, 2]
    assert kept(0.99) == [0, 1, 2, 3]
    assert kept(1.0) == [0, 1, 2, 3]
    row = filtered_probs(logits, [SamplingParams(top_p=0.75)])[0]
    torch.testing.assert_close(row, torch.tensor([0.625, 0.375, 0.0, 0.0]))


def test_rows_are_filtered_independently():
    logits = torch.stack([LOGITS, LOGITS.flip(0)])
    params = [SamplingParams(top_k=1), SamplingParams(top_k=2, temperature=0.5)]
    probs = filtered_probs(logits, params)
    assert torch.nonzero(probs[0]).flatten().tolist() == [0]
    assert torch.nonzero(probs[1]).flatten().tolist() == [8, 9]


def test_sampling_matches_the_filtered_distribution_chi_square():
    params = SamplingParams(temperature=0.8, top_k=6, top_p=0.9)
    draws = 20_000
    generator = torch.Generator().manual_seed(1234)
    tokens = draw(LOGITS.expand(draws, -1).clone(), [params] * draws, [None] * draws,
                    generator)
    counts = np.bincount(tokens, minlength=len(LOGITS))
    want = expected_probs(LOGITS.numpy(), 0.8, 6, 0.9)
    support = want > 0
    assert support.sum() == 4  # top-k 6 then the 0.9 nucleus leaves four tokens
    assert counts[~support].sum() == 0  # filtered-out tokens are never drawn
    result = stats.chisquare(counts[support], want[support] * draws)
    assert result.pvalue > 0.01, (counts, want * draws)


def test_greedy_rows_take_the_argmax_and_top_k_1_equals_greedy():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 500, generator=generator)
    argmax = logits.argmax(dim=-1).tolist()
    greedy = draw(logits, [SamplingParams(temperature=0.0)] * 64, [None] * 64, generator)
    top1 = draw(logits, [SamplingParams(temperature=1.5, top_k=1)] * 64, [None] * 64,
                  generator)
    assert greedy == argmax
    assert top1 == argmax


def test_seeded_row_does_not_depend_on_its_batch_neighbours():
    logits = torch.randn(4, 200, generator=torch.Generator().manual_seed(7))
    seeded = SamplingParams(temperature=1.0, seed=42)

    def draw_seeded(rows: list[int], params: list[SamplingParams], steps: int = 30) -> list[int]:
        own = torch.Generator().manual_seed(42)
        shared = torch.Generator().manual_seed(99)
        generators = [own if p is seeded else None for p in params]
        index = next(i for i, p in enumerate(params) if p is seeded)
        return [draw(logits[rows], params, generators, shared)[index] for _ in range(steps)]

    alone = draw_seeded([0], [seeded])
    neighbours = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.0),
                  SamplingParams(temperature=0.9, top_p=0.5)]
    crowded = draw_seeded([1, 0, 2, 3], [neighbours[0], seeded, neighbours[1], neighbours[2]])
    assert crowded == alone
    assert len(set(alone)) > 5  # really random draws, not a degenerate distribution


def test_seeded_request_reproduces_in_the_engine_regardless_of_batch(tiny_qwen, make_engine):
    prompt = list(range(100, 130))
    seeded = SamplingParams(temperature=1.0, seed=2024, max_tokens=12, ignore_eos=True)

    def run(with_neighbours: bool) -> list[int]:
        engine = make_engine(tiny_qwen, num_blocks=32)
        requests = [GenerationRequest("seeded", prompt, seeded)]
        if with_neighbours:
            requests += [GenerationRequest(f"n{i}", list(range(200 + i, 240 + i)),
                                           SamplingParams(temperature=1.0, max_tokens=12,
                                                          ignore_eos=True))
                         for i in range(3)]
        chunks = engine.generate(requests)
        if with_neighbours:
            assert engine.counters.batch_sizes[4] >= 11
        return [t for c in chunks["seeded"] for t in c.token_ids]

    alone = run(False)
    assert len(alone) == 12
    assert run(True) == alone


def test_every_bit_of_a_seed_chooses_its_stream(tiny_qwen, make_engine):
    """torch's CPU generator keeps a seed's low 32 bits: seeds 5 and 5 + 2**32 (or 0 and
    2**63) drew the same tokens. The seed is mixed first (SplitMix64), so they differ; -1 and
    2**64 - 1, one value mod 2**64, still agree."""
    assert generator_seed(0) == 0xE220A8397B1DCDAF  # SplitMix64's first output from state 0
    engine = make_engine(tiny_qwen, num_blocks=32)

    def tokens(seed: int) -> list[int]:
        chunks = engine.generate([GenerationRequest(f"s{seed}", list(range(100, 120)),
                                                    SamplingParams(temperature=1.5, seed=seed,
                                                                   max_tokens=16,
                                                                   ignore_eos=True))])
        return [t for c in chunks[f"s{seed}"] for t in c.token_ids]

    assert tokens(5) != tokens(5 + 2**32)
    assert tokens(0) != tokens(2**63)
    assert tokens(-1) == tokens(2**64 - 1)


def test_a_vanishing_temperature_is_greedy_and_harms_no_neighbour(tiny_qwen, make_engine):
    """Dividing logits by 1e-45 overflows to inf; such a request must decode greedily, not
    crash the step that also serves other requests."""
    assert SamplingParams(temperature=1e-45).greedy
    assert not SamplingParams(temperature=1e-4).greedy
    prompt = list(range(100, 130))
    engine = make_engine(tiny_qwen, num_blocks=32)
    chunks = engine.generate([
        GenerationRequest("tiny-t", prompt, SamplingParams(temperature=1e-45, max_tokens=8,
                                                           ignore_eos=True)),
        GenerationRequest("greedy", prompt, SamplingParams(temperature=0.0, max_tokens=8,
                                                           ignore_eos=True)),
    ])
    outputs = {rid: [t for c in got for t in c.token_ids] for rid, got in chunks.items()}
    assert len(outputs["greedy"]) == 8
    assert outputs["tiny-t"] == outputs["greedy"]


def reference_probs(logits: np.ndarray, temperature: float, top_k: int = 0, top_p: float = 1.0,
                    min_p: float = 0.0) -> np.ndarray:
    """Independent reference in vLLM's order: temperature, min_p, top_k, top_p."""
    scaled = logits.astype(np.float64) / temperature
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    keep = probs >= min_p * probs.max()
    if top_k > 0:
        keep &= scaled >= np.sort(scaled[keep])[::-1][min(top_k, keep.sum()) - 1]
    probs = np.where(keep, probs, 0.0)
    probs /= probs.sum()
    order = np.argsort(-probs, kind="stable")
    mass_before = np.cumsum(probs[order]) - probs[order]
    probs[order[mass_before >= top_p]] = 0.0
    return probs / probs.sum()


@pytest.mark.parametrize(("temperature", "top_k", "top_p", "min_p"), [
    (1.0, 0, 1.0, 0.0),  # sort-free race
    (0.6, 0, 1.0, 0.0),
    (1.0, 4, 1.0, 0.0),  # torch.topk only
    (1.2, 0, 1.0, 0.05),  # min_p, no sort
    (0.8, 6, 0.9, 0.0),  # sort for top_p
    (1.0, 7, 0.95, 0.02)])
def test_draws_follow_the_filtered_distribution_chi_square(temperature, top_k, top_p, min_p):
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    want = reference_probs(LOGITS.numpy(), temperature, top_k, top_p, min_p)
    got = filtered_probs(LOGITS.unsqueeze(0), [params])[0].double().numpy()
    np.testing.assert_allclose(got, want, atol=1e-6)
    draws = 20_000
    generator = torch.Generator().manual_seed(4321)
    counts = np.bincount(draw(LOGITS.expand(draws, -1).clone(), [params] * draws,
                              [None] * draws, generator), minlength=len(LOGITS))
    support = want > 0
    assert counts[~support].sum() == 0
    assert stats.chisquare(counts[support], want[support] * draws).pvalue > 0.001
    # The same law when every row brings its own seeded generator.
    own = [torch.Generator().manual_seed(i) for i in range(2000)]
    seeded = np.bincount(draw(LOGITS.expand(2000, -1).clone(), [params] * 2000, own,
                              generator), minlength=len(LOGITS))
    assert seeded[~support].sum() == 0
    assert stats.chisquare(seeded[support], want[support] * 2000).pvalue > 0.001


def test_penalties_and_bias_give_exact_logits():
    from workers.sampler import process_logits
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]])
    row = SamplingRow(SamplingParams(repetition_penalty=2.0, presence_penalty=0.5,
                                     frequency_penalty=0.25, logit_bias={5: -1.5},
                                     min_tokens=4),
                      token_ids=[0, 1, 3, 3, 4], num_prompt_tokens=2,
                      stop_token_ids=frozenset({2}))
    got = process_logits(logits, [row])[0]
    # token 0, 1: prompt only (repetition): 2/2, -1*2; token 2: stop token under min_tokens;
    # token 3: output twice: 3/2 - 0.5 - 2*0.25; token 4: output once: -2*2 - 0.5 - 0.25;
    # token 5: bias only.
    torch.testing.assert_close(got, torch.tensor([1.0, -2.0, float("-inf"), 0.5, -4.75, -0.5]))
    assert logits[0, 2] == 0.5  # the caller's logits are not modified
    done = SamplingRow(row.params, [0, 1, 3, 3, 4, 5, 5], 2, frozenset({2}))
    assert process_logits(logits, [done])[0, 2] == 0.5  # min_tokens reached: unmasked


def test_logprobs_are_raw_and_top_ranked():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    row = SamplingRow(SamplingParams(temperature=0.0, logprobs=2, logit_bias={3: 50.0}))
    (result,) = sample(logits, [row], torch.Generator())
    raw = logits[0].log_softmax(-1)
    assert result.token_id == 3  # the bias decided the token ...
    assert result.logprobs.logprob == pytest.approx(float(raw[3]))  # ... not its logprob
    assert [t for t, _ in result.logprobs.top] == [0, 1]
    assert [v for _, v in result.logprobs.top] == pytest.approx(raw[:2].tolist())


@pytest.mark.parametrize("scale", [0.1, 8.0])  # flat: the nucleus needs a full sort; peaked: not
def test_top_p_over_a_large_vocabulary_matches_the_reference(scale):
    logits = torch.randn(2, 5000, generator=torch.Generator().manual_seed(3)) * scale
    params = SamplingParams(temperature=1.0, top_p=0.8)
    got = filtered_probs(logits, [params, params]).double().numpy()
    for row in range(2):
        want = reference_probs(logits[row].numpy(), 1.0, top_p=0.8)
        np.testing.assert_allclose(got[row], want, atol=1e-6)
        assert np.array_equal(got[row] > 0, want > 0)
    kept = (got[0] > 0).sum()
    assert (kept > 1024) == (scale < 1)  # both paths of _apply_top_p are exercised


def test_the_vocabulary_is_sorted_only_when_top_p_needs_it(monkeypatch):
    """The cost to avoid: a full-vocabulary sort per row per step. Plain temperature sampling
    and top-k draw without one (top-k ranks with ``topk`` alone), and so does top-p while its
    nucleus lies among the ranked candidates; a flat row whose nucleus does not falls back to
    one sort. Counted by wrapping torch's sort entry points."""
    calls = {"sort": 0, "topk": 0}
    original_sort, original_topk = torch.Tensor.sort, torch.Tensor.topk

    def counting(name, function):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return function(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(torch.Tensor, "sort", counting("sort", original_sort))
    monkeypatch.setattr(torch.Tensor, "topk", counting("topk", original_topk))
    for name in ("sort", "argsort", "msort"):
        monkeypatch.setattr(torch, name, lambda *a, **k: pytest.fail("torch-level sort"))
    monkeypatch.setattr(torch.Tensor, "argsort", lambda *a, **k: pytest.fail("argsort"))
    peaked = torch.randn(2, 49152, generator=torch.Generator().manual_seed(3)) * 4
    default = torch.Generator().manual_seed(0)

    def sorts_and_topks(**sampling) -> tuple[int, int]:
        calls.update(sort=0, topk=0)
        draw(peaked, [SamplingParams(**sampling)] * 2, [None, None], default)
        return calls["sort"], calls["topk"]

    assert sorts_and_topks(temperature=1.0) == (0, 0)
    assert sorts_and_topks(temperature=0.8, top_k=40) == (0, 1)
    assert sorts_and_topks(temperature=1.0, top_p=0.9)[0] == 0
    flat = torch.zeros(1, 49152)  # every token equally likely: the nucleus is 90% of them
    calls.update(sort=0)
    draw(flat, [SamplingParams(temperature=1.0, top_p=0.9)], [None], default)
    assert calls["sort"] == 1


def test_a_draw_outside_the_narrowed_mask_is_drawn_again_within_it():
    """Closing's ``narrowed`` mask: greedy takes the argmax within it and says it was steered
    only where the argmax of the wider mask lay outside it; sampled, the draws follow the
    distribution within it (a first draw that lands there is kept, the rest drawn again),
    and are steered exactly when the first draw fell outside."""
    from workers.structured.closing import _packed

    allowed, narrowed = _packed([0, 1, 2, 3], len(LOGITS)), _packed([2, 3], len(LOGITS))
    greedy = SamplingParams(temperature=0.0)
    rows = [SamplingRow(greedy, allowed=allowed, narrowed=narrowed),
            SamplingRow(greedy, allowed=allowed, narrowed=_packed([0, 2], len(LOGITS)))]
    tokens = sample(LOGITS.expand(2, -1).clone(), rows, torch.Generator().manual_seed(0))
    assert [(t.token_id, t.steered) for t in tokens] == [(2, True), (0, False)]
    draws = 20_000
    params = SamplingParams(temperature=1.0)
    sampled = sample(LOGITS.expand(draws, -1).clone(),
                     [SamplingRow(params, allowed=allowed, narrowed=narrowed)] * draws,
                     torch.Generator().manual_seed(99))
    counts = np.bincount([t.token_id for t in sampled], minlength=len(LOGITS))
    want = torch.softmax(LOGITS[[2, 3]].double(), dim=0).numpy()
    assert counts.sum() == counts[2] + counts[3]
    assert stats.chisquare(counts[[2, 3]], want * draws).pvalue > 0.001
    outside = 1 - torch.softmax(LOGITS[:4], dim=0)[2:].sum().item()  # first draw not in 2, 3
    steered = sum(t.steered for t in sampled)
    assert abs(steered / draws - outside) < 4 * (outside * (1 - outside) / draws) ** 0.5
