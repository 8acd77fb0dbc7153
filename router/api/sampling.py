"""Sampling parameters from a request body, validated and fitted to the context."""

from __future__ import annotations

from dataclasses import replace

from router.errors import invalid_request
from router.protocol import ChatCompletionRequest, CompletionRequest
from workers.request import InvalidRequestError, SamplingParams


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
        stop_token_ids=list(body.stop_token_ids or []),
        ignore_eos=bool(body.ignore_eos),
        logprobs=body.logprobs_count(),
    )
    # Chat asks for alternatives with ``top_logprobs``; completions with ``logprobs``.
    chat = isinstance(body, ChatCompletionRequest)
    validate(sampling, max_param, "top_logprobs" if chat else "logprobs")
    return sampling


def fit_context(sampling: SamplingParams, prompt_len: int, max_model_len: int,
                explicit_max: bool, prompt_param: str, max_param: str) -> SamplingParams:
    """Refuses prompts that leave no room to generate; defaults ``max_tokens`` to the rest
    of the context (``max_model_len`` tokens, prompt included).

    Raises:
        APIError: 400 ``context_length_exceeded`` naming the prompt or the output limit.
    """
    if prompt_len == 0:
        raise invalid_request(f"{prompt_param}: the prompt has no tokens", prompt_param)
    if prompt_len >= max_model_len:
        raise invalid_request(
            f"This model's maximum context length is {max_model_len} tokens, and the prompt "
            f"has {prompt_len} tokens, leaving no room for output", prompt_param,
            "context_length_exceeded")
    if not explicit_max:
        sampling = replace(sampling, max_tokens=max_model_len - prompt_len)
        validate(sampling, max_param)  # min_tokens may exceed what the context leaves
        return sampling
    if prompt_len + sampling.max_tokens > max_model_len:
        raise invalid_request(
            f"This model's maximum context length is {max_model_len} tokens; the prompt has "
            f"{prompt_len} tokens and {max_param} asks for {sampling.max_tokens} more",
            max_param, "context_length_exceeded")
    return sampling


def validate(sampling: SamplingParams, max_param: str, logprobs_param: str = "logprobs",
             ) -> None:
    """:meth:`SamplingParams.validate`, as a 400 naming the request's parameter."""
    try:
        sampling.validate()
    except InvalidRequestError as exc:
        renamed = {"max_tokens": max_param, "logprobs": logprobs_param}
        param = renamed.get(exc.param, exc.param)
        message = str(exc)
        if exc.param and message.startswith(exc.param):  # name the field the client sent
            message = param + message[len(exc.param):]
        raise invalid_request(message, param, exc.code) from exc
