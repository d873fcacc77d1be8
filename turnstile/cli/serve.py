"""`turnstile serve`: run the recording proxy in front of one or more backends.

Settings come from `--config`, then `TURNSTILE_*` environment variables, then the flags
(flags win). With `--workers N` the first process supervises N worker processes that
share the port; each worker re-runs this command.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any

from turnstile.settings import load_settings

NAME = "serve"
HELP = "run the recording proxy in front of a backend"
DESCRIPTION = (
    "Run the recording proxy. Settings come from --config, then "
    "TURNSTILE_* environment variables, then these flags (flags win)."
)

log = logging.getLogger("turnstile")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, help="YAML settings file (see configs/)")
    p.add_argument(
        "--backend",
        action="append",
        metavar="[MODEL=]URL",
        help="backend base URL, e.g. http://127.0.0.1:8000 (env TURNSTILE_BACKENDS); repeat "
        "for several (rollouts stay on one by consistent hashing); MODEL=URL serves only "
        "requests for model MODEL",
    )
    p.add_argument(
        "--output",
        help="directory for shards (default turnstile-output), or an object store URI "
        "such as s3://bucket/prefix (shards are staged locally in --staging-dir)",
    )
    p.add_argument(
        "--staging-dir",
        type=Path,
        help="local directory for the journal and staged shards when --output "
        "is a URI (default turnstile-staging)",
    )
    p.add_argument(
        "--backend-kind",
        choices=["vllm", "sglang", "auto"],
        help="the backends' dialect (default vllm; auto asks /v1/models)",
    )
    p.add_argument("--host", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port to bind (default 8100)")
    p.add_argument(
        "--tokenizer",
        type=Path,
        help="local tokenizer directory: classifies stitching breaks and tokenizes for "
        "backends that return no token IDs",
    )
    p.add_argument(
        "--mode",
        choices=["record", "tito"],
        help="record (default): forward chat requests as they are; tito: token-in-token-out, "
        "exact multi-turn samples by construction (needs --tokenizer)",
    )
    p.add_argument(
        "--tito-on-rewrite",
        choices=["split", "refuse"],
        help="TITO: a request that rewrites its rollout's history starts a new "
        "sample segment (split, default) or gets 409 (refuse)",
    )
    p.add_argument(
        "--chat-template",
        type=Path,
        metavar="FILE.jinja",
        help="TITO: render with this chat template instead of the tokenizer's",
    )
    p.add_argument(
        "--chat-template-kwargs",
        type=json.loads,
        metavar="JSON",
        help="TITO: template variables for every request, e.g. '{\"enable_thinking\": false}'",
    )
    p.add_argument(
        "--allow-unsafe-template",
        action="store_true",
        default=None,
        help="TITO: accept a chat template that fails the audit",
    )
    p.add_argument(
        "--tito-history",
        choices=["sampled", "template"],
        help="TITO: keep what the model sampled (sampled, default; a template whose "
        "re-render differs is used with a warning) or require the template's own "
        "rendering (template: such a template is refused unless a verified fix applies)",
    )
    p.add_argument(
        "--preserve-tool-arguments",
        action="store_true",
        default=None,
        help="record mode: whole chat answers keep each tool call's arguments as the model "
        "sampled them (needs --tokenizer; see docs/tito.md)",
    )
    p.add_argument(
        "--no-template-fixes",
        dest="tito_apply_fixes",
        action="store_false",
        default=None,
        help="TITO: do not apply a fix the audit verified",
    )
    p.add_argument("--tool-parser", help="TITO: tool-call parser (default: from the template)")
    p.add_argument("--reasoning-parser", help="TITO: reasoning parser (default: from the template)")
    p.add_argument("--top-logprobs", type=int, help="also record the top-k logprobs (0-20)")
    p.add_argument("--policy-version", type=int, help="initial policy version (default 0)")
    p.add_argument(
        "--stream-whole-calls",
        action="store_true",
        default=None,
        help="send whole calls upstream as streams and assemble the answer, so a policy "
        "switch during one is placed per token (default off)",
    )
    p.add_argument(
        "--image-token-id",
        type=int,
        help="images: the placeholder token id whose runs in the prompt are the images "
        "(default: image_token_id of config.json in --processor or --tokenizer)",
    )
    p.add_argument(
        "--processor",
        type=Path,
        metavar="DIR",
        help="images: the model directory (or preprocessor_config.json) whose image "
        "processor digest each image turn records (default: --tokenizer's, if it has one)",
    )
    p.add_argument(
        "--remote-images",
        choices=["url", "fetch", "refuse"],
        help="remote image URLs: record the URL only (default), fetch and store the bytes, "
        "or refuse them",
    )
    p.add_argument(
        "--remote-image-hosts",
        metavar="HOST[,HOST...]",
        help="with --remote-images fetch: the only hosts images are fetched from",
    )
    p.add_argument(
        "--backend-api-key-env",
        metavar="NAME",
        help="name of the environment variable holding the backend's API key",
    )
    p.add_argument(
        "--api-key-env",
        action="append",
        metavar="NAME",
        help="environment variable holding a client API key (repeat for several keys); "
        "required to bind a non-loopback address",
    )
    p.add_argument(
        "--admin-api-key-env",
        metavar="NAME",
        help="environment variable holding the admin key for /admin/* and rewards",
    )
    p.add_argument("--writer-id", help="unique id of this process in shard names")
    p.add_argument(
        "--workers",
        type=int,
        help="worker processes sharing the port (default 1; see docs/deployment.md)",
    )
    p.add_argument(
        "--server",
        choices=["uvicorn", "raw"],
        help="HTTP server under the app: uvicorn (default) or raw (asyncio + httptools); "
        "see docs/performance.md",
    )
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    p.add_argument(
        "--log-format",
        choices=["text", "json"],
        help="text (default) or one JSON object per line with request and rollout ids",
    )


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The settings the flags set (None: not given, the file or environment decides)."""
    return {
        "backends": args.backend,
        "backend_kind": args.backend_kind,
        "staging_dir": args.staging_dir,
        "output": args.output,
        "host": args.host,
        "port": args.port,
        "tokenizer": args.tokenizer,
        "top_logprobs": args.top_logprobs,
        "mode": args.mode,
        "tito_on_rewrite": args.tito_on_rewrite,
        "chat_template": args.chat_template,
        "chat_template_kwargs": args.chat_template_kwargs,
        "allow_unsafe_template": args.allow_unsafe_template,
        "tito_apply_fixes": args.tito_apply_fixes,
        "tito_history": args.tito_history,
        "preserve_tool_arguments": args.preserve_tool_arguments,
        "tool_parser": args.tool_parser,
        "reasoning_parser": args.reasoning_parser,
        "policy_version": args.policy_version,
        "stream_whole_calls": args.stream_whole_calls,
        "image_token_id": args.image_token_id,
        "processor": args.processor,
        "remote_images": args.remote_images,
        "remote_image_hosts": args.remote_image_hosts,
        "backend_api_key_env": args.backend_api_key_env,
        "writer_id": args.writer_id,
        "api_key_env": args.api_key_env,
        "admin_api_key_env": args.admin_api_key_env,
        "log_level": args.log_level,
        "log_format": args.log_format,
        "workers": args.workers,
        "server": args.server,
    }


def run(args: argparse.Namespace) -> int:
    from turnstile.server.logs import setup_logging
    from turnstile.server.workers import worker_env

    settings = load_settings(args.config, _overrides(args))
    setup_logging(settings.log_level, settings.log_format)
    worker = worker_env(settings.workers)
    if worker is None:
        log.info("settings: %s", settings.public_dict())
    if settings.workers > 1 and worker is None:
        from turnstile.server.supervisor import run_workers

        return run_workers(settings, args.argv)
    from turnstile.server.serve import run_server

    run_server(settings, worker)
    return 0
