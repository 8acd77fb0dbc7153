"""API keys through the deployed application: ``ClusterConfig`` reaches the ingress replica,
which reads the keys file in its own process and re-reads it when it changes.

A second, one-worker application runs beside the shared cluster under its own route prefix, so
Serve's ``root_path`` is on the path the guard checks. Afterwards the Ray session's logs (Serve
access logs, replica logs) and the application's Redis entries are searched for the raw keys.
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import httpx
import pytest
import redis

from cluster.config import ClusterConfig
from router.api.auth import RELOAD_PERIOD_S

APP = "nalar-auth-e2e"
PREFIX = "/auth-e2e"
FIXED_KEY, FILE_KEY, NEW_KEY = "sk-e2e-fixed-7f3a", "sk-e2e-file-91c2", "sk-e2e-new-44d0"


@pytest.fixture
def keyed_app(cluster, redis_url: str, tmp_path: Path, tiny_model_dir: Path):
    """The keyed application (over a tiny model: keys are all it is about); yields its base
    URL, its keys file and its Redis key prefix."""
    from ray import serve

    from cluster.app import build_app

    keys_file = tmp_path / "api-keys"
    keys_file.write_text(f"# e2e\n{FILE_KEY}\n")
    key_prefix = f"nalar-auth-{uuid.uuid4().hex[:8]}"
    config = ClusterConfig(model=str(tiny_model_dir), num_workers=1, redis_url=redis_url,
                           key_prefix=key_prefix,
                           dtype="float32", kv_cache_mib=32, worker_threads=1,
                           speculative="off", api_keys=[FIXED_KEY],
                           api_keys_file=str(keys_file))
    serve.run(build_app(config), name=APP, route_prefix=PREFIX)
    yield f"{cluster.base_url}{PREFIX}", keys_file, key_prefix
    serve.delete(APP)
    client = redis.Redis.from_url(redis_url)
    stale = list(client.scan_iter(match=f"{key_prefix}*", count=1000))
    if stale:
        client.delete(*stale)
    client.close()


async def test_keys_reach_the_ingress_replica_and_never_leak(keyed_app, redis_url):
    base_url, keys_file, key_prefix = keyed_app
    chat = {"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 2,
            "temperature": 0}

    async def status(method: str, path: str, key: str | None = None) -> int:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        body = chat if method == "POST" else None
        return (await http.request(method, path, json=body, headers=headers)).status_code

    async with httpx.AsyncClient(base_url=base_url, timeout=120) as http:
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/chat/completions")):
            assert await status(method, path) == 401
            assert await status(method, path, "sk-unknown") == 401
            assert await status(method, path, FIXED_KEY) == 200
            assert await status(method, path, FILE_KEY) == 200
        assert await status("GET", "/health") == 200
        keys_file.write_text(f"{NEW_KEY}\n")
        await asyncio.sleep(RELOAD_PERIOD_S)
        assert await status("POST", "/v1/chat/completions", NEW_KEY) == 200
        assert await status("POST", "/v1/chat/completions", FILE_KEY) == 401
        assert await status("GET", "/v1/models", FIXED_KEY) == 200

    client = redis.Redis.from_url(redis_url)
    entries = list(client.scan_iter(match=f"{key_prefix}*", count=1000))
    stored = b"".join(name + (client.dump(name) or b"") for name in entries)
    client.close()
    assert entries  # the worker published its blocks under this prefix
    logs = _ray_logs()
    assert logs
    for key in (FIXED_KEY, FILE_KEY, NEW_KEY, "sk-unknown"):
        assert key.encode() not in stored
        assert key.encode() not in logs


def _ray_logs() -> bytes:
    """Every file of this Ray session's log directory, concatenated."""
    import ray

    logs_dir = Path(ray._private.worker._global_node.get_logs_dir_path())
    return b"".join(path.read_bytes() for path in sorted(logs_dir.rglob("*")) if path.is_file())
