"""TITO mode (`turnstile.tito`): history matching, token deltas, and the whole app.

The app tests run Turnstile in TITO mode in front of `SimulatedModel` (a vLLM-shaped
backend speaking the real Qwen2.5 / Qwen3 vocabularies and templates vendored by
llama.cpp), through HTTP with the openai client, streaming and not.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest

from tests.live import LiveServer
from turnstile.backends.fake import FakeResponse
from turnstile.dev.drift import TOOLS, SimulatedModel
from turnstile.dev.llama_cpp_assets import ensure_llama_cpp_assets
from turnstile.dev.template_corpus import PAIRINGS
from turnstile.dev.vocab import ensure_vocab_tokenizer, load_tokenizer
from turnstile.errors import BadRequest
from turnstile.proxy.sse import encode_data
from turnstile.server.app import create_app
from turnstile.settings import SettingsError, load_settings
from turnstile.tito import TemplateRenderer, TitoBackend, match
from turnstile.tito.history import TurnState, canonical, same_reply
from turnstile.tito.parsers import parser_for_template

# llama.cpp's vocabularies and templates (a 76 MB download, cached); no vLLM.
pytestmark = pytest.mark.assets

QWEN25 = "Qwen-Qwen2.5-7B-Instruct.jinja"
QWEN3 = "Qwen-Qwen3-0.6B.jinja"
IM_END = 151645


@pytest.fixture(scope="module")
def assets() -> Path:
    return ensure_llama_cpp_assets(log=lambda _: None)


def _tokenizer_dir(name: str) -> Path:
    return ensure_vocab_tokenizer(PAIRINGS[name], log=lambda _: None)


def _state(messages: list[dict[str, Any]], reply: dict[str, Any]) -> TurnState:
    import numpy as np

    return TurnState(
        tuple(messages),
        reply,
        canonical(None),
        canonical(None),
        np.arange(5, dtype=np.int32),
        np.arange(3, dtype=np.int32),
        "stop",
    )


CALL = {
    "id": "c1",
    "type": "function",
    "function": {"name": "search", "arguments": '{"query": "x", "limit": 1.0}'},
}
USER = {"role": "user", "content": "hi"}


# -- history -----------------------------------------------------------------------------
def test_match_extends_the_state_whose_reply_the_harness_sent_back() -> None:
    reply = {"role": "assistant", "content": "", "tool_calls": [CALL], "reasoning": "hmm"}
    state = _state([USER], reply)
    # Re-serialised arguments, a new call id, reasoning left out, None for "": all the same.
    sent = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "other",
                "type": "function",
                "function": {"name": "search", "arguments": '{"limit":1.0,"query":"x"}'},
            }
        ],
    }
    found = match(
        [state],
        [USER, sent, {"role": "tool", "tool_call_id": "c1", "content": "r"}],
        canonical(None),
        canonical(None),
    )
    assert found.kind == "extend" and found.state is state


@pytest.mark.parametrize(
    ("messages", "why"),
    [
        (
            [{"role": "user", "content": "hello"}, {"role": "assistant", "content": ""}, USER],
            "message 0 (user) was changed",
        ),
        (
            [
                USER,
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        {**CALL, "function": {"name": "search", "arguments": '{"query": "y"}'}}
                    ],
                },
                USER,
            ],
            "tool calls differ",
        ),
        (
            [
                USER,
                {"role": "assistant", "content": "", "tool_calls": [CALL], "reasoning": "other"},
                USER,
            ],
            "reasoning differs",
        ),
        ([USER, USER], "expected the assistant message"),
    ],
)
def test_match_reports_a_rewrite_and_where(messages: list[dict[str, Any]], why: str) -> None:
    reply = {"role": "assistant", "content": "", "tool_calls": [CALL], "reasoning": "hmm"}
    found = match([_state([USER], reply)], messages, canonical(None), canonical(None))
    assert found.kind == "rewrite"
    assert why in found.detail


def test_match_finds_repeats_and_changed_tools() -> None:
    state = _state([USER], {"role": "assistant", "content": "a"})
    assert match([state], [USER], canonical(None), canonical(None)).kind == "repeat"
    other_tools = match(
        [state],
        [USER, {"role": "assistant", "content": "a"}, USER],
        canonical(TOOLS),
        canonical(None),
    )
    assert other_tools.kind == "rewrite" and "tools" in other_tools.detail
    assert match([], [USER], canonical(None), canonical(None)).kind == "first"
    assert same_reply({"role": "assistant", "content": "a "}, {"content": "a"}) is not None


# -- deltas --------------------------------------------------------------------------------
def test_delta_continues_the_whole_rendering_token_for_token(assets: Path) -> None:
    hf = load_tokenizer(_tokenizer_dir(QWEN25))
    renderer = TemplateRenderer(hf, (assets / "templates" / QWEN25).read_text())
    history: list[dict[str, Any]] = [
        {"role": "system", "content": "sys"},
        USER,
        {"role": "assistant", "content": "", "tool_calls": [CALL]},
    ]
    messages: list[dict[str, Any]] = [
        *history,
        {"role": "tool", "tool_call_id": "c1", "content": '{"k": 1.00}'},
        {"role": "user", "content": "  and then?  "},
    ]
    first, _ = renderer.prompt(history[:-1], TOOLS, None)
    whole_turn = renderer.encode(renderer.render(history, TOOLS, None, False))
    delta = renderer.delta(history, messages, TOOLS, None)
    assert delta.history_preserved and delta.end_of_turn_id == IM_END
    # The sampled turn is the template's own (canonical) rendering up to <|im_end|>.
    sampled = whole_turn[len(first) : whole_turn.index(IM_END, len(first)) + 1]
    full, _ = renderer.prompt(messages, TOOLS, None)
    assert first + sampled + delta.ids == full
    assert delta.text.startswith("\n<|im_start|>user\n<tool_response>")


# -- the app in TITO mode ---------------------------------------------------------------------
class Tito:
    def __init__(self, server: LiveServer, sim: SimulatedModel, out: Path) -> None:
        self.server, self.sim, self.out = server, sim, out

    def client(self, rollout: str) -> Any:
        # Any: the tests send plain dicts, which the SDK's TypedDict overloads do not take.
        return openai.OpenAI(
            base_url=f"{self.server.url}/rollouts/{rollout}/v1", api_key="k", max_retries=0
        )

    def plan(
        self,
        history: list[dict[str, Any]],
        assistant: dict[str, Any],
        tools: list[dict[str, Any]] | None = TOOLS,
    ) -> list[int]:
        return self.sim.sample(history, assistant, "none", tools)


@pytest.fixture
def tito(tmp_path: Path, live: Callable[[Any], LiveServer]) -> Iterator[Callable[..., Tito]]:
    def _start(
        template: str = QWEN25, sim_cls: type[SimulatedModel] = SimulatedModel, **overrides: Any
    ) -> Tito:
        tokenizer_dir = _tokenizer_dir(template)
        path = ensure_llama_cpp_assets(log=lambda _: None) / "templates" / template
        hf = load_tokenizer(tokenizer_dir)
        settings = load_settings(
            None,
            {
                "output": tmp_path / "out",
                "tokenizer": tokenizer_dir,
                "mode": "tito",
                "chat_template": path,
                "shard_max_age_s": 0.05,
                **overrides,
            },
            environ={},
        )
        text = path.read_text()
        sim = sim_cls(TemplateRenderer(hf, text), parser_for_template(text))
        app = create_app(settings, backend=sim)
        engine = app.state.tito
        sim.renderer = TemplateRenderer(
            hf, engine.renderer.template, engine.renderer.default_kwargs
        )
        return Tito(live(app), sim, tmp_path / "out")

    yield _start


def _finish_and_read(t: Tito, rollout: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    from turnstile.reader import open_output

    assert httpx.post(f"{t.server.url}/rollouts/{rollout}/finish").status_code == 200
    import time

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        reader = open_output(t.out)
        samples = [s for s in reader.samples().to_pylist() if s["rollout_id"] == rollout]
        if samples:
            turns = [x for x in reader.turns().to_pylist() if x["rollout_id"] == rollout]
            return samples, sorted(turns, key=lambda x: x["turn_index"])
        time.sleep(0.05)
    raise AssertionError("no samples published")


def test_tito_tool_turns_stitch_into_one_exact_sample(tito: Callable[..., Tito]) -> None:
    t = tito()
    client = t.client("r1")
    messages: list[dict[str, Any]] = [{"role": "user", "content": "find x"}]
    call = {
        "id": "call_0",
        "type": "function",
        "function": {"name": "search", "arguments": '{"query": "x"}'},
    }
    t.plan(messages, {"role": "assistant", "content": "", "tool_calls": [call]})
    r = client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls and choice.message.tool_calls[0].function.name == "search"
    assert json.loads(choice.message.tool_calls[0].function.arguments) == {"query": "x"}
    assert not hasattr(choice, "token_ids") or choice.token_ids is None  # stripped
    messages += [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": choice.message.tool_calls[0].id, "content": "found"},
    ]
    t.plan(messages, {"role": "assistant", "content": "It is found."})
    stream = client.chat.completions.create(model="m", messages=messages, tools=TOOLS, stream=True)
    parts, finish = [], None
    for chunk in stream:
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    assert "".join(parts) == "It is found." and finish == "stop"
    # Only token IDs went to the backend, on /v1/completions.
    assert len(t.sim.prompts) == 2
    samples, turns = _finish_and_read(t, "r1")
    assert len(samples) == 1 and samples[0]["break_kind"] == "first"
    sample = samples[0]
    assert [x["prompt_token_ids"] for x in turns] == t.sim.prompts
    last = turns[-1]
    assert sample["input_ids"] == last["prompt_token_ids"] + last["completion_token_ids"]
    first = turns[0]
    assert (
        last["prompt_token_ids"][: first["num_prompt_tokens"] + first["num_completion_tokens"]]
        == first["prompt_token_ids"] + first["completion_token_ids"]
    )
    stats = httpx.get(f"{t.server.url}/stats").json()
    assert stats["mode"] == "tito" and stats["tito"]["extended"] == 1
    # The model sampled what the template renders: both contexts are the template's own.
    assert [x["tito_context_faithful"] for x in turns] == [True, True]
    assert stats["tito"]["unfaithful"] == 0


def test_a_context_the_template_would_render_differently_is_recorded_unfaithful(
    tito: Callable[..., Tito],
) -> None:
    # The model samples compact JSON arguments; the template re-serialises them, so the
    # next context (exact: what the model sampled) is not the template's rendering.
    t = tito()
    client = t.client("r-compact")
    messages: list[dict[str, Any]] = [{"role": "user", "content": "find x"}]
    call = {
        "id": "call_0",
        "type": "function",
        "function": {"name": "search", "arguments": '{"query": "x", "limit": 2}'},
    }
    t.sim.sample(
        messages, {"role": "assistant", "content": "", "tool_calls": [call]}, "json_spacing", TOOLS
    )
    r = client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
    messages += [
        r.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": r.choices[0].message.tool_calls[0].id, "content": "ok"},
    ]
    t.plan(messages, {"role": "assistant", "content": "Done."})
    client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
    samples, turns = _finish_and_read(t, "r-compact")
    assert len(samples) == 1  # still one exact sample
    assert [x["tito_context_faithful"] for x in turns] == [True, False]
    assert httpx.get(f"{t.server.url}/stats").json()["tito"]["unfaithful"] == 1


FAKE_ECHO = [9, 9, 9]


class _WrongEcho(SimulatedModel):
    """Echoes a prompt other than the one it was sent (as a backend that cut it would)."""

    async def request(
        self, method: str, path: str, body: bytes | None, headers: Mapping[str, str]
    ) -> FakeResponse:
        resp = await super().request(method, path, body, headers)
        if path != "/v1/completions":
            return resp
        out = []
        for piece in resp.body:
            if piece.startswith(b"data: {"):
                out.append(encode_data(self._rewrite(piece[6:].strip())))
            elif piece.startswith(b"{"):
                out.append(self._rewrite(piece))
            else:
                out.append(piece)
        resp.body = out
        return resp

    @staticmethod
    def _rewrite(raw: bytes) -> bytes:
        obj = orjson.loads(raw)
        for choice in obj.get("choices") or ():
            if choice.get("prompt_token_ids") is not None:
                choice["prompt_token_ids"] = FAKE_ECHO
        return orjson.dumps(obj)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("truncate", [False, True])
def test_tito_records_the_prompt_it_sent_not_the_echo(
    tito: Callable[..., Tito], stream: bool, truncate: bool
) -> None:
    """The backend's echo of the prompt ids is not read: TITO sent them. Only where the
    backend may have cut the prompt (`truncate_prompt_tokens`) is the echo what counts."""
    t = tito(sim_cls=_WrongEcho)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "hello"}]
    t.plan(messages, {"role": "assistant", "content": "Hi."}, None)
    extra = {"return_token_ids": True, **({"truncate_prompt_tokens": 4096} if truncate else {})}
    client = t.client("echo")
    if stream:
        chunks = list(
            client.chat.completions.create(
                model="m", messages=messages, stream=True, extra_body=extra
            )
        )
        answered = chunks[0].model_extra["prompt_token_ids"]
    else:
        r = client.chat.completions.create(model="m", messages=messages, extra_body=extra)
        answered = r.model_extra["prompt_token_ids"]
    expected = FAKE_ECHO if truncate else t.sim.prompts[0]
    assert answered == expected
    _, turns = _finish_and_read(t, "echo")
    assert turns[0]["prompt_token_ids"] == expected


def test_tito_rewrite_splits_with_lineage(tito: Callable[..., Tito]) -> None:
    t = tito()
    client = t.client("r2")
    messages: list[dict[str, Any]] = [{"role": "user", "content": "hello"}]
    t.plan(messages, {"role": "assistant", "content": "Hi."}, None)
    r = client.chat.completions.create(model="m", messages=messages)
    # The harness compacts: it rewrites the assistant's reply before going on.
    messages = [
        *messages,
        {"role": "assistant", "content": "(compacted)"},
        {"role": "user", "content": "go on"},
    ]
    t.plan(messages, {"role": "assistant", "content": "OK."}, None)
    r = client.chat.completions.create(model="m", messages=messages)
    assert r.choices[0].message.content == "OK."
    samples, _ = _finish_and_read(t, "r2")
    assert [s["break_kind"] for s in sorted(samples, key=lambda s: s["sample_index"])] == [
        "first",
        "history_rewritten",
    ]
    assert samples[-1]["parent_sample_index"] == 0 if samples[-1]["sample_index"] else True
    assert httpx.get(f"{t.server.url}/stats").json()["tito"]["split"] == 1


def test_tito_refuse_policy_answers_409_with_where(tito: Callable[..., Tito]) -> None:
    t = tito(tito_on_rewrite="refuse")
    client = t.client("r3")
    messages: list[dict[str, Any]] = [{"role": "user", "content": "hello"}]
    t.plan(messages, {"role": "assistant", "content": "Hi."}, None)
    client.chat.completions.create(model="m", messages=messages)
    edited = [
        {"role": "user", "content": "HELLO"},
        {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": "more"},
    ]
    with pytest.raises(openai.ConflictError) as info:
        client.chat.completions.create(model="m", messages=edited)
    assert "message 0 (user) was changed" in str(info.value)
    assert len(t.sim.prompts) == 1  # nothing reached the backend


@pytest.mark.parametrize(
    ("extra", "param"), [({"n": 2}, "n"), ({"tool_choice": "required"}, "tool_choice")]
)
def test_tito_rejects_what_it_cannot_honour(
    tito: Callable[..., Tito], extra: dict[str, Any], param: str
) -> None:
    t = tito()
    with pytest.raises(openai.UnprocessableEntityError) as info:
        t.client("r4").chat.completions.create(model="m", messages=[USER], tools=TOOLS, **extra)
    assert param in str(info.value)


def test_an_unfaithful_template_is_refused_only_with_template_history(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Phi-3.5's template does not render tool calls (no fix is known): TITO-exact, but its
    # context is not what the template renders once the model has called a tool.
    name = "microsoft-Phi-3.5-mini-instruct.jinja"
    path = ensure_llama_cpp_assets(log=lambda _: None) / "templates" / name
    base = {
        "output": tmp_path / "o",
        "tokenizer": _tokenizer_dir(name),
        "mode": "tito",
        "chat_template": path,
    }
    from tests.fakes_backend import FakeVLLM
    from turnstile.tito.templates import audit_template

    report = audit_template(load_tokenizer(_tokenizer_dir(name)), path.read_text())
    assert report.tito_exact and not report.deployment_faithful, report.reasons
    template_history = {**base, "tito_history": "template"}
    with pytest.raises(SettingsError, match="not safe for TITO mode with tito_history: template"):
        create_app(load_settings(None, template_history, environ={}), backend=FakeVLLM())
    with caplog.at_level("WARNING", logger="turnstile.tito"):
        sampled = create_app(load_settings(None, base, environ={}), backend=FakeVLLM())
    assert sampled.state.tito.template_info["deployment_faithful"] is False
    assert sampled.state.tito.template_info["history"] == "sampled"
    assert "does not render this turn's tool calls" in caplog.text
    app = create_app(
        load_settings(None, {**template_history, "allow_unsafe_template": True}, environ={}),
        backend=FakeVLLM(),
    )
    assert app.state.tito is not None
    # TITO mode is a Backend wrapper: the proxy has no TITO branch of its own.
    backend = app.state.proxy.backend
    assert isinstance(backend, TitoBackend) and backend.engine is app.state.tito
    with pytest.raises(BadRequest, match="within a rollout"):  # no ROLLOUT_AFFINITY set
        asyncio.run(backend.request("POST", "/v1/chat/completions", b"{}", {}))


def test_tito_needs_a_tokenizer() -> None:
    with pytest.raises(SettingsError, match="tokenizer"):
        load_settings(None, {"mode": "tito"}, environ={})


def test_delta_finds_the_turn_when_the_generation_prompt_is_not_repeated(
    assets: Path,
) -> None:
    # R1 distills open "<think>\n" in the generation prompt but render an earlier turn
    # without it: the turn still ends at its own end-of-sentence token, not earlier.
    name = "deepseek-ai-DeepSeek-R1-Distill-Llama-8B.jinja"
    hf = load_tokenizer(_tokenizer_dir(name))
    renderer = TemplateRenderer(hf, (assets / "templates" / name).read_text())
    history = [USER, {"role": "assistant", "content": "Hello."}]
    messages = [*history, {"role": "user", "content": "again"}]
    before = renderer.render(history[:-1], None, None, True)
    whole = renderer.render(history, None, None, False)
    assert not whole.startswith(before)
    start = renderer.turn_start(before, whole)
    assert whole[start:] == "Hello.<｜end▁of▁sentence｜>"  # noqa: RUF001 - DeepSeek markers
    delta = renderer.delta(history, messages, None, None)
    assert delta.text == "<｜User｜>again<｜Assistant｜><think>\n"  # noqa: RUF001
