"""A validated request body turned into a worker's :class:`~contract.request.GenerationRequest`.

Cheap refusals come first (model, stream options, sampling ranges); then the prompt is
tokenized once, with the worker's tokenizer, and its block digests are computed under the
request's cache namespace for the prefix-aware router.
"""

from __future__ import annotations

import copy
import functools
import logging
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import anyio

from contract.identity import (
    AdapterRef,
    CacheNamespace,
    PromptDigests,
    prompt_digests,
    tenant_from_api_key,
)
from contract.request import GenerationRequest
from router.api.auth import bearer_key
from router.api.backend import ServingBackend
from router.api.prompts import (
    chat_template_ids,
    check_template_kwargs,
    checked_ids,
    kept_prompt_tokens,
    longest_token_characters,
    refuse_beyond_context,
    refuse_unpaired_surrogates,
    rendered_characters,
)
from router.api.sampling import as_api_error, chat_max_tokens, fit_context, sampling_params
from router.api.tools import ToolUse, template_conversation, tool_use
from router.errors import APIError, invalid_request
from router.protocol import ChatCompletionRequest, CompletionRequest

logger = logging.getLogger(__name__)


@dataclass
class Job:
    """A validated request, ready for the backend.

    Attributes:
        request: what the worker generates.
        response_id: the answer's ``id``: the request's own, or ``<prefix>-<request_id>``
            when the client set vLLM's ``request_id``.
        model: the model name the answer reports: the served model's, or the adapter's.
        stream: answer as SSE events.
        include_usage: stream a final usage-only event (``stream_options.include_usage``).
        continuous_usage: put the usage so far on every event
            (``stream_options.continuous_usage_stats``).
        created: Unix time in seconds, the answer's ``created``.
        tool_use: what the request's tools ask (chat only), whose parser reads calls out of
            the output; None without tools.
        prompt_logprobs: the alternatives per prompt token of the answer's vLLM
            ``prompt_logprobs``, as the client asked; None leaves them out (the worker may
            still compute prompt logprobs, and more alternatives, for an echo).
        echo: the text each choice's text begins with: a completion's prompt, or a chat's
            last message when it is the assistant's (``echo``); None without echo.
        return_token_ids: put the prompt's and the output's token ids in the answer (vLLM's
            ``return_token_ids``).
        tokens_as_ids: logprobs name each token ``token_id:<id>`` instead of its text (vLLM's
            ``return_tokens_as_token_ids``).
    """

    request: GenerationRequest
    response_id: str
    model: str
    stream: bool
    include_usage: bool
    continuous_usage: bool
    created: int = field(default_factory=lambda: int(time.time()))
    tool_use: ToolUse | None = None
    prompt_logprobs: int | None = None
    echo: str | None = None
    return_token_ids: bool = False
    tokens_as_ids: bool = False


def resolve_model(model: str | None, served_model_name: str,
                  adapters: Mapping[str, AdapterRef]) -> AdapterRef | None:
    """The adapter ``model`` names: None for the served base model, else the LoRA adapter
    loaded under that name (by name and content digest).

    A missing ``model`` means the base model (as vLLM allows).

    Raises:
        APIError: 404 ``model_not_found`` for any other name.
    """
    if model is None or model == served_model_name:
        return None
    adapter = adapters.get(model)
    if adapter is None:
        names = ", ".join(repr(name) for name in [served_model_name, *sorted(adapters)])
        raise APIError(404, f"The model '{model}' does not exist; this server serves "
                       f"{names}", param="model", code="model_not_found")
    return adapter


T = TypeVar("T")

LARGE_TEXT_CHARACTERS = 65_536
"""Texts longer than this are tokenized by a copy of the tokenizer of their own. A tokenizer
takes one call at a time, at about 1 MB of text a second: a client's megabytes (a prompt cut
by ``truncate_prompt_tokens``, which only its tokens can cut) would otherwise hold every
other request's tokenizing back for seconds."""

Tokenize = Callable[[Any], T]
"""Work on a tokenizer (given as its argument), returning ``T``."""


class JobBuilder:
    """Builds :class:`Job` objects for one backend (its tokenizer, context and identity)."""

    def __init__(self, backend: ServingBackend, tokenizer_lock: threading.Lock):
        self.backend = backend
        self._tokenizer_lock = tokenizer_lock  # held around every call on the tokenizer
        self._large_lock = threading.Lock()  # held around every call on its large-text copy
        self._large_tokenizer: Any = None

    @functools.cached_property
    def vocab_size(self) -> int:
        """Token ids a prompt may use. Read on first use, so a backend may finish loading its
        tokenizer after the app is built (``serve.ingress`` wants the app up front)."""
        return len(self.backend.tokenizer)

    @functools.cached_property
    def longest_token(self) -> int:
        """The most characters one token's text holds (read on first use, as
        :attr:`vocab_size`)."""
        with self._tokenizer_lock:
            return longest_token_characters(self.backend.tokenizer)

    async def chat_job(self, body: ChatCompletionRequest, authorization: str | None,
                       id_prefix: str = "chatcmpl") -> Job:
        """Validates a chat request and tokenizes it through the chat template, tools and
        tool turns included (:mod:`router.api.tools`); its ids begin with ``id_prefix``.

        Raises:
            APIError: 400 naming the parameter at fault, 401 for a malformed
                ``Authorization`` (keys are checked before, by :mod:`router.api.auth`),
                404 for another model.
        """
        max_tokens, max_param = chat_max_tokens(body)
        tokenize, characters, tools = self.chat_prompt(body)
        job = await self._job(body, tokenize, "messages", max_tokens, max_param,
                              authorization, id_prefix, characters, tools)
        last = body.messages[-1]
        if body.echo and last.role == "assistant" and last.content:
            job = replace(job, echo=last.content)
        return job

    def chat_prompt(self, body: ChatCompletionRequest,
                    ) -> tuple[Tokenize[list[int]], int, ToolUse | None]:
        """How a chat request's conversation becomes its prompt: a function that renders it
        through the chat template (tools and tool turns included) and tokenizes it, the
        characters it renders to at most, and its tool use.

        Raises:
            APIError: 400 naming the template option, ``messages`` or ``tools`` at fault.
        """
        options = body.template_options()
        if options["continue_final_message"] and options["add_generation_prompt"]:
            raise invalid_request("continue_final_message needs add_generation_prompt: false "
                                  "(the last message is continued, not answered)",
                                  "continue_final_message")
        check_template_kwargs(self.backend.tokenizer, body.chat_template_kwargs)
        sent = body.model_dump(include={"messages", "tools"}, exclude_none=True)
        for param in ("messages", "tools"):
            refuse_unpaired_surrogates(sent.get(param), param)
        characters = rendered_characters(sent["messages"])
        template = str(getattr(self.backend.tokenizer, "chat_template", None) or "")
        tools = tool_use(body, template)
        messages, tool_options = template_conversation(body, tools, template)

        def tokenize(tokenizer: Any) -> list[int]:
            return chat_template_ids(tokenizer, messages, {**options, **tool_options})
        return tokenize, characters, tools

    async def completion_job(self, body: CompletionRequest, authorization: str | None) -> Job:
        """Validates a text-completion request and tokenizes its prompt.

        Raises:
            APIError: as :meth:`chat_job`.
        """
        tokenize, characters = self.completion_prompt(body)
        job = await self._job(body, tokenize, "prompt", body.max_tokens, "max_tokens",
                              authorization, "cmpl", characters)
        if body.echo:
            job = replace(job, echo=await self._echo_text(body, job.request.token_ids))
        return job

    async def _echo_text(self, body: CompletionRequest, token_ids: list[int]) -> str:
        """The text an echo begins each choice with: a text prompt as sent; token ids, or a
        text cut by ``truncate_prompt_tokens``, as the worker's prompt tokens decoded (special
        tokens included, as ``/detokenize`` gives them), so that the text holds the tokens
        the echoed logprobs list."""
        if isinstance(body.prompt, str) and body.truncate_prompt_tokens is None:
            return body.prompt
        return await anyio.to_thread.run_sync(
            self.tokenized, lambda tokenizer: tokenizer.decode(token_ids), "prompt")

    def completion_prompt(self, body: CompletionRequest) -> tuple[Tokenize[list[int]], int]:
        """How a completion request's one prompt becomes its tokens (a text tokenized, or
        token ids range-checked), and the characters of a text (0 for token ids).

        Raises:
            APIError: 400 naming ``prompt`` for an unpaired surrogate in the text.
        """
        prompt = body.prompt
        if isinstance(prompt, str):
            refuse_unpaired_surrogates(prompt, "prompt")
            return lambda tokenizer: list(tokenizer.encode(prompt)), len(prompt)
        return lambda _: checked_ids(prompt, self.vocab_size, "prompt"), 0

    def refuse_too_long(self, characters: int, prompt_param: str) -> None:
        """:func:`~router.api.prompts.refuse_beyond_context` for this backend's context."""
        refuse_beyond_context(characters, self.longest_token, self.backend.max_model_len,
                              prompt_param)

    async def _job(self, body: ChatCompletionRequest | CompletionRequest,
                   tokenize: Tokenize[list[int]], prompt_param: str,
                   max_tokens: int | None, max_param: str, authorization: str | None,
                   id_prefix: str, characters: int, tools: ToolUse | None = None) -> Job:
        """Checks what needs no tokens first (cheap refusals: a text of ``characters`` too
        long for the context whatever its tokenization among them), then tokenizes and
        hashes."""
        adapter = resolve_model(body.model, self.backend.served_model_name,
                                self.backend.adapters)
        check_stream_options(body)
        if body.truncate_prompt_tokens is None:  # else its last tokens may well fit
            self.refuse_too_long(characters, prompt_param)
        for param in ("stop_token_ids", "allowed_token_ids"):
            checked_ids(getattr(body, param) or (), self.vocab_size, param)
        checked_ids(list(body.logit_bias_ids()), self.vocab_size, "logit_bias")
        sampling = sampling_params(body, max_tokens, max_param)
        if tools is not None:
            sampling = replace(sampling, structured=tools.constraint(sampling.structured))
            if tools.forced:  # calls only, ended by the grammar: a stop string could only
                sampling = replace(sampling, stop=[])  # cut a call in two
        # The key has passed ``router.api.auth.ApiKeyGuard`` (accepted, or no keys required),
        # so a tenant scope only ever comes from an accepted key.
        namespace = CacheNamespace(
            tenant=tenant_from_api_key(bearer_key(authorization), self.backend.namespace_secret),
            cache_salt=body.cache_salt,
        )
        keep_last = kept_prompt_tokens(body.truncate_prompt_tokens, max_tokens,
                                       self.backend.max_model_len, max_param)
        token_ids, digests = await anyio.to_thread.run_sync(
            self._tokens_and_digests, tokenize, keep_last, namespace, adapter, prompt_param,
            characters)
        sampling = fit_context(sampling, len(token_ids), self.backend.max_model_len,
                               max_tokens is not None, prompt_param, max_param)
        if body.bad_words:
            sampling = replace(sampling, bad_words_token_ids=await anyio.to_thread.run_sync(
                self._bad_words_ids, body.bad_words))
        with as_api_error({}):  # the tools' grammar and the bad words are new since validated
            sampling.check_bans_beside_a_grammar()
        # A request scoring its prompt reuses no cached block (a block has no logits), so
        # without digests the router places it by load alone, not on a prefix's holder.
        routed_digests = None if sampling.prompt_logprobs is not None else digests
        # A client's ``request_id`` names the answer (vLLM's format) but not the worker's
        # request: two clients may send the same one, and the id cancels the request.
        request = GenerationRequest(f"{id_prefix}-{uuid.uuid4().hex}", token_ids, sampling,
                                    namespace, routed_digests, adapter)
        response_id = f"{id_prefix}-{body.request_id}" if body.request_id else request.request_id
        # The tenant is a keyed hash; a prefix of it is enough to correlate logs.
        logger.debug("request %s (answer id %s): tenant %s, %d prompt tokens, %d digests",
                     request.request_id, response_id, namespace.tenant[:12], len(token_ids),
                     len(digests.digests))
        options = body.stream_options
        model = self.backend.served_model_name if adapter is None else adapter.adapter_id
        return Job(request, response_id, model, bool(body.stream),
                   include_usage=options is not None and options.final_usage(),
                   continuous_usage=options is not None and options.usage_on_every_event(),
                   tool_use=tools, prompt_logprobs=body.prompt_logprobs,
                   return_token_ids=bool(body.return_token_ids),
                   tokens_as_ids=bool(body.return_tokens_as_token_ids))

    def _tokens_and_digests(self, tokenize: Tokenize[list[int]], keep_last: int | None,
                            namespace: CacheNamespace, adapter: AdapterRef | None,
                            prompt_param: str, characters: int,
                            ) -> tuple[list[int], PromptDigests]:
        """Runs in a worker thread: tokenization and hashing are CPU work the event loop
        should not wait on. ``keep_last`` (``truncate_prompt_tokens``) keeps only the prompt's
        last tokens, as vLLM truncates: from the left.

        Raises:
            APIError: as :meth:`tokenized`.
        """
        token_ids = self.tokenized(tokenize, prompt_param, characters)
        if keep_last is not None:
            token_ids = token_ids[-keep_last:]
        return token_ids, prompt_digests(self.backend.identity, namespace, token_ids, adapter)

    def _bad_words_ids(self, words: list[str]) -> list[list[int]]:
        """The token sequences ``bad_words`` bans, as vLLM makes them (call from a worker
        thread): each word as written, and with one leading space where that spells it with
        other tokens of the same count (mid-text, a word usually follows a space)."""
        sequences: list[list[int]] = []
        for word in words:
            bare = self.tokenized(lambda tokenizer, w=word: tokenizer.encode(
                w.lstrip(), add_special_tokens=False), "bad_words")
            spaced = self.tokenized(lambda tokenizer, w=word: tokenizer.encode(
                " " + w.lstrip(), add_special_tokens=False), "bad_words")
            sequences.append(bare)
            if len(spaced) == len(bare) and spaced[0] != bare[0]:
                sequences.append(spaced)
        return [ids for ids in sequences if ids]

    def tokenized(self, tokenize: Tokenize[T], prompt_param: str, characters: int = 0) -> T:
        """``tokenize(tokenizer)`` under that tokenizer's lock (call from a worker thread):
        the backend's, or for a text of more than :data:`LARGE_TEXT_CHARACTERS`
        ``characters``, a copy of it kept for large texts.

        Raises:
            APIError: 400 naming ``prompt_param`` when the tokenizer rejects the text (e.g. a
                lone UTF-16 surrogate, which no UTF-8 encoding can carry): case R6.
        """
        tokenizer, lock = self.backend.tokenizer, self._tokenizer_lock
        if characters > LARGE_TEXT_CHARACTERS:
            tokenizer, lock = self._large_text_tokenizer(), self._large_lock
        with lock:
            try:
                return tokenize(tokenizer)
            except (TypeError, ValueError, UnicodeError) as exc:
                raise invalid_request(f"the tokenizer rejected the {prompt_param}: {exc}",
                                      prompt_param) from exc

    def _large_text_tokenizer(self) -> Any:
        """The copy of the tokenizer that large texts use, made on first use (while the
        backend's is not in use)."""
        with self._large_lock:
            if self._large_tokenizer is None:
                with self._tokenizer_lock:
                    self._large_tokenizer = copy.deepcopy(self.backend.tokenizer)
            return self._large_tokenizer


def check_stream_options(body: ChatCompletionRequest | CompletionRequest) -> None:
    """``stream_options`` only means something for a streaming request (as OpenAI rules)."""
    if body.stream_options is not None and not body.stream:
        raise invalid_request("stream_options is only allowed when stream is true",
                              "stream_options")
