"""What a workload asks for (:class:`BenchRequest`) and what one request measured
(:class:`RequestRecord`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class BenchRequest:
    """One request a workload asks for.

    Attributes:
        messages: the chat messages (``role``/``content``); the completions endpoint gets them
            rendered as one prompt.
        max_tokens: the most output tokens to ask for.
        estimated_prompt_tokens: the workload's estimate, used only when the server reports no
            ``usage``.
        api_key: the bearer key to send (a tenant's own key), or None for the client's default.
        label: what the request belongs to (``tenant-3``, ``conversation-7``), kept in records.
        model: the ``model`` to ask for (a LoRA adapter's name), or None for the client's.
        response_format: OpenAI's ``response_format`` to send (``json_schema`` or
            ``json_object``), or None for free text; the output is checked against it.
    """

    messages: list[dict[str, str]]
    max_tokens: int
    estimated_prompt_tokens: int
    api_key: str | None = None
    label: str = ""
    model: str | None = None
    response_format: dict[str, Any] | None = None


FAILURE_KINDS = ("http", "sse_error", "timeout", "broken_stream", "incomplete_stream",
                 "no_output", "malformed_event")
"""How a request can fail: a non-2xx answer, an error event in the stream, a timeout, a
transport error mid-stream, a stream that ended before ``[DONE]``, a stream without any choice,
an event that is not JSON."""


@dataclass
class RequestRecord:
    """One request as the client measured it (times in seconds, token counts from the server's
    ``usage`` when it reports one).

    Attributes:
        label: the request's :attr:`BenchRequest.label`.
        start_s: when it was sent, seconds since its phase began.
        ttft_s: time to the first output chunk; None when failed before it.
        itl_s: gaps between consecutive output chunks (inter-token latencies; a chunk carrying
            several tokens counts once, as in ``vllm bench serve``).
        e2e_s: send to end of stream (``[DONE]``), or to the failure.
        prompt_tokens, completion_tokens: the server's counts (estimates when
            ``usage_reported`` is False).
        cached_tokens: ``usage.prompt_tokens_details.cached_tokens``; None when not reported.
        usage_reported: whether the server sent ``usage``.
        worker: the ``x-nalar-worker`` response header, when present.
        accepted_prediction_tokens, rejected_prediction_tokens: speculative decoding's draft
            tokens committed and discarded (``usage.completion_tokens_details``), when reported.
        failure: one of :data:`FAILURE_KINDS`, None for a success.
        error: the failure's message (HTTP status and the server's message, for ``http``).
        http_status: the response status, when one arrived.
        output_text: the generated text (multi-turn history needs it; not saved in reports).
        valid_output: for a request that asked for a ``response_format``, whether its output
            parsed and validated against it; None for free text and failed requests.
    """

    label: str
    start_s: float
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    e2e_s: float | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int | None = None
    usage_reported: bool = False
    worker: str | None = None
    accepted_prediction_tokens: int | None = None
    rejected_prediction_tokens: int | None = None
    failure: str | None = None
    error: str | None = None
    http_status: int | None = None
    output_text: str = ""
    valid_output: bool | None = None

    @property
    def ok(self) -> bool:
        """Whether the request succeeded."""
        return self.failure is None

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first: ``(e2e - ttft) / (completion - 1)``, defined
        for successes with at least two output tokens (``vllm bench serve``'s definition)."""
        if not self.ok or self.completion_tokens < 2 or self.ttft_s is None:
            return None
        return (self.e2e_s - self.ttft_s) / (self.completion_tokens - 1)

    def chunk_times_s(self) -> list[float]:
        """Arrival time of each output chunk, seconds since the phase began."""
        if self.ttft_s is None:
            return []
        times = [self.start_s + self.ttft_s]
        for gap in self.itl_s:
            times.append(times[-1] + gap)
        return times

    def to_dict(self) -> dict[str, Any]:
        """The record for a detailed report (without the generated text), plus its TPOT."""
        data = asdict(self)
        del data["output_text"]
        data["tpot_s"] = self.tpot_s
        return data
