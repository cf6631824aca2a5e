"""Per-position top-k of the drafter's log-probabilities (spec §1.2), and bf16 helpers.

The drafter emits bf16 logits; the official code upcasts them to fp32 before top-k, so equal bf16
values stay equal and ties are common (spec §1.2: 81% of adjacent top-256 ranks tie in a synthetic
bf16 row). The order among ties is fixed here: logit descending, then token id ascending (spec §7,
a documented deviation from ``torch.topk``, whose tie order is undefined on CUDA).
"""
from __future__ import annotations

import numpy as np

from reference._checks import require_array, require_finite, require_int

_BF16_SHIFT = 16  # a bf16 is the high half of the float32 with the same sign, exponent and top mantissa
_BF16_QUIET_BIT = np.uint32(0x0040)  # top mantissa bit of a bf16: keeps a NaN a NaN after truncation


def bf16_to_float32(bits: np.ndarray) -> np.ndarray:
    """Widen bf16 bit patterns to float32 exactly.

    Args:
        bits: uint16 array of any shape, raw bf16 bit patterns.

    Returns:
        float32 array of the same shape (``bits << 16`` reinterpreted).
    """
    bits = np.asarray(bits)
    if bits.dtype != np.uint16:
        raise TypeError(f"bits must have dtype uint16 (raw bf16 patterns), got {bits.dtype}")
    return (bits.astype(np.uint32) << np.uint32(_BF16_SHIFT)).view(np.float32)


def float32_to_bf16(x: np.ndarray) -> np.ndarray:
    """Round to bf16 bit patterns, to nearest with ties to even; NaN stays NaN, inf stays inf.

    Args:
        x: floating array of any shape. float16/float64 are first converted to float32
            (float64 therefore rounds twice; pass float32 for a single rounding).

    Returns:
        uint16 array of the same shape.
    """
    x32 = np.asarray(require_array(x, "x", "float"), dtype=np.float32)
    bits = x32.view(np.uint32).astype(np.uint64)  # uint64: the rounding add cannot overflow
    lsb = (bits >> _BF16_SHIFT) & 1  # ties go to the even bf16
    rounded = (bits + 0x7FFF + lsb) >> _BF16_SHIFT
    truncated_nan = (bits >> _BF16_SHIFT) | _BF16_QUIET_BIT  # rounding could carry a NaN into inf
    return np.where(np.isnan(x32), truncated_nan, rounded).astype(np.uint16)


def _logsumexp_rows(x: np.ndarray) -> np.ndarray:
    """Natural-log log-sum-exp of each row of a finite float64 [L, V] array -> [L]."""
    m = x.max(axis=1, keepdims=True)  # [L, 1]; shifts so exp never overflows
    return (m + np.log(np.exp(x - m).sum(axis=1, keepdims=True)))[:, 0]


def topk_log_probs(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Top-k log-probabilities of each row (spec §1.2, with the tie rule of spec §7).

    Args:
        logits: [L, V] float16/float32/float64, finite, V >= 1 (drafter logits for L positions).
        k: int >= 0; the official code passes ``min(budget, V)``. k > V is clamped to V.

    Returns:
        values: float32 [L, k'] with k' = min(k, V): ``float32(logit64 - log_z)`` where log_z is the
            float64 log-sum-exp of the whole row (logits upcast to float64).
        ids: int64 [L, k'] token ids, ordered by logit descending, equal logits by lower id.
    """
    logits = require_array(logits, "logits", "float", ndim=2)
    k = require_int(k, "k", minimum=0)
    if logits.shape[1] == 0:
        raise ValueError("logits must have at least one column (vocabulary size V >= 1)")
    require_finite(logits, "logits")
    x = logits.astype(np.float64)  # [L, V]
    k = min(k, x.shape[1])
    ids = np.empty((x.shape[0], k), dtype=np.int64)  # [L, k']
    if k > 0:
        # Every logit >= the row's k-th largest is a candidate (ties at the boundary included);
        # a stable sort of the negated candidates, taken in ascending id order, keeps equal logits
        # in ascending id order. Same result as sorting the whole row, without sorting V values.
        kth = -np.partition(-x, k - 1, axis=1)[:, k - 1]  # [L]
        for row in range(x.shape[0]):
            cand = np.flatnonzero(x[row] >= kth[row])  # ascending ids
            ids[row] = cand[np.argsort(-x[row, cand], kind="stable")[:k]]
    log_z = _logsumexp_rows(x)  # [L]
    values = (np.take_along_axis(x, ids, axis=1) - log_z[:, None]).astype(np.float32)  # [L, k']
    return values, ids
