"""The Responses conversation store keeps the newest entries within a count and a byte
bound (inline images make entries large), in memory and across a restart."""

from __future__ import annotations

from pathlib import Path

import pytest

from turnstile.errors import BadRequest
from turnstile.protocols.conversations import ConversationStore

SCREEN = "data:image/png;base64," + "A" * 40_000


def _added(k: int) -> list[dict[str, object]]:
    image = {"type": "image_url", "image_url": {"url": SCREEN}}
    return [{"role": "user", "content": [{"type": "text", "text": f"step {k}"}, image]}]


def test_large_entries_are_bounded_by_bytes_oldest_first(tmp_path: Path) -> None:
    store = ConversationStore(tmp_path, max_bytes=200_000)
    store.open()
    previous = None
    for k in range(10):
        store.store(f"resp_{k}", previous, _added(k))
        previous = f"resp_{k}"
    store.close()
    # About 40 KB each: the newest four fit in 200 KB, so a chain from the newest answer
    # reaches back to the oldest kept link and stops there with a 400.
    assert [m["content"][0]["text"] for m in store._entries["resp_9"].added] == ["step 9"]
    assert len(store._entries) == 4
    with pytest.raises(BadRequest, match=r"its earlier response resp_5\)"):
        store.conversation("resp_9")
    # A restart reads the file back under the same bound.
    again = ConversationStore(tmp_path, max_bytes=200_000)
    again.open()
    assert list(again._entries) == ["resp_6", "resp_7", "resp_8", "resp_9"]
    again.close()


def test_one_entry_larger_than_the_bound_is_still_kept() -> None:
    store = ConversationStore(None, max_bytes=1_000)
    store.store("resp_0", None, _added(0))
    assert store.conversation("resp_0")[0]["content"][1]["image_url"]["url"] == SCREEN
    store.store("resp_1", "resp_0", _added(1))
    assert list(store._entries) == ["resp_1"]


def test_the_count_bound_still_holds_for_small_entries() -> None:
    store = ConversationStore(None, max_entries=3)
    for k in range(5):
        store.store(f"r{k}", None, [{"role": "user", "content": "hi"}])
    assert list(store._entries) == ["r2", "r3", "r4"]
