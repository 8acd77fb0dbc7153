"""What routing reads from one request: its prompt length, block digests and work in tokens.

Work tokens (:func:`contract.load.work_tokens`) of one request on a worker = prompt tokens the
worker still has to prefill + every output token the request may still produce (``max_tokens``
per choice; the ingress sets ``max_tokens`` to the rest of the context when the client gave
none). This is the unit the workers report as ``queued_tokens``
(:class:`contract.load.RoutingStats`), where tokens already prefilled or generated are
subtracted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from contract.identity import DIGEST_SIZE
from contract.load import is_count, work_tokens


@dataclass(frozen=True)
class RoutingInput:
    """What routing needs from one ``GenerationRequest``.

    Attributes:
        prompt_len: prompt length in tokens (at least 1).
        digests: the prompt's 32-byte block digests, leading block first (may be empty when the
            prompt is shorter than one block).
        decode_tokens: output tokens the request may produce: ``sampling.max_tokens`` times
            ``sampling.n`` (the choices decode separately).
        request_id: the request's id, as the worker lists it in its routing stats.
        adapter_digest: the content digest of its LoRA adapter (None: the base model).
    """

    prompt_len: int
    digests: list[bytes]
    decode_tokens: int
    request_id: str | None = None
    adapter_digest: str | None = None

    def work_tokens(self, cached_blocks: int, block_size: int) -> int:
        """Tokens of work (:func:`contract.load.work_tokens`) the request adds to a worker
        holding ``cached_blocks`` of its leading blocks (of ``block_size`` tokens each)."""
        return work_tokens(uncached_tokens(self.prompt_len, cached_blocks, block_size),
                           self.decode_tokens)


def uncached_tokens(prompt_len: int, cached_blocks: int, block_size: int) -> int:
    """Prompt tokens still to prefill when ``cached_blocks`` leading blocks are cached.

    At least 1: a fully cached prompt still recomputes its last token to get logits.
    """
    return max(1, prompt_len - max(0, cached_blocks) * block_size)


def routing_input(pending_request: Any) -> RoutingInput | None:
    """Reads the ``GenerationRequest`` in ``pending_request.args[0]``, defensively.

    Anything this router cannot route on its content (no pending request, no arguments, no
    non-empty ``token_ids`` list, ``prompt_digests`` missing or its ``digests`` not a list of
    32-byte ``bytes``) yields ``None`` so the caller routes on load alone; the worker, not the
    router, rejects malformed requests with a 4xx (case R6). Never raises.
    """
    args = getattr(pending_request, "args", None)
    if not isinstance(args, (list, tuple)) or not args:
        return None
    request = args[0]
    token_ids = getattr(request, "token_ids", None)
    digests = getattr(getattr(request, "prompt_digests", None), "digests", None)
    if not isinstance(token_ids, (list, tuple)) or not token_ids:
        return None
    if not isinstance(digests, (list, tuple)):
        return None
    if not all(isinstance(d, bytes) and len(d) == DIGEST_SIZE for d in digests):
        return None
    request_id = getattr(request, "request_id", None)
    adapter = getattr(getattr(request, "adapter", None), "weights_digest", None)
    return RoutingInput(len(token_ids), list(digests), _decode_tokens(request),
                        request_id if isinstance(request_id, str) else None,
                        adapter if isinstance(adapter, str) and adapter else None)


def _decode_tokens(request: Any) -> int:
    """The output tokens of :func:`contract.load.work_tokens`: ``max_tokens`` for each of the
    request's ``n`` choices; 0 where unreadable."""
    sampling = getattr(request, "sampling", None)
    max_tokens = getattr(sampling, "max_tokens", 0)
    choices = getattr(sampling, "n", 1)
    if not is_count(max_tokens) or not is_count(choices):
        return 0
    return work_tokens(0, int(max_tokens), int(choices))
