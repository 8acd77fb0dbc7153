#!/usr/bin/env bash
# What made this folder's files, at 1212309 (whose code is d0e089e's), with nothing else
# running, on an Intel Xeon with AMX (family 6 model 207, 2 cores; MACHINE.md): `nalar serve`'s
# defaults against llama-server on the same weights, Q4_1 against Q4_1 and our bf16 against its
# F32, one at a time, 16 concurrent, shared prefix and multi-turn, two rounds alternating the
# servers; llama-server without its AMX repacking (which crashed on this file in earlier
# sessions). Run from the repository root.
set -euo pipefail
.venv/bin/python benchmarks/llama_server.py --rounds 2 --pairs q4_1,bf16 \
  --workloads single,concurrent16,shared_prefix,multi_turn --llama-args=--no-repack \
  --out benchmarks/results/xeon-amx/llama-server-1212309/llama_server_q4_1_bf16.json
