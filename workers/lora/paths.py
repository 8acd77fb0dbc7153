"""Where an adapter loaded at run time may be read from: only under the directories the
operator allows (``--lora-dir``).

A path given in a request is checked before any file is opened: no ``..`` component, and the
directory and each file read from it resolve (symlinks followed) under an allowed directory,
so a symlink leading out of one is refused like a path outside it.
"""

from __future__ import annotations

import os
from pathlib import Path

from workers.lora.adapter import CONFIG_FILE, WEIGHTS_FILE
from workers.lora.errors import AdapterError


def checked_adapter_dir(path: str, allowed: list[str]) -> Path:
    """``path`` resolved, once it and the adapter files in it are known to lie under one of
    ``allowed``.

    Raises:
        AdapterError: no directory is allowed, ``path`` holds a NUL character, is relative or
            has a ``..`` component, or it (or a file in it, through a symlink) resolves
            outside every allowed directory.
    """
    if not allowed:
        raise AdapterError("loading adapters by path is off: start nalar serve with "
                           "--lora-dir DIR to allow the adapters under DIR")
    if "\x00" in path:  # no file name holds one; os.path.realpath raises ValueError on it
        raise AdapterError(f"lora_path holds a NUL character: {path!r}")
    given = Path(path)
    if not given.is_absolute() or ".." in given.parts:
        raise AdapterError(f"lora_path must be an absolute path without '..': {path!r}")
    roots = [Path(os.path.realpath(root)) for root in allowed]
    resolved = Path(os.path.realpath(given))
    for target in (resolved, resolved / CONFIG_FILE, resolved / WEIGHTS_FILE):
        real = Path(os.path.realpath(target))
        if not any(real.is_relative_to(root) for root in roots):
            raise AdapterError(f"lora_path {path!r} is outside the allowed --lora-dir "
                               "directories")
    return resolved
