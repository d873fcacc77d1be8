"""`turnstile schema`: print the Parquet schema of every table as Markdown."""

from __future__ import annotations

import argparse

NAME = "schema"
HELP = "print the Parquet schema as a Markdown table"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The command takes no arguments."""


def run(args: argparse.Namespace) -> int:
    from turnstile.output.schema import schema_markdown

    print(schema_markdown())
    return 0
