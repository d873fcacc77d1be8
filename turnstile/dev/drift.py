"""The drift corpus: record mode versus TITO mode over real chat templates.

Multi-turn, tool-using conversations with adversarial content (JSON with unusual spacing,
escaped unicode, numbers like 1.00, booleans, empty content, whitespace at boundaries,
long tool outputs) run through the real Turnstile app (proxy, recorder, journal, Parquet
shards) in both modes, against `SimulatedModel`: a backend that "samples" what a model
trained on the template would write for each assistant turn (the template's own rendering
of the turn), perturbed the way real sampling differs from a re-render: argument JSON
spaced differently, unicode escaped, trailing whitespace, and a word split into
non-canonical tokens. It speaks vLLM's chat and token-ID completions protocols with the
template's real vocabulary and renders chat prompts as vLLM does; its answers are built
with `turnstile.backends.fake`'s builders of vLLM's objects.

`measure(template)` returns, per mode, the turns, the breaks by kind, the ground-truth
breaks (a prompt that does not start with the previous prompt + completion), and the
tokens where a stitched sample differs from what the backend consumed and produced (0 is
the TITO guarantee). `python -m turnstile.dev.drift` prints the table in docs/tito.md.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from turnstile.backends.fake import (
    JSON_HEADERS,
    SSE_DONE,
    FakeResponse,
    completion_choice,
    completion_chunk,
    completion_logprobs,
    model_list,
    sse_event,
    text_completion,
    usage,
)
from turnstile.proxy.capture import CHAT
from turnstile.proxy.core import Relay
from turnstile.tito.convert import ChatAnswer, ChatStream
from turnstile.tito.parsers import ParserSpec, parser_for_template
from turnstile.tito.render import RenderError, TemplateRenderer

__all__ = ["ModeDrift", "SimulatedModel", "TemplateDrift", "conversations", "measure"]

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the index.",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string"},
                    "limit": {"type": "number"},
                    "exact": {"type": "boolean"},
                },
                "required": ["query"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file.",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}},
                "required": ["path"],
            },
        },
    },
]
# Why a template has no row of figures: the corpus's conversations are not what it takes
# (e.g. a tool-call format whose parser is unknown, so the harness sends no tool calls).
CANNOT_RUN = "the corpus cannot run on this template"
# The simulated model's name in `/v1/models`, and the id of its answers.
MODEL = "simulated"
COMPLETION_ID = "cmpl-sim"
LONG_OUTPUT = "\n".join(f"line {i}: {'x' * (i % 13)} résultat {i * 1.5}" for i in range(60))


def _call(call_id: str, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
    }


@dataclass(frozen=True)
class Step:
    """One assistant turn the model samples, the perturbation of its sampled text, and
    the messages the harness sends after it (tool results answer the turn's calls)."""

    assistant: dict[str, Any]
    perturb: str
    then: tuple[dict[str, Any], ...]


@dataclass(frozen=True)
class Conversation:
    name: str
    start: tuple[dict[str, Any], ...]
    steps: tuple[Step, ...]


def _tool(call_id: str, content: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "content": content}


def conversations() -> list[Conversation]:
    """The corpus: tool use, parallel calls, reasoning, plain chat, awkward content."""
    search = _call("call_1", "search", {"query": "naïve café ☕", "limit": 1.0, "exact": True})
    read = _call("call_2", "read_file", {"path": "/tmp/a b.txt"})
    parallel = [
        _call("call_3", "search", {"exact": False, "query": "x", "limit": 10}),
        _call("call_4", "read_file", {"path": "C:\\dir\\f.json"}),
    ]
    return [
        Conversation(
            "tools",
            (
                {"role": "system", "content": "You are a careful agent. Use tools."},
                {"role": "user", "content": "  Find the café and read the file.  "},
            ),
            (
                Step(
                    {"role": "assistant", "content": "", "tool_calls": [search]},
                    "json_spacing",
                    (_tool("call_1", json.dumps({"hits": [1.0, 2, True, None], "é": "ü"})),),
                ),
                Step(
                    {"role": "assistant", "content": "", "tool_calls": [read]},
                    "unicode_escape",
                    (_tool("call_2", LONG_OUTPUT),),
                ),
                Step(
                    {"role": "assistant", "content": "Done: 1.0 vs 1, true."},
                    "trailing_space",
                    ({"role": "user", "content": ""},),
                ),
                Step(
                    {"role": "assistant", "content": "Nothing more to add."},
                    "split_token",
                    ({"role": "user", "content": "Now both at once 🚀"},),
                ),
                Step(
                    {"role": "assistant", "content": "", "tool_calls": parallel},
                    "json_spacing",
                    (_tool("call_3", "[]"), _tool("call_4", '{"k": 1.00}')),
                ),
                Step({"role": "assistant", "content": "All read.\n"}, "none", ()),
            ),
        ),
        Conversation(
            "reasoning",
            ({"role": "user", "content": "What is 2 + 2? Think first."},),
            (
                Step(
                    {"role": "assistant", "content": "4", "reasoning_content": "2 + 2 is 4."},
                    "none",
                    ({"role": "user", "content": "And times 3?"},),
                ),
                Step(
                    {
                        "role": "assistant",
                        "content": "12",
                        "reasoning_content": "4 * 3 = 12, checking: 12.",
                    },
                    "split_token",
                    ({"role": "user", "content": "Thanks\t"},),
                ),
                Step({"role": "assistant", "content": "You're welcome."}, "none", ()),
            ),
        ),
        Conversation(
            "chat",
            ({"role": "user", "content": "Say hello."},),
            (
                Step(
                    {"role": "assistant", "content": "Hello!"},
                    "none",
                    ({"role": "user", "content": 'Again, with "quotes" and {braces}.'},),
                ),
                Step(
                    {"role": "assistant", "content": '"Hello" {again}'},
                    "trailing_space",
                    ({"role": "user", "content": "Bye."},),
                ),
                Step({"role": "assistant", "content": "Bye."}, "none", ()),
            ),
        ),
    ]


# -- the simulated model ---------------------------------------------------------------
def _perturb(text: str, how: str) -> str:
    """Sampled text as a model may write it where a re-render writes it canonically."""
    if how == "json_spacing":
        return text.replace('": ', '":').replace(", ", ",  ")
    if how == "unicode_escape":
        return "".join(c if c.isascii() else f"\\u{ord(c):04x}" for c in text)
    if how == "trailing_space":
        return text + "  \n"
    return text


def _split_token(renderer: TemplateRenderer, ids: list[int]) -> list[int]:
    """One multi-character word token written as two tokens (non-canonical BPE)."""
    for i in range(len(ids) // 2, len(ids)):
        piece = renderer.decode([ids[i]])
        if len(piece) >= 3 and piece.strip().isalpha():
            left, right = renderer.encode(piece[:2]), renderer.encode(piece[2:])
            if renderer.decode(left + right) == piece and len(left + right) > 1:
                return ids[:i] + left + right + ids[i + 1 :]
    return ids


def _logprob(i: int) -> float:
    return -0.25 - 0.01 * (i % 9)


@dataclass
class SimulatedModel:
    """A vLLM-shaped backend that samples the planned completion (`plan`) for each call."""

    renderer: TemplateRenderer
    parsers: ParserSpec
    base_url: str = "simulated://model"
    plan: list[int] = field(default_factory=list)
    prompts: list[list[int]] = field(default_factory=list)

    def sample(
        self,
        history: list[dict[str, Any]],
        assistant: dict[str, Any],
        how: str,
        tools: list[dict[str, Any]] | None,
        then: tuple[dict[str, Any], ...] = (),
    ) -> list[int]:
        """The tokens the model samples for `assistant` after `history`, ending with its
        end-of-turn token; stored as the plan of the next call. A template that leaves
        the turn open while it is last ends it with the next message's header (`then`)."""
        r = self.renderer
        prompt = r.render(history, tools, None, True)
        whole = r.render([*history, assistant], tools, None, False)
        start = r.turn_start(prompt, whole)
        end = r.end_of_turn(whole, start)
        if end is None and then:
            whole = r.render([*history, assistant, *then], tools, None, True)
            end = r.end_of_turn(whole, start)
        if end is None:
            if then or not r.stops:
                raise ValueError("the template's assistant turn has no end-of-turn token")
            # The last turn of an open-turn template: the model stops with EOS.
            eos = r.tokenizer.eos_token_id
            eot = eos if eos in r.stops else min(r.stops)
            end = (len(whole) + len(r.decode([eot])), eot)
        cut, eot = end
        text = _perturb(whole[start : max(start, cut - len(r.decode([eot])))], how)
        ids = r.encode(text)
        if how == "split_token":
            ids = _split_token(r, ids)
        self.plan = [*ids, eot]
        return self.plan

    def _completion(self, prompt: list[int], model: str) -> dict[str, Any]:
        ids = list(self.plan)
        stop = ids[-1] in self.renderer.stops
        text = self.renderer.tokenizer.decode(ids[:-1] if stop else ids, skip_special_tokens=True)
        logprobs = completion_logprobs(
            [f"token_id:{t}" for t in ids],
            [_logprob(i) for i in range(len(ids))],
            [{f"token_id:{t}": _logprob(i)} for i, t in enumerate(ids)],
            [0] * len(ids),
        )
        choice = completion_choice(0, text, logprobs, "stop" if stop else "length", ids, prompt)
        return text_completion(COMPLETION_ID, model, [choice], usage(len(prompt), len(ids)))

    async def request(
        self, method: str, path: str, body: bytes | None, headers: Mapping[str, str]
    ) -> FakeResponse:
        req = orjson.loads(body or b"{}")
        if path == "/v1/models":
            return FakeResponse(200, JSON_HEADERS, [orjson.dumps(model_list(MODEL, MODEL))])
        if path == "/v1/completions":
            prompt = [int(t) for t in req["prompt"]]
            out = self._completion(prompt, str(req.get("model")))
        elif path == "/v1/chat/completions":
            prompt, _ = self.renderer.prompt(
                req["messages"], req.get("tools"), req.get("chat_template_kwargs")
            )
            completion = self._completion(prompt, str(req.get("model")))
            out, _ = ChatAnswer(self._chat_parser(req), 0).convert(completion)
        else:
            return FakeResponse(404, JSON_HEADERS, [b'{"error": {"message": "not found"}}'])
        self.prompts.append(prompt)
        if req.get("stream") is True:
            events = self._stream(prompt, str(req.get("model")), path, req)
            return FakeResponse(200, {"Content-Type": "text/event-stream"}, events)
        return FakeResponse(200, JSON_HEADERS, [orjson.dumps(out)])

    def _stream(self, prompt: list[int], model: str, path: str, req: dict[str, Any]) -> list[bytes]:
        """One completions chunk per token (text decoded incrementally, as vLLM does);
        chat chunks converted from them for the chat endpoint."""
        whole = self._completion(prompt, model)["choices"][0]
        ids = whole["token_ids"]
        chunks: list[dict[str, Any]] = []
        emitted = ""
        body_ids = ids[:-1] if whole["finish_reason"] == "stop" else ids
        for i, token in enumerate(ids):
            text = self.renderer.tokenizer.decode(body_ids[: i + 1], skip_special_tokens=True)
            piece = "" if text.endswith("\ufffd") else text[len(emitted) :]
            emitted += piece
            last = i == len(ids) - 1
            logprobs = completion_logprobs(
                [f"token_id:{token}"],
                [_logprob(i)],
                [{f"token_id:{token}": _logprob(i)}],
                [0],
            )
            finish = whole["finish_reason"] if last else None
            first_prompt = prompt if i == 0 else None
            choice = completion_choice(0, piece, logprobs, finish, [token], first_prompt)
            chunks.append(completion_chunk(COMPLETION_ID, model, choice))
        if path == "/v1/chat/completions":
            stream = ChatStream(self._chat_parser(req), 0)
            chunks = [c for chunk in chunks for c in stream.convert(chunk)]
        return [*(sse_event(c) for c in chunks), SSE_DONE]

    def _chat_parser(self, req: dict[str, Any]) -> Any:
        if req.get("tools"):
            return self.parsers.build()
        return ParserSpec(
            reasoning=self.parsers.reasoning, starts_in_reasoning=self.parsers.starts_in_reasoning
        ).build()

    async def aclose(self) -> None:
        return None


# -- measuring ---------------------------------------------------------------------------
@dataclass
class ModeDrift:
    mode: str
    turns: int = 0
    transitions: int = 0  # turns after the first of a conversation
    true_breaks: int = 0  # prompts that do not extend the previous prompt + completion
    breaks: dict[str, int] = field(default_factory=dict)  # samples starting at a break
    mismatched_tokens: int = 0  # sample tokens that differ from what the backend saw/sampled
    merged_through: int = 0  # samples spliced across a mismatch (must be 0)
    refused: str | None = None  # TITO: why the template was refused

    @property
    def drift_rate(self) -> float | None:
        return None if not self.transitions else self.true_breaks / self.transitions


@dataclass
class TemplateDrift:
    template: str
    record: ModeDrift
    tito: ModeDrift


def _harness_message(message: dict[str, Any]) -> dict[str, Any]:
    """What a typical harness sends back: content and tool calls, reasoning dropped."""
    out: dict[str, Any] = {"role": "assistant", "content": message.get("content") or ""}
    if message.get("tool_calls"):
        out["tool_calls"] = [
            {"id": c["id"], "type": "function", "function": c["function"]}
            for c in message["tool_calls"]
        ]
    return out


async def _drive(app: Any, sim: SimulatedModel, convs: list[Conversation]) -> list[list[int]]:
    """Run the conversations through the proxy; the backend's prompt count per turn."""
    proxy = app.state.proxy
    for n, conv in enumerate(convs):
        rollout = f"{conv.name}-{n}"
        messages = list(conv.start)
        for i, step in enumerate(conv.steps):
            sim.sample(messages, step.assistant, step.perturb, TOOLS, step.then)
            raw = orjson.dumps(
                {
                    "model": "simulated",
                    "messages": messages,
                    "tools": TOOLS,
                    "max_tokens": 512,
                    "stream": i % 2 == 1,
                }
            )
            relay = await proxy.complete(CHAT, raw, rollout_id=rollout)
            message = await _message_of(relay)
            messages = [*messages, _harness_message(message), *step.then]
        proxy.registry.finish(rollout)
    return sim.prompts


async def _message_of(relay: Any) -> dict[str, Any]:
    if isinstance(relay, Relay):
        return dict(orjson.loads(relay.body)["choices"][0]["message"])
    content: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    async for piece in relay.chunks:
        for line in piece.split(b"\n"):
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = orjson.loads(line[6:])
            for choice in chunk.get("choices") or ():
                delta = choice.get("delta") or {}
                content.append(delta.get("content") or "")
                for call in delta.get("tool_calls") or ():
                    slot = calls.setdefault(
                        call["index"],
                        {"id": None, "type": "function", "function": {"name": "", "arguments": ""}},
                    )
                    slot["id"] = call.get("id") or slot["id"]
                    fn = call.get("function") or {}
                    slot["function"]["name"] += fn.get("name") or ""
                    slot["function"]["arguments"] += fn.get("arguments") or ""
    return {"content": "".join(content) or None, "tool_calls": [calls[k] for k in sorted(calls)]}


def _score(result: ModeDrift, out: Path) -> None:
    from turnstile.reader import open_output

    reader = open_output(out)
    turns = reader.turns().to_pylist()
    samples = reader.samples().to_pylist()
    by_rollout: dict[str, list[dict[str, Any]]] = {}
    for turn in sorted(turns, key=lambda t: t["turn_index"]):
        by_rollout.setdefault(turn["rollout_id"], []).append(turn)
    for rollout_turns in by_rollout.values():
        result.turns += len(rollout_turns)
        for prev, turn in itertools.pairwise(rollout_turns):
            result.transitions += 1
            context = prev["prompt_token_ids"] + prev["completion_token_ids"]
            if turn["prompt_token_ids"][: len(context)] != context:
                result.true_breaks += 1
    for sample in samples:
        if sample["break_kind"] != "first":
            result.breaks[sample["break_kind"]] = result.breaks.get(sample["break_kind"], 0) + 1
        ids = np.asarray(sample["input_ids"])
        for span in sample["turn_spans"]:
            turn = by_rollout[sample["rollout_id"]][span["turn_index"]]
            seen = np.asarray(turn["prompt_token_ids"] + turn["completion_token_ids"])
            got = ids[: span["completion_end"]]
            n = min(len(seen), len(got))
            bad = int(np.count_nonzero(seen[:n] != got[:n])) + abs(len(seen) - len(got))
            result.mismatched_tokens += bad
            result.merged_through += int(bad > 0)


def _settings(out: Path, tokenizer_dir: Path, template: Path, mode: str) -> Any:
    from turnstile.dev.template_corpus import TEMPLATE_KWARGS
    from turnstile.settings import load_settings

    return load_settings(
        None,
        {
            "output": out,
            "tokenizer": tokenizer_dir,
            "mode": mode,
            "chat_template": template,
            "chat_template_kwargs": TEMPLATE_KWARGS.get(template.name, {}),
        },
        environ={},
    )


def _kwargs(template: Path) -> dict[str, Any]:
    from turnstile.dev.template_corpus import TEMPLATE_KWARGS

    return dict(TEMPLATE_KWARGS.get(template.name, {}))


async def _run_mode(
    mode: str, tokenizer_dir: Path, template: Path, hf: Any, convs: list[Conversation], root: Path
) -> ModeDrift:
    from turnstile.server.app import create_app
    from turnstile.settings import SettingsError

    result = ModeDrift(mode)
    text = template.read_text(encoding="utf-8")  # noqa: ASYNC240 - once, before serving
    renderer = TemplateRenderer(hf, text, _kwargs(template))
    sim = SimulatedModel(renderer, parser_for_template(text))
    out = root / mode
    try:
        app = create_app(_settings(out, tokenizer_dir, template, mode), backend=sim)
    except SettingsError as exc:
        result.refused = str(exc)
        return result
    if mode == "tito":  # the simulated model samples the format of the template TITO uses
        sim.renderer = TemplateRenderer(
            hf, app.state.tito.renderer.template, app.state.tito.renderer.default_kwargs
        )
    async with app.router.lifespan_context(app):
        await _drive(app, sim, convs)
    _score(result, out)
    return result


def measure(
    template: Path, tokenizer_dir: Path, convs: list[Conversation] | None = None
) -> TemplateDrift:
    """Record and TITO mode over the corpus for one template and its vocabulary."""
    from turnstile.dev.vocab import load_tokenizer

    hf = load_tokenizer(tokenizer_dir)
    convs = convs or _renderable(conversations(), hf, template)
    with tempfile.TemporaryDirectory(prefix="turnstile-drift-") as tmp:
        record = asyncio.run(_run_mode("record", tokenizer_dir, template, hf, convs, Path(tmp)))
        tito = asyncio.run(_run_mode("tito", tokenizer_dir, template, hf, convs, Path(tmp)))
    return TemplateDrift(template.stem, record, tito)


def _renderable(convs: list[Conversation], hf: Any, template: Path) -> list[Conversation]:
    """The conversations this template can render (some reject system or tool roles) and
    the simulated model can sample (every assistant turn ends with a stop token)."""
    text = template.read_text(encoding="utf-8")
    renderer = TemplateRenderer(hf, text, _kwargs(template))
    sim = SimulatedModel(renderer, parser_for_template(text))
    keep = []
    for conv in convs:
        messages = list(conv.start)
        try:
            for step in conv.steps:
                renderer.render([*messages, step.assistant], TOOLS, None, False)
                sim.sample(messages, step.assistant, step.perturb, TOOLS, step.then)
                messages = [*messages, step.assistant, *step.then]
            renderer.render(messages, TOOLS, None, True)
        except Exception:
            continue
        keep.append(conv)
    return keep


def markdown(rows: list[TemplateDrift]) -> str:
    """The table of docs/tito.md: drift in record mode versus TITO mode."""
    lines = [
        "| template | turns | record: breaks (detected, by kind) | record drift | "
        "TITO: breaks | TITO mismatched tokens |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        r, t = row.record, row.tito
        kinds = ", ".join(f"{k} {v}" for k, v in sorted(r.breaks.items())) or "none"
        rate = "—" if r.drift_rate is None else f"{r.drift_rate:.0%}"
        if (r.refused or "").startswith(CANNOT_RUN):
            lines.append(f"| {row.template} | — | not run: {r.refused} | — | — | — |")
            continue
        tito = "refused" if t.refused else f"{t.true_breaks} of {t.transitions}"
        mism = "—" if t.refused else str(t.mismatched_tokens)
        lines.append(
            f"| {row.template} | {r.turns} | {r.true_breaks} of {r.transitions} "
            f"({kinds}) | {rate} | {tito} | {mism} |"
        )
    return "\n".join(lines) + "\n"


def corpus(
    log: Callable[[str], None] = print, templates: list[str] | None = None
) -> list[TemplateDrift]:
    """`measure` over every vendored template (or the named ones), each with the
    vocabulary the template audit pairs it with (`turnstile.dev.template_corpus.pairing`:
    its own, one of its family, or a text-level one)."""
    from turnstile.dev.llama_cpp_assets import ensure_llama_cpp_assets
    from turnstile.dev.template_corpus import pairing
    from turnstile.dev.vocab import ensure_vocab_tokenizer

    assets = ensure_llama_cpp_assets(log=lambda _: None)
    names = templates or sorted(path.name for path in (assets / "templates").glob("*.jinja"))
    rows = []
    for name in names:
        spec, _level, _why = pairing(name, assets)
        tokenizer_dir = ensure_vocab_tokenizer(spec, log=lambda _: None)
        try:
            row = measure(assets / "templates" / name, tokenizer_dir)
        except RenderError as exc:  # the harness's messages are not what the template takes
            why = f"{CANNOT_RUN}: {exc}"
            row = TemplateDrift(
                Path(name).stem, ModeDrift("record", refused=why), ModeDrift("tito", refused=why)
            )
        log(
            f"{name}: record {row.record.true_breaks}/{row.record.transitions} breaks; "
            f"TITO {'refused' if row.tito.refused else row.tito.true_breaks} "
            f"({row.tito.mismatched_tokens} mismatched tokens)"
        )
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m turnstile.dev.drift", description=__doc__.split("\n\n")[0]
    )
    parser.parse_args(argv)
    print(markdown(corpus()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
