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
