"""A worker's memory under prompts of every length: RSS of an in-process engine kept busy with
soak-like requests (mixed prompt lengths, random sampling settings), sampled through the run.

oneDNN and ideep keep a primitive per operation shape (``workers/models/linear.py``), so what
matters is whether new prompt and context lengths keep adding shapes. ``--lengths fixed``
gives every prompt the same length (a control: nothing new after the first requests);
``--default-caches`` leaves both caches at oneDNN's default of 1,024 primitives instead of
the engine's bound (the A/B). The figure is the RSS slope over the second half of the run
(MiB per minute), as in the soak.

    .venv/bin/python benchmarks/memory_growth.py [--duration 300] [--lengths mixed|fixed]
        [--default-caches] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import random
import time

try:
    from benchmarks import common
except ImportError:  # run as a script: benchmarks/ is on sys.path, the repo root is not
    import common

PAGE_BYTES = 4096


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common.add_common_args(parser, "memory_growth")
    parser.add_argument("--duration", type=float, default=300.0, help="seconds of load")
    parser.add_argument("--lengths", choices=("mixed", "fixed"), default="mixed",
                        help="mixed: 20-300 tokens, 15%% 800-950; fixed: every prompt 200")
    parser.add_argument("--default-caches", action="store_true",
                        help="oneDNN's and ideep's caches at 1,024 primitives (the old bound)")
    parser.add_argument("--concurrency", type=int, default=8, help="requests kept in flight")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--sample-period", type=float, default=10.0, help="seconds")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.quick:
        args.duration, args.sample_period, args.max_model_len = 3.0, 0.5, 128
        args.kv_cache_mib, args.concurrency = 16, 4
    return args


def rss_mib() -> float:
    """This process's resident set (MiB), from ``/proc/self/statm``."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * PAGE_BYTES / 2**20


class Prompts:
    """Soak-like requests: prompt lengths mixed (or fixed) and random sampling settings."""

    def __init__(self, args: argparse.Namespace, vocab_size: int):
        self.rng = random.Random(args.seed)
        self.fixed = args.lengths == "fixed"
        self.vocab_size = vocab_size
        self.max_model_len = args.max_model_len
        self.count = 0

    def next(self):
        from contract.request import GenerationRequest, SamplingParams
        rng, room = self.rng, self.max_model_len - 70
        if self.fixed:
            length = min(200, room)
        elif rng.random() < 0.15:
            length = rng.randint(min(800, room), min(950, room))
        else:
            length = rng.randint(min(20, room), min(300, room))
        sampling = SamplingParams(temperature=rng.choice([0.0, 0.7, 1.0]),
                                  top_p=rng.choice([1.0, 0.9]), top_k=rng.choice([0, 40]),
                                  max_tokens=rng.randint(8, 64), seed=rng.randrange(1000),
                                  ignore_eos=True)
        self.count += 1
        return GenerationRequest(f"m{self.count}",
                                 [rng.randrange(self.vocab_size) for _ in range(length)],
                                 sampling)


def second_half_slope(samples: list[dict]) -> float | None:
    """Least-squares slope of RSS (MiB/min) over the samples of the run's second half."""
    half = [s for s in samples if s["t_s"] >= samples[-1]["t_s"] / 2]
    if len(half) < 2:
        return None
    mean_t = sum(s["t_s"] for s in half) / len(half)
    mean_r = sum(s["rss_mib"] for s in half) / len(half)
    spread = sum((s["t_s"] - mean_t) ** 2 for s in half)
    covariance = sum((s["t_s"] - mean_t) * (s["rss_mib"] - mean_r) for s in half)
    return 60 * covariance / spread if spread else None


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    threads = common.set_threads(args.threads)
    if args.default_caches:
        from workers.models.linear import PRIMITIVE_CACHES
        os.environ.update(dict.fromkeys(PRIMITIVE_CACHES, "1024"))  # the engine keeps these
    loaded = common.load(args.model, args.dtype)
    engine = common.build_engine(loaded, threads=threads, max_model_len=args.max_model_len,
                                 kv_cache_mib=args.kv_cache_mib)
    prompts = Prompts(args, loaded.model.config.vocab_size)
    samples = [{"t_s": 0.0, "rss_mib": round(rss_mib(), 1)}]
    steps, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < args.duration:
        while len(engine.load_by_request()) < args.concurrency:
            engine.add_request(prompts.next())
        engine.step()
        engine.drain_events()  # a worker publishes them; left here they would pile up
        steps += 1
        if elapsed - samples[-1]["t_s"] >= args.sample_period:
            samples.append({"t_s": round(elapsed, 2), "rss_mib": round(rss_mib(), 1)})
            common.log(f"{samples[-1]}  requests {prompts.count}  steps {steps}")
    slope = second_half_slope(samples)
    result = {"benchmark": "memory_growth", "machine": common.machine_info(loaded.dtype),
              "settings": {k: v for k, v in vars(args).items() if k != "out"},
              "requests": prompts.count, "steps": steps,
              "rss_first_mib": samples[0]["rss_mib"], "rss_last_mib": samples[-1]["rss_mib"],
              "slope_second_half_mib_per_min": slope, "samples": samples}
    common.log(f"RSS {samples[0]['rss_mib']} -> {samples[-1]['rss_mib']} MiB, second-half "
               f"slope {slope} MiB/min over {prompts.count} requests")
    common.write_json(result, args.out)
    return result


if __name__ == "__main__":
    main()
