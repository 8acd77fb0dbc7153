"""A request's output constraint, from whichever field it came in: OpenAI's
``response_format``, vLLM's ``structured_outputs``, or vLLM's older ``guided_*`` fields.

The constraint's content is checked by the worker's grammar engine
(``workers.structured.grammar``), which names what it cannot use; here only its shape.
"""

from __future__ import annotations

import json
from typing import Any

from contract.request import StructuredOutput
from router.errors import invalid_request
from router.protocol import ChatCompletionRequest, CompletionRequest

ANY_JSON_OBJECT = json.dumps({"type": "object"})
_KINDS = ("json", "regex", "choice", "grammar")


def structured_output(body: ChatCompletionRequest | CompletionRequest) -> StructuredOutput | None:
    """The one constraint the request asks for, or None for free text.

    Raises:
        APIError: 400 naming the field: a malformed constraint, or more than one.
    """
    found = [(name, constraint) for name, constraint in (
        ("response_format", _from_response_format(body.response_format)),
        ("structured_outputs", _from_structured_outputs(body.structured_outputs)),
        *((f"guided_{kind}", _constraint(kind, getattr(body, f"guided_{kind}"),
                                         f"guided_{kind}")) for kind in _KINDS),
    ) if constraint is not None]
    if len(found) > 1:
        raise invalid_request(f"send one output constraint, not {found[0][0]} and "
                              f"{found[1][0]}", found[1][0])
    return found[0][1] if found else None


def _from_response_format(value: Any) -> StructuredOutput | None:
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json", ANY_JSON_OBJECT, "response_format")
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise invalid_request("response_format.json_schema.schema must be a JSON Schema "
                                  "object", "response_format")
        return StructuredOutput("json", json.dumps(spec["schema"]), "response_format")
    raise invalid_request("response_format.type must be 'text', 'json_object' or "
                          "'json_schema'", "response_format")


def _from_structured_outputs(value: Any) -> StructuredOutput | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise invalid_request("structured_outputs must be an object", "structured_outputs")
    given = [kind for kind in _KINDS if value.get(kind) is not None]
    if value.get("json_object"):
        given.append("json_object")
    if len(given) != 1:
        raise invalid_request("structured_outputs takes exactly one of json, regex, choice, "
                              "grammar, json_object", "structured_outputs")
    if given[0] == "json_object":
        return StructuredOutput("json", ANY_JSON_OBJECT, "structured_outputs")
    return _constraint(given[0], value[given[0]], "structured_outputs")


def _constraint(kind: str, value: Any, param: str) -> StructuredOutput | None:
    if value is None:
        return None
    if kind == "json":
        if isinstance(value, str):  # vLLM accepts the schema as JSON text too
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise invalid_request(f"{param}: the schema is not valid JSON ({exc})",
                                      param) from exc
        if not isinstance(value, dict):
            raise invalid_request(f"{param}: a JSON Schema must be an object", param)
        return StructuredOutput("json", json.dumps(value), param)
    if kind == "choice":
        if (not isinstance(value, list) or not value
                or not all(isinstance(choice, str) for choice in value)):
            raise invalid_request(f"{param}: choice must be a non-empty list of strings", param)
        return StructuredOutput("choice", json.dumps(value), param)
    if not isinstance(value, str) or not value:
        raise invalid_request(f"{param}: {kind} must be a non-empty string", param)
    return StructuredOutput(kind, value, param)
