"""Errors of the HTTP API, in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

Three kinds of failure reach a client:

* the request is wrong: 400 (``invalid_request_error``; FastAPI's 422 is replaced), 401 for a
  malformed ``Authorization`` header, 404 for an unknown model or route;
* the cluster cannot take it now: :class:`OverloadedError` from the backend, 503 (or 429) with
  ``Retry-After``;
* the cluster failed: 500 (``server_error``), with the request id, never internal details.
"""

from __future__ import annotations

import logging
import math
import sys
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from contract.request import InvalidRequestError

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup

logger = logging.getLogger(__name__)

_TYPE_BY_STATUS = {429: "rate_limit_error"}


class OverloadedError(Exception):
    """Raised by a serving backend that cannot take a request now (queues full, no replica).

    Answered with ``status_code`` (503 by default, 429 allowed) and a ``Retry-After`` header, so
    overload is refused quickly instead of queued without bound.

    Attributes:
        retry_after_s: seconds the client should wait before retrying.
        status_code: 503 or 429.
    """

    def __init__(self, message: str = "the server is overloaded; retry later",
                 retry_after_s: float = 1.0, status_code: int = 503):
        super().__init__(message)
        if status_code not in (429, 503):
            raise ValueError("OverloadedError status must be 429 or 503")
        self.retry_after_s = retry_after_s
        self.status_code = status_code


class APIError(Exception):
    """An error answer the app has decided on; :meth:`response` renders it.

    Attributes:
        status_code: HTTP status.
        message: human-readable explanation (never contains an API key).
        type: OpenAI error type (``invalid_request_error``, ``server_error`` ...).
        param: the request field at fault, as a path like ``messages[0].content``, or ``None``.
        code: machine-readable code (``context_length_exceeded``, ``model_not_found`` ...).
        headers: extra response headers (``Retry-After``, ``x-nalar-worker``).
    """

    def __init__(self, status_code: int, message: str, *, param: str | None = None,
                 code: str | None = None, error_type: str | None = None,
                 headers: Mapping[str, str] | None = None):
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.code = code
        self.type = error_type or _default_type(status_code)
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        """The JSON body: ``{"error": {...}}``."""
        return {"error": {"message": self.message, "type": self.type,
                          "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        """The error as an HTTP response."""
        return JSONResponse(self.body(), status_code=self.status_code, headers=self.headers)


_KNOWN = (APIError, InvalidRequestError, OverloadedError)
"""Errors whose kind decides their answer (400, 503/429 ...); anything else is a 500."""


def _default_type(status_code: int) -> str:
    if status_code >= 500:
        return "server_error"
    return _TYPE_BY_STATUS.get(status_code, "invalid_request_error")


def invalid_request(message: str, param: str | None = None,
                    code: str = "invalid_value") -> APIError:
    """A 400 ``invalid_request_error``."""
    return APIError(400, message, param=param, code=code)


def retry_after_headers(seconds: float) -> dict[str, str]:
    """``Retry-After`` in whole seconds (at least 1, as HTTP requires) and ``retry-after-ms``
    in milliseconds, which the OpenAI clients prefer when both are present."""
    return {"Retry-After": str(max(1, math.ceil(seconds))),
            "retry-after-ms": str(max(0, round(seconds * 1000)))}


def overloaded(exc: OverloadedError, headers: Mapping[str, str] | None = None) -> APIError:
    """The answer to an :class:`OverloadedError`: its status with ``Retry-After``."""
    return APIError(exc.status_code, str(exc), code="overloaded",
                    headers={**(headers or {}), **retry_after_headers(exc.retry_after_s)})


def from_backend_exception(exc: Exception, request_id: str,
                           headers: Mapping[str, str] | None = None) -> APIError:
    """Maps an exception raised by the serving backend to the answer the client gets.

    ``InvalidRequestError`` (the engine refused the request) is the client's fault: 400 with its
    ``param`` and ``code`` (404 for ``model_not_found``: an adapter the worker does not hold).
    ``OverloadedError`` is 503/429 with ``Retry-After``. Anything else is logged with its
    traceback and answered 500 without internal details.

    The error is first taken out of the wrappers it may arrive in (:func:`typed_error`), so
    its kind decides the answer however many layers it crossed.
    """
    exc = typed_error(exc)
    if isinstance(exc, APIError):
        exc.headers = {**(headers or {}), **exc.headers}
        return exc
    if isinstance(exc, InvalidRequestError):
        status = 404 if exc.code == "model_not_found" else 400
        return APIError(status, str(exc), param=exc.param, code=exc.code, headers=headers)
    if isinstance(exc, OverloadedError):
        return overloaded(exc, headers)
    logger.error("request %s failed in the backend", request_id, exc_info=exc)
    return APIError(500, f"internal error while serving request {request_id}",
                    code="internal_error", headers=headers)


def typed_error(exc: BaseException) -> BaseException:
    """The error that decides the answer to a failure that arrived as ``exc``.

    A task group (``asyncio.TaskGroup``, anyio's) raises its failures as an exception group:
    the answer is that of its first leaf that is an error the API knows (``APIError``,
    ``InvalidRequestError``, ``OverloadedError``), else of its first leaf. Anything else is its
    own answer.
    """
    if not isinstance(exc, BaseExceptionGroup):
        return exc
    leaves = list(_leaves(exc))
    return next((leaf for leaf in leaves if isinstance(leaf, _KNOWN)), leaves[0])


def _leaves(group: BaseExceptionGroup) -> Iterator[BaseException]:
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            yield from _leaves(exc)
        else:
            yield exc


# Pydantic error types that mean "wrong JSON type", reported with code ``invalid_type``.
_TYPE_ERRORS = ("_type", "_parsing", "int_from_float")

# Codes our own validators raise (``router.protocol``): their type is the OpenAI code.
_OWN_CODES = ("invalid_value", "invalid_type", "unsupported_parameter", "unsupported_value",
              "unsupported_content_type", "missing_required_parameter")


def from_validation_errors(errors: Sequence[Mapping[str, Any]]) -> APIError:
    """The 400 answer to a failed request-body validation; the first error names the param."""
    if not errors:
        return invalid_request("invalid request body")
    error = errors[0]
    kind = error.get("type", "")
    loc = tuple(error.get("loc", ()))
    if kind == "json_invalid":
        reason = error.get("ctx", {}).get("error", "malformed JSON")
        return invalid_request(f"the request body is not valid JSON: {reason}",
                               code="invalid_json")
    param = _param_path(loc[1:] if loc[:1] == ("body",) else loc)
    if param is None:
        if kind == "missing":
            return invalid_request("the request body is missing (send a JSON object)",
                                   code="missing_required_parameter")
        if kind == "string_unicode":  # pydantic's answer to an object key it cannot decode
            name = ascii(error.get("input"))
            return invalid_request(
                f"a field name holds an unpaired UTF-16 surrogate ({name[:40]}), which no "
                "UTF-8 text can carry")
        return invalid_request("the request body must be a JSON object "
                               "(Content-Type: application/json)", code="invalid_type")
    return invalid_request(_message(kind, param, error.get("msg", "")), param, _code(kind))


def _param_path(loc: Sequence[Any]) -> str | None:
    """``("messages", 0, "content")`` → ``messages[0].content``."""
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path or None


def _code(kind: str) -> str:
    if kind == "extra_forbidden":
        return "unknown_parameter"
    if kind == "missing":
        return "missing_required_parameter"
    if kind in _OWN_CODES:
        return kind
    if kind.endswith(_TYPE_ERRORS):
        return "invalid_type"
    return "invalid_value"


def _message(kind: str, param: str, msg: str) -> str:
    if kind == "extra_forbidden":
        return f"Unrecognized request argument supplied: {param}"
    if kind == "missing":
        return f"Missing required parameter: '{param}'"
    if msg.startswith(param):  # our own validators name the field already
        return msg
    return f"{param}: {msg}"


def install_error_handlers(app: FastAPI) -> None:
    """Makes every error the app answers OpenAI-shaped, validation errors 400 instead of 422."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return from_validation_errors(exc.errors()).response()

    @app.exception_handler(InvalidRequestError)
    async def _invalid_request(_: Request, exc: InvalidRequestError) -> JSONResponse:
        return APIError(400, str(exc), param=exc.param, code=exc.code).response()

    @app.exception_handler(OverloadedError)
    async def _overloaded(_: Request, exc: OverloadedError) -> JSONResponse:
        return overloaded(exc).response()

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        typed = typed_error(exc)
        if isinstance(typed, _KNOWN):  # a known error inside a task group's exception group
            return from_backend_exception(typed, "-").response()
        # Starlette logs the exception itself after this answer goes out.
        return APIError(500, "internal server error", code="internal_error").response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 400 and exc.detail == _BODY_NOT_PARSED:
            return _unreadable_body(request.headers.get("content-encoding")).response()
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return APIError(exc.status_code, str(exc.detail), code=code,
                        headers=exc.headers).response()


_BODY_NOT_PARSED = "There was an error parsing the body"
"""FastAPI's 400 detail for a body its JSON decoder raised on with anything but a JSON syntax
error: bytes that are not UTF-8 (a compressed body among them), or nesting too deep."""


def _unreadable_body(content_encoding: str | None) -> APIError:
    """The 400 for a body FastAPI could not decode, saying what to send instead."""
    if content_encoding and content_encoding.lower() != "identity":
        return invalid_request(f"Content-Encoding {content_encoding!r} is not supported: send "
                               "the JSON body uncompressed", code="invalid_json")
    return invalid_request("the request body is not valid JSON: it is not UTF-8 text, or it "
                           "nests too deeply", code="invalid_json")
