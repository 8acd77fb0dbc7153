"""Headroom for the running sequences' growth: how many KV blocks they are expected to still
claim, which admission keeps free.

Admitting a request whose prompt fits now, though not beside what the running sequences will
grow into, ends in a preemption a few steps later: the newest sequence (often that very
request, part-way into its answer) gives its blocks back and is computed again. On a pool that
holds few long prompts, the recompute can cost more than the wait it avoided. So a request is
admitted, beside running ones, only when the pool can hold its whole prompt and its expected
answer on top of the running sequences' expected growth.

An answer's length is not known in advance (EOS and stop strings end it early), so each
sequence is expected to produce a fraction ``ratio`` of the tokens its ``max_tokens`` still
allows. The fraction starts cautious, falls step by step while nothing is preempted, and goes
back up when something is: the new-token ratio of SGLang's scheduler (Zheng et al., "SGLang:
Efficient Execution of Structured Language Model Programs", NeurIPS 2024), with its defaults.

The tokens counted per sequence are clipped, since a request without ``max_tokens`` may run to
the end of the context and rarely does. SGLang clips at 4,096 tokens. A CPU worker's pool is
small (512 MiB, 23,296 tokens of SmolLM2 in bf16, by default), where 4,096 × 0.7 would admit
eight such requests at a time; so the clip is also the pool's share per sequence slot
(``max_num_seqs``), at which every slot can be filled with short prompts.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from workers.sequence import Sequence

INITIAL_RATIO = 0.7
"""The expected fraction of an answer's remaining ``max_tokens`` at start and after a
preemption."""
MIN_RATIO = INITIAL_RATIO * 0.14
"""The lowest it falls to."""
DECAY_STEPS = 600
"""Steps without a preemption over which it falls from :data:`INITIAL_RATIO` to
:data:`MIN_RATIO`."""
CLIPPED_OUTPUT_TOKENS = 4096
"""Most remaining output tokens counted for one sequence, whatever the pool (SGLang's)."""


class KVHeadroom:
    """The expected growth of sequences, in KV blocks, under an adaptive output ratio.

    Args:
        pool_tokens: tokens the working pool holds (blocks × block size).
        max_num_seqs: most sequences running at once.

    Attributes:
        ratio: the fraction of its remaining ``max_tokens`` a sequence is expected to still
            produce (between :data:`MIN_RATIO` and :data:`INITIAL_RATIO`).
        clip_tokens: most remaining output tokens counted for one sequence.
    """

    def __init__(self, pool_tokens: int, max_num_seqs: int) -> None:
        self.ratio = INITIAL_RATIO
        self.clip_tokens = min(CLIPPED_OUTPUT_TOKENS, pool_tokens // max_num_seqs)

    def stepped(self) -> None:
        """One scheduling step has passed: expect a little less."""
        self.ratio = max(MIN_RATIO, self.ratio - (INITIAL_RATIO - MIN_RATIO) / DECAY_STEPS)

    def preempted(self) -> None:
        """A sequence was preempted for lack of blocks: the estimate was too low."""
        self.ratio = INITIAL_RATIO

    def expected_tokens(self, seq: Sequence) -> int:
        """Tokens ``seq`` is expected to hold when it finishes: all it has now (its prompt
        included, computed or not) plus its expected further output."""
        allowed = min(max(0, seq.sampling.max_tokens - seq.num_output_tokens),
                      self.clip_tokens)
        return seq.num_tokens + math.ceil(allowed * self.ratio)

    def blocks_to_come(self, seqs: Iterable[Sequence]) -> int:
        """KV blocks ``seqs`` are expected to claim beyond the tables they hold."""
        return sum(max(0, seq.blocks_needed(self.expected_tokens(seq)) - len(seq.block_table))
                   for seq in seqs)
