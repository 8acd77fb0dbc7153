"""``copy``: rewrite tasks over real Python standard-library source on this machine.

Outputs of such tasks copy much of their input, the case where prompt-lookup speculation pays.
Snippets are whole lines cut from the standard library's own ``.py`` files (found through
``sysconfig``), so the text is real code and needs no download.
"""

from __future__ import annotations

import functools
import random
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from bench.records import BenchRequest
from bench.text import CHARS_PER_TOKEN, estimate_tokens
from bench.workloads.config import WorkloadConfig
from bench.workloads.session import SingleRequest

TASKS = (
    "Rewrite this code with type hints:",
    "Rewrite this code with more descriptive variable names:",
    "Rewrite this code with a docstring on every function:",
    "Rewrite this code, keeping its behaviour, in a more readable style:",
)
"""The instructions a request opens with, chosen at random."""

_SKIPPED_DIRS = ("site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3",
                 "__pycache__")


@functools.cache
def stdlib_sources() -> tuple[Path, ...]:
    """The standard library's ``.py`` files on this machine (top level and one package deep,
    tests and third-party packages left out), sorted so a seed picks the same files.

    Raises:
        FileNotFoundError: no standard-library source is installed.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(path for pattern in ("*.py", "*/*.py") for path in root.glob(pattern)
                   if not any(part in _SKIPPED_DIRS for part in path.relative_to(root).parts))
    if not files:
        raise FileNotFoundError(f"no Python source under {root}")
    return tuple(files)


@functools.cache
def _lines(path: Path) -> tuple[str, ...]:
    return tuple(path.read_text(encoding="utf-8", errors="replace").splitlines())


@functools.cache
def _definition_starts(path: Path) -> tuple[int, ...]:
    """Indices of the lines that open a function or class."""
    return tuple(i for i, line in enumerate(_lines(path))
                 if line.lstrip().startswith(("def ", "class ", "async def ")))


def source_snippet(rng: random.Random, tokens: int) -> str:
    """Consecutive whole lines of a random standard-library file from the start of a random
    function or class, about ``tokens`` tokens (:data:`bench.text.CHARS_PER_TOKEN`); shorter
    only if the file ends first."""
    path = rng.choice(stdlib_sources())
    while not _definition_starts(path):  # a few modules hold only data or docs
        path = rng.choice(stdlib_sources())
    lines = _lines(path)
    budget = tokens * CHARS_PER_TOKEN
    start = rng.choice(_definition_starts(path))
    taken: list[str] = []
    size = 0
    for line in lines[start:]:
        if size >= budget:
            break
        taken.append(line)
        size += len(line) + 1
    return "\n".join(taken)


def copy_sessions(config: WorkloadConfig) -> Iterator[SingleRequest]:
    """Endless rewrite requests over standard-library snippets."""
    rng = random.Random(config.seed)
    while True:
        snippet = source_snippet(rng, config.input_length(rng))
        task = rng.choice(TASKS)
        content = f"{task}\n\n```python\n{snippet}\n```"
        yield SingleRequest(BenchRequest(
            [{"role": "user", "content": content}], config.output_length(rng),
            estimated_prompt_tokens=estimate_tokens(content), api_key=config.api_key,
            label="copy"))
