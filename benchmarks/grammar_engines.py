"""Which grammar engine constrained decoding should build on: xgrammar, llguidance and
outlines-core on the embedded SmolLM2's 49,152-token vocabulary, measured in one process.

For each JSON schema of a small suite (nesting, enums, bounded arrays, optional fields,
``anyOf``, string formats and patterns) and each engine:
- compile: seconds from the schema text to a matcher ready for its first mask, cold (no
  cache shared across schemas or engines);
- mask: seconds to compute the next-token mask, per token, walking a valid instance of the
  schema as the tokenizer splits it (the walk also checks that the engine accepts every
  token of it, and accepts the end there);
- rollback: whether the matcher can step back over tokens (speculative decoding rejects draft
  tokens), checked by rolling back 3 tokens and accepting them again.

One thread. Writes JSON (``--out``); the decision it informs is in docs/design-decisions.md.

    .venv/bin/python benchmarks/grammar_engines.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

try:
    from benchmarks import common
except ImportError:  # run as a script: benchmarks/ is on sys.path, the repo root is not
    import common

ROLLBACK_TOKENS = 3

SUITE: dict[str, tuple[dict[str, Any], Any]] = {
    "person": ({"type": "object", "properties": {
        "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string", "format": "email"}},
        "required": ["name", "age"], "additionalProperties": False},
        {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org"}),
    "order": ({"type": "object", "properties": {
        "id": {"type": "string", "pattern": "^ORD-[0-9]{6}$"},
        "items": {"type": "array", "minItems": 1, "maxItems": 5, "items": {
            "type": "object", "properties": {
                "sku": {"type": "string"}, "quantity": {"type": "integer", "minimum": 1},
                "price": {"type": "number"}},
            "required": ["sku", "quantity", "price"], "additionalProperties": False}},
        "status": {"enum": ["pending", "paid", "shipped"]}},
        "required": ["id", "items", "status"], "additionalProperties": False},
        {"id": "ORD-004211", "items": [{"sku": "A-1", "quantity": 2, "price": 9.5},
                                       {"sku": "B-22", "quantity": 1, "price": 120.0}],
         "status": "paid"}),
    "event": ({"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 80},
        "start": {"type": "string", "format": "date-time"},
        "attendees": {"type": "array", "items": {"type": "string"}, "maxItems": 10},
        "location": {"anyOf": [{"type": "string"}, {"type": "null"}]}},
        "required": ["title", "start", "attendees", "location"],
        "additionalProperties": False},
        {"title": "Design review", "start": "2026-12-03T10:00:00Z",
         "attendees": ["kim", "lee"], "location": None}),
    "tool_call": ({"type": "object", "properties": {
        "name": {"const": "get_weather"},
        "arguments": {"type": "object", "properties": {
            "city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city"], "additionalProperties": False}},
        "required": ["name", "arguments"], "additionalProperties": False},
        {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}),
    "nested": ({"type": "object", "properties": {
        "company": {"type": "object", "properties": {
            "name": {"type": "string"},
            "address": {"type": "object", "properties": {
                "street": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                "country": {"type": "string", "minLength": 2, "maxLength": 2}},
                "required": ["street", "zip", "country"], "additionalProperties": False},
            "employees": {"type": "integer"}},
            "required": ["name", "address"], "additionalProperties": False}},
        "required": ["company"], "additionalProperties": False},
        {"company": {"name": "Acme", "address": {"street": "1 Main St", "zip": "94105",
                                                  "country": "US"}, "employees": 12}}),
    "review": ({"type": "object", "properties": {
        "rating": {"type": "integer", "minimum": 1, "maximum": 5},
        "pros": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 3},
        "cons": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
        "verdict": {"type": "string"}, "recommend": {"type": "boolean"}},
        "required": ["rating", "pros", "verdict", "recommend"], "additionalProperties": False},
        {"rating": 4, "pros": ["fast", "quiet"], "cons": [], "verdict": "Good value.",
         "recommend": True}),
}


@dataclass
class Engine:
    """One engine's operations on the suite's schemas."""

    name: str
    compile: Callable[[str], Any]           # schema text -> matcher, ready for a mask
    fill: Callable[[Any], None]             # write the next token's mask into ``bitmask``
    bitmask: torch.Tensor                   # [1, ceil(V / 32)] int32, bit set: allowed
    accept: Callable[[Any, int], bool]      # consume one token; False if rejected
    accepts_end: Callable[[Any], bool]      # may it stop (EOS) here
    rollback: Callable[[Any, int], None] | None


def _xgrammar(tokenizer, vocab_size: int) -> Engine:
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
    bitmask = xgr.allocate_token_bitmask(1, vocab_size)

    def compile_(schema: str):
        compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return xgr.GrammarMatcher(compiler.compile_json_schema(schema))

    return Engine("xgrammar", compile_, lambda m: m.fill_next_token_bitmask(bitmask, 0),
                  bitmask, lambda m, t: m.accept_token(t),
                  lambda m: m.is_terminated() or m.accept_token(tokenizer.eos_token_id),
                  lambda m, n: m.rollback(n))


def _llguidance(tokenizer, vocab_size: int) -> Engine:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    lltokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
    bitmask = llguidance.torch.allocate_token_bitmask(1, vocab_size)

    def compile_(schema: str):
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
        matcher = llguidance.LLMatcher(lltokenizer, grammar)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def accept(matcher, token: int) -> bool:
        return matcher.consume_token(token) and not matcher.is_error()

    return Engine("llguidance", compile_,
                  lambda m: llguidance.torch.fill_next_token_bitmask(m, bitmask, 0), bitmask,
                  accept, lambda m: m.is_accepting(),
                  lambda m, n: m.rollback(n))


def _outlines_core(tokenizer, vocab_size: int) -> Engine:
    from outlines_core import Guide, Index, Vocabulary, json_schema
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    # byte-level BPE: each token's text is its bytes, one printable character per byte
    to_byte = {char: byte for byte, char in bytes_to_unicode().items()}
    special = set(tokenizer.all_special_ids)
    tokens: dict[bytes, list[int]] = {}
    for text, token_id in tokenizer.get_vocab().items():
        if token_id not in special:
            tokens.setdefault(bytes(to_byte[c] for c in text), []).append(token_id)
    vocabulary = Vocabulary(tokenizer.eos_token_id, tokens)

    def compile_(schema: str):
        return Guide(Index(json_schema.build_regex_from_schema(schema), vocabulary))

    bitmask = torch.zeros(1, (vocab_size + 31) // 32, dtype=torch.int32)

    def fill(guide) -> None:
        guide.write_mask_into(bitmask.data_ptr(), bitmask.numel(), bitmask.element_size())

    def accept(guide, token: int) -> bool:
        if not guide.accepts_tokens([token]):
            return False
        guide.advance(token)
        return True

    return Engine("outlines-core", compile_, fill, bitmask, accept,
                  lambda g: tokenizer.eos_token_id in g.get_tokens(),
                  lambda g, n: g.rollback_state(n))


def _unpack(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """A ``[ceil(V/32)]`` int32 bitmask as ``[V]`` bool (bit ``i % 32`` of word ``i // 32``)."""
    bits = (words.unsqueeze(1).to(torch.int64) >> torch.arange(32)) & 1
    return bits.flatten()[:vocab_size].bool()


def walk(engine: Engine, schema: str, token_ids: list[int]) -> dict[str, Any]:
    """Compile, then mask and accept every token of a valid instance; check the end and a
    rollback. Raises AssertionError if the engine rejects the instance."""
    started = time.perf_counter()
    matcher = engine.compile(schema)
    compile_s = time.perf_counter() - started
    mask_s = []
    for position, token in enumerate(token_ids):
        started = time.perf_counter()
        engine.fill(matcher)
        mask_s.append(time.perf_counter() - started)
        allowed = _unpack(engine.bitmask[0], len(engine.bitmask[0]) * 32)
        assert allowed[token], f"{engine.name}: token {position} ({token}) masked out"
        assert engine.accept(matcher, token), f"{engine.name}: token {position} rejected"
    assert engine.accepts_end(matcher), f"{engine.name}: may not stop after the instance"
    rollback_ok = False
    if engine.rollback is not None:  # step back over the last tokens and take them again
        fresh = engine.compile(schema)
        for token in token_ids:
            engine.accept(fresh, token)
        engine.rollback(fresh, ROLLBACK_TOKENS)
        rollback_ok = (all(engine.accept(fresh, t) for t in token_ids[-ROLLBACK_TOKENS:])
                       and engine.accepts_end(fresh))
    return {"compile_s": compile_s, "mask_p50_us": 1e6 * statistics.median(mask_s),
            "mask_p99_us": 1e6 * sorted(mask_s)[int(0.99 * (len(mask_s) - 1))],
            "mask_max_us": 1e6 * max(mask_s), "tokens": len(token_ids),
            "rollback": rollback_ok}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="walks per schema and engine")
    parser.add_argument("--out", default=str(common.OUT_DIR / "grammar_engines.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    from workers.model_source import load_tokenizer

    tokenizer = load_tokenizer("embedded")
    vocab_size = len(tokenizer)
    engines = [build(tokenizer, vocab_size) for build in (_xgrammar, _llguidance, _outlines_core)]
    rows = []
    for name, (schema, instance) in SUITE.items():
        text = json.dumps(schema)
        token_ids = tokenizer.encode(json.dumps(instance), add_special_tokens=False)
        for repeat in range(args.repeats):
            for engine in engines[repeat % 3:] + engines[:repeat % 3]:  # each leads in turn
                try:
                    row = walk(engine, text, token_ids)
                except (AssertionError, ValueError, RuntimeError) as exc:
                    row = {"error": f"{type(exc).__name__}: {exc}"[:300]}
                rows.append({"schema": name, "engine": engine.name, "repeat": repeat, **row})
                common.log(f"{name} {engine.name}: {row}")
    result = {"benchmark": "grammar_engines", "machine": common.machine_info(),
              "argv": sys.argv, "vocab_size": vocab_size, "rows": rows,
              "summary": summarize(rows, [e.name for e in engines])}
    common.write_json(result, Path(args.out))
    return result


def summarize(rows: list[dict[str, Any]], engines: list[str]) -> dict[str, Any]:
    """Per engine: median compile seconds and mask microseconds over the suite, the schemas
    it failed, and whether rollback worked everywhere."""
    summary = {}
    for engine in engines:
        ok = [r for r in rows if r["engine"] == engine and "error" not in r]
        summary[engine] = {
            "compile_s_median": statistics.median(r["compile_s"] for r in ok) if ok else None,
            "compile_s_max": max((r["compile_s"] for r in ok), default=None),
            "mask_p50_us_median": statistics.median(r["mask_p50_us"] for r in ok) if ok else None,
            "mask_p99_us_max": max((r["mask_p99_us"] for r in ok), default=None),
            "failed": sorted({r["schema"] for r in rows
                              if r["engine"] == engine and "error" in r}),
            "rollback": bool(ok) and all(r["rollback"] for r in ok)}
    return summary


if __name__ == "__main__":
    main()
