"""The interface every draft proposer implements, local or behind a draft replica.

A proposal is never output: the target engine verifies it in one forward pass and commits only
what verification accepts (``workers.speculative.verify``). Proposers see token ids only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass
class ProposalRequest:
    """One speculating sequence's ask for draft tokens.

    Attributes:
        request_id: the sequence's id (stable across the steps of one request).
        token_ids: its committed tokens, prompt then output.
        num_prompt_tokens: length of the prompt within ``token_ids``.
        k: most draft tokens wanted (>= 1).
        scope: whose text its drafts may come from: its LoRA adapter's content digest, empty
            for the base model. A proposer that indexes other requests (``suffix``) keeps each
            scope's apart, so one adapter's outputs never become another's drafts.
    """

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    k: int
    scope: str = ""


class Proposer(Protocol):
    """Proposes draft tokens for a batch of sequences.

    Implementations: ``workers.speculative.ngram.NgramProposer`` (prompt lookup over the
    request's own tokens), ``workers.speculative.suffix.SuffixProposer`` (a suffix index over
    every sequence the proposer has seen), ``workers.speculative.remote.RemoteProposer`` (either
    of them on a draft replica).
    """

    name: str

    def propose(self, requests: list[ProposalRequest]) -> list[list[int]]:
        """Draft tokens for each request, in order: at most ``k`` each, possibly none.

        Must never raise for a well-formed request; a proposer with nothing to offer returns
        an empty list for that request.
        """
        ...

    def finish(self, request_ids: list[str]) -> None:
        """The sequences have ended: drop any per-sequence state (a shared index may keep
        their tokens)."""
        ...
