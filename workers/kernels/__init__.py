"""Native CPU kernels of our own, compiled once per machine and kept in the model cache.

:func:`paged_decode` reads decode attention straight from the paged KV cache (fp32 or bf16).
Without it, a decode step gathers every sequence's blocks into a copy before torch's
attention: at batch 16 and 330-token contexts in fp32 on a 2-core AMD EPYC, that gather took
14.5 ms and the attention 14.3 ms of a 78 ms step (``torch.profiler``). The kernel is built with
``torch.utils.cpp_extension`` on first use, for this CPU (``-march=native``; the build's name
carries torch's CPU capability, so another CPU builds its own), under
``$NALAR_CACHE_DIR/kernels`` (default ``~/.cache/nalar/kernels``), in a directory named by a
digest of the sources, flags and torch version. ``make`` builds it at
install (``python -m workers.kernels``), so a worker's start only loads it. Where no compiler
is found, or ``NALAR_NATIVE_KERNELS=0``, it is None and attention keeps the gather path.
``NALAR_DISABLE_KERNELS`` names kernels (comma-separated stems: ``paged_decode``,
``rms_norm``, ``rope``, ``silu_mul``, ``prefill_attention``, ``weight_linear``,
``packed_linear``, ``lora_sgmv``, ``token_bitmask``) to leave out alone, to compare with the
torch path.

:func:`rms_norm` is the Llama family's RMSNorm in one call instead of eight torch ops, with
the same rounding points, :func:`rope` the rotary embedding in one call instead of six, and
:func:`silu_mul` the gated MLP's ``silu(gate) * up`` in one pass instead of two (these two
bit-identical); without them the torch ops serve. :func:`prefill_attention` is bf16 prefill
attention on AMX tiles or in AVX512-BF16, where the CPU has either; without it torch's flash
kernel serves. :func:`weight_linear` is the small-batch linear layer over weights kept in their
stored format (GGUF's Q8_0, Q4_0, Q4_1; per-channel int8; bf16; fp32), and
:func:`packed_linear` the same for dense bf16 (AVX-512) and fp32 (AVX2) weights packed once.
:func:`lora_sgmv` adds the LoRA deltas of a step's rows, every adapter's in one call per
projection.

Every compute function releases the GIL for the length of the call
(``pybind11::call_guard<pybind11::gil_scoped_release>``), as torch's own ops do. A worker's
event loop, which streams the tokens, shares the process with the engine thread; while a
kernel held the GIL, a finished token waited for it (15 ms at p90 in a lone request's stream
on an AMX Xeon, docs/performance.md).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import logging
import os
import shutil
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

KERNELS = Path(__file__).parent
DISABLE_VARIABLE = "NALAR_NATIVE_KERNELS"
DISABLE_ONE_VARIABLE = "NALAR_DISABLE_KERNELS"
FINISHED = "finished"
"""Marker file a kernel's build directory gets once its library is built."""


def _staged_sources(name: str, stem: str, flags: list[str]) -> Path:
    """``<stem>.cpp`` and the shared headers, copied into a build directory named by a digest
    of their content, the flags and torch's version, and the path of the copy to compile.

    torch's builder rebuilds whenever a source's path or a flag changes. Compiling from the
    package itself made two checkouts of one version (a worktree, an installed copy) rebuild
    each other's kernels at every start, one minute each, since both wrote one build
    directory; a content-addressed copy gives every version its own and shares it between
    checkouts."""
    from workers.model_source import cache_root
    sources = [KERNELS / f"{stem}.cpp", *sorted(KERNELS.glob("*.h"))]
    hasher = hashlib.sha256(f"{torch.__version__}|{' '.join(flags)}".encode())
    for source in sources:
        hasher.update(source.name.encode() + b"\0" + source.read_bytes())
    build_dir = cache_root() / "kernels" / f"{name}-{hasher.hexdigest()[:16]}"
    build_dir.mkdir(parents=True, exist_ok=True)
    for source in sources:
        staged = build_dir / source.name
        if not staged.is_file() or staged.read_bytes() != source.read_bytes():
            staged.write_bytes(source.read_bytes())
    return build_dir / f"{stem}.cpp"


def _load_finished_build(name: str, build_dir: Path) -> ModuleType | None:
    """The module a finished build left in ``build_dir``, loaded without torch's builder; None
    if no build finished there.

    torch's builder reruns the compiler whenever a compile command changes, and the command
    names torch's headers by the path of the environment they are installed in. So a second
    environment with the same torch (a clean checkout's own venv, as CI makes) rebuilt every
    kernel, 88 s on a 2-core AVX2 EPYC, and the two then rebuilt each other's at every start.
    The directory's name already digests what the build depends on (sources, flags, torch's
    version); the marker, written after the build, keeps a half-written library out."""
    library = build_dir / f"{name}.so"
    if not (build_dir / FINISHED).is_file() or not library.is_file():
        return None
    spec = importlib.util.spec_from_file_location(name, library)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _put_ninja_on_path() -> None:
    """torch's builder runs ``ninja`` from PATH; a venv's own (the ``ninja`` package) is not on
    it unless the venv is activated."""
    if shutil.which("ninja") is None:
        with contextlib.suppress(ImportError):
            import ninja
            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def paged_decode() -> ModuleType | None:
    """The compiled decode-attention extension, or None where it is disabled or cannot be
    built (logged once). Its ``paged_decode_attention(query, key_cache, value_cache,
    block_tables, lengths, block_size, scale)`` takes query ``[B, kv_heads, R, D]`` (the R
    query heads sharing each KV head), caches ``[kv_heads, slots, D]``, ``[B, M]`` int64
    block tables and ``[B]`` int64 context lengths on CPU, query and caches all float32 or all
    bfloat16, and returns ``[B, kv_heads, R, D]`` in their dtype (computed in float32); it
    raises RuntimeError for other dtypes, head sizes outside ``head_dims``, block ids or
    lengths outside the cache, or inconsistent shapes."""
    return _build("paged_decode")


def rms_norm() -> ModuleType | None:
    """The compiled RMSNorm extension, or None where it is disabled or cannot be built. Its
    ``rms_norm(x, weight, eps)`` takes ``x`` ``[T, H]`` and ``weight`` ``[H]``, both float32
    or both bfloat16, and returns ``[T, H]`` in their dtype, rounded as transformers'
    Llama-family RMSNorm modules round; it raises RuntimeError for other dtypes or shapes."""
    return _build("rms_norm")


def rope() -> ModuleType | None:
    """The compiled RoPE extension, or None where it is disabled or cannot be built. Its
    ``rope(x, cos, sin)`` takes ``x`` ``[T, H, D]`` (unit stride within a head) and ``cos``,
    ``sin`` ``[T, D]``, all float32 or all bfloat16, and returns a contiguous ``[T, H, D]``
    bit-identical to transformers' half-split rotation. Its ``rope_store(qkv, cos, sin,
    heads, kv_heads, key_cache, value_cache, slots)`` takes a fused projection's output
    ``qkv`` ``[T, (H + 2 KV) D]`` (unit stride along a row), contiguous caches ``[KV, slots,
    D]`` and ``[T]`` int64 slots; it writes the rotated keys and the values into their slots
    and returns ``(q, k, v)``: ``q`` ``[T, H, D]`` and ``k`` ``[T, KV, D]`` rotated as
    ``rope`` rotates, contiguous, and ``v`` ``[T, KV, D]`` a view of ``qkv``. Both raise
    RuntimeError for other dtypes or shapes, and ``rope_store`` for slots outside the
    cache."""
    return _build("rope")


def silu_mul() -> ModuleType | None:
    """The compiled gated-activation extension, or None where it is disabled or cannot be
    built. Its ``silu_mul(gate_up)`` takes ``[T, 2I]`` float32 or bfloat16 (gate columns
    first, unit stride along a row) and returns ``[T, I]`` ``silu(gate) * up`` in that dtype,
    rounded as torch's ``F.silu(gate) * up``; it raises RuntimeError for other dtypes or
    shapes."""
    return _build("silu_mul")


def prefill_attention() -> ModuleType | None:
    """The compiled bf16 prefill-attention extension, or None where it is disabled, cannot be
    built, or this CPU has neither AMX-BF16 tiles nor AVX512-BF16 (its ``backend`` is then
    empty; otherwise ``"amx-tiles"`` or ``"avx512-bf16"``). Its ``prefill_attention(query,
    key, value, key_cache, value_cache, cached_blocks, num_cached, block_size, scale)`` takes
    a span's query ``[n, H, D]`` and its own keys and values ``[n, KV, D]`` (unit stride
    within a head), the caches ``[KV, slots, D]`` and the ``[M]`` int64 block table holding
    the sequence's first ``num_cached`` tokens, all bf16 on CPU with ``D`` in ``head_dims``;
    query ``i`` attends causally to keys ``0 .. num_cached + i``. Returns ``[n, H, D]`` bf16;
    raises RuntimeError for other dtypes, shapes, or block ids outside the cache."""
    module = _build("prefill_attention")
    return module if module is not None and module.backend else None


def lora_sgmv() -> ModuleType | None:
    """The compiled LoRA delta extension, or None where it is disabled or cannot be built.
    Its ``lora_delta(out, x, rows, offsets, a, bt)`` adds, for each adapter ``g``, ``(x[r] @
    a[g].T) @ bt[g]`` to ``out[r]`` for the rows ``r`` in ``rows[offsets[g]:offsets[g+1]]``:
    ``out`` ``[T, O]`` and ``x`` ``[T, I]`` both float32 or both bfloat16 (contiguous; ``out``
    updated in place), ``rows`` int64, ``a[g]`` ``[R_g, I]`` and ``bt[g]`` ``[R_g, O]``
    float32 (``R_g`` may be 0: nothing to add). It raises RuntimeError for other dtypes,
    shapes, or a row outside ``x``."""
    return _build("lora_sgmv")


def token_bitmask() -> ModuleType | None:
    """The compiled token-mask extension, or None where it is disabled or cannot be built.
    Its ``apply_token_bitmask(logits, rows, masks)`` sets to -inf, in place, every token of
    ``logits[rows[c]]`` whose bit is clear in ``masks[c]``: ``logits`` ``[B, V]`` float32
    contiguous, ``rows`` ``[C]`` int64, ``masks`` ``[C, W]`` int32 (``W * 32 >= V``, bit
    ``t % 32`` of word ``t // 32``: llguidance's layout). It raises RuntimeError for other
    dtypes or shapes, or a row outside ``logits``."""
    return _build("token_bitmask")


def weight_linear() -> ModuleType | None:
    """The compiled weight-streaming linear extension, or None where it is disabled or cannot
    be built. ``weight_linear(x, weight, format, out_features, bias, path, products)`` takes
    ``x`` ``[M, K]`` float32 or bfloat16 (K a multiple of 32), the stored weight (a GGUF
    format's packed groups ``[ceil(N / 8), group bytes]`` from ``pack(rows, format, K)``, else
    its rows ``[N, row_bytes(format, K)]`` uint8) and a ``[N]`` bias or None, and returns
    ``[M, N]`` in x's dtype; ``dequantize(weight, format, N, K, rows, path, dtype)`` returns
    the ``[N, K]`` weights it multiplies (or the features ``rows``) in float32 or bfloat16
    (rounded to nearest even, as torch rounds); ``unpack`` undoes
    ``pack``; ``paths()`` lists the SIMD paths this build and CPU run, widest first
    (``avx512``, ``avx2``, ``scalar``; ``path`` 0 picks the first, 1-3 force scalar, avx2,
    avx512). They raise RuntimeError for unknown formats, shapes that do not match the format,
    products a format does not take, or a path this CPU lacks. Formats are numbered in
    ``workers.models.weight_formats``."""
    return _build("weight_linear")


def packed_linear() -> ModuleType | None:
    """The compiled packed linear extension, or None where it is disabled or cannot be built.
    ``pack(weight)`` turns a ``[N, K]`` bfloat16 weight (K even) into ``[ceil(N / W), K / 2,
    2 * W]`` groups of W output features, or a float32 one into ``[ceil(N / W), K, W]``, W
    being the vector width (8 with AVX2, 16 with AVX-512: ``bf16_features``,
    ``f32_features``); ``linear(x, packed, N, bias)`` takes ``x`` ``[M, K]`` of the weight's
    dtype and a ``[N]`` bias or None and returns ``[M, N]`` in that dtype. ``runs_bf16()``
    and ``runs_f32()`` say whether this build and CPU run each path (AVX-512, or AVX2 with
    FMA); ``linear`` raises RuntimeError where they do not, and for shapes that do not match."""
    return _build("packed_linear")


@functools.cache
def _build(stem: str) -> ModuleType | None:
    """Compile (or load the cached build of) ``<stem>.cpp`` for this CPU."""
    disabled = os.environ.get(DISABLE_ONE_VARIABLE, "").split(",")
    if os.environ.get(DISABLE_VARIABLE, "1") == "0" or stem in disabled:
        return None
    from torch.utils import cpp_extension
    _put_ninja_on_path()
    capability = torch.backends.cpu.get_cpu_capability()  # DEFAULT, AVX2, AVX512...
    name = f"nalar_{stem}_{capability.lower()}"
    # ATen's vector types pick their implementation from CPU_CAPABILITY_<name>, as torch's
    # own kernels are built. at::parallel_for is an inline OpenMP loop: without -fopenmp it
    # compiles to a serial one (measured: 2 threads no faster than 1). The libgomp it links
    # has torch's soname, so the loader binds it to the runtime torch already loaded, and
    # torch.set_num_threads governs both. No implicit fused multiply-adds: the kernels round
    # where torch's separate ops round (RoPE is bit-identical to torch's).
    flags = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off",
             f"-DCPU_CAPABILITY={capability}", f"-DCPU_CAPABILITY_{capability}"]
    try:
        source = _staged_sources(name, stem, flags)
        built = _load_finished_build(name, source.parent)
        if built is not None:
            return built
        module = cpp_extension.load(name=name, sources=[str(source)], extra_cflags=flags,
                                    extra_ldflags=["-fopenmp"],
                                    build_directory=str(source.parent), verbose=False)
        (source.parent / FINISHED).touch()
        return module
    except Exception as exc:  # no compiler, headers or toolchain: keep the torch path
        logger.warning("native kernel %s unavailable (%s); the torch path serves instead",
                       stem, exc)
        return None
