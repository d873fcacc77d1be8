"""What every layer agrees on about recorded images: their types, names and processor.

An image in a call is stored once, by the SHA-256 of its bytes, in the `media` table; the
turns and samples refer to it by that hash. The recorded request messages name it with a
`turnstile-media:sha256:<hex>` URL in place of the inline data, so the `turns` table does
not hold every screenshot again as base64 text. The trainer rebuilds the model's inputs
(`pixel_values`, ...) from those bytes with the model's own processor, whose configuration
digest (`processor_digest`) is recorded with each image turn so that a trainer can tell it
uses the processor the backend used.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Final

__all__ = [
    "IMAGE_MIME_TYPES",
    "MEDIA_URL_PREFIX",
    "PROCESSOR_CONFIG_FILES",
    "media_url",
    "processor_digest",
    "sha256_hex",
    "sha256_of_media_url",
    "sniff_mime",
]

# The image types a chat backend decodes and a browser shows: what Turnstile accepts.
IMAGE_MIME_TYPES: Final[frozenset[str]] = frozenset(
    {"image/png", "image/jpeg", "image/gif", "image/webp"}
)
MEDIA_URL_PREFIX: Final[str] = "turnstile-media:sha256:"
# The files of a Hugging Face model directory that configure its image processing.
PROCESSOR_CONFIG_FILES: Final[tuple[str, ...]] = (
    "preprocessor_config.json",
    "processor_config.json",
)
_SHA256_HEX_LEN: Final[int] = 64


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def media_url(sha256: str) -> str:
    """The URL that stands for stored image bytes in recorded messages."""
    return MEDIA_URL_PREFIX + sha256


def sha256_of_media_url(url: str) -> str | None:
    """The hash a `media_url` names, or None for any other URL."""
    if not url.startswith(MEDIA_URL_PREFIX):
        return None
    digest = url[len(MEDIA_URL_PREFIX) :]
    if len(digest) != _SHA256_HEX_LEN or any(c not in "0123456789abcdef" for c in digest):
        return None
    return digest


def sniff_mime(data: bytes) -> str | None:
    """The image type the bytes say they are (by their magic numbers), or None."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "image/png"
    if data.startswith(b"\xff\xd8\xff"):
        return "image/jpeg"
    if data.startswith((b"GIF87a", b"GIF89a")):
        return "image/gif"
    if len(data) >= 12 and data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    return None


def processor_digest(path: Path) -> str:
    """SHA-256 over a model's image-processing configuration.

    `path` is a model directory (its `PROCESSOR_CONFIG_FILES` that exist are digested, in
    that order, each with its name) or one configuration file. `FileNotFoundError` when
    there is none.
    """
    files = [path] if path.is_file() else [path / n for n in PROCESSOR_CONFIG_FILES]
    found = [f for f in files if f.is_file()]
    if not found:
        raise FileNotFoundError(f"no image processor configuration in {path}")
    h = hashlib.sha256()
    for f in found:
        data = f.read_bytes()
        h.update(f"{f.name}\0{len(data)}\0".encode())
        h.update(data)
    return h.hexdigest()
