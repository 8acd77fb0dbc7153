"""TTFT of a 1,024-token prompt: cold, and with its first 992 tokens in the prefix cache.

Two modes:
- engine (default): one LLMEngine in this process; TTFT = from queueing the request to its
  first sampled token. Also records the engine's start-up time (model load from the local
  cache, weights digest, KV allocation).
- ``--url http://127.0.0.1:8000``: a running server, through HTTP, the router and a worker;
  TTFT = from sending a streaming completion (token-id prompt) to its first text chunk.

Each trial uses fresh random token ids, so the cold run really misses. Writes JSON (median,
all samples, hit/miss ratio). Goal: hit TTFT ≤ 0.15 × miss TTFT.

``--evict-tokens N`` (HTTP mode) sends N tokens of fresh filler prompts between the cold and
the warm request, untimed, so the warm request's prefix has left the working KV cache: with
``nalar serve --kv-tier-mib`` it comes back from the second tier (goal: ≤ 0.3 × miss), without
one it misses.

    .venv/bin/python benchmarks/prefix_ttft.py [--trials 5] [--dtype float32] [--url URL]
        [--evict-tokens N]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from pathlib import Path

PROMPT_TOKENS = 1024
CACHED_TOKENS = 992
TOKEN_RANGE = (100, 40000)


def prompt_pair(rng: random.Random) -> tuple[list[int], list[int]]:
    """A cold prompt and a second one sharing its first CACHED_TOKENS tokens."""
    cold = [rng.randrange(*TOKEN_RANGE) for _ in range(PROMPT_TOKENS)]
    fresh_tail = [rng.randrange(*TOKEN_RANGE) for _ in range(PROMPT_TOKENS - CACHED_TOKENS)]
    return cold, cold[:CACHED_TOKENS] + fresh_tail


def engine_mode(args: argparse.Namespace) -> dict:
    from contract.request import GenerationRequest, SamplingParams
    from workers.config import EngineConfig
    from workers.engine import LLMEngine

    started = time.perf_counter()
    engine = LLMEngine(EngineConfig(dtype=args.dtype, kv_cache_bytes=256 << 20,
                                    num_threads=args.threads))
    startup_s = time.perf_counter() - started

    def ttft(token_ids: list[int], request_id: str) -> tuple[float, int]:
        engine.add_request(GenerationRequest(request_id, token_ids,
                                             SamplingParams(temperature=0, max_tokens=1)))
        begin = time.perf_counter()
        chunks = []
        while engine.has_work():
            chunks += engine.step()
        return time.perf_counter() - begin, chunks[0].cached_tokens

    rng = random.Random(args.seed)
    ttft(prompt_pair(rng)[0], "warmup")
    samples = []
    for trial in range(args.trials):
        cold, warm = prompt_pair(rng)
        miss_s, miss_cached = ttft(cold, f"miss-{trial}")
        hit_s, hit_cached = ttft(warm, f"hit-{trial}")
        samples.append({"miss_s": miss_s, "hit_s": hit_s, "miss_cached_tokens": miss_cached,
                        "hit_cached_tokens": hit_cached})
    return {"mode": "engine", "dtype": str(engine.loaded.dtype), "engine_startup_s": startup_s,
            "samples": samples}


def http_ttft(client, token_ids: list[int], **fields) -> tuple[float, int, str]:
    """TTFT in seconds of a streamed one-token completion of ``token_ids`` through HTTP
    (``client``: an ``httpx.Client`` of the server), its cached tokens and the worker that
    served it; ``fields`` are added to the body."""
    body = {"prompt": token_ids, "max_tokens": 1, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, **fields}
    begin = time.perf_counter()
    first = None
    cached = -1
    with client.stream("POST", "/v1/completions", json=body, timeout=300) as response:
        response.raise_for_status()
        worker = response.headers.get("x-nalar-worker", "")
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk["choices"]:
                first = time.perf_counter() - begin
            if chunk.get("usage"):
                cached = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
    return first, cached, worker


def http_mode(args: argparse.Namespace) -> dict:
    import httpx

    ttft = http_ttft
    rng = random.Random(args.seed)
    samples = []
    with httpx.Client(base_url=args.url) as client:
        ttft(client, prompt_pair(rng)[0])
        for _ in range(args.trials):
            cold, warm = prompt_pair(rng)
            miss_s, miss_cached, miss_worker = ttft(client, cold)
            for _ in range(-(-args.evict_tokens // PROMPT_TOKENS)):
                ttft(client, prompt_pair(rng)[0])
            hit_s, hit_cached, hit_worker = ttft(client, warm)
            samples.append({"miss_s": miss_s, "hit_s": hit_s, "miss_cached_tokens": miss_cached,
                            "hit_cached_tokens": hit_cached,
                            "same_worker": miss_worker == hit_worker})
    return {"mode": "http", "url": args.url, "evict_tokens": args.evict_tokens,
            "samples": samples}


def summarize(result: dict) -> dict:
    miss = statistics.median(s["miss_s"] for s in result["samples"])
    hit = statistics.median(s["hit_s"] for s in result["samples"])
    result.update({"prompt_tokens": PROMPT_TOKENS, "cached_prefix_tokens": CACHED_TOKENS,
                   "miss_ttft_median_s": miss, "hit_ttft_median_s": hit,
                   "hit_over_miss": hit / miss,
                   # a hit after an eviction comes back from the second tier: goal 0.3
                   "goal_hit_over_miss": 0.3 if result.get("evict_tokens") else 0.15,
                   "machine": platform.processor() or platform.machine()})
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--url", default=None, help="measure a running server instead")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--evict-tokens", type=int, default=0,
                        help="HTTP mode: filler tokens sent between the cold and the warm "
                             "request, to push the prefix out of the working KV cache")
    parser.add_argument("--out", default="benchmarks/out/prefix_ttft.json")
    args = parser.parse_args()
    result = summarize(http_mode(args) if args.url else engine_mode(args))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"miss TTFT {result['miss_ttft_median_s'] * 1000:.0f} ms, hit TTFT "
          f"{result['hit_ttft_median_s'] * 1000:.0f} ms, ratio {result['hit_over_miss']:.3f} "
          f"(goal ≤ {result['goal_hit_over_miss']}) → {out}")


if __name__ == "__main__":
    main()
