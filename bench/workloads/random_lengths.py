"""``random``: independent requests of random words, lengths fixed or drawn around a mean."""

from __future__ import annotations

import random
from collections.abc import Iterator

from bench.records import BenchRequest
from bench.text import random_words
from bench.workloads.config import WorkloadConfig
from bench.workloads.session import SingleRequest


def random_sessions(config: WorkloadConfig) -> Iterator[SingleRequest]:
    """Endless single requests; user turns share no prefix beyond the chat template's."""
    rng = random.Random(config.seed)
    while True:
        length = config.input_length(rng)
        messages = [{"role": "user", "content": random_words(rng, length)}]
        yield SingleRequest(BenchRequest(messages, config.output_length(rng),
                                         estimated_prompt_tokens=length,
                                         api_key=config.api_key, label="random"))
