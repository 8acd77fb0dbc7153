"""Selecting a LoRA adapter through the OpenAI API: ``model`` names it, the worker's request
carries it by name and content digest, the routing digests chain from it (never from its name
alone), ``/v1/models`` lists it with its parent, and an unknown name is a 404."""

from __future__ import annotations

import pytest
from openai_fakes import IDENTITY, MODEL, assert_error

from contract.identity import AdapterRef, CacheNamespace, block_digests
from contract.request import InvalidRequestError

ADAPTER = AdapterRef("sql", "11" * 32)
RELOADED = AdapterRef("sql", "22" * 32)  # the same name, other weights
PROMPT = list(range(100, 100 + 3 * 16 + 5))


@pytest.fixture
def backend(backend):
    backend.adapters = {"sql": ADAPTER, "chat": AdapterRef("chat", "33" * 32)}
    return backend


async def complete(client, model: str | None):
    body = {"prompt": PROMPT, "max_tokens": 2, **({"model": model} if model else {})}
    return await client.post("/v1/completions", json=body)


def digests_under(adapter: AdapterRef | None) -> list[bytes]:
    root = IDENTITY.root_for(CacheNamespace(), adapter)
    return block_digests(root, PROMPT, IDENTITY.block_size)


async def test_model_selects_the_adapter_by_name_and_digest(client, backend):
    response = await complete(client, "sql")
    assert response.status_code == 200, response.text
    assert response.json()["model"] == "sql"
    request = backend.requests[-1]
    assert request.adapter == ADAPTER
    assert request.prompt_digests.digests == digests_under(ADAPTER)


async def test_base_and_adapter_digests_are_disjoint_and_follow_content(client, backend):
    for model in (MODEL, None, "sql", "chat"):
        assert (await complete(client, model)).status_code == 200
    base, default, sql, chat = [r.prompt_digests.digests for r in backend.requests]
    assert base == default == digests_under(None)
    assert backend.requests[0].adapter is None
    assert not set(base) & set(sql) and not set(sql) & set(chat) and not set(base) & set(chat)
    backend.adapters = {"sql": RELOADED}  # reloaded with other weights
    assert (await complete(client, "sql")).status_code == 200
    reloaded = backend.requests[-1].prompt_digests.digests
    assert reloaded == digests_under(RELOADED) and not set(reloaded) & set(sql)


async def test_models_lists_adapters_with_their_parent(client):
    listed = (await client.get("/v1/models")).json()["data"]
    assert [(m["id"], m["parent"]) for m in listed] == [
        (MODEL, None), ("chat", MODEL), ("sql", MODEL)]
    one = (await client.get("/v1/models/sql")).json()
    assert (one["id"], one["parent"]) == ("sql", MODEL)


async def test_an_unknown_adapter_is_a_404(client, backend):
    response = await complete(client, "sq")
    assert_error(response, 404, "model", "model_not_found")
    assert "'sql'" in response.json()["error"]["message"]  # the names that exist
    assert_error(await client.get("/v1/models/sq"), 404, "model", "model_not_found")
    assert backend.requests == []


async def test_a_worker_refusing_a_reloaded_adapter_is_a_404(client, backend):
    backend.script = lambda request: [InvalidRequestError(
        "The adapter 'sql' was reloaded with other weights; retry", "model", "model_not_found")]
    assert_error(await complete(client, "sql"), 404, "model", "model_not_found")


# --- loading and unloading at run time: the admin key only --------------------------------

ADMIN = "admin-secret"
TENANT = "tenant-key"


@pytest.fixture
def admin_backend(backend):
    from router.api.auth import AdminKey, ApiKeys

    backend.admin_key = AdminKey(ADMIN)
    backend.api_keys = ApiKeys([TENANT])
    return backend


async def post_admin(client, path: str, body: dict, key: str | None):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return await client.post(path, json=body, headers=headers)


async def test_only_the_admin_key_loads_and_unloads(client, admin_backend):
    body = {"lora_name": "new", "lora_path": "/adapters/new"}
    assert_error(await post_admin(client, "/v1/load_lora_adapter", body, TENANT), 403, None,
                 "forbidden", "permission_error")
    assert_error(await post_admin(client, "/v1/load_lora_adapter", body, None), 401, None,
                 "invalid_api_key")
    assert "new" not in admin_backend.adapters
    loaded = await post_admin(client, "/v1/load_lora_adapter", body, ADMIN)
    assert loaded.status_code == 200, loaded.text
    assert loaded.text == "Success: LoRA adapter 'new' added successfully."
    listed = (await client.get("/v1/models", headers={"Authorization": f"Bearer {TENANT}"}))
    assert "new" in [m["id"] for m in listed.json()["data"]]
    # the admin key is not a tenant key: it serves no completions
    assert (await post_admin(client, "/v1/completions", {"prompt": "hi"}, ADMIN)
            ).status_code == 401
    unload = {"lora_name": "new"}
    assert_error(await post_admin(client, "/v1/unload_lora_adapter", unload, TENANT), 403,
                 None, "forbidden", "permission_error")
    assert (await post_admin(client, "/v1/unload_lora_adapter", unload, ADMIN)
            ).status_code == 200
    assert_error(await post_admin(client, "/v1/unload_lora_adapter", unload, ADMIN), 404,
                 "lora_name", "model_not_found")


async def test_without_an_admin_key_the_routes_are_off(client, backend):
    body = {"lora_name": "new", "lora_path": "/adapters/new"}
    error = assert_error(await post_admin(client, "/v1/load_lora_adapter", body, "anything"),
                         403, None, "forbidden", "permission_error")
    assert "--admin-api-key" in error["message"]


async def test_malformed_load_bodies_are_400s(client, admin_backend):
    for body, param in (({"lora_name": "x"}, "lora_path"),
                        ({"lora_name": "", "lora_path": "/a"}, "lora_name"),
                        ({"lora_name": MODEL, "lora_path": "/a"}, "lora_name"),
                        # names a client cannot tell from another in /v1/models
                        ({"lora_name": f"{MODEL} ", "lora_path": "/a"}, "lora_name"),
                        ({"lora_name": " ", "lora_path": "/a"}, "lora_name"),
                        ({"lora_name": "s\u200bql", "lora_path": "/a"}, "lora_name"),
                        ({"lora_name": "s\tql", "lora_path": "/a"}, "lora_name"),
                        ({"lora_name": "x", "lora_path": "/a", "extra": 1}, "extra")):
        response = await post_admin(client, "/v1/load_lora_adapter", body, ADMIN)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == param
        assert "Value error" not in response.json()["error"]["message"]
    assert admin_backend.adapters.keys() == {"sql", "chat"}
