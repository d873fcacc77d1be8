"""A property: no header, body or backend answer costs anyone an acknowledged turn.

Hypothesis draws one hostile call: a hostile value in a header Turnstile reads, a hostile
request body (wrong types, huge or negative ints, NaN and infinities, lone surrogates,
deep nesting, random bytes, truncated JSON), or a hostile answer from the backend (the
same values in the fields Turnstile records, garbage, truncated JSON, odd SSE). It is made
between two well-behaved rollouts, over the app with its real journal and shards. Then:

- the hostile call is refused with a 4xx or 502, or answered 200; when it was answered
  (200 or 502) its turn is recorded; it never gets a 500 or 503;
- the well-behaved rollout after it is still served;
- every acknowledged turn and finished rollout of the well-behaved clients is in the shards,
  both after a clean shutdown and after a restart on a copy of the output directory taken
  while the app ran (what a crash at that moment leaves behind).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

from turnstile.backends.fake import FakeResponse, FakeVLLM
from turnstile.backends.protocol import ROLLOUT_AFFINITY
from turnstile.reader import open_output
from turnstile.server.app import create_app
from turnstile.settings import load_settings

# Bounded for CI: each example starts the app twice (40 take about 10 s of CPU).
EXAMPLES = 40
HOSTILE = "hostile"  # the rollout the hostile call goes to
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}

# -- values -------------------------------------------------------------------------------
_INTS = st.one_of(
    st.integers(-(2**70), 2**70),
    st.sampled_from([-1, 2**31 - 1, 2**31, 2**63 - 1, 2**63, -(2**63) - 1, 10**30]),
)
_FLOATS = st.floats(allow_nan=True, allow_infinity=True)
_SURROGATES = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)
_TEXTS = st.text(st.one_of(st.characters(), _SURROGATES), max_size=12)
_SCALARS = st.one_of(st.none(), st.booleans(), _INTS, _FLOATS, _TEXTS)
_VALUES = st.recursive(
    _SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(_TEXTS, inner, max_size=3)
    ),
    max_leaves=6,
)


def _json(value: Any) -> bytes:
    """JSON as a careless client writes it: NaN, Infinity and lone surrogates included."""
    return json.dumps(value, allow_nan=True).encode()


def _nested(depth: int) -> Any:
    value: Any = "x"
    for _ in range(depth):
        value = [value]
    return value


@st.composite
def _bodies(draw: st.DrawFn) -> bytes:
    """A chat request with one hostile part, or bytes that are no request at all."""
    kind = draw(st.sampled_from(["field", "content", "deep", "bytes", "truncated"]))
    body: dict[str, Any] = json.loads(json.dumps(CHAT))
    if kind == "field":
        field = draw(
            st.sampled_from(
                [
                    *("messages", "tools", "n", "stream", "model", "max_tokens"),
                    *("logprobs", "top_logprobs", "stop", "temperature"),
                ]
            )
        )
        body[field] = draw(_VALUES)
    elif kind == "content":
        body["messages"][0][draw(st.sampled_from(["content", "role", "name"]))] = draw(_VALUES)
    elif kind == "deep":  # JSON parsers differ around these depths
        depth = draw(st.sampled_from([254, 255, 256, 300, 1000, 1200]))
        body["messages"][0]["content"] = "DEEP"
        raw = _json(body)
        return raw.replace(b'"DEEP"', b"[" * depth + b"1" + b"]" * depth)
    elif kind == "bytes":
        return draw(st.binary(max_size=64))
    else:
        raw = _json(body)
        return raw[: draw(st.integers(0, len(raw) - 1))]
    return _json(body)


_HEADER_TEXT = st.text(
    st.characters(min_codepoint=0x20, max_codepoint=0xFF, exclude_characters="\x7f"),
    max_size=24,
)


@st.composite
def _headers(draw: st.DrawFn) -> tuple[str, dict[str, str]]:
    """(path, headers): a hostile policy version or rollout header."""
    if draw(st.booleans()):
        value = draw(st.one_of(_INTS.map(str), _HEADER_TEXT))
        return f"/rollouts/{HOSTILE}/v1/chat/completions", {"X-Turnstile-Policy-Version": value}
    return "/v1/chat/completions", {"X-Turnstile-Rollout": draw(_HEADER_TEXT)}


# -- backend answers ------------------------------------------------------------------------
_WHOLE_FIELDS = [
    ("choices", 0, "token_ids"),
    ("choices", 0, "index"),
    ("choices", 0, "finish_reason"),
    ("choices", 0, "message"),
    ("choices", 0, "logprobs"),
    ("choices", 0, "logprobs", "content", 0, "logprob"),
    ("choices", 0, "logprobs", "content", 0, "token"),
    ("choices",),
    ("prompt_token_ids",),
    ("model",),
    ("usage",),
]
_STREAM_FIELDS = [
    ("choices", 0, "token_ids"),
    ("choices", 0, "index"),
    ("choices", 0, "delta"),
    ("choices", 0, "logprobs", "content", 0, "logprob"),
    ("choices",),
    ("prompt_token_ids",),
]


def _set(obj: Any, path: tuple[Any, ...], value: Any) -> None:
    """Set `obj` at `path` to `value`, where the path exists."""
    for key in path[:-1]:
        try:
            obj = obj[key]
        except (KeyError, IndexError, TypeError):
            return
    if isinstance(obj, dict) or (isinstance(obj, list) and path[-1] < len(obj)):
        obj[path[-1]] = value


@dataclass(frozen=True)
class Answer:
    """How the backend's answer to the hostile call is spoiled."""

    stream: bool
    kind: str
    path: tuple[Any, ...] = ()
    value: Any = None
    cut: int = 0
    noise: bytes = b""


_ANSWERS = st.one_of(
    st.builds(
        Answer,
        stream=st.just(False),
        kind=st.just("field"),
        path=st.sampled_from(_WHOLE_FIELDS),
        value=_VALUES,
    ),
    st.builds(
        Answer,
        stream=st.booleans(),
        kind=st.sampled_from(["truncated", "bytes"]),
        cut=st.integers(0, 10_000),
        noise=st.binary(max_size=64),
    ),
    st.builds(
        Answer,
        stream=st.just(True),
        kind=st.just("event"),
        path=st.sampled_from(_STREAM_FIELDS),
        value=_VALUES,
        cut=st.integers(0, 4),
    ),
    st.builds(
        Answer,
        stream=st.just(True),
        kind=st.sampled_from(["no-done", "odd-sse"]),
        cut=st.integers(0, 4),
        noise=st.sampled_from(
            [
                *(b": comment\n\n", b"event: x\ndata: {}\n\n", b"data:[DONE]\r\n\r\n"),
                *(b"data\n\n", b"retry: x\n\n", b"data: null\n\n", b"data: 7\n\n"),
                b'data: {"error": 1}\n\n',
            ]
        ),
    ),
)


class HostileBackend:
    """The fake vLLM, except that its answer to the hostile rollout is spoiled."""

    def __init__(self, answer: Answer | None) -> None:
        self.fake = FakeVLLM()
        self.answer = answer
        self.base_url = self.fake.base_url

    async def request(
        self, method: str, path: str, body: bytes | None, headers: Mapping[str, str]
    ) -> Any:
        try:
            resp = await self.fake.request(method, path, body, headers)
        except (KeyError, TypeError, ValueError, AttributeError, IndexError):
            # The fake cannot render this request; vLLM would refuse it as invalid.
            error = {"object": "error", "message": "invalid request", "code": 400}
            return FakeResponse(400, {"Content-Type": "application/json"}, [_json(error)])
        answer = self.answer
        if answer is None or ROLLOUT_AFFINITY.get(None) != HOSTILE or resp.status != 200:
            return resp
        raw = await resp.read()
        if answer.kind == "field":
            obj = orjson.loads(raw)
            _set(obj, answer.path, answer.value)
            chunks = [_json(obj)]
        elif answer.kind == "truncated":
            chunks = [raw[: answer.cut % max(len(raw), 1)]]
        elif answer.kind == "bytes":
            chunks = [answer.noise]
        else:
            events = [e + b"\n\n" for e in raw.split(b"\n\n") if e]
            at = answer.cut % len(events)
            if answer.kind == "event":
                obj = (
                    orjson.loads(events[at].removeprefix(b"data: ")) if at < len(events) - 1 else {}
                )
                _set(obj, answer.path, answer.value)
                events[at] = b"data: " + _json(obj) + b"\n\n"
            elif answer.kind == "no-done":
                events = events[:-1]
            else:
                events.insert(at, answer.noise)
            chunks = events
        return FakeResponse(200, resp.headers, chunks)

    async def aclose(self) -> None:
        return None


# -- the property ---------------------------------------------------------------------------
Good = dict[tuple[str, int], str]  # (rollout, turn index) -> status, acknowledged ok


def _good_rollout(client: TestClient, rid: str, acked: Good) -> None:
    """Two turns (one streamed) and a finish, each acknowledged."""
    for stream in (False, True):
        resp = client.post(f"/rollouts/{rid}/v1/chat/completions", json={**CHAT, "stream": stream})
        assert resp.status_code == 200, resp.text
        assert not stream or resp.text.rstrip().endswith("data: [DONE]"), resp.text
        acked[(rid, int(resp.headers["X-Turnstile-Turn"]))] = "ok"
    assert client.post(f"/rollouts/{rid}/finish").status_code == 200


def _check_output(out: Path, acked: Good, hostile_rollout: str | None) -> None:
    reader = open_output(out)
    turns = reader.turns(
        columns=["rollout_id", "turn_index", "status", "turn_id", "choice_index"]
    ).to_pylist()
    good = {(t["rollout_id"], t["turn_index"]): t["status"] for t in turns}
    assert {k: good.get(k) for k in acked} == acked, f"acknowledged turns lost in {out}"
    keys = {(t["turn_id"], t["choice_index"]) for t in turns}
    assert len(keys) == len(turns), "a turn was written twice"
    rows = reader.rollouts(columns=["rollout_id", "status"]).to_pylist()
    finished = {r["rollout_id"] for r in rows if r["status"] == "finished"}
    assert {rid for rid, _ in acked} <= finished
    if hostile_rollout is not None:
        assert any(t["rollout_id"] == hostile_rollout for t in turns), "not recorded"


def _snapshot(src: Path, dst: Path) -> None:
    """Copy an output directory while its app runs (idle): the journal first, then the
    shards, so that nothing the journal gave up for a published shard is missed. Staged
    shards are left out, as a crash leaves them to be discarded."""
    paths = sorted(src.rglob("*"), key=lambda p: p.relative_to(src).parts[0] != "journal")
    for path in paths:
        target = dst / path.relative_to(src)
        if ".tmp" in path.relative_to(src).parts:
            continue
        if path.is_dir():
            target.mkdir(parents=True, exist_ok=True)
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):  # replaced meanwhile (a manifest)
            shutil.copy2(path, target)


def _settings(out: Path) -> Any:
    return load_settings(None, {"output": out, "shard_max_rows": 4}, environ={})


def _hostile_call(client: TestClient, call: tuple[str, Any]) -> tuple[int, str | None]:
    """Make the call; (its status, the rollout it named when it was answered)."""
    kind, value = call
    path, body = f"/rollouts/{HOSTILE}/v1/chat/completions", _json(CHAT)
    headers: dict[str, str] = {}
    if kind == "header":
        path, headers = value
    elif kind == "body":
        body = value
    elif kind == "backend":
        body = _json({**CHAT, "stream": value.stream})
    sent = {b"content-type": b"application/json"}
    sent.update({name.encode(): value.encode("latin-1") for name, value in headers.items()})
    resp = client.post(path, content=body, headers=sent)
    status = resp.status_code
    assert status in (200, 502) or 400 <= status < 500, (status, resp.text)
    if status == 200 and resp.headers.get("content-type", "").startswith("text/event-stream"):
        assert resp.text.rstrip().endswith("data: [DONE]"), resp.text
    return status, resp.headers.get("X-Turnstile-Rollout")


_CALLS = st.one_of(
    st.tuples(st.just("header"), _headers()),
    st.tuples(st.just("body"), _bodies()),
    st.tuples(st.just("backend"), _ANSWERS),
)


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(call=_CALLS)
# Found by this property (each was a 500 or a cut stream recorded as a client disconnect):
@example(call=("backend", Answer(stream=True, kind="event", path=("choices",), value=True, cut=1)))
@example(call=("backend", Answer(stream=False, kind="field", path=("choices",), value=7)))
@example(
    call=("backend", Answer(stream=True, kind="event", path=("choices", 0, "delta"), value=[1]))
)
@example(call=("body", b'{"model": "m", "messages": [{}]}'))
def test_no_hostile_call_costs_an_acknowledged_turn(call: tuple[str, Any]) -> None:
    answer = call[1] if call[0] == "backend" else None
    with tempfile.TemporaryDirectory() as tmp:
        out, crashed = Path(tmp) / "out", Path(tmp) / "crashed"
        acked: Good = {}
        app = create_app(_settings(out), backend=HostileBackend(answer))
        with TestClient(app) as client:
            _good_rollout(client, "before", acked)
            status, named = _hostile_call(client, call)
            _good_rollout(client, "after", acked)
            assert client.get("/health").status_code == 200
            assert client.get("/stats").json()["in_flight"] == 0
            _snapshot(out, crashed)  # what a kill -9 now would leave behind
        _check_output(out, acked, named if status in (200, 502) else None)
        again = create_app(_settings(crashed), backend=FakeVLLM())
        with TestClient(again):
            pass  # start-up rebuilds from the journal; shutdown publishes
        _check_output(crashed, acked, None)
