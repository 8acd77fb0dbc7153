"""Prefill/decode interference: 4 decoding streams while an 8,000-token prompt arrives.

One in-process LLMEngine is stepped in a loop. --streams 4 requests with --stream-prompt 32
token prompts decode --decode-tokens 400 tokens each; once every stream has --arrive-after
tokens, a --long-prompt 8000 token request arrives (and decodes --long-output-tokens). Per
chunked-prefill setting (--chunks: per-step token budgets, ``off`` = a budget the whole prompt
fits in, i.e. no chunking; ``B@Tms`` = budget B with a step-time target of T ms,
``workers.step_time``) the JSON reports:

- the streams' inter-token latency p50 / p99, and the longest stall: the largest gap between
  two consecutive tokens of any stream (it happens once per stream, so p99 alone hides it);
- the long prompt's TTFT, total output tokens/s, and the per-step series
  ``[end s, step ms, prefill tokens, decode tokens]``.

Goal: at the best chunked setting, longest stall <= 0.3x unchunked while the long
prompt's TTFT stays within 1.1x of unchunked. SmolLM2's max_position_embeddings is 8,192, so
the long prompt plus its output must stay within it.

    .venv/bin/python benchmarks/interference.py [--chunks 256,512,2048,2048@250ms,2048@auto,off]
        [--quantization gguf] [--cap-ms 1000] [--quick]
"""

from __future__ import annotations

import argparse
import gc

try:
    from benchmarks import common
except ImportError:  # run as a script: benchmarks/ is on sys.path, the repo root is not
    import common

OFF = "off"
AUTO = "auto"
LONG_ID = "long"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common.add_common_args(parser, "interference")
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--stream-prompt", type=int, default=32, help="tokens per stream prompt")
    parser.add_argument("--decode-tokens", type=int, default=400, help="tokens per stream")
    parser.add_argument("--long-prompt", type=int, default=8000, help="tokens")
    parser.add_argument("--long-output-tokens", type=int, default=16)
    parser.add_argument("--arrive-after", type=int, default=8,
                        help="stream tokens decoded before the long prompt arrives")
    parser.add_argument("--quantization", default="none", choices=["none", "gguf", "int8"],
                        help="how the weights are held (gguf: the embedded Q4_1 as stored, "
                             "the server's default)")
    parser.add_argument("--cap-ms", type=float, default=None,
                        help="a step-time cap (max_step_time_s) in every chunked setting, as "
                             "the server's default of 1,000 ms on a CPU; default: none")
    parser.add_argument("--chunks", default=f"256,512,2048,2048@250ms,{OFF}",
                        help=f"per-step token budgets; {OFF!r} = no chunking; B@Tms = budget B "
                             "with a step-time target of T ms; B@auto = with the server's "
                             "default target")
    args = parser.parse_args(argv)
    if args.quick:
        args.streams, args.stream_prompt, args.decode_tokens = 2, 8, 12
        args.long_prompt, args.long_output_tokens, args.arrive_after = 64, 2, 6
        args.chunks, args.kv_cache_mib = f"16,32,32@0.001ms,{OFF}", 16
    args.chunks = [c.strip() for c in args.chunks.split(",") if c.strip()]
    if OFF not in args.chunks:
        args.chunks.append(OFF)  # the goal is relative to unchunked
    return args


def setting_of(chunk: str, args: argparse.Namespace) -> tuple[int, float | str | None]:
    """A setting's per-step token budget (``off`` fits the long prompt and every decode) and
    step-time target: seconds (``B@Tms``), the server's default (``B@auto``: ``auto``, which
    for weights kept as stored covers long prompts only), or None (no target)."""
    budget, _, target = chunk.partition("@")
    tokens = args.long_prompt + args.streams if budget == OFF else int(budget)
    if target == AUTO:
        return tokens, AUTO
    return tokens, float(target.removesuffix("ms")) / 1000 if target else None


def run_setting(loaded, prompts: list[list[int]], long_prompt: list[int], budget: int,
                target_s: float | str | None, args: argparse.Namespace) -> dict:
    """One engine with the given token budget and step-time target through the scenario."""
    unchunked = budget >= len(long_prompt) + len(prompts)
    cap_s = None if args.cap_ms is None or unchunked else args.cap_ms / 1000
    engine = common.build_engine(loaded, threads=args.threads, max_num_batched_tokens=budget,
                                 kv_cache_mib=args.kv_cache_mib, step_time_target_s=target_s,
                                 max_step_time_s=cap_s)
    warmup = common.EngineRun(engine)
    warmup.add(common.greedy_request("warmup", prompts[0], 2))
    warmup.run()
    run = common.EngineRun(engine)
    arrival: dict[str, int] = {}
    stream_ids = [f"stream-{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(stream_ids, prompts, strict=True):
        run.add(common.greedy_request(request_id, prompt, args.decode_tokens))

    def maybe_arrive(current: common.EngineRun) -> None:
        decoded = min(len(current.arrivals[rid]) for rid in stream_ids)
        if LONG_ID not in current.submitted and decoded >= args.arrive_after:
            current.add(common.greedy_request(LONG_ID, long_prompt, args.long_output_tokens))
            arrival["step"] = len(current.steps)

    wall_s = run.run(maybe_arrive)
    streams = common.stream_summary({rid: run.submitted[rid] for rid in stream_ids},
                                    {rid: run.arrivals[rid] for rid in stream_ids})
    limits = engine.scheduler.step_target
    return {"token_budget": budget, "step_time_target_s": target_s, "max_step_time_s": cap_s,
            "target_in_effect_s": limits.seconds if limits else None,
            "target_long_prompts_only": limits.long_prompts_only if limits else None,
            "streams_itl": streams["itl"],
            "longest_stall_ms": streams["longest_stall_ms"],
            "long_prompt_ttft_ms": _ms(run.ttft_s(LONG_ID)) if LONG_ID in run.submitted
            else None,
            "long_prompt_cached_tokens": run.cached_tokens.get(LONG_ID),
            "long_arrival_step": arrival.get("step"),
            "output_tokens": run.output_tokens(), "wall_s": wall_s,
            "output_tokens_per_s": run.output_tokens() / wall_s,
            "steps_columns": ["end_s", "step_ms", "prefill_tokens", "decode_tokens"],
            "steps": run.steps}


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


def goal_check(settings: dict[str, dict]) -> dict:
    """The best chunked setting: the smallest stall among those whose long-prompt TTFT stays
    within 1.1x of unchunked; checked against stall <= 0.3x unchunked."""
    off = settings[OFF]
    ttft_limit = 1.1 * off["long_prompt_ttft_ms"]
    eligible = {name: s for name, s in settings.items()
                if name != OFF and s["long_prompt_ttft_ms"] <= ttft_limit}
    candidates = eligible or {name: s for name, s in settings.items() if name != OFF}
    if not candidates:
        return {"best": None, "met": None}
    best = min(candidates, key=lambda name: candidates[name]["longest_stall_ms"])
    stall_ratio = common.ratio(candidates[best]["longest_stall_ms"], off["longest_stall_ms"])
    ttft_ratio = common.ratio(candidates[best]["long_prompt_ttft_ms"],
                              off["long_prompt_ttft_ms"])
    checks = [common.goal(f"chunk {best}: longest stall / unchunked", stall_ratio, 0.3,
                          at_least=False),
              common.goal(f"chunk {best}: long prompt TTFT / unchunked", ttft_ratio, 1.1,
                          at_least=False)]
    return {"best": best, "checks": checks,
            "met": all(check["met"] for check in checks)}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    threads = common.set_threads(args.threads)
    loaded = common.load(args.model, args.dtype, quantization=args.quantization)
    limit = getattr(loaded.model.config, "max_position_embeddings", None)
    if limit and args.long_prompt + args.long_output_tokens > limit:
        raise SystemExit(f"--long-prompt {args.long_prompt} + {args.long_output_tokens} output "
                         f"tokens exceed the model's max_position_embeddings {limit}")
    prompts = common.text_prompts(loaded.tokenizer, args.streams, args.stream_prompt)
    long_prompt = common.text_prompts(loaded.tokenizer, 1, args.long_prompt,
                                      offset=args.streams * args.stream_prompt)[0]
    settings = {}
    for chunk in args.chunks:
        budget, target_s = setting_of(chunk, args)
        common.log(f"chunk {chunk} (token budget {budget}): {args.streams} streams x "
                   f"{args.decode_tokens} tokens, {args.long_prompt}-token prompt arrives")
        settings[chunk] = run_setting(loaded, prompts, long_prompt, budget, target_s, args)
        s = settings[chunk]
        common.log(f"  ITL p50 {s['streams_itl']['p50_ms']:.1f} ms, p99 "
                   f"{s['streams_itl']['p99_ms']:.1f} ms, longest stall "
                   f"{s['longest_stall_ms']:.0f} ms, long TTFT {s['long_prompt_ttft_ms']:.0f} ms, "
                   f"{s['output_tokens_per_s']:.1f} output tokens/s")
        gc.collect()
    result = {"benchmark": "interference", "machine": common.machine_info(loaded.dtype),
              "threads": threads, "model": args.model, "quantization": loaded.quantization,
              "quick": args.quick,
              "workload": {"streams": args.streams, "stream_prompt_tokens": args.stream_prompt,
                           "decode_tokens": args.decode_tokens,
                           "long_prompt_tokens": args.long_prompt,
                           "long_output_tokens": args.long_output_tokens,
                           "arrive_after_tokens": args.arrive_after,
                           "max_position_embeddings": limit},
              "settings": settings, "goal": goal_check(settings)}
    common.log_goals(result["goal"].get("checks", []))
    common.write_json(result, args.out)
    return result


if __name__ == "__main__":
    main()
