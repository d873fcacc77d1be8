"""TITO mode behind the `Backend` seam: chat calls go through the engine as token IDs.

`TitoBackend` wraps the real backend the way the SGLang adapter does: a chat completion
call (`POST /v1/chat/completions`) is handed to the `TitoEngine`, which sends it to
`/v1/completions` as token IDs (or, with images, to vLLM's `/inference/v1/generate`) and
answers with a chat response; everything else
(completions calls, `/v1/models`, `/health`, ...) goes to the wrapped backend unchanged.
The rollout a chat call belongs to is the `ROLLOUT_AFFINITY` the proxy sets around
`Backend.request`. `forget` drops a sealed rollout's token state.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from turnstile.backends.protocol import ROLLOUT_AFFINITY, Backend, BackendResponse
from turnstile.errors import BadRequest
from turnstile.tito.engine import TitoEngine

CHAT_PATH = "/v1/chat/completions"


class TitoBackend:
    """The backend `inner`, with chat completion calls sent through `engine`."""

    kind = "tito"

    def __init__(self, inner: Backend, engine: TitoEngine) -> None:
        self.inner = inner
        self.engine = engine
        self.base_url = inner.base_url

    async def request(
        self, method: str, path: str, body: bytes | None, headers: Mapping[str, str]
    ) -> BackendResponse:
        if method != "POST" or path != CHAT_PATH or body is None:
            return await self.inner.request(method, path, body, headers)
        rollout_id = ROLLOUT_AFFINITY.get()
        if rollout_id is None:
            raise BadRequest("TITO mode sends chat completion calls only within a rollout")
        return await self.engine.request(rollout_id, _request_object(body))

    def forget(self, rollout_id: str) -> None:
        """Drop the token state of a rollout that was sealed."""
        self.engine.forget(rollout_id)

    def stats(self) -> dict[str, Any]:
        return self.engine.stats()

    async def aclose(self) -> None:
        await self.inner.aclose()


def _request_object(body: bytes) -> dict[str, Any]:
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise BadRequest("the request body is not a JSON object")
    return obj
