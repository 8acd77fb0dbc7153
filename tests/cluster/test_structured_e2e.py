"""Structured output through the whole cluster, driven by the official ``openai`` SDK: a
pydantic model as ``response_format`` (``chat.completions.parse``), a streamed JSON-schema
answer, vLLM's ``structured_outputs``, and a bad schema answered with a 400 while the cluster
keeps serving."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field


class City(BaseModel):
    name: str = Field(max_length=24)
    country: str = Field(max_length=24)
    population_millions: int


@pytest.fixture(scope="module")
def client(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key="unused", max_retries=0)


def model_name(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def test_parse_with_a_pydantic_model(client):
    completion = client.chat.completions.parse(
        model=model_name(client), max_tokens=80, temperature=0, response_format=City,
        messages=[{"role": "user", "content": "Give one large city as JSON."}])
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, City)


def test_a_streamed_json_schema_answer_validates(client):
    schema = {"type": "object", "properties": {
        "colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                   "minItems": 2, "maxItems": 3}},
        "required": ["colors"], "additionalProperties": False}
    stream = client.chat.completions.create(
        model=model_name(client), max_tokens=60, temperature=1, seed=3, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "colors",
                                                                 "schema": schema}},
        messages=[{"role": "user", "content": "Name some colors."}])
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), schema)
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_vllm_structured_outputs_and_a_bad_schema(client):
    answer = client.completions.create(
        model=model_name(client), prompt="Is water wet? Answer:", max_tokens=5,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert answer.choices[0].text in ("yes", "no")
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=model_name(client), max_tokens=5,
            messages=[{"role": "user", "content": "hi"}],
            response_format={"type": "json_schema", "json_schema": {
                "name": "x", "schema": {"type": "object", "if": {"type": "object"}}}})
    assert '"if"' in refused.value.body["message"]
    assert refused.value.body["param"] == "response_format"
    again = client.completions.create(model=model_name(client), prompt="Hi", max_tokens=2)
    assert again.choices[0].finish_reason == "length"
