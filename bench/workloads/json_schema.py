"""``json``: requests for JSON objects under a JSON Schema (OpenAI's ``response_format``), the
kind agent frameworks and extraction pipelines send, each output checked against its schema.

As in vLLM's structured-output serving benchmark, a run reports how many outputs parse and
validate (:func:`output_is_valid`, with ``jsonschema`` and its format checker), beside the
usual latencies. The schemas are a fixed set of realistic shapes (nesting, enums, bounded
arrays, patterns, formats, ``anyOf``), each request asking for one at random about a random
subject. Greedy outputs of a small model stop on their own well inside a few hundred tokens;
``--output-tokens`` is their ``max_tokens``.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from typing import Any

import jsonschema

from bench.records import BenchRequest
from bench.text import estimate_tokens
from bench.workloads.config import WorkloadConfig
from bench.workloads.session import SingleRequest

SCHEMAS: dict[str, dict[str, Any]] = {
    "order": {"type": "object", "properties": {
        "id": {"type": "string", "pattern": "^ORD-[0-9]{6}$"},
        "items": {"type": "array", "minItems": 1, "maxItems": 4, "items": {
            "type": "object", "properties": {
                "sku": {"type": "string", "maxLength": 12},
                "quantity": {"type": "integer", "minimum": 1},
                "price": {"type": "number", "minimum": 0}},
            "required": ["sku", "quantity", "price"], "additionalProperties": False}},
        "status": {"enum": ["pending", "paid", "shipped"]}},
        "required": ["id", "items", "status"], "additionalProperties": False},
    "person": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "email": {"type": "string", "format": "email", "maxLength": 60},
        "address": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 40},
            "country": {"type": "string", "pattern": "^[A-Z]{2}$"}},
            "required": ["city", "country"], "additionalProperties": False}},
        "required": ["name", "age", "address"], "additionalProperties": False},
    "event": {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 60},
        "starts": {"type": "string", "format": "date-time"},
        "location": {"anyOf": [{"type": "string", "maxLength": 40}, {"type": "null"}]},
        "attendees": {"type": "array", "maxItems": 5,
                      "items": {"type": "string", "maxLength": 30}}},
        "required": ["title", "starts", "location", "attendees"],
        "additionalProperties": False},
    "review": {"type": "object", "properties": {
        "rating": {"type": "integer", "minimum": 1, "maximum": 5},
        "pros": {"type": "array", "maxItems": 3, "items": {"type": "string", "maxLength": 40}},
        "cons": {"type": "array", "maxItems": 3, "items": {"type": "string", "maxLength": 40}},
        "recommend": {"type": "boolean"}},
        "required": ["rating", "pros", "cons", "recommend"], "additionalProperties": False},
    "tool_call": {"type": "object", "properties": {
        "name": {"enum": ["get_weather", "search_web", "send_email"]},
        "arguments": {"type": "object", "properties": {
            "query": {"type": "string", "maxLength": 60},
            "limit": {"type": "integer", "minimum": 1, "maximum": 20}},
            "required": ["query"], "additionalProperties": False}},
        "required": ["name", "arguments"], "additionalProperties": False},
}
"""The schemas requests ask for, by name (``json_schema.name`` in the request)."""

SUBJECTS = ("a bookshop", "a bicycle repair", "a jazz concert", "a weather station",
            "a hiking trip", "a coffee roaster", "a chess club", "a science museum",
            "a garden centre", "a train journey", "a bakery", "a music school")
"""What a request asks its object to be about, chosen at random."""


def json_sessions(config: WorkloadConfig) -> Iterator[SingleRequest]:
    """Endless requests for a JSON object under one of :data:`SCHEMAS`."""
    rng = random.Random(config.seed)
    while True:
        name = rng.choice(sorted(SCHEMAS))
        content = (f"Write one realistic example of a {name.replace('_', ' ')} about "
                   f"{rng.choice(SUBJECTS)}, as a JSON object.")
        response_format = {"type": "json_schema", "json_schema": {
            "name": name, "schema": SCHEMAS[name], "strict": True}}
        yield SingleRequest(BenchRequest(
            [{"role": "user", "content": content}], config.output_length(rng),
            estimated_prompt_tokens=estimate_tokens(content), api_key=config.api_key,
            label=f"json-{name}", response_format=response_format))


def output_is_valid(response_format: dict[str, Any], text: str) -> bool:
    """Whether ``text`` is one JSON value that validates against ``response_format``'s
    schema (formats checked); for ``json_object``, whether it is a JSON object."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False
    if response_format.get("type") == "json_object":
        return isinstance(value, dict)
    schema = response_format["json_schema"]["schema"]
    validator = jsonschema.Draft202012Validator(schema,
                                                format_checker=jsonschema.FormatChecker())
    return validator.is_valid(value)
