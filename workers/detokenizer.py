"""Incremental detokenization with stop strings.

Text is produced token by token with the tokenizers library's ``DecodeStream`` (which waits for
multi-byte characters to complete). Text that could still be the start of a stop string is held
back, so a stream never shows a stop string, or part of one, that the final answer would not.
"""

from __future__ import annotations

from typing import Any

from tokenizers.decoders import DecodeStream


class IncrementalDetokenizer:
    """Turns one request's output tokens into text deltas.

    Args:
        tokenizer: a transformers fast tokenizer (its ``_tokenizer`` backend is used).
        stop: stop strings; the first one found ends the text, exclusive.
        min_tokens: stop strings are looked for only once more than this many tokens were
            added, and only ending in text added since (vLLM's ``min_tokens`` semantics).
    """

    def __init__(self, tokenizer: Any, stop: list[str], min_tokens: int = 0):
        self._backend = tokenizer._tokenizer
        self._stream = DecodeStream(skip_special_tokens=True)
        self._stop = stop
        self._min_tokens = min_tokens
        self._num_tokens = 0
        self._stop_floor = 0  # a stop string must end after this text offset
        self._text = ""
        self._emitted = 0
        self.stopped = False

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
        cut = self._find_stop()
        if cut is not None:
            self._text = self._text[:cut]
            self.stopped = True
            return self._take(len(self._text))
        return self._take(len(self._text) - self._held_back())

    def flush(self) -> str:
        """The held-back text, once generation has ended without a stop string."""
        return "" if self.stopped else self._take(len(self._text))

    def _take(self, end: int) -> str:
        delta = self._text[self._emitted:end]
        self._emitted = max(self._emitted, end)
        return delta

    def _find_stop(self) -> int | None:
        # A stop string can only end inside the unemitted tail, plus its own length before it.
        window_start = max(0, self._emitted - max((len(s) for s in self._stop), default=0))
        found = []
        for stop in self._stop:
            # Earliest start whose match ends after the floor (past min_tokens).
            start = max(window_start, self._stop_floor - len(stop) + 1)
            if (i := self._text.find(stop, start)) >= 0:
                found.append(i)
        return min(found) if found else None

    def _held_back(self) -> int:
        """Length of the longest text suffix that is a proper prefix of some stop string."""
        longest = 0
        for stop in self._stop:
            for size in range(min(len(stop) - 1, len(self._text)), longest, -1):
                if self._text.endswith(stop[:size]):
                    longest = size
                    break
        return longest
