"""Process-level tuning of the serving path: the garbage collector and thread names.

A proxy decodes tens of thousands of short-lived objects per second (every JSON body
and SSE event), while the process also holds millions of long-lived ones (transformers,
pyarrow, pydantic models). With CPython's default thresholds a full collection scans
all of them every few requests, and the collector dominates CPU and tail latency.
`tune_gc` moves what start-up allocated into the permanent generation (`gc.freeze`)
and raises the thresholds so that young collections run per ~tens of requests and old
ones rarely. Reference cycles are still collected.

`name_thread` gives the calling thread a kernel-visible name (Linux `comm`), so
`top -H`, py-spy and `turnstile bench` can tell the writer and journal threads apart.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import sys
from typing import Final

# Young-generation threshold: objects allocated (net) before a gen-0 collection. One
# 60 KB response decodes into ~5,000 objects; 50,000 collects once per ~10 requests.
GC_GEN0_THRESHOLD: Final[int] = 50_000
# Gen-0 collections per gen-1 collection, and gen-1 per full collection: full scans
# of the (frozen-excluded) heap at most every ~20,000 requests' worth of allocation.
GC_GEN1_THRESHOLD: Final[int] = 20
GC_GEN2_THRESHOLD: Final[int] = 100
# Linux limits thread names to 15 bytes plus the terminating NUL.
MAX_THREAD_NAME: Final[int] = 15
_PR_SET_NAME: Final[int] = 15


def tune_gc() -> None:
    """Freeze everything allocated so far and raise the collection thresholds."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_GEN0_THRESHOLD, GC_GEN1_THRESHOLD, GC_GEN2_THRESHOLD)


def name_thread(name: str) -> None:
    """Set the calling thread's kernel name (Linux only; a no-op elsewhere)."""
    if not sys.platform.startswith("linux"):
        return
    path = ctypes.util.find_library("c")
    if path is None:
        return
    try:
        libc = ctypes.CDLL(path, use_errno=True)
        libc.prctl(_PR_SET_NAME, name.encode()[:MAX_THREAD_NAME], 0, 0, 0)
    except (OSError, AttributeError):
        return
