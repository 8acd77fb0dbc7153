"""The OpenAI-compatible HTTP API of Nalar Serve, independent of Ray.

One module per concept:

* :mod:`router.api.app`: the FastAPI routes and the serving of one job;
* :mod:`router.api.backend`: what the app needs from the cluster (:class:`ServingBackend`);
* :mod:`router.api.auth`: API keys, and the guard refusing a request without an accepted one;
* :mod:`router.api.jobs`: a validated request turned into a worker's ``GenerationRequest``;
* :mod:`router.api.sampling`: sampling parameters from the body, fitted to the context;
* :mod:`router.api.prompts`: tokenization (chat template, token-id prompts);
* :mod:`router.api.stream`: reading the worker's chunks into SSE events or one answer;
* :mod:`router.api.disconnect`: noticing a client that went away and cancelling its request;
* :mod:`router.api.formats`: the OpenAI response shapes of each endpoint;
* :mod:`router.api.usage`: the ``usage`` object (token counts, speculative decoding);
* :mod:`router.api.token_strings`: token ids to texts and bytes for logprobs.
"""
