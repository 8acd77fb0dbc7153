"""Do constrained outputs always validate? Fifty JSON schemas of the kinds APIs and agents use
(nesting, enums, bounded arrays, optional fields, ``anyOf``/``oneOf``, ``$ref`` and
recursion, string formats and patterns, numeric bounds), each sent ``--requests`` times at
temperature 0 and at 1 (seeded) to one engine in this process (the embedded model, its
defaults), 16 at a time. Every output is parsed with ``json`` and validated with the
``jsonschema`` package (formats checked); the compile time of each schema (llguidance's check,
no cache) is recorded.

Goal: 100% of the outputs parse and validate, those the budget ended (``length``, closed
early by ``workers/structured/closing.py``) included; they are listed apart.

``--suite bench-json`` sends ``nalar bench --workload json``'s requests instead (its five
schemas, about random subjects; ``--requests`` of them per temperature), in this process: the
same outputs as through HTTP, without a server. ``--suite open`` sends open objects (what
``response_format: json_object`` asks, and schemas that leave ``additionalProperties`` open),
which the model nests as deep as it likes: a fresh user's break test found them cut unparsed
at ``max_tokens``.

    .venv/bin/python benchmarks/structured_validity.py [--requests 2] [--max-tokens 512]
        [--suite fifty|bench-json|open]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import jsonschema
import torch

try:
    from benchmarks import common
except ImportError:  # run as a script: benchmarks/ is on sys.path, the repo root is not
    import common

S = {"type": "string"}
SHORT = {"type": "string", "maxLength": 40}
INT = {"type": "integer"}
NUM = {"type": "number"}
BOOL = {"type": "boolean"}


def obj(properties: dict[str, Any], required: list[str] | None = None, **extra) -> dict:
    """A closed object schema; every property required unless ``required`` says otherwise."""
    return {"type": "object", "properties": properties,
            "required": list(properties) if required is None else required,
            "additionalProperties": False, **extra}


def array(items: dict, low: int = 0, high: int | None = 5) -> dict:
    bounds = {"minItems": low} | ({"maxItems": high} if high is not None else {})
    return {"type": "array", "items": items, **bounds}


SCHEMAS: dict[str, dict[str, Any]] = {
    "person": obj({"name": SHORT, "age": {"type": "integer", "minimum": 0, "maximum": 130}}),
    "contact": obj({"name": SHORT, "email": {"type": "string", "format": "email"},
                    "phone": {"type": "string", "pattern": "^\\+?[0-9 -]{7,15}$"}}, ["name"]),
    "address": obj({"street": SHORT, "city": SHORT,
                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                    "country": {"type": "string", "minLength": 2, "maxLength": 2}}),
    "user_profile": obj({"username": {"type": "string", "pattern": "^[a-z0-9_]{3,16}$"},
                         "bio": SHORT, "followers": {"type": "integer", "minimum": 0},
                         "verified": BOOL}),
    "product": obj({"sku": SHORT, "name": SHORT, "price": {"type": "number", "minimum": 0},
                    "in_stock": BOOL, "tags": array(SHORT, 0, 4)}),
    "order": obj({"id": {"type": "string", "pattern": "^ORD-[0-9]{6}$"},
                  "items": array(obj({"sku": SHORT, "qty": {"type": "integer", "minimum": 1}}),
                                 1, 4),
                  "status": {"enum": ["pending", "paid", "shipped", "cancelled"]}}),
    "invoice": obj({"number": SHORT, "issued": {"type": "string", "format": "date"},
                    "lines": array(obj({"description": SHORT, "amount": NUM}), 1, 3),
                    "total": NUM, "currency": {"enum": ["USD", "EUR", "GBP"]}}),
    "event": obj({"title": SHORT, "start": {"type": "string", "format": "date-time"},
                  "end": {"type": "string", "format": "date-time"},
                  "location": {"anyOf": [SHORT, {"type": "null"}]}}),
    "meeting": obj({"topic": SHORT, "attendees": array(SHORT, 1, 5),
                    "duration_minutes": {"type": "integer", "minimum": 5, "maximum": 240}}),
    "task": obj({"title": SHORT, "done": BOOL,
                 "priority": {"enum": ["low", "medium", "high"]},
                 "due": {"type": "string", "format": "date"}}, ["title", "done"]),
    "todo_list": obj({"name": SHORT, "tasks": array(obj({"title": SHORT, "done": BOOL}), 0, 5)}),
    "weather": obj({"city": SHORT, "temperature_c": {"type": "number", "minimum": -90,
                                                     "maximum": 60},
                    "conditions": {"enum": ["sunny", "cloudy", "rain", "snow", "storm"]}}),
    "forecast": obj({"city": SHORT, "days": array(obj({
        "date": {"type": "string", "format": "date"}, "high": NUM, "low": NUM}), 1, 3)}),
    "book": obj({"title": SHORT, "authors": array(SHORT, 1, 3),
                 "isbn": {"type": "string", "pattern": "^[0-9]{13}$"},
                 "year": {"type": "integer", "minimum": 1450, "maximum": 2030}}),
    "movie": obj({"title": SHORT, "year": INT, "genres": array(
        {"enum": ["drama", "comedy", "action", "horror", "documentary"]}, 1, 3),
        "rating": {"type": "number", "minimum": 0, "maximum": 10}}),
    "recipe": obj({"name": SHORT, "servings": {"type": "integer", "minimum": 1},
                   "ingredients": array(obj({"item": SHORT, "grams": NUM}), 1, 5),
                   "steps": array(SHORT, 1, 5)}),
    "review": obj({"rating": {"type": "integer", "minimum": 1, "maximum": 5},
                   "title": SHORT, "body": {"type": "string", "maxLength": 120},
                   "recommend": BOOL}),
    "sentiment": obj({"label": {"enum": ["positive", "negative", "neutral"]},
                      "score": {"type": "number", "minimum": 0, "maximum": 1}}),
    "classification": obj({"category": {"enum": ["billing", "technical", "sales", "other"]},
                           "confidence": {"type": "number", "minimum": 0, "maximum": 1},
                           "reason": SHORT}),
    "entities": obj({"entities": array(obj({
        "text": SHORT, "type": {"enum": ["PERSON", "ORG", "PLACE", "DATE"]}}), 0, 5)}),
    "summary": obj({"summary": {"type": "string", "maxLength": 200},
                    "keywords": array(SHORT, 1, 5)}),
    "qa_pair": obj({"question": SHORT, "answer": SHORT}),
    "translation": obj({"source_lang": {"type": "string", "pattern": "^[a-z]{2}$"},
                        "target_lang": {"type": "string", "pattern": "^[a-z]{2}$"},
                        "text": SHORT}),
    "tool_call_weather": obj({"name": {"const": "get_weather"}, "arguments": obj({
        "city": SHORT, "unit": {"enum": ["celsius", "fahrenheit"]}}, ["city"])}),
    "tool_call_search": obj({"name": {"const": "search"}, "arguments": obj({
        "query": SHORT, "limit": {"type": "integer", "minimum": 1, "maximum": 20}}, ["query"])}),
    "tool_choice": {"oneOf": [
        obj({"tool": {"const": "calculator"}, "expression": SHORT}),
        obj({"tool": {"const": "clock"}, "timezone": SHORT})]},
    "agent_step": obj({"thought": SHORT, "action": {"enum": ["search", "answer", "ask"]},
                       "input": SHORT}),
    "plan": obj({"goal": SHORT, "steps": array(obj({"n": {"type": "integer", "minimum": 1},
                                                    "do": SHORT}), 1, 4)}),
    "api_error": obj({"error": obj({"code": {"type": "integer", "minimum": 100,
                                             "maximum": 599},
                                    "message": SHORT})}),
    "http_request": obj({"method": {"enum": ["GET", "POST", "PUT", "DELETE"]},
                         "url": {"type": "string", "format": "uri"},
                         "headers": array(obj({"name": SHORT, "value": SHORT}), 0, 3)}),
    "server_config": obj({"host": {"type": "string", "format": "hostname"},
                          "port": {"type": "integer", "minimum": 1, "maximum": 65535},
                          "tls": BOOL, "workers": {"type": "integer", "minimum": 1}}),
    "network": obj({"ip": {"type": "string", "format": "ipv4"},
                    "mask": {"type": "integer", "minimum": 0, "maximum": 32}}),
    "log_entry": obj({"timestamp": {"type": "string", "format": "date-time"},
                      "level": {"enum": ["DEBUG", "INFO", "WARN", "ERROR"]},
                      "message": SHORT}),
    "metric": obj({"name": {"type": "string", "pattern": "^[a-z_][a-z0-9_]*$"},
                   "value": NUM, "labels": array(obj({"key": SHORT, "value": SHORT}), 0, 3)}),
    "uuid_record": obj({"id": {"type": "string", "format": "uuid"}, "label": SHORT}),
    "color": obj({"name": SHORT, "hex": {"type": "string", "pattern": "^#[0-9a-fA-F]{6}$"}}),
    "coordinates": obj({"lat": {"type": "number", "minimum": -90, "maximum": 90},
                        "lon": {"type": "number", "minimum": -180, "maximum": 180}}),
    "company": obj({"name": SHORT, "founded": {"type": "integer", "minimum": 1800},
                    "address": obj({"city": SHORT, "country": SHORT}),
                    "employees": {"type": "integer", "minimum": 1}}),
    "employee": obj({"name": SHORT, "title": SHORT,
                     "manager": {"anyOf": [SHORT, {"type": "null"}]},
                     "skills": array(SHORT, 0, 5)}),
    "student_grades": obj({"student": SHORT, "grades": array(obj({
        "course": SHORT, "grade": {"enum": ["A", "B", "C", "D", "F"]}}), 1, 4)}),
    "flight": obj({"number": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2,4}$"},
                   "from": {"type": "string", "pattern": "^[A-Z]{3}$"},
                   "to": {"type": "string", "pattern": "^[A-Z]{3}$"},
                   "departure": {"type": "string", "format": "date-time"}}),
    "hotel_booking": obj({"guest": SHORT, "nights": {"type": "integer", "minimum": 1,
                                                     "maximum": 30},
                          "room": {"enum": ["single", "double", "suite"]},
                          "breakfast": BOOL}),
    "quiz": obj({"question": SHORT, "options": array(SHORT, 2, 4),
                 "answer_index": {"type": "integer", "minimum": 0, "maximum": 3}}),
    "nested_optional": obj({"a": obj({"b": obj({"c": SHORT}, [])}, []), "d": INT}, ["d"]),
    "tree": {"$ref": "#/$defs/node", "$defs": {"node": obj({
        "value": SHORT, "children": array({"$ref": "#/$defs/node"}, 0, 2)})}},
    "linked_defs": {"$defs": {"money": obj({"amount": NUM, "currency": SHORT})},
                    **obj({"price": {"$ref": "#/$defs/money"},
                           "discount": {"anyOf": [{"$ref": "#/$defs/money"},
                                                  {"type": "null"}]}})},
    "matrix": obj({"rows": array(array(INT, 1, 3), 1, 3)}),
    "key_value_open": {"type": "object", "additionalProperties": {"type": "integer"},
                       "maxProperties": 4},
    "any_json_object": {"type": "object"},
    "top_level_array": array(obj({"id": INT, "name": SHORT}), 1, 3),
}


OPEN_SCHEMAS: dict[str, dict[str, Any]] = {
    "any_object": {"type": "object"},  # response_format json_object
    "open_string": {"type": "object", "properties": {"d": S}, "required": ["d"]},
    "open_nested": {"type": "object", "properties": {"d": {"type": "object"}},
                    "required": ["d"]},
    "open_pet": {"type": "object", "properties": {
        "name": S, "species": S, "traits": {"type": "object"}, "tags": {"type": "array"}},
        "required": ["name", "species", "traits"]},
}
"""Open objects: any property may be added, and any value nested in it."""

OPEN_SUBJECTS = ("a pet", "a city", "a software project", "a recipe")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=2, help="per schema and temperature")
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--suite", choices=("fifty", "bench-json", "open"), default="fifty")
    parser.add_argument("--out", default=str(common.OUT_DIR / "structured_validity.json"))
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from contract.request import GenerationRequest, SamplingParams, StructuredOutput
    from workers.config import EngineConfig
    from workers.engine import LLMEngine
    from workers.structured.grammar import GrammarCompiler

    engine = LLMEngine(EngineConfig(quantization="gguf", num_threads=args.threads,
                                    kv_cache_bytes=512 << 20))
    tokenizer = engine.tokenizer
    compiler = GrammarCompiler(tokenizer, engine.vocab_size)  # its own: no cache shared
    suites = {"fifty": _fifty_cases, "bench-json": _bench_json_cases, "open": _open_cases}
    schemas, cases = suites[args.suite](args.requests)
    compile_s, requests = {}, []
    for name, schema in schemas.items():
        started = time.perf_counter()
        compiler.compile(StructuredOutput("json", json.dumps(schema)))
        compile_s[name] = time.perf_counter() - started
    for case, (name, content, temperature, seed) in enumerate(cases):
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True,
            tokenize=True, return_dict=True)["input_ids"]
        sampling = SamplingParams(
            temperature=temperature, seed=seed, max_tokens=args.max_tokens,
            structured=StructuredOutput("json", json.dumps(schemas[name])))
        requests.append(GenerationRequest(f"{name}|{temperature}|{case}", prompt, sampling))
    rows = []
    for start in range(0, len(requests), 16):
        batch = requests[start:start + 16]
        for request_id, chunks in engine.generate(batch).items():
            name, temperature, _ = request_id.split("|")
            rows.append(check(schemas[name], name, float(temperature), chunks))
        common.log(f"{len(rows)}/{len(requests)}: {sum(r['valid'] for r in rows)} valid")
    valid = sum(r["valid"] for r in rows)
    goals = [common.goal("valid_share", valid / len(rows), 1.0)]
    common.log_goals(goals)
    result = {"benchmark": "structured_validity", "machine": common.machine_info(),
              "argv": sys.argv, "schemas": len(schemas), "outputs": len(rows), "valid": valid,
              "compile_s": compile_s, "failures": [r for r in rows if not r["valid"]],
              "finish_reasons": {reason: sum(r["finish_reason"] == reason for r in rows)
                                 for reason in ("stop", "length")},
              "closed_within_budget": [r for r in rows
                                       if r["valid"] and r["finish_reason"] == "length"],
              "goals": goals}
    common.write_json(result, args.out)
    return result


def _fifty_cases(requests: int) -> tuple[dict[str, dict], list[tuple[str, str, float, int]]]:
    """:data:`SCHEMAS`, and ``requests`` cases of each per temperature: (schema name, user
    message, temperature, seed)."""
    return SCHEMAS, [
        (name, f"Give one realistic example of a {name.replace('_', ' ')} as JSON.",
         temperature, i)
        for name in SCHEMAS for temperature in (0.0, 1.0) for i in range(requests)]


def _open_cases(requests: int) -> tuple[dict[str, dict], list[tuple[str, str, float, int]]]:
    """:data:`OPEN_SCHEMAS`, and ``requests`` cases of each per temperature and subject of
    :data:`OPEN_SUBJECTS`, as :func:`_fifty_cases` gives them."""
    return OPEN_SCHEMAS, [
        (name, f"Describe {subject} as JSON.", temperature, i)
        for name in OPEN_SCHEMAS for subject in OPEN_SUBJECTS for temperature in (0.0, 0.7)
        for i in range(requests)]


def _bench_json_cases(requests: int) -> tuple[dict[str, dict],
                                              list[tuple[str, str, float, int]]]:
    """``nalar bench --workload json``'s schemas, and its first ``requests`` requests at each
    temperature, as :func:`_fifty_cases` gives them."""
    from bench.workloads.config import WorkloadConfig
    from bench.workloads.json_schema import SCHEMAS as BENCH_SCHEMAS
    from bench.workloads.json_schema import json_sessions

    sessions = json_sessions(WorkloadConfig(name="json"))
    firsts = [next(sessions).request for _ in range(requests)]
    return BENCH_SCHEMAS, [
        (request.response_format["json_schema"]["name"], request.messages[0]["content"],
         temperature, i)
        for temperature in (0.0, 1.0) for i, request in enumerate(firsts)]


def check(schema: dict, name: str, temperature: float, chunks: list) -> dict[str, Any]:
    """Whether one output parses and validates against ``schema`` (formats checked); one
    that ends with ``length`` and is valid was closed early within its budget."""
    text = "".join(chunk.text for chunk in chunks)
    row = {"schema": name, "temperature": temperature, "finish_reason": chunks[-1].finish_reason,
           "tokens": sum(len(chunk.token_ids) for chunk in chunks), "valid": False}
    try:
        jsonschema.validate(json.loads(text), schema, format_checker=jsonschema.FormatChecker())
        row["valid"] = True
        if row["finish_reason"] == "length":
            row["text"] = text[-120:]
    except (json.JSONDecodeError, jsonschema.ValidationError) as exc:
        row["error"] = str(exc)[:200]
        row["text"] = text[:300]
    return row


if __name__ == "__main__":
    main()
