"""End to end through HTTP: ingress → prefix-aware router → two workers → Redis index."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from ray import serve

from cluster.app import APP_NAME, INGRESS_DEPLOYMENT, WORKER_DEPLOYMENT
from cluster.cli import main as nalar_main
from contract.identity import CacheNamespace, block_digests, tenant_from_api_key
from router.index.redis_index import RedisIndex
from workers.model_source import load_tokenizer

QUESTION_A = "Which rule is stated first? Answer in one short sentence."
QUESTION_B = "How many rules are there? Answer with a number."


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("embedded")


@pytest.fixture(scope="module")
def system_prompt(tokenizer) -> str:
    """A system prompt of about 512 tokens."""
    rules = " ".join(f"Rule {i}: always answer politely and cite the rule number {i}."
                     for i in range(1, 80))
    ids = tokenizer.encode(rules, add_special_tokens=False)[:512]
    return tokenizer.decode(ids)


@pytest.fixture(scope="module")
def worker_identity(cluster):
    description = serve.get_deployment_handle(WORKER_DEPLOYMENT, APP_NAME).describe.remote()
    return description.result().identity


def chat_body(system: str, question: str, **extra) -> dict:
    return {"messages": [{"role": "system", "content": system},
                         {"role": "user", "content": question}],
            "max_tokens": 12, "temperature": 0, **extra}


async def post(client: httpx.AsyncClient, path: str, body: dict, key: str | None = None):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return await client.post(path, json=body, headers=headers, timeout=120)


def cached_tokens(response: httpx.Response) -> int:
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


async def wait_for_credit(index: RedisIndex, model_key: str, digests: list[bytes],
                          worker: str, blocks: int, deadline_s: float = 30.0) -> int:
    """Poll the index (never sleep blindly) until ``worker`` is credited with ``blocks``."""
    deadline = time.monotonic() + deadline_s
    while True:
        held = (await index.match(model_key, digests, [worker]))[worker].blocks
        if held >= blocks or time.monotonic() > deadline:
            return held
        await asyncio.sleep(0.05)


async def test_shared_system_prompt_hits_the_worker_holding_it(
        cluster, tokenizer, system_prompt, worker_identity):
    body_a = chat_body(system_prompt, QUESTION_A)
    body_b = chat_body(system_prompt, QUESTION_B)
    ids_b = tokenizer.apply_chat_template(body_b["messages"], add_generation_prompt=True,
                                          tokenize=True)["input_ids"]
    tenant = tenant_from_api_key("key-a", bytes.fromhex(cluster.config.namespace_secret))
    root = worker_identity.with_namespace(CacheNamespace(tenant)).root_digest
    digests_b = block_digests(root, ids_b, worker_identity.block_size)
    shared_blocks = 512 // worker_identity.block_size
    index = RedisIndex(cluster.config.redis_url, cluster.config.key_prefix)
    async with httpx.AsyncClient(base_url=cluster.base_url) as client:
        first = await post(client, "/v1/chat/completions", body_a, "key-a")
        assert first.status_code == 200, first.text
        holder = first.headers["x-nalar-worker"]
        held = await wait_for_credit(index, worker_identity.model_key, digests_b, holder,
                                     shared_blocks)
        assert held >= shared_blocks  # the prefix reached the index before the next request

        warm = await post(client, "/v1/chat/completions", body_b, "key-a")
        other_tenant = await post(client, "/v1/chat/completions", body_b, "key-b")
    await index.close()
    assert warm.status_code == other_tenant.status_code == 200
    assert warm.json()["usage"]["prompt_tokens"] == len(ids_b) > 520
    assert cached_tokens(warm) >= 496
    assert warm.headers["x-nalar-worker"] == holder
    assert cached_tokens(other_tenant) == 0
    # The other tenant's request was computed cold: the warm answer must equal it.
    warm_text = warm.json()["choices"][0]["message"]["content"]
    assert warm_text == other_tenant.json()["choices"][0]["message"]["content"]
    assert warm_text


async def test_bad_requests_get_openai_errors_and_leave_others_running(cluster):
    good = chat_body("You are brief.", "Name a color.")
    bad_cases = [
        ({"model": "x", "max_tokens": 4}, 400, None),  # neither messages nor prompt
        ({"messages": [], "max_tokens": 4}, 400, None),
        ({"prompt": "hi", "max_tokens": 4, "model": "no-such-model"}, 404, "model_not_found"),
        ({"prompt": [1, 2, 10**9], "max_tokens": 4}, 400, None),
        ({"prompt": "hi", "max_tokens": 4, "temperature": -1}, 400, None),
        ({"prompt": "word " * 9000, "max_tokens": 4}, 400, "context_length_exceeded"),
    ]
    async with httpx.AsyncClient(base_url=cluster.base_url) as client:
        good_task = asyncio.create_task(post(client, "/v1/chat/completions", good))
        paths = ["/v1/chat/completions", "/v1/chat/completions"] + ["/v1/completions"] * 4
        bad = await asyncio.gather(*(post(client, path, body)
                                     for path, (body, _, _) in zip(paths, bad_cases,
                                                                   strict=True)))
        malformed = await client.post("/v1/chat/completions", content=b"{not json",
                                      headers={"Content-Type": "application/json"})
        ok = await good_task
    for response, (_, status, code) in zip(bad, bad_cases, strict=True):
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert error["message"] and error["type"]
        if code:
            assert error["code"] == code
    assert malformed.status_code == 400
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"]


async def test_streaming_ends_with_done_and_reports_usage(cluster):
    body = {"prompt": "The capital of France is", "max_tokens": 6, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    async with httpx.AsyncClient(base_url=cluster.base_url) as client:
        plain = await post(client, "/v1/completions", {**body, "stream": False,
                                                       "stream_options": None})
        async with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            assert response.headers["x-nalar-worker"]
            lines = [line async for line in response.aiter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    import json

    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == plain.json()["choices"][0]["text"]
    assert chunks[-1]["usage"]["completion_tokens"] == 6


async def test_models_and_health(cluster):
    async with httpx.AsyncClient(base_url=cluster.base_url) as client:
        models = (await client.get("/v1/models")).json()
        health = await client.get("/health")
    base = "SmolLM2-135M-Instruct"
    assert [(m["id"], m["parent"]) for m in models["data"]] == [
        (base, None), ("lora-a", base), ("lora-b", base)]
    assert health.status_code == 200
    # Asked of Serve's controller from inside the ingress replica, not through a worker's
    # request queue (where, under a full load, it waited past its timeout)
    ingress = serve.get_deployment_handle(INGRESS_DEPLOYMENT, APP_NAME)
    assert await ingress.is_ready.remote() is True


def test_nalar_chat_prints_reply_cached_tokens_and_ttft(cluster, capsys):
    args = ["chat", "Say hello.", "--url", cluster.base_url, "--max-tokens", "8"]
    assert nalar_main(args) == 0
    assert nalar_main(args) == 0
    out = capsys.readouterr().out
    assert out.count("TTFT") == 2
    # The second run reuses at least the chat template's default system prompt block.
    assert "cached 0 " in out.split("--")[1]
    assert "cached 0 " not in out.split("--")[-1]


async def test_a_batch_prompt_is_answered_as_its_prompts_are_alone(cluster):
    """Regression: the prompts of a batch are worker calls in flight at once within one HTTP
    request; they shared Serve's internal request id, by which its router indexes the calls
    waiting for a replica, and a batch of three never answered. Streamed, each choice's
    deltas make the same texts."""
    prompts = ["The capital of France is", "1, 2, 3, 4,", "Once upon a time"]
    body = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=cluster.base_url) as client:
        batch = await asyncio.wait_for(
            post(client, "/v1/completions", {"prompt": prompts, **body}), 60)
        streamed = await asyncio.wait_for(
            post(client, "/v1/completions", {"prompt": prompts, "stream": True, **body}), 60)
        alone = [await post(client, "/v1/completions", {"prompt": p, **body}) for p in prompts]
    texts = ["", "", ""]
    for line in streamed.text.splitlines():
        if line.startswith("data: {"):
            [choice] = json.loads(line[len("data: "):])["choices"]
            texts[choice["index"]] += choice["text"]
    assert texts == [r.json()["choices"][0]["text"] for r in alone], streamed.text
    assert streamed.text.endswith("data: [DONE]\n\n")
    assert batch.status_code == 200, batch.text
    answer = batch.json()
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2]
    assert [c["text"] for c in answer["choices"]] == [
        r.json()["choices"][0]["text"] for r in alone]
    assert answer["usage"]["prompt_tokens"] == sum(r.json()["usage"]["prompt_tokens"]
                                                   for r in alone)
    assert answer["usage"]["completion_tokens"] == 18
