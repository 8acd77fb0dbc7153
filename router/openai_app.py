"""The OpenAI-compatible HTTP API, as cluster code imports it.

The implementation lives in :mod:`router.api` (one module per concept); this module keeps the
names the ingress deployment, the benchmarks and the tests use.
"""

from router.api.app import HEALTH_TIMEOUT_S, build_openai_app
from router.api.backend import WORKER_HEADER, ServingBackend
from router.api.prompts import plain_token_ids
from router.api.usage import sum_spec_usage

__all__ = ["HEALTH_TIMEOUT_S", "WORKER_HEADER", "ServingBackend", "build_openai_app",
           "plain_token_ids", "sum_spec_usage"]
