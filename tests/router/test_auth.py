"""API-key authentication (``router.api.auth``) through the real app, with the fake backend:
which routes need a key, the 401 answer, tenancy per accepted key, the keys file reloaded
without a restart, and no raw key anywhere in the logs."""

from __future__ import annotations

import logging
import os
import pickle
import time
from pathlib import Path

import pytest
from openai_fakes import CHAT, COMPLETIONS, HELLO, MODEL, SECRET, assert_error, expected_digests

from contract.identity import tenant_from_api_key
from router.api.auth import RELOAD_PERIOD_S, ApiKeys, parse_keys_file

KEY_A, KEY_B, FILE_KEY, NEW_KEY = "sk-alpha-0001", "sk-beta-0002", "sk-file-03", "sk-new-4"

V1_ROUTES = [("POST", CHAT, {"messages": HELLO}),
             ("POST", COMPLETIONS, {"prompt": "Hello there"}),
             ("GET", "/v1/models", None),
             ("GET", f"/v1/models/{MODEL}", None)]


class FakeClock:
    """Monotonic seconds that only move when a test says so."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def keys_file(tmp_path: Path) -> Path:
    path = tmp_path / "api-keys"
    path.write_text(f"# team keys\n\n  {FILE_KEY}  \n")
    return path


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def keys(backend, keys_file, clock) -> ApiKeys:
    """Two fixed keys and a keys file, on the fake backend (read per request by the app)."""
    backend.api_keys = ApiKeys([KEY_A, KEY_B], keys_file, clock=clock)
    return backend.api_keys


async def call(client, method: str, path: str, body, key: str | None = None,
               authorization: str | None = None):
    headers = {"Authorization": authorization or f"Bearer {key}"} if key or authorization else {}
    return await client.request(method, path, json=body, headers=headers)


# -- which requests get in ---------------------------------------------------------------------


@pytest.mark.parametrize("method,path,body", V1_ROUTES)
@pytest.mark.parametrize("authorization", [None, "Bearer sk-unknown", f"Bearer {KEY_A}x",
                                           f"Bearer {KEY_A[:-1]}", f"Basic {KEY_A}", "Bearer",
                                           KEY_A])
async def test_v1_routes_refuse_a_missing_or_unknown_key(client, backend, keys, method, path,
                                                         body, authorization):
    response = await call(client, method, path, body, authorization=authorization)
    error = assert_error(response, 401, None, "invalid_api_key")
    assert response.headers["www-authenticate"] == "Bearer"
    assert KEY_A not in error["message"]
    assert backend.requests == []


@pytest.mark.parametrize("method,path,body", V1_ROUTES)
async def test_the_admin_key_is_no_api_key(client, backend, keys, method, path, body):
    """Where API keys are configured, the operator's admin key (which loads adapters) is
    refused on the other /v1 routes like any key not listed (docs/api.md, LoRA adapters)."""
    from router.api.auth import AdminKey

    backend.admin_key = AdminKey("admin-secret")
    response = await call(client, method, path, body, "admin-secret")
    assert_error(response, 401, None, "invalid_api_key")
    assert backend.requests == []


@pytest.mark.parametrize("method,path,body", V1_ROUTES)
@pytest.mark.parametrize("key", [KEY_A, KEY_B, FILE_KEY])
async def test_v1_routes_serve_each_accepted_key(client, backend, keys, method, path, body, key):
    response = await call(client, method, path, body, key)
    assert response.status_code == 200, response.text
    assert len(backend.requests) == (1 if method == "POST" else 0)


@pytest.mark.parametrize("path,status", [("/health", 200), ("/ping", 200), ("/metrics", 404),
                                         ("/dashboard", 404), ("/dashboard/data", 404)])
async def test_probes_and_scrapes_need_no_key(client, keys, path, status):
    # The fake backend has no metrics registry and the bare app no dashboard: a 404, not 401.
    assert (await client.get(path)).status_code == status
    if path in ("/health", "/metrics"):  # probes may send HEAD
        assert (await client.head(path)).status_code == status


@pytest.mark.parametrize("path", ["/v1/nope", "/healthz", "/metricsx", "/openapi.json", "/docs",
                                  "/version", "/"])
async def test_every_other_path_needs_a_key(client, keys, path):
    """An allowlist: a route nobody classified is guarded, and a near-miss is not public."""
    assert_error(await client.get(path), 401, None, "invalid_api_key")
    assert (await client.get(path, headers={"Authorization": f"Bearer {KEY_A}"})
            ).status_code != 401


async def test_without_keys_the_server_is_open(client, backend, caplog):
    caplog.set_level(logging.INFO, logger="router.api.auth")
    backend.api_keys = ApiKeys()
    assert not backend.api_keys.enabled
    assert [r.getMessage() for r in caplog.records] == [
        "API keys: none configured: every request is served (open server)"]
    for key in (None, "sk-anything"):
        response = await call(client, "POST", CHAT, {"messages": HELLO}, key)
        assert response.status_code == 200, response.text
    assert [r.namespace.tenant for r in backend.requests] == [
        "anonymous", tenant_from_api_key("sk-anything", SECRET)]


# -- tenancy -----------------------------------------------------------------------------------


async def test_each_accepted_key_is_its_own_cache_namespace(client, backend, keys):
    for key in (KEY_A, KEY_B, FILE_KEY, KEY_A):
        response = await call(client, "POST", CHAT, {"messages": HELLO}, key)
        assert response.status_code == 200, response.text
    a, b, from_file, a_again = backend.requests
    for request, key in zip(backend.requests, (KEY_A, KEY_B, FILE_KEY, KEY_A), strict=True):
        assert request.namespace.tenant == tenant_from_api_key(key, SECRET)
        assert request.prompt_digests.digests == expected_digests(request.token_ids, key)
    assert len(a.prompt_digests.digests) >= 2
    # one key shares its cached prefixes
    assert a_again.prompt_digests.digests == a.prompt_digests.digests
    assert a_again.namespace == a.namespace
    scopes = [set(r.prompt_digests.digests) for r in (a, b, from_file)]
    assert not scopes[0] & scopes[1] and not scopes[0] & scopes[2] and not scopes[1] & scopes[2]


# -- the keys file -----------------------------------------------------------------------------


def test_keys_file_format():
    text = "# comment\n\nsk-1\n  sk-2\t\n   # indented comment\nsk-3 \n"
    assert parse_keys_file(text) == ["sk-1", "sk-2", "sk-3"]


async def test_edited_keys_file_takes_effect_within_the_reload_period(client, backend,
                                                                      keys_file):
    """Real time, default period: a key added is accepted and a key removed refused one
    period after the edit, with no restart."""
    backend.api_keys = ApiKeys([KEY_A], keys_file)
    chat = {"messages": HELLO}
    assert (await call(client, "POST", CHAT, chat, FILE_KEY)).status_code == 200
    keys_file.write_text(f"{NEW_KEY}\n")
    time.sleep(RELOAD_PERIOD_S)
    assert (await call(client, "POST", CHAT, chat, NEW_KEY)).status_code == 200
    assert_error(await call(client, "POST", CHAT, chat, FILE_KEY), 401, None, "invalid_api_key")
    assert (await call(client, "POST", CHAT, chat, KEY_A)).status_code == 200  # fixed keys stay


def test_keys_file_is_checked_at_most_once_per_period(keys, keys_file, clock, monkeypatch):
    stats = []
    real_stat = os.stat
    monkeypatch.setattr(os, "stat", lambda path: stats.append(path) or real_stat(path))
    keys_file.write_text(f"{NEW_KEY}\n")
    for _ in range(5):
        assert keys.accepts(FILE_KEY) and not keys.accepts(NEW_KEY)  # not re-read yet
    assert stats == []
    clock.now += RELOAD_PERIOD_S
    assert keys.accepts(NEW_KEY) and not keys.accepts(FILE_KEY)
    assert stats == [keys_file]


def test_unreadable_keys_file_keeps_the_last_good_set_and_logs_once(keys, keys_file, clock,
                                                                    caplog):
    caplog.set_level(logging.INFO, logger="router.api.auth")
    keys_file.unlink()
    for _ in range(3):
        clock.now += RELOAD_PERIOD_S
        assert keys.accepts(FILE_KEY) and keys.accepts(KEY_A)
    keys_file.write_bytes(b"sk-\xff\xfe-not-utf8\n")
    clock.now += RELOAD_PERIOD_S
    assert keys.accepts(FILE_KEY)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [f"API keys file {keys_file} cannot be read (No such file or directory); "
                        "keeping the last 1 keys read from it"]
    keys_file.write_text(f"{NEW_KEY}\n")
    clock.now += RELOAD_PERIOD_S
    assert keys.accepts(NEW_KEY) and not keys.accepts(FILE_KEY)
    assert f"API keys file {keys_file} readable again" in caplog.messages


def test_a_missing_keys_file_stops_the_start(tmp_path):
    with pytest.raises(FileNotFoundError):
        ApiKeys([KEY_A], tmp_path / "absent")


async def test_a_keys_file_without_keys_refuses_everyone(client, backend, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="router.api.auth")
    empty = tmp_path / "empty"
    empty.write_text("# no keys yet\n\n")
    backend.api_keys = ApiKeys(path=empty)
    assert f"API keys file {empty}: 0 keys" in caplog.messages
    assert_error(await call(client, "GET", "/v1/models", None), 401, None, "invalid_api_key")
    assert_error(await call(client, "GET", "/v1/models", None, "sk-x"), 401, None,
                 "invalid_api_key")


# -- keys never leak ---------------------------------------------------------------------------


async def test_no_raw_key_in_logs(client, backend, keys_file, caplog):
    caplog.set_level(logging.DEBUG)
    backend.api_keys = ApiKeys([KEY_A, KEY_B], keys_file)
    for key in (KEY_A, FILE_KEY, "sk-refused-key-9"):
        await call(client, "POST", CHAT, {"messages": HELLO}, key)
        await call(client, "GET", "/v1/models", None, key)
    backend.script = lambda request: [RuntimeError("worker crashed")]
    assert (await call(client, "POST", CHAT, {"messages": HELLO}, KEY_A)).status_code == 500
    assert len(backend.requests) == 3
    logged = caplog.text + "".join(str(r.args) for r in caplog.records)
    assert "API keys: required on every route" in caplog.text
    for key in (KEY_A, KEY_B, FILE_KEY, "sk-refused-key-9"):
        assert key not in logged


def test_only_digests_of_the_keys_are_kept(keys_file):
    keys = ApiKeys([KEY_A], keys_file)
    state = pickle.dumps(vars(keys))
    assert KEY_A.encode() not in state and FILE_KEY.encode() not in state
    assert KEY_A not in keys.describe() and FILE_KEY not in keys.describe()
