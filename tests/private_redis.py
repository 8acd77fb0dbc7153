"""A private ``redis-server`` for tests that must kill and restart Redis (never the shared one).

Importable from any test module: ``tests/conftest.py`` puts this directory on ``sys.path``.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator

import pytest
import redis


class PrivateRedis:
    """A ``redis-server`` without persistence on a free port, killed and restarted (empty) on
    that same port at will.

    Args:
        binary: path of the ``redis-server`` executable.
    """

    def __init__(self, binary: str) -> None:
        self.binary = binary
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        """Start it, empty, and wait up to 10 s for PING.

        Raises:
            RuntimeError: it did not answer within 10 s.
        """
        self.process = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis.from_url(self.url, socket_connect_timeout=0.5)
        try:
            deadline = time.monotonic() + 10.0
            while time.monotonic() < deadline and self.process.poll() is None:
                try:
                    if client.ping():
                        return
                except redis.ConnectionError:
                    time.sleep(0.05)
        finally:
            client.close()
        self.kill()
        raise RuntimeError(f"redis-server on port {self.port} did not answer PING in 10 s")

    def kill(self) -> None:
        """Kill it (nothing is saved) and wait until it is gone."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)

    def restart(self) -> None:
        """Kill it and start it again, empty, on the same port."""
        self.kill()
        self.start()


def private_redis_server() -> Iterator[PrivateRedis]:
    """Body of a fixture: a started :class:`PrivateRedis`, killed afterwards; skips the test
    when no ``redis-server`` binary is installed."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("no redis-server binary")
    server = PrivateRedis(binary)
    server.start()
    yield server
    server.kill()
