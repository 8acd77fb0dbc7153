#!/usr/bin/env bash
# What made this folder's files, at 8218411, on the AMX Xeon (family 6 model 207, 2 cores), with
# nothing else running: prefix hits through HTTP against `nalar serve`'s default weights (Q4_1
# as stored, bf16 activations), one worker of two threads with a 48 MiB KV cache and a 256 MiB
# second tier: a hit in the KV cache (pool.json), then one from the second tier (tier.json,
# 3,072 tokens evicting the prefix first, other seeds), and the tier's load counters; two
# rounds, each on a fresh server.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
out=benchmarks/results/xeon-amx/kv-hits-8218411
url=http://127.0.0.1:8123
for round in 1 2; do
  ray_tmp=$(mktemp -d /tmp/nalar-kv-hits-XXXX)
  (RAY_TMPDIR=$ray_tmp setsid .venv/bin/nalar serve --port 8123 --workers 1 --kv-memory-mib 48 \
      --kv-tier-mib 256 > /tmp/kv-hits-serve.log 2>&1 &)
  until curl -sf $url/v1/models > /dev/null; do sleep 2; done
  .venv/bin/python benchmarks/prefix_ttft.py --url $url --trials 5 --seed $((2 * round)) \
      --out $out/pool_round$round.json
  .venv/bin/python benchmarks/prefix_ttft.py --url $url --trials 5 --evict-tokens 3072 \
      --seed $((2 * round - 1)) --out $out/tier_round$round.json
  curl -s $url/metrics | grep -E "^nalar:kv_tier_(loaded_blocks|load_seconds)" \
      > $out/tier_metrics_round$round.txt
  pkill -f "nalar serve --port 8123" || true
  sleep 3
  RAY_TMPDIR=$ray_tmp .venv/bin/ray stop --force > /dev/null 2>&1 || true
done
