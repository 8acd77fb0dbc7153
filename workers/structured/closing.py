"""Closing a constrained output before its token budget runs out.

A grammar can admit outputs longer than ``max_tokens`` (an unbounded number, a recursive tree,
an open object), and a model can loop inside one: greedy SmolLM2 writes ``0000…`` in a number
until the budget cuts it, leaving a prefix that does not parse. So near the end of the budget
each step estimates how many tokens closing the output would take, by a dry run of the matcher
that prefers tokens which end things (EOS, then closing quotes and brackets, then separators);
once that estimate no longer fits in what is left, the step admits only the first preference
class the constraint allows, and the model still chooses within it. Closing then stays on to the
end, which also ends the dry runs: an output that cannot close costs one.

The estimate is an upper bound of a greedy path, not the shortest completion; a constraint whose
every completion is longer than the budget (a long ``minLength``) still ends cut. An output the
closing steered ends with ``finish_reason`` ``length``: it parses, but the model was stopped
short.
"""

from __future__ import annotations

import functools

import llguidance
import numpy as np
import torch

from workers.structured.masks import MaskBuffer

CLOSING_WINDOW = 64
"""Tokens: closing is considered only this near the end of the budget, which bounds the dry
runs' cost (each dry-run step is a mask, about 20 µs) to the last stretch of an output."""
CLOSING_MARGIN = 4
"""Tokens left over the estimate when closing starts: the model's free tokens at positions the
dry run filled with its first choice (a digit, a key) may run longer than the dry run's."""
CLOSERS = frozenset('"}])')
SEPARATORS = frozenset(",")


class ClosingTokens:
    """The tokens that end structure, by preference, packed as the sampler's masks are
    (bit ``t % 32`` of int32 word ``t // 32``): EOS first, then tokens made only of closing
    quotes and brackets (whitespace allowed around them), then those with separators too.

    Args:
        tokenizer: llguidance's tokenizer of the model.
        vocab_size: the logit row's length, in tokens.
    """

    def __init__(self, tokenizer: llguidance.LLTokenizer, vocab_size: int):
        self.vocab_size = vocab_size
        self._tokenizer = tokenizer

    @functools.cached_property
    def tiers(self) -> list[torch.Tensor]:
        """The packed preference classes, sorted out of the vocabulary on first use (about
        0.5 s for 49k tokens): only outputs that near their budget pay for it."""
        closers, separators = [], []
        for token in range(self._tokenizer.vocab_size):
            if self._tokenizer.is_special_token(token):
                continue
            chars = set(self._tokenizer.decode_str([token]).strip())
            if chars and chars <= CLOSERS:
                closers.append(token)
            elif chars and chars <= CLOSERS | SEPARATORS:
                separators.append(token)
        return [_packed(ids, self.vocab_size)
                for ids in (self._tokenizer.eos_tokens, closers, separators)]

    def restrict(self, mask: torch.Tensor) -> bool:
        """Narrows packed ``mask`` in place to its first non-empty preference class; returns
        whether that took anything away."""
        for tier in self.tiers:
            narrowed = mask & tier
            if narrowed.any():
                changed = not torch.equal(narrowed, mask)
                mask.copy_(narrowed)
                return changed
        return False


class ClosingEstimate:
    """Dry runs of one matcher toward the end of its output.

    Args:
        matcher: the sequence's llguidance matcher; a dry run leaves it where it was.
        tokens: the preference classes.
    """

    def __init__(self, matcher: llguidance.LLMatcher, tokens: ClosingTokens):
        self._matcher = matcher
        self._tokens = tokens
        self._scratch = MaskBuffer(tokens.vocab_size)

    def must_close(self, budget: int) -> bool:
        """Whether closing must start now, with ``budget`` tokens left to produce."""
        limit = budget - CLOSING_MARGIN
        return budget <= CLOSING_WINDOW and (limit <= 0 or self.tokens_to_close(limit) >= limit)

    def tokens_to_close(self, limit: int) -> int:
        """Tokens (EOS included) the preferred path takes to end the output, at most
        ``limit``."""
        steps = consumed = 0
        try:
            while steps < limit and not self._matcher.is_stopped():
                mask = self._scratch.fill(self._matcher)
                if not mask.any():
                    break
                steps += 1
                if (mask & self._tokens.tiers[0]).any():
                    break  # EOS: done
                self._tokens.restrict(mask)
                if not self._matcher.consume_token(_first_token(mask)):
                    break
                consumed += 1
        finally:
            self._matcher.rollback(consumed)
        return steps


def _first_token(mask: torch.Tensor) -> int:
    """The lowest token id set in packed ``mask`` (which has one)."""
    word = int(mask.nonzero()[0, 0])
    bits = int(mask[word]) & 0xFFFFFFFF
    return word * 32 + (bits & -bits).bit_length() - 1


def _packed(token_ids: list[int], vocab_size: int) -> torch.Tensor:
    """``[ceil(V / 32)]`` int32 with the bits of ``token_ids`` set."""
    bits = np.zeros(-(-vocab_size // 32) * 32, dtype=bool)
    bits[[t for t in token_ids if t < vocab_size]] = True
    return torch.from_numpy(np.packbits(bits, bitorder="little").view("<i4").copy())
