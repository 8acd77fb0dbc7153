"""What a short request waits while a long prompt is prefilled: the step-time cap.

One in-process LLMEngine. A --long-prompt 8,000-token prompt arrives alone; from --first-ms
after it, a short request (--short-prompt tokens, --short-output output tokens) arrives every
--every-ms for --window-s seconds (the same arrivals in every setting, so the same work). A
request that arrives while a step runs waits for it (the engine loop takes new requests
between steps), so each short request's TTFT counts from its arrival time, not from the step
boundary that admitted it. Per
--caps setting (``off``, or a step-time cap in ms, ``max_step_time_s``), rounds alternating,
the JSON reports the short requests' TTFT p50 / p90 / max, the long prompt's TTFT, and the
per-step series ``[end s, step ms, prefill tokens, decode tokens]``.

Goal: with the cap the server uses by default, the short requests' longest TTFT at most 0.25x
uncapped, and the long prompt's TTFT within 1.05x of uncapped.

    .venv/bin/python benchmarks/arrival_wait.py [--quantization gguf] [--caps off,1000]
        [--rounds 2] [--threads 1] [--quick]
"""

from __future__ import annotations

import argparse
import gc
import time

try:
    from benchmarks import common
except ImportError:  # run as a script: benchmarks/ is on sys.path, the repo root is not
    import common

OFF = "off"
LONG_ID = "long"
DEFAULT_CAP = "1000"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common.add_common_args(parser, "arrival_wait")
    parser.add_argument("--quantization", default="none", choices=["none", "gguf", "int8"],
                        help="how the weights are held (gguf: the embedded Q4_1 as stored, "
                             "the server's default)")
    parser.add_argument("--long-prompt", type=int, default=8000, help="tokens")
    parser.add_argument("--short-prompt", type=int, default=32, help="tokens")
    parser.add_argument("--short-output", type=int, default=4, help="tokens")
    parser.add_argument("--first-ms", type=float, default=250.0)
    parser.add_argument("--every-ms", type=float, default=500.0)
    parser.add_argument("--window-s", type=float, default=20.0,
                        help="seconds over which the short requests arrive")
    parser.add_argument("--caps", default=f"{OFF},{DEFAULT_CAP}",
                        help=f"comma-separated step-time caps in ms; {OFF!r}: none")
    parser.add_argument("--rounds", type=int, default=2, help="rounds, settings alternating")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048,
                        help="the token budget (the cap cuts only prompts longer than it)")
    args = parser.parse_args(argv)
    if args.quick:
        args.long_prompt, args.short_prompt, args.short_output = 96, 8, 2
        args.first_ms, args.every_ms, args.window_s, args.rounds = 0.0, 1.0, 0.03, 1
        args.caps, args.kv_cache_mib, args.max_num_batched_tokens = f"{OFF},0.001", 16, 48
    args.caps = [c.strip() for c in args.caps.split(",") if c.strip()]
    return args


def cap_seconds(cap: str) -> float | None:
    return None if cap == OFF else float(cap) / 1000


def run_setting(loaded, long_prompt: list[int], shorts: list[list[int]], cap: str,
                args: argparse.Namespace) -> dict:
    """One engine with the given cap through the scenario."""
    engine = common.build_engine(loaded, threads=args.threads, kv_cache_mib=args.kv_cache_mib,
                                 max_num_batched_tokens=args.max_num_batched_tokens,
                                 max_step_time_s=cap_seconds(cap))
    warmup = common.EngineRun(engine)  # measures the prompt cost the cap is applied by
    warmup.add(common.greedy_request("warmup", shorts[-2] + shorts[-1], 1))
    warmup.run()
    run = common.EngineRun(engine)
    run.add(common.greedy_request(LONG_ID, long_prompt, 1))
    due = [run.start + (args.first_ms + i * args.every_ms) / 1000
           for i in range(len(shorts) - 2)]  # the last two make the warm-up prompt
    short_ids = []
    while engine.has_work() or due:
        if not engine.has_work():
            time.sleep(max(0.0, due[0] - time.perf_counter()))
        now = time.perf_counter()
        while due and due[0] <= now:
            short_ids.append(f"short-{len(short_ids)}")
            run.add(common.greedy_request(short_ids[-1], shorts[len(short_ids) - 1],
                                          args.short_output), arrived_at=due.pop(0))
        run.step()
    ttfts = [run.ttft_s(rid) for rid in short_ids]
    return {"max_step_time_s": cap_seconds(cap), "short_requests": len(short_ids),
            "short_ttft": common.latency_summary(ttfts),
            "short_ttft_max_ms": max(ttfts) * 1000 if ttfts else None,
            "long_ttft_ms": run.ttft_s(LONG_ID) * 1000,
            "long_prefill_steps": sum(1 for step in run.steps
                                      if run.start + step[0] <= run.arrivals[LONG_ID][0]),
            "steps_columns": ["end_s", "step_ms", "prefill_tokens", "decode_tokens"],
            "steps": run.steps}


def median_of(rounds: list[dict], key: str) -> float | None:
    return common.percentile([r[key] for r in rounds if r[key] is not None], 50)


def goal_check(settings: dict[str, list[dict]]) -> dict:
    """The default cap against none, on the medians over the rounds."""
    if OFF not in settings or DEFAULT_CAP not in settings:
        return {"checks": [], "met": None}
    off, cap = settings[OFF], settings[DEFAULT_CAP]
    checks = [common.goal("cap 1000 ms: short requests' longest TTFT / uncapped",
                          common.ratio(median_of(cap, "short_ttft_max_ms"),
                                       median_of(off, "short_ttft_max_ms")), 0.25,
                          at_least=False),
              common.goal("cap 1000 ms: long prompt's TTFT / uncapped",
                          common.ratio(median_of(cap, "long_ttft_ms"),
                                       median_of(off, "long_ttft_ms")), 1.05, at_least=False)]
    return {"checks": checks, "met": all(check["met"] for check in checks)}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    threads = common.set_threads(args.threads)
    loaded = common.load(args.model, args.dtype, quantization=args.quantization)
    arrivals = int((args.window_s * 1000 - args.first_ms) / args.every_ms) + 1
    prompts = common.text_prompts(loaded.tokenizer, arrivals + 2, args.short_prompt)
    long_prompt = common.text_prompts(loaded.tokenizer, 1, args.long_prompt,
                                      offset=(arrivals + 2) * args.short_prompt)[0]
    settings: dict[str, list[dict]] = {cap: [] for cap in args.caps}
    for round_index in range(args.rounds):
        order = args.caps if round_index % 2 == 0 else args.caps[::-1]
        for cap in order:
            row = run_setting(loaded, long_prompt, prompts, cap, args)
            settings[cap].append(row)
            common.log(f"round {round_index + 1}, cap {cap}: {row['short_requests']} short "
                       f"requests, TTFT p50 {row['short_ttft']['p50_ms']:.0f} ms, max "
                       f"{row['short_ttft_max_ms']:.0f} ms; long prompt TTFT "
                       f"{row['long_ttft_ms']:.0f} ms")
            gc.collect()
    result = {"benchmark": "arrival_wait", "machine": common.machine_info(loaded.dtype),
              "threads": threads, "model": args.model, "quantization": loaded.quantization,
              "quick": args.quick,
              "workload": {"long_prompt_tokens": args.long_prompt,
                           "short_prompt_tokens": args.short_prompt,
                           "short_output_tokens": args.short_output,
                           "first_ms": args.first_ms, "every_ms": args.every_ms,
                           "window_s": args.window_s,
                           "rounds": args.rounds,
                           "max_num_batched_tokens": args.max_num_batched_tokens},
              "settings": settings, "goal": goal_check(settings)}
    common.log_goals(result["goal"]["checks"])
    common.write_json(result, args.out)
    return result


if __name__ == "__main__":
    main()
