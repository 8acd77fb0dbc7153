"""Sampling parameters from a request body, validated and fitted to the context."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import replace

from contract.request import InvalidRequestError, SamplingParams
from router.api.structured import structured_output
from router.errors import invalid_request
from router.protocol import ChatCompletionRequest, CompletionRequest


def chat_max_tokens(body: ChatCompletionRequest) -> tuple[int | None, str]:
    """The output limit of a chat request and the parameter it came from.

    ``max_completion_tokens`` is OpenAI's current name and ``max_tokens`` the deprecated one;
    both are accepted, but not two different values.
    """
    if body.max_completion_tokens is None:
        return body.max_tokens, "max_tokens"
    if body.max_tokens is not None and body.max_tokens != body.max_completion_tokens:
        raise invalid_request("max_tokens and max_completion_tokens disagree; send only one",
                              "max_tokens")
    return body.max_completion_tokens, "max_completion_tokens"


def sampling_params(body: ChatCompletionRequest | CompletionRequest, max_tokens: int | None,
                    max_param: str) -> SamplingParams:
    """Sampling parameters, validated; ``max_tokens`` is provisional until the prompt's
    length is known (see :func:`fit_context`). Token ids are range-checked by the caller.

    Raises:
        APIError: 400 naming the first out-of-range parameter as the client spelled it.
    """
    min_tokens = body.min_tokens or 0
    sampling = SamplingParams(
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=0 if body.top_k is None else body.top_k,
        min_p=body.min_p or 0.0,
        repetition_penalty=1.0 if body.repetition_penalty is None
        else body.repetition_penalty,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        logit_bias=body.logit_bias_ids(),
        seed=body.seed,
        n=1 if body.n is None else body.n,
        max_tokens=max(1, min_tokens) if max_tokens is None else max_tokens,
        min_tokens=min_tokens,
        stop=list(body.stop or []),
        include_stop_str_in_output=bool(body.include_stop_str_in_output),
        skip_special_tokens=body.skip_special_tokens is not False,
        stop_token_ids=list(body.stop_token_ids or []),
        ignore_eos=bool(body.ignore_eos),
        logprobs=body.logprobs_count(),
        structured=structured_output(body),
        # The client's own value is range-checked first (see below).
        prompt_logprobs=(body.prompt_logprobs if body.prompt_logprobs is not None
                         else body.prompt_logprobs_count()),
        allowed_token_ids=body.allowed_token_ids,
    )
    # Chat asks for alternatives with ``top_logprobs``; completions with ``logprobs``.
    chat = isinstance(body, ChatCompletionRequest)
    validate(sampling, max_param, "top_logprobs" if chat else "logprobs")
    # Raised to an echo's ``logprobs`` only once the client's own ``prompt_logprobs`` passed:
    # a -1 beside ``echo`` and ``logprobs: 5`` must be refused, not hidden by the larger one.
    return replace(sampling, prompt_logprobs=body.prompt_logprobs_count())


def fit_context(sampling: SamplingParams, prompt_len: int, max_model_len: int,
                explicit_max: bool, prompt_param: str, max_param: str) -> SamplingParams:
    """Refuses prompts that leave no room to generate; defaults ``max_tokens`` to the rest
    of the context (``max_model_len`` tokens, prompt included).

    Raises:
        APIError: 400 ``context_length_exceeded`` naming the prompt or the output limit, or
            400 naming ``min_tokens`` when it exceeds what the context leaves.
    """
    if prompt_len == 0:
        raise invalid_request(f"{prompt_param}: the prompt has no tokens", prompt_param)
    with as_api_error({"prompt": prompt_param, "max_tokens": max_param}):
        if not explicit_max:
            sampling = replace(sampling, max_tokens=max(1, max_model_len - prompt_len))
        sampling.check_context(prompt_len, max_model_len)
        if not explicit_max:  # min_tokens may exceed what the context leaves
            sampling.check_min_tokens()
    return sampling


def validate(sampling: SamplingParams, max_param: str, logprobs_param: str = "logprobs",
             ) -> None:
    """:meth:`SamplingParams.validate`, as a 400 naming the request's parameter."""
    with as_api_error({"max_tokens": max_param, "logprobs": logprobs_param}):
        sampling.validate()


@contextlib.contextmanager
def as_api_error(renamed: dict[str, str]) -> Iterator[None]:
    """Turns an :class:`InvalidRequestError` into a 400 naming the parameter as the client
    spelled it (``renamed``: the contract's name → the request's), in the message too where
    the message names it as a parameter (the prompt is named in prose)."""
    try:
        yield
    except InvalidRequestError as exc:
        param = renamed.get(exc.param, exc.param)
        message = str(exc)
        if exc.param and exc.param != "prompt":
            message = message.replace(exc.param, param, 1)
        raise invalid_request(message, param, exc.code) from exc
