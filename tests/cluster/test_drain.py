"""A clean stop of a real ``nalar serve``: SIGTERM while two streams run drains the server.

The short stream finishes; the long one ends with an SSE error event at the drain deadline;
meanwhile ``/health`` and new requests get 503 ``shutting_down``; then Serve stops, the process
exits 0, and the port refuses connections.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from helpers import free_port

REPO = Path(__file__).resolve().parents[2]
DRAIN_TIMEOUT_S = 5
START_TIMEOUT_S = 300
SHORT_TOKENS = 24  # finishes well within the drain deadline
# Cannot finish within the deadline: a fast host decodes the Q4_1 model at ~100 tokens/s
# (1,000 tokens once finished in 9.9 s); 320 MiB of fp32 KV holds ~7,000 tokens.
LONG_TOKENS = 6000


@dataclass
class Server:
    process: subprocess.Popen[str]
    url: str
    output: list[str]  # its stdout and stderr lines, read by a thread so it never blocks
    reader: threading.Thread


@pytest.fixture
def server() -> Iterator[Server]:
    """``nalar serve`` with one small float32 worker on a private Ray (the embedded index:
    no shared Redis is touched), once it says it is ready."""
    port = free_port()
    env = {key: value for key, value in os.environ.items() if key != "REDIS_URL"}
    env["RAY_ADDRESS"] = "local"  # its own Ray, never the test session's
    command = [sys.executable, "-m", "cluster.cli", "serve", "--workers", "1",
               "--dtype", "float32", "--kv-memory-mib", "320", "--worker-threads", "1",
               "--speculative", "off", "--port", str(port),
               "--drain-timeout", str(DRAIN_TIMEOUT_S)]
    process = subprocess.Popen(command, cwd=REPO, env=env, text=True, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT)
    output: list[str] = []
    ready = threading.Event()

    def read() -> None:
        for line in process.stdout:
            output.append(line)
            if "Nalar Serve is ready" in line:
                ready.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not ready.wait(0.5):
            if process.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"nalar serve did not get ready: {''.join(output)}")
        yield Server(process, f"http://127.0.0.1:{port}", output, reader)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def stream_request(client: httpx.Client, max_tokens: int) -> Iterator[str]:
    """The ``data:`` payloads of a streaming completion, as they arrive."""
    body = {"prompt": "Count: one, two, three,", "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                yield line[len("data: "):]


def wait_for_draining(client: httpx.Client, timeout_s: float = 30) -> httpx.Response:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        health = client.get("/health")
        if health.status_code == 503:
            return health
        time.sleep(0.05)
    pytest.fail("the server never started draining")


def test_sigterm_drains_then_stops(server):
    process = server.process
    with httpx.Client(base_url=server.url, timeout=120) as client:
        short, long = stream_request(client, SHORT_TOKENS), stream_request(client, LONG_TOKENS)
        assert json.loads(next(short))["choices"][0]["text"] is not None
        assert json.loads(next(long))["choices"][0]["text"] is not None
        process.send_signal(signal.SIGTERM)
        signalled = time.monotonic()

        health = wait_for_draining(client)
        assert health.json()["error"]["code"] == "shutting_down"
        refused = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "shutting_down"
        assert refused.headers["retry-after"] == "1"

        short_events = [json.loads(e) if e != "[DONE]" else e for e in short]
        long_events = [json.loads(e) if e != "[DONE]" else e for e in long]

    assert short_events[-1] == "[DONE]"
    assert short_events[-2]["usage"]["completion_tokens"] == SHORT_TOKENS
    assert short_events[-3]["choices"][0]["finish_reason"] == "length"
    assert long_events[-1] == "[DONE]"
    assert long_events[-2]["error"]["code"] == "shutting_down"
    assert time.monotonic() - signalled >= DRAIN_TIMEOUT_S - 1

    assert process.wait(timeout=120) == 0
    server.reader.join(timeout=10)
    output = "".join(server.output)
    assert time.monotonic() - signalled < DRAIN_TIMEOUT_S + 60
    assert "drained: 1 finished, 1 ended at the deadline" in output
    assert "stopped." in output
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{server.url}/health", timeout=5)
