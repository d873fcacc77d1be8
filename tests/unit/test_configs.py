"""Every example config loads through the real settings loader; compose.yaml is valid."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import jsonschema
import pytest
import yaml

from turnstile.settings import load_settings

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
COMPOSE = ROOT / "compose.yaml"
SCHEMA = ROOT / "tests" / "fixtures" / "compose" / "compose-spec.json"
# `docker compose config` only parses and interpolates; it never starts anything.
COMPOSE_CONFIG_TIMEOUT_S = 60


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_example_config_loads(path: Path) -> None:
    settings = load_settings(path, environ={})
    assert settings.backends


def test_the_examples_mean_what_they_say() -> None:
    by_name = {p.name: load_settings(p, environ={}) for p in CONFIGS}
    assert {"vllm.yaml", "sglang.yaml", "multi-backend.yaml", "production.yaml"} <= set(by_name)
    assert by_name["sglang.yaml"].backend_kind == "sglang"
    groups = by_name["multi-backend.yaml"].backend_groups()
    assert len(groups[None]) == 2 and len(groups["qwen3-32b"]) == 2
    prod = by_name["production.yaml"]
    assert prod.output_uri == "s3://rl-shards/run-42" and prod.output == Path("/data/staging")
    assert prod.fsync == "always" and prod.api_key_env and prod.admin_api_key_env
    # secrets are referenced by variable name only
    for text in (p.read_text() for p in CONFIGS):
        assert not re.search(r"(?i)(secret|password|token)\s*:\s*\S", text)


def _compose() -> dict[str, object]:
    loaded = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(loaded, dict)
    return loaded


def test_compose_file_matches_the_compose_specification() -> None:
    schema = json.loads(SCHEMA.read_text())
    jsonschema.Draft7Validator(schema).validate(_compose())  # the spec is draft 7
    services = _compose()["services"]
    assert isinstance(services, dict) and {"vllm", "turnstile"} <= set(services)
    turnstile = services["turnstile"]
    assert turnstile["depends_on"]["vllm"]["condition"] == "service_healthy"
    command = " ".join(turnstile["command"])
    assert "--api-key-env" in command and "--backend=http://vllm:8000" in command
    config_arg = next(c for c in turnstile["command"] if c.startswith("--config="))
    assert (ROOT / "configs" / Path(config_arg.split("/")[-1])).is_file()


def test_invalid_compose_is_rejected_by_the_schema() -> None:
    schema = json.loads(SCHEMA.read_text())
    broken = _compose()
    broken["services"]["turnstile"]["depends_on"] = {"vllm": {"condition": "whenever"}}  # type: ignore[index]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft7Validator(schema).validate(broken)


def _has_compose_plugin() -> bool:
    docker = shutil.which("docker")
    if docker is None:
        return False
    out = subprocess.run(
        [docker, "compose", "version"],
        capture_output=True,
        check=False,
        timeout=COMPOSE_CONFIG_TIMEOUT_S,
    )
    return out.returncode == 0


if _has_compose_plugin():  # the schema check above runs everywhere; this one where it can

    def test_docker_compose_config_accepts_the_file() -> None:
        env = {
            "VLLM_API_KEY": "x",
            "TURNSTILE_CLIENT_KEY": "y",
            "TURNSTILE_ADMIN_KEY": "z",
            "PATH": "/usr/bin:/bin:/usr/local/bin",
        }
        out = subprocess.run(
            ["docker", "compose", "-f", str(COMPOSE), "config", "--quiet"],
            capture_output=True,
            env=env,
            check=False,
            timeout=COMPOSE_CONFIG_TIMEOUT_S,
        )
        assert out.returncode == 0, out.stderr.decode()


def test_dockerfile_is_multi_stage_non_root_with_healthcheck() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert len(re.findall(r"(?m)^FROM ", text)) == 2
    assert re.search(r"(?m)^USER turnstile$", text) and "HEALTHCHECK" in text


NGINX = "/usr/sbin/nginx"
# `nginx -t` reads and checks a config only.
NGINX_TEST_TIMEOUT_S = 30


def test_nginx_replica_config_is_valid_and_hashes_on_the_rollout(tmp_path: Path) -> None:
    conf = ROOT / "configs" / "nginx-replicas.conf"
    text = conf.read_text()
    assert "hash $turnstile_rollout consistent;" in text
    out = subprocess.run(
        [NGINX, "-t", "-c", str(conf), "-p", f"{tmp_path}/", "-e", str(tmp_path / "error.log")],
        capture_output=True,
        check=False,
        timeout=NGINX_TEST_TIMEOUT_S,
    )
    assert out.returncode == 0, out.stderr.decode()
