"""Where an engine step stands against the hardware: decode step time and prefill tokens/s
next to limits measured on this machine with the same threads.

- Memory bandwidth, on huge pages as the engine's weights are: a tensor summed (bytes read /
  s) and copied (bytes read + written / s), at two sizes: the model's weight bytes (the working
  set a decode step reads; on a CPU with a large L3 it may partly stay in cache) and
  --bandwidth-mib (beyond the caches: DRAM). A decode step must read every weight once, so
  ``weight bytes / read bandwidth`` at the weights' size
  is the floor of a step's time at small batch (the roofline model: Williams et al., 2009).
- Decode step time of our engine at batch 1, 8, 16 with --context 512 token contexts: median
  over --steps steps in which every sequence decodes one token.
- The linear layers alone: every linear layer of the model (q/k/v/o, gate/up/down per layer,
  the LM head), unfused, in the form the engine computes it (prepacked, or streaming its
  stored weight), at the same batch, no attention, no framework: what a step would cost if
  everything else were free.
- Prefill: our engine's tokens/s on a --prefill-tokens prompt against the measured matmul
  limit (the fastest GFLOP/s of a --matmul-size square matmul and of ``F.linear`` at the
  prompt's rows on each of the model's weight shapes, in its dtype): the FLOPs of the
  prompt (2 x linear parameters per token, causal attention, one LM-head row) divided by
  that rate give the limit's tokens/s.
- Where a decode step goes (``--breakdown``): ``cProfile`` over --steps steps at the largest
  batch, each function's own time in ms a step, largest first. Native kernels and torch ops
  are C functions, so each shows under its own name; the profiler's hooks add a little to
  every Python call, so Python's share reads somewhat high.

    .venv/bin/python benchmarks/step_profile.py [--batches 1,8,16] [--threads 2] [--breakdown]
        [--quantization none|gguf|int8] [--quick]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics

import torch
import torch.nn.functional as F

from workers import huge_pages

try:
    from benchmarks import common
except ImportError:  # run as a script: benchmarks/ is on sys.path, the repo root is not
    import common

GIGA = 1e9
ISSUE_REFERENCE = {"read_bandwidth_bytes_per_s": 90e9, "bf16_matmul_flops_per_s": 890e9,
                   "bf16_weights_bytes": 270e6}
"""The figures a 2-core development machine was measured at when these goals were set, kept next
to ours for comparison."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common.add_common_args(parser, "step_profile")
    parser.add_argument("--quantization", default="none", choices=["none", "gguf", "int8"],
                        help="how the weights are held (workers.stored_weights)")
    parser.add_argument("--batches", default="1,8,16", help="decode batch sizes")
    parser.add_argument("--context", type=int, default=512, help="prompt tokens per sequence")
    parser.add_argument("--steps", type=int, default=32, help="decode steps timed per batch")
    parser.add_argument("--bandwidth-mib", type=int, default=1024,
                        help="size of the tensor DRAM bandwidth is measured on (MiB)")
    parser.add_argument("--matmul-size", type=int, default=4096, help="M = N = K")
    parser.add_argument("--prefill-tokens", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5, help="trials per hardware figure")
    parser.add_argument("--breakdown", action="store_true",
                        help="profile the largest batch's decode steps by function")
    parser.add_argument("--breakdown-top", type=int, default=25, help="functions listed")
    args = parser.parse_args(argv)
    if args.quick:
        args.batches, args.context, args.steps = "1,2", 16, 3
        args.bandwidth_mib, args.matmul_size, args.prefill_tokens = 16, 256, 32
        args.repeats, args.kv_cache_mib = 2, 16
    args.batches = [int(b) for b in args.batches.split(",") if b]
    return args


# --- hardware ------------------------------------------------------------------------------

def memory_bandwidth(nbytes: int, repeats: int) -> dict:
    """Read bandwidth (``sum`` of a fp32 tensor of ``nbytes``) and copy bandwidth (read +
    write), bytes/s, both tensors on huge pages as the engine's weights and KV cache are
    (``workers.huge_pages``): on 4 KiB pages a guest's TLB misses can halve the rate, which
    would put the floor under what the step itself reaches."""
    source = torch.ones(max(1, nbytes // 4), dtype=torch.float32)
    target = torch.ones_like(source)
    huge_pages.advise(source)
    huge_pages.advise(target)
    nbytes = source.numel() * source.element_size()
    read_s = common.median_time(lambda: source.sum(), repeats)
    copy_s = common.median_time(lambda: target.copy_(source), repeats)
    return {"tensor_bytes": nbytes, "read_bytes_per_s": nbytes / read_s,
            "copy_bytes_per_s": 2 * nbytes / copy_s}


def matmul_rate(size: int, dtype: torch.dtype, repeats: int, shapes: set[tuple[int, int]],
                rows: int) -> dict:
    """FLOP/s (2 FLOPs per MAC) of one ``size``-cubed matmul in ``dtype``, and of ``F.linear``
    on ``rows`` rows for each distinct ``(out, in)`` weight shape of the model (a prefill's own
    matmuls). ``flops_per_s``, the limit prefill is held against, is the fastest of them: on
    an AMD EPYC (Zen 5) the square matmul ran at 375 GFLOP/s while a 1,024-token prefill as a
    whole reached 496, so the square alone was no limit."""
    a = torch.randn(size, size).to(dtype)
    b = torch.randn(size, size).to(dtype)
    square = 2 * size ** 3 / common.median_time(lambda: a @ b, repeats)
    linear = {}
    for out_features, in_features in sorted(shapes):
        x = torch.randn(rows, in_features).to(dtype)
        w = torch.randn(out_features, in_features).to(dtype)
        seconds = common.median_time(lambda x=x, w=w: F.linear(x, w), repeats)
        linear[f"{rows}x{in_features}->{out_features}"] = 2 * x.numel() * out_features / seconds
    return {"size": size, "dtype": str(dtype).removeprefix("torch."),
            "square_flops_per_s": square, "linear_flops_per_s": linear,
            "flops_per_s": max(square, *linear.values())}


# --- model arithmetic ----------------------------------------------------------------------

def linear_modules(model) -> list[torch.nn.Linear]:
    """Every ``nn.Linear`` of the model (decoder layers and LM head)."""
    return [module for module in model.modules() if isinstance(module, torch.nn.Linear)]


def linear_shapes(model) -> set[tuple[int, int]]:
    """The distinct ``(out_features, in_features)`` of the model's linear layers."""
    return {(m.out_features, m.in_features) for m in linear_modules(model)}


def weight_bytes(model) -> int:
    """Bytes of the model's distinct weights as held: dense parameters, and the stored
    (quantized) weights that replaced dense ones (tied embeddings counted once)."""
    seen = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
    for module in model.modules():
        stored = getattr(module, "stored_weight", None)
        if stored is not None:
            seen[stored.data.data_ptr()] = stored.nbytes
    return sum(seen.values())


def prefill_flops(model, tokens: int) -> float:
    """FLOPs of a prefill of ``tokens``: 2 x decoder linear parameters per token, causal
    attention (QK^T and PV over half the square), and one LM-head row."""
    config = model.config
    head = model.get_output_embeddings()
    decoder = sum(m.out_features * m.in_features for m in linear_modules(model) if m is not head)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    attention = (2 * 2 * config.num_hidden_layers * config.num_attention_heads * head_dim
                 * tokens * (tokens + 1) / 2)
    return 2 * decoder * tokens + attention + 2 * head.out_features * head.in_features


@torch.inference_mode()
def linear_layers_s(model, batch: int, repeats: int) -> float:
    """Median seconds of one pass over every linear layer at ``batch`` rows, each in the form
    the engine computes it (``Linear.of``: prepacked, packed for small batches, or streaming its
    stored weight), unfused."""
    from workers.models.linear import Linear, packs_small_batches

    small_batches = packs_small_batches(model)
    layers = [(Linear.of(m, small_batches), m.in_features) for m in linear_modules(model)]
    inputs = {k: torch.randn(batch, k).to(model.dtype) for _, k in layers}

    def one_pass():
        for layer, in_features in layers:
            layer(inputs[in_features])

    return common.median_time(one_pass, repeats)


# --- our engine ----------------------------------------------------------------------------

def decode_steps_ms(engine, prompts: list[list[int]], steps: int) -> list[float]:
    """Times (ms) of ``steps`` steps in which every one of the sequences decodes one token,
    after their prompts are prefilled."""
    run = common.EngineRun(engine)
    for i, prompt in enumerate(prompts):
        run.add(common.greedy_request(f"decode-{len(prompts)}-{i}", prompt, steps + 2))
    while any(not times for times in run.arrivals.values()):
        run.step()
    prefilled = len(run.steps)
    run.run()
    return [ms for _, ms, prefill, decode in run.steps[prefilled:]
            if prefill == 0 and decode == len(prompts)][:steps]


def decode_breakdown(engine, prompts: list[list[int]], steps: int, top: int) -> dict:
    """cProfile of ``steps`` decode steps of ``prompts`` (after their prefill): the ``top``
    functions by own time, in ms and calls a step."""
    run = common.EngineRun(engine)
    for i, prompt in enumerate(prompts):
        run.add(common.greedy_request(f"profile-{len(prompts)}-{i}", prompt, steps + 2))
    while any(not times for times in run.arrivals.values()):
        run.step()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        run.step()
    profiler.disable()
    run.run()
    entries = pstats.Stats(profiler).stats  # (file, line, name) -> (cc, calls, own, cumulative, _)
    total_s = sum(entry[2] for entry in entries.values())
    rows = sorted(entries.items(), key=lambda item: item[1][2], reverse=True)[:top]
    return {"batch": len(prompts), "steps": steps,
            "profiled_step_ms": 1000 * total_s / steps,
            "functions": [{"function": f"{file.rsplit('/', 1)[-1]}:{line}:{name}",
                           "own_ms_per_step": 1000 * own / steps,
                           "calls_per_step": calls / steps}
                          for (file, line, name), (_, calls, own, _, _) in rows]}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    threads = common.set_threads(args.threads)
    loaded = common.load(args.model, args.dtype, quantization=args.quantization)
    model, dtype = loaded.model, loaded.dtype
    weights = weight_bytes(model)
    common.log(f"memory bandwidth (weights' size, {args.bandwidth_mib} MiB), {threads} threads")
    bandwidth = {"weights_size": memory_bandwidth(weights, args.repeats),
                 "large": memory_bandwidth(args.bandwidth_mib << 20, args.repeats)}
    common.log(f"matmul rate ({args.matmul_size}^3, {dtype})")
    matmul = matmul_rate(args.matmul_size, dtype, args.repeats, linear_shapes(model),
                         args.prefill_tokens)
    read_weights_ms = 1000 * weights / bandwidth["weights_size"]["read_bytes_per_s"]
    read_weights_dram_ms = 1000 * weights / bandwidth["large"]["read_bytes_per_s"]
    common.log(f"weights {weights / 2**20:.0f} MiB: read in {read_weights_ms:.2f} ms "
               f"({read_weights_dram_ms:.2f} ms at the large tensor's bandwidth); matmul "
               f"{matmul['flops_per_s'] / GIGA:.0f} GFLOP/s")
    linear_ms = {b: 1000 * linear_layers_s(model, b, args.repeats) for b in args.batches}
    engine = common.build_engine(loaded, threads=args.threads, kv_cache_mib=args.kv_cache_mib)
    prompts = common.text_prompts(loaded.tokenizer, max(args.batches), args.context)
    decode = {}
    for batch in args.batches:
        common.log(f"decode steps at batch {batch}, {args.context}-token contexts")
        step_ms = decode_steps_ms(engine, prompts[:batch], args.steps)
        median = statistics.median(step_ms) if step_ms else None
        decode[batch] = {"step_ms_median": median, "step_ms": step_ms,
                         "linear_layers_ms": linear_ms[batch],
                         "read_weights_ms": read_weights_ms,
                         "read_weights_dram_ms": read_weights_dram_ms,
                         "step_over_read_weights": common.ratio(median, read_weights_ms),
                         "step_over_linear_layers": common.ratio(median, linear_ms[batch]),
                         "output_tokens_per_s": batch * 1000 / median if median else None}
        common.log(f"  step {median:.2f} ms, linear layers {linear_ms[batch]:.2f} ms, "
                   f"read weights {read_weights_ms:.2f} ms")
    breakdown = None
    if args.breakdown:
        batch = max(args.batches)
        common.log(f"decode step breakdown at batch {batch} (cProfile)")
        breakdown = decode_breakdown(engine, prompts[:batch], args.steps, args.breakdown_top)
        for row in breakdown["functions"][:10]:
            common.log(f"  {row['own_ms_per_step']:6.2f} ms  {row['function']}")
    prefill_prompt = common.text_prompts(loaded.tokenizer, 1, args.prefill_tokens,
                                         offset=max(args.batches) * args.context)[0]
    common.cold_prefill(engine, prefill_prompt[:16], "prefill-warmup")
    prefill_s = statistics.median(
        common.cold_prefill(engine, prefill_prompt, f"prefill-{i}").seconds
        for i in range(max(1, args.repeats // 2)))
    flops = prefill_flops(model, args.prefill_tokens)
    limit_tokens_per_s = args.prefill_tokens * matmul["flops_per_s"] / flops
    prefill = {"tokens": args.prefill_tokens, "median_s": prefill_s,
               "tokens_per_s": args.prefill_tokens / prefill_s, "flops": flops,
               "achieved_flops_per_s": flops / prefill_s,
               "matmul_limit_tokens_per_s": limit_tokens_per_s,
               "fraction_of_matmul_limit": args.prefill_tokens / prefill_s / limit_tokens_per_s}
    common.log(f"prefill {args.prefill_tokens} tokens: {prefill['tokens_per_s']:.0f} tokens/s, "
               f"{prefill['fraction_of_matmul_limit']:.2f} of the matmul limit")
    result = {"benchmark": "step_profile", "machine": common.machine_info(dtype),
              "threads": threads, "model": args.model, "quantization": loaded.quantization,
              "quick": args.quick,
              "context_tokens": args.context, "weights_bytes": weights,
              "memory_bandwidth": bandwidth, "matmul": matmul, "decode": decode,
              "decode_breakdown": breakdown, "prefill": prefill,
              "issue_reference": ISSUE_REFERENCE}
    common.write_json(result, args.out)
    return result


if __name__ == "__main__":
    main()
