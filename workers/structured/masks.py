"""A packed token mask that llguidance fills in place: bit ``t % 32`` of int32 word ``t // 32``
is set when token ``t`` is allowed.

It goes through llguidance's numpy entry points and shares the memory with a torch view:
importing ``llguidance.torch`` imports ``torch._dynamo``. Without it, importing the worker
deployment took 5.3 s instead of 6.9 s (``python -X importtime``), at every worker's start.
"""

from __future__ import annotations

from typing import NamedTuple

import llguidance
import llguidance.numpy
import torch


class MaskBuffer:
    """One ``[ceil(V / 32)]`` int32 mask, rewritten by each :meth:`fill`.

    Args:
        vocab_size: the logit row's length, in tokens.
    """

    def __init__(self, vocab_size: int):
        self._array = llguidance.numpy.allocate_token_bitmask(1, vocab_size)
        self.mask = torch.from_numpy(self._array[0])

    def fill(self, matcher: llguidance.LLMatcher) -> torch.Tensor:
        """:attr:`mask` set to the tokens ``matcher`` admits next (EOS where it may end)."""
        llguidance.numpy.fill_next_token_bitmask(matcher, self._array, 0)
        return self.mask


def admits(mask: torch.Tensor, token: int) -> bool:
    """Whether packed ``mask`` holds ``token``."""
    return bool((int(mask[token // 32]) >> (token % 32)) & 1)


class PositionMask(NamedTuple):
    """What a constraint admits at one output position, packed as :class:`MaskBuffer`'s.

    Attributes:
        allowed: ``[ceil(V / 32)]`` int32, the tokens the constraint admits (EOS only where
            it may end).
        narrowed: the part of ``allowed`` that closing admits near the end of the budget
            (``closing.py``); None where closing leaves the position alone. The sampler
            draws from ``allowed`` and, where that token is not in ``narrowed``, draws again
            within it: the same as drawing within ``narrowed`` (the first draw, conditioned
            on landing there, is distributed as the second), and the output then knows
            whether the budget changed it.
    """

    allowed: torch.Tensor
    narrowed: torch.Tensor | None = None
