"""Real, decodable PNG images made without an imaging library, for the image tests."""

from __future__ import annotations

import base64
import struct
import zlib


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png(width: int, height: int, seed: int = 0) -> bytes:
    """An RGB PNG of `width` x `height` whose pixels depend on `seed` (a screenshot-like
    gradient with a few stripes), so that two seeds give two different images."""
    rows = []
    for y in range(height):
        row = bytearray([0])  # filter: none
        for x in range(width):
            stripe = 255 if (x // 40 + y // 40 + seed) % 5 == 0 else 0
            row += bytes(((x * 7 + seed * 31) % 256, (y * 5 + seed * 17) % 256, stripe))
        rows.append(bytes(row))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + _chunk(b"IHDR", header)
        + _chunk(b"IDAT", zlib.compress(b"".join(rows), 6))
        + _chunk(b"IEND", b"")
    )


def data_url(image: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(image).decode('ascii')}"


def image_part(url: str) -> dict[str, object]:
    return {"type": "image_url", "image_url": {"url": url}}
