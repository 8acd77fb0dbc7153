"""Continuous batching: which sequences run in the next step, and with how many tokens.

One unified step in the manner of vLLM v1's scheduler: every sequence has tokens whose KV is not
yet computed (a whole prompt, the rest of a prompt, or one decode token), and each step hands
out a token budget — running sequences first, oldest first, then waiting ones in arrival order.
A prompt longer than what is left of the budget is prefilled in chunks. When a running sequence
needs a block and none is free, the newest running sequence is preempted: its blocks go back to
the pool and it is recomputed later (recompute preemption, as in vLLM).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from workers.block_manager import BlockManager
from workers.sequence import Sequence, SequenceStatus


@dataclass
class SchedulerCounters:
    """Monotonic counts, in tokens or events, since the engine started.

    Attributes:
        prefix_query_tokens: prompt tokens looked up in the prefix cache (once per request).
        prefix_hit_tokens: of those, tokens reused (once per request, at first admission).
        preemptions: sequences preempted for lack of blocks.
    """

    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    preemptions: int = 0


@dataclass
class ScheduledBatch:
    """The work of one step: ``num_new_tokens[i]`` tokens of ``seqs[i]`` to compute."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)

    def add(self, seq: Sequence, num_tokens: int) -> None:
        self.seqs.append(seq)
        self.num_new_tokens.append(num_tokens)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)


class Scheduler:
    """Decides each step's batch under a token budget and the KV block supply.

    Args:
        block_manager: owns the block tables.
        max_num_seqs: most sequences running at once.
        max_num_batched_tokens: most tokens (prefill + decode) computed in one step.
    """

    def __init__(self, block_manager: BlockManager, max_num_seqs: int,
                 max_num_batched_tokens: int):
        self.blocks = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.counters = SchedulerCounters()

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        """Pick this step's sequences; may preempt running ones when blocks run out."""
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        preempted = self._schedule_running(batch, budget)
        if not preempted:
            self._admit_waiting(batch, budget - batch.num_tokens)
        return batch

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence and return its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq)

    def _schedule_running(self, batch: ScheduledBatch, budget: int) -> bool:
        preempted = False
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            num_tokens = min(seq.num_uncomputed_tokens, budget)
            while not self.blocks.reserve(seq, num_tokens):
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    return preempted
            batch.add(seq, num_tokens)
            budget -= num_tokens
            index += 1
        return preempted

    def _admit_waiting(self, batch: ScheduledBatch, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            hits = self.blocks.cached_prefix(seq)
            num_tokens = min(seq.num_tokens - len(hits) * self.blocks.block_size, budget)
            if not self.blocks.can_admit(seq, hits, num_tokens):
                return  # first come, first served: later arrivals wait behind it
            self.waiting.popleft()
            self.blocks.admit(seq, hits, num_tokens)
            self._count_first_lookup(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.add(seq, num_tokens)
            budget -= num_tokens

    def _count_first_lookup(self, seq: Sequence) -> None:
        """Hits count once per request; recomputation after preemption is not a hit."""
        if seq.admitted:
            return
        seq.admitted = True
        seq.num_cached_tokens = seq.num_computed_tokens
        self.counters.prefix_query_tokens += seq.num_prompt_tokens
        self.counters.prefix_hit_tokens += seq.num_cached_tokens

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.counters.preemptions += 1
