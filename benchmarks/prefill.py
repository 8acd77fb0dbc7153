"""Prefill tokens/s at 1k, 4k and 8k tokens: our engine, unchunked and chunked, next to
transformers' own forward pass, in the same run.

- engine: one request of L prompt tokens and one output token; time from queueing it to its
  first token (its TTFT: the whole prefill, plus one LM-head row and one sample). The prefix
  cache is reset before every trial and the JSON records that nothing was reused. Settings:
  ``unchunked`` (token budget >= the longest prompt) and ``chunk_<N>`` for each --chunks N.
- transformers: one ``model(input_ids)`` call, SDPA attention, ``use_cache=False``,
  ``logits_to_keep=1`` (the same work: all L positions, one LM-head row).

Median over --repeats trials after one warm-up. Goal: >= 1.5x transformers at 8k.
The 8k length is 8,000 tokens: SmolLM2's ``max_position_embeddings`` is 8,192, and prompt plus
output must fit.

    .venv/bin/python benchmarks/prefill.py [--lengths 1024,4096,8000] [--chunks 512,2048]
"""

from __future__ import annotations

import argparse
import gc
import statistics

import torch

try:
    from benchmarks import common
except ImportError:  # run as a script: benchmarks/ is on sys.path, the repo root is not
    import common


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common.add_common_args(parser, "prefill")
    parser.add_argument("--lengths", default="1024,4096,8000", help="prompt lengths, tokens")
    parser.add_argument("--chunks", default="512,2048",
                        help="chunked-prefill token budgets to measure besides unchunked")
    parser.add_argument("--repeats", type=int, default=3, help="timed trials per figure")
    args = parser.parse_args(argv)
    if args.quick:
        args.lengths, args.chunks, args.repeats = "64,128", "32", 1
        args.kv_cache_mib = 16
    args.lengths = [int(n) for n in args.lengths.split(",") if n]
    args.chunks = [int(n) for n in args.chunks.split(",") if n]
    return args


def engine_prefill(loaded, prompts: dict[int, list[int]], budget: int,
                   args: argparse.Namespace) -> dict[int, dict]:
    """Prefill figures of one engine whose per-step token budget is ``budget``."""
    engine = common.build_engine(loaded, threads=args.threads, max_num_batched_tokens=budget,
                                 kv_cache_mib=args.kv_cache_mib)
    common.cold_prefill(engine, prompts[min(prompts)][:16], "warmup")
    figures = {}
    for length, prompt in prompts.items():
        samples = [common.cold_prefill(engine, prompt, f"prefill-{length}-{i}")
                   for i in range(args.repeats)]
        seconds = statistics.median(s.seconds for s in samples)
        figures[length] = {"median_s": seconds, "tokens_per_s": length / seconds,
                           "samples_s": [s.seconds for s in samples],
                           "cached_tokens": max(s.cached_tokens for s in samples),
                           "steps": max(s.steps for s in samples)}
        common.log(f"  engine budget {budget}: {length} tokens in {seconds * 1000:.0f} ms "
                   f"({length / seconds:.0f} tokens/s)")
    return figures


@torch.inference_mode()
def hf_prefill(model, prompts: dict[int, list[int]], repeats: int) -> dict[int, dict]:
    """transformers' forward over the whole prompt: sdpa, no cache, one LM-head row."""
    model.set_attn_implementation("sdpa")

    def forward(prompt: list[int]):
        return model(input_ids=torch.tensor([prompt]), use_cache=False, logits_to_keep=1)

    forward(prompts[min(prompts)][:16])
    figures = {}
    for length, prompt in prompts.items():
        samples = [common.timed(lambda p=prompt: forward(p))[0] for _ in range(repeats)]
        seconds = statistics.median(samples)
        figures[length] = {"median_s": seconds, "tokens_per_s": length / seconds,
                           "samples_s": samples}
        common.log(f"  transformers: {length} tokens in {seconds * 1000:.0f} ms "
                   f"({length / seconds:.0f} tokens/s)")
    return figures


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    threads = common.set_threads(args.threads)
    loaded = common.load(args.model, args.dtype)
    limit = getattr(loaded.model.config, "max_position_embeddings", None)
    if limit and max(args.lengths) >= limit:
        raise SystemExit(f"--lengths up to {max(args.lengths)} do not fit the model's "
                         f"max_position_embeddings {limit} (prompt + 1 output token)")
    prompts = {length: common.text_prompts(loaded.tokenizer, 1, length)[0]
               for length in args.lengths}
    settings = {"unchunked": max(args.lengths)} | {f"chunk_{n}": n for n in args.chunks}
    engine: dict[str, dict] = {}
    for name, budget in settings.items():
        common.log(f"engine {name} (token budget {budget}), {threads} threads")
        engine[name] = engine_prefill(loaded, prompts, budget, args)
        gc.collect()
    common.log(f"transformers forward, {threads} threads")
    hf = hf_prefill(common.load(args.model, args.dtype).model, prompts, args.repeats)
    ratios = {name: {length: common.ratio(figures[length]["tokens_per_s"],
                                          hf[length]["tokens_per_s"])
                     for length in args.lengths} for name, figures in engine.items()}
    longest = max(args.lengths)
    best = max(ratios, key=lambda name: ratios[name][longest])
    result = {"benchmark": "prefill", "machine": common.machine_info(loaded.dtype),
              "threads": threads, "model": args.model, "quick": args.quick,
              "lengths": args.lengths, "settings": settings, "repeats": args.repeats,
              "engine": engine, "transformers": hf, "ratio_vs_transformers": ratios,
              "goals": [common.goal(f"engine {name} / transformers prefill at {longest} tokens",
                                    ratios[name][longest], 1.5)
                        for name in dict.fromkeys((best, "unchunked"))]}
    common.log_goals(result["goals"])
    common.write_json(result, args.out)
    return result


if __name__ == "__main__":
    main()
