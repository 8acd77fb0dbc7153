"""What serving weights as stored costs in accuracy: greedy agreement with the dequantized model
and perplexity over a text, for each way of holding the embedded model's weights.

Variants (``--variants``): ``dense-fp32`` (the GGUF dequantized to float32: the reference),
``dense-bf16``, ``gguf-fp32`` and ``gguf-bf16`` (the Q4_1/Q8_0 tensors as stored, activations
in that dtype), ``int8-fp32`` (the dequantized model quantized again per channel).

- Greedy agreement: --prompts prompts of real text (standard-library source, 64 tokens each),
  --max-tokens greedy tokens each; per variant, the share of prompts whose output equals the
  reference's, and the mean number of tokens before the first difference.
- Perplexity: exp of the mean negative log-likelihood of --text's first --ppl-tokens tokens
  (default: the GPL-3 licence text Debian ships), each token predicted from all before it.
  The text is fed --ppl-chunk tokens a step through the engine's own runner, so the numerics
  are those of serving: chunk 1 is a decode step (int8 activations on stored GGUF weights),
  chunks of 32 or more take the prefill path (weights dequantized a layer at a time).

    .venv/bin/python benchmarks/quantized_accuracy.py [--variants dense-fp32,gguf-bf16]
        [--ppl-chunk 1] [--quick]
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch

try:
    from benchmarks import common
except ImportError:  # run as a script: benchmarks/ is on sys.path, the repo root is not
    import common

VARIANTS = {"dense-fp32": ("none", "float32"), "dense-bf16": ("none", "bfloat16"),
            "gguf-fp32": ("gguf", "float32"), "gguf-bf16": ("gguf", "bfloat16"),
            "int8-fp32": ("int8", "float32")}
"""Variant → (quantization, activation dtype)."""

REFERENCE = "dense-fp32"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--text", default="/usr/share/common-licenses/GPL-3")
    parser.add_argument("--ppl-tokens", type=int, default=512)
    parser.add_argument("--ppl-chunk", type=int, default=1, help="tokens fed a step")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=str(common.OUT_DIR / "quantized_accuracy.json"))
    args = parser.parse_args(argv)
    if args.quick:
        args.prompts, args.max_tokens, args.ppl_tokens = 2, 4, 24
    args.variants = parse_variants(parser, args.variants)
    if REFERENCE not in args.variants:
        args.variants.insert(0, REFERENCE)
    return args


def parse_variants(parser: argparse.ArgumentParser, text: str) -> list[str]:
    """The comma-separated ``--variants`` of :data:`VARIANTS`; exits through ``parser`` on an
    unknown one."""
    variants = [v for v in text.split(",") if v]
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}: use {sorted(VARIANTS)}")
    return variants


def load_variant(name: str):
    from workers.model_loader import load_model

    quantization, dtype = VARIANTS[name]
    if quantization == "int8":  # per channel, from the dequantized weights
        from workers.stored_weights import attach_int8_weights
        loaded = load_model("embedded", dtype=dtype, device="cpu")
        attach_int8_weights(loaded.model)
        loaded.quantization = "int8"
        return loaded
    return load_model("embedded", dtype=dtype, device="cpu", quantization=quantization)


def greedy_outputs(engine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Each prompt's greedy output, one request at a time (decode numerics of batch 1)."""
    outputs = []
    for i, prompt in enumerate(prompts):
        request = common.greedy_request(f"accuracy-{i}", prompt, max_tokens)
        chunks = engine.generate([request])[request.request_id]
        outputs.append([t for chunk in chunks for t in chunk.token_ids])
    return outputs


@torch.inference_mode()
def perplexity(engine, token_ids: list[int], chunk: int) -> float:
    """exp(mean NLL) of ``token_ids[1:]``, each predicted from the tokens before it, fed
    ``chunk`` tokens a step through the engine's runner (one sequence, its own blocks)."""
    from contract.request import GenerationRequest, SamplingParams
    from workers.scheduler import ScheduledBatch
    from workers.sequence import Sequence

    request = GenerationRequest("perplexity", token_ids, SamplingParams(max_tokens=1))
    seq = Sequence(request, bytes(32), engine.config.block_size)
    engine.block_manager.admit(seq, [], len(token_ids))
    nll = 0.0
    try:
        for start in range(0, len(token_ids) - 1, chunk):
            count = min(chunk, len(token_ids) - 1 - start)
            batch = ScheduledBatch()
            batch.add(seq, count)
            logits = engine.runner.execute(batch, [count])
            targets = torch.tensor(token_ids[start + 1:start + 1 + count])
            nll -= torch.log_softmax(logits, dim=-1).gather(1, targets[:, None]).sum().item()
            seq.num_computed_tokens += count
    finally:
        engine.block_manager.free(seq)
    return math.exp(nll / (len(token_ids) - 1))


def agreement(outputs: list[list[int]], reference: list[list[int]]) -> dict:
    """Share of identical outputs and mean tokens before the first difference."""
    prefix = []
    for out, ref in zip(outputs, reference, strict=True):
        same = next((i for i, (a, b) in enumerate(zip(out, ref, strict=False)) if a != b),
                    min(len(out), len(ref)))
        prefix.append(same)
    return {"identical_outputs": sum(o == r for o, r in zip(outputs, reference, strict=True))
            / len(reference), "mean_tokens_before_first_difference": sum(prefix) / len(prefix)}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    threads = common.set_threads(args.threads)
    results, reference_outputs, tokenizer = {}, None, None
    for name in args.variants:
        common.log(f"{name}: loading")
        loaded = load_variant(name)
        tokenizer = loaded.tokenizer
        engine = common.build_engine(loaded, threads=args.threads, kv_cache_mib=64)
        prompts = common.text_prompts(tokenizer, args.prompts, 64)
        outputs = greedy_outputs(engine, prompts, args.max_tokens)
        text_ids = tokenizer.encode(Path(args.text).read_text(), add_special_tokens=False)
        ppl = perplexity(engine, text_ids[:args.ppl_tokens], args.ppl_chunk)
        if name == REFERENCE:
            reference_outputs = outputs
        results[name] = {"quantization": VARIANTS[name][0], "dtype": VARIANTS[name][1],
                         "linear_kernel": engine.runner.linear_kernel, "perplexity": ppl,
                         **agreement(outputs, reference_outputs)}
        common.log(f"  perplexity {ppl:.3f}; identical greedy outputs "
                   f"{results[name]['identical_outputs']:.0%}, first difference after "
                   f"{results[name]['mean_tokens_before_first_difference']:.1f} tokens")
    result = {"benchmark": "quantized_accuracy", "machine": common.machine_info(None),
              "threads": threads, "reference": REFERENCE, "prompts": args.prompts,
              "max_tokens": args.max_tokens, "text": args.text, "ppl_tokens": args.ppl_tokens,
              "ppl_chunk": args.ppl_chunk, "quick": args.quick, "variants": results}
    common.write_json(result, args.out)
    return result


if __name__ == "__main__":
    main()
