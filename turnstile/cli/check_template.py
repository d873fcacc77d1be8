"""``turnstile check-template``: audit a chat template (or the vendored corpus) for TITO.

Exit status: 0 when TITO mode would accept the template under `--tito-history` (and for a
corpus run), 1 when it would refuse it, 2 for bad input (no tokenizer, no template,
unreadable files, a template that renders nothing). With `sampled` (the proxy's default)
the gate is TITO-exactness: every delta can be found, so every sample equals the token
stream. With `template` the context must also be what the template renders
(deployment-faithful), as it is or with a verified fix, which the proxy then applies.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

__all__ = [
    "DESCRIPTION",
    "EXIT_BAD_INPUT",
    "EXIT_NOT_SAFE",
    "EXIT_SAFE",
    "HELP",
    "NAME",
    "accepted_by_tito",
    "add_arguments",
    "run",
]

NAME = "check-template"
HELP = "audit a chat template for token-in-token-out stitching"
DESCRIPTION = (
    "Render a battery of conversations with a tokenizer's chat template (or "
    "--template) and check, per message kind, that each rendering extends the previous "
    "one in text and tokens where TITO joins prompt, completion and new messages, and "
    "that assistant turns end with a stop token. Exits 0 if TITO mode accepts it under "
    "--tito-history (sampled: TITO-exact; template: also deployment-faithful, or made so by "
    "a verified fix), 1 if not, 2 for bad input."
)

EXIT_SAFE = 0
EXIT_NOT_SAFE = 1
EXIT_BAD_INPUT = 2


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "tokenizer",
        nargs="?",
        type=Path,
        metavar="TOKENIZER_DIR",
        help="local Hugging Face tokenizer directory (its chat template is audited unless "
        "--template is given)",
    )
    p.add_argument(
        "--template",
        type=Path,
        metavar="FILE.jinja",
        help="audit this chat template instead of the tokenizer's",
    )
    p.add_argument("--json", type=Path, metavar="FILE", help="also write the report as JSON")
    p.add_argument(
        "--markdown", action="store_true", help="print a Markdown table instead of the text report"
    )
    p.add_argument(
        "--chat-template-kwargs",
        type=json.loads,
        metavar="JSON",
        default=None,
        help="extra template variables, e.g. '{\"preserve_thinking\": true}'",
    )
    p.add_argument(
        "--stop-token-id",
        type=int,
        action="append",
        default=[],
        metavar="ID",
        help="a token the model also stops on (beyond EOS and generation_config.json); repeatable",
    )
    p.add_argument(
        "--raw-messages",
        action="store_true",
        help="render messages exactly as given, not as vLLM hands them to the "
        "template (JSON-string tool arguments parsed into dicts)",
    )
    p.add_argument(
        "--tito-history",
        choices=("sampled", "template"),
        default="sampled",
        help="the proxy's tito_history the exit status answers for (default: sampled)",
    )
    p.add_argument(
        "--corpus",
        action="store_true",
        help="audit every vendored llama.cpp template that pairs with a vendored "
        "vocabulary (no TOKENIZER_DIR)",
    )


def _fail(message: str) -> int:
    print(f"turnstile check-template: {message}", file=sys.stderr)
    return EXIT_BAD_INPUT


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _run_corpus(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from turnstile.dev.template_corpus import audit_corpus, corpus_markdown, corpus_summary

    rows = audit_corpus(log=lambda line: print(line, file=sys.stderr))
    if args.json is not None:
        _write_json(args.json, [asdict(row) for row in rows])
    if args.markdown:
        print(corpus_markdown(rows), end="")
    else:
        answer = {True: "yes", False: "NO", None: "not audited"}
        for row in rows:
            failing = f" (failing: {', '.join(row.failing_kinds)})" if row.failing_kinds else ""
            print(
                f"{row.template} [{row.level}]: TITO-exact {answer[row.tito_exact]}, "
                f"deployment-faithful {answer[row.faithful]}{failing}"
                f"{' - ' + row.note if row.note else ''}"
            )
        print(", ".join(f"{key}: {value}" for key, value in corpus_summary(rows).items()))
    return EXIT_SAFE


def _kinds_markdown(report: Any) -> str:
    lines = [
        "| kind | status | text prefix | token prefix | end of turn |",
        "| --- | --- | --- | --- | --- |",
    ]
    for result in report.kinds:
        end = result.end_of_turn
        eot = (
            "—"
            if end is None
            else (
                f"`{end.marker}`{' (stop)' if end.is_stop_token else ' (not a stop token)'}"
                if end.marker
                else "none"
            )
        )
        marks = {True: "yes", False: "no", None: "—"}
        lines.append(
            f"| `{result.kind}` | {result.status} | {marks[result.prefix_preserving]} | "
            f"{marks[result.token_prefix_preserving]} | {eot} |"
        )
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:
    """The subcommand: parse-checked ``args`` in, exit status out."""
    if args.corpus:
        if args.tokenizer is not None or args.template is not None:
            return _fail("--corpus takes no TOKENIZER_DIR or --template")
        return _run_corpus(args)
    if args.tokenizer is None:
        return _fail("give a TOKENIZER_DIR (or --corpus)")
    if args.chat_template_kwargs is not None and not isinstance(args.chat_template_kwargs, dict):
        return _fail("--chat-template-kwargs must be a JSON object")
    from turnstile.output.tokenizer import LocalTokenizer, TokenizerError
    from turnstile.tito.templates.audit import audit_template
    from turnstile.tito.templates.model import AuditError
    from turnstile.tito.templates.report import format_report

    template: str | None = None
    if args.template is not None:
        try:
            template = args.template.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            return _fail(f"cannot read {args.template}: {exc}")
    try:
        tokenizer = LocalTokenizer(args.tokenizer)
    except TokenizerError as exc:
        return _fail(str(exc))
    try:
        report = audit_template(
            tokenizer,
            template,
            chat_template_kwargs=args.chat_template_kwargs,
            stop_token_ids=args.stop_token_id,
            vllm_messages=not args.raw_messages,
        )
    except AuditError as exc:
        return _fail(str(exc))
    if args.template is not None:
        report.template_source = str(args.template)
    if args.json is not None:
        try:
            _write_json(args.json, report.to_dict())
        except OSError as exc:
            return _fail(f"cannot write {args.json}: {exc}")
    label = str(args.template or args.tokenizer)
    if args.markdown:
        print(_kinds_markdown(report), end="")
    else:
        print(format_report(report, label), end="")
    accepted = accepted_by_tito(report, args.tito_history)
    verdict = "accepts" if accepted else "refuses"
    print(f"TITO mode with tito_history: {args.tito_history} {verdict} this template")
    return EXIT_SAFE if accepted else EXIT_NOT_SAFE


def accepted_by_tito(report: Any, history: str) -> bool:
    """Whether TITO mode's gate (`turnstile.tito.gate.choose_template`) takes a template
    with this audit report under `history`."""
    from turnstile.tito.gate import applicable_fixes

    if history == "sampled":
        return bool(report.tito_exact)
    return bool(report.tito_safe or (report.tito_exact and applicable_fixes(report)))
