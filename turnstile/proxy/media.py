"""The images of a chat request: checked where they enter, hashed, and made recordable.

`collect_images` walks a chat request's messages for `image_url` parts (inline data URLs
and remote http(s) URLs) and returns them in request order, which is the order the
chat template lays out their placeholder tokens. Inline images are decoded, checked
(one of `IMAGE_MIME_TYPES` by their bytes, within `max_image_bytes`) and hashed; the
recorded copy of the messages names them by `turnstile-media:sha256:<hex>` instead of
holding the base64 text again. Remote URLs follow `MediaPolicy.remote`:

- `url`: the backend fetches the URL itself; only the URL is recorded (no bytes);
- `fetch`: Turnstile fetches it (hosts in `allowed_hosts` only, when that is set;
  at most `max_image_bytes`; `IMAGE_FETCH_TIMEOUT_S`), stores the bytes, and forwards
  them inline, so the backend processes exactly the bytes that are stored;
- `refuse`: 400, the client must send the image inline.

Other media parts (`video_url`, `input_audio`, `image_embeds`, ...) would reach the
model without being recorded, so they are refused (422) rather than silently lost; so
is any image where `MediaPolicy.refusal` says why images cannot be served (TITO mode).
`locate_images` then finds each image's placeholder run in the prompt token ids.
"""

from __future__ import annotations

import base64
import binascii
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Final, Literal
from urllib.parse import urlsplit

import aiohttp
import numpy as np

from turnstile.errors import BadRequest, PayloadTooLarge, Unprocessable
from turnstile.images import IMAGE_MIME_TYPES, media_url, sha256_hex, sniff_mime
from turnstile.limits import MAX_IMAGE_BYTES
from turnstile.records import ImageRef, Int32Array, MediaBlob

__all__ = [
    "IMAGE_FETCH_TIMEOUT_S",
    "MAX_IMAGE_BYTES",
    "MediaPolicy",
    "RemoteImages",
    "RequestImages",
    "collect_images",
    "locate_images",
]

log = logging.getLogger("turnstile.media")

RemoteImages = Literal["url", "fetch", "refuse"]
# Fetching one remote image: a slow image host must not hold the call for minutes.
IMAGE_FETCH_TIMEOUT_S: Final[float] = 30.0
IMAGE_FETCH_CONNECT_TIMEOUT_S: Final[float] = 10.0
_FETCH_CHUNK_BYTES: Final[int] = 64 * 1024
# Content parts that carry media other than images: recorded nowhere, so refused.
_UNRECORDED_PARTS: Final[frozenset[str]] = frozenset(
    {"video_url", "input_audio", "audio_url", "image_embeds", "image_pil", "file", "video"}
)


@dataclass(frozen=True, slots=True)
class MediaPolicy:
    """How a call's images are taken in and recorded (built once from the settings)."""

    remote: RemoteImages = "url"
    allowed_hosts: frozenset[str] = frozenset()  # `fetch` only; empty: any host
    max_image_bytes: int = MAX_IMAGE_BYTES
    refusal: str | None = None  # set: every image is refused (422) with this reason
    image_token_id: int | None = None  # the placeholder token (None: spans not located)
    processor_digest: str | None = None  # recorded with each image turn


@dataclass(slots=True)
class RequestImages:
    """A request's images in order, the bytes of each distinct one, and the messages as
    they are recorded (inline data replaced by `turnstile-media:` references)."""

    refs: list[ImageRef] = field(default_factory=list)
    blobs: dict[str, MediaBlob] = field(default_factory=dict)
    recorded_messages: list[Any] | None = None


async def collect_images(body: dict[str, Any], policy: MediaPolicy) -> RequestImages | None:
    """The images of a chat request (None when it has none).

    Fetched remote images are written back into `body` as data URLs, so the backend gets
    the stored bytes; `BadRequest`, `PayloadTooLarge` or `Unprocessable` for an image
    that cannot be taken in.
    """
    messages = body.get("messages")
    if not isinstance(messages, list):
        return None
    found: RequestImages | None = None
    recorded: list[Any] = list(messages)
    for m_index, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        new_content: list[Any] | None = None
        for p_index, part in enumerate(content):
            if not isinstance(part, dict):
                continue
            kind = part.get("type")
            if kind in _UNRECORDED_PARTS:
                raise Unprocessable(
                    f"messages[{m_index}].content[{p_index}] is a {kind!r} part: Turnstile "
                    "records images only, and would lose it from the training data",
                    param="messages",
                )
            if kind != "image_url":
                continue
            if policy.refusal is not None:
                raise Unprocessable(policy.refusal, param="messages")
            found = found or RequestImages()
            where = f"messages[{m_index}].content[{p_index}]"
            url = _image_url(part, where)
            ref, recorded_url, forwarded_url = await _take(url, where, policy, found)
            found.refs.append(ref)
            if forwarded_url is not None:  # fetched: the backend gets the bytes inline
                content[p_index] = _with_url(part, forwarded_url)
            if recorded_url != url:
                if new_content is None:
                    new_content = list(content)
                new_content[p_index] = _with_url(part, recorded_url)
        if new_content is not None:
            recorded[m_index] = {**message, "content": new_content}
    if found is not None:
        found.recorded_messages = recorded
    return found


def _image_url(part: dict[str, Any], where: str) -> str:
    value = part.get("image_url")
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str) or not url:
        raise BadRequest(f"{where}.image_url must have a non-empty 'url'", param="messages")
    return url


def _with_url(part: dict[str, Any], url: str) -> dict[str, Any]:
    value = part.get("image_url")
    image_url = {**value, "url": url} if isinstance(value, dict) else {"url": url}
    return {**part, "image_url": image_url}


async def _take(
    url: str, where: str, policy: MediaPolicy, found: RequestImages
) -> tuple[ImageRef, str, str | None]:
    """One image: (its reference, the URL recorded, the URL forwarded if it changes)."""
    if url.startswith("data:"):
        data = _decode_data_url(url, where, policy.max_image_bytes)
        blob = _blob(data, where)
        found.blobs.setdefault(blob.sha256, blob)
        return ImageRef(blob.sha256, None, None, None), media_url(blob.sha256), None
    scheme = urlsplit(url).scheme.lower()
    if scheme not in ("http", "https"):
        raise BadRequest(
            f"{where} has an image URL with scheme {scheme or '(none)'!r}: send a data URL "
            "or an http(s) URL",
            param="messages",
        )
    if policy.remote == "refuse":
        raise BadRequest(
            f"{where} is a remote image URL, and this Turnstile refuses them "
            "(remote_images: refuse): send the image inline as a data URL",
            param="messages",
        )
    if policy.remote == "url":
        return ImageRef(None, url, None, None), url, None
    data = await _fetch(url, where, policy)
    blob = _blob(data, where)
    found.blobs.setdefault(blob.sha256, blob)
    inline = f"data:{blob.mime_type};base64,{base64.b64encode(data).decode('ascii')}"
    return ImageRef(blob.sha256, url, None, None), media_url(blob.sha256), inline


def _decode_data_url(url: str, where: str, max_bytes: int) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep or not header.endswith(";base64"):
        raise BadRequest(
            f"{where} has a data URL that is not base64 ('data:<type>;base64,<data>')",
            param="messages",
        )
    declared = header[len("data:") : -len(";base64")].split(";")[0].strip().lower()
    if declared and declared not in IMAGE_MIME_TYPES:
        raise BadRequest(
            f"{where} has a data URL of type {declared!r}; images must be one of "
            f"{', '.join(sorted(IMAGE_MIME_TYPES))}",
            param="messages",
        )
    if len(payload) > (max_bytes + 2) // 3 * 4 + 4:
        raise PayloadTooLarge(
            f"{where} is an image of more than {max_bytes} bytes", param="messages"
        )
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise BadRequest(f"{where} has invalid base64 data: {exc}", param="messages") from None
    if len(data) > max_bytes:
        raise PayloadTooLarge(
            f"{where} is an image of {len(data)} bytes, over the limit of {max_bytes}",
            param="messages",
        )
    return data


def _blob(data: bytes, where: str) -> MediaBlob:
    mime = sniff_mime(data)
    if mime is None:
        raise BadRequest(
            f"{where} is not a PNG, JPEG, GIF or WebP image (its first bytes are {data[:8]!r})",
            param="messages",
        )
    return MediaBlob(sha256_hex(data), mime, data)


async def _fetch(url: str, where: str, policy: MediaPolicy) -> bytes:
    host = (urlsplit(url).hostname or "").lower()
    if policy.allowed_hosts and host not in policy.allowed_hosts:
        raise BadRequest(
            f"{where}: Turnstile fetches remote images only from "
            f"{', '.join(sorted(policy.allowed_hosts))}, not from {host!r}",
            param="messages",
        )
    timeout = aiohttp.ClientTimeout(
        total=IMAGE_FETCH_TIMEOUT_S, sock_connect=IMAGE_FETCH_CONNECT_TIMEOUT_S
    )
    limit = policy.max_image_bytes
    try:
        async with (
            aiohttp.ClientSession(timeout=timeout) as session,
            session.get(url, allow_redirects=False) as resp,
        ):
            if resp.status != 200:
                raise BadRequest(
                    f"{where}: fetching the image {url!r} answered HTTP {resp.status}",
                    param="messages",
                )
            if resp.content_length is not None and resp.content_length > limit:
                raise PayloadTooLarge(
                    f"{where}: the image at {url!r} is {resp.content_length} bytes, over "
                    f"the limit of {limit}",
                    param="messages",
                )
            chunks: list[bytes] = []
            size = 0
            async for chunk in resp.content.iter_chunked(_FETCH_CHUNK_BYTES):
                size += len(chunk)
                if size > limit:
                    raise PayloadTooLarge(
                        f"{where}: the image at {url!r} is over the limit of {limit} bytes",
                        param="messages",
                    )
                chunks.append(chunk)
            return b"".join(chunks)
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        raise BadRequest(
            f"{where}: cannot fetch the image {url!r}: {type(exc).__name__}: {exc}",
            param="messages",
        ) from None


def locate_images(
    refs: Sequence[ImageRef], prompt_ids: Int32Array, image_token_id: int | None
) -> list[ImageRef]:
    """`refs` with their placeholder spans: the k-th run of `image_token_id` in the
    prompt is the k-th image. Unlocated (None) where the runs do not match the images."""
    if image_token_id is None or not refs or prompt_ids.size == 0:
        return list(refs)
    marks = np.zeros(prompt_ids.size + 2, dtype=np.int8)
    marks[1:-1] = prompt_ids == image_token_id
    edges = np.diff(marks)
    starts = np.flatnonzero(edges == 1)
    ends = np.flatnonzero(edges == -1)
    if starts.size != len(refs):
        log.warning(
            "the prompt has %d runs of image token %d but the request %d images: their "
            "spans are recorded as unknown",
            starts.size,
            image_token_id,
            len(refs),
        )
        return list(refs)
    return [
        replace(ref, start=int(s), length=int(e - s))
        for ref, s, e in zip(refs, starts.tolist(), ends.tolist(), strict=True)
    ]
