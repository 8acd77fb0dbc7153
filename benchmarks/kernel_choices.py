"""The measurements behind the engine's kernel choices, on SmolLM2-135M's shapes.

1. Linear layers in the run's dtype (``--dtype``; ``auto`` is bf16 where native, else fp32):
   ``F.linear`` against weights prepacked once for oneDNN (``workers.models.linear``), per row
   count: where prepacking pays, where it stops, and how far the results differ; in bf16 also
   the packed small-batch kernel, where it runs (where it beats prepacking).
2. Causal flash attention of one prompt on strided head views (as they come out of the fused
   qkv projection) against contiguous head-major copies: whether copying first pays (it did
   not, measured: ``workers.attention.paged`` attends to the views).
3. Decode attention over the paged cache, fp32 and bf16, per batch and context length: our
   native kernel reading blocks in place (``workers.kernels``) against gathering the blocks into
   a copy for torch's SDPA, with the tables scattered over the pool, and the largest difference
   between the two. These loops keep one layer's KV in the CPU's caches; a step does not, so the
   native kernel is also timed over 30 layers' caches at 16 x 512 tokens in the run's dtype
   (``decode_attention_from_dram``), next to only reading those blocks, and with the tables the
   engine's block manager gives a burst of requests once its pool has turned over.
4. Prefill attention in bf16 (``workers.attention.kernel_choice.prefill_kernel``), one layer,
   for each ``--prefill-cases`` (new tokens + cached tokens): our kernel (AMX tiles or
   AVX512-BF16, ``prefill_backend`` in the JSON) reading the cached context in place against
   torch's flash kernel (two calls and a log-sum-exp merge over a gathered copy when there is
   cached context), trials alternating between the two; fastest and median.
5. Weights kept as stored (Q4_1, as the embedded GGUF holds them; ``workers.models.linear.
   StoredLinear``), per ``--stored-rows`` row count in the run's dtype: the native kernel
   streaming them (int8 activations) against dequantizing the layer and multiplying densely
   (oneDNN, on AMX tiles where the CPU has them), trials alternating: where
   ``STREAMED_MAX_ROWS`` should lie on this machine. These loops keep one layer's weights in
   the caches, so the native kernel is also timed over 30 layers' weights, a step's worth, per
   ``--stored-dram-rows`` row count (``stored_q4_1_from_dram``): where its paths' choice by rows
   should lie (``workers/kernels/weight_linear.cpp``).

Writes JSON; ``--quick`` for a smoke run.
"""

from __future__ import annotations

import argparse
import random
import statistics

import torch
import torch.nn.functional as F

from workers.attention.kernel_choice import prefill_kernel
from workers.kv_budget import CPU_KV_CACHE_BYTES
from workers.model_loader import parse_dtype

try:
    from benchmarks import common
except ImportError:  # run as a script: benchmarks/ is on sys.path, the repo root is not
    import common

# (out_features, in_features) of SmolLM2-135M's fused projections: qkv, o, gate/up, down.
LINEAR_SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64
DECODE_BLOCK, DECODE_POOL_BLOCKS = 16, 4096
SECTIONS = ("linear", "stored_q4_1", "stored_q4_1_from_dram", "flash", "decode_attention",
            "decode_attention_from_dram", "prefill_attention")
"""What ``--only`` can name: the JSON's keys for the measurements of the docstring's items."""


def linear_rows(rows: list[int], repeats: int, dtype: torch.dtype) -> dict:
    """Milliseconds per matmul, plain and (where oneDNN can prepack ``dtype`` on this CPU)
    prepacked, for each shape and row count, and the largest relative difference between the
    two results. Where the packed kernel runs for ``dtype`` (AVX2 with FMA, or AVX-512;
    ``workers.models.linear.packed_max_rows``), also ``packed_small_ms``: the same matmul
    through it, timed right after the others."""
    from workers.models.linear import _packed_kernel, _prepacking_pays

    small = _packed_kernel(dtype, torch.device("cpu"))
    prepacks = _prepacking_pays(dtype, torch.device("cpu"))
    results = {}
    for name, (out_features, in_features) in LINEAR_SHAPES.items():
        weight = torch.randn(out_features, in_features, dtype=dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, None) if prepacks else None
        small_packed = small.pack(weight) if small is not None else None
        for count in rows:
            x = torch.randn(count, in_features, dtype=dtype)
            plain = common.median_time(lambda x=x, w=weight: F.linear(x, w), repeats)
            row = results[f"{name}/{count}"] = {"plain_ms": plain * 1e3}
            if packed is not None:
                row.update(_prepacked(x, weight, packed, plain, repeats))
            if small is not None:
                row["packed_small_ms"] = common.median_time(
                    lambda x=x, p=small_packed, n=out_features: small.linear(x, p, n, None),
                    repeats) * 1e3
            common.log(f"{name} {count} rows: {row}")
    return results


def _prepacked(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor, plain_s: float,
               repeats: int) -> dict:
    """oneDNN's prepacked matmul of ``x`` by ``weight``: its time against ``plain_s`` and how
    far its result is from ``F.linear``'s."""
    fast = common.median_time(
        lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""), repeats)
    reference = F.linear(x, weight).float()
    packed_out = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    difference = float(((packed_out.float() - reference).abs()
                        / reference.abs().clamp_min(1e-3)).max())
    return {"prepacked_ms": fast * 1e3, "speedup": plain_s / fast,
            "bit_identical": difference == 0.0, "max_relative_difference": difference}


def q4_1_weight(out_features: int, in_features: int):
    """A random ``[out_features, in_features]`` weight quantized to Q4_1 by the ``gguf``
    package, packed as ``StoredWeight`` holds it."""
    import gguf

    from workers.models.weight_formats import StoredWeight, WeightFormat

    values = torch.randn(out_features, in_features).numpy()
    rows_bytes = torch.from_numpy(gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q4_1))
    return StoredWeight.from_rows(rows_bytes, WeightFormat.Q4_1, in_features)


def stored_rows(rows: list[int], repeats: int, dtype: torch.dtype) -> dict:
    """Milliseconds per matmul over Q4_1 weights (random, quantized by the ``gguf`` package) for
    each shape and row count: ``streamed_ms`` through the native kernel, ``dense_ms``
    dequantized to ``dtype`` then ``F.linear``, trials alternating; None where the kernel could
    not be built."""
    from workers import kernels
    from workers.models.weight_formats import WeightFormat

    native = kernels.weight_linear()
    if native is None:
        return {}
    results = {}
    for name, (out_features, in_features) in LINEAR_SHAPES.items():
        weight = q4_1_weight(out_features, in_features)

        def streamed(x, weight=weight, n=out_features):
            return native.weight_linear(x, weight.data, int(WeightFormat.Q4_1), n, None, 0, 1)

        def dense(x, weight=weight):
            return F.linear(x, weight.dequantize(dtype=dtype))

        for count in rows:
            x = torch.randn(count, in_features, dtype=dtype)
            times = common.alternating_times({"streamed": lambda x=x: streamed(x),
                                              "dense": lambda x=x: dense(x)}, repeats)
            entry = {f"{kind}_ms": statistics.median(samples) * 1e3
                     for kind, samples in times.items()}
            entry["dense_over_streamed"] = entry["dense_ms"] / entry["streamed_ms"]
            results[f"{name}/{count}"] = entry
            common.log(f"stored Q4_1 {name} {count} rows: {entry}")
    return results


def stored_q4_1_from_dram(rows: list[int], layers: int, repeats: int,
                          dtype: torch.dtype) -> dict:
    """A step's stored-weight matmuls as a step meets them: SmolLM2's four projections in Q4_1
    for ``layers`` layers (66 MB at 30), each multiplied once per step, so the weights come from
    DRAM rather than from the caches a one-layer loop keeps warm. Per row count: ``step_ms``,
    milliseconds for all of them through the native kernel, and ``gb_per_s``, the rate its
    weights stream at (the layers share their values, not their memory). Empty where the kernel
    could not be built."""
    from workers import kernels
    from workers.models.weight_formats import WeightFormat

    native = kernels.weight_linear()
    if native is None:
        return {}
    shapes = list(LINEAR_SHAPES.values())
    weights = [(q4_1_weight(out_features, in_features).data, out_features, in_features)
               for out_features, in_features in shapes]
    weights = [(data.clone(), n, k) for _ in range(layers) for data, n, k in weights]
    nbytes = sum(data.numel() for data, _, _ in weights)
    results = {}
    for count in rows:
        xs = {k: torch.randn(count, k, dtype=dtype) for _, k in shapes}

        def step(xs=xs):
            for data, n, k in weights:
                native.weight_linear(xs[k], data, int(WeightFormat.Q4_1), n, None, 0, 1)
        seconds = common.median_time(step, repeats)
        results[str(count)] = {"step_ms": seconds * 1e3, "gb_per_s": nbytes / seconds / 1e9,
                               "weight_bytes": nbytes}
        common.log(f"stored Q4_1 from DRAM, {count} rows: {results[str(count)]}")
    return results


def flash_layouts(tokens: int, repeats: int) -> dict:
    """Milliseconds for one causal GQA attention layer over ``tokens`` tokens."""
    qkv = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM, dtype=torch.bfloat16)
    q, k, v = qkv.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], -1)
    views = [x.view(tokens, -1, HEAD_DIM).transpose(0, 1).unsqueeze(0) for x in (q, k, v)]

    def attend(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    strided = common.median_time(lambda: attend(*views), repeats)
    contiguous = common.median_time(lambda: attend(*(x.contiguous() for x in views)), repeats)
    common.log(f"flash {tokens} tokens: strided {strided * 1e3:.1f} ms, "
               f"contiguous (copies included) {contiguous * 1e3:.1f} ms")
    return {"tokens": tokens, "strided_ms": strided * 1e3, "contiguous_ms": contiguous * 1e3}


def decode_attention(cases: list[tuple[int, int]], repeats: int) -> dict:
    """Milliseconds per layer of decode attention, native and gathered, for each dtype and
    (batch, context) case; native is None where the kernel could not be built."""
    from workers.kv_cache import PagedKVCache

    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        cache = PagedKVCache(1, DECODE_POOL_BLOCKS, DECODE_BLOCK, KV_HEADS, HEAD_DIM, dtype,
                             torch.device("cpu"))
        cache.keys[0].normal_()
        cache.values[0].normal_()
        for batch, context in cases:
            key = f"{str(dtype).removeprefix('torch.')}/{batch}x{context}"
            results[key] = _decode_case(cache, batch, context, repeats)
            common.log(f"decode attention {key}: {results[key]}")
    return results


def _decode_case(cache, batch: int, context: int, repeats: int) -> dict:
    from workers.attention import metadata, paged
    from workers.kernels import paged_decode

    blocks = random.Random(0).sample(range(DECODE_POOL_BLOCKS),
                                     batch * -(-context // DECODE_BLOCK))
    per_row = len(blocks) // batch
    tables = [blocks[i * per_row:(i + 1) * per_row] for i in range(batch)]
    groups = {native: metadata.build_metadata(
        cache, tables, [context - 1] * batch, [1] * batch, torch.device("cpu"),
        native_decode=native).decode_groups[0] for native in (False, True)}
    query = torch.randn(batch, HEADS, HEAD_DIM).to(cache.keys[0].dtype)

    def gathered():
        return paged._attend_gathered(0, query, groups[False], cache, HEAD_DIM ** -0.5)

    def native():
        return paged._attend_decodes_in_place(0, query, groups[True], cache, HEAD_DIM ** -0.5)

    entry = {"gather_ms": common.median_time(gathered, repeats) * 1e3, "native_ms": None,
             "max_abs_difference": None}
    if paged_decode() is not None:
        entry["native_ms"] = common.median_time(native, repeats) * 1e3
        entry["max_abs_difference"] = (native().float() - gathered().float()).abs().max().item()
    return entry


def decode_attention_from_dram(batch: int, context: int, layers: int, repeats: int,
                               dtype: torch.dtype, drafts: int = 0) -> dict:
    """A step's decode attention in ``dtype`` as a step meets it: ``layers`` layers' caches of the
    served default's blocks (or twice the step's, if more), each sequence's blocks scattered
    at random over its pool, every layer attended once per step, so the KV comes from DRAM
    rather than from the caches a one-layer loop keeps warm. Milliseconds a step for the
    native kernel; the same with each sequence's blocks in order (``in_order_step_ms``: each
    KV head's keys and values of a sequence one contiguous run, as a fresh pool hands them
    out); with the tables the engine's block manager gives a burst of ``batch`` requests
    once its pool has turned over (``turned_over_step_ms``, :func:`turned_over_tables`); and
    the floor: the bytes it reads at the sequential read bandwidth of the same caches
    (``sum`` over every pool, which is twice the bytes read). With ``drafts``, each sequence
    is a verification block instead: its decode token and that many draft tokens, the last
    seeing ``context`` tokens."""
    from workers.attention import metadata, paged
    from workers.kernels import paged_decode
    from workers.kv_cache import PagedKVCache

    if paged_decode() is None:
        return {}
    per_row = -(-context // DECODE_BLOCK)
    served_pool = CPU_KV_CACHE_BYTES // (layers * 2 * DECODE_BLOCK * KV_HEADS * HEAD_DIM
                                         * dtype.itemsize)
    pool = max(2 * batch * per_row, served_pool)
    caches = [PagedKVCache(1, pool, DECODE_BLOCK, KV_HEADS, HEAD_DIM, dtype,
                           torch.device("cpu")) for _ in range(layers)]
    for cache in caches:
        cache.keys[0].normal_()
        cache.values[0].normal_()
    q_len = 1 + drafts
    query = torch.randn(batch * q_len, HEADS, HEAD_DIM).to(dtype)

    def step_ms(blocks: list[int]) -> float:
        tables = [blocks[i * per_row:(i + 1) * per_row] for i in range(batch)]
        group = metadata.build_metadata(caches[0], tables, [context - q_len] * batch,
                                        [q_len] * batch, torch.device("cpu"),
                                        verify=[drafts > 0] * batch,
                                        native_decode=True).decode_groups[0]

        def attend():
            for cache in caches:
                paged._attend_decodes_in_place(0, query, group, cache, HEAD_DIM ** -0.5)
        return common.median_time(attend, repeats) * 1e3

    def read():
        for cache in caches:
            cache.keys[0].sum()
            cache.values[0].sum()

    attend_ms = step_ms(random.Random(0).sample(range(pool), batch * per_row))
    in_order_ms = step_ms(list(range(batch * per_row)))
    turned_over = turned_over_tables(batch, context, pool)
    turned_over_ms = step_ms([block for table in turned_over for block in table])
    read_s = common.median_time(read, repeats)
    nbytes = layers * 2 * batch * per_row * DECODE_BLOCK * KV_HEADS * HEAD_DIM * dtype.itemsize
    bandwidth = sum(c.keys[0].nbytes + c.values[0].nbytes for c in caches) / read_s
    entry = {"batch": batch, "context": context, "drafts": drafts, "layers": layers,
             "dtype": str(dtype), "kv_bytes": nbytes,
             "score_products": (paged_decode().score_products(DECODE_BLOCK, HEAD_DIM)
                                 if dtype == torch.bfloat16 else ""),
             "native_step_ms": attend_ms, "native_gb_per_s": nbytes / attend_ms / 1e6,
             "in_order_step_ms": in_order_ms, "in_order_gb_per_s": nbytes / in_order_ms / 1e6,
             "turned_over_step_ms": turned_over_ms,
             "turned_over_mean_run_blocks": mean_run(turned_over),
             "sequential_read_gb_per_s": bandwidth / 1e9,
             "read_floor_step_ms": nbytes / bandwidth * 1e3}
    common.log(f"decode attention from DRAM, {layers} layers x {batch} x {context}"
               f"{f' (+{drafts} drafts)' if drafts else ''}: {entry}")
    return entry


def turned_over_tables(batch: int, context: int, pool_blocks: int, waves: int = 4,
                       seed: int = 0) -> list[list[int]]:
    """Block tables of ``batch`` requests of ``context`` tokens as the engine's block manager
    lays them out over a pool of ``pool_blocks`` that has turned over: first ``waves`` pools'
    worth of blocks go through ``batch`` requests at a time (each a prompt of two thirds of
    ``context``, then one token a step to ``context``, arriving and ending at staggered steps,
    every full block registered, as random prompts leave the pool: all cached, nothing reused);
    then a burst of ``batch`` requests arrives at once, their prompts admitted together and
    their last third decoded in lockstep. Only the bookkeeping runs (no model, no KV)."""
    from contract.request import GenerationRequest
    from workers.block_manager import BlockManager
    from workers.block_pool import BlockPool
    from workers.sequence import Sequence

    rng = random.Random(seed)
    manager = BlockManager(BlockPool(pool_blocks, DECODE_BLOCK))
    prompt_tokens = context * 2 // 3

    def admit(name: str) -> Sequence:
        request = GenerationRequest(name, [rng.randrange(1, 30000) for _ in range(prompt_tokens)])
        seq = Sequence(request, b"turned-over-root", DECODE_BLOCK)
        manager.admit(seq, [], prompt_tokens)
        manager.commit(seq, prompt_tokens)
        seq.token_ids.append(rng.randrange(1, 30000))
        return seq

    def decode(seq: Sequence) -> None:
        manager.reserve(seq, 1)
        manager.commit(seq, 1)
        seq.token_ids.append(rng.randrange(1, 30000))

    live = [admit(f"churn-{i}") for i in range(batch)]
    for seq in live:  # staggered: each starts part of the way through its decode
        for _ in range(rng.randrange(context - prompt_tokens)):
            decode(seq)
    admitted = batch
    while admitted * context < waves * pool_blocks * DECODE_BLOCK:
        for seq in list(live):
            decode(seq)
            if seq.num_tokens >= context:
                manager.free(seq)
                live.remove(seq)
                live.append(admit(f"churn-{admitted}"))
                admitted += 1
    for seq in live:
        manager.free(seq)
    burst = [admit(f"burst-{i}") for i in range(batch)]
    while burst[0].num_tokens < context:
        for seq in burst:
            decode(seq)
    return [seq.block_table[:-(-context // DECODE_BLOCK)] for seq in burst]


def mean_run(tables: list[list[int]]) -> float:
    """Blocks per run of adjacent ids (ascending by one), weighted by blocks: the length of
    the run an average block lies in."""
    runs = []
    for table in tables:
        length = 1
        for before, after in zip(table, table[1:], strict=False):
            if after == before + 1:
                length += 1
            else:
                runs.append(length)
                length = 1
        runs.append(length)
    return sum(run * run for run in runs) / sum(runs)


def prefill_attention(cases: list[tuple[int, int]], repeats: int) -> dict:
    """Milliseconds per layer of a bf16 span's attention, our kernel and torch's flash, for
    each (new tokens, cached tokens) case; empty where our kernel is unavailable."""
    from workers.kernels import prefill_attention

    if prefill_attention() is None:
        common.log("prefill attention: neither AMX-BF16 nor AVX512-BF16 here, nothing to compare")
        return {}
    results = {}
    for new, cached in cases:
        results[f"{new}+{cached}"] = entry = _prefill_case(new, cached, repeats)
        common.log(f"prefill attention {new} new + {cached} cached: {entry}")
    return results


def _prefill_case(new: int, cached: int, repeats: int) -> dict:
    from workers.attention import metadata, paged
    from workers.kv_cache import PagedKVCache

    blocks = -(-(new + cached) // DECODE_BLOCK)
    cache = PagedKVCache(1, blocks + 8, DECODE_BLOCK, KV_HEADS, HEAD_DIM, torch.bfloat16,
                         torch.device("cpu"))
    cache.keys[0].normal_()
    cache.values[0].normal_()
    table = torch.tensor(random.Random(0).sample(range(blocks + 8), blocks))
    cached_blocks = table[:-(-cached // DECODE_BLOCK)] if cached else None
    span = metadata.PrefillSpan(0, new, cached, cached_blocks)
    qkv = torch.randn(new, (HEADS + 2 * KV_HEADS) * HEAD_DIM, dtype=torch.bfloat16)
    q, k, v = (x.view(new, -1, HEAD_DIM) for x in qkv.split(
        [HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], -1))
    kernels = {"native": paged._attend_span_native, "flash": paged._attend_span}

    def attend(name: str) -> torch.Tensor:
        return kernels[name](0, q, k, v, span, cache, HEAD_DIM ** -0.5)

    samples = common.alternating_times(
        {name: lambda name=name: attend(name) for name in kernels}, repeats)
    entry = {}
    for name, times in samples.items():
        times = sorted(times)
        entry[f"{name}_min_ms"] = times[0] * 1e3
        entry[f"{name}_median_ms"] = times[len(times) // 2] * 1e3
    difference = attend("native").float() - attend("flash").float()
    entry["max_abs_difference"] = difference.abs().max().item()
    return entry


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_common_args(parser, "kernel_choices")
    parser.add_argument("--rows", default="1,8,16,64,128,256,512,1024,4096")
    parser.add_argument("--flash-tokens", type=int, default=4096)
    parser.add_argument("--decode-cases", default="1x330,8x330,16x330,16x1000",
                        help="decode attention cases, batch x context tokens")
    parser.add_argument("--prefill-cases", default="32+992,256+0,1024+0,4096+0,8000+0,2048+5952",
                        help="prefill attention cases, new tokens + cached tokens")
    parser.add_argument("--stored-rows", default="16,32,48,64,96,128,192,256,512")
    parser.add_argument("--stored-dram-rows", default="1,2,3,4,5,6,8,11,16",
                        help="row counts of the stored weights' steps from DRAM")
    parser.add_argument("--dram-cases", default="16x512,1x512,1x512+4",
                        help="decode attention from DRAM over 30 layers, batch x context tokens "
                             "[+ draft tokens: verification blocks]")
    parser.add_argument("--only", default=",".join(SECTIONS),
                        help=f"the sections to run, of {','.join(SECTIONS)}")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    cases = [tuple(int(n) for n in case.split("x")) for case in args.decode_cases.split(",")]
    dram_cases = [parse_dram_case(case) for case in args.dram_cases.split(",")]
    prefill_cases = [tuple(int(n) for n in case.split("+"))
                     for case in args.prefill_cases.split(",")]
    if args.quick:
        cases, prefill_cases = [(2, 40)], [(40, 0), (20, 30)]
        dram_cases = [(2, 40, 0), (1, 40, 2)]
    rows = [1, 8, 300] if args.quick else [int(r) for r in args.rows.split(",")]
    stored = [8, 40] if args.quick else [int(r) for r in args.stored_rows.split(",")]
    stored_dram = [1, 5] if args.quick else [int(r) for r in args.stored_dram_rows.split(",")]
    tokens, repeats = (64, 2) if args.quick else (args.flash_tokens, args.repeats)
    threads = common.set_threads(args.threads)
    dtype = parse_dtype(args.dtype, torch.device("cpu"))
    layers = 2 if args.quick else 30
    sections = {
        "linear": lambda: linear_rows(rows, repeats, dtype),
        "stored_q4_1": lambda: stored_rows(stored, repeats, dtype),
        "stored_q4_1_from_dram": lambda: stored_q4_1_from_dram(stored_dram, layers, repeats, dtype),
        "flash": lambda: flash_layouts(tokens, repeats),
        "decode_attention": lambda: decode_attention(cases, repeats),
        "decode_attention_from_dram": lambda: [
            decode_attention_from_dram(batch, context, layers, repeats, dtype, drafts)
            for batch, context, drafts in dram_cases],
        "prefill_attention": lambda: prefill_attention(prefill_cases, min(repeats, 10))}
    result = {"benchmark": "kernel_choices", "machine": common.machine_info(dtype),
              "threads": threads, "quick": args.quick, "dtype": str(dtype),
              "prefill_backend": prefill_kernel(torch.bfloat16, torch.device("cpu"), HEAD_DIM)}
    for name in args.only.split(","):
        result[name] = sections[name]()
    common.write_json(result, args.out)
    return result


def parse_dram_case(case: str) -> tuple[int, int, int]:
    """``"16x512"`` -> (16, 512, 0); ``"1x512+4"`` -> (1, 512, 4): batch, context, drafts."""
    shape, _, drafts = case.partition("+")
    batch, context = shape.split("x")
    return int(batch), int(context), int(drafts or 0)


if __name__ == "__main__":
    main()
