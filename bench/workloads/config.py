"""The knobs every workload reads, and the length sampling they share."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass
class WorkloadConfig:
    """What a workload generates (lengths in tokens, as estimated by :mod:`bench.text`).

    Attributes:
        name: ``shared-prefix``, ``multi-turn``, ``copy``, ``random`` or ``json``.
        input_tokens: length of a user turn (for ``copy``: of the source snippet).
        output_tokens: ``max_tokens`` of each request.
        range_ratio: lengths are drawn uniformly from ``[n * (1 - r), n * (1 + r)]`` (vLLM's
            ``--random-range-ratio``); 0 keeps them fixed.
        seed: seeds every random choice, so a run repeats.
        api_key: the key of requests that have no tenant key.
        tenants: ``shared-prefix``: how many tenants, each with its own key and system prompt.
        prefix_tokens: ``shared-prefix``: length of each tenant's system prompt.
        tenant_key_prefix: ``shared-prefix``: tenant i's key is ``{tenant_key_prefix}-{i}``.
        hot_share: ``shared-prefix``: the fraction of requests from tenant 0 (a hot system
            prompt); the rest are spread evenly over the others. None: every tenant alike.
        turns: ``multi-turn``: user turns per conversation.
        think_time_s: ``multi-turn``: pause between a reply and the next turn, seconds.
    """

    name: str = "random"
    input_tokens: int = 128
    output_tokens: int = 128
    range_ratio: float = 0.0
    seed: int = 0
    api_key: str | None = None
    tenants: int = 8
    prefix_tokens: int = 512
    tenant_key_prefix: str = "nalar-bench-tenant"
    hot_share: float | None = None
    turns: int = 4
    think_time_s: float = 0.0

    def __post_init__(self) -> None:
        if not 0 <= self.range_ratio < 1:
            raise ValueError(f"range_ratio must be in [0, 1), got {self.range_ratio}")
        for name in ("input_tokens", "output_tokens", "tenants", "turns"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.prefix_tokens < 0 or self.think_time_s < 0:
            raise ValueError("prefix_tokens and think_time_s must not be negative")
        if self.hot_share is not None and not (0 <= self.hot_share <= 1 and self.tenants > 1):
            raise ValueError("hot_share must be in [0, 1], with at least 2 tenants")

    def input_length(self, rng: random.Random) -> int:
        """One user turn's length, drawn around :attr:`input_tokens`."""
        return sample_length(rng, self.input_tokens, self.range_ratio)

    def output_length(self, rng: random.Random) -> int:
        """One request's ``max_tokens``, drawn around :attr:`output_tokens`."""
        return sample_length(rng, self.output_tokens, self.range_ratio)


def sample_length(rng: random.Random, mean: int, range_ratio: float) -> int:
    """An integer drawn uniformly from ``[mean * (1 - r), mean * (1 + r)]``, at least 1."""
    low = max(1, round(mean * (1 - range_ratio)))
    return rng.randint(low, max(low, round(mean * (1 + range_ratio))))
