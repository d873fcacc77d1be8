"""Shared bits of the examples: where Turnstile is, which model, and the rollout API.

Every example reads `TURNSTILE_URL` (default http://127.0.0.1:8100) and `TURNSTILE_MODEL`
(default tiny-qwen3, the model `turnstile demo` serves).
"""

from __future__ import annotations

import os
from typing import Any

import httpx

TURNSTILE_URL = os.environ.get("TURNSTILE_URL", "http://127.0.0.1:8100").rstrip("/")
MODEL = os.environ.get("TURNSTILE_MODEL", "tiny-qwen3")
# Short answers keep the examples quick on a CPU backend.
MAX_TOKENS = int(os.environ.get("TURNSTILE_EXAMPLE_MAX_TOKENS", "24"))
# Turnstile answers the rollout API at once; a generous bound for a loaded machine.
API_TIMEOUT_S = 30.0


def create_rollout(**fields: Any) -> dict[str, Any]:
    """POST /rollouts: returns `rollout_id`, `base_url` (give it to the harness), `api_key`."""
    resp = httpx.post(f"{TURNSTILE_URL}/rollouts", json=fields, timeout=API_TIMEOUT_S)
    resp.raise_for_status()
    return dict(resp.json())


def reward_and_finish(
    rollout_id: str, rewards: dict[str, float], info: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Post the verifier's rewards, then seal the rollout so it is stitched and written."""
    resp = httpx.post(
        f"{TURNSTILE_URL}/rollouts/{rollout_id}/rewards",
        json={"rewards": rewards, "info": info or {}},
        timeout=API_TIMEOUT_S,
    )
    resp.raise_for_status()
    resp = httpx.post(f"{TURNSTILE_URL}/rollouts/{rollout_id}/finish", timeout=API_TIMEOUT_S)
    resp.raise_for_status()
    return dict(resp.json())
