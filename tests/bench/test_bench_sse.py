"""bench.sse: the event-stream framing, including its less common corners."""

from __future__ import annotations

from bench.sse import ServerSentEvent, SSEDecoder, aiter_events


async def _lines(*lines):
    for line in lines:
        yield line


async def _events(*lines):
    return [event async for event in aiter_events(_lines(*lines))]


async def test_events_end_at_blank_lines_and_join_data_lines():
    events = await _events("data: {\"a\":", "data: 1}", "", ": keep-alive comment", "",
                           "data:[DONE]", "")
    assert events == [ServerSentEvent('{"a":\n1}'), ServerSentEvent("[DONE]")]


async def test_named_events_and_a_stream_without_final_blank_line():
    events = await _events("event: error", "data: {\"error\": 1}", "", "data: last")
    assert events == [ServerSentEvent('{"error": 1}', "error"), ServerSentEvent("last")]


def test_fields_without_data_make_no_event():
    decoder = SSEDecoder()
    assert decoder.feed("id: 7") is None
    assert decoder.feed("retry: 10") is None
    assert decoder.feed("") is None
    assert decoder.feed("data:  two spaces") is None
    assert decoder.feed("") == ServerSentEvent(" two spaces")  # only one space is stripped
