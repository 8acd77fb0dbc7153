"""A request's ``n`` choices: sibling sequences that share its prompt's KV blocks.

A request with ``n > 1`` becomes ``n`` sibling sequences ``{request_id}#{i}``. The first
prefills the prompt; the others are held back until its full prompt blocks are registered,
then queued as prefix-cache hits, so the prompt's KV is computed once (plus each sibling's
recomputed last token) and its blocks are shared by reference count (vLLM's parallel sampling
does the same through its prefix cache).
"""

from __future__ import annotations

from workers.sequence import Sequence


class Choices:
    """The sequences of every request in an engine, by request id, and the siblings held back.

    Args:
        block_size: tokens per KV block.
    """

    def __init__(self, block_size: int):
        self.block_size = block_size
        self._by_request: dict[str, list[Sequence]] = {}
        self._held: dict[str, list[Sequence]] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._by_request

    def add(self, request_id: str, seqs: list[Sequence]) -> Sequence:
        """Records a request's choices (``seqs[i]`` is choice ``i``); returns the one to queue
        now, holding the rest back until :meth:`release` lets them go."""
        self._by_request[request_id] = list(seqs)
        if len(seqs) > 1:
            self._held[request_id] = seqs[1:]
        return seqs[0]

    def of(self, request_id: str) -> list[Sequence]:
        """The request's choices still in the engine (empty when none)."""
        return list(self._by_request.get(request_id, ()))

    def left(self, request_id: str) -> int:
        """How many of the request's choices are still in the engine."""
        return len(self._by_request.get(request_id, ()))

    def remove(self, seq: Sequence) -> None:
        """``seq`` has finished; forget the request once its last choice has."""
        request_id = seq.request.request_id
        choices = self._by_request[request_id]
        choices.remove(seq)
        if not choices:
            del self._by_request[request_id]
            self._held.pop(request_id, None)

    def release(self) -> list[Sequence]:
        """The held siblings of every request whose first choice has registered its full
        prompt blocks (or is gone), now to be queued so they admit as prefix-cache hits."""
        released = []
        for request_id, siblings in list(self._held.items()):
            leader = next((seq for seq in self._by_request[request_id]
                           if seq.choice_index == 0), None)
            # The last prompt token is always recomputed, so only these blocks can be hits.
            full_blocks = (siblings[0].num_prompt_tokens - 1) // self.block_size
            if leader is None or leader.num_registered_blocks >= full_blocks:
                del self._held[request_id]
                released += siblings
        return released
