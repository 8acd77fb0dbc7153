"""Incremental detokenization with stop strings.

Text is produced token by token with the tokenizers library's ``DecodeStream`` (which waits for
multi-byte characters to complete). Text that could still be the start of a stop string is held
back, so a stream never shows a stop string, or part of one, that the final answer would not.
Where the matched stop string is returned (vLLM's ``include_stop_str_in_output``), nothing
needs holding back: the text streams as it comes, and ends with the stop string.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tokenizers.decoders import DecodeStream

PROMPT_CONTEXT_TOKENS = 8
"""Prompt tokens the stream starts after: enough for any decoder's view of "what came
before" (a leading space, a word piece's joint, a character's bytes)."""


class IncrementalDetokenizer:
    """Turns one request's output tokens into text deltas.

    Args:
        tokenizer: a transformers fast tokenizer (its ``_tokenizer`` backend is used).
        stop: stop strings; once one is complete in the text, the one of those complete that
            starts earliest ends it (the longest of those starting there), exclusive.
        min_tokens: stop strings are looked for only once more than this many tokens were
            added, and only ending in text added since (vLLM's ``min_tokens`` semantics).
        include_stop: end the text after the matched stop string instead of before it.
        skip_special_tokens: leave special tokens out of the text.
        prompt_ids: the prompt's token ids. The stream starts after its last
            :data:`PROMPT_CONTEXT_TOKENS`, as vLLM's starts after the prompt: a decoder that
            strips a text's leading space (SentencePiece's Metaspace: Llama 2, Mistral) would
            otherwise take it from the first output token (" Paris" after "The capital of
            France is" coming out as "Paris"). Not where they end mid-character: the stream
            would then give their pending bytes as the output's first text.
    """

    def __init__(self, tokenizer: Any, stop: list[str], min_tokens: int = 0,
                 include_stop: bool = False, skip_special_tokens: bool = True,
                 prompt_ids: Sequence[int] = ()):
        self._backend = tokenizer._tokenizer
        context = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:])
        if context and self._backend.decode(context, skip_special_tokens).endswith("\ufffd"):
            context = []
        self._stream = DecodeStream(ids=context or None, skip_special_tokens=skip_special_tokens)
        self._stop = stop
        self._min_tokens = min_tokens
        self._include_stop = include_stop
        self._num_tokens = 0
        self._stop_floor = 0  # a stop string must end after this text offset
        self._text = ""
        self._emitted = 0
        self.matched: str | None = None
        """The stop string that ended the text, once one has (vLLM's ``stop_reason``)."""

    @property
    def stopped(self) -> bool:
        """Whether a stop string has ended the text."""
        return self.matched is not None

    def add(self, token_id: int) -> str:
        """Feed one token; returns the text that became final (possibly empty).

        After a stop string is found, :attr:`stopped` is True and later calls return "".
        """
        if self.stopped:
            return ""
        piece = self._stream.step(self._backend, token_id)
        self._num_tokens += 1
        if self._num_tokens <= self._min_tokens:
            self._text += piece or ""
            self._stop_floor = len(self._text)
            return self._take(len(self._text))
        if piece:
            self._text += piece
        match = self._find_stop()
        if match is not None:
            start, end = match
            self.matched = self._text[start:end]
            self._text = self._text[:end if self._include_stop else start]
            return self._take(len(self._text))
        return self._take(len(self._text) - self._held_back())

    def flush(self) -> str:
        """The held-back text, once generation has ended without a stop string."""
        return "" if self.stopped else self._take(len(self._text))

    def _take(self, end: int) -> str:
        delta = self._text[self._emitted:end]
        self._emitted = max(self._emitted, end)
        return delta

    def _find_stop(self) -> tuple[int, int] | None:
        """The (start, end) text offsets of the stop string found, or None."""
        # A stop string can only end inside the unemitted tail, plus its own length before it.
        window_start = max(0, self._emitted - max((len(s) for s in self._stop), default=0))
        found = []
        for stop in self._stop:
            # Earliest start whose match ends after the floor (past min_tokens).
            start = max(window_start, self._stop_floor - len(stop) + 1)
            if (i := self._text.find(stop, start)) >= 0:
                found.append((i, -len(stop)))
        if not found:
            return None
        start, minus_length = min(found)
        return start, start - minus_length

    def _held_back(self) -> int:
        """Length of the longest text suffix that is a proper prefix of some stop string
        (none where stop strings are returned: the text may show them)."""
        if self._include_stop:
            return 0
        longest = 0
        for stop in self._stop:
            for size in range(min(len(stop) - 1, len(self._text)), longest, -1):
                if self._text.endswith(stop[:size]):
                    longest = size
                    break
        return longest
