"""Every native kernel compiles on this machine wherever a compiler is found.

A kernel that fails to build is logged and the torch path serves instead, so without this test
a build broken on one CPU kind goes unseen: its kernel tests skip as "not built here". That
happened: the AVX2 build of the weight-streaming kernel failed on a Zen 3 EPYC (gcc 12 did not
unroll a loop whose index fed an instruction's immediate), and stored GGUF weights there lost
their kernel while the suite passed.
"""

from __future__ import annotations

import os
import shutil

import pytest

from workers import kernels
from workers.kernels.__main__ import BUILDS

needs_compiler = pytest.mark.skipif(
    shutil.which("c++") is None or os.environ.get(kernels.DISABLE_VARIABLE) == "0"
    or bool(os.environ.get(kernels.DISABLE_ONE_VARIABLE)),
    reason="no C++ compiler here, or native kernels turned off")


@needs_compiler
@pytest.mark.parametrize("stem", [stem for _, stem in BUILDS])
def test_every_kernel_builds_here(stem):
    # _build, not the public getters: prefill attention's getter is None on CPUs it has no
    # backend for, though its build succeeded.
    assert kernels._build(stem) is not None
