"""Where the native kernels are built: a directory named by their content, so two checkouts
of one version share a build and never rebuild each other's (no compiler runs here)."""

from __future__ import annotations

import shutil

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
