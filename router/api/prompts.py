"""Prompts to token ids: the chat template, and range checks of client-given token ids."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence
from typing import Any

from jinja2 import TemplateError

from router.errors import invalid_request
from router.protocol import UNPAIRED_SURROGATE


def refuse_unpaired_surrogates(value: Any, param: str, path: str | None = None) -> None:
    """Refuses a request text the tokenizer could not encode, with a message that says why
    (the tokenizer's own says only that its input has the wrong type) and where: case R6.

    Args:
        value: a string, or lists and dicts holding strings (keys included), at any depth.
        param: the request field to name.
        path: where ``value`` lies in the request (default: ``param``), as
            ``messages[1].content`` names it.

    Raises:
        APIError: 400 ``invalid_value`` naming ``param``, whose message names the string's
            place, the surrogate's code and its offset in the string, when a string holds an
            unpaired UTF-16 surrogate.
    """
    path = param if path is None else path
    if isinstance(value, str):
        found = UNPAIRED_SURROGATE.search(value)
        if found:
            raise invalid_request(
                f"{path} holds an unpaired UTF-16 surrogate (\\u{ord(found.group()):04x} at "
                f"character {found.start()}), which no UTF-8 text can carry", param)
    elif isinstance(value, dict):
        for key, item in value.items():
            refuse_unpaired_surrogates(key, param, f"a key of {path}")
            refuse_unpaired_surrogates(item, param, f"{path}.{key}")
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            refuse_unpaired_surrogates(item, param, f"{path}[{i}]")


def rendered_characters(messages: list[dict[str, Any]]) -> int:
    """Characters a chat template renders of ``messages`` at the least: their contents, less
    the whitespace at either end (templates may trim it); not the keys, roles or ids, which a
    template may leave out."""
    return sum(len(message["content"].strip()) for message in messages
               if isinstance(message.get("content"), str))


@functools.lru_cache(maxsize=4)
def longest_token_characters(tokenizer: Any) -> int:
    """The most characters one token's text can hold: its string's length, which for a
    byte-level tokenizer counts bytes, at least as many as the characters they encode.
    Cached per tokenizer: the walk over its vocabulary takes about 25 ms (SmolLM2's)."""
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    return max(len(token) for token in tokens if token)


def refuse_beyond_context(characters: int, longest_token: int, max_model_len: int,
                          param: str) -> None:
    """Refuses, before any tokenizing, a prompt text too long for the context whatever its
    tokenization: more characters than ``max_model_len`` tokens of ``longest_token``
    characters hold. (A 20 MB prompt took 26 s to tokenize, holding every other request's
    tokenizing back, only to be refused.)

    Raises:
        APIError: 400 ``context_length_exceeded`` naming ``param``.
    """
    fewest = -(-characters // longest_token)
    if fewest > max_model_len:
        raise invalid_request(
            f"{param}: the prompt's {characters} characters make at least {fewest} tokens (no "
            f"token holds more than {longest_token}), over the {max_model_len}-token context",
            param, "context_length_exceeded")


def kept_prompt_tokens(truncate_prompt_tokens: int | None, max_tokens: int | None,
                       max_model_len: int, max_param: str) -> int | None:
    """How many of the prompt's last tokens ``truncate_prompt_tokens`` keeps (None: all).
    -1 keeps as many as the context leaves beside ``max_tokens`` output tokens, or beside one
    where the request sets none or 0 (vLLM's -1 is the context less the output).

    Raises:
        APIError: 400 ``context_length_exceeded`` naming ``max_param`` when -1 is asked and
            ``max_tokens`` leaves no room for a prompt.
    """
    if truncate_prompt_tokens != -1:
        return truncate_prompt_tokens
    room = max_model_len - max(1, max_tokens or 0)
    if room < 1:
        raise invalid_request(
            f"{max_param} ({max_tokens}) leaves no room for the prompt in the "
            f"{max_model_len}-token context", max_param, "context_length_exceeded")
    return room


def chat_template_ids(tokenizer: Any, messages: list[dict[str, Any]],
                      options: dict[str, Any]) -> list[int]:
    """Token ids of the chat template applied to ``messages``.

    ``options`` are ``apply_chat_template``'s keyword arguments besides the messages
    (``add_generation_prompt``, ``continue_final_message``, template variables); see
    :meth:`~router.protocol.ChatCompletionRequest.template_options`.

    Raises:
        APIError: 400 naming ``messages`` when the model has no chat template or the template
            refuses the conversation.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise invalid_request("this model has no chat template; use /v1/completions",
                              "messages", "unsupported_value")
    try:
        encoded = tokenizer.apply_chat_template(messages, tokenize=True, **options)
    except TemplateError as exc:
        # Templates reject some conversations themselves (e.g. roles that do not alternate).
        raise invalid_request(f"messages: the model's chat template refused them: {exc}",
                              "messages") from exc
    return plain_token_ids(encoded)


def check_template_kwargs(tokenizer: Any, template_kwargs: dict[str, Any] | None) -> None:
    """Refuses ``chat_template_kwargs`` keys that would override ``apply_chat_template``'s own
    arguments (``tokenize``, ``tools`` ...) or the ``messages`` the template renders: they are
    template variables only.

    Raises:
        APIError: 400 naming ``chat_template_kwargs`` and the key.
    """
    if not template_kwargs:
        return
    parameters = inspect.signature(tokenizer.apply_chat_template).parameters.values()
    reserved = {p.name for p in parameters if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    for key in template_kwargs:
        if key in reserved | {"messages"}:
            raise invalid_request(
                f"chat_template_kwargs: '{key}' is not a template variable; set it as a "
                "request field if the API has one", "chat_template_kwargs")


def plain_token_ids(encoded: Any) -> list[int]:
    """Token ids from whatever ``apply_chat_template(tokenize=True)`` returned.

    transformers 5 returns a ``BatchEncoding`` (a mapping with ``input_ids``); older versions a
    list, sometimes nested one level for a batch of one.
    """
    ids = encoded["input_ids"] if hasattr(encoded, "keys") else encoded
    ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
    if ids and isinstance(ids[0], list):
        ids = ids[0]
    return [int(token_id) for token_id in ids]


def checked_ids(token_ids: Sequence[int], vocab_size: int, param: str) -> list[int]:
    """``token_ids`` as a list, if every id is in the vocabulary.

    Raises:
        APIError: 400 naming ``param[i]`` for the first id outside ``[0, vocab_size)``.
    """
    for index, token_id in enumerate(token_ids):
        if not 0 <= token_id < vocab_size:
            raise invalid_request(f"{param}[{index}]: token id {token_id} is outside the "
                                  f"vocabulary [0, {vocab_size})", param)
    return list(token_ids)
