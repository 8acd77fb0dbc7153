"""Server-sent events: the ``text/event-stream`` framing OpenAI-compatible servers stream in.

Only what the WHATWG format defines is parsed: ``field: value`` lines, events ended by a blank
line, ``data`` lines joined with newlines, ``:`` comments ignored.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass


@dataclass(frozen=True)
class ServerSentEvent:
    """One event: its ``event`` name (``message`` when unnamed) and its data."""

    data: str
    event: str = "message"


class SSEDecoder:
    """Turns lines (without their line endings) into events."""

    def __init__(self) -> None:
        self._data: list[str] = []
        self._event = "message"

    def feed(self, line: str) -> ServerSentEvent | None:
        """Takes one line; returns the event it completes, if any."""
        if not line:
            return self.flush()
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._event = value
        return None

    def flush(self) -> ServerSentEvent | None:
        """The event being built, if it has data (a stream may end without a blank line)."""
        event = ServerSentEvent("\n".join(self._data), self._event) if self._data else None
        self._data, self._event = [], "message"
        return event


async def aiter_events(lines: AsyncIterable[str]) -> AsyncIterator[ServerSentEvent]:
    """The events of a stream of lines (e.g. ``httpx.Response.aiter_lines()``)."""
    decoder = SSEDecoder()
    async for line in lines:
        event = decoder.feed(line)
        if event is not None:
            yield event
    event = decoder.flush()
    if event is not None:
        yield event
