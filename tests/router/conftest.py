"""Fixtures of the HTTP-layer tests: the real SmolLM2 tokenizer, a scripted fake backend, and
an httpx client talking to the app over ASGI (no server, no Ray)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from openai_fakes import FakeBackend, load_tokenizer

from router.api.app import build_openai_app


@pytest.fixture(scope="session")
def tokenizer() -> Any:
    """The embedded SmolLM2 tokenizer (loaded once per session)."""
    return load_tokenizer()


@pytest.fixture
def backend(tokenizer: Any) -> FakeBackend:
    """A fake backend answering every request with ``hello_world``."""
    return FakeBackend(tokenizer)


@pytest.fixture
async def client(backend: FakeBackend) -> AsyncIterator[httpx.AsyncClient]:
    """An httpx client of the app serving ``backend``."""
    transport = httpx.ASGITransport(app=build_openai_app(backend))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        yield http
