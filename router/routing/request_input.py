"""What routing reads from one request: its prompt length, block digests and work."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from router.routing.checks import is_count
from workers.identity import DIGEST_SIZE
from workers.request import DECODE_HORIZON


@dataclass(frozen=True)
class RoutingInput:
    """What routing needs from one ``GenerationRequest``.

    Attributes:
        prompt_len: prompt length in tokens (at least 1).
        digests: the prompt's 32-byte block digests, leading block first (may be empty when the
            prompt is shorter than one block).
        decode_tokens: output tokens the request counts for in load: ``sampling.max_tokens``
            capped at ``workers.request.DECODE_HORIZON``, as the workers count it.
        request_id: the request's id, as the worker lists it in its routing stats.
    """

    prompt_len: int
    digests: list[bytes]
    decode_tokens: int
    request_id: str | None = None


def routing_input(pending_request: Any) -> RoutingInput | None:
    """Reads the ``GenerationRequest`` in ``pending_request.args[0]``, defensively.

    Anything this router cannot route on its content (no pending request, no arguments, no
    non-empty ``token_ids`` list, ``routing_digests`` missing or not a list of 32-byte
    ``bytes``) yields ``None`` so the caller routes on load alone; the worker, not the router,
    rejects malformed requests with a 4xx (case R6). Never raises.
    """
    args = getattr(pending_request, "args", None)
    if not isinstance(args, (list, tuple)) or not args:
        return None
    request = args[0]
    token_ids = getattr(request, "token_ids", None)
    digests = getattr(request, "routing_digests", None)
    if not isinstance(token_ids, (list, tuple)) or not token_ids:
        return None
    if not isinstance(digests, (list, tuple)):
        return None
    if not all(isinstance(d, bytes) and len(d) == DIGEST_SIZE for d in digests):
        return None
    max_tokens = getattr(getattr(request, "sampling", None), "max_tokens", 0)
    decode_tokens = min(max_tokens, DECODE_HORIZON) if is_count(max_tokens) else 0
    request_id = getattr(request, "request_id", None)
    return RoutingInput(len(token_ids), list(digests), decode_tokens,
                        request_id if isinstance(request_id, str) else None)
