"""Assembles the server from settings: backend -> proxy -> recorder -> sink, and runs it.

`create_app` takes optional fakes for the backend and the sink so unit tests can run the
whole HTTP surface without a network or a disk. Every part the proxy uses is built
before it and handed to its constructor: the backend (wrapped in `TitoBackend` in TITO
mode), the recorder, the `TurnJournal` (detached until start-up) and the metrics'
counters that observe each finished call; the metrics' scrape-time view of the proxy
comes after. The lifespan opens the journal, restores into the proxy what the last run
left unpublished, attaches the journal, and starts the writer thread and the
idle-rollout sweep; on shutdown it lets in-flight calls finish, seals open rollouts as
`interrupted`, and publishes everything received before the process exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson
from fastapi import FastAPI

from turnstile import __version__
from turnstile.backends.aiohttp_client import redact_url
from turnstile.backends.control import engine_control
from turnstile.backends.factory import build_backend
from turnstile.backends.pool import BackendPool
from turnstile.backends.protocol import Backend, Timeouts
from turnstile.errors import TurnstileError
from turnstile.images import PROCESSOR_CONFIG_FILES, processor_digest
from turnstile.journal.rebuild import JOURNAL_DIR, rebuild
from turnstile.journal.retention import retain_forever
from turnstile.journal.turns import TurnJournal
from turnstile.journal.wal import FileJournal, list_segments
from turnstile.limits import ROLLOUT_SWEEP_INTERVAL_S, WRITER_JOIN_TIMEOUT_S
from turnstile.output.objstore import ObjectStorePublisher, open_store
from turnstile.output.recorder import Recorder
from turnstile.output.shards import ParquetShardSink, Sink
from turnstile.output.tokenizer import LocalTokenizer
from turnstile.protocols.conversations import ConversationStore
from turnstile.proxy.admission import Admission
from turnstile.proxy.core import Proxy
from turnstile.proxy.media import MediaPolicy
from turnstile.runtime import tune_gc
from turnstile.server.asgi import BodyReader, HeaderLimits
from turnstile.server.auth import AuthMiddleware, RolloutKeys
from turnstile.server.logs import RequestContext
from turnstile.server.metrics import EventMetrics, HTTPMetrics, TurnstileMetrics, add_metrics_route
from turnstile.server.routes.agent_protocols import AgentProtocolRoutes
from turnstile.server.routes.agent_protocols import openapi_paths as agent_openapi_paths
from turnstile.server.routes.api import add_routes, install_error_handlers
from turnstile.server.routes.completions import CompletionFastPath, openapi_paths
from turnstile.server.workers import WorkerRouter, WorkerSpec, id_factory, peer_clients
from turnstile.settings import Settings, SettingsError, resolve_secret

if TYPE_CHECKING:
    from turnstile.tito import TitoBackend

log = logging.getLogger("turnstile")

# Where the Responses conversations (`previous_response_id`) are kept, in the output.
RESPONSES_DIR = "responses"
# The start-up look at the backend's model list must not hold up start-up for long.
MODEL_LIST_TIMEOUT_S = 5.0


# TITO sends image turns to vLLM's token-in route (`turnstile.tito.generate`); SGLang has
# none that takes token ids and images and answers with what TITO records.
TITO_IMAGE_REFUSAL = (
    "TITO mode sends a conversation with images to vLLM's token-in route "
    "(/inference/v1/generate, vLLM >= 0.32 with --enable-scale-out); the SGLang backend "
    "has none: record image rollouts in record mode (the default), where images are "
    "recorded with their placeholder spans"
)


def media_policy(settings: Settings) -> MediaPolicy:
    """How calls' images are taken in: the settings, with the image token id and the
    processor digest read from the model directory where they are not given."""
    processor = settings.processor
    tokenizer = settings.tokenizer
    if processor is None and tokenizer is not None and tokenizer.is_dir():
        has_config = any((tokenizer / n).is_file() for n in PROCESSOR_CONFIG_FILES)
        processor = tokenizer if has_config else None
    digest = None
    if processor is not None:
        try:
            digest = processor_digest(processor)
        except OSError as exc:
            raise SettingsError(f"processor {processor}: {exc}") from None
    image_token_id = settings.image_token_id
    if image_token_id is None:
        for directory in (processor, settings.tokenizer):
            image_token_id = _config_image_token_id(directory)
            if image_token_id is not None:
                break
    return MediaPolicy(
        remote=settings.remote_images,
        allowed_hosts=frozenset(settings.remote_image_hosts),
        max_image_bytes=settings.max_image_bytes,
        refusal=(
            TITO_IMAGE_REFUSAL
            if settings.mode == "tito" and settings.backend_kind == "sglang"
            else None
        ),
        image_token_id=image_token_id,
        processor_digest=digest,
    )


def _config_image_token_id(directory: Path | None) -> int | None:
    """`image_token_id` of a model directory's config.json, if it has one."""
    if directory is None or not directory.is_dir():
        return None
    try:
        config = orjson.loads((directory / "config.json").read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return None
    value = config.get("image_token_id") if isinstance(config, dict) else None
    return value if type(value) is int and value >= 0 else None


async def _model_identity(backend: Backend) -> str | None:
    """The served model's id (and root path) from the backend's model list, if it answers."""
    try:
        async with asyncio.timeout(MODEL_LIST_TIMEOUT_S):
            resp = await backend.request("GET", "/v1/models", None, {})
            try:
                body = await resp.read()
            finally:
                resp.close()
        data = orjson.loads(body).get("data") or []
    except (TurnstileError, TimeoutError, orjson.JSONDecodeError, AttributeError) as exc:
        log.warning("could not read the backend's model list: %s", exc)
        return None
    names = [f"{m.get('id')}" + (f" ({m['root']})" if m.get("root") else "") for m in data]
    return ", ".join(names) or None


def _tito_backend(
    settings: Settings, backend: Backend, tokenizer: LocalTokenizer | None
) -> TitoBackend:
    """`backend` in TITO mode; a template the audit refuses stops start-up with the reason."""
    from turnstile.tito import TemplateRefused, TitoBackend, build_engine

    if tokenizer is None:  # settings require one in TITO mode
        raise SettingsError("mode 'tito' needs a tokenizer directory")
    try:
        engine = build_engine(
            backend,
            tokenizer.hf,
            template_path=settings.chat_template,
            chat_template_kwargs=settings.chat_template_kwargs,
            on_rewrite=settings.tito_on_rewrite,
            apply_fixes=settings.tito_apply_fixes,
            allow_unsafe=settings.allow_unsafe_template,
            tool_parser=settings.tool_parser,
            reasoning_parser=settings.reasoning_parser,
            history=settings.tito_history,
            image_token_id=media_policy(settings).image_token_id,
        )
    except TemplateRefused as exc:
        raise SettingsError(f"TITO mode: {exc}") from None
    return TitoBackend(backend, engine)


class TurnstileAPI(FastAPI):
    """The app, whose OpenAPI schema also lists the routes served in front of FastAPI
    (`turnstile.server.routes.completions` and `.agent_protocols`)."""

    def openapi(self) -> dict[str, Any]:
        schema = self.openapi_schema
        if schema is None:
            schema = super().openapi()  # cached by FastAPI: completed once, here
            served = {**openapi_paths(), **agent_openapi_paths()}
            schema["paths"] = {**served, **schema.get("paths", {})}
        return schema


def create_app(
    settings: Settings,
    *,
    backend: Backend | None = None,
    sink: Sink | None = None,
    worker: WorkerSpec | None = None,
) -> FastAPI:
    """The app; `worker` when this process is one of several (`turnstile.server.workers`)."""
    tokenizer = LocalTokenizer(settings.tokenizer) if settings.tokenizer else None
    timeouts = Timeouts(
        settings.connect_timeout_s,
        settings.first_byte_timeout_s,
        settings.idle_timeout_s,
        settings.total_timeout_s,
    )
    writer_id = settings.writer_id if worker is None else f"{settings.writer_id}-{worker.suffix}"
    journal_dir = settings.output / JOURNAL_DIR
    conversations_dir = settings.output / RESPONSES_DIR
    if worker is not None:
        journal_dir = journal_dir / worker.suffix
        conversations_dir = conversations_dir / worker.suffix
    conversations = ConversationStore(conversations_dir, fsync=settings.fsync == "always")
    if backend is None:  # one vLLM client, or the SGLang adapter, or a pool of them
        backend = build_backend(settings, timeouts, tokenizer)
    # The engines' own pause and resume, in each backend's dialect (not through wrappers
    # that only rewrite calls).
    engine = engine_control(backend) if settings.backend_pause else None
    if settings.preserve_tool_arguments and tokenizer is not None:  # settings require one
        from turnstile.proxy.tool_arguments import PreserveToolArguments

        backend = PreserveToolArguments(backend, tokenizer.hf)
    publisher = _publisher(settings, writer_id)
    # The sink reads this mapping when it writes a shard; the model is filled in at start-up.
    identity = {
        "turnstile.version": __version__,
        "turnstile.model": "",
        "turnstile.backend": redact_url(settings.backend),
        "turnstile.tokenizer": str(settings.tokenizer or ""),
    }
    if sink is None:
        sink = ParquetShardSink(
            settings.output,
            writer_id=writer_id,
            identity=identity,
            max_rows=settings.shard_max_rows,
            max_age_s=settings.shard_max_age_s,
            # With an object store this is only staging: the store holds the manifest.
            manifest=publisher is None,
        )
    recorder = Recorder(
        sink,
        max_backlog=settings.recorder_queue_size,
        tokenizer=tokenizer,
        publish_delay_s=settings.publish_delay_s,
    )
    tito = _tito_backend(settings, backend, tokenizer) if settings.mode == "tito" else None
    journal = TurnJournal()  # attached at start-up, once the last run's state is rebuilt
    events = EventMetrics()
    proxy = Proxy(
        backend if tito is None else tito,
        recorder,
        top_logprobs=settings.top_logprobs,
        policy_version=settings.policy_version,
        idle_timeout_s=settings.rollout_idle_timeout_s,
        journal=journal,
        # With several workers, ids this worker owns, so later calls come back here.
        new_rollout_id=None if worker is None else id_factory(worker.index, worker.count),
        on_turn=events.observe,
        on_seal=None if tito is None else tito.forget,  # a sealed rollout's token state
        max_rollout_bytes=settings.max_rollout_bytes,
        max_open_rollout_bytes=settings.max_open_rollout_bytes,
        admission=Admission(
            settings.max_open_rollouts_per_version,
            settings.max_staleness,
            settings.policy_version,
            settings.admission,
        ),
        engine=engine,
        stream_whole_calls=settings.stream_whole_calls,
        media=media_policy(settings),
    )
    peers: dict[int, Backend] = {} if worker is None else peer_clients(worker, timeouts)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if isinstance(backend, BackendPool):
            backend.start()  # health checks
        if publisher is not None:
            publisher.start()
        model = await _model_identity(backend)
        identity["turnstile.model"] = model or ""
        wal = await asyncio.to_thread(
            FileJournal,
            journal_dir,
            fsync=settings.fsync,
            segment_bytes=settings.journal_segment_bytes,
        )
        rebuilt = await asyncio.to_thread(rebuild, wal, settings.output)
        proxy.restore(rebuilt, restore_open=settings.recover_open_rollouts == "restore")
        journal.attach(wal)
        await asyncio.to_thread(conversations.open)
        recorder.start()
        sweeper = asyncio.ensure_future(_sweep(proxy))
        retainer = asyncio.ensure_future(
            retain_forever(proxy, settings.journal_retention_interval_s)
        )
        log.info(
            "turnstile %s recording %s -> %s (model: %s)",
            __version__,
            redact_url(settings.backend),
            settings.output,
            model or "unknown",
        )
        tune_gc()  # start-up garbage is done: keep the collector off the hot path
        try:
            yield
        finally:
            sweeper.cancel()
            retainer.cancel()
            await _drain(proxy, settings.drain_timeout_s)
            sealed = proxy.registry.seal_all()
            await backend.aclose()
            for peer in peers.values():
                await peer.aclose()
            finished = await asyncio.to_thread(recorder.stop, WRITER_JOIN_TIMEOUT_S)
            if publisher is not None:  # the last shards go to the store (or stay staged)
                await asyncio.to_thread(publisher.stop)
            await asyncio.to_thread(wal.close)
            conversations.close()
            if finished and recorder.error is None and recorder.oldest_pin is None:
                # Every journaled row is in a published shard or in the quarantine: the
                # next start has nothing to rebuild. Work that failed in this run keeps
                # its pin, and then the journal stays for the next start.
                for _, segment in list_segments(journal_dir):
                    segment.unlink()
            elif finished:
                log.warning(
                    "the journal in %s is kept: some of its rows are not in published "
                    "shards; the next start (or `turnstile recover`) publishes them",
                    journal_dir,
                )
            log.info(
                "shut down: sealed %d open rollouts as interrupted; %d turns written%s",
                sealed,
                recorder.stats.turns_written,
                "" if finished else " (WRITER DID NOT FINISH IN TIME)",
            )

    app = TurnstileAPI(
        title="Turnstile",
        version=__version__,
        description="OpenAI-compatible recording reverse proxy for RL training.",
        lifespan=lifespan,
    )
    app.state.proxy = proxy
    app.state.tito = None if tito is None else tito.engine
    app.state.publisher = publisher
    client_keys = [k for k in map(resolve_secret, settings.api_key_env) if k]
    admin_key = resolve_secret(settings.admin_api_key_env)
    rollout_keys = RolloutKeys(client_keys) if client_keys else None
    # Added first, so it runs inside authentication (the last added runs outermost).
    bodies = BodyReader(settings.max_request_body_bytes)
    app.add_middleware(AgentProtocolRoutes, proxy=proxy, bodies=bodies, conversations=conversations)
    app.add_middleware(CompletionFastPath, proxy=proxy, bodies=bodies)
    app.add_middleware(
        AuthMiddleware,
        client_keys=client_keys,
        admin_keys=[admin_key] if admin_key else [],
        rollout_keys=rollout_keys,
    )
    if worker is not None and worker.count > 1:  # added last: runs before everything
        app.add_middleware(
            WorkerRouter, spec=worker, peers=peers, max_body=settings.max_request_body_bytes
        )
    # Outermost: every request is counted and logged with its ids, whatever answers it.
    metrics = TurnstileMetrics(events, proxy, backend)
    app.add_middleware(HTTPMetrics, events=events)
    app.add_middleware(RequestContext)
    app.add_middleware(HeaderLimits)  # before anything reads a header
    install_error_handlers(app)
    add_routes(
        app.router,
        proxy,
        bodies,
        rollout_keys,
        tito_stats=None if tito is None else tito.stats,
    )
    add_metrics_route(app, metrics)
    return app


def _publisher(settings: Settings, writer_id: str) -> ObjectStorePublisher | None:
    """The uploader to `settings.output_uri`, when shards go to an object store."""
    if settings.output_uri is None:
        return None
    fs, root = open_store(
        settings.output_uri,
        endpoint=settings.object_store_endpoint,
        region=settings.object_store_region,
    )
    return ObjectStorePublisher(settings.output, fs, root, writer_id=writer_id)


async def _sweep(proxy: Proxy) -> None:
    while True:
        await asyncio.sleep(ROLLOUT_SWEEP_INTERVAL_S)
        for rollout in proxy.registry.sweep():
            log.info("rollout %s sealed as abandoned after idling", rollout.rollout_id)


async def _drain(proxy: Proxy, timeout_s: float) -> None:
    proxy.start_draining()
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(proxy.idle.wait(), timeout_s)
    if proxy.in_flight:
        log.warning("%d calls still in flight after the drain timeout", proxy.in_flight)
