"""Scoring a text through the whole cluster, as lm-evaluation-harness's ``local-completions``
does (``echo``, ``logprobs``, ``max_tokens: 1``) with the official ``openai`` SDK, and vLLM's
``prompt_logprobs``: the served log-probabilities are those of a transformers forward pass
over the same token ids (fp32, the same weights), a cached prefix included."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch

from workers.model_loader import load_model

TEXT = ("The capital of France is Paris. The capital of Italy is Rome. The capital of Spain is "
        "Madrid, and the capital of Portugal is Lisbon.")


@pytest.fixture(scope="module")
def client(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def base_model(client) -> str:
    return next(m.id for m in client.models.list() if m.parent is None)


def served_ids(cluster, model: str, text: str) -> list[int]:
    """The ids ``/v1/completions`` computes for ``text`` (from ``/tokenize``)."""
    answer = httpx.post(f"{cluster.base_url}/tokenize", json={"model": model, "prompt": text},
                        timeout=30)
    return answer.json()["tokens"]


@pytest.fixture(scope="module")
def reference(cluster, base_model) -> torch.Tensor:
    """``[len(ids) - 1]`` for :data:`TEXT`'s served ids: each token's log-probability given
    those before it, by transformers over the embedded model in fp32 with SDPA attention."""
    ids = served_ids(cluster, base_model, TEXT)
    model = load_model("embedded", dtype="float32", device="cpu").model
    model.set_attn_implementation("sdpa")
    with torch.inference_mode():
        logprobs = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    return logprobs[:-1].gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)


def test_echo_scores_the_prompt_as_transformers_does_cached_or_not(cluster, client,
                                                                   base_model, reference):
    ids = served_ids(cluster, base_model, TEXT)
    want = reference.tolist()
    client.completions.create(model=base_model, prompt=TEXT, max_tokens=2, temperature=0)
    scored = client.completions.create(model=base_model, prompt=TEXT, max_tokens=1,
                                       temperature=0, echo=True, logprobs=1)
    choice = scored.choices[0]
    assert choice.text.startswith(TEXT)
    assert "".join(choice.logprobs.tokens[:len(ids)]) == TEXT
    assert choice.logprobs.token_logprobs[0] is None
    assert choice.logprobs.token_logprobs[1:len(ids)] == pytest.approx(want, abs=2e-3)
    assert len(choice.logprobs.tokens) == len(ids) + 1  # the prompt, then one new token
    # The prompt was cached by the request before; scoring it computed it all the same.
    assert scored.usage.prompt_tokens_details.cached_tokens == 0
    again = client.completions.create(model=base_model, prompt=TEXT, max_tokens=1,
                                      temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens > 0


def test_vllm_prompt_logprobs_rank_and_alternatives(cluster, client, base_model, reference):
    ids = served_ids(cluster, base_model, TEXT)
    want = reference
    answer = client.completions.create(model=base_model, prompt=TEXT, max_tokens=1,
                                       temperature=0, extra_body={"prompt_logprobs": 2})
    entries = answer.choices[0].model_extra["prompt_logprobs"]
    assert len(entries) == len(ids) and entries[0] is None
    for position, entry in enumerate(entries[1:], start=1):
        token = str(ids[position])
        assert entry[token]["logprob"] == pytest.approx(float(want[position - 1]), abs=2e-3)
        ranks = {key: e["rank"] for key, e in entry.items()}
        top = {key for key, rank in ranks.items() if rank <= 2}
        assert len(top) == 2 and len(entry) == 2 + (token not in top), entry
    paris = next(p for p in range(1, len(ids))
                 if "Paris" in entries[p][str(ids[p])]["decoded_token"])
    assert entries[paris][str(ids[paris])]["rank"] == 1  # " Paris" is the model's first guess


def test_echo_of_max_tokens_0_scores_the_prompt_alone(cluster, client, base_model,
                                                      reference):
    ids = served_ids(cluster, base_model, TEXT)
    scored = client.completions.create(model=base_model, prompt=TEXT, max_tokens=0,
                                       temperature=0, echo=True, logprobs=0)
    choice = scored.choices[0]
    assert (choice.text, choice.finish_reason) == (TEXT, "length")
    assert choice.logprobs.token_logprobs[0] is None
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(reference.tolist(), abs=2e-3)
    assert (scored.usage.prompt_tokens, scored.usage.completion_tokens) == (len(ids), 0)
