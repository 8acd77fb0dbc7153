"""``python -m workers.kernels``: build the native kernels now (``make`` does at install), so
that no worker compiles them at start-up. Exits 0 either way: without a compiler the engine
runs its torch-only path."""

from workers.kernels import paged_decode

if __name__ == "__main__":
    print("paged decode attention:", "built" if paged_decode() is not None else "unavailable")
