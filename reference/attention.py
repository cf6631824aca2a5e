"""Tree-verify attention in weight-absorbed MLA form (limits §2; DeepSeek-V3 attn_impl="absorb").

Per query (tree node) i, head h and key j: s = scale * (q_latent[i,h]·kv_latent[j] + q_rope[i,h]·k_rope[j]).
Query i sees all N cached rows and tree row N + j iff visibility[i, j] (ancestor-or-self); the values
are the latent rows themselves. Everything is computed in float64.
"""
from __future__ import annotations

import numpy as np

from reference._checks import require_array, require_finite, require_real, require_shape


def _check_scale(scale) -> float:
    """A finite scale > 0."""
    scale = require_real(scale, "scale")
    if scale <= 0.0:
        raise ValueError(f"scale must be > 0, got {scale}")
    return scale


def _check_float(arr, name: str, ndim: int) -> np.ndarray:
    """A finite floating array of rank ``ndim``."""
    arr = require_array(arr, name, "float", ndim=ndim)
    require_finite(arr, name)
    return arr


def _check_diagonal(visibility: np.ndarray) -> None:
    """Every tree query must see itself (else a row could be empty)."""
    if not np.all(np.diagonal(visibility, axis1=-2, axis2=-1)):
        raise ValueError("visibility must include the diagonal (every node sees itself)")


def _attend(q_latent, q_rope, kv_latent, k_rope, visibility, scale: float) -> tuple[np.ndarray, np.ndarray]:
    """Checked-input core: float64 (out [T, H, Dl], lse [T, H])."""
    t, h, d_latent = q_latent.shape
    if t == 0:  # no queries: nothing to reduce over
        return np.zeros((0, h, d_latent)), np.zeros((0, h))
    n_past = kv_latent.shape[0] - t
    ql, qr = q_latent.astype(np.float64), q_rope.astype(np.float64)  # [T, H, Dl], [T, H, Dr]
    kv, kr = kv_latent.astype(np.float64), k_rope.astype(np.float64)  # [N + T, Dl], [N + T, Dr]
    scores = scale * (np.einsum("thd,jd->thj", ql, kv) + np.einsum("thd,jd->thj", qr, kr))  # [T, H, N + T]
    visible = np.concatenate([np.ones((t, n_past), dtype=bool), visibility], axis=1)  # [T, N + T]
    scores = np.where(visible[:, None, :], scores, -np.inf)
    row_max = scores.max(axis=2, keepdims=True)  # [T, H, 1]; finite: the diagonal is always visible
    weights = np.exp(scores - row_max)  # [T, H, N + T]; hidden keys give exp(-inf) = 0
    total = weights.sum(axis=2, keepdims=True)  # [T, H, 1]
    out = np.einsum("thj,jd->thd", weights, kv) / total  # [T, H, Dl]
    lse = (row_max + np.log(total))[:, :, 0]  # [T, H]
    return out, lse


def verify_attention(
    q_latent: np.ndarray,
    q_rope: np.ndarray,
    kv_latent: np.ndarray,
    k_rope: np.ndarray,
    visibility: np.ndarray,
    scale: float,
) -> tuple[np.ndarray, np.ndarray]:
    """Tree-masked absorbed-MLA attention of T tree queries over N cached + T tree keys.

    Args:
        q_latent: [T, H, Dl] floating; absorbed query W_UK^T q_nope (Dl = 512 for Kimi / DeepSeek-V3).
        q_rope: [T, H, Dr] floating; RoPE'd query part (Dr = 64).
        kv_latent: [N + T, Dl] floating; normed latent cache rows, cached then tree; also the values.
        k_rope: [N + T, Dr] floating; RoPE'd key rows.
        visibility: bool [T, T]; query i sees tree key j iff visibility[i, j]; diagonal must be true.
        scale: finite > 0 softmax scale (e.g. 0.144680 for Kimi K2 with YaRN factor 64, limits §2).

    Returns:
        out: float64 [T, H, Dl], softmax-weighted sum of the visible latent rows.
        lse: float64 [T, H], natural-log log-sum-exp of the scaled visible scores.
    """
    q_latent = _check_float(q_latent, "q_latent", 3)
    q_rope = _check_float(q_rope, "q_rope", 3)
    kv_latent = _check_float(kv_latent, "kv_latent", 2)
    k_rope = _check_float(k_rope, "k_rope", 2)
    visibility = require_array(visibility, "visibility", "bool", ndim=2)
    scale = _check_scale(scale)
    t, h, d_latent = q_latent.shape
    require_shape(q_rope, "q_rope", (t, h, q_rope.shape[2]))
    if kv_latent.shape[0] < t or kv_latent.shape[1] != d_latent:
        raise ValueError(f"kv_latent must have shape [N + {t}, {d_latent}], got {kv_latent.shape}")
    require_shape(k_rope, "k_rope", (kv_latent.shape[0], q_rope.shape[2]))
    require_shape(visibility, "visibility", (t, t))
    _check_diagonal(visibility)
    return _attend(q_latent, q_rope, kv_latent, k_rope, visibility, scale)


def verify_attention_batch(
    q_latent: np.ndarray,
    q_rope: np.ndarray,
    kv_latent: np.ndarray,
    k_rope: np.ndarray,
    past_lens: np.ndarray,
    tree_sizes: np.ndarray,
    visibility: np.ndarray,
    scale: float,
) -> tuple[np.ndarray, np.ndarray]:
    """Ragged batch of ``verify_attention``: request b's tree rows are kv rows past_lens[b] ... + tree_sizes[b] - 1.

    Args:
        q_latent: [bs, Tc, H, Dl] floating; rows >= tree_sizes[b] are padding (ignored).
        q_rope: [bs, Tc, H, Dr] floating.
        kv_latent: [bs, S, Dl] floating; rows past past_lens[b] + tree_sizes[b] are ignored.
        k_rope: [bs, S, Dr] floating.
        past_lens: int [bs], >= 0; cached rows N of each request.
        tree_sizes: int [bs], 0 <= size <= Tc (0: an idle slot); past_lens + tree_sizes <= S.
        visibility: bool [bs, Tc, Tc]; only the [:size, :size] block is read; its diagonal must be true.
        scale: finite > 0.

    Returns:
        out: float64 [bs, Tc, H, Dl], zeros in padding rows.
        lse: float64 [bs, Tc, H], zeros in padding rows.
    """
    q_latent = _check_float(q_latent, "q_latent", 4)
    q_rope = _check_float(q_rope, "q_rope", 4)
    kv_latent = _check_float(kv_latent, "kv_latent", 3)
    k_rope = _check_float(k_rope, "k_rope", 3)
    past_lens = require_array(past_lens, "past_lens", "int", ndim=1)
    tree_sizes = require_array(tree_sizes, "tree_sizes", "int", ndim=1)
    visibility = require_array(visibility, "visibility", "bool", ndim=3)
    scale = _check_scale(scale)
    bs, tc, h, d_latent = q_latent.shape
    d_rope = q_rope.shape[3]
    s = kv_latent.shape[1]
    require_shape(q_rope, "q_rope", (bs, tc, h, d_rope))
    require_shape(kv_latent, "kv_latent", (bs, s, d_latent))
    require_shape(k_rope, "k_rope", (bs, s, d_rope))
    require_shape(past_lens, "past_lens", (bs,))
    require_shape(tree_sizes, "tree_sizes", (bs,))
    require_shape(visibility, "visibility", (bs, tc, tc))
    if np.any(past_lens < 0):
        raise ValueError("past_lens must be >= 0")
    if np.any(tree_sizes < 0) or np.any(tree_sizes > tc):
        raise ValueError(f"tree_sizes must be in [0, {tc}]")
    if np.any(past_lens.astype(np.int64) + tree_sizes.astype(np.int64) > s):
        raise ValueError(f"past_lens + tree_sizes must be <= S = {s}")
    for b in range(bs):
        _check_diagonal(visibility[b, :tree_sizes[b], :tree_sizes[b]])

    out = np.zeros((bs, tc, h, d_latent), dtype=np.float64)
    lse = np.zeros((bs, tc, h), dtype=np.float64)
    for b in range(bs):
        n, t = int(past_lens[b]), int(tree_sizes[b])
        out[b, :t], lse[b, :t] = _attend(
            q_latent[b, :t], q_rope[b, :t], kv_latent[b, :n + t], k_rope[b, :n + t], visibility[b, :t, :t], scale
        )
    return out, lse
