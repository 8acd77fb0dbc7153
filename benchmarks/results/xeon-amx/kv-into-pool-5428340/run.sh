#!/usr/bin/env bash
# What made this folder's files, on the AMX Xeon (family 6 model 167, 2 cores), with nothing
# else running: a 1,024-token prompt whose first 992 tokens are fetched from the other, busy
# worker, against a miss (kv_transfer.py, 6 trials a run), at 4c61455 (fetched blocks stored in
# the second tier's file, CRC-32 checked) and 5428340 (XXH3 checksums, fetched blocks stored in
# the working pool), two rounds alternating the order. Each server: the defaults (Q4_1 as
# stored, bf16), 2 workers of one thread, a 256 MiB second tier each.
set -euo pipefail
benchmarks/prefix_ttft_ab.sh 4c61455 5428340 benchmarks/results/xeon-amx/kv-into-pool-5428340 \
    2 transfer --workers 2 --kv-tier-mib 256
