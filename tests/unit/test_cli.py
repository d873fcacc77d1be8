"""The command line: one module per command, the top-level parser, the `replay` alias."""

from __future__ import annotations

import argparse
import pkgutil
import sys
from pathlib import Path
from types import ModuleType

import pytest

import turnstile.cli
from tests.unit.test_train_batches import group_records, write_shard
from turnstile.cli import main as cli
from turnstile.cli import rescore

UNREACHABLE_BACKEND = "http://127.0.0.1:9"
# Wide enough that argparse wraps no help line.
HELP_COLUMNS = "200"


def _subparsers(
    parser: argparse.ArgumentParser,
) -> argparse._SubParsersAction[argparse.ArgumentParser]:
    (action,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action


@pytest.mark.parametrize("module", cli.COMMANDS, ids=lambda m: m.NAME)
def test_every_command_module_has_the_interface(module: ModuleType) -> None:
    assert isinstance(module.NAME, str) and module.NAME
    assert isinstance(module.HELP, str) and module.HELP
    assert isinstance(getattr(module, "DESCRIPTION", ""), str)
    assert callable(module.add_arguments) and callable(module.run)
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)  # builds on a bare parser too


def test_no_command_module_is_named_like_a_standard_library_module() -> None:
    names = {m.name for m in pkgutil.iter_modules(turnstile.cli.__path__)}
    assert not names & sys.stdlib_module_names
    assert {m.__name__.rsplit(".", 1)[1] for m in cli.COMMANDS} <= names  # type: ignore[attr-defined]


def test_the_parser_has_one_subparser_per_module_and_the_hidden_alias() -> None:
    sub = _subparsers(cli.build_parser())
    names = [m.NAME for m in cli.COMMANDS]
    assert len(set(names)) == len(names)
    assert [a.dest for a in sub._choices_actions] == names  # what --help lists
    assert set(sub.choices) == {*names, *rescore.DEPRECATED_ALIASES}
    for module in cli.COMMANDS:
        assert sub.choices[module.NAME].get_default("func") is module.run
        assert sub.choices[module.NAME].description == getattr(module, "DESCRIPTION", None)


def test_help_lists_the_commands_and_not_replay(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", HELP_COLUMNS)
    with pytest.raises(SystemExit) as done:
        cli.main(["--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    for module in cli.COMMANDS:
        assert f"    {module.NAME}" in out and module.HELP in out
    assert "replay" not in out and "SUPPRESS" not in out


@pytest.mark.parametrize("command", ["rescore", "replay"])
def test_rescore_and_its_deprecated_alias_have_the_same_help(
    command: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", HELP_COLUMNS)
    with pytest.raises(SystemExit) as done:
        cli.main([command, "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: turnstile {command} ")
    assert rescore.DESCRIPTION[:40] in out and "--backend URL" in out


def test_rescore_parses_its_flags() -> None:
    args = cli.build_parser().parse_args(
        ["rescore", "d", "--backend", "http://x", "--top-k", "3", "--reward", "a"]
    )
    assert args.command == "rescore" and args.func is rescore.run
    assert (args.directory, args.backend, args.top_k, args.reward) == (
        Path("d"),
        "http://x",
        3,
        ["a"],
    )
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["rescore", "d"])  # --backend or --model is required


@pytest.mark.parametrize("command", ["rescore", "replay"])
def test_rescore_runs_on_a_tiny_dataset(
    tmp_path: Path, command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    write_shard(tmp_path, group_records("g", [(1, 0), (0, 1)]))
    assert (
        cli.main([command, str(tmp_path), "--backend", UNREACHABLE_BACKEND]) == rescore.EXIT_FAILED
    )
    err = capsys.readouterr().err.splitlines()
    assert err[-1].startswith("turnstile rescore: ")
    notices = [line for line in err if "deprecated" in line]
    assert notices == (
        ["turnstile replay: deprecated, use `turnstile rescore` instead"]
        if command == "replay"
        else []
    )
    assert cli.main([command, str(tmp_path / "missing"), "--backend", UNREACHABLE_BACKEND]) == (
        rescore.EXIT_BAD_INPUT
    )


def test_serve_flag_streams_whole_calls() -> None:
    from turnstile.cli import serve
    from turnstile.settings import load_settings

    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    on = serve._overrides(parser.parse_args(["--stream-whole-calls"]))
    assert load_settings(None, on, environ={}).stream_whole_calls is True
    off = serve._overrides(parser.parse_args([]))
    assert load_settings(None, off, environ={}).stream_whole_calls is False
