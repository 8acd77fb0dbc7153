"""Next-token selection for a batch: greedy, temperature, top-k, top-p, per-request seeds."""

from __future__ import annotations

import torch

from workers.request import SamplingParams


def filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Probabilities after temperature, top-k and top-p (nucleus, Holtzman et al. 2019).

    Args:
        logits: ``[B, V]`` float32.
        params: one per row; rows must not be greedy (temperature > 0).

    Returns:
        ``[B, V]`` float32 probabilities; filtered-out tokens have probability 0.
    """
    temperature = torch.tensor([p.temperature for p in params], device=logits.device)
    logits = logits / temperature.unsqueeze(1)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params],
                         device=logits.device)
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
    sorted_logits = sorted_logits.masked_fill(ranks >= top_k.unsqueeze(1), float("-inf"))
    sorted_probs = sorted_logits.softmax(dim=-1)
    top_p = torch.tensor([p.top_p for p in params], device=logits.device)
    # Drop a token when the mass before it already reaches top_p; the first always stays.
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(mass_before >= top_p.unsqueeze(1), 0.0)
    sorted_probs = sorted_probs / sorted_probs.sum(dim=-1, keepdim=True)
    return torch.zeros_like(sorted_probs).scatter_(-1, order, sorted_probs)


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None],
           default_generator: torch.Generator) -> list[int]:
    """One token id per row.

    Args:
        logits: ``[B, V]`` float32 logits.
        params: sampling parameters per row.
        generators: per-row RNG (seeded requests) or None to use ``default_generator``. A
            seeded row draws only from its own generator, so its tokens do not depend on its
            batch neighbours.
        default_generator: RNG for unseeded rows.
    """
    tokens = logits.argmax(dim=-1).tolist()
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    if not random_rows:
        return tokens
    probs = filtered_probs(logits[random_rows].cpu(), [params[i] for i in random_rows])
    for row, row_probs in zip(random_rows, probs, strict=True):
        generator = generators[row] or default_generator
        tokens[row] = int(torch.multinomial(row_probs, 1, generator=generator))
    return tokens
