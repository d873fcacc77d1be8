"""The `turnstile` command line: the top-level parser and one sub-parser per command module.

Each module of `COMMANDS` names its command (`NAME`, `HELP`, optionally `DESCRIPTION`
and `DEPRECATED_ALIASES`), adds its flags (`add_arguments`) and runs it (`run`, whose
return value is the exit status).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Protocol

from turnstile import __version__
from turnstile.cli import (
    bench,
    check_template,
    demo,
    inspection,
    recover,
    rescore,
    schema,
    serve,
    verify,
    view,
)
from turnstile.settings import SettingsError

EXIT_SETTINGS_ERROR = 2
EXIT_INTERRUPTED = 130


class Command(Protocol):
    """What a command module exposes."""

    NAME: str
    HELP: str

    def add_arguments(self, parser: argparse.ArgumentParser) -> None: ...

    def run(self, args: argparse.Namespace) -> int: ...


# In the order `turnstile --help` lists them.
COMMANDS: tuple[Command, ...] = (
    serve,
    demo,
    verify,
    recover,
    schema,
    bench,
    check_template,
    rescore,
    inspection,
    view,
)


def _deprecated(alias: str, command: Command) -> Callable[[argparse.Namespace], int]:
    """`command.run`, after a one-line notice on stderr that `alias` is its old name."""

    def run(args: argparse.Namespace) -> int:
        print(
            f"turnstile {alias}: deprecated, use `turnstile {command.NAME}` instead",
            file=sys.stderr,
        )
        return command.run(args)

    return run


def _description(command: Command) -> str | None:
    """The command's `DESCRIPTION`, for the commands that have one."""
    description: str | None = getattr(command, "DESCRIPTION", None)
    return description


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="turnstile",
        description="OpenAI-compatible recording reverse proxy for RL training: forwards "
        "Chat Completions to vLLM/SGLang and records exact token IDs, logprobs and rewards "
        "as Parquet shards.",
    )
    parser.add_argument("--version", action="version", version=f"turnstile {__version__}")
    # A fixed metavar: the choices shown are the commands, not their hidden aliases.
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        p = sub.add_parser(command.NAME, help=command.HELP, description=_description(command))
        command.add_arguments(p)
        p.set_defaults(func=command.run)
    for command in COMMANDS:
        aliases: tuple[str, ...] = getattr(command, "DEPRECATED_ALIASES", ())
        for alias in aliases:
            # No help at all (not even argparse.SUPPRESS, which Python 3.11 prints
            # as "==SUPPRESS=="): the command list leaves the alias out.
            p = sub.add_parser(alias, description=_description(command))
            command.add_arguments(p)
            p.set_defaults(func=_deprecated(alias, command))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # re-run by --workers
    try:
        result: int = args.func(args)
    except SettingsError as exc:
        print(f"turnstile: {exc}", file=sys.stderr)
        return EXIT_SETTINGS_ERROR
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    return result
