"""vLLM's ``POST /tokenize`` and ``POST /detokenize``: a prompt's token ids exactly as a
completion or chat request would be given them, and token ids back to text."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import anyio
from pydantic import ValidationError

from router.api.jobs import JobBuilder, Tokenize, resolve_model
from router.api.prompts import checked_ids
from router.errors import from_validation_errors, invalid_request
from router.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)

CHAT_ONLY = ("tools", "add_generation_prompt", "continue_final_message", "chat_template_kwargs")
"""Fields of a ``/tokenize`` body that only go with ``messages``."""

T = TypeVar("T")


async def tokenize(jobs: JobBuilder, body: TokenizeRequest) -> TokenizeResponse:
    """The token ids of ``body``'s prompt or conversation, counted.

    Raises:
        APIError: 404 for another model; 400 naming ``prompt`` (neither or both of
            ``prompt`` and ``messages``, a text longer than the context whatever its
            tokenization, one the tokenizer rejects), a chat-only field sent with ``prompt``,
            or whatever ``/v1/completions`` (for ``prompt``) or ``/v1/chat/completions`` (for
            ``messages``, ``tools`` and the template's options) would refuse them for.
    """
    backend = jobs.backend
    resolve_model(body.model, backend.served_model_name, backend.adapters)
    if (body.prompt is None) == (body.messages is None):
        raise invalid_request("send exactly one of prompt (a text) and messages (a chat)",
                              "prompt")
    if body.messages is not None:
        param, (text, characters) = "messages", _chat_prompt(jobs, body)
    else:
        param, (text, characters) = "prompt", _text_prompt(jobs, body)
    token_ids = await anyio.to_thread.run_sync(jobs.tokenized, text, param, characters)
    strings = None
    if body.return_token_strs:
        strings = await anyio.to_thread.run_sync(
            jobs.tokenized, lambda tokenizer: tokenizer.convert_ids_to_tokens(token_ids), param)
    return TokenizeResponse(count=len(token_ids), max_model_len=backend.max_model_len,
                            tokens=token_ids, token_strs=strings)


async def detokenize(jobs: JobBuilder, body: DetokenizeRequest) -> DetokenizeResponse:
    """The text of ``body.tokens``, special tokens included (the inverse of ``/tokenize``).

    Raises:
        APIError: 404 for another model; 400 naming ``tokens`` for an id outside the
            vocabulary.
    """
    backend = jobs.backend
    resolve_model(body.model, backend.served_model_name, backend.adapters)
    token_ids = checked_ids(body.tokens, jobs.vocab_size, "tokens")
    text = await anyio.to_thread.run_sync(
        jobs.tokenized, lambda tokenizer: tokenizer.decode(token_ids), "tokens")
    return DetokenizeResponse(prompt=text)


def _chat_prompt(jobs: JobBuilder, body: TokenizeRequest) -> tuple[Tokenize[list[int]], int]:
    tokenize, characters, _ = jobs.chat_prompt(_validated(body.chat_request))
    jobs.refuse_too_long(characters, "messages")
    return tokenize, characters


def _text_prompt(jobs: JobBuilder, body: TokenizeRequest) -> tuple[Tokenize[list[int]], int]:
    for field in CHAT_ONLY:
        if getattr(body, field) is not None:
            raise invalid_request(f"{field} goes with messages, not with prompt", field)
    tokenize, characters = jobs.completion_prompt(_validated(body.completion_request))
    jobs.refuse_too_long(characters, "prompt")
    return tokenize, characters


def _validated(request: Callable[[], T]) -> T:
    """``request()``, its validation errors as the completion routes answer them."""
    try:
        return request()
    except ValidationError as exc:
        raise from_validation_errors(exc.errors()) from None
