"""What a structured-output constraint costs a decode step: 16 concurrent requests under a
JSON Schema against the same requests unconstrained, on one engine in this process (the
embedded model, its defaults: Q4_1 weights as stored, ``--dtype auto``), rounds alternating.

Each request is a distinct chat prompt asking for JSON; 64 output tokens, greedy. The schema
(an object holding at least 40 free strings) keeps the output going to ``max_tokens``, so both
kinds decode as many tokens; unconstrained rows ignore EOS for the same reason. The step time
counted is that of steps where all 16 rows decode (no prefill in the step): the TPOT of a
full batch. Each constrained step also computes 16 masks (llguidance) and applies them in the
sampler; the per-mask time is reported apart.

Goal (issue 20): constrained TPOT at most 1.10× unconstrained, taken as the median round's
ratio (single rounds on a 2-core VM vary by ±20%; every round is in the JSON).

``--speculation`` measures instead what ``ngram`` speculation gains on JSON output: the same
``--concurrency`` requests under a natural schema (an order: an id pattern, a bounded array of
objects, an enum), greedy, 256 tokens at most, on an engine with speculation and one without,
rounds alternating. Decode tokens/s counts the output after each request's first token, over
the steps after the first. The outputs must be equal token for token. Goal: at least 1.5×.

``--masks`` measures where a step's masks are computed: in the engine's thread (``inline``)
or on a helper thread beside the forward pass (``beside``, ``workers/structured/step_masks.py``),
forced each way in alternating rounds, on three workloads: 16 order-schema requests, 16 of the
40-strings schema (64 tokens), and 4 order-schema requests under ``ngram`` speculation. Outputs
must be equal; decode tokens/s as ``--speculation`` counts them. Run it at ``--threads 1`` on a
2-core machine (a core free beside the forward pass) and at ``--threads 2`` (none free).

    .venv/bin/python benchmarks/structured.py [--rounds 3] [--threads 2]
    .venv/bin/python benchmarks/structured.py --speculation [--concurrency 4]
    .venv/bin/python benchmarks/structured.py --masks [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import torch

try:
    from benchmarks import common
except ImportError:  # run as a script: benchmarks/ is on sys.path, the repo root is not
    import common

SCHEMA = {"type": "object", "properties": {
    "items": {"type": "array", "items": {"type": "string"}, "minItems": 40}},
    "required": ["items"], "additionalProperties": False}
ORDER = {"type": "object", "properties": {
    "id": {"type": "string", "pattern": "^ORD-[0-9]{6}$"},
    "items": {"type": "array", "minItems": 1, "maxItems": 4, "items": {
        "type": "object", "properties": {
            "sku": {"type": "string", "maxLength": 12},
            "quantity": {"type": "integer", "minimum": 1},
            "price": {"type": "number"}},
        "required": ["sku", "quantity", "price"], "additionalProperties": False}},
    "status": {"enum": ["pending", "paid", "shipped"]}},
    "required": ["id", "items", "status"], "additionalProperties": False}
TOPICS = ["fruits", "rivers", "cities", "colors", "tools", "birds", "planets", "metals",
          "games", "trees", "fish", "books", "songs", "cars", "flowers", "dances"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--speculation", action="store_true",
                        help="measure ngram speculation on JSON output instead")
    parser.add_argument("--concurrency", type=int, default=4, help="--speculation's requests")
    parser.add_argument("--masks", action="store_true",
                        help="measure masks computed beside the forward pass instead")
    parser.add_argument("--out", default=str(common.OUT_DIR / "structured.json"))
    return parser.parse_args(argv)


def requests(tokenizer, constrained: bool, output_tokens: int, tag: str,
             schema: dict = SCHEMA, count: int = len(TOPICS)) -> list:
    from contract.request import GenerationRequest, SamplingParams, StructuredOutput

    structured = StructuredOutput("json", json.dumps(schema)) if constrained else None
    batch = []
    for i, topic in enumerate(TOPICS[:count]):
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": f"List many {topic} as a JSON object."}],
            add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
        sampling = SamplingParams(temperature=0.0, max_tokens=output_tokens,
                                  ignore_eos=not constrained, structured=structured)
        batch.append(GenerationRequest(f"{tag}-{i}", prompt, sampling))
    return batch


def run(engine, batch: list) -> dict[str, Any]:
    """Serve ``batch`` to the end; the step seconds of steps where every row decodes."""
    for request in batch:
        engine.add_request(request)
    full_steps, outputs = [], {r.request_id: 0 for r in batch}
    while engine.has_work():
        decoding = (len(engine.scheduler.running) == len(batch)
                    and all(seq.num_uncomputed_tokens == 1 for seq in engine.scheduler.running))
        started = time.perf_counter()
        chunks = engine.step()
        if decoding:
            full_steps.append(time.perf_counter() - started)
        for chunk in chunks:
            outputs[chunk.request_id] += len(chunk.token_ids)
    return {"step_ms_median": 1000 * statistics.median(full_steps),
            "full_steps": len(full_steps), "output_tokens": sum(outputs.values())}


def build_engine(threads: int, speculation: str = "off"):
    """The engine every mode measures: the embedded model, Q4_1 as stored, ``--dtype auto``,
    a 256 MiB KV cache, ``speculation`` (``off`` or a proposer's name)."""
    from workers.config import EngineConfig
    from workers.engine import LLMEngine
    from workers.speculative.config import SpeculativeConfig

    return LLMEngine(EngineConfig(quantization="gguf", num_threads=threads,
                                  kv_cache_bytes=256 << 20,
                                  speculative=SpeculativeConfig(method=speculation)))


def decode_rate(engine, batch: list) -> dict[str, Any]:
    """Serve ``batch`` to the end; decode tokens/s after the first step, and the outputs."""
    for request in batch:
        engine.add_request(request)
    outputs: dict[str, list[int]] = {r.request_id.split("-", 1)[1]: [] for r in batch}
    decode_s, first = 0.0, True
    while engine.has_work():
        started = time.perf_counter()
        chunks = engine.step()
        if not first:
            decode_s += time.perf_counter() - started
        first = False
        for chunk in chunks:
            outputs[chunk.request_id.split("-", 1)[1]] += chunk.token_ids
    decoded = sum(len(tokens) - 1 for tokens in outputs.values())
    return {"decode_tok_s": decoded / decode_s, "output_tokens": decoded + len(outputs),
            "outputs": outputs}


def speculation(args: argparse.Namespace) -> dict[str, Any]:
    """The ``--speculation`` rounds (module docstring)."""
    engines = {"plain": build_engine(args.threads),
               "ngram": build_engine(args.threads, "ngram")}
    rounds = []
    for index in range(args.rounds):
        entry: dict[str, Any] = {"round": index + 1}
        for kind in (("plain", "ngram") if index % 2 == 0 else ("ngram", "plain")):
            engines[kind].reset_prefix_cache()
            batch = requests(engines[kind].tokenizer, True, 256, f"{kind}{index}", ORDER,
                             args.concurrency)
            entry[kind] = decode_rate(engines[kind], batch)
            common.log(f"round {index + 1} {kind}: {entry[kind]['decode_tok_s']:.1f} tok/s")
        entry["equal_outputs"] = entry["plain"].pop("outputs") == entry["ngram"].pop("outputs")
        entry["ratio"] = common.ratio(entry["ngram"]["decode_tok_s"],
                                      entry["plain"]["decode_tok_s"])
        rounds.append(entry)
    spec = engines["ngram"].counters.spec
    goals = [common.goal("ngram_over_plain_json_decode_tok_s_median_round",
                         statistics.median(r["ratio"] for r in rounds), 1.5)]
    common.log_goals(goals)
    return {"benchmark": "structured_speculation", "concurrency": args.concurrency,
            "schema": ORDER, "acceptance_rate": spec.accepted_tokens / spec.proposed_tokens,
            "rounds": rounds, "goals": goals}


def masks_beside(args: argparse.Namespace) -> dict[str, Any]:
    """The ``--masks`` rounds (module docstring)."""
    plain, ngram = build_engine(args.threads), build_engine(args.threads, "ngram")
    workloads = {"order_c16": (plain, ORDER, 16, 256), "strings_c16": (plain, SCHEMA, 16, 64),
                 "order_c4_ngram": (ngram, ORDER, 4, 256)}
    rounds, outputs = [], {}
    for index in range(args.rounds):
        for where in (("inline", "beside") if index % 2 == 0 else ("beside", "inline")):
            entry = {"round": index + 1, "masks": where}
            for name, (eng, schema, concurrency, max_tokens) in workloads.items():
                eng.step_masks.beside = where == "beside"
                eng.reset_prefix_cache()
                batch = requests(eng.tokenizer, True, max_tokens, f"{name}{where}{index}",
                                 schema, concurrency)
                result = decode_rate(eng, batch)
                if outputs.setdefault(name, result["outputs"]) != result["outputs"]:
                    raise AssertionError(f"{name}: outputs differ with masks {where}")
                entry[name] = result["decode_tok_s"]
            common.log(f"round {index + 1} masks {where}: "
                       + ", ".join(f"{n} {entry[n]:.1f}" for n in workloads) + " tok/s")
            rounds.append(entry)
    ratios = {name: common.ratio(
        statistics.median(r[name] for r in rounds if r["masks"] == "beside"),
        statistics.median(r[name] for r in rounds if r["masks"] == "inline"))
        for name in workloads}
    common.log(f"beside / inline, medians: {ratios}")
    return {"benchmark": "structured_masks_beside", "ratios": ratios, "rounds": rounds}


def mask_us(engine, tokenizer) -> float:
    """Median microseconds of one constrained row's mask (compute and unpack) at the start."""
    from contract.request import StructuredOutput

    matcher = engine.grammars.matcher(StructuredOutput("json", json.dumps(SCHEMA)))
    times = []
    for _ in range(200):
        started = time.perf_counter()
        matcher.allowed(1 << 30)
        times.append(time.perf_counter() - started)
    return 1e6 * statistics.median(times)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.speculation or args.masks:
        result = {**(speculation(args) if args.speculation else masks_beside(args)),
                  "machine": common.machine_info(), "argv": sys.argv, "threads": args.threads}
        common.write_json(result, args.out)
        return result
    engine = build_engine(args.threads)
    tokenizer = engine.tokenizer
    run(engine, requests(tokenizer, False, 8, "warmup"))
    rounds = []
    for index in range(args.rounds):
        entry: dict[str, Any] = {"round": index + 1}
        order = ("free", "json") if index % 2 == 0 else ("json", "free")
        for kind in order:
            engine.reset_prefix_cache()  # each kind prefills its prompts afresh
            entry[kind] = run(engine, requests(tokenizer, kind == "json", args.output_tokens,
                                               f"{kind}{index}"))
            common.log(f"round {index + 1} {kind}: {entry[kind]}")
        entry["ratio"] = common.ratio(entry["json"]["step_ms_median"],
                                      entry["free"]["step_ms_median"])
        rounds.append(entry)
    ratios = sorted(r["ratio"] for r in rounds)
    goals = [common.goal("json_over_free_tpot_median_round", statistics.median(ratios), 1.10,
                         at_least=False)]
    common.log_goals(goals)
    result = {"benchmark": "structured", "machine": common.machine_info(engine.loaded.dtype),
              "argv": sys.argv, "threads": args.threads, "schema": SCHEMA,
              "mask_us_median": mask_us(engine, tokenizer), "rounds": rounds, "goals": goals}
    common.write_json(result, args.out)
    return result


if __name__ == "__main__":
    main()
