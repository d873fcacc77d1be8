"""Builds the `Backend` the proxy talks to from the settings.

One URL of the vLLM kind is the plain `AiohttpBackend`, as before. Each URL gets its own
keep-alive client; `backend_kind` wraps it in the SGLang adapter (`sglang`) or in one
that asks the server at first use (`auto`). Several URLs, or any `MODEL=URL` entry,
make a `BackendPool` (sticky routing, health checks, fail-over).
"""

from __future__ import annotations

from turnstile.backends.aiohttp_client import AiohttpBackend
from turnstile.backends.pool import BackendPool
from turnstile.backends.protocol import Backend, Timeouts
from turnstile.backends.sglang import AutoKindBackend, PromptRenderer, SGLangBackend
from turnstile.settings import Settings, resolve_secret


def _one(
    settings: Settings, url: str, timeouts: Timeouts, renderer: PromptRenderer | None
) -> Backend:
    client = AiohttpBackend(
        url,
        timeouts,
        pool_size=settings.backend_pool_size,
        api_key=resolve_secret(settings.backend_api_key_env),
    )
    if settings.backend_kind == "sglang":
        return SGLangBackend(client, renderer=renderer)
    if settings.backend_kind == "auto":
        return AutoKindBackend(client, renderer=renderer)
    return client


def build_backend(
    settings: Settings, timeouts: Timeouts, renderer: PromptRenderer | None = None
) -> Backend:
    """The backend (or pool of backends) `settings` describe."""
    groups = settings.backend_groups()
    if list(groups) == [None] and len(groups[None]) == 1:
        return _one(settings, groups[None][0], timeouts, renderer)
    return BackendPool(
        {
            model: [_one(settings, url, timeouts, renderer) for url in urls]
            for model, urls in groups.items()
        },
        health_interval_s=settings.backend_health_interval_s,
    )
