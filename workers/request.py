"""What a worker is asked to generate and what it streams back.

These cross process boundaries (ingress → router → worker replica) as plain pickled dataclasses.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from workers.identity import CacheNamespace

FinishReason = Literal["stop", "length", "abort"]

GREEDY_TEMPERATURE = 1e-5
"""Below this temperature sampling is argmax (vLLM draws the same line)."""

DECODE_HORIZON = 128
"""Output tokens a request is counted for when load is measured in tokens: a request with a
large ``max_tokens`` rarely uses it all, so load counts at most this many (tokens)."""


class InvalidRequestError(ValueError):
    """A request the engine cannot serve as asked; ``param`` names the offending field."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_value"):
        super().__init__(message)
        self.param = param
        self.code = code


@dataclass
class SamplingParams:
    """How to pick each next token.

    Attributes:
        temperature: 0 means greedy (argmax); otherwise logits are divided by it.
        top_p: nucleus sampling mass in (0, 1]; 1 disables it.
        top_k: keep the k most likely tokens; 0 or -1 disables it.
        seed: seeds a per-request generator, so the output does not depend on batch neighbours.
        max_tokens: most tokens to generate.
        stop: strings that end generation; the matched string is not returned.
        stop_token_ids: token ids that end generation (the model's EOS is added unless
            ``ignore_eos``); the stop token is not returned as text.
        ignore_eos: keep generating past the model's end-of-sequence token.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int = 16
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        """Temperatures below :data:`GREEDY_TEMPERATURE` are greedy: dividing logits by them
        overflows to inf and would make sampling fail."""
        return self.temperature < GREEDY_TEMPERATURE

    def validate(self) -> None:
        """Raises :class:`InvalidRequestError` naming the first out-of-range field."""
        if not 0.0 <= self.temperature <= 2.0:
            raise InvalidRequestError("temperature must be in [0, 2]", "temperature")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError("top_p must be in (0, 1]", "top_p")
        if self.top_k < -1:
            raise InvalidRequestError("top_k must be -1, 0 (disabled) or positive", "top_k")
        if self.max_tokens < 1:
            raise InvalidRequestError("max_tokens must be at least 1", "max_tokens")
        if any(not s for s in self.stop):
            raise InvalidRequestError("stop strings must not be empty", "stop")


@dataclass
class GenerationRequest:
    """One generation job for a worker.

    Attributes:
        request_id: unique id, used for cancellation and logs.
        token_ids: the prompt, already tokenized (chat template applied) by the ingress.
        sampling: sampling parameters.
        namespace: the cache scope (tenant, salt) this request may share KV within.
        routing_digests: block digests of the prompt under the deployment's identity, computed
            once by the ingress for the prefix-aware router. Workers recompute their own.
    """

    request_id: str
    token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    namespace: CacheNamespace = field(default_factory=CacheNamespace)
    routing_digests: list[bytes] = field(default_factory=list)


@dataclass
class GenerationChunk:
    """What one engine step produced for one request.

    Attributes:
        request_id: the request this belongs to.
        token_ids: newly committed output token ids (may be empty when held back by a stop
            string check).
        text: newly final output text.
        finish_reason: set on the last chunk.
        prompt_tokens: prompt length in tokens.
        cached_tokens: prompt tokens whose KV was reused from the prefix cache, counted at the
            request's first admission only.
        completion_tokens: output tokens so far (equals the tokens returned).
        worker_id: the replica that served it (filled by the worker deployment).
    """

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    worker_id: str = ""
