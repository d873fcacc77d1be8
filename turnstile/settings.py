"""Settings: one frozen object built at start-up from defaults, a YAML file,
`TURNSTILE_*` environment variables and command-line flags, in that order of precedence
(flags win).

Secrets are never values here: a setting ending in `_env` names the environment
variable that holds the secret, and `resolve_secret` reads it when needed.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from turnstile import limits
from turnstile.backends.pool import HEALTH_INTERVAL_S
from turnstile.journal.wal import DEFAULT_SEGMENT_BYTES

ENV_PREFIX = "TURNSTILE_"
# The local directory that stages shards (and holds the journal) when `output` is a URI.
STAGING_OUTPUT = Path("turnstile-staging")


def is_loopback(host: str) -> bool:
    """Whether binding `host` exposes the server to this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class SettingsError(Exception):
    """The configuration is invalid; the message says which setting and why."""


class Settings(BaseModel):
    """Everything Turnstile's server needs, frozen once built."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # Backend base URLs; `MODEL=URL` puts a backend in the group serving model MODEL
    # (several backends: rollouts routed by consistent hashing, see turnstile.backends.pool).
    backends: tuple[str, ...] = Field(default=("http://127.0.0.1:8000",), min_length=1)
    # The same per model name, as a YAML mapping: {model: [url, ...]}.
    model_backends: dict[str, tuple[str, ...]] = Field(default_factory=dict)
    # The backends' dialect: vLLM's, SGLang's (turnstile.backends.sglang), or asked at start-up.
    backend_kind: Literal["vllm", "sglang", "auto"] = "vllm"
    backend_health_interval_s: float = Field(default=HEALTH_INTERVAL_S, gt=0)
    backend_api_key_env: str | None = None
    # Names of environment variables holding client API keys (several allowed);
    # empty means no client authentication, which is refused off loopback.
    api_key_env: tuple[str, ...] = ()
    # Name of the environment variable holding the admin key: when set, only it opens
    # /admin/* and the reward routes.
    admin_api_key_env: str | None = None
    # Where shards go: a local directory, or a URI (`s3://bucket/prefix`, any pyarrow or
    # fsspec filesystem URI), given as `output` and moved to `output_uri`; shards are then
    # staged in `output` (the local directory below, which also holds the journal) and
    # published to the store by turnstile.output.objstore.
    output: Path = Path("turnstile-output")
    output_uri: str | None = None
    staging_dir: Path | None = None  # the local directory when `output` is a URI
    # An S3-compatible endpoint (MinIO, Ceph, a test server) instead of AWS's own.
    object_store_endpoint: str | None = None
    object_store_region: str | None = None
    host: str = "127.0.0.1"
    port: int = Field(default=8100, ge=0, le=65535)
    tokenizer: Path | None = None
    # "record": forward chat requests as they are and record what the backend did.
    # "tito": token-in-token-out (turnstile.tito): keep each rollout's tokens and send the
    # backend token IDs, so multi-turn samples are exact by construction (needs tokenizer).
    mode: Literal["record", "tito"] = "record"
    # TITO: what a request that rewrites its rollout's history gets: "split" starts a new
    # sample segment linked to the earlier one; "refuse" answers 409.
    tito_on_rewrite: Literal["split", "refuse"] = "split"
    # TITO: the chat template file to render with (default: the tokenizer's), and
    # template variables every request gets (a request's own chat_template_kwargs win).
    chat_template: Path | None = None
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    # TITO: use a known fix the template audit verified (e.g. Qwen3's template patched to
    # keep earlier reasoning); and accept a template that fails the audit anyway.
    tito_apply_fixes: bool = True
    allow_unsafe_template: bool = False
    # TITO: what the context is held to. "sampled": what the model sampled (a template
    # whose re-render differs, e.g. one that drops earlier <think> blocks, is used with a
    # warning; each turn records whether its context was faithful). "template": the
    # template's own rendering (such a template is refused unless a verified fix applies).
    tito_history: Literal["sampled", "template"] = "sampled"
    # Record mode: whole chat answers carry each tool call's arguments as the model
    # sampled them (turnstile.proxy.tool_arguments), not as the backend re-serialised them.
    preserve_tool_arguments: bool = False
    # TITO: output parsers by name (default: detected from the template's text).
    tool_parser: str | None = None
    reasoning_parser: str | None = None
    top_logprobs: int = Field(default=0, ge=0, le=20)
    policy_version: int = 0
    writer_id: str = Field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}")
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    # "json": one JSON object per line with request and rollout ids (turnstile.server.logs).
    log_format: Literal["text", "json"] = "text"
    # Processes serving the port together (SO_REUSEPORT); each rollout is owned by one.
    workers: int = Field(default=1, ge=1, le=64)
    # The HTTP server under the app (docs/performance.md, "Serving layer"): uvicorn, or
    # the raw asyncio/httptools protocol (turnstile.server.raw); both keep every HTTP
    # behaviour (the header phase's 408/431, the body bounds).
    server: Literal["uvicorn", "raw"] = "uvicorn"

    connect_timeout_s: float = Field(default=limits.CONNECT_TIMEOUT_S, gt=0)
    first_byte_timeout_s: float = Field(default=limits.FIRST_BYTE_TIMEOUT_S, gt=0)
    idle_timeout_s: float = Field(default=limits.IDLE_TIMEOUT_S, gt=0)
    total_timeout_s: float = Field(default=limits.TOTAL_TIMEOUT_S, gt=0)
    max_request_body_bytes: int = Field(default=limits.MAX_REQUEST_BODY_BYTES, gt=0)
    # A request's line and headers must arrive within this (408 and closed; see limits).
    header_read_timeout_s: float = Field(default=limits.HEADER_READ_TIMEOUT_S, gt=0)
    backend_pool_size: int = Field(default=limits.BACKEND_POOL_SIZE, gt=0)

    # When a turn counts as safe before it is acknowledged: "always" fsyncs it first
    # (survives power loss); "interval" writes it first and fsyncs within 5 ms (survives
    # any process crash; a power loss loses at most the last 5 ms); "never" writes it
    # and leaves syncing to the OS (survives a process crash).
    fsync: Literal["always", "interval", "never"] = "interval"
    # Rollouts a crashed run left open: restored (the harness may go on with them) or
    # sealed as "interrupted" at start-up.
    recover_open_rollouts: Literal["restore", "interrupt"] = "restore"
    # The journal rolls to a new segment file past this size; whole segments are removed
    # once every frame in them is in a published shard (checked every
    # journal_retention_interval_s).
    journal_segment_bytes: int = Field(default=DEFAULT_SEGMENT_BYTES, gt=0)
    journal_retention_interval_s: float = Field(default=limits.JOURNAL_RETENTION_INTERVAL_S, gt=0)
    recorder_queue_size: int = Field(default=limits.RECORDER_QUEUE_SIZE, gt=0)
    shard_max_rows: int = Field(default=limits.SHARD_MAX_ROWS, gt=0)
    shard_max_age_s: float = Field(default=limits.SHARD_MAX_AGE_S, gt=0)
    # A sealed rollout without a group, and a group once all its rollouts are sealed,
    # is published within this long (seals meanwhile share the shards).
    publish_delay_s: float = Field(default=limits.PUBLISH_DELAY_S, ge=0)
    max_rollout_bytes: int = Field(default=limits.MAX_ROLLOUT_BYTES, gt=0)
    max_open_rollout_bytes: int = Field(default=limits.MAX_OPEN_ROLLOUT_BYTES, gt=0)
    rollout_idle_timeout_s: float = Field(default=limits.ROLLOUT_IDLE_TIMEOUT_S, gt=0)
    # Admission control (turnstile.proxy.admission): with the rollouts the trainer takes
    # per policy version, new rollouts get 429 (or wait) once the harness is more than
    # max_staleness versions of data ahead of the trainer. None: no limit.
    max_open_rollouts_per_version: int | None = Field(default=None, ge=1)
    max_staleness: int = Field(default=0, ge=0)
    admission: Literal["refuse", "wait"] = "refuse"
    # During a weight update (POST /admin/pause ... /admin/resume), also pause and resume
    # the backend engines themselves (turnstile.backends.control): vLLM's /pause and
    # /resume (with VLLM_SERVER_DEV_MODE=1), SGLang's /pause_generation and
    # /continue_generation; every backend of a pool.
    backend_pause: bool = False
    # Send whole (non-streamed) calls upstream as streams and assemble the whole answer
    # for the client (turnstile.proxy.assemble), so that a policy switch during the call
    # falls between two of its tokens (`policy_version_spans`). Off: such a call is
    # recorded under the version it began with and flagged `policy_switch_unlocated`.
    stream_whole_calls: bool = False
    drain_timeout_s: float = Field(default=limits.DRAIN_TIMEOUT_S, ge=0)
    # Images (turnstile.proxy.media): the placeholder token whose runs in the prompt are
    # the images (default: `image_token_id` of config.json in `processor` or `tokenizer`),
    # and the model directory (or preprocessor_config.json) whose image-processor digest
    # each image turn records (default: `tokenizer`, when it holds one).
    image_token_id: int | None = Field(default=None, ge=0, le=limits.MAX_TOKEN_ID)
    processor: Path | None = None
    # Remote image URLs: "url" records the URL only (the backend fetches it); "fetch"
    # fetches and stores the bytes and forwards them inline (hosts in remote_image_hosts
    # only, when that is set); "refuse" answers 400.
    remote_images: Literal["url", "fetch", "refuse"] = "url"
    remote_image_hosts: tuple[str, ...] = ()
    max_image_bytes: int = Field(default=limits.MAX_IMAGE_BYTES, gt=0)

    @model_validator(mode="before")
    @classmethod
    def _output_uri(cls, values: Any) -> Any:
        if isinstance(values, dict):
            output = values.get("output")
            if isinstance(output, str) and "://" in output:
                values = {**values, "output_uri": output}
                values["output"] = values.get("staging_dir") or STAGING_OUTPUT
        return values

    @field_validator("backends", mode="before")
    @classmethod
    def _split_backends(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = [v for v in value.split(",") if v.strip()]
        return value

    @field_validator("remote_image_hosts", mode="before")
    @classmethod
    def _split_hosts(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = [v.strip().lower() for v in value.split(",") if v.strip()]
        return value

    @field_validator("api_key_env", mode="before")
    @classmethod
    def _split_key_envs(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        return value

    @model_validator(mode="after")
    def _tito_needs_tokenizer(self) -> Settings:
        if self.mode == "tito" and self.tokenizer is None:
            raise ValueError(
                "mode 'tito' renders prompts itself: set tokenizer (--tokenizer DIR) to the "
                "served model's tokenizer directory"
            )
        return self

    @model_validator(mode="after")
    def _preserve_arguments_needs_record_and_tokenizer(self) -> Settings:
        if self.preserve_tool_arguments and (self.mode != "record" or self.tokenizer is None):
            raise ValueError(
                "preserve_tool_arguments works in record mode and decodes the sampled tokens: "
                "set tokenizer (--tokenizer DIR) and leave mode at 'record'"
            )
        return self

    @model_validator(mode="after")
    def _no_open_proxy_off_loopback(self) -> Settings:
        if not self.api_key_env and not is_loopback(self.host):
            raise ValueError(
                f"refusing to bind {self.host} without client authentication: set "
                "api_key_env (--api-key-env NAME) or bind 127.0.0.1"
            )
        return self

    @field_validator("backends")
    @classmethod
    def _check_backends(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        checked = []
        for entry in value:
            model, url = _split_model(entry.strip())
            url = url.rstrip("/")
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"backend URL must start with http:// or https://: {url!r}")
            checked.append(f"{model}={url}" if model else url)
        return tuple(checked)

    @field_validator("model_backends")
    @classmethod
    def _check_model_backends(cls, value: dict[str, tuple[str, ...]]) -> dict[str, tuple[str, ...]]:
        for model, urls in value.items():
            if not urls:
                raise ValueError(f"model {model!r} has no backends")
            for url in urls:
                if not url.startswith(("http://", "https://")):
                    raise ValueError(f"backend URL must start with http:// or https://: {url!r}")
        return {m: tuple(u.rstrip("/") for u in urls) for m, urls in value.items()}

    @property
    def backend(self) -> str:
        """The first backend's URL (the only one without a pool)."""
        return _split_model(self.backends[0])[1]

    def backend_groups(self) -> dict[str | None, list[str]]:
        """Backend URLs per served model name (None: calls naming no listed model)."""
        groups: dict[str | None, list[str]] = {}
        for entry in self.backends:
            model, url = _split_model(entry)
            groups.setdefault(model, []).append(url)
        for model, urls in self.model_backends.items():
            groups.setdefault(model, []).extend(u for u in urls if u not in groups[model])
        return groups

    def public_dict(self) -> dict[str, Any]:
        """The settings as logged at start-up: secrets are only ever env-var names."""
        return self.model_dump(mode="json")


def _split_model(entry: str) -> tuple[str | None, str]:
    """`MODEL=URL` as (MODEL, URL); a plain URL as (None, URL)."""
    head, sep, tail = entry.partition("=")
    if sep and "://" not in head:
        return head.strip() or None, tail.strip()
    return None, entry


def resolve_secret(env_name: str | None) -> str | None:
    """Read a secret from the environment variable a setting names."""
    if env_name is None:
        return None
    value = os.environ.get(env_name)
    if value is None:
        raise SettingsError(f"environment variable {env_name} (a configured secret) is not set")
    if not value:
        raise SettingsError(f"environment variable {env_name} (a configured secret) is empty")
    return value


def _from_yaml(path: Path) -> dict[str, Any]:
    try:
        loaded = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise SettingsError(f"cannot read config file {path}: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise SettingsError(f"config file {path} is not valid YAML: {exc}") from exc
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise SettingsError(f"config file {path} must hold a mapping of settings")
    return {str(k).replace("-", "_"): v for k, v in loaded.items()}


def _from_env(environ: Mapping[str, str]) -> dict[str, Any]:
    fields = Settings.model_fields
    out: dict[str, Any] = {}
    for key, value in environ.items():
        if not key.startswith(ENV_PREFIX):
            continue
        name = key[len(ENV_PREFIX) :].lower()
        if name in fields:
            out[name] = value
    return out


def load_settings(
    config_file: Path | None = None,
    overrides: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> Settings:
    """Build the frozen settings: defaults < YAML file < TURNSTILE_* env < overrides."""
    merged: dict[str, Any] = {}
    if config_file is not None:
        merged.update(_from_yaml(config_file))
    merged.update(_from_env(os.environ if environ is None else environ))
    merged.update({k: v for k, v in (overrides or {}).items() if v is not None})
    try:
        return Settings(**merged)
    except ValidationError as exc:
        problems = "; ".join(_problem(err) for err in exc.errors())
        raise SettingsError(f"invalid settings: {problems}") from exc


def _problem(err: Any) -> str:
    where = ".".join(str(p) for p in err.get("loc", ()))
    msg = str(err.get("msg", "")).removeprefix("Value error, ")
    return f"{where}: {msg}" if where else msg
