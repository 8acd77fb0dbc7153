# What made this folder's files, in this order, with nothing else running: a decode step on
# the Q4_1 weights (as stored; bf16 activations) at d34a96c (before) and 1686283 (the int8
# weight kernel prefetching 4 KiB ahead), alternating, three rounds, one and two threads
# (benchmarks/step_profile_ab.sh, run from a checkout of 1686283; the loop it holds ran inline
# here then).
set -e
cd "$(git rev-parse --show-toplevel)"
benchmarks/step_profile_ab.sh d34a96c 1686283 benchmarks/results/xeon-amx/int8-prefetch-1686283 3 \
    --quantization gguf --batches 1,16
