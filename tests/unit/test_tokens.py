"""The recorded fields of whole answers: the compiled scanner against the msgspec path.

`turnstile.proxy.tokens.scan` (C) and `decode` (msgspec) must give the same arrays bit for
bit on every body the scanner accepts, and `read_answer` (scan, else decode) must behave
exactly as `decode` alone on every body, refusals included: random vLLM-shaped chat and
completions answers with escapes, exponents, -0.0, subnormals, NaN/Infinity spellings,
duplicated keys, out-of-range ids and broken bytes.
"""

from __future__ import annotations

import json
import math
import shutil
import struct
import subprocess
import sys
from typing import Any
from unittest import mock

import numpy as np
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from turnstile.backends.fake import chat_choice, chat_completion, chat_message, logprob_entry
from turnstile.bench.backend import Corpus, Shape
from turnstile.errors import BackendValueError
from turnstile.limits import MAX_TOKEN_ID
from turnstile.proxy import tokens
from turnstile.proxy.capture import CHAT, COMPLETIONS, CapturePlan, ResponseCapture
from turnstile.proxy.tokens import AnswerTokens

needs_compiled = pytest.mark.skipif(not tokens.COMPILED, reason="the extension is not built")


def _outcome(fn: Any, body: bytes, completions: bool, as_ids: bool) -> Any:
    try:
        return ("ok", fn(body, completions, as_ids))
    except BackendValueError as exc:
        return ("refused", exc.message)


def _bits(values: list[list[float]] | None) -> Any:
    if values is None:
        return None
    return [[struct.pack("<d", v) for v in row] for row in values]


def _array(a: Any) -> Any:
    return None if a is None else (a.dtype.str, a.tobytes())


def _canonical(answer: AnswerTokens | None) -> Any:
    """Everything an answer holds, with arrays and floats as their bytes."""
    if answer is None:
        return None
    return (
        _array(answer.prompt_token_ids),
        repr(answer.model),
        repr(answer.usage),
        [
            (
                c.index,
                _array(c.token_ids),
                _array(c.prompt_token_ids),
                _array(c.logprobs),
                c.top_ids,
                _bits(c.top_values),
                repr(c.message),
                repr(c.text),
                repr(c.finish_reason),
                repr(c.stop_reason),
            )
            for c in answer.choices
        ],
    )


def _same(a: Any, b: Any) -> bool:
    if a[0] != b[0]:
        return False
    return bool(a[1] == b[1] if a[0] == "refused" else _canonical(a[1]) == _canonical(b[1]))


# -- generated bodies --------------------------------------------------------------------
WS = st.sampled_from(["", "", " ", "\n", "\t", "\r\n  "])
NUMBER_TEXT = st.from_regex(
    r"-?(0|[1-9][0-9]{0,24})(\.[0-9]{1,24})?([eE][+-]?[0-9]{1,2})?", fullmatch=True
)
FLOAT_TEXT = st.floats(allow_nan=False, allow_infinity=False).map(repr) | st.sampled_from(
    [
        "-0.0",
        "-0",
        "0",
        "0e0",
        "-0E-0",
        "5e-324",
        "-4.9406564584124654e-324",
        "2.2250738585072011e-308",
        "1.7976931348623157e308",
        "-9999.0",
        "1E+2",
        "1e-400",
        "100000000000000000000000",
    ]
)
BAD_NUMBER_TEXT = st.sampled_from(
    [
        "NaN",
        "-NaN",
        "Infinity",
        "-Infinity",
        "inf",
        "nan",
        "1e400",
        "-1e999",
        "01",
        "1.",
        ".5",
        "+1",
        "1e",
        "0x10",
        "1_0",
        "- 1",
    ]
)
SAFE_TEXT = st.text(st.characters(exclude_categories=["Cs"]), max_size=12)


def _string(value: str, ascii_only: bool) -> str:
    return json.dumps(value, ensure_ascii=ascii_only)


@st.composite
def json_string(draw: st.DrawFn, hostile: bool) -> str:
    text = _string(draw(SAFE_TEXT), draw(st.booleans()))
    if hostile and draw(st.integers(0, 9)) == 0:
        text = draw(st.sampled_from(['"\\ud800"', '"\\x41"', '"a\tb"', '"\\u12"', '"open']))
    return text


@st.composite
def junk(draw: st.DrawFn, hostile: bool, depth: int = 0) -> str:
    """Any JSON value (of a field Turnstile does not record)."""
    kind = draw(st.integers(0, 6 if depth < 3 else 3))
    if kind == 0:
        return draw(st.sampled_from(["null", "true", "false"]))
    if kind == 1:
        return draw(NUMBER_TEXT | FLOAT_TEXT)
    if kind in (2, 3):
        return draw(json_string(hostile))
    if kind == 4:
        items = draw(st.lists(junk(hostile, depth + 1), max_size=3))
        return "[" + ",".join(items) + "]"
    pairs = draw(st.lists(st.tuples(json_string(False), junk(hostile, depth + 1)), max_size=3))
    return "{" + ",".join(f"{k}:{v}" for k, v in pairs) + "}"


@st.composite
def obj(draw: st.DrawFn, members: list[tuple[str, str]], hostile: bool) -> str:
    """An object of `members`, shuffled, with unrecorded extra members and whitespace."""
    members = list(members)
    for _ in range(draw(st.integers(0, 2))):
        members.append((_string(draw(SAFE_TEXT), True), draw(junk(hostile))))
    if hostile and members and draw(st.integers(0, 7)) == 0:
        members.append(draw(st.sampled_from(members)))  # a key twice
    order = draw(st.permutations(members))
    sep = draw(WS)
    return "{" + sep + ("," + sep).join(f"{k}{draw(WS)}:{draw(WS)}{v}" for k, v in order) + "}"


@st.composite
def token_id_text(draw: st.DrawFn, hostile: bool) -> str:
    if hostile and draw(st.integers(0, 9)) == 0:
        return draw(
            st.sampled_from(
                [
                    str(MAX_TOKEN_ID + 1),
                    "-1",
                    "-0",
                    "1.0",
                    "1e3",
                    "01",
                    '"5"',
                    "null",
                    "true",
                    "99999999999",
                ]
            )
        )
    return str(draw(st.integers(0, MAX_TOKEN_ID) | st.integers(0, 200)))


@st.composite
def ids_text(draw: st.DrawFn, hostile: bool) -> str:
    if draw(st.integers(0, 5)) == 0:
        return "null"
    items = draw(st.lists(token_id_text(hostile), max_size=8))
    return "[" + f",{draw(WS)}".join(items) + "]"


@st.composite
def logprob_text(draw: st.DrawFn, hostile: bool) -> str:
    kind = draw(st.integers(0, 12))
    if kind < 8:
        return draw(FLOAT_TEXT)
    if kind < 10:
        return draw(NUMBER_TEXT)
    if hostile and kind == 12:
        return draw(BAD_NUMBER_TEXT)
    return draw(junk(hostile))


@st.composite
def top_token(draw: st.DrawFn, hostile: bool) -> str:
    kind = draw(st.integers(0, 5))
    if kind <= 2:
        return _string(f"token_id:{draw(st.integers(0, MAX_TOKEN_ID))}", True)
    if kind == 3:
        return draw(json_string(hostile))
    choices = [
        '"token_id:"',
        '"token_id:12a"',
        '"token_id:\\u0031"',
        '"token_id:007"',
        '"token_id:\u0661"',
        '"token_id:99999999999"',
        f'"token_id:{MAX_TOKEN_ID + 1}"',
        "5",
    ]
    return draw(st.sampled_from(choices if hostile else choices[:2] + choices[3:5]))


@st.composite
def chat_entry(draw: st.DrawFn, hostile: bool) -> str:
    tops = [
        draw(
            obj(
                [('"token"', draw(top_token(hostile))), ('"logprob"', draw(logprob_text(hostile)))],
                hostile,
            )
        )
        for _ in range(draw(st.integers(0, 3)))
    ]
    members = [('"token"', draw(json_string(hostile))), ('"bytes"', "null")]
    if draw(st.integers(0, 9)):
        members.append(('"logprob"', draw(logprob_text(hostile))))
    members.append(
        ('"top_logprobs"', "[" + ",".join(tops) + "]" if draw(st.integers(0, 5)) else "null")
    )
    return draw(obj(members, hostile))


@st.composite
def completion_top(draw: st.DrawFn, hostile: bool) -> str:
    if draw(st.integers(0, 6)) == 0:
        return "null"
    pairs = [
        (draw(top_token(hostile)), draw(logprob_text(hostile)))
        for _ in range(draw(st.integers(0, 3)))
    ]
    pairs = [(k, v) for k, v in pairs if k.startswith('"')]
    return draw(obj(pairs, hostile))


@st.composite
def choice_text(
    draw: st.DrawFn, completions: bool, hostile: bool, index: int, message_key: str = "message"
) -> str:
    n = draw(st.integers(0, 5))
    if completions:
        logprobs = draw(
            obj(
                [
                    (
                        '"tokens"',
                        "[" + ",".join(draw(json_string(hostile)) for _ in range(n)) + "]",
                    ),
                    (
                        '"token_logprobs"',
                        "[" + ",".join(draw(logprob_text(hostile)) for _ in range(n)) + "]",
                    ),
                    (
                        '"top_logprobs"',
                        "[" + ",".join(draw(completion_top(hostile)) for _ in range(n)) + "]",
                    ),
                ],
                hostile,
            )
        )
    else:
        content = "[" + ",".join(draw(chat_entry(hostile)) for _ in range(n)) + "]"
        logprobs = draw(obj([('"content"', content)], hostile))
    if draw(st.integers(0, 6)) == 0:
        logprobs = "null"
    message = draw(
        obj([('"role"', '"assistant"'), ('"content"', draw(json_string(hostile)))], hostile)
    )
    members = [
        (
            '"index"',
            str(index) if not hostile or draw(st.integers(0, 9)) else draw(token_id_text(True)),
        ),
        ('"logprobs"', logprobs),
        ('"finish_reason"', draw(st.sampled_from(['"stop"', '"length"', "null", "3", "{}"]))),
        ('"stop_reason"', draw(st.sampled_from(["null", "151645", '"</s>"']))),
        ('"token_ids"', draw(ids_text(hostile))),
    ]
    if completions:
        members += [
            ('"text"', draw(json_string(hostile))),
            ('"prompt_token_ids"', draw(ids_text(hostile))),
        ]
    else:
        members.append((f'"{message_key}"', message))
    return draw(obj(members, hostile))


@st.composite
def answer_body(
    draw: st.DrawFn, completions: bool, hostile: bool, message_key: str = "message"
) -> bytes:
    fields_hostile, hostile = hostile and draw(st.booleans()), hostile
    n = draw(st.integers(0, 3))
    indices = draw(st.permutations(list(range(n))))
    if hostile and n and draw(st.integers(0, 9)) == 0:
        indices = [0] * n  # one index twice
    choices = [draw(choice_text(completions, fields_hostile, i, message_key)) for i in indices]
    members = [
        ('"id"', '"cmpl-1"'),
        ('"model"', draw(json_string(fields_hostile))),
        ('"choices"', "[" + ",".join(choices) + "]" if draw(st.integers(0, 9)) else "null"),
        ('"usage"', '{"prompt_tokens":3,"completion_tokens":2}'),
    ]
    if draw(st.integers(0, 9)) == 0:
        members.append(('"error"', draw(junk(False))))
    if not completions:
        members.append(('"prompt_token_ids"', draw(ids_text(fields_hostile))))
    text = draw(WS) + draw(obj(members, fields_hostile)) + draw(WS)
    data = text.encode("utf-8")
    if hostile:
        cut = draw(st.integers(0, 11))
        if cut == 0 and data:
            data = data[: draw(st.integers(0, len(data) - 1))]
        elif cut == 1:
            pos = draw(st.integers(0, len(data)))
            data = data[:pos] + bytes([draw(st.integers(0, 255))]) + data[pos:]
        elif cut == 2:
            data += draw(st.sampled_from([b"x", b"{}", b" 1", b"\x00"]))
        elif cut == 3:
            data = b"[" + data + b"]"
    return data


MODES = st.tuples(st.booleans(), st.booleans())


@needs_compiled
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), mode=MODES)
def test_scan_agrees_with_decode_on_well_formed_answers(
    data: st.DataObject, mode: tuple[bool, bool]
) -> None:
    completions, as_ids = mode
    body = data.draw(answer_body(completions, hostile=False))
    scanned = _outcome(tokens.scan, body, completions, as_ids)
    decoded = _outcome(tokens.decode, body, completions, as_ids)
    if decoded[0] == "ok" and decoded[1] is not None and not (completions and as_ids):
        # every well-formed answer is the scanner's (completions' top-k maps may repeat a
        # token or escape one, which it leaves to msgspec)
        assert scanned[0] == "ok" and scanned[1] is not None, body
    if scanned[0] == "ok" and scanned[1] is not None:
        assert _same(scanned, decoded), body
    assert _same(_outcome(tokens.read_answer, body, completions, as_ids), decoded), body


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), mode=MODES)
def test_read_answer_behaves_as_decode_on_hostile_bodies(
    data: st.DataObject, mode: tuple[bool, bool]
) -> None:
    completions, as_ids = mode
    body = data.draw(answer_body(completions, hostile=True))
    decoded = _outcome(tokens.decode, body, completions, as_ids)
    scanned = _outcome(tokens.scan, body, completions, as_ids)
    assert scanned[0] == "ok"  # the scanner never refuses by itself: it declines
    if scanned[1] is not None:
        assert _same(scanned, decoded), body
    assert _same(_outcome(tokens.read_answer, body, completions, as_ids), decoded), body


# -- examples ---------------------------------------------------------------------------------
def _bench_body(top: int = 0) -> tuple[Corpus, bytes]:
    corpus = Corpus(300, 50)
    raw = corpus.answer(Shape(False, True, True, top, top > 0))
    assert isinstance(raw, bytes)
    return corpus, raw[raw.index(b"\r\n\r\n") + 4 :]


@pytest.mark.parametrize("reader", [tokens.read_answer, tokens.decode])
def test_the_bench_answer_is_read_into_arrays(reader: Any) -> None:
    corpus, body = _bench_body(top=3)
    answer = reader(body, False, True)
    assert answer is not None
    assert answer.prompt_token_ids.dtype == np.int32
    assert answer.prompt_token_ids.tolist() == corpus.prompt_ids
    (choice,) = answer.choices
    assert choice.token_ids.tolist() == corpus.ids
    assert choice.logprobs.dtype == np.float32
    assert np.array_equal(choice.logprobs, np.asarray(corpus.logprobs, dtype=np.float32))
    assert choice.top_ids[0] == [corpus.ids[0] + j for j in range(3)]
    assert choice.top_values[1] == [corpus.logprobs[1] - j for j in range(3)]
    assert choice.finish_reason == "length" and choice.message["role"] == "assistant"
    assert answer.model == "bench-model" and answer.usage["prompt_tokens"] == 300


def test_a_c_compiler_means_the_compiled_scanner_is_in_use() -> None:
    """`pip install` builds the extension wherever there is a compiler (CI included)."""
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler: the msgspec path is the one in use")
    assert tokens.COMPILED
    _, body = _bench_body()
    assert tokens.scan(body, False, False) is not None


def test_without_the_extension_the_msgspec_path_reads_answers() -> None:
    """In a process where the extension cannot be imported, answers read the same."""
    code = (
        "import sys; sys.modules['turnstile.proxy._tokenscan'] = None\n"
        "from turnstile.proxy import tokens\n"
        "from turnstile.bench.backend import Corpus, Shape\n"
        "assert not tokens.COMPILED and tokens.scan(b'{}', False, False) is None\n"
        "raw = Corpus(300, 50).answer(Shape(False, True, True, 0, False))\n"
        "a = tokens.read_answer(raw[raw.index(b'\\r\\n\\r\\n') + 4:], False, False)\n"
        "sys.stdout.write(a.choices[0].token_ids.tobytes().hex())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    corpus, _ = _bench_body()
    assert bytes.fromhex(out.stdout) == np.asarray(corpus.ids, dtype=np.int32).tobytes()


@needs_compiled
@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("-0.0", -0.0),
        ("-0", 0.0),
        ("5e-324", 5e-324),
        ("1e-400", 0.0),
        ("-1E+2", -100.0),
        ("0.1", 0.1),
        ("123456789012345678901234", 1.2345678901234568e23),
        ("2.5e-310", 2.5e-310),
    ],
)
def test_numbers_become_the_doubles_python_makes(text: str, value: float) -> None:
    body = ('{"choices":[{"logprobs":{"token_logprobs":[' + text + "]}}]}").encode()
    answer = tokens.scan(body, True, False)
    assert answer is not None and answer.choices[0].logprobs is not None
    got = answer.choices[0].logprobs[0]
    assert struct.pack("<f", got) == struct.pack("<f", value)
    assert math.copysign(1.0, float(got)) == math.copysign(1.0, value)


@pytest.mark.parametrize(
    "body",
    [
        b'{"choices":[{"logprobs":{"token_logprobs":[NaN]}}]}',
        b'{"choices":[{"logprobs":{"token_logprobs":[Infinity]}}]}',
        b'{"choices":[{"token_ids":[2147483648]}]}',
        b'{"choices":[{"logprobs":{"token_logprobs":[1e400]}}]}',
    ],
)
def test_what_neither_path_fits_is_left_to_the_full_decode(body: bytes) -> None:
    assert tokens.read_answer(body, True, False) is None


def test_a_huge_integer_logprob_is_refused_as_not_finite() -> None:
    body = b'{"choices":[{"logprobs":{"token_logprobs":[' + b"9" * 400 + b"]}}]}"
    with pytest.raises(BackendValueError, match="not finite"):
        tokens.read_answer(body, True, False)


def test_a_whole_fake_vllm_answer_with_top_ids_as_tokens() -> None:
    entries = [logprob_entry("token_id:7", -0.5, [("token_id:7", -0.5), ("x", -1.0)])]
    body = json.dumps(
        chat_completion(
            "c",
            "m",
            [chat_choice(0, chat_message("a"), entries, "stop", [7])],
            {"prompt_tokens": 1},
            [1, 2],
        )
    ).encode()
    for reader in (tokens.read_answer, tokens.decode):
        answer = reader(body, False, True)
        assert answer is not None
        assert answer.choices[0].top_ids == [[7]] and answer.choices[0].top_values == [[-0.5]]


# -- stream chunks -------------------------------------------------------------------------
def _capture_state(capture: ResponseCapture) -> Any:
    out = []
    for index in sorted(capture.choices):
        c = capture.choices[index]
        ids, lps = c.completion_arrays()
        prompt = capture.prompt_ids_for(c)
        out.append(
            (
                index,
                _array(ids),
                _array(lps),
                None if prompt is None else np.asarray(prompt, dtype=np.int32).tobytes(),
                c.top_ids,
                _bits(c.top_values),
                c.finish_reason,
                c.stop_reason,
                repr(c.message()),
                c.saw_token_ids,
            )
        )
    return (repr(capture.model), repr(capture.usage), out)


def _fed(chunks: list[bytes], plan: CapturePlan, scanned: bool) -> Any:
    """What a capture holds after `chunks` (None: a chunk the path does not take)."""
    capture = ResponseCapture(plan)
    for data in chunks:
        try:
            if scanned:
                found = tokens.scan_chunk(data, plan.endpoint != CHAT, plan.tokens_as_ids)
                if found is None:
                    return None
                if found.error is not None and not found.choices:
                    continue
                capture.add_scanned_chunk(found)
            else:
                obj = orjson.loads(data)
                if not isinstance(obj, dict):
                    return None
                if "error" in obj and not obj.get("choices"):
                    continue
                capture.add(obj, chunk=True)
        except orjson.JSONDecodeError:
            return None
        except BackendValueError as exc:
            return ("refused", exc.message)
    return ("ok", _capture_state(capture))


@needs_compiled
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), mode=MODES, hostile=st.booleans())
def test_scanned_stream_chunks_record_what_decoded_chunks_do(
    data: st.DataObject, mode: tuple[bool, bool], hostile: bool
) -> None:
    completions, as_ids = mode
    chunks = data.draw(st.lists(answer_body(completions, hostile, "delta"), min_size=1, max_size=3))
    plan = CapturePlan(COMPLETIONS if completions else CHAT, True, True, True, as_ids)
    with mock.patch.object(tokens, "SCAN_CHUNK_MIN_BYTES", 0):  # every chunk, however small
        scanned = _fed(chunks, plan, scanned=True)
    decoded = _fed(chunks, plan, scanned=False)
    if not hostile and not (completions and as_ids):
        assert scanned is not None or decoded is None or decoded[0] == "refused", chunks
    if scanned is not None:
        assert scanned == decoded, chunks


@needs_compiled
def test_small_chunks_are_left_to_orjson_and_large_ones_scanned() -> None:
    small = b'{"choices":[{"index":0,"token_ids":[5]}]}'
    assert tokens.scan_chunk(small, False, False) is None
    large = b'{"prompt_token_ids":[' + b",".join([b"123456"] * 400) + b"]}"
    found = tokens.scan_chunk(large, False, False)
    assert found is not None and found.prompt_token_ids is not None
    assert np.frombuffer(found.prompt_token_ids, dtype=np.int32).tolist() == [123456] * 400


# -- answers the client gets without the recorded fields ---------------------------------------
def _stripped(body: bytes, plan: CapturePlan, scanned: bool) -> Any:
    """The client's body (as parsed JSON) and the capture, or None where a path declines."""
    capture = ResponseCapture(plan)
    completions = plan.endpoint != CHAT
    try:
        if scanned:
            found = tokens.scan(body, completions, plan.tokens_as_ids)
            if found is None:
                return None
            capture.add_answer(found)
            out = found.strip(body, plan.client_token_ids, plan.client_logprobs)
            assert out is not None
            client = orjson.loads(out)
        else:
            client = orjson.loads(body)
            if not isinstance(client, dict):
                return None
            capture.add(client, chunk=False)
            plan.strip(client)
    except orjson.JSONDecodeError:
        return None
    except BackendValueError as exc:
        return ("refused", exc.message)
    return ("ok", repr(client), _capture_state(capture))


@needs_compiled
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    mode=MODES,
    hostile=st.booleans(),
    client_ids=st.booleans(),
    client_lps=st.booleans(),
)
def test_spliced_answers_are_what_decoding_and_stripping_gives(
    data: st.DataObject,
    mode: tuple[bool, bool],
    hostile: bool,
    client_ids: bool,
    client_lps: bool,
) -> None:
    completions, as_ids = mode
    body = data.draw(answer_body(completions, hostile))
    plan = CapturePlan(COMPLETIONS if completions else CHAT, False, client_ids, client_lps, as_ids)
    scanned = _stripped(body, plan, scanned=True)
    decoded = _stripped(body, plan, scanned=False)
    if scanned is not None:
        assert scanned == decoded, body


@needs_compiled
def test_a_splice_keeps_every_other_byte() -> None:
    body = (
        b'{"a" : 1.50, "prompt_token_ids" : [1, 2],"choices":[{"index":0,"token_ids":[3],'
        b'"logprobs":{"content":[]},"x":"\\u00e9"}]}'
    )
    found = tokens.scan(body, False, False)
    assert found is not None
    assert found.strip(body, False, True) == (
        b'{"a" : 1.50, "prompt_token_ids" : null,"choices":[{"index":0,"token_ids":null,'
        b'"logprobs":{"content":[]},"x":"\\u00e9"}]}'
    )
    assert found.strip(body, True, True) == body
