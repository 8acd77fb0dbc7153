"""Closing a constrained output before its token budget runs out.

A grammar can admit outputs longer than ``max_tokens`` (an unbounded number, a recursive tree,
an open object), and a model can loop inside one: greedy SmolLM2 writes ``0000…`` in a number
until the budget cuts it, leaving a prefix that does not parse. So in the last stretch of the
budget, dry runs of the matcher estimate how many tokens closing the output would take, along a
path that prefers tokens which end things (EOS, then closing quotes, then closing brackets,
then separators, then tokens that open nothing, then digits). Once that estimate no longer fits
in what is left, the step admits only the first preference class the constraint allows, and the
model still chooses within it (in a class that may loop, only the path's token). Closing then
stays on to the end. The dry runs come more often as the estimate nears what is left, so an
output far from its end costs one now and then. Each
decision depends only on the tokens before its position, so a verification's drafts get the
masks a plain step would give them.

A position where the output may already end (its matcher accepts) is never steered: cut there,
it is whole. That leaves free text alone (``tool_choice`` ``auto``'s text before a call), which
the margin would otherwise end with EOS well before the budget.

The estimate is the length of a greedy path, not of the shortest completion. Where the path does
not fit in the budget at all, closing leaves the model free (steering could not save the output)
and looks again later; such an output, or one whose every completion is longer than the budget
(a long ``minLength``), still ends cut. An output the closing steered ends with
``finish_reason`` ``length``: it parses, but the model was stopped short.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import llguidance
import numpy as np
import torch

from workers.structured.masks import MaskBuffer

CLOSING_WINDOW = 256
"""Tokens: closing is considered only this near the end of the budget (a deep recursive tree
took over 64 tokens to close), which bounds a dry run to as many masks (about 20 µs each)."""
CLOSING_MARGIN = 16
"""Tokens left over the estimate when closing starts: one free token can add about ten tokens
of closing (a new object in a tree of required keys), and the model's tokens at positions the
dry run filled with its first choice (a digit, a key) may run longer than the dry run's."""
MARGIN_SHARE = 8
"""A small budget keeps at most this fraction of itself as margin (at least 2 tokens): with 16
of 40 tokens, closing steered a tool call from its first token, and the closers it admitted
made the city ``}`` where the model, left free, wrote ``Paris`` and ended in 29 tokens."""
RECHECK_UNFIT = 16
"""Tokens between dry runs while the closing path does not fit in the budget at all."""
LOOP_TRIES = 48
"""Tokens a dry run tries at one position before it takes a token that loops (each try costs
a mask)."""
FIRST_OPEN_ENDED_TIER = 4
"""Index in :attr:`ClosingTokens.tiers` of the first class that may loop (what opens nothing,
then digits, then an opener); the closers and separators before it are taken as moving on,
which inside an email's local part, where ``}`` is text, they do not (a known gap)."""
CLOSERS = frozenset('"}])')
SEPARATORS = frozenset(",")
OPENERS = frozenset("{[(")


def _closing_class(text: str) -> int | None:
    """Where a token of (stripped) ``text`` ranks when closing, EOS being first: 0 made only
    of closers and starting with a quote, 1 the other tokens made only of closers, 2 of
    closers and separators, 3 anything else that opens nothing, 4 digits alone, 5 a single
    opener (a value that must be an array); None otherwise: whitespace alone, and a token
    that opens structure and then some, are never closing choices.

    A quote ranks first because inside a string ``}`` and ``]`` are text: steered to every
    closer, greedy SmolLM2 wrote ``}}}}…`` inside an open string to ``max_tokens``. Digits
    rank below the rest because they too could go on forever: in a date-time's fraction of a
    second the path took ``0`` after ``0`` (the lowest id of its class) and never reached the
    ``Z`` that ends it, so closing judged the output beyond saving and left the model writing
    zeros."""
    chars = set(text)
    if not chars:
        return None
    if chars <= CLOSERS:
        return 0 if text.startswith('"') else 1
    if chars <= CLOSERS | SEPARATORS:
        return 2
    if text.isdigit():
        return 4
    if not chars & OPENERS:
        return 3
    return 5 if len(text) == 1 else None


class ClosingTokens:
    """The tokens that end structure, by preference, packed as the sampler's masks are
    (bit ``t % 32`` of int32 word ``t // 32``): EOS first, then the classes of
    :func:`_closing_class`. A position where none is allowed keeps its whole mask.

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
        classes: list[list[int]] = [[] for _ in range(6)]
        for token in range(self._tokenizer.vocab_size):
            if not self._tokenizer.is_special_token(token):
                kind = _closing_class(self._tokenizer.decode_str([token]).strip())
                if kind is not None:
                    classes[kind].append(token)
        return [_packed(ids, self.vocab_size) for ids in (self._tokenizer.eos_tokens, *classes)]

    def narrow(self, mask: torch.Tensor, may_end: bool = True) -> tuple[int | None, bool]:
        """Narrows packed ``mask`` in place to its first non-empty preference class (EOS's
        only where the output ``may_end``: before ``min_tokens`` the sampler forbids it);
        returns the index in :attr:`tiers` of the class kept (None where the mask holds
        none) and whether that took anything away."""
        first = 0 if may_end else 1
        for index, tier in enumerate(self.tiers[first:], start=first):
            narrowed = mask & tier
            if narrowed.any():
                changed = not torch.equal(narrowed, mask)
                mask.copy_(narrowed)
                return index, changed
        return None, False


@dataclass(frozen=True)
class ClosingState:
    """Closing's decision at one output position.

    Attributes:
        closing: only closing tokens are admitted, from here to the end.
        next_check: the budget (tokens left) at or below which the next dry run is due.
        margin: tokens kept over the estimate (:meth:`start`).
    """

    closing: bool = False
    next_check: int = CLOSING_WINDOW
    margin: int = CLOSING_MARGIN

    @classmethod
    def start(cls, budget: int) -> ClosingState:
        """The state before an output's first token, with ``budget`` tokens to produce: its
        margin is :data:`CLOSING_MARGIN`, or a :data:`MARGIN_SHARE` of a small budget."""
        return cls(margin=min(CLOSING_MARGIN, max(2, budget // MARGIN_SHARE)))


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
        self._after = MaskBuffer(tokens.vocab_size)

    def decide(self, previous: ClosingState, budget: int) -> ClosingState:
        """The decision at this position, with ``budget`` tokens left to produce, after
        ``previous`` (the previous position's, or :meth:`ClosingState.start`)."""
        if previous.closing or budget > min(previous.next_check, CLOSING_WINDOW):
            return previous
        if self._matcher.is_accepting():
            # Cut here, the output is whole: nothing to steer (free text before a tool call
            # was ended early by the margin below). Look again at the next position.
            return replace(previous, next_check=budget - 1)
        length = self.tokens_to_close(budget)
        if length is None:  # steering cannot save it: leave the model free, look again later
            return replace(previous, next_check=budget - RECHECK_UNFIT)
        slack = budget - length - previous.margin
        if slack <= 0:
            return replace(previous, closing=True, next_check=0)
        # A token can deepen the structure by a few tokens of closing: look again well before
        # the slack could be spent.
        return replace(previous, next_check=budget - max(1, slack // 8))

    def tokens_to_close(self, limit: int) -> int | None:
        """Tokens (EOS included) the preferred path takes to end the output; None if it takes
        more than ``limit``."""
        steps = consumed = 0
        try:
            while not self._matcher.is_stopped():
                mask = self._scratch.fill(self._matcher)
                if steps == limit or not mask.any():
                    return None
                steps += 1
                if (mask & self._tokens.tiers[0]).any():
                    return steps  # EOS
                before = mask.clone()
                tier, _ = self._tokens.narrow(mask)
                if tier is None or self._next_token(mask, tier, before) is None:
                    return None
                consumed += 1
            return steps
        finally:
            self._matcher.rollback(consumed)

    def steer(self, mask: torch.Tensor, may_end: bool) -> bool:
        """Narrows packed ``mask`` in place at a position where closing is on: to its first
        preference class (EOS's only where the output ``may_end``), and where that class may
        loop, to the one token the closing path takes there, since the model, free within
        it, went on in a date-time's fraction or a URI's scheme to ``max_tokens``. Returns
        whether anything was taken away."""
        full = mask.clone()
        tier, changed = self._tokens.narrow(mask, may_end)
        if tier is None or tier < FIRST_OPEN_ENDED_TIER:
            return changed
        token = self._next_token(mask.clone(), tier, full)
        if token is None:
            return changed
        self._matcher.rollback(1)
        mask.copy_(_packed([token], self._tokens.vocab_size))
        return not torch.equal(mask, full)

    def _next_token(self, candidates: torch.Tensor, tier: int,
                    before: torch.Tensor) -> int | None:
        """Consumes and returns the closing path's next token among packed ``candidates``
        (class ``tier`` of the position's mask ``before``; cleared as tried): the lowest id,
        unless the class may loop and the token leaves the mask as it was (a letter after a
        letter in a URI's scheme, where ``:`` is what moves on): then the next lowest, up to
        :data:`LOOP_TRIES`, and failing those the lowest. None if the matcher rejects it."""
        first = _first_token(candidates)
        if tier >= FIRST_OPEN_ENDED_TIER:
            for _ in range(LOOP_TRIES):
                token = _first_token(candidates)
                if not self._matcher.consume_token(token):
                    return None
                if not torch.equal(self._after.fill(self._matcher), before):
                    return token
                self._matcher.rollback(1)
                _clear(candidates, token)
                if not candidates.any():
                    break
        return first if self._matcher.consume_token(first) else None


def _first_token(mask: torch.Tensor) -> int:
    """The lowest token id set in packed ``mask`` (which has one)."""
    word = int(mask.nonzero()[0, 0])
    bits = int(mask[word]) & 0xFFFFFFFF
    return word * 32 + (bits & -bits).bit_length() - 1


def _clear(mask: torch.Tensor, token: int) -> None:
    """Unsets ``token``'s bit in packed ``mask`` (int32 words: bit 31 is the sign)."""
    word, bit = divmod(token, 32)
    value = int(mask[word]) & 0xFFFFFFFF & ~(1 << bit)
    mask[word] = value - (1 << 32) if value >= 1 << 31 else value


def _packed(token_ids: list[int], vocab_size: int) -> torch.Tensor:
    """``[ceil(V / 32)]`` int32 with the bits of ``token_ids`` set."""
    bits = np.zeros(-(-vocab_size // 32) * 32, dtype=bool)
    bits[[t for t in token_ids if t < vocab_size]] = True
    return torch.from_numpy(np.packbits(bits, bitorder="little").view("<i4").copy())
