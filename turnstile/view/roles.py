"""Which message a token belongs to, read from the chat template's markers.

Chat templates open each message with a special token and the role name
(`<|im_start|>user`, `<|start_header_id|>tool<|end_header_id|>`, ...). Tool traffic has
its own markers in hermes-style templates (`<tool_call>`, `<tool_response>`), which
Qwen3 renders inside a `user` message (markers inside a system message only describe
the format and are not tool traffic). `token_roles` walks the decoded pieces and labels
each token `system`, `user`, `assistant`, `tool` (a tool result), `tool_call`, or ``""``
where no marker was seen (e.g. without a tokenizer).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

ROLES: Final[frozenset[str]] = frozenset(
    {"system", "user", "assistant", "tool", "ipython", "developer"}
)
# Hermes-style tool markers: opening piece -> (closing piece, label).
TOOL_MARKERS: Final[dict[str, tuple[str, str]]] = {
    "<tool_call>": ("</tool_call>", "tool_call"),
    "<tool_response>": ("</tool_response>", "tool"),
}
# Pieces a role name may take after the opening special token: the name, maybe after a
# newline or a space (sentencepiece-style `▁user`).
_STRIP: Final[str] = " \n\t▁Ġ"


def token_roles(pieces: Sequence[str], special: Sequence[bool]) -> list[str]:
    """A role label per token (see the module docstring)."""
    roles: list[str] = []
    role = ""
    inner: tuple[str, str] | None = None  # (closing piece, label) inside tool markers
    expect_role = False
    for piece, is_special in zip(pieces, special, strict=True):
        name = piece.strip(_STRIP)
        if expect_role and name in ROLES:
            role = "tool" if name in ("tool", "ipython") else name
            expect_role = False
            roles.append(role)
            continue
        expect_role = is_special and not name.startswith("</")
        # A system prompt that describes the tool format mentions the markers: not traffic.
        if inner is None and name in TOOL_MARKERS and role != "system":
            inner = TOOL_MARKERS[name]
            roles.append(inner[1])
            continue
        if inner is not None:
            roles.append(inner[1])
            if name == inner[0]:
                inner = None
            continue
        roles.append(role)
    return roles
