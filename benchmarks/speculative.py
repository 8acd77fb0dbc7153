"""Speculative decoding on copy-heavy real input: decode tokens/s with and without drafts.

Workload: chat prompts (the tokenizer's chat template, as the OpenAI ingress applies
it) that ask the model to rewrite a real function of the Python standard library, read from
the source files on this machine (:func:`stdlib_functions`: functions of 15-60 lines, taken in
turn from :data:`STDLIB_MODULES`), adding a docstring or comments. Greedy, EOS honoured (every
variant stops at the same token, since greedy output must not depend on speculation), at most
--output-tokens tokens. Rows, all on the same prompts in the same run:

- ``engine_off``: our LLMEngine without speculation.
- ``engine_ngram_adaptive``: ``ngram`` prompt lookup with the adaptive draft-length controller
  (k <= --k-max; the served default).
- ``engine_ngram_k<K>``: ``ngram`` with the controller off, always k = --fixed-k.
- ``hf_plain`` and ``hf_prompt_lookup``: transformers ``generate`` at batch 1, greedy, plain and
  with ``prompt_lookup_num_tokens`` (--hf-lookup-tokens), same threads.

The engine rows run each prompt alone (batch 1) and --concurrency prompts at once; the
transformers rows at batch 1. A last section runs general chat prompts that do not copy
(:data:`CHAT_QUESTIONS`) with and without adaptive speculation.

Decode tokens/s = output tokens after the first / time from the first output token to the
last (prefill excluded). With transformers the first token's time is its streamer's first
``put`` of generated tokens (with prompt lookup, that forward pass may already commit several
tokens; they count as prefill output). With --concurrency requests, decode tokens/s counts the
tokens committed after every request has its first token, over that window. Each timed figure
is the median of --repeats runs; the variants alternate within each repeat.

Goals: batch 1 decode tokens/s >= 2x no speculation and >= 1.3x transformers prompt
lookup; general chat >= 0.95x no speculation; greedy ids identical with and without
speculation on every prompt.

    .venv/bin/python benchmarks/speculative.py [--prompts 4] [--threads 2] [--quick]

The default sizes (4 prompts, 64 output tokens, 2 chat prompts of 48 tokens, 3 repeats) keep a
run near 10 minutes on 2 AVX2 cores in fp32 (about 11 tokens/s without speculation); longer
outputs copy more (--output-tokens 160 for a longer run).
"""

from __future__ import annotations

import argparse
import ast
import os
import statistics
import sysconfig
import time
from pathlib import Path

import torch

try:
    from benchmarks import common
except ImportError:  # run as a script: benchmarks/ is on sys.path, the repo root is not
    import common

STDLIB_MODULES = ("textwrap", "shlex", "fnmatch", "glob", "difflib", "calendar", "csv",
                  "configparser", "string", "heapq", "base64", "posixpath")
"""Standard-library modules whose functions are rewritten, taken in turn in this order."""

INSTRUCTIONS = (
    "Rewrite this Python function, adding a docstring that explains its arguments and "
    "return value. Reply with the complete function.",
    "Add a docstring to the following Python function and return the whole function.",
    "Rewrite this Python function with a docstring and a comment on each step.",
)
"""What each copy-heavy prompt asks for, in turn."""

CHAT_QUESTIONS = (
    "What are three tips for staying focused while studying?",
    "Why is the sky blue? Explain briefly.",
    "Suggest a name for a small bakery and say why.",
    "What should I pack for a weekend hiking trip?",
    "How do bees make honey?",
    "Give me a short poem about autumn rain.",
    "What is the difference between weather and climate?",
    "How can I be kinder to myself when I make mistakes?",
)
"""General chat prompts that give the model little to copy."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common.add_common_args(parser, "speculative")
    parser.add_argument("--prompts", type=int, default=4,
                        help="copy-heavy prompts (standard-library functions)")
    parser.add_argument("--output-tokens", type=int, default=64,
                        help="max_tokens of the copy-heavy prompts")
    parser.add_argument("--concurrency", type=int, default=4,
                        help="requests at once in the concurrent engine rows")
    parser.add_argument("--chat-prompts", type=int, default=2,
                        help=f"general chat prompts (at most {len(CHAT_QUESTIONS)})")
    parser.add_argument("--chat-tokens", type=int, default=48,
                        help="max_tokens of the general chat prompts")
    parser.add_argument("--k-max", type=int, default=4,
                        help="k_max of the adaptive controller (the served default)")
    parser.add_argument("--fixed-k", type=int, default=4, help="k of the fixed-k row")
    parser.add_argument("--hf-lookup-tokens", type=int, default=10,
                        help="transformers' prompt_lookup_num_tokens")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    if args.quick:
        args.prompts, args.output_tokens, args.concurrency = 2, 12, 2
        args.chat_prompts, args.chat_tokens, args.repeats = 1, 8, 1
        args.kv_cache_mib = 32
    args.chat_prompts = min(args.chat_prompts, len(CHAT_QUESTIONS))
    return args


# --- prompts ---------------------------------------------------------------------------------

def stdlib_functions(count: int, min_lines: int = 15,
                     max_lines: int = 60) -> list[tuple[str, str]]:
    """``count`` ``(module.qualname, source)`` pairs: functions (and methods) of ``min_lines``
    to ``max_lines`` lines from the standard library's source files, read with :mod:`ast`.

    The modules of :data:`STDLIB_MODULES` are taken in turn (the first qualifying function of
    each, then the second of each, ...), so the prompts differ in style; deterministic for a
    given Python version.

    Raises:
        ValueError: fewer than ``count`` functions qualify.
    """
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    per_module: list[list[tuple[str, str]]] = []
    for module in STDLIB_MODULES:
        path = stdlib / f"{module}.py"
        if not path.exists():
            continue
        source = path.read_text(encoding="utf-8")
        found = []
        for node in _functions(ast.parse(source)):
            lines = node[1].end_lineno - node[1].lineno + 1
            if min_lines <= lines <= max_lines:
                segment = ast.get_source_segment(source, node[1], padded=True)
                found.append((f"{module}.{node[0]}", _dedent(segment)))
        per_module.append(found)
    picked: list[tuple[str, str]] = []
    for rank in range(max(map(len, per_module), default=0)):
        for found in per_module:
            if rank < len(found) and len(picked) < count:
                picked.append(found[rank])
    if len(picked) < count:
        raise ValueError(f"only {len(picked)} standard-library functions of {min_lines}-"
                         f"{max_lines} lines found, {count} wanted")
    return picked


def _functions(tree: ast.Module):
    """``(qualname, node)`` of every top-level function and method, in source order."""
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            yield node.name, node
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef):
                    yield f"{node.name}.{item.name}", item


def _dedent(segment: str) -> str:
    import textwrap
    return textwrap.dedent(segment)


def chat_ids(tokenizer, content: str) -> list[int]:
    """Token ids of one user message under the chat template, the assistant's turn opened
    (what the OpenAI ingress sends a worker for /v1/chat/completions)."""
    from router.api.prompts import plain_token_ids
    return plain_token_ids(tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=True))


def copy_prompts(tokenizer, count: int) -> list[dict]:
    """The copy-heavy prompts: ``{"name", "lines", "prompt"}`` (token ids) each."""
    prompts = []
    for i, (name, source) in enumerate(stdlib_functions(count)):
        text = f"{INSTRUCTIONS[i % len(INSTRUCTIONS)]}\n\n```python\n{source}```"
        prompts.append({"name": name, "lines": source.count("\n"),
                        "prompt": chat_ids(tokenizer, text)})
    return prompts


# --- our engine ------------------------------------------------------------------------------

class SpecRun(common.EngineRun):
    """:class:`common.EngineRun` that also keeps each request's speculative counts (the
    ``spec`` of its last chunk)."""

    def __init__(self, engine):
        super().__init__(engine)
        self.spec: dict[str, object] = {}

    def step(self) -> None:
        begin = time.perf_counter()
        chunks = self.engine.step()
        end = time.perf_counter()
        for chunk in chunks:
            self.arrivals[chunk.request_id] += [end] * len(chunk.token_ids)
            self.token_ids[chunk.request_id] += chunk.token_ids
            if chunk.spec is not None:
                self.spec[chunk.request_id] = chunk.spec
        self.steps.append([round(end - self.start, 4), round((end - begin) * 1000, 2)])


def build_engines(loaded, args: argparse.Namespace) -> dict:
    """The three engine variants over one loaded model (the runner only reads its weights)."""
    from workers.config import EngineConfig
    from workers.engine import LLMEngine
    from workers.speculative.config import SpeculativeConfig
    specs = {"engine_off": SpeculativeConfig(),
             "engine_ngram_adaptive": SpeculativeConfig(
                 method="ngram", num_speculative_tokens=args.k_max, adaptive=True),
             f"engine_ngram_k{args.fixed_k}": SpeculativeConfig(
                 method="ngram", num_speculative_tokens=args.fixed_k, adaptive=False)}
    dtype = str(loaded.dtype).removeprefix("torch.")
    return {name: LLMEngine(EngineConfig(dtype=dtype, device="cpu",
                                         kv_cache_bytes=args.kv_cache_mib << 20,
                                         num_threads=args.threads, speculative=spec),
                            loaded=loaded)
            for name, spec in specs.items()}


def engine_run(engine, prompts: list[list[int]], max_tokens: int, tag: str) -> dict:
    """All ``prompts`` at once on ``engine`` (cold prefix cache), to completion.

    Returns:
        ``decode_tokens``, ``decode_s`` (see the module docstring), ``output_tokens``,
        ``wall_s``, ``token_ids`` (per prompt) and ``spec`` (per prompt, or None).
    """
    from contract.request import GenerationRequest, SamplingParams
    engine.reset_prefix_cache()
    run = SpecRun(engine)
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts, strict=True):
        run.add(GenerationRequest(rid, list(prompt),
                                  SamplingParams(temperature=0, max_tokens=max_tokens)))
    wall_s = run.run()
    arrivals = [run.arrivals[rid] for rid in ids]
    all_started = max(times[0] for times in arrivals)
    end = max(times[-1] for times in arrivals)
    decode_tokens = sum(1 for times in arrivals for t in times if t > all_started)
    if len(prompts) == 1:  # alone: every token after the first (a step may commit several)
        decode_tokens = len(arrivals[0]) - 1
    return {"decode_tokens": decode_tokens, "decode_s": end - all_started,
            "output_tokens": run.output_tokens(), "wall_s": wall_s,
            "token_ids": [run.token_ids[rid] for rid in ids],
            "spec": [run.spec.get(rid) for rid in ids]}


# --- transformers ----------------------------------------------------------------------------

class TimingStreamer:
    """A transformers streamer that stamps every ``put``: the first holds the prompt, each
    later one the tokens a decoding step committed."""

    def __init__(self):
        self.puts: list[tuple[float, int]] = []

    def put(self, value) -> None:
        self.puts.append((time.perf_counter(), int(value.numel())))

    def end(self) -> None:
        pass


@torch.inference_mode()
def hf_run(model, prompt: list[int], max_tokens: int, eos_id: int, pad_id: int,
           lookup_tokens: int | None) -> dict:
    """transformers ``generate`` at batch 1, greedy, stopping at EOS like our engine; with
    ``lookup_tokens``, prompt lookup decoding (``prompt_lookup_num_tokens``)."""
    from transformers import GenerationConfig
    config = GenerationConfig(max_new_tokens=max_tokens, do_sample=False, eos_token_id=eos_id,
                              pad_token_id=pad_id, prompt_lookup_num_tokens=lookup_tokens)
    streamer = TimingStreamer()
    ids = torch.tensor([prompt])
    begin = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config,
                         streamer=streamer)
    wall_s = time.perf_counter() - begin
    generated = out[0, len(prompt):].tolist()
    first_time, first_count = streamer.puts[1]
    return {"decode_tokens": len(generated) - first_count,
            "decode_s": streamer.puts[-1][0] - first_time, "output_tokens": len(generated),
            "wall_s": wall_s, "token_ids": [generated], "spec": [None]}


# --- runs ------------------------------------------------------------------------------------

def timed_rows(variants: dict, groups: list[list[int]], repeats: int, label: str) -> dict:
    """Run every variant on every prompt group, ``repeats`` times, variants alternating (the
    order rotates each repeat). ``variants`` maps a name to ``fn(prompts, tag) -> run dict``.

    Returns:
        name → ``{"runs": [per repeat: [per group run]]}``.
    """
    names = list(variants)
    results: dict = {name: {"runs": []} for name in names}
    for repeat in range(repeats):
        order = names[repeat % len(names):] + names[:repeat % len(names)]
        for name in order:
            runs = [variants[name](group, f"{label}-{name}-{repeat}-{g}")
                    for g, group in enumerate(groups)]
            results[name]["runs"].append(runs)
            tps = _tokens_per_s(runs)
            common.log(f"{label} repeat {repeat + 1}/{repeats} {name}: "
                       f"{tps:.2f} decode tokens/s")
    return results


def _tokens_per_s(runs: list[dict]) -> float | None:
    seconds = sum(r["decode_s"] for r in runs)
    return sum(r["decode_tokens"] for r in runs) / seconds if seconds > 0 else None


def summarise(rows: dict, baseline: str | None = None) -> dict:
    """Median decode tokens/s per row (per repeat: all prompts' decode tokens / their decode
    seconds), its ratio to ``baseline``, per-prompt medians, and speculative counts."""
    out = {}
    for name, row in rows.items():
        per_repeat = [_tokens_per_s(runs) for runs in row["runs"]]
        first = row["runs"][0]
        per_prompt = []
        for g in range(len(first)):
            samples = [_tokens_per_s([runs[g]]) for runs in row["runs"]]
            per_prompt.append(statistics.median(samples))
        out[name] = {
            "decode_tokens_per_s": statistics.median(per_repeat),
            "decode_tokens_per_s_repeats": per_repeat,
            "decode_tokens_per_s_per_group": per_prompt,
            "output_tokens_per_s": statistics.median(
                sum(r["output_tokens"] for r in runs) / sum(r["wall_s"] for r in runs)
                for runs in row["runs"]),
            "output_tokens": sum(r["output_tokens"] for r in first),
            "decode_tokens": sum(r["decode_tokens"] for r in first),
            "spec": spec_summary([s for runs in row["runs"] for r in runs for s in r["spec"]]),
        }
    if baseline in out:
        for row in out.values():
            row[f"speedup_vs_{baseline}"] = common.ratio(
                row["decode_tokens_per_s"], out[baseline]["decode_tokens_per_s"])
    return out


def spec_summary(usages: list) -> dict | None:
    """Speculative counts summed over requests (all repeats): acceptance rate, mean accepted
    length per verification step, acceptance per position, k decisions, draft/verify time."""
    usages = [u for u in usages if u is not None]
    if not usages:
        return None
    proposed = sum(u.proposed_tokens for u in usages)
    accepted = sum(u.accepted_tokens for u in usages)
    steps = sum(u.verification_steps for u in usages)
    width = max(len(u.proposed_by_position) for u in usages)
    by_pos_p = [sum(u.proposed_by_position[i] for u in usages
                    if i < len(u.proposed_by_position)) for i in range(width)]
    by_pos_a = [sum(u.accepted_by_position[i] for u in usages
                    if i < len(u.accepted_by_position)) for i in range(width)]
    decisions: dict[int, int] = {}
    for u in usages:
        for k, n in u.k_decisions.items():
            decisions[k] = decisions.get(k, 0) + n
    return {"requests": len(usages), "proposed_tokens": proposed, "accepted_tokens": accepted,
            "verification_steps": steps,
            "acceptance_rate": accepted / proposed if proposed else None,
            "mean_accepted_length": accepted / steps if steps else None,
            "acceptance_by_position": [a / p if p else None
                                       for a, p in zip(by_pos_a, by_pos_p, strict=True)],
            "k_decisions": dict(sorted(decisions.items())),
            "draft_s": sum(u.draft_s for u in usages),
            "verify_s": sum(u.verify_s for u in usages)}


# --- greedy equality -------------------------------------------------------------------------

def outputs(row: dict) -> list[list[int]]:
    """Per prompt token ids of a row's first repeat (groups flattened, in prompt order)."""
    return [ids for run in row["runs"][0] for ids in run["token_ids"]]


def deterministic(row: dict) -> bool:
    """Whether every repeat of the row produced the same token ids."""
    first = outputs(row)
    return all([ids for run in runs for ids in run["token_ids"]] == first
               for runs in row["runs"])


def compare(ours: list[list[int]], theirs: list[list[int]], prompts: list[list[int]],
            names: list[str], margin_model=None) -> dict:
    """Per prompt: identical or where the two outputs part (position, both tokens, and, with
    ``margin_model``, the reference model's top-1 minus top-2 logit there)."""
    parts = []
    for name, prompt, a, b in zip(names, prompts, ours, theirs, strict=True):
        at = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                  None if len(a) == len(b) else min(len(a), len(b)))
        if at is None:
            continue
        part = {"prompt": name, "position": at, "tokens": [a[at:at + 1], b[at:at + 1]],
                "lengths": [len(a), len(b)]}
        if margin_model is not None:
            part["logit_margin"] = logit_margin(margin_model, prompt + a[:at])
        parts.append(part)
    return {"identical": len(ours) - len(parts), "prompts": len(ours), "parted": parts}


@torch.inference_mode()
def logit_margin(model, ids: list[int]) -> float:
    """Top-1 minus top-2 logit of the next token after ``ids`` (one transformers forward)."""
    logits = model(torch.tensor([ids]), logits_to_keep=1).logits[0, -1].float()
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


def strip_runs(rows: dict) -> None:
    """Drop the raw runs (token ids, usage objects) once summarised."""
    for row in rows.values():
        row.pop("runs", None)


# --- main ------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    threads = common.set_threads(args.threads)
    load_before = os.getloadavg()
    loaded = common.load(args.model, args.dtype)
    tokenizer = loaded.tokenizer
    prompts = copy_prompts(tokenizer, args.prompts)
    prompt_ids = [p["prompt"] for p in prompts]
    names = [p["name"] for p in prompts]
    common.log(f"{len(prompts)} copy-heavy prompts ({', '.join(names)}), "
               f"{min(map(len, prompt_ids))}-{max(map(len, prompt_ids))} tokens, max_tokens "
               f"{args.output_tokens}; {threads} threads, {loaded.dtype}")
    engines = build_engines(loaded, args)
    common.set_threads(args.threads)
    hf = common.load(args.model, args.dtype)
    hf.model.set_attn_implementation("sdpa")
    eos_id = loaded.model.generation_config.eos_token_id
    eos_id = eos_id[0] if isinstance(eos_id, list) else eos_id
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_id

    def engine_variant(engine, max_tokens):
        return lambda group, tag: engine_run(engine, group, max_tokens, tag)

    def hf_variant(lookup):
        return lambda group, tag: hf_run(hf.model, group[0], args.output_tokens, eos_id,
                                         pad_id, lookup)

    for name, engine in engines.items():  # warm-up, untimed
        engine_run(engine, prompt_ids[:1], 4, f"warmup-{name}")
    hf_run(hf.model, prompt_ids[0], 4, eos_id, pad_id, None)
    hf_run(hf.model, prompt_ids[0], 4, eos_id, pad_id, args.hf_lookup_tokens)

    alone = {name: engine_variant(engine, args.output_tokens)
             for name, engine in engines.items()}
    alone |= {"hf_plain": hf_variant(None), "hf_prompt_lookup": hf_variant(args.hf_lookup_tokens)}
    batch1 = timed_rows(alone, [[p] for p in prompt_ids], args.repeats, "batch 1")
    groups = [prompt_ids[i:i + args.concurrency]
              for i in range(0, len(prompt_ids), args.concurrency)]
    concurrent = timed_rows({name: engine_variant(engine, args.output_tokens)
                             for name, engine in engines.items()},
                            groups, args.repeats, f"{args.concurrency} concurrent")
    chat_prompt_ids = [chat_ids(tokenizer, q) for q in CHAT_QUESTIONS[:args.chat_prompts]]
    chat = timed_rows({name: engine_variant(engines[name], args.chat_tokens)
                       for name in ("engine_off", "engine_ngram_adaptive")},
                      [[p] for p in chat_prompt_ids], args.repeats, "general chat")

    fixed = f"engine_ngram_k{args.fixed_k}"
    off = outputs(batch1["engine_off"])
    equality = {
        f"{name} vs engine_off ({section})": compare(outputs(rows[name]), outputs(
            rows["engine_off"]), prompt_ids if section != "chat" else chat_prompt_ids,
            names if section != "chat" else list(CHAT_QUESTIONS[:args.chat_prompts]),
            hf.model)
        for section, rows in (("batch 1", batch1), ("concurrent", concurrent), ("chat", chat))
        for name in rows if name.startswith("engine_ngram")}
    equality["hf_prompt_lookup vs hf_plain (batch 1)"] = compare(
        outputs(batch1["hf_prompt_lookup"]), outputs(batch1["hf_plain"]), prompt_ids, names,
        hf.model)
    equality["hf_plain vs engine_off (batch 1)"] = compare(
        outputs(batch1["hf_plain"]), off, prompt_ids, names, hf.model)
    determinism = {f"{section}/{name}": deterministic(row)
                   for section, rows in (("batch 1", batch1), ("concurrent", concurrent),
                                         ("chat", chat)) for name, row in rows.items()}

    summary = {"batch_1": summarise(batch1, "engine_off"),
               f"concurrent_{args.concurrency}": summarise(concurrent, "engine_off"),
               "general_chat": summarise(chat, "engine_off")}
    for row in summary["batch_1"].values():
        row["speedup_vs_hf_prompt_lookup"] = common.ratio(
            row["decode_tokens_per_s"], summary["batch_1"]["hf_prompt_lookup"][
                "decode_tokens_per_s"])
        row["speedup_vs_hf_plain"] = common.ratio(
            row["decode_tokens_per_s"], summary["batch_1"]["hf_plain"]["decode_tokens_per_s"])
    for rows in (batch1, concurrent, chat):
        strip_runs(rows)
    b1 = summary["batch_1"]
    ours_vs_spec = [v for k, v in equality.items() if k.startswith("engine_ngram")]
    goals = [
        common.goal("batch 1 ngram adaptive / no speculation (decode tok/s)",
                    b1["engine_ngram_adaptive"]["speedup_vs_engine_off"], 2.0),
        common.goal(f"batch 1 ngram k={args.fixed_k} / no speculation (decode tok/s)",
                    b1[fixed]["speedup_vs_engine_off"], 2.0),
        common.goal("batch 1 ngram adaptive / transformers prompt lookup (decode tok/s)",
                    b1["engine_ngram_adaptive"]["speedup_vs_hf_prompt_lookup"], 1.3),
        common.goal(f"batch 1 ngram k={args.fixed_k} / transformers prompt lookup "
                    "(decode tok/s)", b1[fixed]["speedup_vs_hf_prompt_lookup"], 1.3),
        common.goal("general chat: ngram adaptive / no speculation (decode tok/s)",
                    summary["general_chat"]["engine_ngram_adaptive"]["speedup_vs_engine_off"],
                    0.95),
        common.goal("greedy ids identical with and without speculation (fraction of outputs)",
                    sum(e["identical"] for e in ours_vs_spec)
                    / max(1, sum(e["prompts"] for e in ours_vs_spec)), 1.0),
    ]
    result = {
        "benchmark": "speculative", "machine": common.machine_info(loaded.dtype),
        "threads": threads, "model": args.model, "quick": args.quick,
        "load_average": {"start": load_before, "end": os.getloadavg()},
        "workload": {"prompts": [{"name": p["name"], "lines": p["lines"],
                                  "prompt_tokens": len(p["prompt"])} for p in prompts],
                     "instructions": INSTRUCTIONS, "output_tokens": args.output_tokens,
                     "greedy": True, "ignore_eos": False, "concurrency": args.concurrency,
                     "chat_questions": CHAT_QUESTIONS[:args.chat_prompts],
                     "chat_tokens": args.chat_tokens, "k_max": args.k_max,
                     "fixed_k": args.fixed_k, "hf_prompt_lookup_num_tokens":
                         args.hf_lookup_tokens, "repeats": args.repeats,
                     "decode_tokens_per_s": "output tokens after the first / seconds from the "
                     "first output token to the last (concurrent: tokens committed after every "
                     "request's first token / that window); median over repeats"},
        "rows": summary, "greedy_equality": equality, "deterministic_repeats": determinism,
        "goals": goals}
    common.log_goals(goals)
    common.write_json(result, args.out)
    return result


if __name__ == "__main__":
    main()
