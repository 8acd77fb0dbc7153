"""``nalar``: serve the cluster, or chat with a running one."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import pydantic

from cluster.config import ClusterConfig


def _serve_parser(commands) -> None:
    serve_cmd = commands.add_parser("serve", help="serve a model on an OpenAI-compatible API")
    serve_cmd.add_argument("--model", default="embedded",
                           help="'embedded' (SmolLM2-135M-Instruct), a .gguf file, a model "
                                "directory or a locally cached hub id")
    serve_cmd.add_argument("--served-model-name", default=None)
    serve_cmd.add_argument("--dtype", default="auto",
                           help="activations and KV cache (and dense weights): auto (bf16 where "
                                "native, else fp32), bfloat16, float16, float32")
    serve_cmd.add_argument("--quantization", default="auto",
                           choices=["auto", "none", "gguf", "int8"],
                           help="weights: gguf keeps a GGUF file's Q8_0/Q4_0/Q4_1 tensors as "
                                "stored, int8 quantizes per channel, none is dense in --dtype; "
                                "auto: gguf for a GGUF model on the CPU, else none")
    serve_cmd.add_argument("--workers", type=int, default=None, dest="num_workers",
                           help="worker replicas, one engine each (default: one per visible "
                                "CUDA device, else 2)")
    serve_cmd.add_argument("--redis-url", default=None,
                           help="Redis digest index (default: $REDIS_URL, else embedded)")
    serve_cmd.add_argument("--host", default="127.0.0.1")
    serve_cmd.add_argument("--port", type=int, default=8000)
    serve_cmd.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    serve_cmd.add_argument("--kv-memory-mib", type=int, default=None, dest="kv_cache_mib",
                           help="KV cache budget per worker, MiB (default: 512 on a CPU; on "
                                "CUDA what --gpu-memory-utilization leaves after the weights "
                                "and a step's activations)")
    serve_cmd.add_argument("--kv-tier-mib", type=int, default=0,
                           help="second KV tier per worker, MiB: blocks evicted from the KV "
                                "cache move there and load back on a hit (default 0: off)")
    serve_cmd.add_argument("--kv-tier-medium", choices=["auto", "host", "disk"],
                           default="auto",
                           help="where the second tier keeps blocks (default auto: host "
                                "memory on a GPU worker, a file on local disk on a CPU one)")
    serve_cmd.add_argument("--kv-tier-dir", default=None,
                           help="directory of the second KV tier's file (default: the "
                                "system's temporary directory)")
    serve_cmd.add_argument("--gpu-memory-utilization", type=float, default=None,
                           help="on CUDA, the fraction of the device's total memory each "
                                "worker may use in all: weights, KV cache, activations "
                                "(default 0.9; workers sharing a GPU must add up to at most "
                                "1)")
    serve_cmd.add_argument("--max-model-len", type=int, default=None)
    serve_cmd.add_argument("--max-num-seqs", type=int, default=64)
    serve_cmd.add_argument("--max-num-batched-tokens", type=int, default=2048,
                           help="token budget of one engine step (prefill chunks + decodes)")
    serve_cmd.add_argument("--max-num-partial-prefills", type=int, default=1,
                           help="most prompts being prefilled in chunks at once")
    serve_cmd.add_argument("--long-prefill-token-threshold", type=int, default=None,
                           help="most tokens a chunked prompt computes per step while others "
                                "wait (default: half of --max-num-batched-tokens)")
    serve_cmd.add_argument("--step-time-target-ms", type=float, default=None,
                           help="while sequences decode, the step time prompt chunks fill up "
                                "to, by step costs measured on the worker; 0: off (default: "
                                "250 on a CPU with dense weights; for weights kept as stored, "
                                "500 on the chunks of prompts longer than "
                                "--max-num-batched-tokens only)")
    serve_cmd.add_argument("--max-step-time-ms", type=float, default=None,
                           help="the longest a step may take with chunks of a prompt "
                                "longer than the token budget, by step costs measured on the "
                                "worker: what a request arriving during a long prefill waits "
                                "for the step in progress; 0: off (default: 1000 on a CPU, "
                                "off on a GPU)")
    serve_cmd.add_argument("--scheduling-policy", choices=["fcfs", "prefix"], default="fcfs",
                           help="admission order: arrival (fcfs) or longest cached prefix "
                                "first, with aging (prefix)")
    serve_cmd.add_argument("--gpus-per-worker", type=float, default=None, dest="worker_gpus",
                           help="GPUs each worker replica asks Ray for (default: 1 when CUDA "
                                "is available, else 0); a fraction shares a GPU (0.5: two "
                                "workers on each)")
    serve_cmd.add_argument("--routing", choices=["prefix", "round-robin", "power-of-two"],
                           default=None,
                           help="request routing: longest cached prefix weighed against load "
                                "(prefix, the default), round-robin, or power-of-two choices")
    serve_cmd.add_argument("--worker-threads", type=int, default=None,
                           help="torch threads per worker (default: cores / --workers)")
    serve_cmd.add_argument("--no-borrow-idle-cores", action="store_false", default=None,
                           dest="borrow_idle_cores",
                           help="never compute a long prompt on the cores of the host's idle "
                                "workers too; each worker keeps to its --worker-threads")
    serve_cmd.add_argument("--drain-timeout", type=float, default=None, dest="drain_timeout_s",
                           help="on SIGTERM or Ctrl-C, seconds requests in flight get to finish "
                                "(new ones get 503) before they end with an error (default 30)")
    serve_cmd.add_argument("--max-queue-delay", type=float, default=None,
                           dest="max_queue_delay_s",
                           help="refuse a request with 503 while the work in flight would take "
                                "longer than this many seconds at the measured rate "
                                "(default: no time bound, only the token bound)")
    _speculative_flags(serve_cmd)
    _auth_flags(serve_cmd)
    _lora_flags(serve_cmd)


def _lora_module(value: str) -> tuple[str, str]:
    """``name=path`` (vLLM's ``--lora-modules`` form) as a pair."""
    name, sep, path = value.partition("=")
    if not (sep and name and path):
        raise argparse.ArgumentTypeError(f"expected name=path, got {value!r}")
    return name, path


def _lora_flags(serve_cmd) -> None:
    lora = serve_cmd.add_argument_group(
        "LoRA adapters", "Requests select an adapter by its name in `model`; /v1/models lists "
        "each with `parent` set to the base model.")
    lora.add_argument("--lora-modules", nargs="+", type=_lora_module, action="extend",
                      default=None, metavar="NAME=PATH",
                      help="PEFT adapter directories every worker loads at start")
    lora.add_argument("--max-lora-rank", type=int, default=None,
                      help="largest adapter rank accepted (default 64)")
    lora.add_argument("--max-loras", type=int, default=None,
                      help="most adapters resident on a worker, batched in its steps "
                           "(default 8); the least recently used idle one makes room")
    lora.add_argument("--max-cpu-loras", type=int, default=None,
                      help="most adapters a worker holds counting those in host memory "
                           "(default: --max-loras, no host tier); others are read again "
                           "from disk when needed")
    lora.add_argument("--lora-dir", action="append", default=None, dest="lora_dirs",
                      metavar="DIR",
                      help="POST /v1/load_lora_adapter may read adapters under DIR "
                           "(repeatable); no other path is opened")
    lora.add_argument("--admin-api-key", default=None, metavar="KEY",
                      help="the key of /v1/load_lora_adapter and /v1/unload_lora_adapter "
                           "(default: $NALAR_ADMIN_API_KEY; without one they answer 403)")


def _auth_flags(serve_cmd) -> None:
    auth = serve_cmd.add_argument_group(
        "authentication", "Without a key the API is open. /health, /metrics and /dashboard "
        "never need one: keep them on a private network.")
    auth.add_argument("--api-key", action="append", default=None, dest="api_keys",
                      metavar="KEY",
                      help="accept this bearer key (repeatable or comma-separated; "
                           "default: $NALAR_API_KEY)")
    auth.add_argument("--api-keys-file", default=None, metavar="PATH",
                      help="accept the keys in this file too: one per line, '#' comments; "
                           "re-read within a second of a change, no restart")


def _milliseconds(value: str) -> float:
    """A flag given in milliseconds, as seconds."""
    return float(value) / 1000


def _speculative_flags(serve_cmd) -> None:
    spec = serve_cmd.add_argument_group("speculative decoding")
    spec.add_argument("--speculative", choices=["off", "ngram", "suffix", "model"],
                      default=None,
                      help="draft proposer: ngram (prompt lookup, in each worker; the "
                           "default), suffix (an index over every request, on draft "
                           "replicas), model (--draft-model on draft replicas) or off")
    spec.add_argument("--draft-model", default=None,
                      help="the model proposer's draft: a smaller model with the target's "
                           "tokenizer (a path or cached hub id)")
    spec.add_argument("--num-speculative-tokens", type=int, default=None,
                      help="most draft tokens verified per step (default 4)")
    spec.add_argument("--ngram-min", type=int, default=None,
                      help="shortest suffix ngram matches, tokens (default 1)")
    spec.add_argument("--ngram-max", type=int, default=None,
                      help="longest suffix ngram matches, tokens (default 4)")
    spec.add_argument("--draft-replicas", type=int, default=None,
                      help="draft replicas when the proposer runs remotely (default 1)")
    spec.add_argument("--draft-deadline-ms", type=_milliseconds, default=None,
                      dest="draft_deadline_s", metavar="MS",
                      help="a draft call slower than this gives no drafts that step "
                           "(default 50)")
    spec.add_argument("--speculative-remote", action="store_true", default=None,
                      help="run ngram on draft replicas instead of inside each worker")
    spec.add_argument("--no-adaptive-speculation", action="store_false", default=None,
                      dest="adaptive_speculation",
                      help="always draft --num-speculative-tokens instead of choosing each "
                           "request's draft length from measured acceptance and costs")


def _chat_parser(commands) -> None:
    chat_cmd = commands.add_parser("chat", help="send one chat message to a running server")
    chat_cmd.add_argument("text")
    chat_cmd.add_argument("--url", default="http://127.0.0.1:8000",
                          help="the server, as printed by nalar serve (with or without /v1)")
    chat_cmd.add_argument("--api-key", default=None)
    chat_cmd.add_argument("--max-tokens", type=int, default=128)
    chat_cmd.add_argument("--temperature", type=float, default=0.0)
    chat_cmd.add_argument("--system", default=None, help="optional system prompt")


def serve_config(args: argparse.Namespace) -> ClusterConfig:
    """The configuration ``nalar serve`` runs with: the flags given, defaults for the rest.

    Raises:
        pydantic.ValidationError: a flag out of range.
    """
    options = {k: v for k, v in vars(args).items() if k != "command" and v is not None}
    return ClusterConfig(**options)


def _flag_errors(error: pydantic.ValidationError) -> list[str]:
    """One line per invalid setting, naming the flag the user gave (not the config field)."""
    flags = {action.dest: action.option_strings[-1]
             for action in _serve_actions() if action.option_strings}
    lines = []
    for problem in error.errors():
        field = str(problem["loc"][0]) if problem["loc"] else ""
        message = problem["msg"].removeprefix("Value error, ")
        lines.append(f"{flags.get(field, field)}: {message}" if field else message)
    return lines


def _serve_actions() -> list[argparse.Action]:
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return commands.choices["serve"]._actions


def serve_command(args: argparse.Namespace) -> int:
    from cluster.runtime import (
        NotEnoughGPUsError,
        PortInUseError,
        TierStoreError,
        start_cluster,
        stop_cluster,
    )

    try:
        config = serve_config(args)
    except pydantic.ValidationError as exc:
        for line in _flag_errors(exc):
            print(f"nalar: cannot serve: {line}", file=sys.stderr)
        return 2
    index = f"Redis at {config.redis_url}" if config.redis_url else "embedded"
    workers = f"{config.num_workers} worker{'s' if config.num_workers != 1 else ''}"
    print(f"starting Nalar Serve: model {config.model}, {workers}, "
          f"index {index}, speculation {_speculation(config)}, {_auth(config)} ...",
          flush=True)
    # Set before the start: Ray and Serve swallow a KeyboardInterrupt raised while they start
    # (a Ctrl-C there was ignored), so a signal only asks to stop, once the start is done.
    stop, started = threading.Event(), threading.Event()
    previous = _on_stop_signals(lambda: _ask_to_stop(stop, started))
    try:
        start_cluster(config)
    except (PortInUseError, NotEnoughGPUsError, TierStoreError) as exc:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        hint = ". Stop the other server or pass --port." if isinstance(exc, PortInUseError) else ""
        print(f"nalar: cannot serve: {exc}{hint}", file=sys.stderr)
        return 1
    started.set()
    _on_stop_signals(lambda: _ask_to_stop(stop, started))  # again: ray.init set SIGTERM's
    if not stop.is_set():
        print(f"Nalar Serve is ready: http://{config.host}:{config.port}/v1 "
              "(Ctrl-C to stop)", flush=True)
        stop.wait()
        _drain(config.drain_timeout_s)
    print("stopping ...", flush=True)
    stop_cluster()
    print("stopped.", flush=True)
    return 0


def _on_stop_signals(handler: Callable[[], None]) -> dict[int, Any]:
    """Calls ``handler`` on SIGINT and SIGTERM from now on; returns the handlers it replaced."""
    return {signum: signal.signal(signum, lambda *_: handler())
            for signum in (signal.SIGINT, signal.SIGTERM)}


def _ask_to_stop(stop: threading.Event, started: threading.Event) -> None:
    """SIGINT or SIGTERM: stop serving (``nalar serve`` waits on ``stop``). Before ``started``,
    says that the stop comes once the start is done."""
    if not stop.is_set() and not started.is_set():
        print("stopping once the start is done ...", flush=True)
    stop.set()


def _drain(timeout_s: float) -> None:
    """Asks the ingress to drain (``NalarIngress.drain``) and waits for it: new requests get
    503 from now on, those in flight get ``timeout_s`` seconds to finish. A failed drain is
    reported, and the stop goes on."""
    from ray import serve

    from cluster.app import APP_NAME
    from router.api.admission import CUT_GRACE_S

    print(f"draining: new requests get 503; requests in flight get up to {timeout_s:g} s ...",
          flush=True)
    try:
        report = serve.get_app_handle(APP_NAME).drain.remote(timeout_s).result(
            timeout_s=timeout_s + CUT_GRACE_S + 10)
    except Exception as exc:
        print(f"nalar: the drain failed ({exc}); stopping anyway", file=sys.stderr, flush=True)
        return
    print(f"drained: {report['finished']} finished, {report['cut']} ended at the deadline",
          flush=True)


def _speculation(config: ClusterConfig) -> str:
    """One phrase for the start-up line: the proposer, its k_max and where it runs."""
    if config.speculative == "off":
        return "off"
    where = (f"{config.draft_replicas} draft replica(s)" if config.draft_is_remote
             else "in each worker")
    return f"{config.speculative} k<={config.num_speculative_tokens} {where}"


def _auth(config: ClusterConfig) -> str:
    """One phrase for the start-up line: whether the API needs a key (never the keys)."""
    if not config.api_keys and config.api_keys_file is None:
        return "no API key (open to anyone who can reach the port)"
    source = f"{len(config.api_keys)} API key(s)"
    if config.api_keys_file is not None:
        source += f" + the keys in {config.api_keys_file}"
    return f"auth by {source}"


def _api_base(url: str) -> str:
    """Accepts the server root or the ``/v1`` URL ``nalar serve`` prints, with or without a
    trailing slash."""
    url = url.rstrip("/")
    return url if url.endswith("/v1") else f"{url}/v1"


def chat_command(args: argparse.Namespace) -> int:
    messages = [{"role": "system", "content": args.system}] if args.system else []
    messages.append({"role": "user", "content": args.text})
    body = {"messages": messages, "max_tokens": args.max_tokens,
            "temperature": args.temperature, "stream": True,
            "stream_options": {"include_usage": True}}
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    started = time.perf_counter()
    ttft = None
    usage = {}
    try:
        with httpx.stream("POST", f"{_api_base(args.url)}/chat/completions", json=body,
                          headers=headers, timeout=300) as response:
            if response.status_code != 200:
                response.read()
                print(f"error {response.status_code}: {response.text}", file=sys.stderr)
                return 1
            worker = response.headers.get("x-nalar-worker", "?")
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: "):])
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices", []):
                    text = choice.get("delta", {}).get("content") or ""
                    if text and ttft is None:
                        ttft = time.perf_counter() - started
                    print(text, end="", flush=True)
    except httpx.HTTPError as exc:
        print(f"nalar: cannot reach {args.url}: {exc}", file=sys.stderr)
        return 1
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    ttft_text = f"{ttft * 1000:.0f} ms" if ttft is not None else "n/a"
    print(f"\n--\nworker {worker} | prompt {usage.get('prompt_tokens', '?')} tokens, "
          f"cached {cached} | completion {usage.get('completion_tokens', '?')} tokens | "
          f"TTFT {ttft_text}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``nalar`` command line: ``serve``, ``chat`` and ``bench``."""
    from bench.cli import add_bench_parser

    parser = argparse.ArgumentParser(prog="nalar", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    _serve_parser(commands)
    _chat_parser(commands)
    add_bench_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "bench":
        from bench.cli import bench_command

        return bench_command(args)
    return serve_command(args) if args.command == "serve" else chat_command(args)


if __name__ == "__main__":
    sys.exit(main())
