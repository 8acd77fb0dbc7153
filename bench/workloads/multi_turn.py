"""``multi-turn``: conversations whose history grows turn by turn.

Each turn sends the whole history so far: every earlier user turn and the assistant's actual
reply to it, then a new user turn. A failed turn ends its conversation (its history would be
wrong).
"""

from __future__ import annotations

import random
from collections.abc import Iterator

from bench.records import BenchRequest, RequestRecord
from bench.text import random_words
from bench.workloads.config import WorkloadConfig


class Conversation:
    """One conversation of ``config.turns`` user turns with ``config.think_time_s`` between
    them (see :class:`bench.workloads.session.Session`)."""

    def __init__(self, index: int, config: WorkloadConfig, seed: int):
        self.index = index
        self.config = config
        self.max_requests = config.turns
        self.think_time_s = config.think_time_s
        self.history: list[dict[str, str]] = []
        self.history_tokens = 0
        self._rng = random.Random(seed)

    def next_request(self, previous: RequestRecord | None) -> BenchRequest | None:
        """The next turn: the history, the previous reply and a new user turn; None once the
        conversation has had all its turns or the previous one failed."""
        if previous is not None:
            if not previous.ok:
                return None
            self.history.append({"role": "assistant", "content": previous.output_text})
            self.history_tokens += previous.completion_tokens
        if len(self.history) >= 2 * self.max_requests:
            return None
        length = self.config.input_length(self._rng)
        self.history.append({"role": "user", "content": random_words(self._rng, length)})
        self.history_tokens += length
        return BenchRequest(list(self.history), self.config.output_length(self._rng),
                            estimated_prompt_tokens=self.history_tokens,
                            api_key=self.config.api_key, label=f"conversation-{self.index}")


def multi_turn_sessions(config: WorkloadConfig) -> Iterator[Conversation]:
    """Endless conversations, each seeded from the workload's seed."""
    rng = random.Random(config.seed)
    index = 0
    while True:
        yield Conversation(index, config, rng.getrandbits(64))
        index += 1
