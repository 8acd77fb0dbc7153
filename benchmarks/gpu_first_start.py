"""A first start on a CUDA host: greedy equality with transformers, a prefix hit, 16 requests.

Prepared on a CPU machine for a later run on a GPU; nothing here has run on one yet. Three
checks of our engine on the GPU, with the KV cache sized automatically from the device's free
memory (``workers.kv_budget``; ``--kv-cache-mib`` fixes it instead):

- ``greedy_equality``: the model's greedy continuations of a few prompts (standard-library
  source, EOS ignored) from our engine and from transformers ``generate`` (batch 1, its own
  model instance), token ids compared per prompt. In bf16 the two may part at a near-tie
  (their kernels round differently); where any prompt differs, the comparison is repeated in
  fp32 and both are reported, each under its dtype.
- ``prefix_ttft``: TTFT of a 1,024-token prompt cold, then of one sharing its first 992 tokens
  (random token ids as in ``prefix_ttft.py``; median of ``--trials``).
- ``concurrent``: ``--requests`` 16 requests of ``--prompt-tokens`` 256 decoding exactly
  ``--output-tokens`` 128 tokens, all queued at once in our engine: output tokens/s, TTFT, ITL
  (the engine row of ``throughput.py``).

Writes one JSON (with the machine, GPU included) like the other scripts. Exits with a message
and status 1 where torch sees no CUDA device. Transformers' copy of the weights loads beside
the engine, in what ``--gpu-memory-utilization`` leaves: for a model much larger than the
embedded one, lower it (0.5).

    .venv/bin/python benchmarks/gpu_first_start.py [--quick] [--dtype float32]
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import random
import statistics
import time
from collections.abc import Iterator

try:
    from benchmarks import common, prefix_ttft, throughput
except ImportError:  # run as a script: benchmarks/ is on sys.path, the repo root is not
    import common
    import prefix_ttft
    import throughput

FP32_CHECK_KV_MIB = 1024
"""The fp32 equality rerun's fixed KV budget: the automatic engine already holds most of the
device."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common.add_common_args(parser, "gpu_first_start")
    parser.set_defaults(kv_cache_mib=None)  # automatic: sized from the device's memory
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                        help="fraction of the device's memory the engine may use when its KV "
                             "cache is sized automatically (no --kv-cache-mib)")
    parser.add_argument("--equality-prompts", type=int, default=4,
                        help="prompts whose greedy ids are compared with transformers'")
    parser.add_argument("--equality-prompt-tokens", type=int, default=64,
                        help="tokens of each equality prompt")
    parser.add_argument("--equality-output-tokens", type=int, default=32,
                        help="greedy tokens compared per prompt")
    parser.add_argument("--trials", type=int, default=5, help="prefix hit/miss pairs")
    parser.add_argument("--requests", type=int, default=16, help="concurrent requests")
    parser.add_argument("--prompt-tokens", type=int, default=256,
                        help="tokens of each concurrent request's prompt")
    parser.add_argument("--output-tokens", type=int, default=128,
                        help="tokens each concurrent request decodes (EOS ignored)")
    parser.add_argument("--seed", type=int, default=0, help="the prefix prompts' random ids")
    args = parser.parse_args(argv)
    if args.quick:
        args.equality_prompts, args.equality_prompt_tokens, args.equality_output_tokens = 2, 32, 8
        args.trials, args.requests, args.prompt_tokens, args.output_tokens = 1, 4, 32, 8
    return args


def main(argv: list[str] | None = None) -> dict:
    """Runs the checks on ``cuda``.

    Raises:
        SystemExit: torch sees no CUDA device.
    """
    import torch

    from workers import devices

    args = parse_args(argv)
    if not devices.cuda_available():
        raise SystemExit(
            "gpu_first_start.py needs a CUDA device and torch sees none (torch "
            f"{torch.__version__}, CUDA build: {torch.version.cuda or 'no'}). Run it on a GPU "
            "host with a CUDA build of torch (make TORCH_SPEC=torch ...).")
    return measure(args, "cuda")


def measure(args: argparse.Namespace, device: str) -> dict:
    """The three checks on ``device`` (``cuda``; the smoke test runs them on ``cpu``), written
    to ``args.out``."""
    from workers import devices

    threads = common.set_threads(args.threads)
    common.log(f"loading {args.model} ({args.dtype}) on {device}, {threads} threads")
    started = time.perf_counter()
    loaded = common.load(args.model, args.dtype, device)
    with _captured("workers.kv_budget") as budget_lines:
        engine = common.build_engine(loaded, threads=args.threads,
                                     kv_cache_mib=args.kv_cache_mib,
                                     gpu_memory_utilization=args.gpu_memory_utilization)
    startup_s = time.perf_counter() - started
    kv = {"blocks": engine.pool.num_blocks, "block_size": engine.config.block_size,
          "max_model_len": engine.max_model_len, "derivation": budget_lines[-1:]}
    if device == "cuda":
        free, total = devices.device_memory(loaded.device)
        kv.update(device_free_after_start_bytes=free, device_total_bytes=total)
    common.log(f"engine ready in {startup_s:.1f} s: {kv['blocks']} KV blocks")
    result = {"benchmark": "gpu_first_start", "machine": common.machine_info(loaded.dtype),
              "device": device, "model": args.model, "engine_startup_s": startup_s,
              "kv_cache": kv, "settings": {k: v for k, v in vars(args).items() if k != "out"}}
    result["greedy_equality"] = greedy_equality(args, loaded, engine, device)
    result["prefix_ttft"] = prefix_hit(engine, args.trials, args.seed)
    result["concurrent"] = concurrent(engine, loaded.tokenizer, args)
    common.write_json(result, args.out)
    return result


def greedy_equality(args: argparse.Namespace, loaded, engine, device: str) -> dict:
    """Our engine's greedy ids against transformers', per prompt; again in fp32 where the
    model's dtype gave any difference."""
    prompts = common.text_prompts(loaded.tokenizer, args.equality_prompts,
                                  args.equality_prompt_tokens)
    checks = {_dtype_name(loaded.dtype): compare(args, loaded, engine, prompts, device)}
    if not checks[_dtype_name(loaded.dtype)]["all_identical"] and "float32" not in checks:
        common.log("greedy ids differ: repeating the comparison in float32")
        fp32 = common.load(args.model, "float32", device)
        fp32_engine = common.build_engine(fp32, threads=args.threads,
                                          kv_cache_mib=FP32_CHECK_KV_MIB)
        checks["float32"] = compare(args, fp32, fp32_engine, prompts, device)
        del fp32_engine, fp32
    return checks


def compare(args: argparse.Namespace, loaded, engine, prompts: list[list[int]],
            device: str) -> dict:
    """Greedy ids of each prompt from ``engine`` and from transformers ``generate`` on a
    separate instance of the same weights."""
    tokens = args.equality_output_tokens
    ours = throughput.run_engine(engine, prompts, tokens, "equality")["token_ids"]
    reference = common.load(args.model, _dtype_name(loaded.dtype), device)
    reference.model.set_attn_implementation("sdpa")
    pad_id = loaded.tokenizer.pad_token_id
    pad_id = 0 if pad_id is None else pad_id
    theirs = [throughput.hf_generate(reference.model, [prompt], tokens, pad_id)["token_ids"][0]
              for prompt in prompts]
    del reference
    rows = [{"prompt": i, "identical": a == b, "tokens": len(a),
             "common_prefix_tokens": throughput._common_prefix(a, b)}
            for i, (a, b) in enumerate(zip(ours, theirs, strict=True))]
    common.log(f"greedy equality ({_dtype_name(loaded.dtype)}): "
               f"{sum(r['identical'] for r in rows)}/{len(rows)} prompts identical")
    return {"prompts": rows, "all_identical": all(r["identical"] for r in rows)}


def prefix_hit(engine, trials: int, seed: int) -> dict:
    """TTFT of ``prefix_ttft.PROMPT_TOKENS`` cold, then with ``CACHED_TOKENS`` cached."""
    rng = random.Random(seed)

    def ttft(prompt: list[int], request_id: str) -> tuple[float, int]:
        run = common.EngineRun(engine)
        run.add(common.greedy_request(request_id, prompt, 1))
        run.run()
        return run.ttft_s(request_id), run.cached_tokens[request_id]

    ttft(prefix_ttft.prompt_pair(rng)[0], "prefix-warmup")
    samples = []
    for trial in range(trials):
        cold, warm = prefix_ttft.prompt_pair(rng)
        miss_s, miss_cached = ttft(cold, f"miss-{trial}")
        hit_s, hit_cached = ttft(warm, f"hit-{trial}")
        samples.append({"miss_ms": miss_s * 1000, "hit_ms": hit_s * 1000,
                        "miss_cached_tokens": miss_cached, "hit_cached_tokens": hit_cached})
    miss = statistics.median(s["miss_ms"] for s in samples)
    hit = statistics.median(s["hit_ms"] for s in samples)
    common.log(f"prefix: miss TTFT {miss:.1f} ms, hit TTFT {hit:.1f} ms")
    return {"prompt_tokens": prefix_ttft.PROMPT_TOKENS,
            "cached_prefix_tokens": prefix_ttft.CACHED_TOKENS, "samples": samples,
            "miss_ttft_median_ms": miss, "hit_ttft_median_ms": hit,
            "hit_over_miss": hit / miss if miss else None}


def concurrent(engine, tokenizer, args: argparse.Namespace) -> dict:
    """``--requests`` requests queued at once in our engine (``throughput.py``'s engine row)."""
    prompts = common.text_prompts(tokenizer, args.requests, args.prompt_tokens)
    throughput.run_engine(engine, prompts[:1], 2, "concurrent-warmup")
    before = dict(engine.counters.batch_sizes)
    row = throughput.run_engine(engine, prompts, args.output_tokens, "concurrent")
    row.pop("token_ids")
    row["requests"] = len(prompts)
    row["batch_sizes"] = {size: count - before.get(size, 0)
                          for size, count in sorted(engine.counters.batch_sizes.items())
                          if count > before.get(size, 0)}
    common.log(f"concurrent: {len(prompts)} requests, "
               f"{row['output_tokens_per_s']:.0f} output tokens/s")
    return row


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


@contextlib.contextmanager
def _captured(logger_name: str) -> Iterator[list[str]]:
    """The messages ``logger_name`` logs at INFO and above inside the block (the KV budget's
    derivation, logged at engine start)."""
    lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    logger, handler = logging.getLogger(logger_name), Collect()
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


if __name__ == "__main__":
    main()
