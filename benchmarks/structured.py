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

    .venv/bin/python benchmarks/structured.py [--rounds 3] [--threads 2]
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
TOPICS = ["fruits", "rivers", "cities", "colors", "tools", "birds", "planets", "metals",
          "games", "trees", "fish", "books", "songs", "cars", "flowers", "dances"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--out", default=str(common.OUT_DIR / "structured.json"))
    return parser.parse_args(argv)


def requests(tokenizer, constrained: bool, output_tokens: int, tag: str) -> list:
    from contract.request import GenerationRequest, SamplingParams, StructuredOutput

    structured = StructuredOutput("json", json.dumps(SCHEMA)) if constrained else None
    batch = []
    for i, topic in enumerate(TOPICS):
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


def mask_us(engine, tokenizer) -> float:
    """Median microseconds of one constrained row's mask (compute and unpack) at the start."""
    from contract.request import StructuredOutput

    matcher = engine.grammars.matcher(StructuredOutput("json", json.dumps(SCHEMA)))
    times = []
    for _ in range(200):
        started = time.perf_counter()
        matcher.allowed()
        times.append(time.perf_counter() - started)
    return 1e6 * statistics.median(times)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from workers.config import EngineConfig
    from workers.engine import LLMEngine

    engine = LLMEngine(EngineConfig(quantization="gguf", num_threads=args.threads,
                                    kv_cache_bytes=256 << 20))
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
