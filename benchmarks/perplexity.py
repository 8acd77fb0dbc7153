"""Perplexity of a text through ``nalar serve``'s HTTP API against llama.cpp's own
``llama-perplexity``, on the same weights: does serving the GGUF as stored cost accuracy
against llama.cpp's kernels on the same file?

llama.cpp's method (``llama-perplexity -c N``, stride 0): the text's tokens are cut into
chunks of N (the last partial one dropped); in each, the first token is replaced by BOS where
the model adds one, and the tokens of the second half are scored, each given every token of
the chunk before it. Ours sends each chunk, as token ids, to ``/v1/completions`` with
``echo: true``, ``logprobs: 0`` and ``max_tokens: 1`` (as lm-evaluation-harness scores text)
through the ``openai`` SDK, and scores the same tokens from the echoed ``token_logprobs``.
Both report exp(mean negative log-likelihood) over the scored tokens, and the running figure
after each chunk.

Pairs (``llama_server.PAIRS``): ``q4_1`` (ours: the Q4_1/Q8_0 tensors as stored, activations
at ``--dtype auto``, against llama.cpp on that GGUF), ``f32`` (both the GGUF dequantized to
fp32: the agreement of two fp32 implementations) and ``bf16`` (ours in bf16 against its F32).
Both score the same token ids: the text is tokenized by llama.cpp (``llama-server``'s
``/tokenize``), whose pre-tokenizer splits runs of newlines and spaces otherwise than the Hugging
Face tokenizer does (the GPL-3 text: 7,639 tokens against 7,658), and ours gets the ids as its
prompts. Writes JSON; not part of ``make test``.

    .venv/bin/python benchmarks/perplexity.py [--pairs q4_1,f32,bf16] [--ctx 512]
        [--text /usr/share/common-licenses/GPL-3] [--out PATH]
"""

from __future__ import annotations

import argparse
import math
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import gguf
import httpx
import openai

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout first
from benchmarks import common, llama_server  # noqa: E402
from workers.model_source import embedded_gguf_path  # noqa: E402

RUNNING_PPL = re.compile(r"\[(\d+)\](\d+\.\d+)")
"""``llama-perplexity``'s running estimate after each chunk: ``[3]12.3456,``."""
FINAL_PPL = re.compile(r"Final estimate: PPL = (\d+\.\d+)")
CHUNKS = re.compile(r"calculating perplexity over (\d+) chunks")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", default="q4_1,f32,bf16", help="of q4_1, f32, bf16")
    parser.add_argument("--ctx", type=int, default=512, help="tokens per chunk (llama's -c)")
    parser.add_argument("--text", default="/usr/share/common-licenses/GPL-3")
    parser.add_argument("--chunks", type=int, default=0, help="at most this many (0: all)")
    parser.add_argument("--threads", type=int, default=common._cpu_count(),
                        help="llama-perplexity's threads")
    parser.add_argument("--llama-version", default=llama_server.LLAMA_CPP_VERSION)
    parser.add_argument("--out", default=str(common.OUT_DIR / "perplexity.json"))
    args = parser.parse_args(argv)
    args.pairs = [p for p in args.pairs.split(",") if p]
    return args


def bos_token(path: Path) -> int | None:
    """The BOS id llama.cpp puts first in each chunk: None where the GGUF says it adds none."""
    reader = gguf.GGUFReader(path)

    def scalar(key: str) -> Any:
        field = reader.get_field(key)
        return None if field is None else field.contents()

    return scalar("tokenizer.ggml.bos_token_id") if scalar("tokenizer.ggml.add_bos_token") \
        else None


def llama_tokens(root: Path, model: Path, text: str, logs: Path) -> list[int]:
    """``text``'s token ids by llama.cpp's tokenizer, without special tokens."""
    port = llama_server.free_port()
    server = llama_server.Server("llama_tokenizer", [
        str(llama_server.binary(root, "llama-server")), "-m", str(model), "-t", "1",
        "--host", "127.0.0.1", "--port", str(port)], port, "/health", logs / "tokenizer.log")
    try:
        server.start(120.0)
        answer = httpx.post(f"{server.url}/tokenize", json={"content": text,
                                                            "add_special": False}, timeout=120)
        answer.raise_for_status()
        return answer.json()["tokens"]
    finally:
        server.stop()


def text_chunks(tokens: list[int], ctx: int, bos: int | None, limit: int) -> list[list[int]]:
    """``tokens`` in chunks of ``ctx`` as ``llama-perplexity`` makes them."""
    chunks = [tokens[start:start + ctx] for start in range(0, len(tokens) - ctx + 1, ctx)]
    if bos is not None:
        chunks = [[bos, *chunk[1:]] for chunk in chunks]
    return chunks[:limit] if limit else chunks


def running_ppl(nll_by_chunk: list[list[float]]) -> list[float]:
    """exp(mean NLL) over the scored tokens of chunks 1..i, for each i."""
    total, count, out = 0.0, 0, []
    for nll in nll_by_chunk:
        total += sum(nll)
        count += len(nll)
        out.append(math.exp(total / count))
    return out


def ours(server: llama_server.Server, chunks: list[list[int]]) -> list[list[float]]:
    """The negative log-likelihoods of each chunk's scored tokens, through HTTP."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                           timeout=600)
    model = client.models.list().data[0].id
    first = len(chunks[0]) // 2
    nll = []
    for chunk in chunks:
        answer = client.completions.create(model=model, prompt=chunk, max_tokens=1,
                                           temperature=0, echo=True, logprobs=0)
        logprobs = answer.choices[0].logprobs.token_logprobs
        nll.append([-value for value in logprobs[first + 1:len(chunk)]])
    return nll


def llama(root: Path, model: Path, text: str, args: argparse.Namespace) -> dict[str, Any]:
    """``llama-perplexity``'s figures: chunks, running estimates, final estimate."""
    command = [str(llama_server.binary(root, "llama-perplexity")), "-m", str(model), "-f", text,
               "-c", str(args.ctx), "-t", str(args.threads)]
    if args.chunks:
        command += ["--chunks", str(args.chunks)]
    run = subprocess.run(command, capture_output=True, text=True, check=True)
    output = run.stdout + run.stderr
    final = FINAL_PPL.search(output)
    return {"command": command, "chunks": int(CHUNKS.search(output).group(1)),
            "running_ppl": [float(v) for _, v in RUNNING_PPL.findall(output)],
            "ppl": float(final.group(1)) if final else None}


def measure_pair(pair: str, root: Path, ggufs: dict[str, Path], chunks: list[list[int]],
                 args: argparse.Namespace, logs: Path) -> dict[str, Any]:
    common.log(f"{pair}: llama-perplexity")
    theirs = llama(root, ggufs[llama_server.PAIRS[pair]["llama_gguf"]], args.text, args)
    server = llama_server.our_server(pair, ggufs, [], logs)
    common.log(f"{pair}: starting ours: {' '.join(server.command)}")
    try:
        server.start(900.0)
        nll = ours(server, chunks)
    finally:
        server.stop()
    mine = running_ppl(nll)
    common.log(f"{pair}: ours {mine[-1]:.4f}, llama.cpp {theirs['ppl']}")
    return {"ours": {"command": server.command, "running_ppl": mine, "ppl": mine[-1],
                     "scored_tokens": sum(map(len, nll))},
            "llama_cpp": theirs, "ratio": mine[-1] / theirs["ppl"] if theirs["ppl"] else None,
            "same_chunks": theirs["chunks"] == len(chunks)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    root = llama_server.build_llama(args.llama_version, None, common._cpu_count())
    q4_1 = embedded_gguf_path()
    ggufs = {"q4_1": q4_1, "f32": llama_server.f32_gguf(root, q4_1)}
    bos = bos_token(q4_1)
    out = Path(args.out)
    logs = out.with_name(out.stem + "_logs")
    tokens = llama_tokens(root, q4_1, Path(args.text).read_text(), logs)
    chunks = text_chunks(tokens, args.ctx, bos, args.chunks)
    common.log(f"{len(chunks)} chunks of {args.ctx} tokens from {args.text}; BOS {bos}")
    pairs = {pair: measure_pair(pair, root, ggufs, chunks, args, logs) for pair in args.pairs}
    result = {"benchmark": "perplexity", "machine": common.machine_info(), "argv": sys.argv,
              "text": args.text, "text_tokens": len(tokens), "ctx": args.ctx,
              "chunks": len(chunks), "bos": bos,
              "llama_cpp": llama_server.llama_version(root), "pairs": pairs}
    common.write_json(result, out)
    return result


if __name__ == "__main__":
    main()
