"""File-system durability helpers shared by the journal and the shard writer."""

from __future__ import annotations

import os
from pathlib import Path


def fsync_path(path: Path) -> None:
    """fsync a file or a directory by path (a directory's fsync makes renames durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
