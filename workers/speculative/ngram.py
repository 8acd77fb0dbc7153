"""Prompt lookup decoding: draft tokens copied from earlier in the request's own tokens.

Saxena, "Prompt Lookup Decoding" (2023), as in vLLM's ``ngram`` proposer: the last ``n`` tokens
of a sequence (prompt + output) are looked up earlier in that same sequence, and the tokens that
followed the most recent earlier occurrence are proposed. The longest ``n`` in
``[ngram_min, ngram_max]`` that occurs wins. Stateless: nothing is kept between calls.
"""

from __future__ import annotations

from workers.speculative.proposer import ProposalRequest


class NgramProposer:
    """Proposes, per request, the tokens that followed the latest earlier copy of its suffix.

    Cost per request is one backward scan over its tokens (C-speed ``list.index``) plus a few
    Python steps per candidate position; no per-request state, so :meth:`finish` does nothing.

    Args:
        ngram_min: the shortest suffix, in tokens, that may match (>= 1).
        ngram_max: the longest suffix, in tokens, that is tried (>= ``ngram_min``).

    Raises:
        ValueError: ``ngram_min`` < 1 or ``ngram_max`` < ``ngram_min``.
    """

    name = "ngram"

    def __init__(self, ngram_min: int = 1, ngram_max: int = 4) -> None:
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {ngram_min}, {ngram_max}")
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max

    def propose(self, requests: list[ProposalRequest]) -> list[list[int]]:
        """Up to ``k`` draft tokens per request; ``[]`` where no suffix of a usable length
        occurs earlier in the request's tokens."""
        return [self.propose_one(r.token_ids, r.k) for r in requests]

    def propose_one(self, token_ids: list[int], k: int) -> list[int]:
        """The draft for one sequence: up to ``k`` tokens, truncated at the sequence's end."""
        if k <= 0:
            return []
        length, start = find_longest_match(token_ids, self.ngram_max)
        if length < self.ngram_min:
            return []
        return list(token_ids[start:start + k])

    def finish(self, request_ids: list[str]) -> None:
        """Nothing to drop: the proposer keeps no per-sequence state."""


def find_longest_match(token_ids: list[int], max_len: int) -> tuple[int, int]:
    """The longest suffix of ``token_ids`` (at most ``max_len`` tokens) that occurs earlier.

    An occurrence is "earlier" when at least one token follows it, so it may overlap the
    suffix itself (``[5, 5, 5]`` matches ``[5, 5]`` at positions 0-1). Among occurrences of
    the longest length, the most recent wins.

    Returns:
        ``(n, start)``: the match length in tokens (0 if none) and the index in ``token_ids``
        of the first token after the matched occurrence (the draft starts there).
    """
    size = len(token_ids)
    if size < 2 or max_len < 1:
        return 0, 0
    # Searching the reversed list forward with list.index is a backward search at C speed;
    # rev[j:j + n] == rev[:n] means an occurrence ending j tokens before the last one.
    rev = token_ids[::-1]
    best_len, best_j = 0, 0
    j = 0
    while best_len < max_len:
        # Only a candidate that also matches rev[best_len] can beat the best, so scan for
        # that (the "frontier") token: it skips candidates that merely tie the best.
        frontier = best_len
        try:
            pos = rev.index(rev[frontier], j + 1 + frontier)
        except ValueError:
            break
        j = pos - frontier
        if rev[j:j + frontier] != rev[:frontier]:
            continue
        top = min(max_len, size - j)  # the occurrence may not run past the sequence start
        n = frontier + 1
        while n < top and rev[j + n] == rev[n]:
            n += 1
        best_len, best_j = n, j
    return best_len, size - best_j
