"""What a live Turnstile has published for one rollout, as the tests read it back."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from turnstile.reader import open_output

# A finished rollout is published within `publish_delay_s`; a loaded 2-core machine
# running vLLM beside the proxy may take a good while longer.
PUBLISH_WAIT_S = 20.0


def published_rollout(
    out: Path, rollout: str, timeout_s: float = PUBLISH_WAIT_S
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """A finished rollout's samples and its turns (in turn order), once published."""
    reader = open_output(out)
    samples = reader.wait_for(rollout_ids=[rollout], timeout_s=timeout_s).to_pylist()
    turns = [t for t in reader.turns().to_pylist() if t["rollout_id"] == rollout]
    return samples, sorted(turns, key=lambda t: (t["turn_index"], t["choice_index"]))
