#!/usr/bin/env bash
# prefix_ttft.py through HTTP against `nalar serve` at two commits, one server at a time, ROUNDS
# rounds alternating which goes first. Each commit runs from a git worktree (its code first on
# PYTHONPATH, its own kernel builds) with the given `nalar serve` flags on port 8123. MODES,
# comma-separated: `pool` measures the hit in the KV cache (no eviction); `tier` the hit from
# the second tier (3,072 tokens evict the prefix first; after a pool run with another seed, so
# that its misses are not prompts that run served), and keeps the tier's counters from
# /metrics; `transfer` runs kv_transfer.py (a prefix fetched from the other, busy worker: serve
# with --workers 2 and a tier) and keeps the transfer counters. Writes
# OUT/{MODE}_{COMMIT}_round{N}.json (and OUT/{tier,transfer}_metrics_{COMMIT}_round{N}.txt);
# the servers' logs go to /tmp/prefix-ab-{COMMIT}-{N}.log. The worktrees it made are removed at
# the end. Run it from the repository root with nothing else running.
#
#     benchmarks/prefix_ttft_ab.sh BEFORE AFTER OUT ROUNDS MODES [nalar serve flags...]
set -euo pipefail
before=$1 after=$2 out=$3 rounds=$4 modes=$5
shift 5
root=$(pwd) url=http://127.0.0.1:8123
tier_counters='loaded_blocks|load_seconds|saved_blocks|save_seconds|io_errors|corrupt_blocks'
transfer_counters='(ex|im)ported_(blocks|bytes)|(ex|im)port_seconds|rejected_blocks|failed_fetches'
mkdir -p "$out"
made=()
for commit in "$before" "$after"; do
  if [ ! -d "/tmp/wt-$commit" ]; then
    git worktree add -q --detach "/tmp/wt-$commit" "$commit"
    made+=("/tmp/wt-$commit")
  fi
done
measure() {  # commit round [nalar serve flags...]
  local commit=$1 round=$2 wt=/tmp/wt-$1 ray_tmp
  shift 2
  ray_tmp=$(mktemp -d /tmp/nalar-prefix-ab-XXXX)
  (cd "$wt" && PYTHONPATH="$wt" RAY_TMPDIR="$ray_tmp" setsid "$root/.venv/bin/nalar" serve \
     --port 8123 "$@" > "/tmp/prefix-ab-$commit-$round.log" 2>&1 &)
  until curl -sf $url/v1/models > /dev/null; do sleep 2; done
  if [[ ,$modes, == *,pool,* ]]; then
    .venv/bin/python benchmarks/prefix_ttft.py --url $url --trials 5 \
      --out "$out/pool_${commit}_round$round.json"
  fi
  if [[ ,$modes, == *,tier,* ]]; then
    local seed=0
    [[ ,$modes, == *,pool,* ]] && seed=1
    .venv/bin/python benchmarks/prefix_ttft.py --url $url --trials 5 --evict-tokens 3072 \
      --seed $seed --out "$out/tier_${commit}_round$round.json"
    curl -s $url/metrics | grep -E "^nalar:kv_tier_($tier_counters)" \
      > "$out/tier_metrics_${commit}_round$round.txt"
  fi
  if [[ ,$modes, == *,transfer,* ]]; then
    .venv/bin/python benchmarks/kv_transfer.py --url $url --trials 6 \
      --out "$out/transfer_${commit}_round$round.json"
    curl -s $url/metrics | grep -E "^nalar:(kv_transfer_($transfer_counters)|kv_tier_load)" \
      > "$out/transfer_metrics_${commit}_round$round.txt"
  fi
  pkill -f "nalar serve --port 8123" || true
  sleep 3
  RAY_TMPDIR="$ray_tmp" .venv/bin/ray stop --force > /dev/null 2>&1 || true
  sleep 2
}
for round in $(seq "$rounds"); do
  if (( round % 2 )); then order=("$before" "$after"); else order=("$after" "$before"); fi
  for commit in "${order[@]}"; do
    measure "$commit" "$round" "$@"
  done
done
for worktree in "${made[@]}"; do
  git worktree remove --force "$worktree"
done
