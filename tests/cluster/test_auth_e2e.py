"""API keys through the deployed application: ``ClusterConfig`` reaches the ingress replica,
which reads the keys file in its own process and re-reads it when it changes.

The side application (``side_app`` in conftest.py: keys, and a route prefix of its own beside
the shared cluster, so Serve's ``root_path`` is on the path the guard checks). Afterwards the
Ray session's logs (Serve access logs, replica logs) are searched for the raw keys. (Its index
is the embedded one: what the index stores is digests and worker ids, which no key reaches;
the tenant a key scopes is a keyed hash made in the ingress.)
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx

from router.api.auth import RELOAD_PERIOD_S

NEW_KEY = "sk-side-new-44d0"


async def test_keys_reach_the_ingress_replica_and_never_leak(side_app):
    chat = {"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 2,
            "temperature": 0}

    async def status(method: str, path: str, key: str | None = None) -> int:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        body = chat if method == "POST" else None
        return (await http.request(method, path, json=body, headers=headers)).status_code

    async with httpx.AsyncClient(base_url=side_app.base_url, timeout=120) as http:
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/chat/completions")):
            assert await status(method, path) == 401
            assert await status(method, path, "sk-unknown") == 401
            assert await status(method, path, side_app.fixed_key) == 200
            assert await status(method, path, side_app.file_key) == 200
        assert await status("GET", "/health") == 200
        side_app.keys_file.write_text(f"{NEW_KEY}\n")
        await asyncio.sleep(RELOAD_PERIOD_S)
        assert await status("POST", "/v1/chat/completions", NEW_KEY) == 200
        assert await status("POST", "/v1/chat/completions", side_app.file_key) == 401
        assert await status("GET", "/v1/models", side_app.fixed_key) == 200

    logs = _ray_logs()
    assert logs
    for key in (side_app.fixed_key, side_app.file_key, NEW_KEY, "sk-unknown"):
        assert key.encode() not in logs


def _ray_logs() -> bytes:
    """Every file of this Ray session's log directory, concatenated."""
    import ray

    logs_dir = Path(ray._private.worker._global_node.get_logs_dir_path())
    return b"".join(path.read_bytes() for path in sorted(logs_dir.rglob("*")) if path.is_file())
