"""``python -m workers.kernels``: build the native kernels now (``make`` does at install), so
that no worker compiles them at start-up. Exits 0 either way: without a compiler the engine
runs its torch-only path.

Each kernel is its own compiler run, so they build in parallel, one process a core (on 2 cores
the five took 101 s one after another)."""

import os
from concurrent.futures import ProcessPoolExecutor

from workers import kernels

BUILDS = (("paged decode attention", "paged_decode"), ("RMSNorm", "rms_norm"),
          ("RoPE", "rope"), ("SiLU and mul", "silu_mul"),
          ("prefill attention", "prefill_attention"),
          ("weight-streaming linear", "weight_linear"),
          ("packed linear", "packed_linear"), ("LoRA deltas", "lora_sgmv"),
          ("token masks", "token_bitmask"))


def _built(attribute: str) -> bool:
    return getattr(kernels, attribute)() is not None


if __name__ == "__main__":
    with ProcessPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        results = pool.map(_built, [attribute for _, attribute in BUILDS])
        for (name, _), built in zip(BUILDS, results, strict=True):
            print(f"{name}:", "built" if built else "unavailable")
