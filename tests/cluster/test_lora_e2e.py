"""LoRA adapters through the whole cluster, driven by the official ``openai`` SDK: an adapter
selected by ``model`` changes the answer, is reported back, and never shares KV with the base
model or another adapter, in the workers, the index or the router."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
from helpers import CLUSTER_ADMIN_KEY, CLUSTER_LORA_ADAPTERS, write_lora_adapter

SYSTEM = " ".join(f"Rule {i}: answer briefly and cite rule {i}." for i in range(1, 40))


@pytest.fixture(scope="module")
def client(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key="unused", max_retries=0)


def ask(client: openai.OpenAI, model: str, question: str = "Name a color."):
    return client.chat.completions.create(
        model=model, max_tokens=10, temperature=0,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}])


def cached(completion) -> int:
    return completion.usage.prompt_tokens_details.cached_tokens


def test_models_lists_each_adapter_with_the_base_as_parent(client):
    models = {model.id: model for model in client.models.list()}
    base = next(name for name, model in models.items() if model.parent is None)
    assert {name for name, model in models.items() if model.parent == base} == set(
        CLUSTER_LORA_ADAPTERS)
    assert client.models.retrieve("lora-a").parent == base


def test_adapter_requests_answer_differently_and_never_share_kv(client):
    base_model = next(m.id for m in client.models.list() if m.parent is None)
    # fresh question: no earlier test cached this prompt
    question = "Which rule mentions the number seven?"
    base = ask(client, base_model, question)
    lora_a = ask(client, "lora-a", question)
    lora_b = ask(client, "lora-b", question)
    assert (base.model, lora_a.model, lora_b.model) == (base_model, "lora-a", "lora-b")
    assert cached(lora_a) == cached(lora_b) == 0  # the base model's blocks are not theirs
    texts = {c.choices[0].message.content for c in (base, lora_a, lora_b)}
    assert len(texts) == 3
    again = ask(client, "lora-a", question)
    assert cached(again) >= (again.usage.prompt_tokens - 1) // 16 * 16 > 0  # routed to it
    assert again.choices[0].message.content == lora_a.choices[0].message.content


def test_an_unknown_adapter_is_a_404_model_not_found(client):
    with pytest.raises(openai.NotFoundError) as refused:
        ask(client, "lora-z")
    assert refused.value.body["code"] == "model_not_found"


def recovered_by_a_new_ingress() -> dict:
    """What a restarted ingress's catalog would hold: recovered from the real replicas."""
    import asyncio

    from ray import serve

    from cluster.adapters import AdapterCatalog
    from cluster.app import APP_NAME, WORKER_DEPLOYMENT

    catalog = AdapterCatalog(serve.get_deployment_handle(WORKER_DEPLOYMENT, APP_NAME), {})
    asyncio.run(catalog.recover())
    return catalog.adapters


def test_the_admin_key_loads_an_adapter_every_worker_serves_then_unloads_it(cluster, client):
    import httpx

    directory = write_lora_adapter(Path(cluster.config.lora_dirs[0]) / "runtime", seed=9)
    admin = {"Authorization": f"Bearer {CLUSTER_ADMIN_KEY}"}
    with httpx.Client(base_url=cluster.base_url, timeout=120) as http:
        outside = http.post("/v1/load_lora_adapter", headers=admin, json={
            "lora_name": "sneaky", "lora_path": str(directory.parent.parent)})
        assert outside.status_code == 400 and outside.json()["error"]["param"] == "lora_path"
        assert "outside the allowed" in outside.json()["error"]["message"]
        loaded = http.post("/v1/load_lora_adapter", headers=admin, json={
            "lora_name": "runtime", "lora_path": str(directory)})
        assert loaded.status_code == 200, loaded.text
        answers = [ask(client, "runtime", f"Count to {n}.") for n in range(4)]
        assert {a.model for a in answers} == {"runtime"}
        stats = http.get("/metrics").text
        assert "nalar:lora_adapters_loaded" in stats
        recovered = recovered_by_a_new_ingress()
        assert set(recovered) == set(CLUSTER_LORA_ADAPTERS) | {"runtime"}
        assert recovered["runtime"].source == str(directory)
        unloaded = http.post("/v1/unload_lora_adapter", headers=admin,
                             json={"lora_name": "runtime"})
        assert unloaded.status_code == 200, unloaded.text
    with pytest.raises(openai.NotFoundError):
        ask(client, "runtime")
    assert "sneaky" not in {m.id for m in client.models.list()}
