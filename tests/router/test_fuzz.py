"""Hostile input against the OpenAI routes.

Bodies come from the app's own OpenAPI schema (schemathesis's generators: bodies the schema
allows and bodies it forbids); from a valid body with fields replaced by hostile values
(wrong types, huge, negative and zero numbers, NaN and Infinity, deep nesting, huge and
unpaired-surrogate strings, bogus roles, empty messages, token ids out of range, giant ``n``,
``logit_bias`` abuse), across all fields and field by field; and from raw bytes no JSON
encoder writes. The app runs in-process on the fake backend of ``openai_fakes``.

Every answer must be a 200 in the endpoint's shape or a 4xx in OpenAI's error shape, never a
5xx; every request handed to the backend must be closed again; and a plain request must
still succeed afterwards. Hypothesis runs derandomized with fixed example counts, so a run is
reproducible and bounded in time; each test prints how many cases it sent and asserts a
minimum, so it cannot silently send none.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from fastapi import FastAPI
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openai_fakes import CHAT, COMPLETIONS, HELLO, FakeBackend, assert_error, sse_events
from schemathesis import GenerationMode

from router.api.app import build_openai_app
from router.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest

VOCAB = 49152  # the SmolLM2 tokenizer's size: token ids are valid in [0, VOCAB)

FUZZ = settings(derandomize=True, database=None, deadline=None, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.filter_too_much])


class Fuzzer:
    """Sends cases to one app, checks every answer, and counts the cases per test."""

    def __init__(self, client: TestClient, backend: FakeBackend):
        self.client = client
        self.backend = backend
        self.cases = 0  # in the current test
        self.statuses: dict[int, int] = {}
        self.total = 0  # in the tests reported so far

    def post(self, path: str, body: Any, headers: dict[str, str] | None = None,
             ) -> httpx.Response:
        """POST ``body`` as JSON (NaN and Infinity as Python's encoder writes them)."""
        return self.send("POST", path, json.dumps(body).encode(), headers)

    def send(self, method: str, path: str, content: bytes | None = None,
             headers: dict[str, str] | None = None) -> httpx.Response:
        """Send one case and check its answer."""
        headers = {"content-type": "application/json", **(headers or {})}
        response = self.client.request(method, path, content=content, headers=headers)
        self.cases += 1
        self.statuses[response.status_code] = self.statuses.get(response.status_code, 0) + 1
        check_answer(response)
        return response

    def report(self, name: str, minimum: int) -> None:
        """Print the cases this test sent, check there were enough, and check the app still
        serves and the backend holds no open request."""
        print(f"fuzz {name}: {self.cases} cases, statuses {dict(sorted(self.statuses.items()))}")
        assert self.cases >= minimum
        self.total += self.cases
        check_still_serving(self)
        opened = [request.request_id for request in self.backend.requests]
        assert sorted(self.backend.closed) == sorted(opened)  # nothing left open


def check_answer(response: httpx.Response) -> None:
    """A 200 in the endpoint's shape, or a 4xx whose body is exactly OpenAI's error object."""
    status = response.status_code
    assert status < 500, response.text
    if status >= 400:
        body = response.json()
        assert list(body) == ["error"], body
        error = body["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        assert isinstance(error["message"], str) and error["message"]
        expected_type = "rate_limit_error" if status == 429 else "invalid_request_error"
        assert error["type"] == expected_type, error
        assert error["param"] is None or isinstance(error["param"], str)
        assert error["code"] is None or isinstance(error["code"], str)
        return
    assert status == 200, response.text
    if response.headers["content-type"].startswith("text/event-stream"):
        events = sse_events(response)
        assert all(event == "[DONE]" or "error" not in event for event in events), events
        return
    body = response.json()
    assert body["object"] in ("chat.completion", "text_completion", "list", "model"), body


def check_still_serving(fuzzer: Fuzzer) -> None:
    """A plain chat and a plain completion are answered in full."""
    chat = fuzzer.client.post(CHAT, json={"messages": HELLO, "max_tokens": 5})
    assert chat.status_code == 200, chat.text
    assert chat.json()["choices"][0]["message"]["content"] == "Hello world"
    text = fuzzer.client.post(COMPLETIONS, json={"prompt": "Hello", "max_tokens": 5})
    assert text.status_code == 200, text.text
    assert text.json()["choices"][0]["text"] == "Hello world"


@pytest.fixture(scope="module")
def fuzzer(tokenizer: Any) -> Iterator[Fuzzer]:
    """One app on the fake backend for the whole module."""
    backend = FakeBackend(tokenizer)
    with TestClient(build_openai_app(backend), raise_server_exceptions=False) as client:
        fuzzer = Fuzzer(client, backend)
        yield fuzzer
    print(f"fuzz: {fuzzer.total} cases in all")


@pytest.fixture
def fuzz(fuzzer: Fuzzer) -> Fuzzer:
    """The module's fuzzer, its counts reset for this test."""
    fuzzer.cases, fuzzer.statuses = 0, {}
    return fuzzer


# -- strategies --------------------------------------------------------------------------------

HUGE_INTS = st.sampled_from([2**31, 2**53 + 1, 2**63, 2**64, 10**30, -(10**30), -(2**63) - 1])
NUMBERS = st.one_of(st.integers(-3, 300), HUGE_INTS, st.floats(allow_nan=True),
                    st.sampled_from([0, -1, 0.5, -0.0, 1e308, 5e-324]))
SURROGATES = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)
TEXTS = st.one_of(
    st.text(max_size=30),
    st.text(st.characters(codec="utf-8") | SURROGATES, max_size=30),
    st.sampled_from(["", " ", "\x00", "\u202e", "user", "Bearer", "%s%n{0}", "\ud800",
                     "x" * 20_000, "é" * 5_000 + "\U0001f600" * 5_000]),
)
SCALARS = st.one_of(st.none(), st.booleans(), NUMBERS, TEXTS)
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(TEXTS, inner, max_size=4), max_leaves=12)

ROLES = st.sampled_from(["system", "developer", "user", "assistant", "tool", "function",
                         "wizard", "", "USER", "user\x00"]) | TEXTS
CONTENT_PART = st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]) | TEXTS},
                                     optional={"text": JSON, "image_url": JSON})
MESSAGE = st.fixed_dictionaries({"role": ROLES}, optional={
    **{name: JSON for name in ChatMessage.model_fields if name != "role"},
    "content": JSON | TEXTS | st.lists(CONTENT_PART, max_size=3),
    "unknown": JSON})
TOKEN_IDS = st.one_of(st.integers(0, VOCAB - 1), st.sampled_from([-1, VOCAB, VOCAB + 1]),
                      HUGE_INTS)
LOGIT_BIAS_KEYS = st.one_of(
    st.integers(-5, VOCAB + 5).map(str), TEXTS,
    st.sampled_from(["--5", "²", "١٢", " 12 ", "+3", "1e3", "0x10", "9" * 5_000, "-0"]))

# Values tried per field; fields not listed get arbitrary JSON.
FIELD_VALUES: dict[str, st.SearchStrategy[Any]] = {
    "messages": st.lists(MESSAGE, max_size=4) | JSON,
    "prompt": st.lists(TOKEN_IDS, max_size=40) | TEXTS | st.lists(TEXTS, max_size=3) | JSON,
    "logit_bias": st.dictionaries(LOGIT_BIAS_KEYS, NUMBERS | JSON, min_size=1, max_size=4)
    | JSON,
    "stop": st.lists(TEXTS, max_size=5) | TEXTS | JSON,
    "stop_token_ids": st.lists(TOKEN_IDS, max_size=5) | JSON,
    "stream_options": st.fixed_dictionaries({}, optional={
        "include_usage": JSON, "continuous_usage_stats": JSON, "x": JSON}) | JSON,
    "chat_template_kwargs": st.dictionaries(TEXTS | st.sampled_from(
        ["tokenize", "messages", "tools", "add_generation_prompt", "return_dict"]), JSON,
        max_size=3) | JSON,
    "stream": st.booleans() | JSON,
    "model": st.just("smollm2-135m-instruct") | TEXTS | JSON,
}
for _name in ("max_tokens", "max_completion_tokens", "n", "logprobs", "top_logprobs",
              "min_tokens", "truncate_prompt_tokens", "seed", "top_k", "priority",
              "temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
              "repetition_penalty"):
    FIELD_VALUES[_name] = NUMBERS | st.booleans() | JSON


REMOVED = object()


def mutated(base: dict[str, Any], fields: list[str]) -> st.SearchStrategy[dict[str, Any]]:
    """``base`` with one to three fields (known ones, or an unknown name) set to hostile
    values, or removed."""
    # A third of the changes hit the fields with hostile values of their own.
    names = st.sampled_from(sorted(FIELD_VALUES)) | st.sampled_from(fields) | TEXTS
    change = names.flatmap(lambda name: st.tuples(
        st.just(name), st.just(REMOVED) | FIELD_VALUES.get(name, JSON)))

    def apply(changes: list[tuple[str, Any]]) -> dict[str, Any]:
        body = dict(base)
        for name, value in changes:
            if value is REMOVED:
                body.pop(name, None)
            else:
                body[name] = value
        return body

    return st.lists(change, min_size=1, max_size=3).map(apply)


def schema_bodies(app: FastAPI, path: str, mode: GenerationMode) -> st.SearchStrategy[Any]:
    """Bodies of ``POST path`` that the app's OpenAPI schema allows (positive) or forbids
    (negative: wrong types, missing fields, bytes that are no JSON)."""
    operation = schemathesis.openapi.from_dict(app.openapi())[path]["POST"]
    return operation.as_strategy(generation_mode=mode).map(lambda case: case.body)


CHAT_FIELDS = sorted(ChatCompletionRequest.model_fields)
COMPLETION_FIELDS = sorted(CompletionRequest.model_fields)


# -- the fuzz tests ----------------------------------------------------------------------------


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_bodies_from_the_openapi_schema(fuzz, path, mode):
    @settings(FUZZ, max_examples=60)
    @given(body=schema_bodies(fuzz.client.app, path, mode))
    def run(body: Any) -> None:
        if isinstance(body, bytes):
            fuzz.send("POST", path, body)
        else:
            fuzz.post(path, body)

    run()
    fuzz.report(f"{mode} OpenAPI schema bodies of {path}", minimum=60)


@pytest.mark.parametrize("path, base, fields", [
    (CHAT, {"messages": HELLO, "max_tokens": 4}, CHAT_FIELDS),
    (COMPLETIONS, {"prompt": "Hello", "max_tokens": 4}, COMPLETION_FIELDS),
])
def test_valid_bodies_with_hostile_fields(fuzz, path, base, fields):
    @settings(FUZZ, max_examples=150)
    @given(body=mutated(base, fields), key=st.none() | TEXTS.filter(str.isprintable).filter(
        lambda key: key.isascii()))
    def run(body: dict[str, Any], key: str | None) -> None:
        fuzz.post(path, body, {"authorization": f"Bearer {key}"} if key else None)

    run()
    fuzz.report(f"hostile fields of {path}", minimum=150)


@pytest.mark.parametrize("field", sorted(FIELD_VALUES))
def test_each_field_with_hostile_values(fuzz, field):
    path, base = ((COMPLETIONS, {"prompt": "Hello", "max_tokens": 4}) if field == "prompt"
                  else (CHAT, {"messages": HELLO, "max_tokens": 4}))

    @settings(FUZZ, max_examples=50)
    @given(value=FIELD_VALUES[field])
    def run(value: Any) -> None:
        fuzz.post(path, {**base, field: value})

    run()
    fuzz.report(f"hostile {field}", minimum=50)


RAW_VALUES = ["NaN", "-Infinity", "1e999", "-1e999", "1" + "0" * 5_000, "-0", "0.0e0",
              '"\\ud800"', '"\\udfff\\ud800"', '"\\u0000"', "[" * 100_000 + "]" * 100_000,
              '{"a":' * 50_000 + "1" + "}" * 50_000, "tru", "01", "1.", ".5", "0x10"]
RAW_BODIES = st.sampled_from([
    b"", b"null", b"[]", b"1", b'"messages"', b"{", b"\xff\xfe", b"\x00" * 16,
    b'{"messages": ' + b"[" * 100_000, json.dumps({"messages": HELLO}).encode("utf-16"),
])


@pytest.mark.parametrize("path, template", [
    (CHAT, '{{"messages": [{{"role": "user", "content": "Hi"}}], "{field}": {value}}}'),
    (CHAT, '{{"messages": [{{"role": "user", "content": {value}}}]}}'),
    (COMPLETIONS, '{{"prompt": "Hi", "{field}": {value}}}'),
    (COMPLETIONS, '{{"prompt": [1, 2, {value}]}}'),
])
def test_raw_json_tokens(fuzz, path, template):
    fields = CHAT_FIELDS if path == CHAT else COMPLETION_FIELDS

    @settings(FUZZ, max_examples=40)
    @given(field=st.sampled_from(fields), value=st.sampled_from(RAW_VALUES),
           raw=st.none() | RAW_BODIES)
    def run(field: str, value: str, raw: bytes | None) -> None:
        content = raw if raw is not None else template.format(field=field, value=value).encode()
        fuzz.send("POST", path, content)

    run()
    fuzz.report(f"raw JSON tokens of {path}", minimum=40)


def test_other_routes_and_methods(fuzz):
    @settings(FUZZ, max_examples=60)
    @given(model=st.text(st.characters(codec="utf-8", exclude_categories=("Cc", "Cs"),
                                       exclude_characters="/?#%"), min_size=1,
                         max_size=40),
           method=st.sampled_from(["GET", "PUT", "DELETE", "PATCH"]),
           path=st.sampled_from([CHAT, COMPLETIONS, "/v1/models", "/v1/embeddings", "/"]))
    def run(model: str, method: str, path: str) -> None:
        fuzz.send("GET", f"/v1/models/{model}")
        fuzz.send(method, path, b"{}")

    run()
    fuzz.report("other routes and methods", minimum=120)


# -- regressions the fuzzer found -------------------------------------------------------------

REGRESSIONS = [
    # path, body, status, param, code. Each was a 500 before its fix.
    # logit_bias keys that passed str.isdigit() but not int(): a second sign, a superscript
    # digit, more digits than int() converts
    (CHAT, {"messages": HELLO, "logit_bias": {"--5": 1}}, 400, "logit_bias", "invalid_value"),
    (CHAT, {"messages": HELLO, "logit_bias": {"\u00b2": 1}}, 400, "logit_bias",
     "invalid_value"),
    (CHAT, {"messages": HELLO, "logit_bias": {"9" * 5_000: 1}}, 400, "logit_bias",
     "invalid_value"),
    # an unpaired surrogate echoed in an error message could not be encoded as UTF-8
    (CHAT, {"messages": HELLO, "logit_bias": {"\ud800": 1}}, 400, "logit_bias",
     "invalid_value"),
    (CHAT, {"messages": [{"role": "\ud800", "content": "x"}]}, 400, "messages[0].role",
     "invalid_value"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "\udfff"}]}]}, 400,
     "messages[0].content", "unsupported_content_type"),
    (CHAT, {"messages": HELLO, "model": "gpt-\ud800"}, 400, "model", "invalid_value"),
    (COMPLETIONS, {"prompt": "x", "model": "\udc00"}, 400, "model", "invalid_value"),
    # texts accepted with a surrogate (a stop string that could never match) or refused in
    # pydantic's internal words ("unable to parse raw data as a unicode string")
    (COMPLETIONS, {"prompt": "x", "stop": ["ok", "a\ud800"]}, 400, "stop", "invalid_value"),
    (CHAT, {"messages": HELLO, "stop": "\udfff"}, 400, "stop", "invalid_value"),
    (COMPLETIONS, {"prompt": "x", "request_id": "r\ud800"}, 400, "request_id",
     "invalid_value"),
    (CHAT, {"messages": HELLO, "cache_salt": "\udc00"}, 400, "cache_salt", "invalid_value"),
    # an unknown field whose name holds one was answered as a body that is not an object
    (COMPLETIONS, {"prompt": "x", "x\ud800": 1}, 400, None, "invalid_value"),
]


@pytest.mark.parametrize("path, body, status, param, code", REGRESSIONS)
def test_fuzzer_findings_are_refused_by_name(fuzz, path, body, status, param, code):
    error = assert_error(fuzz.post(path, body), status, param, code)
    assert len(error["message"]) < 200  # a huge or unencodable value is not echoed whole
    fuzz.report("regression", minimum=1)
