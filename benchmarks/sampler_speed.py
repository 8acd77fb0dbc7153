"""Sampler time per step: the sort-based sampler this engine used before vs today's.

The baseline is a verbatim copy of the previous ``filtered_probs`` + ``torch.multinomial``
sampler, which sorted the whole vocabulary of every sampled row. Today's
(:func:`workers.sampler.sample`) draws by exponential race without sorting unless ``top_p`` is
set, and uses ``torch.topk`` for ``top_k``. Both run on random ``[B, V]`` float32 logits with
``V = 49152`` (SmolLM2's vocabulary) on one CPU thread by default.

    .venv/bin/python benchmarks/sampler_speed.py [--threads 1] [--repeats 30]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (  # noqa: E402
    OUT_DIR,
    log,
    machine_info,
    median_time,
    set_threads,
    write_json,
)
from contract.request import SamplingParams  # noqa: E402
from workers.sampler import SamplingRow, sample  # noqa: E402

VOCAB = 49152
CASES = {
    "temperature": SamplingParams(temperature=0.8),
    "top_k": SamplingParams(temperature=0.8, top_k=50),
    "min_p": SamplingParams(temperature=0.8, min_p=0.05),
    "top_p": SamplingParams(temperature=0.8, top_p=0.9),
    "top_k+top_p": SamplingParams(temperature=0.8, top_k=50, top_p=0.9),
    "greedy": SamplingParams(temperature=0.0),
}


def baseline_sample(logits: torch.Tensor, params: list[SamplingParams],
                    generator: torch.Generator) -> list[int]:
    """The previous sampler (commit 9d96ab1): sort, top-k mask, softmax, top-p, multinomial."""
    tokens = logits.argmax(dim=-1).tolist()
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    if not random_rows:
        return tokens
    rows = logits[random_rows]
    chosen = [params[i] for i in random_rows]
    temperature = torch.tensor([p.temperature for p in chosen])
    rows = rows / temperature.unsqueeze(1)
    sorted_logits, order = rows.sort(dim=-1, descending=True)
    vocab = rows.shape[-1]
    top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in chosen])
    ranks = torch.arange(vocab).unsqueeze(0)
    sorted_logits = sorted_logits.masked_fill(ranks >= top_k.unsqueeze(1), float("-inf"))
    sorted_probs = sorted_logits.softmax(dim=-1)
    top_p = torch.tensor([p.top_p for p in chosen])
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(mass_before >= top_p.unsqueeze(1), 0.0)
    sorted_probs = sorted_probs / sorted_probs.sum(dim=-1, keepdim=True)
    probs = torch.zeros_like(sorted_probs).scatter_(-1, order, sorted_probs)
    for row, row_probs in zip(random_rows, probs, strict=True):
        tokens[row] = int(torch.multinomial(row_probs, 1, generator=generator))
    return tokens


def measure(batch: int, params: SamplingParams, repeats: int) -> dict[str, float]:
    logits = torch.randn(batch, VOCAB, generator=torch.Generator().manual_seed(batch)) * 3
    generator = torch.Generator().manual_seed(0)
    rows = [SamplingRow(params) for _ in range(batch)]
    before = median_time(lambda: baseline_sample(logits, [params] * batch, generator), repeats)
    after = median_time(lambda: sample(logits, rows, generator), repeats)
    return {"before_ms": round(before * 1e3, 3), "after_ms": round(after * 1e3, 3),
            "speedup": round(before / after, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--batches", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--out", default=str(OUT_DIR / "sampler_speed.json"))
    args = parser.parse_args()
    threads = set_threads(args.threads)
    results = []
    for batch in args.batches:
        for name, params in CASES.items():
            figures = measure(batch, params, args.repeats)
            log(f"batch {batch:>2} {name:<12} {figures}")
            results.append({"batch": batch, "case": name, **figures})
    write_json({"benchmark": "sampler_speed", "vocab": VOCAB, "threads": threads,
                "repeats": args.repeats, "machine": machine_info("float32"),
                "results": results}, args.out)


if __name__ == "__main__":
    main()
