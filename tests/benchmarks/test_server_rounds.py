"""How the side-by-side benchmarks (``llama_server.py``, ``serve_ab.py``) alternate servers and
summarize rounds (``bench`` replaced by a recorder), and how a server whose port was taken
starts on another (a stand-in server, no model)."""

from __future__ import annotations

import sys

import httpx
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


FAILS_ONCE_ON_ITS_PORT = """
import http.server, pathlib, sys
marker = pathlib.Path(sys.argv[1])
if not marker.exists():
    marker.write_text(sys.argv[-1])
    print("couldn't bind HTTP server socket, port", sys.argv[-1])
    sys.exit(1)
http.server.HTTPServer(("127.0.0.1", int(sys.argv[-1])),
                       http.server.SimpleHTTPRequestHandler).serve_forever()
"""


def test_a_server_whose_port_was_taken_starts_on_another(tmp_path):
    marker = tmp_path / "first_port"
    port = llama_server.free_port()
    server = llama_server.Server(
        "fake", [sys.executable, "-c", FAILS_ONCE_ON_ITS_PORT, str(marker), "--port", str(port)],
        port, "/", tmp_path / "fake.log", cwd=tmp_path)
    try:
        server.start(timeout_s=30)
        assert marker.read_text() == str(port)  # the first try's port
        assert server.port != port and server.command[-1] == str(server.port)
        assert httpx.get(server.url + "/", timeout=5).status_code == 200
    finally:
        server.stop(grace_s=5)
