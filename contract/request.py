"""What a worker is asked to generate and what it streams back.

These cross process boundaries (ingress → router → worker replica) as plain pickled dataclasses.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

from contract.identity import AdapterRef, CacheNamespace, PromptDigests
from contract.kv_transfer import KVSource

FinishReason = Literal["stop", "length", "abort"]

GREEDY_TEMPERATURE = 1e-5
"""Below this temperature sampling is argmax (vLLM draws the same line)."""

MAX_TOP_LOGPROBS = 20
"""Most alternatives ``logprobs``/``top_logprobs`` may ask for (OpenAI's limit)."""

MAX_CHOICES = 128
"""Most choices (``n``) one request may ask for (OpenAI's limit)."""

MAX_REPETITION_PENALTY = 10.0
"""Largest accepted ``repetition_penalty``; beyond it every seen token is all but banned."""


class InvalidRequestError(ValueError):
    """A request the engine cannot serve as asked; ``param`` names the offending field."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_value"):
        super().__init__(message)
        self.param = param
        self.code = code


StructuredKind = Literal["json", "regex", "choice", "grammar"]


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on the output: what OpenAI's ``response_format`` and vLLM's
    ``structured_outputs`` (and the older ``guided_*`` fields) ask for.

    Attributes:
        kind: ``json`` (``spec``: a JSON Schema, as JSON text; ``{"type": "object"}`` for
            ``json_object``), ``regex``, ``choice`` (``spec``: a JSON list of strings) or
            ``grammar`` (``spec``: a Lark grammar, llguidance's format).
        spec: the constraint's text.
        param: the request field it came from (``response_format``, ``tools`` ...), which
            an error about it names; empty for the kind's usual field.
    """

    kind: StructuredKind
    spec: str
    param: str = ""


@dataclass
class SamplingParams:
    """How to pick each next token (the semantics of vLLM's ``SamplingParams``).

    Logits are processed in vLLM v1's order: ``min_tokens`` masking and ``logit_bias``, then
    the repetition/presence/frequency penalties, then (sampled rows only) temperature,
    ``min_p``, ``top_k``, ``top_p``. Greedy rows take the argmax after the penalties.

    Attributes:
        temperature: 0 means greedy (argmax); otherwise logits are divided by it.
        top_p: nucleus sampling mass in (0, 1]; 1 disables it.
        top_k: keep the k most likely tokens; 0 or -1 disables it.
        min_p: drop tokens whose probability is below ``min_p`` times the most likely one's
            (Nguyen et al. 2024, "min-p sampling"); 0 disables it.
        repetition_penalty: CTRL's penalty (Keskar et al. 2019) as in transformers and vLLM:
            the logit of every token present in the prompt or the output is divided by it when
            positive and multiplied by it when negative; 1 disables it.
        presence_penalty: OpenAI's: subtracted once from the logit of every token already in
            the output, in [-2, 2].
        frequency_penalty: OpenAI's: subtracted from a token's logit once per occurrence in
            the output, in [-2, 2].
        logit_bias: token id -> value in [-100, 100] added to that token's logit.
        seed: seeds a per-request generator, so the output does not depend on batch neighbours.
            With ``n > 1``, choice ``i`` uses ``seed + i``.
        n: independent choices generated from the one prompt (they share its KV blocks).
        max_tokens: most tokens to generate; 0 computes the prompt only (for its
            ``prompt_logprobs``: a completion's ``echo`` with ``max_tokens: 0``, as vLLM serves
            it) and ends with ``length``.
        min_tokens: EOS and ``stop_token_ids`` are masked out until this many tokens are
            generated (vLLM semantics; stop strings still apply).
        stop: strings that end generation; the matched string is not returned unless
            ``include_stop_str_in_output``.
        include_stop_str_in_output: end the text with the matched stop string (vLLM's
            extension); the text is then streamed without holding back what could start one.
        skip_special_tokens: leave the tokenizer's special tokens out of the text (vLLM's
            default); False writes them into it as their text (``<|im_start|>``). A stop
            token (EOS among them) never enters the text either way.
        stop_token_ids: token ids that end generation (the model's EOS is added unless
            ``ignore_eos``); the stop token is not returned as text.
        ignore_eos: keep generating past the model's end-of-sequence token.
        logprobs: None for no log-probabilities; otherwise the sampled token's log-probability
            is returned along with this many most likely alternatives (0..20). They are of the
            raw model distribution, before penalties, bias, temperature and filtering (vLLM's
            default, ``raw_logprobs``).
        structured: a constraint the output must follow (:class:`StructuredOutput`): tokens
            it forbids are masked out before everything else; None for free text.
        allowed_token_ids: the only tokens the output may hold (vLLM's ``allowed_token_ids``:
            every other token's logit is -inf before the other processors); None for all.
        bad_words_token_ids: token sequences the output may not contain (vLLM's
            ``bad_words``, tokenized): a sequence's last token is banned wherever the output
            so far ends with the rest of it (at once for a one-token sequence).
        prompt_logprobs: None for none; otherwise every prompt token after the first gets
            its log-probability given the tokens before it, its rank, and this many most
            likely alternatives (0..20), of the raw model distribution (vLLM's
            ``prompt_logprobs``). Such a request computes its whole prompt: a cached prefix
            has no logits to give.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None
    n: int = 1
    max_tokens: int = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    structured: StructuredOutput | None = None
    allowed_token_ids: list[int] | None = None
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    prompt_logprobs: int | None = None

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
        if self.max_tokens < 0 or (self.max_tokens == 0 and self.prompt_logprobs is None):
            raise InvalidRequestError("max_tokens must be at least 1", "max_tokens")
        if any(not s for s in self.stop):
            raise InvalidRequestError("stop strings must not be empty", "stop")
        self._validate_extras()

    def _validate_extras(self) -> None:
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError("min_p must be in [0, 1]", "min_p")
        if not 0.0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise InvalidRequestError(
                f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY}]",
                "repetition_penalty")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise InvalidRequestError(f"{name} must be in [-2, 2]", name)
        if any(not -100.0 <= bias <= 100.0 for bias in self.logit_bias.values()):
            raise InvalidRequestError("logit_bias values must be in [-100, 100]", "logit_bias")
        if not 1 <= self.n <= MAX_CHOICES:
            raise InvalidRequestError(f"n must be in [1, {MAX_CHOICES}]", "n")
        self.check_min_tokens()
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise InvalidRequestError("allowed_token_ids must not be empty", "allowed_token_ids")
        if not all(self.bad_words_token_ids):
            raise InvalidRequestError("bad_words must not hold an empty word", "bad_words")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_TOP_LOGPROBS:
                raise InvalidRequestError(f"{name} must be in [0, {MAX_TOP_LOGPROBS}]", name)
        self.check_bans_beside_a_grammar()

    def check_bans_beside_a_grammar(self) -> None:
        """Raises :class:`InvalidRequestError` for ``allowed_token_ids`` or ``bad_words`` beside
        a constraint's grammar: together they could leave no token to draw, which the grammar
        would then reject mid-step."""
        if self.structured is None:
            return
        for name, value in (("allowed_token_ids", self.allowed_token_ids),
                            ("bad_words", self.bad_words_token_ids)):
            if value:
                raise InvalidRequestError(
                    f"{name} cannot be combined with a structured-output constraint "
                    f"({self.structured.param or 'response_format'})", name)

    def check_min_tokens(self) -> None:
        """Raises :class:`InvalidRequestError` unless ``0 <= min_tokens <= max_tokens``."""
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequestError("min_tokens must be in [0, max_tokens]", "min_tokens")

    def check_context(self, prompt_tokens: int, max_model_len: int) -> None:
        """Raises :class:`InvalidRequestError` (code ``context_length_exceeded``) unless a
        prompt of ``prompt_tokens`` leaves room for output and ``max_tokens`` more fit within
        ``max_model_len`` tokens: ``param`` is ``prompt`` when the prompt alone leaves no room,
        else ``max_tokens``."""
        if prompt_tokens >= max_model_len:
            raise InvalidRequestError(
                f"This model's maximum context length is {max_model_len} tokens, and the "
                f"prompt has {prompt_tokens} tokens, leaving no room for output", "prompt",
                "context_length_exceeded")
        if prompt_tokens + self.max_tokens > max_model_len:
            raise InvalidRequestError(
                f"This model's maximum context length is {max_model_len} tokens; the prompt "
                f"has {prompt_tokens} tokens and max_tokens asks for {self.max_tokens} more",
                "max_tokens", "context_length_exceeded")

    def for_choice(self, index: int) -> SamplingParams:
        """The parameters of choice ``index`` of an ``n > 1`` request: seed + index (mod
        2**64, the range torch generators take)."""
        if self.seed is None or index == 0:
            return self
        return replace(self, seed=(self.seed + index) % 2**64)


@dataclass
class GenerationRequest:
    """One generation job for a worker.

    Attributes:
        request_id: unique id, used for cancellation and logs.
        token_ids: the prompt, already tokenized (chat template applied) by the ingress.
        sampling: sampling parameters.
        namespace: the cache scope (tenant, salt) this request may share KV within.
        prompt_digests: the prompt's block digests under the deployment's identity and
            ``namespace``, computed once by the ingress: the prefix-aware router looks them up
            in the index, and the worker uses them once :meth:`PromptDigests.verified
            <contract.identity.PromptDigests.verified>` against its own identity (else it
            hashes the prompt itself). None when not computed.
        adapter: the LoRA adapter to run under, by name and content digest (the worker
            refuses the request when the adapter it holds under that name has another
            digest); None for the base model.
        kv_source: set by the router when another worker holds more of the prompt's prefix
            than the chosen one: the chosen worker may fetch those blocks from it instead of
            computing them.
    """

    request_id: str
    token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    namespace: CacheNamespace = field(default_factory=CacheNamespace)
    prompt_digests: PromptDigests | None = None
    adapter: AdapterRef | None = None
    kv_source: KVSource | None = None


@dataclass
class TokenLogprob:
    """Log-probabilities of one output or prompt token, of the raw model distribution
    (natural log).

    Attributes:
        token_id: the token that was generated (or, for a prompt token, that came next).
        logprob: its log-probability.
        top: the most likely tokens as ``(token_id, logprob)``, most likely first (as many as
            the request's ``logprobs`` or ``prompt_logprobs``; may or may not include
            ``token_id``).
        rank: for a prompt token, 1 + how many tokens are more likely than it (1: the most
            likely; tokens of equal logprob share a rank); None for output tokens.
    """

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)
    rank: int | None = None


@dataclass
class SpecUsage:
    """One request's speculative decoding so far (counts in tokens, times in seconds).

    Attributes:
        proposed_tokens: draft tokens sent to verification.
        accepted_tokens: draft tokens committed (a draft token past a stop or the length cap
            is not committed, so it is not counted).
        verification_steps: steps that verified at least one draft token.
        accepted_by_position: ``[k_max]``: how often the draft token at position i was
            committed.
        proposed_by_position: ``[k_max]``: how often a draft token at position i was verified.
        k_decisions: chosen draft length -> steps (0 = did not speculate that step).
        draft_s: time spent proposing for this request (its share of batched calls).
        verify_s: wall time of the verification steps it was in (each such step counts
            whole for every sequence it verified: the latency the request saw).
    """

    proposed_tokens: int = 0
    accepted_tokens: int = 0
    verification_steps: int = 0
    accepted_by_position: list[int] = field(default_factory=list)
    proposed_by_position: list[int] = field(default_factory=list)
    k_decisions: dict[int, int] = field(default_factory=dict)
    draft_s: float = 0.0
    verify_s: float = 0.0

    @property
    def rejected_tokens(self) -> int:
        return self.proposed_tokens - self.accepted_tokens

    @property
    def acceptance_rate(self) -> float:
        """Committed draft tokens / proposed draft tokens (0 when nothing was proposed)."""
        return self.accepted_tokens / self.proposed_tokens if self.proposed_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Committed draft tokens per verification step (0 when none ran)."""
        return (self.accepted_tokens / self.verification_steps
                if self.verification_steps else 0.0)


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
        index: the choice this chunk belongs to (0 .. n-1).
        logprobs: one entry per token of ``token_ids`` when the request asked for logprobs.
        choices_left: choices of the request still running after this chunk; the request's
            stream ends with the chunk that has a finish reason and no choice left.
        spec: this choice's speculative decoding counts, on its last chunk when it speculated.
        tier_tokens: of ``cached_tokens``, those loaded from the worker's second KV tier.
        transfer_tokens: of ``cached_tokens``, those fetched from another worker.
        stop_reason: on the last chunk of a choice that finished with "stop", the stop string
            matched or the requested stop token id; None for the model's end-of-sequence token
            and every other finish (vLLM's ``stop_reason``).
        prompt_logprobs: on a choice's first chunk with output, when the request asked for
            ``prompt_logprobs``: one entry per prompt token, None for the first (nothing
            precedes it).
    """

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    worker_id: str = ""
    index: int = 0
    logprobs: list[TokenLogprob] | None = None
    choices_left: int = 0
    spec: SpecUsage | None = None
    tier_tokens: int = 0
    transfer_tokens: int = 0
    stop_reason: int | str | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None

    def followed_by(self, later: GenerationChunk) -> GenerationChunk:
        """One chunk carrying this chunk's tokens then ``later``'s (same request and choice)."""
        logprobs = None
        if self.logprobs is not None or later.logprobs is not None:
            logprobs = (self.logprobs or []) + (later.logprobs or [])
        return replace(later, token_ids=self.token_ids + later.token_ids,
                       text=self.text + later.text, logprobs=logprobs,
                       prompt_logprobs=self.prompt_logprobs or later.prompt_logprobs)

    @property
    def is_last(self) -> bool:
        """Whether this chunk ends the request's stream (every choice has finished)."""
        return self.finish_reason is not None and self.choices_left == 0
