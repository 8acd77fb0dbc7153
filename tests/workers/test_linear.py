"""The compact models' linear layer and the process-wide bound on oneDNN's per-shape caches."""

from __future__ import annotations

import os

from workers.models.linear import (
    PRIMITIVE_CACHE_CAPACITY,
    PRIMITIVE_CACHES,
    bound_primitive_caches,
)


def test_primitive_caches_are_bounded_unless_the_operator_sized_them(monkeypatch):
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "512")
    bound_primitive_caches()
    assert PRIMITIVE_CACHES == ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == str(PRIMITIVE_CACHE_CAPACITY) == "64"
    assert os.environ["LRU_CACHE_CAPACITY"] == "512"
