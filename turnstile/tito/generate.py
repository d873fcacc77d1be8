"""TITO's image turns: token IDs and images to vLLM's token-in route, and the answer back.

`/v1/completions` takes prompt token IDs but no images, so a TITO turn whose conversation
holds images goes to vLLM's token-in-token-out route, `POST /inference/v1/generate`
(vLLM >= 0.32, served with `--enable-scale-out`): the token IDs with each image as a
`content_parts` entry, in the order the template lays out their placeholders.

vLLM expands every image's placeholder there (Qwen2-VL's single `<|image_pad|>` becomes one
token per merged patch) and applies the expansion to whatever IDs it gets: IDs that are
already expanded are expanded again, silently (a 338-token prompt came back as 659). So TITO
sends and keeps each rollout's token state with *unexpanded* placeholders, one per image as
the chat template renders it, and records the prompt IDs vLLM answers with
(`return_token_ids`), which are expanded exactly as the model consumed them. An extension
then expands to the previous turn's recorded prompt, its completion and the new tokens.

`generate_body` maps a chat request onto the route's request (sampling fields into
`sampling_params`, `output_mode: text` so the answer carries the text the parsers read);
`as_completion` reshapes its answers and stream chunks into the `/v1/completions` shape that
`convert` turns into chat answers (the expanded prompt IDs moved into the choice, the
logprobs left in the chat form vLLM already gives).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

from turnstile.errors import Unprocessable

__all__ = [
    "GENERATE_PATH",
    "ROUTE_MISSING",
    "ROUTE_MISSING_STATUSES",
    "as_completion",
    "generate_body",
    "image_urls",
]

GENERATE_PATH: Final[str] = "/inference/v1/generate"
# Statuses with which a backend says it has no such route: vLLM without --enable-scale-out
# answers 403, older vLLM and SGLang 404 (or 405).
ROUTE_MISSING_STATUSES: Final[frozenset[int]] = frozenset({403, 404, 405})
ROUTE_MISSING: Final[str] = (
    "TITO mode sends a conversation with images as token IDs plus the images to vLLM's "
    f"token-in route {GENERATE_PATH}, which this backend does not serve (HTTP {{status}}): "
    "serve vLLM >= 0.32 with --enable-scale-out, or record image rollouts in record mode"
)
# Chat request fields that are sampling parameters of the same name and meaning.
SAMPLING_FIELDS: Final[tuple[str, ...]] = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "ignore_eos",
    "min_tokens",
    "skip_special_tokens",
    "include_stop_str_in_output",
    "spaces_between_special_tokens",
    "bad_words",
    "allowed_token_ids",
    "structured_outputs",
)
# Chat request fields the route has no counterpart for: refused rather than ignored.
UNSUPPORTED_FIELDS: Final[tuple[str, ...]] = ("truncate_prompt_tokens",)


def image_urls(messages: Sequence[Any]) -> list[str]:
    """The URL of every `image_url` part of `messages`, in order (the proxy has checked
    them where they entered)."""
    urls: list[str] = []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for part in content:
            if isinstance(part, dict) and part.get("type") == "image_url":
                value = part.get("image_url")
                url = value.get("url") if isinstance(value, dict) else value
                if isinstance(url, str):
                    urls.append(url)
    return urls


def _structured_outputs(chat: dict[str, Any]) -> dict[str, Any] | None:
    """`response_format` as the sampling parameters' `structured_outputs`, as vLLM's chat
    route maps it."""
    given = chat.get("structured_outputs")
    fmt = chat.get("response_format")
    if fmt is None:
        return given if isinstance(given, dict) else None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return given if isinstance(given, dict) else None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        schema = fmt.get("json_schema")
        if isinstance(schema, dict) and isinstance(schema.get("schema"), dict):
            return {"json": schema["schema"]}
    raise Unprocessable(
        "TITO image turns take response_format 'text', 'json_object' or 'json_schema' "
        "(with a 'schema' object)",
        param="response_format",
    )


def _logit_bias(value: Any) -> dict[int, float]:
    if not isinstance(value, dict):
        raise Unprocessable("'logit_bias' must be an object", param="logit_bias")
    out: dict[int, float] = {}
    for key, bias in value.items():
        try:
            out[int(key)] = float(bias)
        except (TypeError, ValueError):
            raise Unprocessable(
                f"logit_bias key {key!r} is not a token id with a number", param="logit_bias"
            ) from None
    return out


def generate_body(
    chat: dict[str, Any], prompt_ids: list[int], images: Sequence[str], top_k: int
) -> dict[str, Any]:
    """The `/inference/v1/generate` request for a chat request whose prompt (placeholders
    unexpanded) is `prompt_ids` and whose images are `images`, in order.

    `convert.completions_body` has already checked `n` and `tool_choice`.
    """
    for name in UNSUPPORTED_FIELDS:
        if chat.get(name) is not None:
            raise Unprocessable(
                f"TITO image turns go to vLLM's {GENERATE_PATH}, which has no {name!r}",
                param=name,
            )
    sampling: dict[str, Any] = {k: chat[k] for k in SAMPLING_FIELDS if chat.get(k) is not None}
    structured = _structured_outputs(chat)
    if structured is not None:
        sampling["structured_outputs"] = structured
    if chat.get("logit_bias") is not None:
        sampling["logit_bias"] = _logit_bias(chat["logit_bias"])
    max_tokens = chat.get("max_completion_tokens", chat.get("max_tokens"))
    if max_tokens is not None:  # absent: the server's default (up to the context length)
        sampling["max_tokens"] = max_tokens
    sampling["logprobs"] = top_k
    body: dict[str, Any] = {
        "token_ids": prompt_ids,
        "content_parts": [{"type": "image_url", "url": url} for url in images],
        "sampling_params": sampling,
        "return_token_ids": True,
        "output_mode": "text",
        "stream": chat.get("stream") is True,
    }
    for name in ("model", "stream_options", "priority"):
        if chat.get(name) is not None:
            body[name] = chat[name]
    return body


def as_completion(obj: Any) -> Any:
    """A generate answer or stream chunk in the completions shape `convert` reads: the
    top-level `prompt_token_ids` (expanded by vLLM; in a stream, on the first chunk only)
    moved into the first choice. Anything else is returned as it is."""
    if not isinstance(obj, dict):
        return obj
    prompt = obj.pop("prompt_token_ids", None)
    choices = obj.get("choices")
    if prompt is not None and isinstance(choices, list) and choices:
        first = choices[0]
        if isinstance(first, dict):
            choices[0] = {**first, "prompt_token_ids": prompt}
    return obj
