"""The C library, for the few calls torch does not make for us (``madvise``, ``malloc_trim``)."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def libc() -> ctypes.CDLL | None:
    """The process's C library with ``errno`` kept for ``ctypes.get_errno``, or None where
    none is found or it cannot be loaded."""
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name, use_errno=True) if name else None
    except OSError:
        return None
