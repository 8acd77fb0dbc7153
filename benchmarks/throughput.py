"""Output tokens/s of the 16-request workload: our server and engine next to transformers.

Workload: --requests 16 prompts of --prompt-tokens 256 token ids (standard-library
source text), each decoding exactly --output-tokens 128 tokens, greedy, EOS ignored. Rows, each
selectable with --rows:

- ``http``: a running ``nalar serve`` (--url), 16 concurrent streaming /v1/completions with
  token-id prompts, then one request alone; TTFT and ITL from the SSE chunk arrival times.
- ``engine``: our LLMEngine in this process, 16 batched, then one alone (with --threads, and
  with torch's default thread count: the default configuration's figure).
- ``hf_generate``: transformers ``model.generate`` on a left-padded batch of 16.
- ``hf_generate_batch``: transformers' continuous batching API ``model.generate_batch``.
- ``hf_single``: transformers ``model.generate`` at batch 1.
- ``hf`` selects all three transformers rows.

Goals: batched >= 2.5x hf_generate and >= 1.2x hf_generate_batch; alone >= 1.0x hf_single.

    .venv/bin/python benchmarks/throughput.py [--rows engine,hf] [--threads 2] [--quick]
    .venv/bin/python benchmarks/throughput.py --rows http --url http://127.0.0.1:8000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import time

import torch

try:
    from benchmarks import common
except ImportError:  # run as a script: benchmarks/ is on sys.path, the repo root is not
    import common

ALL_ROWS = ("http", "engine", "hf_generate", "hf_generate_batch", "hf_single")
ROW_ALIASES = {"hf": ("hf_generate", "hf_generate_batch", "hf_single")}
HF_PAGE_SIZE = 256
"""Tokens per KV page of transformers' continuous batching (its default)."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common.add_common_args(parser, "throughput")
    parser.add_argument("--rows", default="engine,hf",
                        help=f"comma-separated rows: {', '.join(ALL_ROWS)}, or hf (all three "
                             "transformers rows)")
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="server for the http row")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048,
                        help="token budget per step, for our engine and generate_batch")
    args = parser.parse_args(argv)
    if args.quick:
        args.requests, args.prompt_tokens, args.output_tokens = 2, 16, 4
        args.kv_cache_mib = 16
    args.rows = parse_rows(args.rows)
    return args


def parse_rows(text: str) -> list[str]:
    """``engine,hf`` → the row names, in :data:`ALL_ROWS` order.

    Raises:
        SystemExit: an unknown row name (argparse style).
    """
    rows: set[str] = set()
    for name in filter(None, (part.strip() for part in text.split(","))):
        if name not in ALL_ROWS and name not in ROW_ALIASES:
            raise SystemExit(f"unknown row {name!r}: choose from {', '.join(ALL_ROWS)}, hf")
        rows.update(ROW_ALIASES.get(name, (name,)))
    return [row for row in ALL_ROWS if row in rows]


def throughput(output_tokens: int, wall_s: float, **extra) -> dict:
    """A result row: output tokens, wall time and output tokens/s (+ any extra fields)."""
    return {"output_tokens": output_tokens, "wall_s": wall_s,
            "output_tokens_per_s": output_tokens / wall_s if wall_s > 0 else None, **extra}


# --- our engine, in process ------------------------------------------------------------------

def engine_rows(loaded, prompts: list[list[int]], args: argparse.Namespace) -> dict:
    """16 batched, one alone at --threads, one alone at torch's default threads."""
    engine = common.build_engine(loaded, threads=args.threads,
                                 max_num_batched_tokens=args.max_num_batched_tokens,
                                 kv_cache_mib=args.kv_cache_mib)
    threads = common.set_threads(args.threads)
    run_engine(engine, prompts[:1], 2, "warmup")
    common.log(f"engine: {len(prompts)} requests batched, {threads} threads")
    rows = {"batched": run_engine(engine, prompts, args.output_tokens, "batched")}
    common.log(f"engine: one request alone, {threads} threads")
    rows["single"] = run_engine(engine, prompts[:1], args.output_tokens, "single")
    rows["batched"]["threads"] = rows["single"]["threads"] = threads
    default = common.set_threads(None)
    if default != threads:
        common.log(f"engine: one request alone, default configuration ({default} threads)")
        rows["single_default_threads"] = run_engine(engine, prompts[:1], args.output_tokens,
                                                    "default")
        rows["single_default_threads"]["threads"] = default
        common.set_threads(args.threads)
    rows["batch_sizes"] = dict(sorted(engine.counters.batch_sizes.items()))
    return rows


def run_engine(engine, prompts: list[list[int]], output_tokens: int, tag: str) -> dict:
    run = common.EngineRun(engine)
    for i, prompt in enumerate(prompts):
        run.add(common.greedy_request(f"{tag}-{i}", prompt, output_tokens))
    wall_s = run.run()
    return throughput(run.output_tokens(), wall_s, token_ids=list(run.token_ids.values()),
                      **common.stream_summary(run.submitted, run.arrivals))


# --- transformers, in process ----------------------------------------------------------------

def hf_rows(loaded, prompts: list[list[int]], args: argparse.Namespace) -> dict:
    """The selected transformers rows on one model instance with plain SDPA attention."""
    common.set_threads(args.threads)
    model = loaded.model
    model.set_attn_implementation("sdpa")
    pad_id = loaded.tokenizer.pad_token_id
    pad_id = 0 if pad_id is None else pad_id
    hf_generate(model, prompts[:1], 2, pad_id)  # warm-up
    rows = {}
    if "hf_generate" in args.rows:
        common.log(f"transformers generate: batch of {len(prompts)}")
        rows["hf_generate"] = hf_generate(model, prompts, args.output_tokens, pad_id)
    if "hf_generate_batch" in args.rows:
        common.log(f"transformers generate_batch: {len(prompts)} requests")
        rows["hf_generate_batch"] = hf_generate_batch(model, prompts, args)
    if "hf_single" in args.rows:
        common.log("transformers generate: batch of 1")
        rows["hf_single"] = hf_generate(model, prompts[:1], args.output_tokens, pad_id)
    for row in rows.values():
        row["threads"] = torch.get_num_threads()
    return rows


def greedy_config(output_tokens: int, pad_id: int):
    """Exactly ``output_tokens`` greedy tokens: no EOS, no other stopping criterion."""
    from transformers import GenerationConfig
    return GenerationConfig(max_new_tokens=output_tokens, do_sample=False, eos_token_id=None,
                            pad_token_id=pad_id)


@torch.inference_mode()
def hf_generate(model, prompts: list[list[int]], output_tokens: int, pad_id: int) -> dict:
    """``model.generate`` on one left-padded batch (with its attention mask)."""
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    ids, mask = ids.to(model.device), mask.to(model.device)
    wall_s, out = common.timed(lambda: model.generate(
        ids, attention_mask=mask, generation_config=greedy_config(output_tokens, pad_id)))
    generated = (out.shape[1] - width) * len(prompts)
    return throughput(generated, wall_s, batch=len(prompts),
                      token_ids=out[:, width:].tolist())


@torch.inference_mode()
def hf_generate_batch(model, prompts: list[list[int]], args: argparse.Namespace) -> dict:
    """transformers' continuous batching (``generate_batch``), its KV cache sized for exactly
    this workload (its automatic sizing takes a share of all free memory)."""
    from transformers import ContinuousBatchingConfig
    pages_per_request = math.ceil((args.prompt_tokens + args.output_tokens) / HF_PAGE_SIZE)
    config = ContinuousBatchingConfig(page_size=HF_PAGE_SIZE,
                                      num_blocks=pages_per_request * len(prompts) + 4,
                                      max_batch_tokens=args.max_num_batched_tokens)
    generation = greedy_config(args.output_tokens, 0)
    generation.eos_token_id = -1  # continuous batching's spelling of "no EOS"

    def run():
        return model.generate_batch(prompts, generation_config=generation,
                                    continuous_batching_config=config, warmup=False)

    warmup = greedy_config(2, 0)
    warmup.eos_token_id = -1
    model.generate_batch(prompts[:1], generation_config=warmup,
                         continuous_batching_config=config, warmup=False)
    wall_s, outputs = common.timed(run)
    errors = [out.error for out in outputs.values() if out.error]
    generated = sum(len(out.generated_tokens) for out in outputs.values())
    token_ids = [out.generated_tokens for out in outputs.values()]
    return throughput(generated, wall_s, errors=errors, token_ids=token_ids,
                      page_size=HF_PAGE_SIZE, max_batch_tokens=args.max_num_batched_tokens)


# --- through HTTP ----------------------------------------------------------------------------

async def http_rows(url: str, prompts: list[list[int]], output_tokens: int,
                    transport=None) -> dict:
    """All prompts at once (concurrent streams), then the first alone, against ``url``."""
    import httpx
    async with httpx.AsyncClient(base_url=url, transport=transport, timeout=600) as client:
        await http_run(client, prompts[:1], 2, "warmup")
        common.log(f"http: {len(prompts)} concurrent requests to {url}")
        rows = {"batched": await http_run(client, prompts, output_tokens, "batched")}
        common.log("http: one request alone")
        rows["single"] = await http_run(client, prompts[:1], output_tokens, "single")
    return rows


async def http_run(client, prompts: list[list[int]], output_tokens: int, tag: str) -> dict:
    start = time.perf_counter()
    streams = await asyncio.gather(*(http_stream(client, prompt, output_tokens)
                                     for prompt in prompts))
    wall_s = time.perf_counter() - start
    submitted = {f"{tag}-{i}": s["submitted"] for i, s in enumerate(streams)}
    arrivals = {f"{tag}-{i}": s["arrivals"] for i, s in enumerate(streams)}
    workers = sorted({s["worker"] for s in streams})
    return throughput(sum(s["completion_tokens"] for s in streams), wall_s, workers=workers,
                      **common.stream_summary(submitted, arrivals))


async def http_stream(client, prompt: list[int], output_tokens: int) -> dict:
    """One streaming completion; stamps every SSE chunk that carries text.

    Raises:
        httpx.HTTPStatusError: the server answered with an error status.
    """
    body = {"prompt": prompt, "max_tokens": output_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    submitted = time.perf_counter()
    arrivals: list[float] = []
    completion_tokens = 0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.is_error:
            await response.aread()
        response.raise_for_status()
        worker = response.headers.get("x-nalar-worker", "")
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[len("data: "):])
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                arrivals.append(time.perf_counter())
            if chunk.get("usage"):
                completion_tokens = chunk["usage"]["completion_tokens"]
    return {"submitted": submitted, "arrivals": arrivals, "worker": worker,
            "completion_tokens": completion_tokens}


# --- report ----------------------------------------------------------------------------------

AGREEMENT_PAIRS = ((("engine", "batched"), ("hf_generate",)),
                   (("engine", "batched"), ("hf_generate_batch",)),
                   (("engine", "single"), ("hf_single",)))


def token_agreement(rows: dict) -> list[dict]:
    """Compare our greedy outputs with transformers' on the same prompts, then drop the token
    ids from ``rows``. In bf16 outputs may part at near-ties (matmul shapes differ), so this
    is a sanity check that both did the same work, not an equality test."""
    def find(path):
        node = rows
        for key in path:
            node = node.get(key) if isinstance(node, dict) else None
        return node

    checks = []
    for ours_path, theirs_path in AGREEMENT_PAIRS:
        ours, theirs = find(ours_path), find(theirs_path)
        if ours and theirs and "token_ids" in ours and "token_ids" in theirs:
            pairs = list(zip(ours["token_ids"], theirs["token_ids"], strict=True))
            prefixes = [_common_prefix(a, b) for a, b in pairs]
            checks.append({"ours": ".".join(ours_path), "theirs": ".".join(theirs_path),
                           "identical_requests": sum(a == b for a, b in pairs),
                           "requests": len(pairs),
                           "mean_common_prefix_tokens": sum(prefixes) / len(prefixes)})
    for node in [rows, *rows.values()]:
        for row in node.values() if isinstance(node, dict) else []:
            if isinstance(row, dict):
                row.pop("token_ids", None)
    return checks


def _common_prefix(a: list[int], b: list[int]) -> int:
    length = 0
    while length < min(len(a), len(b)) and a[length] == b[length]:
        length += 1
    return length


# --- goals ----------------------------------------------------------------------------------

def goals(rows: dict) -> list[dict]:
    """The throughput goals, for each of our rows (engine, http) that ran."""
    def tps(*path):
        node = rows
        for key in path:
            node = node.get(key) if isinstance(node, dict) else None
        return node

    checks = []
    for ours in ("engine", "http"):
        if ours not in rows:
            continue
        batched = tps(ours, "batched", "output_tokens_per_s")
        single = tps(ours, "single", "output_tokens_per_s")
        checks += [
            common.goal(f"{ours} batched / hf_generate batched", common.ratio(
                batched, tps("hf_generate", "output_tokens_per_s")), 2.5),
            common.goal(f"{ours} batched / hf_generate_batch", common.ratio(
                batched, tps("hf_generate_batch", "output_tokens_per_s")), 1.2),
            common.goal(f"{ours} alone / hf_generate batch 1", common.ratio(
                single, tps("hf_single", "output_tokens_per_s")), 1.0)]
    return checks


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    threads = common.set_threads(args.threads)
    common.log(f"rows {', '.join(args.rows)}; {args.requests} requests x {args.prompt_tokens} "
               f"prompt tokens, {args.output_tokens} output tokens")
    rows: dict = {}
    dtype = None
    tokenizer = None
    if any(row != "http" for row in args.rows):
        loaded = common.load(args.model, args.dtype)
        dtype, tokenizer = loaded.dtype, loaded.tokenizer
    else:
        from workers.model_source import load_tokenizer
        tokenizer = load_tokenizer("embedded" if args.model == common.TINY_MODEL else args.model)
    prompts = common.text_prompts(tokenizer, args.requests, args.prompt_tokens)
    if "http" in args.rows:
        rows["http"] = asyncio.run(http_rows(args.url, prompts, args.output_tokens))
    if "engine" in args.rows:
        rows["engine"] = engine_rows(loaded, prompts, args)
    if any(row.startswith("hf_") for row in args.rows):
        rows.update(hf_rows(common.load(args.model, args.dtype), prompts, args))
    result = {"benchmark": "throughput", "machine": common.machine_info(dtype),
              "threads": threads, "model": args.model, "quick": args.quick,
              "workload": {"requests": args.requests, "prompt_tokens": args.prompt_tokens,
                           "output_tokens": args.output_tokens, "greedy": True,
                           "ignore_eos": True,
                           "max_num_batched_tokens": args.max_num_batched_tokens},
              "token_agreement": token_agreement(rows), "rows": rows, "goals": goals(rows)}
    common.log_goals(result["goals"])
    common.write_json(result, args.out)
    return result


if __name__ == "__main__":
    main()
