"""Next-token selection for a batch: logits processors, greedy, filtered sampling, logprobs.

Per step, for the rows that sample a token (vLLM v1's order):

1. raw log-probabilities, for rows that asked for logprobs (before anything below);
2. a structured-output constraint's mask (``workers.structured``) and ``allowed_token_ids``:
   forbidden tokens to -inf;
3. ``min_tokens`` masking of EOS / stop token ids, ``bad_words``, and ``logit_bias``;
4. repetition (prompt + output), presence and frequency (output) penalties;
5. greedy rows: argmax. Sampled rows: temperature, then ``min_p``, ``top_k`` and ``top_p``
   (nucleus, Holtzman et al. 2019), then one draw.

The draw is an exponential race (equivalent to the Gumbel-max trick): with independent
``E_v ~ Exp(1)``, ``argmax_v p_v / E_v`` is distributed exactly as ``Categorical(p)``. It needs
no sort and no cumulative sum, and each seeded row draws its ``V`` exponentials from its own
generator, so its tokens do not depend on which rows share its batch. The vocabulary is sorted
only for rows with ``top_p < 1``; ``top_k`` alone uses ``torch.topk``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from contract.request import SamplingParams, TokenLogprob
from workers import kernels
from workers.structured.masks import admits

_TINY = torch.finfo(torch.float32).tiny

TOP_P_CANDIDATES = 1024
"""Tokens ranked by ``torch.topk`` before ``top_p`` falls back to sorting the vocabulary."""


@dataclass
class SamplingRow:
    """What the sampler needs to know about one sampled sequence.

    Attributes:
        params: the request's sampling parameters.
        token_ids: prompt followed by the output so far.
        num_prompt_tokens: length of the prompt within ``token_ids``.
        stop_token_ids: ids that end generation (EOS included unless ``ignore_eos``); they
            are masked while the output is shorter than ``params.min_tokens``.
        generator: the request's own RNG (seeded requests), or None for the engine's.
        allowed: ``[ceil(V / 32)]`` int32, the tokens a structured-output constraint admits
            next, packed (bit ``t % 32`` of word ``t // 32``); None for free text.
        narrowed: packed as ``allowed``, the part of it that the constraint's closing admits
            near the end of the budget; a token drawn outside it is drawn again within it
            (:class:`~workers.structured.masks.PositionMask`). None where closing is off.
    """

    params: SamplingParams
    token_ids: Sequence[int] = ()
    num_prompt_tokens: int = 0
    stop_token_ids: frozenset[int] = frozenset()
    generator: torch.Generator | None = None
    allowed: torch.Tensor | None = None
    narrowed: torch.Tensor | None = None

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


@dataclass
class SampledToken:
    """One row's result: the token and, when asked for, its log-probabilities.

    Attributes:
        steered: drawn again within the row's ``narrowed`` mask, because the first draw was
            outside it: the budget, not the model, chose it.
    """

    token_id: int
    logprobs: TokenLogprob | None = None
    steered: bool = False


def sample(logits: torch.Tensor, rows: list[SamplingRow],
           default_generator: torch.Generator) -> list[SampledToken]:
    """One token per row.

    Args:
        logits: ``[B, V]`` float32 logits, one row per entry of ``rows`` (not modified).
        rows: per-row parameters and history.
        default_generator: CPU RNG of rows without their own generator.

    Returns:
        ``B`` sampled tokens, with raw-distribution logprobs for rows that asked for them;
        a row with a ``narrowed`` mask whose token fell outside it is drawn again within it.
    """
    sampled = _sample_allowed(logits, rows, default_generator)
    redraw = [i for i, (row, token) in enumerate(zip(rows, sampled, strict=True))
              if row.narrowed is not None and not admits(row.narrowed, token.token_id)]
    if redraw:
        again = _sample_allowed(
            logits[redraw], [replace(rows[i], allowed=rows[i].narrowed) for i in redraw],
            default_generator)
        for i, token in zip(redraw, again, strict=True):
            sampled[i] = replace(token, steered=True)
    return sampled


def _sample_allowed(logits: torch.Tensor, rows: list[SamplingRow],
                    default_generator: torch.Generator) -> list[SampledToken]:
    """:func:`sample` within each row's ``allowed`` mask alone."""
    raw_logprobs = _raw_logprobs(logits, rows)
    logits = process_logits(logits, rows)
    tokens = logits.argmax(dim=-1).tolist()
    random_rows = [i for i, row in enumerate(rows) if not row.params.greedy]
    if random_rows:
        probs = filtered_probs(logits[random_rows], [rows[i].params for i in random_rows])
        drawn = _exponential_race(probs, [rows[i].generator for i in random_rows],
                                  default_generator)
        for row, token in zip(random_rows, drawn, strict=True):
            tokens[row] = token
    return [SampledToken(token, _token_logprob(raw_logprobs.get(i), token, rows[i].params))
            for i, token in enumerate(tokens)]


def process_logits(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Logits after a constraint's mask, ``min_tokens`` masking, ``logit_bias`` and the
    penalties.

    Returns ``logits`` itself when no row asks for any of them, else a processed copy.
    """
    touched = [i for i, row in enumerate(rows) if needs_processing(row)]
    if not touched:
        return logits
    logits = logits.clone()
    constrained = [i for i in touched if rows[i].allowed is not None]
    if constrained:
        _apply_token_masks(logits, constrained, [rows[i].allowed for i in constrained])
    for i in touched:
        _process_row(logits[i], rows[i])
    return logits


def filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Probabilities after temperature, ``min_p``, ``top_k`` and ``top_p``.

    Args:
        logits: ``[B, V]`` float32 (already processed by :func:`process_logits`).
        params: one per row; rows must not be greedy (temperature > 0).

    Returns:
        ``[B, V]`` float32 probabilities; filtered-out tokens have probability 0. Tokens tied
        with the k-th most likely one are all kept by ``top_k`` (as vLLM does).
    """
    temperature = torch.tensor([p.temperature for p in params], device=logits.device)
    logits = logits / temperature.unsqueeze(1)
    _apply_min_p(logits, params)
    _apply_top_k(logits, params)
    _apply_top_p(logits, params)
    return logits.softmax(dim=-1)


# -- logits processors ------------------------------------------------------------------------


def needs_processing(row: SamplingRow) -> bool:
    """Whether the row asks for a logits processor (a constraint's mask, allowed_token_ids,
    min_tokens, bad words, logit_bias, a penalty)."""
    p = row.params
    return bool(row.allowed is not None or p.allowed_token_ids or p.bad_words_token_ids
                or p.logit_bias
                or p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty
                or (row.num_output_tokens < p.min_tokens and row.stop_token_ids))


def _process_row(logits: torch.Tensor, row: SamplingRow) -> None:
    """Applies ``row``'s processors, but its constraint's mask (:func:`process_logits`), to its
    ``[V]`` logits in place."""
    p = row.params
    vocab = logits.shape[0]
    if p.allowed_token_ids:
        allowed = torch.tensor(p.allowed_token_ids, device=logits.device)
        kept = logits[allowed]
        logits.fill_(float("-inf"))
        logits[allowed] = kept
    banned = _banned_words(p.bad_words_token_ids, row.token_ids[row.num_prompt_tokens:])
    if row.num_output_tokens < p.min_tokens and row.stop_token_ids:
        banned += [t for t in row.stop_token_ids if t < vocab]
    # The output never leaves ``allowed_token_ids``: where the bans would leave none of them,
    # they give way for this token (else the argmax of all -inf would be token 0).
    if banned and not (p.allowed_token_ids and set(p.allowed_token_ids) <= set(banned)):
        logits[banned] = float("-inf")
    if p.logit_bias:
        ids = torch.tensor(list(p.logit_bias), device=logits.device)
        logits.index_add_(0, ids, torch.tensor(list(p.logit_bias.values()),
                                               dtype=logits.dtype, device=logits.device))
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(row.token_ids)), dtype=torch.long, device=logits.device)
        values = logits[seen]
        logits[seen] = torch.where(values > 0, values / p.repetition_penalty,
                                   values * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and row.num_output_tokens:
        output = torch.tensor(list(row.token_ids[row.num_prompt_tokens:]), device=logits.device)
        counts = torch.bincount(output, minlength=vocab)[:vocab].to(logits.dtype)
        logits -= counts * p.frequency_penalty + (counts > 0).to(logits.dtype) * p.presence_penalty


def _banned_words(words: list[list[int]], output: Sequence[int]) -> list[int]:
    """The tokens ``words`` ban next after ``output``: each word's last token where the output
    ends with the rest of the word (vLLM's ``bad_words``, which looks at the output only)."""
    return [word[-1] for word in words
            if len(word) <= len(output) + 1
            and list(output[len(output) - len(word) + 1:]) == word[:-1]]


def _apply_token_masks(logits: torch.Tensor, indices: list[int],
                       masks: list[torch.Tensor]) -> None:
    """-inf for every token the packed ``masks`` forbid in rows ``indices`` of ``logits``
    ``[B, V]`` (contiguous), all rows in one call: the native kernel on the CPU, else an
    unpack and a masked fill."""
    stacked = torch.stack(masks)
    native = kernels.token_bitmask()
    if native is not None and logits.device.type == "cpu":
        native.apply_token_bitmask(logits, torch.tensor(indices), stacked)
        return
    stacked = stacked.to(logits.device)
    bits = (stacked.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32,
                                                  device=logits.device)) & 1
    allowed = bits.flatten(1)[:, :logits.shape[1]].bool()
    logits[indices] = logits[indices].masked_fill(~allowed, float("-inf"))


# -- filters (on temperature-scaled logits, in place) -----------------------------------------


def _apply_min_p(logits: torch.Tensor, params: list[SamplingParams]) -> None:
    rows = [i for i, p in enumerate(params) if p.min_p > 0]
    if not rows:
        return
    probs = logits[rows].softmax(dim=-1)
    min_p = torch.tensor([params[i].min_p for i in rows], device=logits.device)
    threshold = probs.max(dim=-1, keepdim=True).values * min_p.unsqueeze(1)
    logits[rows] = logits[rows].masked_fill(probs < threshold, float("-inf"))


def _apply_top_k(logits: torch.Tensor, params: list[SamplingParams]) -> None:
    vocab = logits.shape[-1]
    rows = [i for i, p in enumerate(params) if 0 < p.top_k < vocab]
    if not rows:
        return
    top_k = torch.tensor([params[i].top_k for i in rows], device=logits.device)
    values = logits[rows].topk(int(top_k.max()), dim=-1).values
    kth = values.gather(-1, (top_k - 1).unsqueeze(1))
    logits[rows] = logits[rows].masked_fill(logits[rows] < kth, float("-inf"))


def _apply_top_p(logits: torch.Tensor, params: list[SamplingParams]) -> None:
    """Keeps the smallest set of most likely tokens whose mass reaches ``top_p``.

    Sorting the whole vocabulary is the cost here, so the :data:`TOP_P_CANDIDATES` most likely
    tokens are ranked first with ``torch.topk``; when they hold ``top_p`` of the mass the
    nucleus lies among them (exactly), and only otherwise is the whole row sorted.
    """
    rows = [i for i, p in enumerate(params) if p.top_p < 1.0]
    if not rows:
        return
    probs = logits[rows].softmax(dim=-1)
    top_p = torch.tensor([params[i].top_p for i in rows], device=logits.device).unsqueeze(1)
    sorted_probs, order = probs.topk(min(TOP_P_CANDIDATES, probs.shape[-1]), dim=-1)
    if bool((sorted_probs.sum(dim=-1, keepdim=True) < top_p).any()):
        sorted_probs, order = probs.sort(dim=-1, descending=True)
    # Drop a token when the mass before it already reaches top_p; the first always stays.
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    keep_sorted = mass_before < top_p
    keep = torch.zeros_like(probs, dtype=torch.bool).scatter_(-1, order, keep_sorted)
    logits[rows] = logits[rows].masked_fill(~keep, float("-inf"))


# -- drawing and logprobs ---------------------------------------------------------------------


def _exponential_race(probs: torch.Tensor, generators: list[torch.Generator | None],
                      default_generator: torch.Generator) -> list[int]:
    """One draw per row of ``probs`` ``[B, V]``: ``argmax(p / E)`` with ``E ~ Exp(1)``.

    ``E = -log U`` with ``U`` uniform, drawn on the CPU from the row's generator (or, for all
    rows without one together, from ``default_generator``), so a seeded row consumes exactly
    ``V`` uniforms of its own generator per step whatever the batch and the device. (torch's
    ``exponential_`` gives the same law but is about 5x slower on a CPU.)
    """
    uniform = torch.empty(probs.shape, dtype=torch.float32)
    shared = [i for i, g in enumerate(generators) if g is None]
    if shared:
        uniform[shared] = torch.rand(len(shared), probs.shape[1], generator=default_generator)
    for i, generator in enumerate(generators):
        if generator is not None:
            uniform[i] = torch.rand(probs.shape[1], generator=generator)
    # U = 0 would give E = inf; clamping keeps E finite (a weight, not an exclusion).
    noise = uniform.clamp_min_(_TINY).log_().neg_().to(probs.device)
    return (probs / noise).argmax(dim=-1).tolist()


def _raw_logprobs(logits: torch.Tensor, rows: list[SamplingRow]) -> dict[int, torch.Tensor]:
    """``log_softmax`` of the unprocessed logits of the rows that asked for logprobs."""
    wanted = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
    if not wanted:
        return {}
    logprobs = logits[wanted].float().log_softmax(dim=-1).cpu()
    return dict(zip(wanted, logprobs, strict=True))


def _token_logprob(logprobs: torch.Tensor | None, token: int,
                   params: SamplingParams) -> TokenLogprob | None:
    if logprobs is None:
        return None
    return TokenLogprob(token, float(logprobs[token]), _top(logprobs, params.logprobs))


def _top(logprobs: torch.Tensor, count: int | None) -> list[tuple[int, float]]:
    """The ``count`` most likely ``(token_id, logprob)`` of a ``[V]`` row, most likely first."""
    if not count:
        return []
    values, ids = logprobs.topk(count)
    return list(zip(ids.tolist(), values.tolist(), strict=True))


def prompt_logprobs(logits: torch.Tensor, next_tokens: list[int],
                    count: int) -> list[TokenLogprob]:
    """Log-probabilities of prompt tokens, each given the tokens before it (vLLM's
    ``prompt_logprobs``), of the raw model distribution.

    Args:
        logits: ``[m, V]``: row ``j`` holds the logits at the position before
            ``next_tokens[j]``.
        next_tokens: ``m`` prompt token ids.
        count: most likely alternatives listed per token (0..20).

    Returns:
        One :class:`TokenLogprob` per token, with its rank (1 + the tokens more likely:
        ties share a rank, so the most likely tokens are always rank 1).
    """
    logprobs = logits.float().log_softmax(dim=-1).cpu()
    targets = torch.tensor(next_tokens, dtype=torch.long).unsqueeze(1)
    chosen = logprobs.gather(1, targets)
    ranks = ((logprobs > chosen).sum(dim=1) + 1).tolist()
    return [TokenLogprob(token, value, _top(row, count), rank)
            for token, value, row, rank in zip(next_tokens, chosen.squeeze(1).tolist(),
                                                logprobs, ranks, strict=True)]
