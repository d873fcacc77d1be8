"""Types of the compiled scanner (`_tokenscan.c`); `turnstile.proxy.tokens` wraps it."""

from typing import Any

from _typeshed import ReadableBuffer

def scan(
    body: ReadableBuffer, completions: bool, tokens_as_ids: bool, /
) -> (
    tuple[
        bytearray | None,
        str | tuple[int, int] | None,
        tuple[int, int] | None,
        tuple[int, int] | None,
        list[tuple[Any, ...]] | None,
        list[tuple[int, int, int]],
    ]
    | None
): ...
