"""Request and response bodies of the OpenAI-compatible HTTP API.

Request models forbid unknown fields and validate strictly (``"1"`` is not a number, ``true`` is
not an integer), so a client never gets an answer to a question it did not ask. OpenAI
parameters this server does not implement are declared here only so that a non-neutral value is
refused by name (``unsupported_parameter``); sending their neutral value (``logprobs: false``,
``n: 1``, ``tools: []`` ...) or ``null`` is allowed, because it asks for nothing we ignore.
Fields that cannot change the output (``user``, ``metadata``, ``priority`` ...) are accepted.
docs/api.md ("Request extensions") gives the decision for each field vLLM-targeted clients send.

Validation errors are raised as ``PydanticCustomError`` whose *type* is the OpenAI error ``code``
(``router.errors`` turns them into ``{"error": {...}}`` bodies with that code).
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from contract.identity import adapter_name_fault

# Neutral values of the parameters we accept but do not implement: any other non-null value is
# refused by name. ``None`` (JSON null) always means "not given".
_CHAT_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "functions": ([],),
    "function_call": ("none",),
    "audio": (),
    "modalities": (["text"],),
    "prediction": (),
    "web_search_options": (),
    "reasoning_effort": (),
    "verbosity": (),
    # vLLM's chat extensions.
    "add_special_tokens": (False,),
    "chat_template": (),
    "documents": ([],),
    "best_of": (1,),
}

_COMPLETION_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "best_of": (1,),
    "suffix": ("",),
    "add_special_tokens": (True,),
}

# Both endpoints: OpenAI's ``response_format`` and vLLM's extensions that would change the
# output if ignored.
# The output constraints (``response_format``, ``structured_outputs``, ``guided_json`` ...) are
# served: ``router.api.structured``.
_GENERATION_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "guided_decoding_backend": ("auto", "guidance", "llguidance"),
    "guided_whitespace_pattern": (),
    "structural_tag": (),
    "logits_processors": (),
    "use_beam_search": (False,),
    "mm_processor_kwargs": ({},),
    "kv_transfer_params": (),
    "vllm_xargs": (),
}

# Why a refused parameter is refused, where its name does not say it.
_WHY_UNSUPPORTED: dict[str, str] = {
    "functions": "the deprecated functions API is not served; use tools",
    "function_call": "the deprecated functions API is not served; use tool_choice",
    "chat_template": "only the model's own chat template is used",
    "documents": "documents are not passed to the chat template",
    "add_special_tokens": "special tokens are added as the endpoint's default only",
}
_WHY_UNSUPPORTED["guided_decoding_backend"] = "constraints run on llguidance only"
_WHY_UNSUPPORTED["guided_whitespace_pattern"] = "the JSON whitespace pattern is llguidance's"
_WHY_UNSUPPORTED["structural_tag"] = "structural tags are not implemented"

# Message fields a text-only chat cannot honour.
_MESSAGE_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "function_call": (),
    "audio": (),
    "refusal": (),
    "annotations": ([],),
}

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
"""Roles a chat message may have; ``developer`` is rendered as ``system`` (its OpenAI meaning)."""

MAX_REQUEST_ID_CHARS = 256
"""Longest ``request_id`` a client may set (it is echoed in the answer's ``id``)."""


_TOKEN_ID_KEY = re.compile(r"\s*-?[0-9]{1,18}\s*")
"""A ``logit_bias`` key: a decimal token id (ASCII digits only: ``int()`` also takes "²" as a
digit, and no string past 4300 digits)."""

UNPAIRED_SURROGATE = re.compile("[\ud800-\udfff]")
"""A UTF-16 surrogate in a decoded JSON string: JSON's paired escapes decode to one character,
so any surrogate left is unpaired, and no UTF-8 text can carry it."""


def _quoted(text: str, limit: int = 40) -> str:
    """``text`` as a JSON string literal for an error message: escaped, so an unpaired UTF-16
    surrogate (valid in JSON, not encodable as UTF-8) cannot break the answer, and cut to
    ``limit`` characters."""
    return json.dumps(text[:limit]) + ("..." if len(text) > limit else "")


def refuse_unless_neutral(value: Any, name: str, neutral: tuple[Any, ...],
                          why: str | None = None) -> Any:
    """Returns ``value`` if it asks for nothing (null, or one of ``neutral``); otherwise
    raises ``unsupported_parameter``, saying ``why`` (by default, as this module records)."""
    if value is None or value in neutral:
        return value
    why = why or _WHY_UNSUPPORTED.get(name)
    message = "{name} is not supported by this server" + (f" ({why})" if why else "")
    if neutral:
        message += "; the only value accepted is " + " or ".join(
            json.dumps(v) for v in neutral)
    raise PydanticCustomError("unsupported_parameter", message, {"name": name})


class _StrictModel(BaseModel):
    """Base of request bodies: unknown fields are errors and types are not coerced."""

    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_StrictModel):
    """``stream_options`` of a streaming request.

    ``include_usage`` (OpenAI) adds a last event carrying only ``usage``.
    ``continuous_usage_stats`` (vLLM's extension, sent by GuideLLM) also puts the cumulative
    ``usage`` on every event. As in vLLM, where ``include_usage`` defaults to true once
    ``stream_options`` is given, ``continuous_usage_stats`` alone turns both on, and an explicit
    ``include_usage: false`` turns both off.
    """

    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None

    def final_usage(self) -> bool:
        """Whether the stream ends with a usage-only event."""
        if self.include_usage is None:
            return bool(self.continuous_usage_stats)
        return self.include_usage

    def usage_on_every_event(self) -> bool:
        """Whether every event carries the usage so far."""
        return bool(self.continuous_usage_stats) and self.final_usage()


TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
"""A function name OpenAI accepts: letters, digits, underscores and dashes, at most 64."""


class FunctionDefinition(_StrictModel):
    """``tools[].function``: a function the model may call, its arguments a JSON Schema
    object (``parameters``; absent means no arguments). ``strict`` is accepted: calls the
    server constrains (``tool_choice`` ``required`` or named) always follow the schema."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _object_schema(cls, parameters: dict[str, Any] | None) -> dict[str, Any] | None:
        if parameters is not None and parameters.get("type", "object") != "object":
            raise PydanticCustomError(
                "invalid_value", "parameters must be a JSON Schema of an object (type "
                "'object'): a function's arguments are named")
        return parameters

    @field_validator("name")
    @classmethod
    def _valid_name(cls, name: str) -> str:
        if not TOOL_NAME.fullmatch(name):
            raise PydanticCustomError(
                "invalid_value", "a function name must be 1 to 64 letters, digits, '_' or "
                "'-', got {name}", {"name": _quoted(name)})
        return name


class ToolDefinition(_StrictModel):
    """One entry of ``tools``: ``{"type": "function", "function": {...}}``."""

    type: Literal["function"]
    function: FunctionDefinition


class FunctionCallText(_StrictModel):
    """``function`` of a tool call in a request's assistant message; ``arguments`` is the
    JSON text of an object, as the API returned it. ``parsed_arguments`` is accepted and
    ignored: the SDK's ``parse()`` adds it, and clients send its message back as it is."""

    name: str
    arguments: str
    parsed_arguments: Any = None

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, arguments: str) -> str:
        try:
            parsed = json.loads(arguments)
        except (ValueError, RecursionError) as exc:  # RecursionError: nested too deep
            raise PydanticCustomError(
                "invalid_value", "arguments must be the JSON text of an object ({error})",
                {"error": str(exc) or type(exc).__name__}) from None
        if not isinstance(parsed, dict):
            raise PydanticCustomError("invalid_value",
                                      "arguments must be the JSON text of an object")
        return arguments


class MessageToolCall(_StrictModel):
    """One of ``tool_calls`` in an assistant message of the conversation. ``index`` is
    accepted and ignored: calls accumulated from a stream keep their delta's index."""

    id: str = Field(min_length=1)
    type: Literal["function"]
    function: FunctionCallText
    index: int | None = None


class NamedFunction(_StrictModel):
    """``tool_choice.function``: the function the model must call."""

    name: str


class NamedToolChoice(_StrictModel):
    """``tool_choice: {"type": "function", "function": {"name": ...}}``."""

    type: Literal["function"]
    function: NamedFunction


class ChatMessage(_StrictModel):
    """One chat message; ``content`` is normalised to plain text by validation.

    Content may be a string or a list of ``{"type": "text", "text": ...}`` parts, which are
    joined with newlines (the model's chat template takes a string). Other part types (images,
    audio, files) are refused: this server serves text-only models.

    Tool turns: an ``assistant`` message may carry ``tool_calls`` (its ``content`` then may be
    null), and a ``tool`` message answers one of them by ``tool_call_id``. How they reach the
    model is :mod:`router.api.tool_messages`'s business.
    """

    role: str
    # Validated even when absent, so a missing content is an error rather than None.
    content: Any = Field(default=None, validate_default=True)
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None
    parsed: Any = None  # the SDK's parse() result, sent back with the message; ignored
    function_call: Any = None
    audio: Any = None
    refusal: Any = None
    annotations: Any = None

    @field_validator("role")
    @classmethod
    def _known_role(cls, role: str) -> str:
        if role == "function":
            raise PydanticCustomError(
                "unsupported_value", "messages with role 'function' (the deprecated functions "
                "API) are not supported; use role 'tool'")
        if role not in CHAT_ROLES:
            raise PydanticCustomError(
                "invalid_value", "role must be one of {roles}, got {role}",
                {"roles": ", ".join(CHAT_ROLES), "role": _quoted(role)},
            )
        return role

    @field_validator("content", mode="before")
    @classmethod
    def _text_content(cls, content: Any, info: ValidationInfo) -> str | None:
        if content is None:
            if info.data.get("role") == "assistant":  # may carry tool_calls instead: below
                return None
            raise PydanticCustomError("missing_required_parameter", "content is required")
        if isinstance(content, str):
            return content
        if isinstance(content, list):
            return "\n".join(_text_of_part(part, index) for index, part in enumerate(content))
        raise PydanticCustomError(
            "invalid_type", "content must be a string or a list of text parts"
        )

    @field_validator(*_MESSAGE_UNSUPPORTED)
    @classmethod
    def _unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        return refuse_unless_neutral(value, info.field_name, _MESSAGE_UNSUPPORTED[info.field_name])

    @model_validator(mode="after")
    def _tool_fields_fit_the_role(self) -> ChatMessage:
        if self.tool_calls and self.role != "assistant":
            raise PydanticCustomError("invalid_value",
                                      "only assistant messages may carry tool_calls")
        if (self.tool_call_id is None) != (self.role != "tool"):
            raise PydanticCustomError(
                "invalid_value", "a tool message needs tool_call_id, and only a tool message "
                "may have one")
        if self.content is None and not self.tool_calls:
            raise PydanticCustomError("missing_required_parameter",
                                      "an assistant message needs content or tool_calls")
        return self

    def template_dict(self) -> dict[str, str]:
        """A message without tool fields as the chat template expects it; ``name`` is passed
        on for templates that render it (many, SmolLM2's included, ignore it)."""
        role = "system" if self.role == "developer" else self.role
        message = {"role": role, "content": self.content or ""}
        if self.name is not None:
            message["name"] = self.name
        return message


def _text_of_part(part: Any, index: int) -> str:
    """The text of one content part; anything but a text part is refused."""
    if not isinstance(part, dict) or not isinstance(part.get("type"), str):
        raise PydanticCustomError(
            "invalid_type", "content[{index}] must be an object with a 'type'", {"index": index}
        )
    if part["type"] != "text":
        raise PydanticCustomError(
            "unsupported_content_type",
            "content[{index}] has type {type}; only 'text' parts are supported",
            {"index": index, "type": _quoted(part["type"])},
        )
    if set(part) != {"type", "text"} or not isinstance(part["text"], str):
        raise PydanticCustomError(
            "invalid_value", "content[{index}] must be {{\"type\": \"text\", \"text\": <string>}}",
            {"index": index},
        )
    return part["text"]


class _GenerationBody(_StrictModel):
    """Fields shared by chat and text completions.

    ``top_k``, ``min_p``, ``min_tokens``, ``repetition_penalty``, ``stop_token_ids``,
    ``ignore_eos``, ``include_stop_str_in_output``, ``cache_salt``, ``truncate_prompt_tokens``
    (keep the prompt's last k tokens; -1: as many as the context leaves beside the output,
    :func:`router.api.prompts.kept_prompt_tokens`), ``request_id`` (the answer's ``id`` becomes
    ``<prefix>-<request_id>``), ``prompt_logprobs`` (each prompt token's logprob, its rank
    and this many alternatives; never streamed), ``return_token_ids`` (the prompt's and the
    output's token ids in the answer), ``return_tokens_as_token_ids`` (logprobs name each
    token ``token_id:<id>``), ``allowed_token_ids`` (the only tokens the output may hold),
    ``bad_words`` (words it may not hold) and ``skip_special_tokens`` (``false``: the special
    tokens generated are in the text) are vLLM's extensions, spelled and meant as vLLM
    does. Ranges are checked by :meth:`contract.request.SamplingParams.validate`;
    ``logit_bias`` keys (token ids as strings, OpenAI's form) are parsed here and
    range-checked against the vocabulary by the app.

    Accepted and ignored, because they never change the output: ``user`` and
    ``safety_identifier`` (end-user identifiers for abuse monitoring), ``metadata`` and
    ``store`` (nothing is stored), ``service_tier`` and ``priority`` (one tier, first come
    first served), ``spaces_between_special_tokens`` (the text is the tokenizer's stream
    decoding, as with vLLM's default ``true``).
    """

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    min_tokens: int | None = None
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**64)
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: int | None = None
    cache_salt: str | None = Field(default=None, min_length=1)
    user: str | None = None
    safety_identifier: str | None = None
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    request_id: str | None = Field(default=None, min_length=1, max_length=MAX_REQUEST_ID_CHARS)
    priority: int | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    spaces_between_special_tokens: bool | None = None
    response_format: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_decoding_backend: Any = None
    guided_whitespace_pattern: Any = None
    structural_tag: Any = None
    structured_outputs: Any = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    prompt_logprobs: int | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    logits_processors: Any = None
    return_tokens_as_token_ids: bool | None = None
    return_token_ids: bool | None = None
    use_beam_search: Any = None
    mm_processor_kwargs: Any = None
    kv_transfer_params: Any = None
    vllm_xargs: Any = None

    @field_validator(*_GENERATION_UNSUPPORTED)
    @classmethod
    def _unsupported_extension(cls, value: Any, info: ValidationInfo) -> Any:
        neutral = _GENERATION_UNSUPPORTED[info.field_name]
        return refuse_unless_neutral(value, info.field_name, neutral)

    @field_validator("prompt_logprobs")
    @classmethod
    def _not_streamed(cls, count: int | None, info: ValidationInfo) -> int | None:
        # As vLLM: they would all come before the first token, in no event's shape.
        if count is not None and info.data.get("stream"):
            raise PydanticCustomError("invalid_value",
                                      "prompt_logprobs cannot be streamed; send stream: false")
        return count

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _keeps_some_tokens(cls, keep: int | None) -> int | None:
        if keep == 0:  # vLLM's range has it, but a prompt of no tokens is refused anyway
            raise PydanticCustomError(
                "invalid_value", "truncate_prompt_tokens keeps the prompt's last k tokens: "
                "k >= 1, or -1 for as many as the context leaves beside the output")
        return keep

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, stop: Any) -> Any:
        return [stop] if isinstance(stop, str) else stop

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for key in bias or {}:
            if not _TOKEN_ID_KEY.fullmatch(key):
                raise PydanticCustomError(
                    "invalid_value", "logit_bias keys must be token ids, got {key}",
                    {"key": _quoted(key)})
        return bias

    @field_validator("model", "stop", "request_id", "cache_salt", mode="before")
    @classmethod
    def _encodable(cls, value: Any, info: ValidationInfo) -> Any:
        # Texts that are echoed (the model by a 404, the request_id in the answer's id), hashed
        # as UTF-8 (the cache_salt) or matched against decoded output (a stop string, which
        # could never match one): none can hold what UTF-8 cannot carry.
        texts = value if isinstance(value, list) else [value]
        if any(isinstance(text, str) and UNPAIRED_SURROGATE.search(text) for text in texts):
            raise PydanticCustomError(
                "invalid_value", "{name} must be text without unpaired UTF-16 surrogates",
                {"name": info.field_name})
        return value

    def logit_bias_ids(self) -> dict[int, float]:
        """``logit_bias`` with integer token ids."""
        return {int(key): value for key, value in (self.logit_bias or {}).items()}

    def prompt_logprobs_count(self) -> int | None:
        """Alternatives per prompt token the worker is asked for; None when prompt logprobs
        are off."""
        return self.prompt_logprobs


class ChatCompletionRequest(_GenerationBody):
    """Body of ``POST /v1/chat/completions``.

    ``echo`` (vLLM's): each choice's content begins with the last message's, when that
    message is the assistant's (a turn the answer continues, ``continue_final_message``).
    """

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    prompt_cache_key: str | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    web_search_options: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    echo: bool | None = None
    add_special_tokens: Any = None
    chat_template: Any = None
    documents: Any = None
    best_of: Any = None

    @field_validator("messages")
    @classmethod
    def _not_empty(cls, messages: list[ChatMessage]) -> list[ChatMessage]:
        if not messages:
            raise PydanticCustomError("invalid_value", "messages must not be empty")
        return messages

    @field_validator(*_CHAT_UNSUPPORTED)
    @classmethod
    def _unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        return refuse_unless_neutral(value, info.field_name, _CHAT_UNSUPPORTED[info.field_name])

    @field_validator("tool_choice")
    @classmethod
    def _known_tool_choice(cls, choice: Any) -> str | NamedToolChoice | None:
        if choice is None or choice in ("none", "auto", "required"):
            return choice
        try:
            return NamedToolChoice.model_validate(choice)
        except ValidationError:
            raise PydanticCustomError(
                "invalid_value", "tool_choice must be 'none', 'auto', 'required' or "
                '{"type": "function", "function": {"name": <string>}}') from None

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, top: int | None, info: ValidationInfo) -> int | None:
        if top and not info.data.get("logprobs"):
            raise PydanticCustomError("invalid_value",
                                      "top_logprobs needs logprobs to be true")
        return top

    def logprobs_count(self) -> int | None:
        """Alternatives per token the worker is asked for; None when logprobs are off."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def template_options(self) -> dict[str, Any]:
        """Keyword arguments of ``apply_chat_template`` besides the messages: vLLM's
        ``add_generation_prompt`` (default true), ``continue_final_message`` (default false)
        and the template variables of ``chat_template_kwargs``."""
        return {**(self.chat_template_kwargs or {}),
                "add_generation_prompt": self.add_generation_prompt is not False,
                "continue_final_message": bool(self.continue_final_message)}


class CompletionRequest(_GenerationBody):
    """Body of ``POST /v1/completions``.

    ``prompt`` is one string, one list of token ids, or a batch of up to
    :data:`MAX_BATCH_PROMPTS` of either kind (a list of strings, or of token-id lists): each
    prompt of a batch is served as a request of its own (:meth:`batch`).
    """

    prompt: Any
    logprobs: int | None = None
    echo: bool | None = None
    best_of: Any = None
    suffix: Any = None
    add_special_tokens: Any = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, prompt: Any) -> str | list[int] | list[str] | list[list[int]]:
        if prompt is None:
            raise PydanticCustomError("missing_required_parameter", "prompt is required")
        if not _is_batch(prompt):
            return _one_prompt(prompt)
        if len(prompt) > MAX_BATCH_PROMPTS:
            raise PydanticCustomError(
                "invalid_value", f"a batch prompt holds at most {MAX_BATCH_PROMPTS} prompts")
        if len({type(item) for item in prompt}) > 1:
            raise PydanticCustomError("invalid_type", _MIXED_BATCH)
        return [_one_prompt(item) for item in prompt]

    def batch(self) -> list[CompletionRequest] | None:
        """One request per prompt of a batch prompt, in order; None for a single prompt."""
        if not _is_batch(self.prompt):
            return None
        return [self.model_copy(update={"prompt": prompt}) for prompt in self.prompt]

    @field_validator(*_COMPLETION_UNSUPPORTED)
    @classmethod
    def _unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        neutral = _COMPLETION_UNSUPPORTED[info.field_name]
        return refuse_unless_neutral(value, info.field_name, neutral)

    def logprobs_count(self) -> int | None:
        """Alternatives per token the worker is asked for; None when logprobs are off."""
        return self.logprobs

    def prompt_logprobs_count(self) -> int | None:
        """Alternatives per prompt token the worker is asked for: ``prompt_logprobs``, raised
        to ``logprobs`` when the prompt is echoed with logprobs (its tokens then lead each
        choice's ``logprobs``, as vLLM gives them); at least 0 for an echo of ``max_tokens:
        0``, which scores the prompt and generates nothing; None when none asks."""
        if not self.echo:
            return self.prompt_logprobs
        asked = [n for n in (self.logprobs, self.prompt_logprobs) if n is not None]
        if self.max_tokens == 0:
            asked.append(0)
        return max(asked, default=None)


MAX_BATCH_PROMPTS = 128
"""Prompts one completion request may batch (each with its ``n`` choices)."""
_MIXED_BATCH = "a batch prompt is a list of strings or a list of token-id lists"


def _is_batch(prompt: Any) -> bool:
    """Whether ``prompt`` is a batch: a list whose first item is a prompt of its own."""
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], (str, list))


def _one_prompt(prompt: Any) -> str | list[int]:
    """Checks one prompt: a non-empty string or token-id list."""
    if isinstance(prompt, str):
        if not prompt:
            raise PydanticCustomError("invalid_value", "prompt must not be empty")
        return prompt
    if not isinstance(prompt, list):
        raise PydanticCustomError("invalid_type", "prompt must be a string or a list of token ids")
    return _token_id_prompt(prompt)


def _token_id_prompt(prompt: list[Any]) -> list[int]:
    """Checks a list prompt is one sequence of token ids (range is checked by the app)."""
    if not prompt:
        raise PydanticCustomError("invalid_value", "prompt must not be empty")
    if any(isinstance(item, (str, list)) for item in prompt):
        raise PydanticCustomError("invalid_type", _MIXED_BATCH)
    # bool is an int subclass, but true/false are not token ids.
    if not all(isinstance(item, int) and not isinstance(item, bool) for item in prompt):
        raise PydanticCustomError("invalid_type", "a list prompt must hold integer token ids")
    return prompt


# ---------------------------------------------------------------------------------------------
# Responses. Built by the app and serialised with ``model_dump``; nullable OpenAI fields
# (``finish_reason``, ``logprobs``) stay in the output as ``null``, as clients expect.


def _omitted_when_null(default: Any = None) -> Any:
    """A field left out of the JSON while it is null: an extension OpenAI's shape lacks, or a
    field OpenAI leaves out when empty. Applied by pydantic's core serializer, where a model's
    own wrap serializer would run Python on every streamed event."""
    return Field(default=default, exclude_if=_is_null)


def _is_null(value: Any) -> bool:
    return value is None


class PromptTokensDetails(BaseModel):
    """``usage.prompt_tokens_details``. ``cached_tokens_by_source`` (an extension) breaks
    ``cached_tokens`` down by where the KV came from: ``local_cache_hit`` (the worker's KV
    cache), ``second_tier`` (its second tier, after an eviction) and ``external_kv_transfer``
    (fetched from another worker); present only when some came from the last two."""

    cached_tokens: int = 0
    cached_tokens_by_source: dict[str, int] | None = _omitted_when_null()


class Usage(BaseModel):
    """Token counts of one request; ``cached_tokens`` is the prefix-cache hit."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class TopLogprob(BaseModel):
    """One alternative of ``choices[].logprobs.content[].top_logprobs`` (chat)."""

    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(TopLogprob):
    """One output token of ``choices[].logprobs.content`` (chat)."""

    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    """``choices[].logprobs`` of a chat completion (or of one of its chunks)."""

    content: list[ChatTokenLogprob]


class CompletionLogprobs(BaseModel):
    """``choices[].logprobs`` of a text completion: parallel lists, one entry per token;
    ``text_offset`` is each token's offset in the choice's text. With ``echo`` the prompt's
    tokens come first; the very first has null ``token_logprobs`` and ``top_logprobs``
    (nothing precedes it to predict it)."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """One token at one prompt position in vLLM's ``prompt_logprobs``: its log-probability
    (natural log), its rank (1: the most likely) and its text, as logprobs render a token."""

    logprob: float
    rank: int | None
    decoded_token: str


PromptLogprobs = list[dict[str, PromptLogprob] | None]
"""vLLM's ``prompt_logprobs``: one entry per prompt token, null for the first; each other maps
token ids (as strings) to :class:`PromptLogprob`, the prompt token first, then the most likely
alternatives."""


class FunctionCall(BaseModel):
    """``function`` of a tool call the model made: its name and its arguments as JSON text."""

    name: str
    arguments: str


class ToolCall(BaseModel):
    """One of ``choices[].message.tool_calls``."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    """``choices[0].message`` of a chat completion. ``content`` is null when the answer is
    only tool calls; ``tool_calls`` is left out when there are none (as OpenAI does)."""

    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = _omitted_when_null()


FinishReason = Literal["stop", "length", "tool_calls"]
"""Why a choice ended: a stop (EOS, stop string, the constraint complete), ``max_tokens``, or
a stop after which the answer held tool calls."""


class ChatChoice(BaseModel):
    """One choice of a chat completion; ``token_ids`` (vLLM's, its output's ids) is left out
    unless the request asked for them (``return_token_ids``)."""

    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason
    stop_reason: int | str | None = None
    """vLLM's extension: the stop string or stop token id that ended the choice; null for the
    model's end-of-sequence token, ``max_tokens`` and every other end."""
    token_ids: list[int] | None = _omitted_when_null()


class ChatCompletionResponse(BaseModel):
    """Body of a non-streaming chat completion. ``prompt_logprobs`` and ``prompt_token_ids``
    (vLLM's, of the conversation's prompt) are left out unless the request asked for them."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = _omitted_when_null()
    prompt_token_ids: list[int] | None = _omitted_when_null()


class DeltaToolCall(ToolCall):
    """One entry of ``delta.tool_calls``: a whole call in one delta; ``index`` orders the
    calls of a choice."""

    index: int


class ChatDelta(BaseModel):
    """``choices[0].delta`` of a chat chunk; unset fields are left out of the JSON (OpenAI
    deltas carry only what changed: the last one is ``{}``)."""

    role: Literal["assistant"] | None = _omitted_when_null()
    content: str | None = _omitted_when_null()
    tool_calls: list[DeltaToolCall] | None = _omitted_when_null()


class ChatChunkChoice(BaseModel):
    """One choice of a chat completion chunk; ``token_ids`` (vLLM's: the ids of the tokens
    this event carries) is left out unless the request asked for them."""

    index: int = 0
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    """vLLM's extension: the stop string or stop token id that ended the choice; null for the
    model's end-of-sequence token, ``max_tokens`` and every other end."""
    token_ids: list[int] | None = _omitted_when_null()


class ChatCompletionChunk(BaseModel):
    """One SSE event of a streaming chat completion; ``prompt_token_ids`` (vLLM's) is on the
    first event only, and only when the request asked for token ids."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = _omitted_when_null()


class CompletionChoice(BaseModel):
    """One choice of a text completion (or of one of its chunks). vLLM's ``prompt_logprobs``
    and ``prompt_token_ids`` (of the choice's prompt; streamed: on the choice's first event)
    and ``token_ids`` (its output's, or the event's) are left out unless the request asked
    for them."""

    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None
    stop_reason: int | str | None = None
    """vLLM's extension: the stop string or stop token id that ended the choice; null for the
    model's end-of-sequence token, ``max_tokens`` and every other end."""
    prompt_logprobs: PromptLogprobs | None = _omitted_when_null()
    prompt_token_ids: list[int] | None = _omitted_when_null()
    token_ids: list[int] | None = _omitted_when_null()


class CompletionResponse(BaseModel):
    """Body of a text completion, and of each of its SSE events when streaming."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    """One entry of ``GET /v1/models``: the base model, or a LoRA adapter on it (``parent``
    names the base model, as vLLM lists adapters)."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "nalar-serve"
    parent: str | None = None
    max_model_len: int


class ModelList(BaseModel):
    """Body of ``GET /v1/models``."""

    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(_StrictModel):
    """Body of ``POST /tokenize`` (vLLM's): exactly one of ``prompt`` (tokenized as
    ``/v1/completions`` tokenizes it) and ``messages`` (rendered and tokenized as
    ``/v1/chat/completions`` does, with ``tools`` and the chat template's options, which only
    go with ``messages``); ``return_token_strs`` adds each token's string."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[ToolDefinition] | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool | None = None
    return_token_strs: bool | None = None

    def chat_request(self) -> ChatCompletionRequest:
        """The chat request whose prompt ``messages`` are, validated as one.

        Raises:
            pydantic.ValidationError: what ``/v1/chat/completions`` would refuse them for.
        """
        return ChatCompletionRequest.model_validate(self._sent(
            "model", "messages", "tools", "add_generation_prompt", "continue_final_message",
            "chat_template_kwargs", "add_special_tokens"))

    def completion_request(self) -> CompletionRequest:
        """The completion request whose prompt ``prompt`` is, validated as one.

        Raises:
            pydantic.ValidationError: what ``/v1/completions`` would refuse it for.
        """
        return CompletionRequest.model_validate(self._sent("model", "prompt",
                                                           "add_special_tokens"))

    def _sent(self, *names: str) -> dict[str, Any]:
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}


class TokenizeResponse(BaseModel):
    """``POST /tokenize``'s answer: the prompt's token ids, their count and the context
    length they must fit in (prompt and output together)."""

    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_StrictModel):
    """Body of ``POST /detokenize`` (vLLM's): token ids to turn back into text."""

    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    """``POST /detokenize``'s answer: the tokens' text, special tokens included."""

    prompt: str


class LoadLoRAAdapterRequest(_StrictModel):
    """Body of ``POST /v1/load_lora_adapter`` (vLLM's): serve the PEFT adapter directory
    ``lora_path`` (under a ``--lora-dir``) as the model ``lora_name``."""

    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)

    @field_validator("lora_name")
    @classmethod
    def _nameable(cls, value: str) -> str:
        fault = adapter_name_fault(value)
        if fault is not None:
            raise PydanticCustomError("invalid_value", fault)
        return value


class UnloadLoRAAdapterRequest(_StrictModel):
    """Body of ``POST /v1/unload_lora_adapter`` (vLLM's; ``lora_int_id`` is accepted and
    ignored: adapters are named, not numbered, here)."""

    lora_name: str = Field(min_length=1, max_length=256)
    lora_int_id: int | None = None
