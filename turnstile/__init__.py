"""Turnstile: an OpenAI-compatible recording reverse proxy for RL training.

The data path, one module each: routes -> proxy -> backend -> capture -> recorder ->
stitch -> shards -> reader. `turnstile.reader` is importable without the server.
"""

__version__ = "0.1.0"
