"""reference/topk.py: top-k log-probabilities with the (logit desc, id asc) tie rule, and bf16 helpers."""
from __future__ import annotations

import numpy as np
import pytest

from reference.topk import bf16_to_float32, float32_to_bf16, topk_log_probs


def _direct_topk(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Independent oracle: np.lexsort per row (primary -logit, secondary id), float64 log-sum-exp via np.logaddexp."""
    x = logits.astype(np.float64)
    n_rows, vocab = x.shape
    k = min(k, vocab)
    values = np.empty((n_rows, k), dtype=np.float32)
    ids = np.empty((n_rows, k), dtype=np.int64)
    for row in range(n_rows):
        order = np.lexsort((np.arange(vocab), -x[row]))[:k]
        log_z = np.logaddexp.reduce(x[row])
        ids[row] = order
        values[row] = (x[row, order] - log_z).astype(np.float32)
    return values, ids


def _bf16_logits(rng: np.random.Generator, n_rows: int, vocab: int) -> np.ndarray:
    """float32 logits quantized through bf16: N(0, 2.5^2) rows with many exact ties (spec §1.2)."""
    return bf16_to_float32(float32_to_bf16(rng.normal(0.0, 2.5, (n_rows, vocab)).astype(np.float32)))


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_matches_direct_random(dtype) -> None:
    rng = np.random.default_rng(1)
    for _ in range(40):
        n_rows, vocab = int(rng.integers(0, 6)), int(rng.integers(1, 300))
        k = int(rng.integers(0, vocab + 5))
        logits = (rng.normal(0.0, rng.uniform(0.1, 8.0), (n_rows, vocab)) + rng.normal(0, 50)).astype(dtype)
        values, ids = topk_log_probs(logits, k)
        want_values, want_ids = _direct_topk(logits, k)
        assert values.dtype == np.float32 and ids.dtype == np.int64
        np.testing.assert_array_equal(ids, want_ids)
        np.testing.assert_allclose(values, want_values, rtol=1e-6, atol=1e-6)


def test_tie_heavy_bf16_rows() -> None:
    rng = np.random.default_rng(2)
    logits = _bf16_logits(rng, 8, 4096)
    values, ids = topk_log_probs(logits, 256)
    want_values, want_ids = _direct_topk(logits, 256)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_allclose(values, want_values, rtol=1e-6, atol=1e-6)
    ties = values[:, 1:] == values[:, :-1]
    assert ties.mean() > 0.3  # the rule is exercised, not vacuous
    assert np.all(ids[:, 1:][ties] > ids[:, :-1][ties])  # equal values: ascending ids


def test_equal_logits_lowest_id_first() -> None:
    logits = np.array([[1.0, 3.0, 3.0, 0.0, 3.0], [2.0, 2.0, 2.0, 2.0, 2.0]], dtype=np.float32)
    values, ids = topk_log_probs(logits, 4)
    np.testing.assert_array_equal(ids, [[1, 2, 4, 0], [0, 1, 2, 3]])
    np.testing.assert_allclose(values[1], np.log(0.2), rtol=1e-6)


def test_k_bounds() -> None:
    logits = np.random.default_rng(3).normal(size=(3, 7))
    values, ids = topk_log_probs(logits, 100)  # k > V clamps to V
    assert values.shape == ids.shape == (3, 7)
    np.testing.assert_array_equal(np.sort(ids, axis=1), np.tile(np.arange(7), (3, 1)))
    values, ids = topk_log_probs(logits, 0)
    assert values.shape == ids.shape == (3, 0)


def test_full_vocab_normalises() -> None:
    rng = np.random.default_rng(4)
    for scale in (0.1, 3.0, 30.0):
        logits = rng.normal(0.0, scale, (4, 513)) + 1000.0  # large offset: log-sum-exp must shift
        values, _ = topk_log_probs(logits, 513)
        np.testing.assert_allclose(np.exp(values.astype(np.float64)).sum(axis=1), 1.0, rtol=1e-5)
        assert np.all(np.diff(values, axis=1) <= 0)


def test_bf16_widening_exact() -> None:
    bits = np.arange(0, 2**16, dtype=np.uint32).astype(np.uint16)
    wide = bf16_to_float32(bits)
    assert wide.dtype == np.float32
    np.testing.assert_array_equal(wide.view(np.uint32) >> 16, bits)
    np.testing.assert_array_equal(wide.view(np.uint32) & 0xFFFF, 0)
    finite = np.isfinite(wide)
    np.testing.assert_array_equal(float32_to_bf16(wide[finite]), bits[finite])  # bf16 values round-trip


def _round_bf16_oracle(x: np.ndarray) -> np.ndarray:
    """Round to nearest even by comparing with both bf16 neighbours, in float64."""
    bits = x.view(np.uint32)
    low = (bits >> 16).astype(np.uint16)
    high = low + np.uint16(1)
    lo_val = bf16_to_float32(low).astype(np.float64)
    hi_val = bf16_to_float32(high).astype(np.float64)
    d_lo, d_hi = np.abs(x - lo_val), np.abs(hi_val - x)
    pick_high = (d_hi < d_lo) | ((d_hi == d_lo) & (low % 2 == 1))
    return np.where(pick_high, high, low)


def test_float32_to_bf16_rounding() -> None:
    rng = np.random.default_rng(5)
    x = rng.normal(0.0, 10.0, 20000).astype(np.float32)
    ties = (rng.integers(0, 2**16, 2000, dtype=np.uint32) << 16 | 0x8000).view(np.float32)  # exact halfway
    x = np.concatenate([x, ties[np.isfinite(ties)]])
    np.testing.assert_array_equal(float32_to_bf16(x), _round_bf16_oracle(x))


def test_float32_to_bf16_specials() -> None:
    big = np.float32(np.finfo(np.float32).max)
    x = np.array([np.inf, -np.inf, 0.0, -0.0, big, np.nan, -np.nan], dtype=np.float32)
    payload_nan = np.array([0x7F800001], dtype=np.uint32).view(np.float32)  # truncation alone would give inf
    out = bf16_to_float32(float32_to_bf16(np.concatenate([x, payload_nan])))
    assert out[0] == np.inf and out[1] == -np.inf and out[4] == np.inf  # max float32 rounds up to inf
    assert out[2] == 0.0 and not np.signbit(out[2]) and np.signbit(out[3])
    assert np.all(np.isnan(out[5:]))


def test_bf16_helpers_keep_shape() -> None:
    x = np.arange(24, dtype=np.float64).reshape(2, 3, 4)[:, ::2, 1:]  # non-contiguous, float64 input
    bits = float32_to_bf16(x)
    assert bits.shape == x.shape and bits.dtype == np.uint16
    np.testing.assert_array_equal(bf16_to_float32(bits), x)  # small integers are exact in bf16
    assert float32_to_bf16(np.float32(1.5)).shape == () and bf16_to_float32(np.uint16(0x3FC0)) == 1.5


_ERRORS = {
    "logits_int": (lambda: topk_log_probs(np.zeros((2, 3), dtype=np.int32), 2), TypeError, "logits"),
    "logits_1d": (lambda: topk_log_probs(np.zeros(3), 2), ValueError, "logits"),
    "logits_empty_vocab": (lambda: topk_log_probs(np.zeros((2, 0)), 2), ValueError, "logits"),
    "logits_nan": (lambda: topk_log_probs(np.array([[0.0, np.nan]]), 1), ValueError, "logits"),
    "logits_inf": (lambda: topk_log_probs(np.array([[0.0, -np.inf]]), 1), ValueError, "logits"),
    "k_negative": (lambda: topk_log_probs(np.zeros((2, 3)), -1), ValueError, "k"),
    "k_float": (lambda: topk_log_probs(np.zeros((2, 3)), 2.0), TypeError, "k"),
    "k_bool": (lambda: topk_log_probs(np.zeros((2, 3)), True), TypeError, "k"),
    "bits_dtype": (lambda: bf16_to_float32(np.zeros(3, dtype=np.int16)), TypeError, "bits"),
    "x_dtype": (lambda: float32_to_bf16(np.zeros(3, dtype=np.int32)), TypeError, "x"),
}


@pytest.mark.parametrize("case", sorted(_ERRORS))
def test_validation(case: str) -> None:
    call, error, name = _ERRORS[case]
    with pytest.raises(error, match=rf"\b{name}\b"):
        call()
