"""Token-in-token-out (TITO) mode: drift-free multi-turn rollouts by construction.

In record mode the backend re-renders and re-tokenizes the whole conversation every turn,
and a rollout only stitches into one training sequence when that happens to reproduce
what was sampled. In TITO mode (`--mode tito`) Turnstile keeps each rollout's token state
and sends the backend token IDs: the previous prompt, the sampled completion and only the
new messages rendered with the chat template. Every turn's prompt then extends the last
one token for token, so the stitched sample is exactly what the backend consumed and
produced.

* ``render``: the token delta of new messages (``TemplateRenderer``);
* ``history``: per-rollout token states and whether a request extends one (``match``);
* ``convert``: chat request -> token-ID completions request, and the answer back;
* ``generate``: image turns: token IDs plus the images to vLLM's token-in route;
* ``engine``: ``TitoEngine``, TITO mode's request path and per-rollout token state;
* ``backend``: ``TitoBackend``, the engine behind the ``Backend`` seam, around the real one;
* ``setup``: building the engine from settings, with the template audit gate.
"""

from turnstile.tito.backend import TitoBackend
from turnstile.tito.engine import RewritePolicy, TitoEngine
from turnstile.tito.gate import TemplateRefused, build_engine
from turnstile.tito.history import Match, TurnState, match
from turnstile.tito.render import Delta, RenderError, TemplateRenderer

__all__ = [
    "Delta",
    "Match",
    "RenderError",
    "RewritePolicy",
    "TemplateRefused",
    "TemplateRenderer",
    "TitoBackend",
    "TitoEngine",
    "TurnState",
    "build_engine",
    "match",
]
