"""KV-cache compaction after acceptance (spec §1.5).

Row past_len + accepted[j] moves to past_len + j. Because accepted[0] = 0 and the indices strictly
increase, accepted[j] >= j, so a forward in-place copy reads every source before overwriting it;
this reference returns a copy with the same result. Rows past past_len + m keep their old (stale)
contents; the caller crops its length to past_len + m.
"""
from __future__ import annotations

import numpy as np

from reference._checks import as_int64, require_array, require_int, require_shape


def _check_cache(cache, ndim_min: int) -> np.ndarray:
    """Any ndarray of rank >= ndim_min (rows along the first axis after the batch axes)."""
    if not isinstance(cache, np.ndarray):
        raise TypeError(f"cache must be a numpy.ndarray, got {type(cache).__name__}")
    if cache.ndim < ndim_min:
        raise ValueError(f"cache must have at least {ndim_min} dimensions, got shape {cache.shape}")
    return cache


def _check_accepted(accepted: np.ndarray, past_len: int, n_rows: int) -> None:
    """accepted int64 [m]: m >= 1, starts at 0, strictly increasing, last row inside the cache."""
    if accepted.shape[0] < 1:
        raise ValueError("accepted must hold at least the root (m >= 1)")
    if accepted[0] != 0:
        raise ValueError(f"accepted[0] must be 0 (the root), got {accepted[0]}")
    if np.any(np.diff(accepted) <= 0):
        raise ValueError("accepted must be strictly increasing")
    if past_len + accepted[-1] >= n_rows:
        raise ValueError(f"accepted rows must lie in the cache: past_len + accepted[-1] must be < {n_rows}")


def compact(cache: np.ndarray, past_len: int, accepted: np.ndarray) -> np.ndarray:
    """Gather the accepted tree rows of one request's cache into consecutive rows.

    Args:
        cache: [S, ...] any dtype (latent rows [S, 512], rope rows [S, 64], side buffers).
        past_len: int >= 0, rows before the tree.
        accepted: int [m], accepted node indices (``AcceptResult.accepted``).

    Returns:
        A copy of ``cache`` with row past_len + j = old row past_len + accepted[j] for j < m.
    """
    cache = _check_cache(cache, 1)
    past_len = require_int(past_len, "past_len", minimum=0)
    acc = as_int64(require_array(accepted, "accepted", "int", ndim=1), "accepted")
    _check_accepted(acc, past_len, cache.shape[0])
    out = cache.copy()
    out[past_len:past_len + acc.shape[0]] = cache[past_len + acc]
    return out


def compact_batch(cache: np.ndarray, past_lens: np.ndarray, accepted: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """``compact`` for every request of a batch.

    Args:
        cache: [bs, S, ...] any dtype.
        past_lens: int [bs], >= 0.
        accepted: int [bs, M]; row b's first lengths[b] entries are its accepted nodes, the rest
            (padding, -1 from ``accept_batch``) are ignored.
        lengths: int [bs], 1 <= lengths[b] <= M.

    Returns:
        A compacted copy of ``cache``.
    """
    cache = _check_cache(cache, 2)
    past_lens = as_int64(require_array(past_lens, "past_lens", "int", ndim=1), "past_lens")
    acc = as_int64(require_array(accepted, "accepted", "int", ndim=2), "accepted")
    lengths = as_int64(require_array(lengths, "lengths", "int", ndim=1), "lengths")
    bs, n_rows = cache.shape[:2]
    require_shape(past_lens, "past_lens", (bs,))
    require_shape(lengths, "lengths", (bs,))
    if acc.shape[0] != bs:
        raise ValueError(f"accepted must have shape [{bs}, M], got {acc.shape}")
    if np.any(past_lens < 0):
        raise ValueError("past_lens must be >= 0")
    if np.any(lengths < 1) or np.any(lengths > acc.shape[1]):
        raise ValueError(f"lengths must be in [1, {acc.shape[1]}]")
    for b in range(bs):
        _check_accepted(acc[b, :lengths[b]], int(past_lens[b]), n_rows)

    out = cache.copy()
    for b in range(bs):
        rows = int(past_lens[b]) + acc[b, :lengths[b]]  # [m]
        out[b, int(past_lens[b]):int(past_lens[b]) + int(lengths[b])] = cache[b, rows]
    return out
