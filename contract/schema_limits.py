"""What a JSON Schema constraint may hold beyond what its grammar engine checks: bounds that
llguidance (1.9's JSON Schema compiler) either crashes on or silently gets wrong, refused
before it sees them.

- An integer range whose maximum rounds, as a 64-bit float, to -2**63 or below kills the
  process that compiles it (SIGSEGV), the ingress's tool check or a worker, and with it every
  request that process serves.
- Bounds beyond the 64-bit range compile, and the output then holds 2**63 - 1, outside them.

Both are checked by the ingress (tool parameters) and by the worker (every constraint it
compiles), so neither process ever hands such a schema to llguidance.
"""

from __future__ import annotations

import json
from typing import Any

INT64_MIN, INT64_MAX = -2**63, 2**63 - 1

LOWEST_MAXIMUM = INT64_MIN + 1024
"""The lowest integer ``maximum`` accepted. float64s just above -2**63 are 1,024 apart, so a
maximum within 512 of it rounds to -2**63, the crash above (probed in subprocesses: up to
-2**63 + 500 crashed, from + 600 not); from here up it rounds to -2**63 + 1,024 or above."""

_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")

DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples"})
"""JSON Schema keywords whose values are data, not schemas: a ``$ref`` or a bound inside them
is a value."""


def schema_fault(schema: Any) -> str | None:
    """Why ``schema`` (a parsed JSON Schema) may not be compiled, or None.

    Bounds are checked on every node that may constrain an integer: one whose ``type`` is or
    lists ``integer``, and one without a ``type`` (its bounds reach an integer branch of its
    ``anyOf``, ``allOf`` or ``$ref``). A schema nested too deep to walk is left to llguidance,
    which refuses it.
    """
    try:
        return _fault(schema, "")
    except RecursionError:
        return None


def _fault(schema: Any, where: str) -> str | None:
    """:func:`schema_fault` of the node at JSON pointer ``where``."""
    if isinstance(schema, list):
        return next((fault for i, item in enumerate(schema)
                     if (fault := _fault(item, f"{where}/{i}"))), None)
    if not isinstance(schema, dict):
        return None
    kind = schema.get("type")
    if kind is None or kind == "integer" or (isinstance(kind, list) and "integer" in kind):
        for key in _BOUNDS:
            fault = _bound_fault(key, schema.get(key))
            if fault:
                return f"{where or '/'}: {fault}"
    return next((fault for key, value in schema.items() if key not in DATA_KEYWORDS
                 if (fault := _fault(value, f"{where}/{key}"))), None)


def grammar_fault(grammar: str) -> str | None:
    """:func:`schema_fault` of each JSON Schema a Lark grammar embeds (``%json {...}``)."""
    decoder = json.JSONDecoder()
    at = grammar.find("%json")
    while at >= 0:
        start = len(grammar) - len(grammar[at + len("%json"):].lstrip())
        try:
            schema, _ = decoder.raw_decode(grammar, start)
        except (json.JSONDecodeError, RecursionError):
            schema = None  # llguidance names the fault
        fault = schema_fault(schema)
        if fault:
            return fault
        at = grammar.find("%json", at + 1)
    return None


def _bound_fault(key: str, value: Any) -> str | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if not INT64_MIN <= value <= INT64_MAX:
        return f"{key} {value} is outside the 64-bit integer range"
    if key in ("maximum", "exclusiveMaximum") and value < LOWEST_MAXIMUM:
        return f"{key} {value} is below {LOWEST_MAXIMUM}, the lowest integer maximum served"
    return None
