"""Closing a constrained output before its token budget runs out.

A grammar can admit outputs longer than ``max_tokens`` (an unbounded number, a recursive tree,
an open object), and a model can loop inside one: greedy SmolLM2 writes ``0000…`` in a number
until the budget cuts it, leaving a prefix that does not parse. So in the last stretch of the
budget, dry runs of the matcher estimate how many tokens closing the output would take, along a
path that prefers tokens which end things (EOS, then closing quotes, then closing brackets,
then separators, then tokens that open nothing, then digits) and passes over tokens that
loop. The dry runs come more often as the estimate nears what is left, so an output far from
its end costs one now and then.

- Once the estimate no longer fits in what is left, closing admits only the first preference
  class the constraint allows, to the end. The model still chooses within it, except where
  the class may loop or the path passes over the class's first token: there only the path's
  token.
- Before that, near the end, a position where a token could open more than the budget can
  close (a ``,``, ``[`` or ``{``) holds such tokens back, where a closer may come instead.

Either way closing gives a second mask beside the constraint's (``PositionMask.narrowed``):
the sampler draws within the constraint and draws again within closing's mask only where the
first token is not in it. An output whose token closing so chose ends with ``finish_reason``
``length``: it parses, but the model was stopped short. Each decision depends only on the
tokens before its position, so a verification's drafts get the masks a plain step would give
them.

A position where the output may already end (its matcher accepts) is never steered: cut there,
it is whole. That leaves free text alone (``tool_choice`` ``auto``'s text before a call), which
the margin would otherwise end with EOS well before the budget.

The estimate is the length of a greedy path (lowest ids, so single characters, first), not of
the shortest completion. Where the path does not fit in the budget at all, closing leaves the
model free (steering could not save the output) and looks again later; such an output, or one
whose every completion is longer than the budget (a long ``minLength``), still ends cut.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

import llguidance
import numpy as np
import torch

from workers.structured.masks import MaskBuffer, admits

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
SEARCH_TRIES = 256
"""Tokens a dry run may try for loops in all (each costs a mask, about 20 µs)."""
LOOP_SPAN = 2
"""Positions a dry run compares a token's mask with to take it for a loop: the token's own
and the one before (``.`` then ``}`` in an email's local part); a closer's own only (closing
a tree alternates two masks). Three took the tens of a date-time's seconds for a loop, since
the tens of its minutes allow the same digits, and the path wrote the leap second ``60``,
which ``jsonschema``'s format check refuses."""
BRANCH_TRIES = 48
"""Tokens a dry run tries at one position for one that does not loop: inside a string,
thousands of words are allowed, and the single characters, which come first, hold what moves
on."""
NESTING_PROBE = 16
"""Times a dry run takes a closer again to tell nested structure from text (``_leads_out``):
deeper nesting of one kind is taken for a loop, and the model is left free there."""
LAST_CLOSER_TIER = 3
"""Index in :attr:`ClosingTokens.tiers` of the last class made only of closers and
separators: the tokens ``_leads_out`` probes."""
FIRST_OPEN_ENDED_TIER = 4
"""Index in :attr:`ClosingTokens.tiers` of the first class that may loop (what opens nothing,
then digits, then an opener, then the rest): closing leaves the model free within a class
before it, which the closing path's token moves on from, and forces the path's token from
this one on."""
CLOSERS = frozenset('"}])')
SEPARATORS = frozenset(",")
OPENERS = frozenset("{[(")
OPENS_MORE = frozenset(",[{")


def _closing_class(text: str) -> int:
    """Where a token of (stripped) ``text`` ranks when closing, EOS being first: 0 made only
    of closers and starting with a quote, 1 the other tokens made only of closers, 2 of
    closers and separators, 3 anything else that opens nothing, 4 digits alone not led by
    ``0``, 5 those led by ``0``, 6 a single opener (a value that must be an array), 7 the
    rest: whitespace alone, and tokens that open structure and then some, taken only where
    nothing else may come (a tool without parameters admits `` {}`` alone for its arguments,
    and with no class for it the path ended there, and the output was cut).

    A quote ranks first because inside a string ``}`` and ``]`` are text: steered to every
    closer, greedy SmolLM2 wrote ``}}}}…`` inside an open string to ``max_tokens``. Digits
    rank below the rest because they too could go on forever: in a date-time's fraction of a
    second the path took ``0`` after ``0`` (the lowest id of its class) and never reached the
    ``Z`` that ends it, so closing judged the output beyond saving and left the model writing
    zeros. Zeros rank last because a date's grammar admits the year ``0000``, which Python's
    dates, and so ``jsonschema``'s format check, refuse: closed early at 96 tokens, 11 of
    200 outputs of the fifty-schema suite held one."""
    chars = set(text)
    if not chars:
        return 7
    if chars <= CLOSERS:
        return 0 if text.startswith('"') else 1
    if chars <= CLOSERS | SEPARATORS:
        return 2
    if text.isdigit():
        return 5 if text.startswith("0") else 4
    if not chars & OPENERS:
        return 3
    return 6 if len(text) == 1 else 7


class ClosingTokens:
    """The tokens that end structure, by preference, packed as the sampler's masks are
    (bit ``t % 32`` of int32 word ``t // 32``): EOS first, then the classes of
    :func:`_closing_class`. Special tokens other than EOS are in none: a position that
    allows only those keeps its whole mask.

    Args:
        tokenizer: llguidance's tokenizer of the model.
        vocab_size: the logit row's length, in tokens.
    """

    def __init__(self, tokenizer: llguidance.LLTokenizer, vocab_size: int):
        self.vocab_size = vocab_size
        self._tokenizer = tokenizer

    @property
    def tiers(self) -> list[torch.Tensor]:
        """The packed preference classes."""
        return self._sorted[0]

    @functools.cached_property
    def stack(self) -> np.ndarray:
        """``[len(tiers), ceil(V / 32)]`` int32: :attr:`tiers` as one array, for a dry run
        to find a position's classes in one operation."""
        return np.stack([tier.numpy() for tier in self.tiers])

    @functools.cached_property
    def closers(self) -> np.ndarray:
        """Packed, EOS and the two classes made only of closers: what can end structure."""
        return np.bitwise_or.reduce(self.stack[:3])

    @property
    def openers(self) -> torch.Tensor:
        """Packed, the tokens holding a ``,``, ``[`` or ``{``: what may open another item,
        property or level."""
        return self._sorted[1]

    @functools.cached_property
    def _sorted(self) -> tuple[list[torch.Tensor], torch.Tensor]:
        """:attr:`tiers` and :attr:`openers`, sorted out of the vocabulary on first use
        (about 0.5 s for 49k tokens): only outputs that near their budget pay for it."""
        classes: list[list[int]] = [[] for _ in range(8)]
        openers = []
        for token in range(self._tokenizer.vocab_size):
            if not self._tokenizer.is_special_token(token):
                text = self._tokenizer.decode_str([token]).strip()
                classes[_closing_class(text)].append(token)
                if not OPENS_MORE.isdisjoint(text):
                    openers.append(token)
        tiers = [_packed(ids, self.vocab_size) for ids in (self._tokenizer.eos_tokens, *classes)]
        return tiers, _packed(openers, self.vocab_size)

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
        estimate: the last dry run's closing length, in tokens; None before one, or where
            it found no path.
    """

    closing: bool = False
    next_check: int = CLOSING_WINDOW
    margin: int = CLOSING_MARGIN
    estimate: int | None = None

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

    Attributes:
        matcher: the matcher dry runs start from (a verification's drafts swap in a copy).
    """

    def __init__(self, matcher: llguidance.LLMatcher, tokens: ClosingTokens):
        self.matcher = matcher
        self._tokens = tokens
        self._scratch = MaskBuffer(tokens.vocab_size)
        self._after = MaskBuffer(tokens.vocab_size)
        # mask_key of a position where an opener may come -> the closing path's length
        # after it, or None if longer than the limit it was measured against (hold_openers).
        self._opened: dict[int, tuple[int | None, int]] = {}

    def decide(self, previous: ClosingState, budget: int,
               history: Sequence[int] = ()) -> ClosingState:
        """The decision at this position, with ``budget`` tokens left to produce, after
        ``previous`` (the previous position's, or :meth:`ClosingState.start`) and the
        positions whose :func:`mask_key` are ``history``, oldest first."""
        if previous.closing or budget > min(previous.next_check, CLOSING_WINDOW):
            return previous
        if self.matcher.is_accepting():
            # Cut here, the output is whole: nothing to steer (free text before a tool call
            # was ended early by the margin below). Look again at the next position.
            return replace(previous, next_check=budget - 1)
        length = self.tokens_to_close(budget, history)
        if length is None:  # steering cannot save it: leave the model free, look again later
            return replace(previous, next_check=budget - RECHECK_UNFIT, estimate=None)
        slack = budget - length - previous.margin
        if slack <= 0:
            return replace(previous, closing=True, next_check=0, estimate=length)
        # Look again once half the slack is spent: a token spends one of it, or a few where
        # it deepens the structure, and the openers that deepen it most are held back near
        # the end (hold_openers). Looking every eighth of it cost 225 µs of dry runs a
        # position against 68 µs (a throwaway profile of nalar bench's json requests at 128
        # tokens), and closed no more outputs at 64, 96 or 128 tokens.
        return replace(previous, next_check=budget - max(1, slack // 2), estimate=length)

    def hold_openers(self, mask: torch.Tensor, state: ClosingState, budget: int,
                     history: Sequence[int] = ()) -> torch.Tensor | None:
        """Packed ``mask`` without its openers (:attr:`ClosingTokens.openers`) where one
        would open more than the budget can close: where, after the first of them, the
        closing path and the margin no longer fit in the ``budget`` tokens left (after the
        positions whose :func:`mask_key` are ``history``). None where they may stay: closing
        is already on or not yet in its window, or the output may end here or is past
        saving, or nothing but an opener may come here, or what one opens fits.

        Without it, the ``,`` before another array item of three required keys, or the
        ``{`` of another node of a tree, or the first item of an array of objects of four
        formatted strings (86 tokens), taken with too little left, made the closing path
        longer than the budget, the model was left free, and the output was cut unparsed
        (3 of 96 requests of ``nalar bench --workload json`` at 128 tokens). Closing from
        there on instead ended tool calls that would have finished by themselves; holding
        back only the openers, and only where the model reaches for one (the sampler draws
        again only then), leaves them alone.

        The closing path after an opener is measured once per position's mask and kept
        (:attr:`_opened`): an array's items, each followed by the same choice, ask again
        and again. Measuring at every such position cost 330 µs a position on ``nalar
        bench``'s json requests at 128 tokens (a throwaway profile)."""
        if (state.closing or state.estimate is None or budget > CLOSING_WINDOW
                or self.matcher.is_accepting()):
            return None
        here, opening = mask.numpy(), self._tokens.openers.numpy()
        openers, held = here & opening, here & ~opening
        if not openers.any() or not (held & self._tokens.closers).any():
            return None  # none here, or one must come (no closer may)
        key = mask_key(here)
        room = budget - 1 - state.margin
        length, limit = self._opened.get(key, (None, -1))
        if length is None and limit < room:  # not measured, or only against a smaller room
            length = self._path_after(_first_token(openers), key, room, history)
            self._opened[key] = length, room
        if length is not None and length < 0:
            return None  # text, inside a string: it opened nothing
        return torch.from_numpy(held) if length is None or length > room else None

    def _path_after(self, opener: int, key: int, limit: int,
                    history: Sequence[int]) -> int | None:
        """The closing path's length after ``opener`` at the position whose mask's key is
        ``key``: None if longer than ``limit``; -1 where the opener leaves the mask as it
        was (text in a string), or the matcher refuses it (nothing to hold)."""
        with self._on_a_copy():
            if not self.matcher.consume_token(opener):
                return -1
            if mask_key(self._after.fill(self.matcher).numpy()) == key:
                return -1
            path = self.closing_path(limit, [*history, key])
            return None if path is None else len(path)

    def tokens_to_close(self, limit: int, history: Sequence[int] = ()) -> int | None:
        """Tokens (EOS included) the closing path (:meth:`closing_path`) takes to end the
        output; None if it finds none within ``limit``."""
        path = self.closing_path(limit, history)
        return None if path is None else len(path)

    def closing_path(self, limit: int, history: Sequence[int] = ()) -> list[int] | None:
        """The preferred way to end the output from here: at most ``limit`` token ids, the
        last EOS unless the constraint stops by itself; None if there is none that short.
        The matcher is left where it was (the path is tried on a copy).

        At each position it takes the first token, in the preference classes' order and by
        lowest id within each, that does not loop: that does not lead back to the mask of
        its position or of the one before (:data:`LOOP_SPAN`), the output's own included
        (``history``: :func:`mask_key` of each, oldest first). In an email's local part
        ``}`` is text and loops, and so does ``.`` after ``.}``; ``0`` after ``0`` loops in a
        date-time's fraction. So the path reaches what moves on (``@``, ``Z``, ``:``). Where
        every token loops it takes the first anyway: a year's four digits each leave the
        mask as it was, and only counting moves on. A mask stands in for the matcher's state,
        which llguidance does not expose; far apart, two states share one (after a string
        inside an array item and after the array, ``,`` may come), so only nearby positions
        are compared. After :data:`SEARCH_TRIES` tokens tried, it takes each position's
        first."""
        mask = self._scratch.fill(self.matcher).numpy().copy()
        recent = collections.deque([*history, mask_key(mask)], maxlen=LOOP_SPAN)
        tries = SEARCH_TRIES
        path: list[int] = []  # consumed, so EOS is never in it
        with self._on_a_copy():
            while not self.matcher.is_stopped():
                if len(path) == limit:
                    return None
                ending = mask & self._tokens.stack[0]
                if ending.any():
                    return [*path, _first_token(ending)]
                step = self._next_step(mask, recent, max(1, min(BRANCH_TRIES, tries)))
                if step is None:
                    return None
                token, mask, tried = step
                path.append(token)
                tries -= tried
                recent.append(mask_key(mask))
            return path

    @contextlib.contextmanager
    def _on_a_copy(self) -> Iterator[None]:
        """Runs a dry run on a copy of the matcher (about 2 µs), left where it was. A token
        after which nothing may follow (a grammar's dead end) leaves a matcher in error once
        its next mask is computed, which ``rollback`` cannot undo: met in a dry run, it made
        the sequence's own next mask EOS alone, and a request was answered with an empty
        "complete" output (a fresh user's break test)."""
        real = self.matcher
        self.matcher = real.deep_copy()
        try:
            yield
        finally:
            self.matcher = real

    def _next_step(self, mask: np.ndarray, recent: collections.deque[int],
                   tries: int) -> tuple[int, np.ndarray, int] | None:
        """Consumes the closing path's token at a position whose packed ``mask`` is given,
        after the positions whose masks are ``recent`` (this one's last), trying at most
        ``tries`` tokens (:meth:`closing_path`). Returns the token, the mask after it and
        the tokens tried; None where the matcher takes none."""
        looping: tuple[int, np.ndarray] | None = None
        tried = 0
        for tier, token in itertools.islice(self._candidates(mask), tries):
            tried += 1
            if not self.matcher.consume_token(token):
                continue
            after = self._after.fill(self.matcher).numpy().copy()
            # A token made of closers (and separators) is compared with its own position
            # only: closing nested structure alternates two masks (after each `]` of a tree,
            # `}` must come; after each `}`, `]` or `,` may), which is progress, not the loop
            # `.` then `}` is in an email.
            compared = recent if tier >= FIRST_OPEN_ENDED_TIER else (recent[-1],)
            if (self.matcher.is_stopped() or mask_key(after) not in compared
                    or (tier <= LAST_CLOSER_TIER and self._leads_out(token, mask_key(after)))):
                return token, after, tried
            self.matcher.rollback(1)
            looping = looping or (token, after)
        if looping is None:
            return None
        self.matcher.consume_token(looping[0])
        return (*looping, tried)

    def _leads_out(self, closer: int, key: int) -> bool:
        """Whether ``closer``, just taken, with the mask after it ``key`` as before it, is
        nested structure closing rather than text: taken again (at most
        :data:`NESTING_PROBE` times), it is refused, or ends the output, or the mask after it
        changes. An object closed inside an object leaves the mask it found (a ``,`` or a
        ``}`` may come after either), so without this the path took the ``,`` and another
        property, again and again, and found no way out of an open object three levels deep
        (6 of 12 ``json_object`` outputs cut unparsed at 100 tokens, in the break test). A
        ``}`` inside a string is text: the mask never changes. The matcher is left where it
        was."""
        taken = 0
        try:
            for _ in range(NESTING_PROBE):
                if not self.matcher.consume_token(closer):
                    return True
                taken += 1
                if (self.matcher.is_stopped()
                        or mask_key(self._after.fill(self.matcher).numpy()) != key):
                    return True
            return False
        finally:
            self.matcher.rollback(taken)

    def _candidates(self, mask: np.ndarray) -> Iterator[tuple[int, int]]:
        """The tokens of packed ``mask`` in closing's order, each with the index of its
        class in :attr:`ClosingTokens.tiers`: the preference classes after EOS's, lowest id
        first within each."""
        for index, tier in enumerate(self._tokens.stack[1:] & mask, start=1):
            for word in np.flatnonzero(tier):
                bits = int(tier[word]) & 0xFFFFFFFF
                while bits:
                    lowest = bits & -bits
                    yield index, int(word) * 32 + lowest.bit_length() - 1
                    bits ^= lowest

    def steer(self, mask: torch.Tensor, budget: int, may_end: bool,
              history: Sequence[int] = ()) -> torch.Tensor | None:
        """What closing admits of packed ``mask`` at a position where it is on, with
        ``budget`` tokens left after the positions whose :func:`mask_key` are ``history``:
        the first preference class (EOS's only where the output ``may_end``), within which
        the model chooses; but the closing path's one token where that is not the class's
        first, or the class may loop (what opens nothing, and digits: free within them, the
        model went on in a date-time's fraction or a URI's scheme to ``max_tokens``). None
        where that takes nothing away."""
        narrowed = mask.clone()
        tier, changed = self._tokens.narrow(narrowed, may_end)
        kept = narrowed if changed else None
        if tier is None or tier == 0:
            return kept
        path = self.closing_path(min(budget, CLOSING_WINDOW), history)
        if not path or admits(self._tokens.tiers[0], path[0]):  # none, or EOS before
            return kept                                           # min_tokens: the class
        if tier < FIRST_OPEN_ENDED_TIER and path[0] == _first_token(narrowed.numpy()):
            return kept
        only = _packed([path[0]], self._tokens.vocab_size)
        return None if torch.equal(only, mask) else only


def _first_token(mask: np.ndarray) -> int:
    """The lowest token id set in packed ``mask`` (which has one)."""
    word = int(np.flatnonzero(mask)[0])
    bits = int(mask[word]) & 0xFFFFFFFF
    return word * 32 + (bits & -bits).bit_length() - 1


def mask_key(mask: np.ndarray) -> int:
    """A hash of packed ``mask``, to compare positions by (:meth:`ClosingEstimate.closing_path`)."""
    return hash(mask.tobytes())


def _packed(token_ids: list[int], vocab_size: int) -> torch.Tensor:
    """``[ceil(V / 32)]`` int32 with the bits of ``token_ids`` set."""
    bits = np.zeros(-(-vocab_size // 32) * 32, dtype=bool)
    bits[[t for t in token_ids if t < vocab_size]] = True
    return torch.from_numpy(np.packbits(bits, bitorder="little").view("<i4").copy())
