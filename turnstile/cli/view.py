"""`turnstile view DIR`: the command of the local web viewer (served by `turnstile.view.server`)."""

from __future__ import annotations

import argparse

from turnstile.view import server

NAME = "view"
HELP = "browse rollouts and tokens in a local web page"
DESCRIPTION = (
    "Serve a local web page (no external assets) to browse the rollouts "
    "and samples of an output directory: tokens coloured by loss mask and behaviour "
    "logprob, turn and tool boundaries, stitching breaks side by side, rewards, and "
    "reward and token counts over policy versions."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    server.add_arguments(p)


def run(args: argparse.Namespace) -> int:
    from turnstile.server.logs import setup_logging

    setup_logging("info")
    return server.run(args)
