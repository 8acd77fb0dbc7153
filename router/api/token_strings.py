"""Token ids to the texts and UTF-8 bytes that logprobs report."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from transformers.convert_slow_tokenizer import bytes_to_unicode

TokenStringsFn = Callable[[int], tuple[str, list[int]]]
"""Token id → (text, UTF-8 bytes)."""

# Byte-level BPE vocabularies (GPT-2, Llama 3, Qwen, SmolLM2) spell each byte as one printable
# character (GPT-2's table); inverted, it turns a token's spelling back into its bytes.
_BYTE_DECODER = {char: byte for byte, char in bytes_to_unicode().items()}


class TokenStrings:
    """Token id → (text, UTF-8 bytes) for logprobs, cached per id.

    Byte-level BPE tokens give their exact bytes (a token holding part of a multi-byte
    character has text ``�`` but its true bytes, as OpenAI reports them); other vocabularies
    fall back to decoding the single token.
    """

    def __init__(self, tokenizer: Any, lock: threading.Lock):
        self._tokenizer = tokenizer
        self._lock = lock
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        cached = self._cache.get(token_id)
        if cached is None:
            cached = self._cache[token_id] = self._lookup(token_id)
        return cached

    def _lookup(self, token_id: int) -> tuple[str, list[int]]:
        with self._lock:
            piece = self._tokenizer.convert_ids_to_tokens(token_id)
            special = token_id in set(getattr(self._tokenizer, "all_special_ids", ()))
            if special or not piece or any(c not in _BYTE_DECODER for c in piece):
                text = piece if special and piece else self._tokenizer.decode([token_id])
                return text, list(text.encode("utf-8"))
        raw = bytes(_BYTE_DECODER[c] for c in piece)
        return raw.decode("utf-8", errors="replace"), list(raw)


def as_token_ids(token_strings: TokenStringsFn) -> TokenStringsFn:
    """``token_strings`` with each token's text replaced by ``token_id:<id>`` (vLLM's
    ``return_tokens_as_token_ids``: a token whose bytes are not valid UTF-8 on their own can
    still be told apart); the bytes stay the token's own."""
    return lambda token_id: (f"token_id:{token_id}", token_strings(token_id)[1])
