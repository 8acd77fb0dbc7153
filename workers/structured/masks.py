"""A packed token mask that llguidance fills in place: bit ``t % 32`` of int32 word ``t // 32``
is set when token ``t`` is allowed.

It goes through llguidance's numpy entry points and shares the memory with a torch view:
importing ``llguidance.torch`` imports ``torch._dynamo``. Without it, importing the worker
deployment took 5.3 s instead of 6.9 s (``python -X importtime``), at every worker's start.
"""

from __future__ import annotations

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
