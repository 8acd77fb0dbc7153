"""Where the native kernels are built: a directory named by their content, so two checkouts
of one version share a build and never rebuild each other's, and a finished build is loaded
as it is (no compiler runs here, except for a kernel the install did not build)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from workers import kernels

FLAGS = ["-O3", "-march=native"]


def test_two_checkouts_of_the_same_sources_share_one_build(tmp_path, monkeypatch):
    monkeypatch.setenv("NALAR_CACHE_DIR", str(tmp_path / "cache"))
    here = kernels._staged_sources("nalar_rope_x", "rope", FLAGS)
    elsewhere = tmp_path / "checkout" / "kernels"
    shutil.copytree(kernels.KERNELS, elsewhere)
    monkeypatch.setattr(kernels, "KERNELS", elsewhere)
    assert kernels._staged_sources("nalar_rope_x", "rope", FLAGS) == here
    assert here.read_bytes() == (elsewhere / "rope.cpp").read_bytes()
    assert sorted(p.name for p in here.parent.glob("*.h")) == sorted(
        p.name for p in elsewhere.glob("*.h"))


def test_other_sources_or_flags_build_elsewhere(tmp_path, monkeypatch):
    monkeypatch.setenv("NALAR_CACHE_DIR", str(tmp_path / "cache"))
    original = kernels._staged_sources("nalar_rope_x", "rope", FLAGS)
    assert kernels._staged_sources("nalar_rope_x", "rope", [*FLAGS, "-g"]) != original
    edited = tmp_path / "edited"
    shutil.copytree(kernels.KERNELS, edited)
    header = next(edited.glob("*.h"))
    header.write_text(header.read_text() + "\n// edited\n")
    monkeypatch.setattr(kernels, "KERNELS", edited)
    changed = kernels._staged_sources("nalar_rope_x", "rope", FLAGS)
    assert changed.parent != original.parent
    assert changed.parent.parent == original.parent.parent  # both under the cache's kernels/


def test_a_finished_build_is_loaded_without_the_builder(monkeypatch):
    """Another environment with the same torch (CI's clean checkout has its own venv) loads
    the finished build as it is: torch's builder, which would recompile because its command
    names the headers' paths, is not called."""
    from torch.utils import cpp_extension
    first = kernels._build.__wrapped__("rms_norm")  # past the per-process cache
    if first is None:
        pytest.skip("no compiler here: nothing was built to load")
    build_dir = Path(first.__file__).parent
    assert (build_dir / kernels.FINISHED).is_file()

    def builder(**_):
        raise AssertionError("the builder ran for a finished build")
    monkeypatch.setattr(cpp_extension, "load", builder)
    again = kernels._build.__wrapped__("rms_norm")
    assert again is not None and Path(again.__file__).parent == build_dir


def test_a_build_without_its_marker_is_not_loaded(tmp_path):
    """A library left by a build that did not finish (no marker) is never loaded."""
    (tmp_path / "nalar_x.so").write_bytes(b"half a library")
    assert kernels._load_finished_build("nalar_x", tmp_path) is None
