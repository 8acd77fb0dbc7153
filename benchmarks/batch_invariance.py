"""Whether a greedy answer depends on how its prompt was computed: alone or beside other
requests, from scratch or after a prefix-cache hit.

A prefix-cache hit, a second-tier load or a transfer reuses KV blocks computed in another step,
and the rest of the prompt is computed as a shorter chunk; a batch puts more rows in each step.
Either can change which kernel a linear layer takes (several are chosen by the step's row
count: AMX tiles, VNNI pairs, int8 activations below 32 rows on stored weights) and so the
rounding of every activation after it. In fp32 the paths agree to the bit; in bf16, or with
weights as stored, they need not, as in vLLM without its batch-invariant mode.

For each variant (``quantized_accuracy.VARIANTS``) and each of --prompts prompts of real text,
the reference is the prompt computed alone from an empty cache. Each condition runs the same
request again and is compared with it, token by token, up to the first token that differs:

- ``again``: alone from an empty cache (the run's own repeatability);
- ``cached``: alone, its prompt's blocks already in the cache (all but the last partial block
  reused);
- ``hit16``: alone, after a 17-token prompt put its first block in the cache (the rest of the
  prompt is one chunk starting at token 16, as after a one-block tier load or transfer);
- ``batch4``, ``batch16``: from an empty cache, beside 3 or 15 other prompts arriving with it;
- ``threads2``: alone from an empty cache, its prompt's step on two threads where the
  reference's ran on --threads (1 by default), its decode steps on --threads: as when a
  prompt's step borrows an idle worker's core (``workers/host_cores.py``).

It reports, per variant and condition, the share of identical outputs, the mean number of
tokens before the first difference, and the largest and median absolute difference of a
sampled token's logprob (nats) over the tokens before it (where both runs chose the same
token).

    .venv/bin/python benchmarks/batch_invariance.py [--variants dense-fp32,gguf-bf16]
        [--prompts 8] [--prompt-tokens 600] [--max-tokens 24] [--threads 1]

The machine needs two cores for ``threads2``.
"""

from __future__ import annotations

import argparse
import statistics

import torch

try:
    from benchmarks import common
    from benchmarks.quantized_accuracy import VARIANTS, load_variant, parse_variants
except ImportError:  # run as a script: benchmarks/ is on sys.path, the repo root is not
    import common
    from quantized_accuracy import VARIANTS, load_variant, parse_variants

CONDITIONS = ("again", "cached", "hit16", "batch4", "batch16", "threads2")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variants", default="dense-fp32,dense-bf16,gguf-fp32,gguf-bf16")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=600)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=str(common.OUT_DIR / "batch_invariance.json"))
    args = parser.parse_args(argv)
    if args.quick:
        args.prompts, args.prompt_tokens, args.max_tokens = 1, 40, 4
    args.variants = parse_variants(parser, args.variants)
    return args


class Runner:
    """Greedy requests with the sampled tokens' logprobs, through one engine."""

    def __init__(self, engine, max_tokens: int):
        self.engine, self.max_tokens, self.count = engine, max_tokens, 0

    def run(self, prompts: list[list[int]], cold: bool = True
            ) -> list[tuple[list[int], list[float]]]:
        """Each prompt's output tokens and their logprobs, all submitted together; ``cold``
        empties the prefix cache first."""
        if cold:
            self.engine.reset_prefix_cache()
        requests = [self.request(prompt) for prompt in prompts]
        chunks = self.engine.generate(requests)
        return [_output(chunks[r.request_id]) for r in requests]

    def request(self, prompt: list[int]):
        from contract.request import GenerationRequest, SamplingParams

        self.count += 1
        return GenerationRequest(f"invariance-{self.count}", list(prompt), SamplingParams(
            temperature=0, max_tokens=self.max_tokens, ignore_eos=True, logprobs=0))

    def prompt_on_two_threads(self, prompt: list[int]) -> tuple[list[int], list[float]]:
        """``prompt`` alone from an empty cache, the steps to its first token on two threads
        and the rest on the threads set before."""
        self.engine.reset_prefix_cache()
        self.engine.add_request(self.request(prompt))
        threads, chunks = torch.get_num_threads(), []
        torch.set_num_threads(2)
        try:
            while not any(chunk.token_ids for chunk in chunks):
                chunks += self.engine.step()
        finally:
            torch.set_num_threads(threads)
        while self.engine.has_work():
            chunks += self.engine.step()
        return _output(chunks)

    def condition(self, name: str, prompt: list[int], others: list[list[int]]
                  ) -> tuple[list[int], list[float]]:
        """``prompt``'s output under condition ``name`` (:data:`CONDITIONS`)."""
        if name == "again":
            return self.run([prompt])[0]
        if name == "cached":
            self.run([prompt])
            return self.run([prompt], cold=False)[0]
        if name == "hit16":
            self.run([prompt[:17]])
            return self.run([prompt], cold=False)[0]
        if name == "threads2":
            return self.prompt_on_two_threads(prompt)
        size = int(name.removeprefix("batch"))
        return self.run([prompt] + others[:size - 1])[0]


def _output(chunks) -> tuple[list[int], list[float]]:
    """A choice's output tokens and their logprobs, from its chunks."""
    return ([t for c in chunks for t in c.token_ids],
            [lp.logprob for c in chunks for lp in c.logprobs or []])


def compare(output: tuple[list[int], list[float]], reference: tuple[list[int], list[float]]
            ) -> tuple[bool, int, list[float]]:
    """Whether ``output`` equals ``reference``, the tokens before the first difference,
    and the absolute logprob differences over them (nats)."""
    (tokens, logprobs), (ref_tokens, ref_logprobs) = output, reference
    same = next((i for i, (a, b) in enumerate(zip(tokens, ref_tokens, strict=False)) if a != b),
                min(len(tokens), len(ref_tokens)))
    return (tokens == ref_tokens, same,
            [abs(a - b) for a, b in zip(logprobs[:same], ref_logprobs[:same], strict=True)])


def summarize(compared: list[tuple[bool, int, list[float]]]) -> dict:
    deltas = [d for _, _, ds in compared for d in ds]
    return {"identical_outputs": sum(same for same, _, _ in compared) / len(compared),
            "mean_tokens_before_first_difference":
                sum(n for _, n, _ in compared) / len(compared),
            "max_abs_logprob_difference": max(deltas, default=0.0),
            "median_abs_logprob_difference": statistics.median(deltas) if deltas else 0.0}


def measure_variant(name: str, args: argparse.Namespace) -> dict:
    loaded = load_variant(name)
    engine = common.build_engine(loaded, threads=args.threads, kv_cache_mib=256)
    prompts = common.text_prompts(loaded.tokenizer, args.prompts + 15, args.prompt_tokens)
    runner = Runner(engine, args.max_tokens)
    compared: dict[str, list] = {c: [] for c in CONDITIONS}
    for i, prompt in enumerate(prompts[:args.prompts]):
        others = prompts[i + 1:i + 16]
        reference = runner.run([prompt])[0]
        for name_ in CONDITIONS:
            compared[name_].append(compare(runner.condition(name_, prompt, others), reference))
    return {"quantization": VARIANTS[name][0], "dtype": VARIANTS[name][1],
            "linear_kernel": engine.runner.linear_kernel,
            "conditions": {c: summarize(v) for c, v in compared.items()}}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    threads = common.set_threads(args.threads)
    results = {}
    for name in args.variants:
        common.log(f"{name}: measuring")
        results[name] = measure_variant(name, args)
        for condition, row in results[name]["conditions"].items():
            common.log(f"  {condition:8s} identical {row['identical_outputs']:.0%}, first "
                       f"difference after {row['mean_tokens_before_first_difference']:.1f}, "
                       f"|dlogprob| max {row['max_abs_logprob_difference']:.4f} median "
                       f"{row['median_abs_logprob_difference']:.4f}")
    result = {"benchmark": "batch_invariance", "machine": common.machine_info(None),
              "threads": threads, "prompts": args.prompts, "prompt_tokens": args.prompt_tokens,
              "max_tokens": args.max_tokens, "quick": args.quick, "variants": results}
    common.write_json(result, args.out)
    return result


if __name__ == "__main__":
    main()
