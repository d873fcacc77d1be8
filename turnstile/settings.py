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
from turnstile.journal import DEFAULT_SEGMENT_BYTES

ENV_PREFIX = "TURNSTILE_"


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

    backends: tuple[str, ...] = Field(default=("http://127.0.0.1:8000",), min_length=1)
    backend_api_key_env: str | None = None
    # Names of environment variables holding client API keys (several allowed);
    # empty means no client authentication, which is refused off loopback.
    api_key_env: tuple[str, ...] = ()
    # Name of the environment variable holding the admin key: when set, only it opens
    # /admin/* and the reward routes.
    admin_api_key_env: str | None = None
    output: Path = Path("turnstile-output")
    host: str = "127.0.0.1"
    port: int = Field(default=8100, ge=0, le=65535)
    tokenizer: Path | None = None
    mode: Literal["record"] = "record"
    top_logprobs: int = Field(default=0, ge=0, le=20)
    policy_version: int = 0
    writer_id: str = Field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}")
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    # Processes serving the port together (SO_REUSEPORT); each rollout is owned by one.
    workers: int = Field(default=1, ge=1, le=64)

    connect_timeout_s: float = Field(default=limits.CONNECT_TIMEOUT_S, gt=0)
    first_byte_timeout_s: float = Field(default=limits.FIRST_BYTE_TIMEOUT_S, gt=0)
    idle_timeout_s: float = Field(default=limits.IDLE_TIMEOUT_S, gt=0)
    total_timeout_s: float = Field(default=limits.TOTAL_TIMEOUT_S, gt=0)
    max_request_body_bytes: int = Field(default=limits.MAX_REQUEST_BODY_BYTES, gt=0)
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
    journal_retention_interval_s: float = Field(
        default=limits.JOURNAL_RETENTION_INTERVAL_S, gt=0
    )
    recorder_queue_size: int = Field(default=limits.RECORDER_QUEUE_SIZE, gt=0)
    shard_max_rows: int = Field(default=limits.SHARD_MAX_ROWS, gt=0)
    shard_max_age_s: float = Field(default=limits.SHARD_MAX_AGE_S, gt=0)
    max_rollout_bytes: int = Field(default=limits.MAX_ROLLOUT_BYTES, gt=0)
    max_open_rollout_bytes: int = Field(default=limits.MAX_OPEN_ROLLOUT_BYTES, gt=0)
    rollout_idle_timeout_s: float = Field(default=limits.ROLLOUT_IDLE_TIMEOUT_S, gt=0)
    drain_timeout_s: float = Field(default=limits.DRAIN_TIMEOUT_S, ge=0)

    @field_validator("backends", mode="before")
    @classmethod
    def _split_backends(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = [v for v in value.split(",") if v.strip()]
        return value

    @field_validator("api_key_env", mode="before")
    @classmethod
    def _split_key_envs(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        return value

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
        for url in value:
            url = url.strip().rstrip("/")
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"backend URL must start with http:// or https://: {url!r}")
            checked.append(url)
        return tuple(checked)

    @property
    def backend(self) -> str:
        """The backend that requests go to (several backends come with routing)."""
        return self.backends[0]

    def public_dict(self) -> dict[str, Any]:
        """The settings as logged at start-up: secrets are only ever env-var names."""
        return self.model_dump(mode="json")


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
