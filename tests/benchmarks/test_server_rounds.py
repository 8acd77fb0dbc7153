"""How the side-by-side benchmarks (``llama_server.py``, ``serve_ab.py``) alternate servers and
summarize rounds, without starting any server: ``bench`` is replaced by a recorder."""

from __future__ import annotations

import pytest

from benchmarks import llama_server, serve_ab
from benchmarks.llama_server import METRICS


def figures(value: float) -> dict:
    return dict.fromkeys(METRICS, value)


def test_rounds_alternate_the_order_and_share_each_rounds_seed(monkeypatch, tmp_path):
    calls = []

    def bench(server, workload, seed, quick, out):
        calls.append((server, workload, seed, out.name))
        return figures(len(calls))
    monkeypatch.setattr(llama_server, "bench", bench)
    entries = llama_server.alternate({"a": "A", "b": "B"}, ["single", "concurrent16"], 2,
                                     False, tmp_path, label="q4_1")
    assert [(server, workload, seed) for server, workload, seed, _ in calls] == [
        ("A", "single", 1000), ("B", "single", 1000),
        ("A", "concurrent16", 1001), ("B", "concurrent16", 1001),
        ("B", "single", 2000), ("A", "single", 2000),
        ("B", "concurrent16", 2001), ("A", "concurrent16", 2001)]
    assert calls[0][3] == "q4_1-single-round1-a.json"
    assert [e["order"] for e in entries] == [("a", "b"), ("a", "b"), ("b", "a"), ("b", "a")]
    assert entries[2]["a"]["output_tok_s"] == 6 and entries[2]["b"]["output_tok_s"] == 5


def test_serve_ab_reports_after_over_before_of_the_medians():
    rounds = [{"workload": "single", "before": figures(b), "after": figures(a)}
              for b, a in [(10.0, 9.0), (20.0, 8.0), (12.0, 30.0)]]
    summary = serve_ab.summarize(rounds)["single"]
    assert summary["before"]["tpot_p50_ms"] == 12.0 and summary["after"]["tpot_p50_ms"] == 9.0
    assert summary["ratio"]["tpot_p50_ms"] == pytest.approx(0.75)
