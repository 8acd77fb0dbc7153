"""Shared pieces of the benchmark scripts: CLI flags, models, prompts, statistics, JSON.

Every script records the machine it ran on (:func:`machine_info`), builds its prompts from real
text (:func:`text_prompts`: Python standard library sources, tokenized and cut to length, so
runs are deterministic and need no network) and writes one JSON file (:func:`write_json`).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import platform
import subprocess
import sysconfig
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

OUT_DIR = Path(__file__).resolve().parent / "out"
"""Where every script writes by default (``--out``, plots, and the step profile
``draft_roundtrip.py`` reads): ``benchmarks/out/``, ignored by git, so a run never overwrites a
committed result. Committed runs live in ``benchmarks/results/<machine kind>/``."""
REPO_ROOT = Path(__file__).resolve().parent.parent
TINY_MODEL = "tiny"
"""``--model tiny``: a 2-layer random Llama with the embedded tokenizer, for smoke tests."""

STDLIB_SOURCES = ("argparse.py", "typing.py", "inspect.py", "subprocess.py", "pathlib.py",
                  "dataclasses.py", "functools.py", "tarfile.py", "shutil.py",
                  "logging/__init__.py")
"""Prompt text, in this order: large, stable files of the standard library."""

_INITIAL_THREADS = torch.get_num_threads()
"""torch's own default thread count, read before any script changes it."""


def add_common_args(parser: argparse.ArgumentParser, name: str) -> None:
    """Flags every script shares: model, dtype, threads, KV budget, quick mode, output path."""
    parser.add_argument("--model", default="embedded",
                        help=f"embedded (SmolLM2-135M), a model path, or {TINY_MODEL!r}")
    parser.add_argument("--dtype", default="auto", help="auto (bf16 where native), bfloat16, "
                        "float32")
    parser.add_argument("--threads", type=int, default=None,
                        help=f"torch CPU threads (default: torch's, {_INITIAL_THREADS} here)")
    parser.add_argument("--quick", action="store_true",
                        help="tiny sizes that finish in seconds (smoke test)")
    parser.add_argument("--kv-cache-mib", type=int, default=512,
                        help="our engine's KV cache budget (MiB)")
    parser.add_argument("--out", default=str(OUT_DIR / f"{name}.json"),
                        help="where to write the JSON result")


def set_threads(threads: int | None) -> int:
    """Set torch's intra-op threads (None: torch's default); returns the count in force."""
    torch.set_num_threads(threads or _INITIAL_THREADS)
    return torch.get_num_threads()


def log(message: str) -> None:
    """Progress line with wall-clock time, flushed at once (long runs)."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


# --- machine ---------------------------------------------------------------------------------

def cpu_info() -> dict[str, Any]:
    """CPU model and the flags that decide bf16 speed (AVX512-BF16, AMX)."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
    return {"model": model, "logical_cpus": _cpu_count(),
            "flags": {flag: flag in flags for flag in wanted}}


def _cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def machine_info(dtype: torch.dtype | str | None = None) -> dict[str, Any]:
    """What a figure depends on: CPU, GPU, torch threads, dtype, library versions, commit."""
    import transformers
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"cpu": cpu_info(), "gpu": gpu,
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "torch_threads": torch.get_num_threads(),
            "torch_default_threads": _INITIAL_THREADS,
            "dtype": str(dtype).removeprefix("torch.") if dtype is not None else None,
            "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "commit": _git("rev-parse", "--short",
                                                                      "HEAD"),
            "uncommitted_changes": bool(_git("status", "--porcelain", "--untracked-files=no"))}


def _git(*args: str) -> str | None:
    """Output of a git command in this repository; None where git is unavailable."""
    try:
        out = subprocess.run(["git", "-C", str(REPO_ROOT), *args],
                             capture_output=True, text=True, timeout=5, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


# --- models ----------------------------------------------------------------------------------

def load(model: str, dtype: str, device: str = "cpu", quantization: str = "none"):
    """A fresh :class:`workers.model_loader.LoadedModel` on ``device`` (each call its own
    weights, so the engine's runner and a transformers baseline never share a module), its
    weights held as ``quantization`` says (``workers.stored_weights``)."""
    if model == TINY_MODEL:
        loaded = tiny_model(dtype)
        loaded.model.to(device)
        return loaded
    from workers.model_loader import load_model
    return load_model(model, dtype=dtype, device=device, quantization=quantization)


def tiny_model(dtype: str):
    """A 2-layer Llama with seeded random weights and SmolLM2's tokenizer and vocabulary
    (``initializer_range`` 0.2 keeps greedy logits away from near-ties)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from workers.model_loader import LoadedModel, model_digest, parse_dtype
    tokenizer = embedded_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=16384, tie_word_embeddings=True,
                         initializer_range=0.2,
                         bos_token_id=1, eos_token_id=2, pad_token_id=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.set_attn_implementation("sdpa")
    model = model.to(parse_dtype(dtype, torch.device("cpu"))).eval()
    return LoadedModel(model, tokenizer, model_digest(model), "tiny-llama", Path("tiny-llama"))


@functools.cache
def embedded_tokenizer():
    """SmolLM2's tokenizer, loaded once per process (tokenizers are not mutated)."""
    from workers.model_source import load_tokenizer
    return load_tokenizer("embedded")


def build_engine(loaded, *, threads: int | None, max_model_len: int | None = None,
                 max_num_batched_tokens: int = 2048, kv_cache_mib: int | None = 512,
                 **fields):
    """An :class:`workers.engine.LLMEngine` over ``loaded`` (on its device, in its dtype);
    ``kv_cache_mib`` None sizes the KV cache automatically (``workers.kv_budget``); ``fields``
    set other :class:`workers.config.EngineConfig` fields."""
    from workers.config import EngineConfig
    from workers.engine import LLMEngine
    config = EngineConfig(dtype=str(loaded.dtype).removeprefix("torch."),
                          device=loaded.device.type,
                          kv_cache_bytes=None if kv_cache_mib is None else kv_cache_mib << 20,
                          num_threads=threads, max_model_len=max_model_len,
                          max_num_batched_tokens=max_num_batched_tokens, **fields)
    return LLMEngine(config, loaded=loaded)


def greedy_request(request_id: str, prompt: list[int], max_tokens: int):
    """A greedy request that ignores EOS, so every run decodes exactly ``max_tokens``."""
    from contract.request import GenerationRequest, SamplingParams
    return GenerationRequest(request_id, list(prompt),
                             SamplingParams(temperature=0, max_tokens=max_tokens,
                                            ignore_eos=True))


# --- prompts ---------------------------------------------------------------------------------

def corpus_token_ids(tokenizer, num_tokens: int) -> list[int]:
    """At least ``num_tokens`` token ids of standard-library source (fewer only if the files
    listed in :data:`STDLIB_SOURCES` run out)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    ids: list[int] = []
    for name in STDLIB_SOURCES:
        path = stdlib / name
        if path.exists():
            ids += tokenizer.encode(path.read_text(encoding="utf-8"), add_special_tokens=False)
        if len(ids) >= num_tokens:
            break
    return ids


def text_prompts(tokenizer, count: int, length: int, offset: int = 0) -> list[list[int]]:
    """``count`` distinct prompts of exactly ``length`` token ids from real source text.

    Prompt i is the corpus window starting at ``offset + i * length`` (disjoint windows, so no
    two prompts share a prefix); the corpus wraps around if it is too short.

    Raises:
        ValueError: ``length`` < 1 or the corpus is empty.
    """
    if length < 1:
        raise ValueError(f"prompt length must be at least 1, got {length}")
    corpus = corpus_token_ids(tokenizer, offset + count * length)
    if not corpus:
        raise ValueError("no standard-library source found to build prompts from")
    return [[corpus[(offset + i * length + j) % len(corpus)] for j in range(length)]
            for i in range(count)]


# --- statistics ------------------------------------------------------------------------------

def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation (numpy's default); None if empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def latency_summary(values_s: Sequence[float]) -> dict[str, float | None]:
    """p50 / p90 / p99 / max / mean of latencies, in milliseconds."""
    ms = [v * 1000 for v in values_s]
    return {"p50_ms": percentile(ms, 50), "p90_ms": percentile(ms, 90),
            "p99_ms": percentile(ms, 99), "max_ms": max(ms) if ms else None,
            "mean_ms": sum(ms) / len(ms) if ms else None, "count": len(ms)}


def gaps(timestamps: Sequence[float]) -> list[float]:
    """Differences between consecutive timestamps (inter-token latencies, seconds)."""
    return [b - a for a, b in zip(timestamps[:-1], timestamps[1:], strict=True)]


def ratio(ours: float | None, theirs: float | None) -> float | None:
    """ours / theirs, None when either is missing or theirs is zero."""
    if ours is None or not theirs:
        return None
    return ours / theirs


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """(seconds, result) of one call."""
    begin = time.perf_counter()
    result = fn()
    return time.perf_counter() - begin, result


def alternating_times(fns: dict[str, Callable[[], Any]], repeats: int) -> dict[str, list[float]]:
    """Seconds of ``repeats`` calls of each of ``fns``, one of each in turn (so drift in the
    machine's speed reaches all alike), after one untimed round that warms them up."""
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats + 1):
        for name, fn in fns.items():
            samples[name].append(timed(fn)[0])
    return {name: times[1:] for name, times in samples.items()}


def median_time(fn: Callable[[], Any], repeats: int, warmup: int = 1) -> float:
    """Median seconds of ``repeats`` calls after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    samples = sorted(timed(fn)[0] for _ in range(repeats))
    return samples[len(samples) // 2]


# --- output ----------------------------------------------------------------------------------

def log_goals(checks: list[dict[str, Any]]) -> None:
    """Print each goal check (as made by :func:`goal`) on its own line."""
    for check in checks:
        log(f"goal {check['name']}: {check['value']} ({check['goal']}, met={check['met']})")


def write_json(result: dict[str, Any], out: str | Path) -> Path:
    """Write ``result`` (indented JSON) to ``out``, creating its folder; returns the path."""
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, default=str))
    log(f"wrote {path}")
    return path


# --- driving an engine -----------------------------------------------------------------------

class EngineRun:
    """Steps an in-process engine to completion, timing every token and every step.

    Attributes:
        arrivals: request id → perf_counter time of each output token (seconds).
        submitted: request id → time the request was queued.
        cached_tokens: request id → prompt tokens reused from the prefix cache.
        token_ids: request id → its output token ids.
        steps: one row per step: ``[end time since start (s), duration (ms), prefill tokens,
            decode tokens]`` (token counts from the engine's counters).
    """

    def __init__(self, engine):
        self.engine = engine
        self.start = time.perf_counter()
        self.arrivals: dict[str, list[float]] = {}
        self.submitted: dict[str, float] = {}
        self.steps: list[list[float]] = []
        self.cached_tokens: dict[str, int] = {}
        self.token_ids: dict[str, list[int]] = {}

    def add(self, request, arrived_at: float | None = None) -> None:
        """Queue a request now (raises as ``LLMEngine.add_request``); its latencies count
        from ``arrived_at`` (a perf_counter time; None: now), as a request that arrived while
        a step ran waits for it."""
        self.engine.add_request(request)
        self.submitted[request.request_id] = arrived_at or time.perf_counter()
        self.arrivals[request.request_id] = []
        self.token_ids[request.request_id] = []

    def step(self) -> None:
        """One engine step; stamps each token it produced."""
        counters = self.engine.counters
        prefill, decode = counters.prefill_tokens, counters.decode_tokens
        begin = time.perf_counter()
        chunks = self.engine.step()
        end = time.perf_counter()
        for chunk in chunks:
            self.arrivals[chunk.request_id] += [end] * len(chunk.token_ids)
            self.cached_tokens[chunk.request_id] = chunk.cached_tokens
            self.token_ids[chunk.request_id] += chunk.token_ids
        self.steps.append([round(end - self.start, 4), round((end - begin) * 1000, 2),
                           counters.prefill_tokens - prefill, counters.decode_tokens - decode])

    def run(self, on_step: Callable[[EngineRun], None] | None = None) -> float:
        """Step until the engine is idle (``on_step`` may add requests after each step);
        returns the wall time in seconds since this run was created."""
        while self.engine.has_work():
            self.step()
            if on_step is not None:
                on_step(self)
        return time.perf_counter() - self.start

    def output_tokens(self) -> int:
        return sum(len(times) for times in self.arrivals.values())

    def ttft_s(self, request_id: str) -> float | None:
        times = self.arrivals[request_id]
        return times[0] - self.submitted[request_id] if times else None


@dataclass
class Prefill:
    """One cold prefill: seconds from queueing to the first token, prompt tokens reused from
    the prefix cache (0 when cold), and engine steps it took (1 unless chunked)."""

    seconds: float
    cached_tokens: int
    steps: int


def cold_prefill(engine, prompt: list[int], request_id: str) -> Prefill:
    """Prefill ``prompt`` (one output token) after resetting the prefix cache."""
    engine.reset_prefix_cache()
    run = EngineRun(engine)
    run.add(greedy_request(request_id, prompt, 1))
    run.run()
    return Prefill(run.ttft_s(request_id), run.cached_tokens[request_id], len(run.steps))


def stream_summary(submitted: dict[str, float], arrivals: dict[str, list[float]]) -> dict:
    """TTFT and inter-token latency of a set of streams (one token or chunk per timestamp),
    plus the longest stall: the largest gap between consecutive tokens of any stream."""
    ttfts = [times[0] - submitted[rid] for rid, times in arrivals.items() if times]
    itls = [gap for times in arrivals.values() for gap in gaps(times)]
    return {"ttft": latency_summary(ttfts), "itl": latency_summary(itls),
            "longest_stall_ms": max(itls) * 1000 if itls else None}


def goal(name: str, value: float | None, target: float, at_least: bool = True) -> dict:
    """A goal check: ``value`` against ``target`` (``>=`` or ``<=``); met is None if unknown."""
    met = None if value is None else (value >= target if at_least else value <= target)
    return {"name": name, "value": value, "goal": f"{'>=' if at_least else '<='} {target}",
            "met": met}
