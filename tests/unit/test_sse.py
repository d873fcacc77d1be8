"""The SSE parser splits arbitrary byte pieces into whole events."""

from __future__ import annotations

import pytest

from turnstile.proxy.sse import MAX_EVENT_BYTES, SSEError, SSEParser, encode_data

STREAM = (
    b'data: {"a": 1}\n\n'
    b": keep-alive comment\n\n"
    b'event: message\ndata: {"b":\ndata: 2}\n\n'
    b"data: [DONE]\n\n"
)


def _all(parser: SSEParser, pieces: list[bytes]) -> list[bytes | None]:
    out: list[bytes | None] = []
    for piece in pieces:
        out.extend(e.data for e in parser.feed(piece))
    return out


def test_whole_stream_in_one_piece() -> None:
    assert _all(SSEParser(), [STREAM]) == [b'{"a": 1}', None, b'{"b":\n2}', b"[DONE]"]


@pytest.mark.parametrize("size", [1, 2, 3, 7, 64])
def test_any_split_gives_the_same_events(size: int) -> None:
    pieces = [STREAM[i : i + size] for i in range(0, len(STREAM), size)]
    assert _all(SSEParser(), pieces) == [b'{"a": 1}', None, b'{"b":\n2}', b"[DONE]"]


def test_crlf_line_ends_and_raw_bytes() -> None:
    parser = SSEParser()
    events = parser.feed(b"data: x\r\n\r\ndata: y\r\n")
    assert [e.data for e in events] == [b"x"]
    assert events[0].raw == b"data: x\n\n"
    assert parser.pending() == b"data: y\n"
    assert [e.data for e in parser.feed(b"\r\n")] == [b"y"]


def test_oversized_event_is_refused() -> None:
    parser = SSEParser()
    with pytest.raises(SSEError):
        parser.feed(b"data: " + b"x" * (MAX_EVENT_BYTES + 1))


def test_encode_data_round_trip() -> None:
    assert [e.data for e in SSEParser().feed(encode_data(b'{"z":0}'))] == [b'{"z":0}']
