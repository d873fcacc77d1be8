"""The coding agents the integration suite runs through Turnstile, from the npm registry.

Codex (`@openai/codex`, speaks Responses) and Claude Code (`@anthropic-ai/claude-code`,
speaks Anthropic Messages), pinned, installed with `npm install --prefix` into the cache
(both ship their native binaries inside the package). Keyed like every cached artefact by
a digest of the pinned versions and this file, so a new pin reinstalls them once.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from turnstile.dev.cache import (
    DevstackError,
    Log,
    _file_lock,
    _remove,
    _root,
    _run_logged,
    build_digest,
    is_current,
)

__all__ = ["AGENT_PACKAGES", "AgentCLIs", "ensure_agent_clis"]

AGENT_PACKAGES: Final[tuple[str, ...]] = (
    "@openai/codex@0.171.0",
    "@anthropic-ai/claude-code@2.1.332",
)
# Both packages together download about 250 MB (800 MB unpacked); minutes on a slow link.
NPM_INSTALL_TIMEOUT_S: Final[float] = 1200.0


@dataclass(frozen=True)
class AgentCLIs:
    """The installed agents' executables."""

    codex: Path
    claude: Path


def ensure_agent_clis(root: Path | None = None, log: Log = print) -> AgentCLIs:
    """Install the pinned agents into the cache unless they are there; their executables."""
    base = _root(root)
    target = base / "agent-clis"
    marker = target / ".built"
    digest = build_digest({"packages": list(AGENT_PACKAGES)}, [Path(__file__)])
    with _file_lock(base / "locks" / "agent-clis.lock"):
        if not is_current(marker, digest, "the coding-agent CLIs", log):
            npm = shutil.which("npm")
            if npm is None:
                raise DevstackError("npm is needed to install the coding agents (Node.js 20+)")
            _remove(target)
            target.mkdir(parents=True)
            command = [npm, "install", "--prefix", str(target), "--no-audit", "--no-fund"]
            _run_logged(
                [*command, *AGENT_PACKAGES],
                base / "logs" / "agent-clis-install.log",
                NPM_INSTALL_TIMEOUT_S,
                "npm install of the coding agents",
            )
            marker.write_text(digest + "\n", encoding="utf-8")
    bin_dir = target / "node_modules" / ".bin"
    return AgentCLIs(codex=bin_dir / "codex", claude=bin_dir / "claude")


if __name__ == "__main__":  # `python -m turnstile.dev.agent_clis`: install, print the paths
    clis = ensure_agent_clis()
    print(clis.codex)
    print(clis.claude)
