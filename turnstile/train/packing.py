"""Packed rows (one row, sequences back to back, ``cu_seqlens``) to padded rows and back.

``pack_batch`` lays sequences out as one ``(1, N)`` row with boundaries ``cu_seqlens``
(``(S + 1,)``, starting at 0). Everything that works per sequence (the future-KL cost,
sequence-level importance corrections and rejections, sequence-mean loss aggregation)
must not run across those boundaries, so ``turnstile.train.corrections`` and
``turnstile.train.losses`` unpack such a row into ``(S, L)`` padded rows (zeros beyond each
sequence's length), compute there, and repack. Works on numpy arrays and torch tensors
(indexing keeps gradients).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

Array = Any  # a numpy array or a torch tensor


def _is_torch(x: Array) -> bool:
    return type(x).__module__.startswith("torch")


def _numpy(x: Array) -> npt.NDArray[Any]:
    if _is_torch(x):
        return np.asarray(x.detach().cpu().numpy())
    return np.asarray(x)


def _layout(cu_seqlens: Array) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.bool_]]:
    """Flat indices ``(S, L)`` of each sequence's positions and where they are real."""
    cu = _numpy(cu_seqlens).astype(np.int64).reshape(-1)
    if cu.ndim != 1 or cu.size < 2 or cu[0] != 0 or (np.diff(cu) < 0).any():
        raise ValueError(f"cu_seqlens must start at 0 and not decrease, got {cu.tolist()}")
    lengths = np.diff(cu)
    width = int(lengths.max()) if lengths.size else 0
    offsets = np.arange(width, dtype=np.int64)[None, :]
    valid = offsets < lengths[:, None]
    index = np.where(valid, cu[:-1, None] + offsets, 0)
    return index, valid


def _flat(x: Array, total: int) -> Array:
    flat = x.reshape(-1)
    if flat.shape[0] != total:
        raise ValueError(f"a packed row of {flat.shape[0]} positions for cu_seqlens of {total}")
    return flat


def unpack(x: Array, cu_seqlens: Array) -> Array:
    """``(1, N)`` or ``(N,)`` packed values as ``(S, L)`` padded rows (0 beyond a length)."""
    index, valid = _layout(cu_seqlens)
    total = int(_numpy(cu_seqlens).reshape(-1)[-1])
    flat = _flat(x, total)
    if _is_torch(x):
        import torch

        idx = torch.as_tensor(index, device=x.device)
        keep = torch.as_tensor(valid, device=x.device)
        picked = flat[idx]
        return torch.where(keep, picked, torch.zeros_like(picked))
    picked = np.asarray(flat)[index]
    return np.where(valid, picked, np.zeros_like(picked))


def repack(x: Array, cu_seqlens: Array, like: Array) -> Array:
    """``(S, L)`` padded rows back to the packed layout of ``like`` (``(1, N)`` or ``(N,)``)."""
    _, valid = _layout(cu_seqlens)
    if _is_torch(x):
        import torch

        flat = x[torch.as_tensor(valid, device=x.device)]
    else:
        flat = np.asarray(x)[valid]
    return flat.reshape(like.shape)
