"""A request's ``n`` choices: sibling sequences that share its prompt's KV blocks.

A request with ``n > 1`` becomes ``n`` sibling sequences ``{request_id}#{i}``, queued together.
The first prefills the prompt; the scheduler holds the others while it computes their next
block (``workers.scheduler``), then admits them as prefix-cache hits, so the prompt's KV is
computed once (plus each sibling's recomputed last token) and its blocks are shared by
reference count (vLLM's parallel sampling does the same through its prefix cache).
"""

from __future__ import annotations

from workers.sequence import Sequence


class Choices:
    """The sequences of every request in an engine, by request id."""

    def __init__(self) -> None:
        self._by_request: dict[str, list[Sequence]] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._by_request

    def add(self, request_id: str, seqs: list[Sequence]) -> None:
        """Records a request's choices (``seqs[i]`` is choice ``i``)."""
        self._by_request[request_id] = list(seqs)

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
