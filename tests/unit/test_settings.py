"""Settings: precedence, validation, and the example config file."""

from __future__ import annotations

from pathlib import Path

import pytest

from turnstile.cli.main import build_parser, main
from turnstile.settings import SettingsError, load_settings, resolve_secret

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def test_flags_beat_env_beat_file(tmp_path: Path) -> None:
    cfg = tmp_path / "t.yaml"
    cfg.write_text("port: 9001\ntop_logprobs: 2\nbackends: [http://file:1]\n")
    env = {"TURNSTILE_PORT": "9002", "TURNSTILE_BACKENDS": "http://env:1,http://env:2"}
    s = load_settings(cfg, {"port": 9003}, environ=env)
    assert s.port == 9003 and s.top_logprobs == 2
    assert s.backends == ("http://env:1", "http://env:2")
    with pytest.raises(Exception, match="frozen"):
        s.port = 1


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("port: -1\n", "port"),
        ("backends: [ftp://x]\n", "http://"),
        ("no_such_setting: 1\n", "no_such_setting"),
        ("- a list\n", "mapping"),
        ("port: [\n", "YAML"),
    ],
)
def test_bad_config_is_a_clear_error(tmp_path: Path, text: str, needle: str) -> None:
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(text)
    with pytest.raises(SettingsError, match=needle):
        load_settings(cfg, environ={})


def test_every_example_config_loads() -> None:
    files = sorted(CONFIGS.glob("*.yaml"))
    assert files
    for path in files:
        load_settings(path, environ={})


def test_secrets_come_from_named_env_vars(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MY_KEY", "s3cret")
    assert resolve_secret("MY_KEY") == "s3cret"
    monkeypatch.setenv("EMPTY_KEY", "")
    with pytest.raises(SettingsError, match="empty"):
        resolve_secret("EMPTY_KEY")
    with pytest.raises(SettingsError, match="not set"):
        resolve_secret("UNSET_KEY_FOR_TEST")
    s = load_settings(None, {"backend_api_key_env": "MY_KEY"}, environ={})
    assert "s3cret" not in str(s.public_dict())


def test_cli_help_explains_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    for argv in (["--help"], ["serve", "--help"], ["demo", "--help"], ["schema", "--help"]):
        with pytest.raises(SystemExit) as exc:
            parser.parse_args(argv)
        assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "--backend" in out and "--tokenizer" in out and "--output" in out


def test_cli_reports_bad_settings(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("port: nope\n")
    assert main(["serve", "--config", str(cfg)]) == 2
    assert "port" in capsys.readouterr().err
