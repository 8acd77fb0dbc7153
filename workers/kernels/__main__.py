"""``python -m workers.kernels``: build the native kernels now (``make`` does at install), so
that no worker compiles them at start-up. Exits 0 either way: without a compiler the engine
runs its torch-only path."""

from workers.kernels import paged_decode, rms_norm, rope, silu_mul, tile_attention

if __name__ == "__main__":
    for name, build in (("paged decode attention", paged_decode), ("RMSNorm", rms_norm),
                        ("RoPE", rope), ("SiLU and mul", silu_mul),
                        ("AMX prefill attention", tile_attention)):
        print(f"{name}:", "built" if build() is not None else "unavailable")
