"""`turnstile view DIR`: a local web page to browse rollouts, samples and their tokens.

A small FastAPI app serves one page (HTML, CSS and JS shipped in `turnstile/view/static`,
no external assets) and a JSON API over the published shards of an output directory:

- `GET /api/overview`: the rollouts, and per policy version the mean reward and tokens;
- `GET /api/rollouts/{id}`: one rollout with its turns and samples, each sample's tokens
  as `[id, text, loss_mask, logprob, role, special]` (role from the chat template's markers when
  a tokenizer decodes the text), and each stitching break with the parent's and the
  sample's tokens around the first mismatch, and each sample's `image_spans`;
- `GET /media/{sha256}`: a stored image's bytes, which the page shows as a thumbnail at
  its placeholder span.

It binds 127.0.0.1 by default: the shards hold prompts, so exposing them is a choice.
"""

from __future__ import annotations

import argparse
import re
import statistics
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from turnstile.images import IMAGE_MIME_TYPES
from turnstile.view.roles import token_roles

if TYPE_CHECKING:
    from fastapi import FastAPI

    from turnstile.view.data import OutputData, TokenText

DEFAULT_PORT: Final[int] = 8101
STATIC_DIR: Final[Path] = Path(__file__).parent / "static"
# Tokens of one sample sent to the page: beyond this the browser's layout of one span
# per token gets slow, so the rest is cut off (and the page says so).
MAX_TOKENS_PER_SAMPLE: Final[int] = 60_000
# Tokens of context on each side of a break in the side-by-side view.
BREAK_WINDOW_TOKENS: Final[int] = 8
_SHA256: Final = re.compile(r"[0-9a-f]{64}")
# A stored image never changes under its hash; the sniffing guard keeps the browser to the
# recorded image type.
_MEDIA_HEADERS: Final[dict[str, str]] = {
    "Cache-Control": "public, max-age=31536000, immutable",
    "X-Content-Type-Options": "nosniff",
}
_STATIC_TYPES: Final[dict[str, str]] = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
}


def overview(data: OutputData, tokens: TokenText) -> dict[str, Any]:
    """Rollouts, and per policy version: rollouts, mean reward, mean tokens per sample."""
    rollouts = data.rollouts()
    samples = data.samples()
    by_version: dict[int, dict[str, list[float]]] = {}
    for r in rollouts:
        if r["max_policy_version"] is None:
            continue
        bucket = by_version.setdefault(
            r["max_policy_version"], {"reward": [], "tokens": [], "loss": [], "n": []}
        )
        bucket["n"].append(1.0)
        if r["reward"] is not None:
            bucket["reward"].append(r["reward"])
    for s in samples:
        if s["max_policy_version"] is None:
            continue
        bucket = by_version.setdefault(
            s["max_policy_version"], {"reward": [], "tokens": [], "loss": [], "n": []}
        )
        bucket["tokens"].append(s["num_tokens"])
        bucket["loss"].append(s["num_loss_tokens"])

    def mean(values: list[float]) -> float | None:
        return statistics.fmean(values) if values else None

    versions = [
        {
            "version": v,
            "rollouts": len(b["n"]),
            "mean_reward": mean(b["reward"]),
            "mean_tokens": mean(b["tokens"]),
            "mean_loss_tokens": mean(b["loss"]),
        }
        for v, b in sorted(by_version.items())
    ]
    return {
        "directory": str(data.directory),
        "tokenizer": str(tokens.path) if tokens.path else None,
        "rollouts": rollouts,
        "versions": versions,
        "reward_names": data.reward_names(),
    }


def _token_rows(sample: dict[str, Any], tokens: TokenText) -> list[list[Any]]:
    ids = [int(i) for i in sample["input_ids"][:MAX_TOKENS_PER_SAMPLE]]
    pieces = tokens.pieces(ids)
    special = [tokens.is_special(i) for i in ids]
    roles = token_roles(pieces, special)
    mask, lps = sample["loss_mask"], sample["behavior_logprobs"]
    return [
        [ids[i], pieces[i], int(mask[i]), lps[i], roles[i], int(special[i])]
        for i in range(len(ids))
    ]


def _break_view(
    rollout: dict[str, Any], sample: dict[str, Any], tokens: TokenText
) -> dict[str, Any] | None:
    parent_index = sample["parent_sample_index"]
    if parent_index is None:
        return None
    parents = [s for s in rollout["samples"] if s["sample_index"] == parent_index]
    pos = sample["break_position"] or 0
    lo, hi = max(0, pos - BREAK_WINDOW_TOKENS), pos + BREAK_WINDOW_TOKENS
    parent_ids = [int(i) for i in parents[0]["input_ids"][lo:hi]] if parents else []
    own_ids = [int(i) for i in sample["input_ids"][lo:hi]]
    return {
        "kind": sample["break_kind"],
        "position": pos,
        "start": lo,
        "detail": sample["break_detail"],
        "parent": parent_index,
        "parent_tokens": [[i, tokens.piece(i)] for i in parent_ids],
        "tokens": [[i, tokens.piece(i)] for i in own_ids],
    }


def rollout_view(data: OutputData, tokens: TokenText, rollout_id: str) -> dict[str, Any] | None:
    rollout = data.rollout(rollout_id)
    if rollout is None:
        return None
    out_samples = []
    for s in rollout["samples"]:
        out_samples.append(
            {
                **{
                    k: v
                    for k, v in s.items()
                    if k not in ("input_ids", "loss_mask", "behavior_logprobs")
                },
                "tokens": _token_rows(s, tokens),
                "truncated": s["num_tokens"] > MAX_TOKENS_PER_SAMPLE,
                "break": _break_view(rollout, s, tokens),
            }
        )
    return {**rollout, "samples": out_samples, "decoded": tokens.available}


def build_app(directory: Path, tokenizer: Path | None = None) -> FastAPI:
    """The viewer app over `directory` (tokens decoded with `tokenizer` when given)."""
    from fastapi import FastAPI, HTTPException
    from fastapi.responses import JSONResponse, Response

    from turnstile.view.data import OutputData, TokenText, resolve_tokenizer

    data = OutputData(directory)
    tokens = TokenText(resolve_tokenizer(tokenizer, data.reader))
    app = FastAPI(title="Turnstile viewer", docs_url=None, redoc_url=None, openapi_url=None)

    def static(name: str) -> Response:
        path = STATIC_DIR / name
        return Response(
            path.read_bytes(),
            media_type=_STATIC_TYPES[path.suffix],
            headers={"Cache-Control": "no-cache"},
        )

    @app.get("/", include_in_schema=False)
    def index() -> Response:
        return static("index.html")

    @app.get("/static/{name}", include_in_schema=False)
    def asset(name: str) -> Response:
        if name not in {p.name for p in STATIC_DIR.iterdir()}:
            raise HTTPException(404, "no such asset")
        return static(name)

    @app.get("/media/{sha256}", include_in_schema=False)
    def media(sha256: str) -> Response:
        if not _SHA256.fullmatch(sha256):
            raise HTTPException(400, "a media path is the image's SHA-256 in 64 hex digits")
        image = data.image(sha256)
        if image is None:
            raise HTTPException(404, f"no stored image {sha256}")
        mime = (
            image.mime_type if image.mime_type in IMAGE_MIME_TYPES else "application/octet-stream"
        )
        return Response(image.data, media_type=mime, headers=_MEDIA_HEADERS)

    @app.get("/api/overview")
    def api_overview() -> JSONResponse:
        return JSONResponse(overview(data, tokens))

    @app.get("/api/rollouts/{rollout_id}")
    def api_rollout(rollout_id: str) -> JSONResponse:
        view = rollout_view(data, tokens, rollout_id)
        if view is None:
            raise HTTPException(404, f"no rollout {rollout_id!r}")
        return JSONResponse(view)

    return app


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("directory", type=Path, help="Turnstile output directory")
    p.add_argument(
        "--tokenizer",
        type=Path,
        metavar="DIR",
        help="local tokenizer directory to decode tokens (default: the one the "
        "shards were recorded with, if it exists here; else ids are shown)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument(
        "--port", type=int, default=DEFAULT_PORT, help=f"port to bind (default {DEFAULT_PORT})"
    )


def run(args: argparse.Namespace) -> int:
    import uvicorn

    try:
        app = build_app(args.directory, args.tokenizer)
    except (FileNotFoundError, OSError, ValueError) as exc:
        print(f"turnstile view: {exc}")
        return 2
    print(f"Turnstile viewer for {args.directory}: http://{args.host}:{args.port}/")
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0
