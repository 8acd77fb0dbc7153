"""``shared-prefix``: tenants with their own API key and long system prompt, random user turns.

Every request of a tenant repeats that tenant's system prompt, so a server with prefix caching
(and a router that sends a tenant where its prefix is cached) reuses it; different tenants share
nothing (different keys, so different cache namespaces on servers that scope caches by key).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

from bench.records import BenchRequest
from bench.text import random_words
from bench.workloads.config import WorkloadConfig
from bench.workloads.session import SingleRequest


@dataclass(frozen=True)
class Tenant:
    """One tenant: its index, API key and system prompt."""

    index: int
    api_key: str
    system_prompt: str


def make_tenants(config: WorkloadConfig, rng: random.Random) -> list[Tenant]:
    """``config.tenants`` tenants with distinct keys and ``config.prefix_tokens``-word system
    prompts."""
    return [Tenant(i, f"{config.tenant_key_prefix}-{i}",
                   f"Tenant {i}. " + random_words(rng, config.prefix_tokens))
            for i in range(config.tenants)]


def shared_prefix_sessions(config: WorkloadConfig) -> Iterator[SingleRequest]:
    """Endless requests, each from a tenant chosen at random: uniformly, or tenant 0 with
    probability ``hot_share`` and the others uniformly."""
    rng = random.Random(config.seed)
    tenants = make_tenants(config, rng)
    while True:
        if config.hot_share is None:
            tenant = rng.choice(tenants)
        else:
            tenant = tenants[0] if rng.random() < config.hot_share else rng.choice(tenants[1:])
        length = config.input_length(rng)
        messages = [{"role": "system", "content": tenant.system_prompt},
                    {"role": "user", "content": random_words(rng, length)}]
        yield SingleRequest(BenchRequest(
            messages, config.output_length(rng),
            estimated_prompt_tokens=config.prefix_tokens + 2 + length,
            api_key=tenant.api_key, label=f"tenant-{tenant.index}"))
