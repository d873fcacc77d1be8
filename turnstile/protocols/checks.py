"""Checks of client values where a protocol request enters: each failure is a 400 naming
the field, raised before anything is forwarded or recorded."""

from __future__ import annotations

import math
from typing import Any

from turnstile.errors import BadRequest


def obj(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise BadRequest(f"{where} must be an object", param=where)
    return value


def array(value: Any, where: str) -> list[Any]:
    if not isinstance(value, list):
        raise BadRequest(f"{where} must be an array", param=where)
    return value


def text(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise BadRequest(f"{where} must be a string", param=where)
    return value


def optional_text(value: Any, where: str) -> str | None:
    return None if value is None else text(value, where)


def positive_int(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise BadRequest(f"{where} must be an integer >= 1", param=where)
    return value


def number(value: Any, where: str) -> float | int:
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if not ok or not math.isfinite(value):
        raise BadRequest(f"{where} must be a finite number", param=where)
    return value  # type: ignore[no-any-return]


def boolean(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise BadRequest(f"{where} must be a boolean", param=where)
    return value


def copy_numbers(body: dict[str, Any], chat: dict[str, Any], names: dict[str, str]) -> None:
    """Copy the numeric sampling fields `names` (protocol name -> chat name) that are set."""
    for name, chat_name in names.items():
        if body.get(name) is not None:
            chat[chat_name] = number(body[name], name)
