"""Token deltas from a chat template: what token-in-token-out (TITO) appends each turn.

Turn k+1's prompt is turn k's prompt, turn k's sampled completion (ending with the
end-of-turn token the model sampled; the template's one is added when sampling stopped
early, e.g. at `length`), then the tokens of the new messages (tool results, user turns)
and the generation prompt. Those last tokens are the *delta*: the text the template
renders after the previous assistant turn's end-of-turn marker, tokenized on its own.
Because the marker is a special token, tokenization starts afresh after it, so the delta's
tokens are the tokens a whole-conversation tokenization gives at that point.

The delta is found in the rendering of the whole new conversation: the previous assistant
turn is located in the rendering of the history that ends with it (after the generation
prompt, up to its first stop token), and the new rendering is cut after the same number
of end-of-turn markers. Whether the history before the cut renders exactly as before is
reported (``Delta.history_preserved``): a template that passes the audit always does; one
that drops earlier reasoning does not, and TITO then still keeps what the model sampled.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from turnstile.tito.templates.render import as_vllm_renders, stop_ids

__all__ = ["Delta", "RenderError", "TemplateRenderer"]


class RenderError(ValueError):
    """The chat template cannot render the conversation (or its delta)."""


@dataclass(frozen=True, slots=True)
class Delta:
    """The tokens TITO appends for the new messages, and how they were found."""

    ids: list[int]
    text: str
    history_preserved: bool  # the history renders as before up to the cut
    end_of_turn_id: int | None  # the template's end-of-turn token of the assistant turn
    # the assistant turn as the template renders the message the harness sent back, up to
    # and including its end-of-turn marker (compared with what was sampled)
    turn_text: str = ""


def _anchor(message: Mapping[str, Any]) -> str:
    """Text an assistant turn's rendering holds near its end: its answer (after any
    reasoning block), else its last tool call's name."""
    content = message.get("content")
    if isinstance(content, str) and content.strip():
        return content.split("</think>")[-1].strip()
    calls = message.get("tool_calls")
    if isinstance(calls, list) and calls and isinstance(calls[-1], Mapping):
        function = calls[-1].get("function")
        if isinstance(function, Mapping) and isinstance(function.get("name"), str):
            return str(function["name"])
    return ""


class TemplateRenderer:
    """Renders conversations with one tokenizer and chat template, as vLLM would."""

    def __init__(
        self,
        tokenizer: Any,
        template: str,
        default_kwargs: Mapping[str, Any] | None = None,
        stop_token_ids: Sequence[int] = (),
    ) -> None:
        self.tokenizer = tokenizer
        self.template = template
        self.default_kwargs = dict(default_kwargs or {})
        self.stops = stop_ids(tokenizer, stop_token_ids)
        self._marker_ids = {self._piece(t): t for t in self.stops}

    def _piece(self, token_id: int) -> str:
        return str(self.tokenizer.decode([token_id], skip_special_tokens=False))

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        kwargs: Mapping[str, Any] | None,
        generation_prompt: bool,
    ) -> str:
        try:
            out = self.tokenizer.apply_chat_template(
                as_vllm_renders(messages),
                tools=tools,
                chat_template=self.template,
                add_generation_prompt=generation_prompt,
                tokenize=False,
                **{**self.default_kwargs, **dict(kwargs or {})},
            )
        except Exception as exc:  # jinja, template raise_exception, bad JSON arguments
            raise RenderError(f"the chat template cannot render the messages: {exc}") from exc
        if not isinstance(out, str):
            raise RenderError(f"the chat template rendered {type(out).__name__}, not text")
        return out

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in self.tokenizer.encode(text, add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=False))

    def prompt(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        kwargs: Mapping[str, Any] | None,
    ) -> tuple[list[int], str]:
        """The whole conversation's prompt (first turn, or a new segment)."""
        text = self.render(messages, tools, kwargs, True)
        return self.encode(text), text

    def turn_start(self, prompt: str, whole: str) -> int:
        """Where the assistant turn begins in `whole` (a rendering that ends with it),
        given `prompt` (the rendering before it, with the generation prompt): the end of
        their common prefix, moved back to the start of a marker that prefix cuts."""
        if whole.startswith(prompt):
            return len(prompt)
        at = 0
        limit = min(len(prompt), len(whole))
        while at < limit and prompt[at] == whole[at]:
            at += 1
        # The history may close the message before the turn with a marker the prompt
        # lacks (Hermes' last tool message): the rest of the prompt then follows it.
        tail = prompt[at:]
        if tail.strip():
            found = whole.find(tail, at)
            if found > at and not self._strip_markers(whole[at:found]).strip():
                return found + len(tail)
        for marker in self._marker_ids:
            for back in range(1, len(marker)):
                if at - back >= 0 and whole.startswith(marker, at - back):
                    return at - back
        return at

    def _strip_markers(self, text: str) -> str:
        for marker in self._marker_ids:
            if marker:
                text = text.replace(marker, "")
        return text

    def end_of_turn(self, text: str, start: int) -> tuple[int, int] | None:
        """Where the first stop-token marker at or after `start` ends, and its id."""
        best: tuple[int, int] | None = None
        for marker, token_id in self._marker_ids.items():
            if not marker:
                continue
            at = text.find(marker, start)
            if at >= 0 and (best is None or at + len(marker) < best[0]):
                best = (at + len(marker), token_id)
        return best

    def delta(
        self,
        history: list[dict[str, Any]],
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        kwargs: Mapping[str, Any] | None,
    ) -> Delta:
        """The tokens of ``messages[len(history):]`` plus the generation prompt, where
        ``history`` ends with the assistant turn the model sampled last."""
        if not history or history[-1].get("role") != "assistant":
            raise RenderError("the history must end with the sampled assistant turn")
        before = self.render(history[:-1], tools, kwargs, True)
        with_turn = self.render(history, tools, kwargs, False)
        # Where the assistant turn starts: after the generation prompt, or where the two
        # renderings part (a generation prompt the turn does not repeat, e.g. "<think>").
        start = self.turn_start(before, with_turn)
        full = self.render(messages, tools, kwargs, True)
        found = self.end_of_turn(with_turn, start)
        anchor = _anchor(history[-1])
        if found is not None and anchor:
            # The renderings may part before the turn (a template that keeps reasoning
            # only in the last assistant turn): the turn ends after what it says.
            at = with_turn.rfind(anchor)
            if at > found[0]:
                found = self.end_of_turn(with_turn, at + len(anchor))
        if found is None:
            # Some templates leave a final assistant turn open (for prefilling) and close
            # it only once a message follows: find its end in the new rendering, after as
            # many stop-token markers as the history has before the turn.
            return self._open_turn_delta(with_turn, start, full)
        cut, eot_id = found
        marker = self._piece(eot_id)
        count = with_turn[:cut].count(marker)
        at = -1
        for _ in range(count):
            at = full.find(marker, at + 1)
            if at < 0:
                raise RenderError(
                    "the new rendering has fewer end-of-turn markers than the history: the "
                    "template re-renders earlier turns differently"
                )
        new_cut = at + len(marker)
        text = full[new_cut:]
        return Delta(
            ids=self.encode(text),
            text=text,
            history_preserved=full[:new_cut] == with_turn[:cut],
            end_of_turn_id=eot_id,
            turn_text=with_turn[start:cut],
        )

    def _markers_in(self, text: str) -> list[tuple[int, int, int]]:
        """Every stop-token marker in ``text``: (start, end, token id), in order."""
        found: list[tuple[int, int, int]] = []
        for marker, token_id in self._marker_ids.items():
            at = text.find(marker) if marker else -1
            while at >= 0:
                found.append((at, at + len(marker), token_id))
                at = text.find(marker, at + 1)
        return sorted(found)

    def _open_turn_delta(self, with_turn: str, start: int, full: str) -> Delta:
        """The delta where the history leaves the sampled turn open (no end-of-turn
        marker after ``start``): the turn ends at the first stop-token marker of ``full``
        after those the history has before it."""
        before = len(self._markers_in(with_turn[:start]))
        markers = self._markers_in(full)
        if len(markers) <= before:
            raise RenderError(
                "the template's assistant turn does not end with a token the model stops on "
                f"(stop ids {sorted(self.stops)})"
            )
        marker_start, new_cut, eot_id = markers[before]
        text = full[new_cut:]
        return Delta(
            ids=self.encode(text),
            text=text,
            history_preserved=full[:start] == with_turn[:start]
            and full[start:marker_start] == with_turn[start:],
            end_of_turn_id=eot_id,
            turn_text=full[start:new_cut],
        )
