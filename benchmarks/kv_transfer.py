"""TTFT of a 1,024-token prompt whose first 992 tokens are fetched from another worker, against
a miss on the same worker, through HTTP.

Needs a running server with two workers and a second tier (``nalar serve --workers 2
--kv-tier-mib 256``). Each trial: a fresh 992-token prefix is served once (its holder), then a
long answer on the same prefix keeps the holder busy, so the router sends the next prompt
sharing the prefix to the other worker, which fetches the prefix from the holder (timed: the
transfer), and a fresh prompt of the same length there (timed: the miss). Trials alternate
which of the two timed requests goes first. Goal: transfer TTFT ≤ 0.25 × miss. Writes JSON.

    .venv/bin/python benchmarks/kv_transfer.py --url http://127.0.0.1:8000 [--trials 5]
"""

from __future__ import annotations

import argparse
import random
import statistics
import threading
import time

import httpx
from common import machine_info, write_json
from prefix_ttft import CACHED_TOKENS, PROMPT_TOKENS, TOKEN_RANGE, http_ttft


def fresh(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(*TOKEN_RANGE) for _ in range(length)]


def keep_busy(url: str, tokens: list[int], holder: str, stop: threading.Event) -> None:
    """Streams a long answer on ``tokens`` until ``stop``; it must land on ``holder``."""
    body = {"prompt": tokens, "max_tokens": 1500, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.Client(base_url=url) as client, client.stream(
            "POST", "/v1/completions", json=body, timeout=300) as answer:
        if answer.status_code != 200:  # e.g. a context too short for the prompt + 1,500
            raise RuntimeError(f"the busy request was refused: {answer.status_code} "
                               f"{answer.read().decode()}")
        if answer.headers.get("x-nalar-worker") != holder:
            raise RuntimeError("the busy request did not land on the holder")
        for _ in answer.iter_lines():
            if stop.is_set():
                return


def trial(url: str, rng: random.Random, transfer_first: bool) -> dict:
    tail = PROMPT_TOKENS - CACHED_TOKENS
    shared = fresh(rng, CACHED_TOKENS)
    with httpx.Client(base_url=url) as client:
        _, _, holder = http_ttft(client, shared + fresh(rng, tail))
        stop = threading.Event()
        busy = threading.Thread(target=keep_busy, args=(url, shared + fresh(rng, tail),
                                                        holder, stop))
        busy.start()
        time.sleep(1.0)  # the holder's load reaches the router
        try:
            timed = {}
            order = ["transfer", "miss"] if transfer_first else ["miss", "transfer"]
            for kind in order:
                prompt = shared + fresh(rng, tail) if kind == "transfer" else fresh(
                    rng, PROMPT_TOKENS)
                timed[kind] = http_ttft(client, prompt)
        finally:
            stop.set()
            busy.join()
    return {"holder": holder,
            **{f"{kind}_s": value[0] for kind, value in timed.items()},
            **{f"{kind}_cached_tokens": value[1] for kind, value in timed.items()},
            **{f"{kind}_worker": value[2] for kind, value in timed.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="benchmarks/out/kv_transfer.json")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    with httpx.Client(base_url=args.url) as client:
        http_ttft(client, fresh(rng, PROMPT_TOKENS))  # warm-up
    samples = [trial(args.url, rng, n % 2 == 0) for n in range(args.trials)]
    valid = [s for s in samples if s["transfer_worker"] != s["holder"]
             and s["transfer_cached_tokens"] == CACHED_TOKENS]
    transfer = statistics.median(s["transfer_s"] for s in valid) if valid else None
    miss = statistics.median(s["miss_s"] for s in samples)
    result = {"prompt_tokens": PROMPT_TOKENS, "fetched_tokens": CACHED_TOKENS,
              "samples": samples, "trials_with_transfer": len(valid),
              "transfer_ttft_median_s": transfer, "miss_ttft_median_s": miss,
              "transfer_over_miss": transfer / miss if transfer else None,
              "goal_transfer_over_miss": 0.25, "machine": machine_info()}
    out = write_json(result, args.out)
    print(f"{len(valid)}/{len(samples)} trials fetched the prefix; transfer TTFT "
          f"{(transfer or 0) * 1000:.0f} ms, miss {miss * 1000:.0f} ms, ratio "
          f"{result['transfer_over_miss']} (goal ≤ 0.25) → {out}")


if __name__ == "__main__":
    main()
