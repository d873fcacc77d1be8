"""JSON text for values recorded as JSON columns (messages, tools, metadata, verifier info)."""

from __future__ import annotations

import json
from typing import Any

import orjson


def json_text(value: Any) -> str:
    """`value` as compact JSON text; orjson for speed, the stdlib for what orjson refuses
    (integers beyond 64 bits, which a client may legally send)."""
    try:
        return orjson.dumps(value).decode()
    except TypeError:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False)
