"""What Turnstile adds to a backend request and takes from its response.

`plan_request` decides which recording fields to inject (`return_token_ids`, `logprobs`,
`top_logprobs`) given what the client itself asked for, and remembers it in a
`CapturePlan`. `ChoiceCapture` accumulates one choice's recorded fields from a whole
response or from stream chunks. `CapturePlan.strip_*` removes what the client did not
ask for, so that the harness sees the response shape the backend would have given it.

The response shapes are vLLM's (0.32): chat choices carry `token_ids` and
`logprobs.content[{token, logprob, top_logprobs}]`, the chat response carries
`prompt_token_ids` at the top level; completions choices carry both `prompt_token_ids`
and `token_ids`, and `logprobs.{tokens, token_logprobs, top_logprobs}`.
"""

from __future__ import annotations

import array
from dataclasses import dataclass, field
from typing import Any, NoReturn

import numpy as np

from turnstile.errors import BackendValueError, Unprocessable
from turnstile.limits import MAX_CHOICE_INDEX, MAX_TOKEN_ID
from turnstile.proxy.tokens import AnswerTokens, ScannedChunk, logprob_value, top_token_id
from turnstile.records import Float32Array, Int32Array

CHAT = "chat.completions"
COMPLETIONS = "completions"

# Sampling fields copied into the record (the rest of the request is kept as messages).
SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "max_tokens",
    "max_completion_tokens",
    "n",
    "seed",
    "stop",
    "stop_token_ids",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "response_format",
    "tool_choice",
    "parallel_tool_calls",
    "ignore_eos",
    "min_tokens",
    "skip_special_tokens",
    "include_stop_str_in_output",
    "chat_template_kwargs",
    "reasoning_effort",
)

# The array type code of a C unsigned 32-bit int (``I`` where it is 4 bytes, as on every
# platform Turnstile runs on; ``L`` otherwise).
_UINT32 = "I" if array.array("I").itemsize == 4 else "L"
# Up to this many ids are checked one by one; longer lists (whole answers, prompts) with
# numpy, which costs a few microseconds to start but little per id.
_SMALL_ID_LIST = 16


@dataclass(slots=True)
class CapturePlan:
    """What was injected into one request, so the response can be put back."""

    endpoint: str
    stream: bool
    client_token_ids: bool  # the client asked for return_token_ids itself
    client_logprobs: bool  # the client asked for logprobs itself
    tokens_as_ids: bool  # top-k tokens come back as "token_id:N"
    echo: bool = False

    @property
    def needs_strip(self) -> bool:
        return not (self.client_token_ids and self.client_logprobs)

    def strip(self, obj: dict[str, Any]) -> None:
        """Undo the injected fields in a response or a stream chunk, in place.

        vLLM writes the fields it was not asked for as `null` (whole responses and
        stream chunks alike), so injected fields are reset to `null` where present.
        """
        if not self.client_token_ids and obj.get("prompt_token_ids") is not None:
            obj["prompt_token_ids"] = None
        for choice in obj.get("choices") or ():
            if not isinstance(choice, dict):
                continue
            if not self.client_token_ids:
                if choice.get("token_ids") is not None:
                    choice["token_ids"] = None
                if choice.get("prompt_token_ids") is not None:
                    choice["prompt_token_ids"] = None
            if not self.client_logprobs and choice.get("logprobs") is not None:
                choice["logprobs"] = None

    def carries_nothing(self, chunk: dict[str, Any]) -> bool:
        """After `strip`: a chunk vLLM only sent for the injected fields.

        vLLM emits a chunk with an empty delta for tokens that decode to no text yet
        (a partial UTF-8 sequence) only when token IDs or logprobs were asked for; a
        client that did not ask for them would not have received it.
        """
        choices = chunk.get("choices")
        if not choices or chunk.get("usage") is not None:
            return False
        for choice in choices:
            if not isinstance(choice, dict) or choice.get("finish_reason") is not None:
                return False
            if choice.get("delta") or choice.get("logprobs") is not None:
                return False
            if choice.get("token_ids") is not None or choice.get("text"):
                return False
        return True


def plan_request(endpoint: str, body: dict[str, Any], top_logprobs: int) -> CapturePlan:
    """Inject the recording fields into `body` (in place) and return the plan."""
    stream = body.get("stream") is True
    client_ids = body.get("return_token_ids") is True
    body["return_token_ids"] = True
    if endpoint == CHAT:
        client_lp = body.get("logprobs") is True
        tokens_as_ids = False
        if not client_lp:
            body["logprobs"] = True
            if top_logprobs > 0:
                body["top_logprobs"] = top_logprobs
                body["return_tokens_as_token_ids"] = True
                tokens_as_ids = True
            else:
                body.pop("top_logprobs", None)
        else:
            tokens_as_ids = body.get("return_tokens_as_token_ids") is True
        return CapturePlan(CHAT, stream, client_ids, client_lp, tokens_as_ids)
    logprobs = body.get("logprobs")
    client_lp = isinstance(logprobs, int) and not isinstance(logprobs, bool)
    tokens_as_ids = False
    if not client_lp:
        body["logprobs"] = top_logprobs
        if top_logprobs > 0:
            body["return_tokens_as_token_ids"] = True
            tokens_as_ids = True
    else:
        tokens_as_ids = body.get("return_tokens_as_token_ids") is True
    echo = body.get("echo") is True
    return CapturePlan(COMPLETIONS, stream, client_ids, client_lp, tokens_as_ids, echo)


def sampling_params(body: dict[str, Any]) -> dict[str, Any]:
    """The effective sampling fields of a request (as sent to the backend)."""
    return {k: body[k] for k in SAMPLING_FIELDS if k in body}


def validate_request(endpoint: str, body: Any) -> dict[str, Any]:
    """Reject requests Turnstile cannot record; everything else is the backend's call."""
    if not isinstance(body, dict):
        raise Unprocessable("the request body must be a JSON object")
    if endpoint == CHAT:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise Unprocessable("'messages' must be a non-empty array", param="messages")
        if not all(isinstance(m, dict) for m in messages):
            raise Unprocessable("every message must be an object", param="messages")
    elif "prompt" not in body:
        raise Unprocessable("'prompt' is required", param="prompt")
    n = body.get("n", 1)
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise Unprocessable("'n' must be an integer >= 1", param="n")
    if "stream" in body and not isinstance(body["stream"], bool):
        raise Unprocessable("'stream' must be a boolean", param="stream")
    return body


def checked_ids(ids: Any, what: str) -> list[int]:
    """``ids`` when it is a list of token ids within int32 and not negative; else the
    backend's answer cannot be recorded (`BackendValueError`, a 502).

    On the hot path: a stream's one id per event is checked in a plain loop; a whole
    answer's hundreds of ids are packed into a C array of unsigned 32-bit ints, which
    refuses anything but integers in 0..2**32-1, and one numpy pass finds any above int32.
    """
    if not isinstance(ids, list):
        raise BackendValueError(f"the backend sent {what} that are not a list")
    if len(ids) <= _SMALL_ID_LIST:
        for value in ids:
            if type(value) is not int or not 0 <= value <= MAX_TOKEN_ID:
                _refuse_ids(ids, what)
        return ids
    try:
        packed = array.array(_UINT32, ids)
    except (TypeError, OverflowError):
        _refuse_ids(ids, what)
    if np.frombuffer(packed, dtype=np.int32).min() < 0:  # at least one id above int32
        _refuse_ids(ids, what)
    return ids


def _refuse_ids(ids: list[Any], what: str) -> NoReturn:
    """Raise naming the first id of ``ids`` that is not an int32 token id."""
    for value in ids:
        if type(value) is not int:
            raise BackendValueError(
                f"the backend sent {what} with a non-integer value {value!r:.40}"
            )
        if not 0 <= value <= MAX_TOKEN_ID:
            raise BackendValueError(
                f"the backend sent {what} with token id {value}: outside 0..{MAX_TOKEN_ID}"
            )
    raise AssertionError("no bad id found")  # pragma: no cover - callers found one


def _choice_index(index: Any) -> int:
    if index is None:
        return 0
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index <= MAX_CHOICE_INDEX:
        raise BackendValueError(
            f"the backend sent choice index {index!r:.40}: not an integer in 0..{MAX_CHOICE_INDEX}"
        )
    return index


@dataclass(slots=True)
class ChoiceCapture:
    """One choice's recorded fields, filled from a response or from stream chunks."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_ids: list[list[int]] | None = None
    top_values: list[list[float]] | None = None
    prompt_token_ids: list[int] | Int32Array | None = None
    finish_reason: str | None = None
    # as the backend said it: vLLM gives a stop_token_ids token's id as a number and a
    # stop string as text (the `stop_reason` column records its text; an assembled answer
    # gives it back as it was)
    stop_reason: int | str | None = None
    content: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    tool_calls: dict[int, dict[str, Any]] = field(default_factory=dict)
    role: str = "assistant"
    saw_token_ids: bool = False
    # A whole answer's arrays (`ResponseCapture.add_answer`); streams fill the lists above.
    id_array: Int32Array | None = None
    logprob_array: Float32Array | None = None

    # -- chat --------------------------------------------------------------------
    def add_chat_logprobs(self, logprobs: Any, tokens_as_ids: bool) -> None:
        if not isinstance(logprobs, dict):
            return
        for entry in logprobs.get("content") or ():
            if not isinstance(entry, dict):
                continue
            self.logprobs.append(logprob_value(entry.get("logprob")))
            tops = entry.get("top_logprobs")
            if tokens_as_ids and isinstance(tops, list) and tops:
                if self.top_ids is None or self.top_values is None:
                    self.top_ids, self.top_values = [], []
                ids, values = [], []
                for top in tops:
                    tid = top_token_id(top.get("token")) if isinstance(top, dict) else None
                    if tid is not None:
                        ids.append(tid)
                        values.append(logprob_value(top.get("logprob")))
                self.top_ids.append(ids)
                self.top_values.append(values)

    def add_chat_message(self, message: Any, delta: bool) -> None:
        if not isinstance(message, dict):
            return
        if isinstance(message.get("role"), str):
            self.role = message["role"]
        if isinstance(message.get("content"), str):
            self.content.append(message["content"])
        reasoning = message.get("reasoning") or message.get("reasoning_content")
        if isinstance(reasoning, str):
            self.reasoning.append(reasoning)
        for pos, call in enumerate(message.get("tool_calls") or ()):
            if not isinstance(call, dict):
                continue
            idx = call.get("index", pos) if delta else pos
            slot = self.tool_calls.setdefault(
                idx if isinstance(idx, int) else pos,
                {"id": None, "type": "function", "function": {"name": "", "arguments": ""}},
            )
            if call.get("id"):
                slot["id"] = call["id"]
            if call.get("type"):
                slot["type"] = call["type"]
            fn = call.get("function")
            if isinstance(fn, dict):
                if isinstance(fn.get("name"), str):
                    slot["function"]["name"] += fn["name"]
                if isinstance(fn.get("arguments"), str):
                    slot["function"]["arguments"] += fn["arguments"]

    # -- completions ------------------------------------------------------------------
    def add_completion_logprobs(self, logprobs: Any, tokens_as_ids: bool) -> None:
        if not isinstance(logprobs, dict):
            return
        values = logprobs.get("token_logprobs") or ()
        self.logprobs.extend(logprob_value(v) for v in values)
        tops = logprobs.get("top_logprobs")
        if tokens_as_ids and isinstance(tops, list):
            if self.top_ids is None or self.top_values is None:
                self.top_ids, self.top_values = [], []
            for top in tops:
                ids, vals = [], []
                if isinstance(top, dict):
                    for tok, lp in top.items():
                        tid = top_token_id(tok)
                        if tid is not None:
                            ids.append(tid)
                            vals.append(logprob_value(lp))
                self.top_ids.append(ids)
                self.top_values.append(vals)

    def set_stop_reason(self, value: Any) -> None:
        """A choice's `stop_reason`: a token id kept as the number it is, anything else
        as text."""
        is_id = isinstance(value, int) and not isinstance(value, bool)
        self.stop_reason = value if is_id else str(value)

    def add_common(self, choice: dict[str, Any]) -> None:
        ids = choice.get("token_ids")
        if ids is not None:
            self.token_ids.extend(checked_ids(ids, "token_ids"))
            self.saw_token_ids = True
        prompt_ids = choice.get("prompt_token_ids")
        if prompt_ids is not None:
            self.prompt_token_ids = checked_ids(prompt_ids, "prompt_token_ids")
        if choice.get("finish_reason") is not None:
            self.finish_reason = str(choice["finish_reason"])
        stop = choice.get("stop_reason")
        if stop is not None:
            self.set_stop_reason(stop)
        if isinstance(choice.get("text"), str):
            self.content.append(choice["text"])

    # -- results ------------------------------------------------------------------------
    def completion_arrays(self, echo: bool = False) -> tuple[Int32Array, Float32Array]:
        """Token IDs and one behaviour logprob per token (NaN where none was given)."""
        ids = self.id_array if self.id_array is not None else np.asarray(self.token_ids, np.int32)
        lps: list[float] | Float32Array = self.logprobs
        if self.logprob_array is not None:
            lps = self.logprob_array
        if echo and len(lps) > len(ids):
            lps = lps[len(lps) - len(ids) :]
        if len(lps) == len(ids):
            values = np.asarray(lps, dtype=np.float32)
        else:
            values = np.full(len(ids), np.nan, dtype=np.float32)
        return ids, values

    def top_k(self, n_tokens: int, echo: bool = False) -> tuple[Any, Any]:
        if self.top_ids is None or self.top_values is None:
            return None, None
        ids, values = self.top_ids, self.top_values
        if echo and len(ids) > n_tokens:
            ids, values = ids[len(ids) - n_tokens :], values[len(values) - n_tokens :]
        if len(ids) != n_tokens:
            return None, None
        return ids, values

    def message(self) -> dict[str, Any]:
        """The response message as the harness received it (chat)."""
        msg: dict[str, Any] = {"role": self.role, "content": "".join(self.content) or None}
        if self.reasoning:
            msg["reasoning"] = "".join(self.reasoning)
        if self.tool_calls:
            msg["tool_calls"] = [self.tool_calls[k] for k in sorted(self.tool_calls)]
        return msg

    def text(self) -> str:
        return "".join(self.content)


class ResponseCapture:
    """All choices of one backend call."""

    __slots__ = ("choices", "model", "plan", "prompt_token_ids", "usage")

    def __init__(self, plan: CapturePlan) -> None:
        self.plan = plan
        self.choices: dict[int, ChoiceCapture] = {}
        self.prompt_token_ids: list[int] | Int32Array | None = None
        self.model: str | None = None
        self.usage: dict[str, Any] | None = None

    def _choice(self, index: Any) -> ChoiceCapture:
        idx = _choice_index(index)
        cap = self.choices.get(idx)
        if cap is None:
            cap = self.choices[idx] = ChoiceCapture(idx)
        return cap

    def add(self, obj: dict[str, Any], *, chunk: bool) -> None:
        """Take the recorded fields from a whole response or from one stream chunk.

        A field of an unexpected type (choices that are no list, logprobs that are no
        array, ...) cannot be recorded: `BackendValueError` (a 502, the turn recorded as an
        error), never a foreign exception that would cut the call unrecorded.
        """
        try:
            self._add(obj, chunk)
        except (TypeError, ValueError, AttributeError, KeyError, IndexError) as exc:
            raise BackendValueError(
                f"the backend sent an answer of an unexpected shape: {type(exc).__name__}: "
                f"{str(exc)[:200]}"
            ) from None

    def _add(self, obj: dict[str, Any], chunk: bool) -> None:
        if isinstance(obj.get("model"), str):
            self.model = obj["model"]
        if obj.get("prompt_token_ids") is not None:
            self.prompt_token_ids = checked_ids(obj["prompt_token_ids"], "prompt_token_ids")
        if isinstance(obj.get("usage"), dict):
            self.usage = obj["usage"]
        plan = self.plan
        choices = obj.get("choices") or ()
        if not isinstance(choices, list | tuple):
            raise BackendValueError(
                f"the backend sent choices of type {type(choices).__name__}, not an array"
            )
        for choice in choices:
            if not isinstance(choice, dict):
                continue
            cap = self._choice(choice.get("index"))
            cap.add_common(choice)
            if plan.endpoint == CHAT:
                cap.add_chat_message(choice.get("delta" if chunk else "message"), chunk)
                cap.add_chat_logprobs(choice.get("logprobs"), plan.tokens_as_ids)
            else:
                cap.add_completion_logprobs(choice.get("logprobs"), plan.tokens_as_ids)

    def add_scanned_chunk(self, chunk: ScannedChunk) -> None:
        """`add(obj, chunk=True)` for a stream chunk read by the compiled scanner: the
        same values, without decoding the chunk into Python objects."""
        model = chunk.model
        if model is not None and isinstance(model := chunk.value(model), str):
            self.model = model
        if chunk.prompt_token_ids is not None:  # bounded as it was read
            self.prompt_token_ids = np.frombuffer(chunk.prompt_token_ids, dtype=np.int32)
        if chunk.usage is not None and isinstance(usage := chunk.value(chunk.usage), dict):
            self.usage = usage
        chat = self.plan.endpoint == CHAT
        for found in chunk.choices or ():
            index, ids, prompt, lps, counts, top_ids, top_values = found[:7]
            _message, delta, text, finish, stop = found[7:]
            cap = self._choice(index)
            if ids is not None:
                cap.token_ids.extend(memoryview(ids).cast("i"))
                cap.saw_token_ids = True
            if prompt is not None:
                cap.prompt_token_ids = np.frombuffer(prompt, dtype=np.int32)
            if finish is not None and (reason := chunk.value(finish)) is not None:
                cap.finish_reason = str(reason)
            if stop is not None and (reason := chunk.value(stop)) is not None:
                cap.set_stop_reason(reason)
            if text is not None and isinstance(piece := chunk.value(text), str):
                cap.content.append(piece)
            if chat and delta is not None:
                cap.add_chat_message(chunk.value(delta), True)
            if lps is not None:
                cap.logprobs.extend(memoryview(lps).cast("f"))
            if counts is not None:
                if cap.top_ids is None or cap.top_values is None:
                    cap.top_ids, cap.top_values = [], []
                flat_ids = np.frombuffer(top_ids, dtype=np.int64).tolist()
                flat_values = np.frombuffer(top_values, dtype=np.float64).tolist()
                start = 0
                for n in memoryview(counts).cast("q"):
                    cap.top_ids.append(flat_ids[start : start + n])
                    cap.top_values.append(flat_values[start : start + n])
                    start += n

    def add_answer(self, answer: AnswerTokens) -> None:
        """`add` for a whole response read by `turnstile.proxy.tokens.read_answer`."""
        if isinstance(answer.model, str):
            self.model = answer.model
        if answer.prompt_token_ids is not None:  # bounded as it was read
            self.prompt_token_ids = answer.prompt_token_ids
        if isinstance(answer.usage, dict):
            self.usage = answer.usage
        chat = self.plan.endpoint == CHAT
        for choice in answer.choices:
            cap = self._choice(choice.index)
            if choice.token_ids is not None:
                cap.id_array = _joined(cap.id_array, choice.token_ids)
                cap.saw_token_ids = True
            if choice.prompt_token_ids is not None:
                cap.prompt_token_ids = choice.prompt_token_ids
            if choice.finish_reason is not None:
                cap.finish_reason = str(choice.finish_reason)
            if choice.stop_reason is not None:
                cap.set_stop_reason(choice.stop_reason)
            if isinstance(choice.text, str):
                cap.content.append(choice.text)
            if chat:
                cap.add_chat_message(choice.message, False)
            if choice.logprobs is not None:
                cap.logprob_array = _joined(cap.logprob_array, choice.logprobs)
            if choice.top_ids is not None and choice.top_values is not None:
                cap.top_ids = (cap.top_ids or []) + choice.top_ids
                cap.top_values = (cap.top_values or []) + choice.top_values

    def prompt_ids_for(self, cap: ChoiceCapture) -> list[int] | Int32Array | None:
        return cap.prompt_token_ids if cap.prompt_token_ids is not None else self.prompt_token_ids


def _joined(first: Any, second: Any) -> Any:
    """`second`, after `first` where a body gave one choice index twice."""
    return second if first is None else np.concatenate([first, second])
