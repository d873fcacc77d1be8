"""TITO mode's request path: chat request in, token-ID completion out, chat answer back.

`TitoEngine.request` stands where a chat request would go to the backend. It matches the
request against the rollout's token states (`history.match`), builds the prompt as token
IDs (previous prompt + sampled completion + end-of-turn + delta, or a whole rendering for
the first turn and for a new segment), sends it to `/v1/completions`, and returns a
`BackendResponse` whose body is the chat answer (`convert`), so the proxy records and
relays it exactly as a backend's chat answer. The state advances only when the answer is
complete (the whole body read, or the stream's `[DONE]` reached): a turn the harness never
received leaves nothing to extend.

Each turn also says whether its context was *deployment-faithful*
(`context_faithful`, recorded in the turns table's `tito_context_faithful`): whether the
prompt equals what the template renders for the same messages. A first turn or new segment
is; an extension is when the previous prompt was, the template renders the returned
assistant message as the tokens the model sampled, and the history renders as before.
A template that drops earlier `<think>` blocks, or a model that samples compact JSON the
template re-serialises, makes it false: TITO's context is still exactly what the model
consumed and sampled.

A turn whose conversation holds images goes to vLLM's token-in route instead, with every
image of the conversation (`turnstile.tito.generate`): the state keeps one unexpanded
placeholder per image, and the prompt recorded is the one vLLM expands them into.

A history rewrite follows the configured policy: `split` renders the whole conversation as
a new segment (stitching then starts a new sample whose `parent_sample_index` links the
earlier one, classified `history_rewritten`); `refuse` answers 409 with where the messages
part from the rollout's history. Counts of each outcome are in `stats()` (`GET /stats`).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import msgspec
import numpy as np
import orjson

from turnstile.backends.protocol import Backend, BackendResponse
from turnstile.errors import BackendError, Conflict, Unprocessable
from turnstile.proxy.sse import DONE, SSEParser, encode_data
from turnstile.tito.convert import (
    ChatAnswer,
    ChatStream,
    completions_body,
    decode_completion,
    echo_needed,
)
from turnstile.tito.generate import (
    GENERATE_PATH,
    ROUTE_MISSING,
    ROUTE_MISSING_STATUSES,
    as_completion,
    generate_body,
    image_urls,
)
from turnstile.tito.history import TurnState, canonical, match
from turnstile.tito.parsers import ParserSpec, get_parser, prompt_ends_in_reasoning
from turnstile.tito.parsers.registry import PLAIN, reasoning_markers
from turnstile.tito.render import RenderError, TemplateRenderer

__all__ = ["RewritePolicy", "TitoEngine"]

log = logging.getLogger("turnstile.tito")

RewritePolicy = Literal["split", "refuse"]
COMPLETIONS_PATH = "/v1/completions"
_JSON = "application/json"
# Token states kept per rollout: enough for branches and subagents sharing a rollout,
# bounded so a rollout that never repeats itself cannot grow without end.
MAX_STATES_PER_ROLLOUT = 32
# Rollouts whose states are kept; the oldest are forgotten first (a sealed rollout's are
# dropped at once). Bounds memory if rollouts are never finished.
MAX_ROLLOUT_STATES = 65536


@dataclass(slots=True)
class TitoStats:
    turns: int = 0
    first: int = 0
    extended: int = 0
    repeated: int = 0
    split: int = 0
    refused: int = 0
    history_rerendered: int = 0  # extended, but the template re-renders the history
    unfaithful: int = 0  # turns whose context differs from the template's rendering
    image_turns: int = 0  # turns sent with their images to the token-in route
    # extensions whose image placeholders no longer match the images (a sampled
    # placeholder token): rendered whole as a new segment instead
    placeholder_split: int = 0

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in self.__slots__}


class TitoEngine:
    """Per-rollout token state and the token-ID request path of TITO mode."""

    def __init__(
        self,
        backend: Backend,
        renderer: TemplateRenderer,
        parsers: ParserSpec,
        on_rewrite: RewritePolicy = "split",
        image_token_id: int | None = None,
    ) -> None:
        self.backend = backend
        self.renderer = renderer
        self.parsers = parsers
        self.on_rewrite = on_rewrite
        # the placeholder token the template renders once per image (None: not checked)
        self.image_token_id = image_token_id
        self._states: OrderedDict[str, list[TurnState]] = OrderedDict()
        self.counts = TitoStats()
        self.template_info: dict[str, Any] = {}

    # -- state ---------------------------------------------------------------------
    def forget(self, rollout_id: str) -> None:
        self._states.pop(rollout_id, None)

    def states(self, rollout_id: str) -> list[TurnState]:
        return list(self._states.get(rollout_id, ()))

    def _commit(self, rollout_id: str, state: TurnState) -> None:
        states = self._states.setdefault(rollout_id, [])
        self._states.move_to_end(rollout_id)
        states.append(state)
        del states[:-MAX_STATES_PER_ROLLOUT]
        while len(self._states) > MAX_ROLLOUT_STATES:
            self._states.popitem(last=False)

    def stats(self) -> dict[str, Any]:
        return {
            "mode": "tito",
            "on_rewrite": self.on_rewrite,
            **self.counts.as_dict(),
            "open_rollouts": len(self._states),
            "template": self.template_info,
        }

    # -- the prompt ----------------------------------------------------------------
    def _placeholders(self, prompt: list[int]) -> int | None:
        """How many image placeholders `prompt` holds (None: the token is not known)."""
        token = self.image_token_id
        return None if token is None else prompt.count(token)

    def _prompt(
        self, rollout_id: str, body: Mapping[str, Any], n_images: int = 0
    ) -> tuple[list[int], str, bool]:
        """Token IDs for this turn's prompt, the text its end renders to, and whether the
        prompt is what the template renders for the messages. A conversation with
        `n_images` images has one unexpanded placeholder per image."""
        messages = list(body["messages"])
        tools, kwargs = body.get("tools"), body.get("chat_template_kwargs")
        if kwargs is not None and not isinstance(kwargs, dict):
            raise Unprocessable(
                "'chat_template_kwargs' must be an object", param="chat_template_kwargs"
            )
        found = match(
            self._states.get(rollout_id, ()), messages, canonical(tools), canonical(kwargs)
        )
        self.counts.turns += 1
        state = found.state
        if found.kind == "extend" and state is not None:
            n = len(state.messages)
            try:
                delta = self.renderer.delta(messages[: n + 1], messages, tools, kwargs)
            except RenderError as exc:
                log.warning(
                    "rollout %s: no token delta (%s); starting a new segment", rollout_id, exc
                )
            else:
                completion = [int(t) for t in state.completion_ids]
                if delta.end_of_turn_id is not None and (
                    not completion or completion[-1] not in self.renderer.stops
                ):
                    completion.append(delta.end_of_turn_id)  # sampling stopped early
                prompt = [int(t) for t in state.prompt_ids] + completion + delta.ids
                found_images = self._placeholders(prompt) if n_images else None
                if found_images is not None and found_images != n_images:
                    # The model sampled a placeholder token (or the delta holds one the
                    # template did not render for an image): the backend would give an
                    # image to the wrong place, so the conversation is rendered whole.
                    self.counts.placeholder_split += 1
                    log.warning(
                        "rollout %s: the extended prompt holds %d image placeholders for "
                        "%d images; starting a new segment",
                        rollout_id,
                        found_images,
                        n_images,
                    )
                else:
                    self.counts.extended += 1
                    self.counts.history_rerendered += not delta.history_preserved
                    faithful = (
                        state.prompt_faithful
                        and delta.history_preserved
                        and self.renderer.encode(delta.turn_text) == completion
                    )
                    self.counts.unfaithful += not faithful
                    return prompt, delta.text, faithful
        elif found.kind == "repeat" and state is not None:
            self.counts.repeated += 1
            self.counts.unfaithful += not state.prompt_faithful
            return (
                [int(t) for t in state.prompt_ids],
                self.renderer.decode(state.prompt_ids[-_TAIL_TOKENS:].tolist()),
                state.prompt_faithful,
            )
        elif found.kind == "first":
            self.counts.first += 1
        else:
            if self.on_rewrite == "refuse":
                self.counts.refused += 1
                raise Conflict(
                    f"rollout {rollout_id}: the request rewrites the rollout's history "
                    f"({found.detail}); TITO mode is set to refuse rewrites "
                    "(tito_on_rewrite: split starts a new sample segment instead)"
                )
            self.counts.split += 1
            log.info("rollout %s: history rewritten (%s); new segment", rollout_id, found.detail)
        try:
            ids, text = self.renderer.prompt(messages, tools, kwargs)
        except RenderError as exc:
            raise Unprocessable(str(exc), param="messages") from None
        found_images = self._placeholders(ids) if n_images else None
        if found_images is not None and found_images != n_images:
            raise Unprocessable(
                f"the chat template renders {found_images} image placeholders (token id "
                f"{self.image_token_id}) for the {n_images} images of the messages: TITO "
                "cannot tell the backend where each image goes (a text-only template, or "
                "a message that holds the placeholder token as text)",
                param="messages",
            )
        return ids, text, True

    def _parser_for(self, body: Mapping[str, Any], prompt_text: str) -> Any:
        spec = self.parsers
        tool = PLAIN if body.get("tool_choice") == "none" or not body.get("tools") else spec.tool
        starts = None
        if spec.reasoning is not None:
            starts = prompt_ends_in_reasoning(prompt_text, *reasoning_markers(spec.reasoning))
        return get_parser(tool, reasoning=spec.reasoning, starts_in_reasoning=starts)

    # -- the call --------------------------------------------------------------------
    async def request(self, rollout_id: str, body: dict[str, Any]) -> BackendResponse:
        """Send the chat request `body` (with the recording fields) as token IDs; with
        its images, where the conversation has any (`turnstile.tito.generate`)."""
        images = image_urls(body["messages"])
        prompt, prompt_text, faithful = self._prompt(rollout_id, body, len(images))
        forward = completions_body(body, prompt)
        top = body.get("top_logprobs")
        top_k = top if isinstance(top, int) and not isinstance(top, bool) else 0
        parser = self._parser_for(body, prompt_text)
        path, reshape = COMPLETIONS_PATH, _as_is
        if images:
            self.counts.image_turns += 1
            forward = generate_body(body, prompt, images, top_k)
            path, reshape = GENERATE_PATH, as_completion
        resp = await self.backend.request(
            "POST", path, orjson.dumps(forward), {"Content-Type": _JSON}
        )
        if resp.status >= 400:
            if images and resp.status in ROUTE_MISSING_STATUSES:
                try:
                    detail = (await resp.read())[:_DETAIL_BYTES]
                finally:
                    resp.close()
                log.warning("%s answered %d: %r", GENERATE_PATH, resp.status, detail)
                raise Unprocessable(ROUTE_MISSING.format(status=resp.status), param="messages")
            return resp
        # The token-in route expands the images' placeholders: the prompt recorded is the
        # one it answers with, while the state keeps the prompt as sent.
        known = None if images or echo_needed(forward) else prompt
        turn = _Turn(self, rollout_id, body, prompt, known, faithful, reshape, bool(images))
        if forward.get("stream") is True:
            return _StreamAnswer(resp, turn, ChatStream(parser, top_k, known_prompt=known))
        return _WholeAnswer(resp, turn, ChatAnswer(parser, top_k))


# Tokens decoded to learn whether a repeated prompt ends inside a reasoning block.
_TAIL_TOKENS = 16
# Bytes of a refusing backend's answer kept for the log.
_DETAIL_BYTES = 512


def _as_is(obj: Any) -> Any:
    return obj


@dataclass(slots=True)
class _Turn:
    engine: TitoEngine
    rollout_id: str
    body: Mapping[str, Any]
    prompt: list[int]
    known_prompt: list[int] | None  # `prompt`, unless the backend may have cut it
    faithful: bool  # the prompt is what the template renders for the messages
    reshape: Callable[[Any], Any]  # the backend's answer in the completions shape
    # the backend expands image placeholders: the state keeps `prompt` as sent
    expands: bool = False

    def decode(self, raw: bytes) -> Any:
        """A completions answer or chunk; the echo of the prompt ids is skipped unread
        where the prompt is known (else decoded whole)."""
        if self.known_prompt is not None:
            try:
                return decode_completion(raw)
            except msgspec.DecodeError:
                pass  # not the expected shape: orjson below says what is wrong
        return self.reshape(orjson.loads(raw))

    def commit(
        self, reply: dict[str, Any], prompt_ids: Any, completion_ids: Any, finish: str | None
    ) -> None:
        usable = isinstance(prompt_ids, list) and not self.expands
        prompt = prompt_ids if usable else self.prompt
        self.engine._commit(
            self.rollout_id,
            TurnState(
                messages=tuple(self.body["messages"]),
                reply=reply,
                tools_key=canonical(self.body.get("tools")),
                kwargs_key=canonical(self.body.get("chat_template_kwargs")),
                prompt_ids=np.asarray(prompt, dtype=np.int32),
                completion_ids=np.asarray(completion_ids or (), dtype=np.int32),
                finish_reason=finish,
                prompt_faithful=self.faithful,
            ),
        )


class _WholeAnswer:
    """The chat answer to a whole completions response."""

    def __init__(self, resp: BackendResponse, turn: _Turn, answer: ChatAnswer) -> None:
        self._resp, self._turn, self._answer = resp, turn, answer
        self.status = resp.status
        self.served_by = resp.served_by
        self.failover_from = resp.failover_from
        self.context_faithful: bool | None = turn.faithful
        self.headers: Mapping[str, str] = {"Content-Type": _JSON}

    async def read(self) -> bytes:
        raw = await self._resp.read()
        try:
            obj = self._turn.decode(raw)
            chat, parsed = self._answer.convert(obj, self._turn.known_prompt)
        except (orjson.JSONDecodeError, ValueError, TypeError, AttributeError) as exc:
            raise BackendError(f"the backend's completions response is unusable: {exc}") from exc
        choice = chat["choices"][0]
        self._turn.commit(
            parsed.to_openai(),
            chat.get("prompt_token_ids"),
            choice.get("token_ids"),
            choice.get("finish_reason"),
        )
        return orjson.dumps(chat)

    def iter_chunks(self) -> AsyncIterator[bytes]:
        return self._once()

    async def _once(self) -> AsyncIterator[bytes]:
        yield await self.read()

    def close(self) -> None:
        self._resp.close()


class _StreamAnswer:
    """Chat stream chunks from a completions stream; the state advances at `[DONE]`."""

    def __init__(self, resp: BackendResponse, turn: _Turn, stream: ChatStream) -> None:
        self._resp, self._turn, self._stream = resp, turn, stream
        self.status = resp.status
        self.served_by = resp.served_by
        self.failover_from = resp.failover_from
        self.context_faithful: bool | None = turn.faithful
        self.headers: Mapping[str, str] = {"Content-Type": "text/event-stream"}

    async def read(self) -> bytes:
        return b"".join([piece async for piece in self.iter_chunks()])

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        parser = SSEParser()
        async for chunk in self._resp.iter_chunks():
            for event in parser.feed(chunk):
                out = self._event(event.data)
                if out:
                    yield out
        for event in parser.finish():
            out = self._event(event.data)
            if out:
                yield out

    def _event(self, data: bytes | None) -> bytes:
        if data is None:
            return b""
        if data.strip() == DONE:
            stream = self._stream
            if stream.finish is not None:
                self._turn.commit(
                    stream.message().to_openai(), stream.prompt_ids, stream.token_ids, stream.finish
                )
            return encode_data(DONE)
        try:
            obj = self._turn.decode(data)
        except orjson.JSONDecodeError as exc:
            raise BackendError(f"the backend sent a chunk that is not JSON: {exc}") from exc
        if not isinstance(obj, dict):
            raise BackendError("the backend sent a chunk that is not a JSON object")
        if "error" in obj and "choices" not in obj:
            return encode_data(data)  # an error event: relayed as the backend sent it
        return b"".join(encode_data(orjson.dumps(c)) for c in self._stream.convert(obj))

    def close(self) -> None:
        self._resp.close()
