#!/usr/bin/env bash
# What made this folder's files, on the AMX Xeon (family 6 model 167, 2 cores), 2026-12-08, with
# nothing else running: the steady-state skewed workload of routing-steady-ed7ad06/ (16 tenants
# with 1,024-token system prompts, one taking 80% of the requests, 16 in flight, 200 requests
# of warm-up then 400 measured; 2 workers of one thread with a 48 MiB KV pool; prefix routing
# alone and with a 1 GiB second tier) at 7ec19e1 and at 04013ba (admission keeping headroom
# for the running sequences' expected growth, SGLang's new-token ratio; reverted in the next
# commit), two rounds, the commits alternating.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
THREADS=1 benchmarks/script_ab.sh routing.py "prefix|wrote" 7ec19e1 04013ba \
    benchmarks/results/xeon-amx/kv-headroom-ab 2 --workloads shared-prefix \
    --policies prefix,prefix+tier --rounds 1 --hot-share 0.8 --tenants 16 --prefix-tokens 1024 \
    --max-concurrency 16 --warmup 200 --requests 400 --kv-cache-mib 48 --kv-tier-mib 1024
