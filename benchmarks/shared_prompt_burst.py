"""Requests that share a prompt nobody has cached yet, arriving together: what the engine
computes for them and how long their first tokens take, on one engine in this process.

Two cases, on the embedded model with its defaults (Q4_1 weights as stored, ``--dtype auto``):

- ``burst``: 8 streams decode (distinct 128-token prompts, 192 output tokens each); once they
  are decoding, 8 requests arrive in one step, each a new 1,024-token system prompt they all
  share plus its own 32-token question, 16 output tokens. Reported: prompt tokens computed for
  the burst, its TTFT p50 and maximum, and the decoding streams' inter-token latency p99 while
  it is served.
- ``n``: one request with ``n=4`` sampled choices of a new 1,024-token prompt, 16 tokens each:
  prompt tokens computed and the time to each choice's first token.

Both depend on whether the scheduler makes a request wait for a block another running prompt
is computing (``workers.scheduler``); to compare commits, run this script with the library of
each on ``PYTHONPATH``.

    .venv/bin/python benchmarks/shared_prompt_burst.py [--rounds 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from typing import Any

try:
    from benchmarks import common
except ImportError:  # run as a script: benchmarks/ is on sys.path, the repo root is not
    import common

BACKGROUND = 8
BURST = 8
CHOICES = 4


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common.add_common_args(parser, "shared_prompt_burst")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prefix-tokens", type=int, default=1024)
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.prefix_tokens = 1, 64
    return args


def burst(engine, prompts: list[list[int]], prefix: list[int], tag: str) -> dict[str, Any]:
    """The ``burst`` case: background streams, then the burst added in one step."""
    run = common.EngineRun(engine)
    for i in range(BACKGROUND):
        run.add(common.greedy_request(f"{tag}-bg{i}", prompts[i][:128], 192))
    burst_ids = [f"{tag}-burst{i}" for i in range(BURST)]
    prefill_before: list[int] = []  # the prompt tokens computed once the burst arrives

    def add_burst(current: common.EngineRun) -> None:
        if not prefill_before and len(current.steps) == 3:  # the streams are decoding
            prefill_before.append(engine.counters.prefill_tokens)
            for i, request_id in enumerate(burst_ids):
                question = prompts[BACKGROUND + i][:32]
                current.add(common.greedy_request(request_id, prefix + question, 16))

    run.run(add_burst)
    served_until = max(run.arrivals[rid][-1] for rid in burst_ids)
    start = min(run.submitted[rid] for rid in burst_ids)
    background_gaps = [gap for i in range(BACKGROUND)
                       for gap, at in zip(common.gaps(run.arrivals[f"{tag}-bg{i}"]),
                                          run.arrivals[f"{tag}-bg{i}"][1:], strict=True)
                       if start <= at <= served_until]
    ttfts = [run.ttft_s(rid) for rid in burst_ids]
    return {"burst_prompt_tokens_computed": engine.counters.prefill_tokens - prefill_before[0],
            "burst_cached_tokens": sum(run.cached_tokens[rid] for rid in burst_ids),
            "burst_ttft_p50_ms": 1000 * statistics.median(ttfts),
            "burst_ttft_max_ms": 1000 * max(ttfts),
            "background_itl_p99_ms_during_burst": 1000 * common.percentile(background_gaps, 99)}


def choices(engine, prompt: list[int], tag: str) -> dict[str, Any]:
    """The ``n`` case: one request with :data:`CHOICES` sampled choices."""
    from contract.request import GenerationRequest, SamplingParams

    run = common.EngineRun(engine)
    before = engine.counters.prefill_tokens
    run.add(GenerationRequest(f"{tag}-n", prompt, SamplingParams(
        temperature=0.8, seed=1, n=CHOICES, max_tokens=16, ignore_eos=True)))
    run.run()
    # every choice's chunks come under the request's id: its first CHOICES tokens are the
    # choices' first tokens (each choice's first step yields one token)
    firsts = run.arrivals[f"{tag}-n"][:CHOICES]
    started = run.submitted[f"{tag}-n"]
    return {"n_prompt_tokens_computed": engine.counters.prefill_tokens - before,
            "n_first_token_ms": [round(1000 * (t - started), 1) for t in firsts]}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    common.set_threads(args.threads)
    from workers.config import EngineConfig
    from workers.engine import LLMEngine

    engine = LLMEngine(EngineConfig(quantization="gguf", num_threads=args.threads,
                                    kv_cache_bytes=args.kv_cache_mib << 20))
    tokenizer = engine.tokenizer
    prompts = common.text_prompts(tokenizer, BACKGROUND + BURST, 128)
    rounds = []
    for index in range(args.rounds):
        engine.reset_prefix_cache()
        prefixes = common.text_prompts(tokenizer, 2, args.prefix_tokens,
                                       offset=(BACKGROUND + BURST) * 128
                                       + 2 * index * args.prefix_tokens)
        entry = {"round": index + 1, **burst(engine, prompts, prefixes[0], f"r{index}"),
                 **choices(engine, prefixes[1], f"r{index}")}
        common.log(f"round {index + 1}: {entry}")
        rounds.append(entry)
    result = {"benchmark": "shared_prompt_burst", "machine": common.machine_info(
        engine.loaded.dtype), "argv": sys.argv, "threads": args.threads,
        "prefix_tokens": args.prefix_tokens, "rounds": rounds}
    common.write_json(result, args.out)
    return result


if __name__ == "__main__":
    main()
