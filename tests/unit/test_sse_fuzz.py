"""Property tests for the SSE parser: chunking never changes the events, garbage never
raises anything but SSEError."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from turnstile.proxy import sse
from turnstile.proxy.sse import SSEError, SSEEvent, SSEParser

# A field value: any text without line breaks (the parser works on bytes).
values = st.text(st.characters(codec="utf-8", exclude_characters="\r\n"), max_size=30).map(
    lambda t: t.encode()
)
fields = st.sampled_from([b"data", b"event", b"id", b"retry", b""])  # b"": a comment line


@st.composite
def streams(draw: Any) -> tuple[bytes, list[bytes | None]]:
    """A well-formed stream in one line-ending style, and each event's expected data."""
    eol = draw(st.sampled_from([b"\n", b"\r\n", b"\r"]))
    out: list[bytes] = []
    expected: list[bytes | None] = []
    for _ in range(draw(st.integers(0, 6))):
        data: list[bytes] = []
        for field, value, spaced in draw(
            st.lists(st.tuples(fields, values, st.booleans()), min_size=1, max_size=4)
        ):
            line = field + b":" + (b" " if spaced else b"") + value
            out.append(line + eol)
            if field == b"data":  # one leading space after the colon is not data
                data.append(value[1:] if not spaced and value.startswith(b" ") else value)
        out.append(eol * draw(st.integers(1, 3)))  # the blank line(s) ending the event
        expected.append(b"\n".join(data) if data else None)
    out.append(draw(values))  # a torn tail without its terminator
    return b"".join(out), expected


def feed_all(chunks: list[bytes]) -> tuple[list[SSEEvent], bytes]:
    parser = SSEParser()
    events = [event for chunk in chunks for event in parser.feed(chunk)]
    events += parser.finish()
    return events, parser.pending()


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    bounds = [0, *points, len(data)]
    return [data[a:b] for a, b in itertools.pairwise(bounds)]


@settings(max_examples=1000)
@given(streams(), st.lists(st.integers(0, 10_000), max_size=20))
def test_any_split_yields_the_same_events(
    stream: tuple[bytes, list[bytes | None]], cuts: list[int]
) -> None:
    data, expected = stream
    whole, _ = feed_all([data])
    assert [e.data for e in whole] == expected
    assert feed_all(split(data, cuts))[0] == whole


@settings(max_examples=300)
@given(streams())
def test_byte_by_byte_streams(stream: tuple[bytes, list[bytes | None]]) -> None:
    data, expected = stream
    events, _ = feed_all([data[i : i + 1] for i in range(len(data))])
    assert [e.data for e in events] == expected


def test_crlf_split_between_cr_and_lf() -> None:
    stream = b"data: a\r\ndata: b\r\n\r\n"
    cut = stream.index(b"\n")
    assert feed_all([stream[:cut], stream[cut:]])[0] == feed_all([stream])[0]


@settings(max_examples=1000)
@given(st.lists(st.binary(max_size=200), max_size=10))
def test_garbage_raises_nothing_but_sse_error(chunks: list[bytes]) -> None:
    parser = SSEParser()
    try:
        for chunk in chunks:
            for event in parser.feed(chunk):
                assert event.raw.endswith(b"\n\n")
    except SSEError:
        pass


@settings(max_examples=500)
@given(st.binary(max_size=400).map(lambda b: b.replace(b"\r", b"")), st.lists(st.integers()))
def test_garbage_without_cr_splits_freely(data: bytes, cuts: list[int]) -> None:
    assert feed_all(split(data, cuts)) == feed_all([data])


@settings(max_examples=300)
@given(st.lists(st.binary(max_size=100), max_size=10))
def test_oversized_events_raise_sse_error(chunks: list[bytes]) -> None:
    with pytest.MonkeyPatch.context() as m:
        m.setattr(sse, "MAX_EVENT_BYTES", 64)
        parser = SSEParser()
        try:
            for chunk in chunks:
                parser.feed(chunk)
        except SSEError:
            return
        assert len(parser.pending()) <= 64
