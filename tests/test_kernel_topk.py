"""Fused log-softmax top-k kernel (ddtree_numba.kernels.topk) against reference.topk_log_probs.

Simulator tests use tiny shapes (V <= 512, k <= 16, 2-4 rows, 32 threads per block); the
``gpu``-marked tests run the real Kimi-K2 shapes (V = 163840) on a GPU. Ids must be bit-exact;
values within VALUE_ATOL + VALUE_RTOL * |reference|.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from numba import cuda

from ddtree_numba.golden import read_all
from ddtree_numba.kernels import registry
from ddtree_numba.kernels import topk as topk_module
from ddtree_numba.kernels.topk import (
    MAX_K,
    VALUE_ATOL,
    VALUE_RTOL,
    WARP_MAX_K,
    WORDS_PER_THREAD,
    TopKPlan,
    check_topk_errors,
    plan_topk,
    run_topk,
)
from reference.topk import bf16_to_float32, float32_to_bf16, topk_log_probs

# from this file, not the working directory: pytest may run from anywhere
GOLDEN = Path(__file__).resolve().parent.parent / "data" / "golden" / "topk.h5"
SIM_THREADS = 32  # one warp per block keeps simulated launches fast
KIMI_VOCAB = 163840


def _run(logits: np.ndarray, k: int, **plan_kw) -> tuple[np.ndarray, np.ndarray, TopKPlan]:
    """Plan and run on host arrays; returns (values, ids, plan)."""
    plan_kw.setdefault("threads", SIM_THREADS)
    plan = plan_topk(logits.shape[0], logits.shape[1], k, logits.dtype, **plan_kw)
    values = np.full((plan.rows, plan.k_out), np.nan, np.float32)
    ids = np.full((plan.rows, plan.k_out), -7, np.int32)
    run_topk(plan, logits, values, ids)
    return values, ids, plan


def _expected(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    as_float = bf16_to_float32(logits) if logits.dtype == np.uint16 else logits
    return topk_log_probs(as_float, k)


def _assert_matches(values: np.ndarray, ids: np.ndarray, ref_values: np.ndarray, ref_ids: np.ndarray) -> None:
    np.testing.assert_array_equal(ids, ref_ids.astype(np.int32))
    tol = VALUE_ATOL + VALUE_RTOL * np.abs(ref_values)
    worst = np.max(np.abs(values - ref_values) - tol) if values.size else -1.0
    assert worst <= 0.0, f"values off by {worst} beyond tolerance"


def _check(logits: np.ndarray, k: int, **plan_kw) -> TopKPlan:
    values, ids, plan = _run(logits, k, **plan_kw)
    _assert_matches(values, ids, *_expected(logits, k))
    return plan


def _gaussian(rng: np.random.Generator, rows: int, vocab: int, std: float = 3.0) -> np.ndarray:
    return (rng.standard_normal((rows, vocab)) * std).astype(np.float32)


# --- golden cases --------------------------------------------------------------------------------

def _golden_topk_cases() -> list:
    return [(name, ds) for name, ds in read_all(GOLDEN).items() if ds.attrs["function"].endswith("topk_log_probs")]


@pytest.mark.parametrize("name, ds", _golden_topk_cases(), ids=lambda v: v if isinstance(v, str) else "")
def test_golden(name, ds):
    k = int(ds["in_k"].values)
    inputs = [ds["in_logits"].values]
    if "in_logits_bf16" in ds:
        inputs.append(ds["in_logits_bf16"].values)  # the same logits as raw bf16 bits
    for logits in inputs:
        values, ids, _ = _run(np.ascontiguousarray(logits), k)
        _assert_matches(values, ids, ds["out_values"].values, ds["out_ids"].values)


# --- random and edge shapes ----------------------------------------------------------------------

@pytest.mark.parametrize(
    "rows, vocab, k, dtype, n_chunks",
    [
        (2, 96, 8, "f32", 1),  # packed float32 (2 per word)
        (3, 101, 16, "f32", 2),  # odd V: scalar path, two chunks
        (2, 512, 16, "bf16", 3),  # packed bf16 (4 per word), chunks merged
        (4, 66, 5, "bf16", None),  # V % 4 != 0: scalar bf16
        (2, 1, 4, "f32", None),  # V = 1
        (2, 9, 9, "bf16", None),  # k = V
        (3, 7, 16, "f32", 2),  # k > V: clamped
        (2, 40, 0, "bf16", 2),  # k = 0
    ],
)
def test_random_shapes(rows, vocab, k, dtype, n_chunks):
    logits = _gaussian(np.random.default_rng(rows * 1000 + vocab), rows, vocab)
    if dtype == "bf16":
        logits = float32_to_bf16(logits)
    plan = _check(logits, k, n_chunks=n_chunks)
    assert plan.k_out == min(k, vocab)


def test_tie_heavy_bf16_across_chunks():
    """Few distinct values, equal values in every chunk: ids resolve ties by lower id everywhere."""
    rng = np.random.default_rng(7)
    levels = float32_to_bf16(np.array([1.5, 1.0, -0.25], np.float32))
    logits = levels[rng.integers(0, 3, size=(3, 256))]  # [3, 256] uint16
    logits[1] = levels[0]  # a row of one value: the top k are ids 0..k-1
    values, ids, plan = _run(logits, 16, n_chunks=4)
    assert plan.n_chunks == 4
    _assert_matches(values, ids, *_expected(logits, 16))
    np.testing.assert_array_equal(ids[1], np.arange(16))


def test_bf16_gaussian_ties_match_reference():
    """bf16-rounded N(0, 2.5^2) logits (spec §1.2: most adjacent top ranks tie)."""
    logits = float32_to_bf16(_gaussian(np.random.default_rng(11), 2, 512, std=2.5))
    ref_values, _ = _expected(logits, 16)
    assert np.sum(np.diff(ref_values, axis=1) == 0) > 0  # the case really has ties
    _check(logits, 16, n_chunks=2)


@pytest.mark.parametrize("warp_buffers", [True, False])
@pytest.mark.parametrize("order", ["ascending", "descending"])
def test_monotone_rows_force_compactions(order, warp_buffers):
    """Ascending rows make every element a new top-k (worst case: many compactions and retries),
    with per-warp buffers (the default for k' <= WARP_MAX_K) and with the block buffer."""
    ramp = np.linspace(-4.0, 4.0, 192, dtype=np.float32)
    logits = np.stack([ramp if order == "ascending" else ramp[::-1], np.sin(ramp * 7.0)]).astype(np.float32)
    plan = _check(float32_to_bf16(logits), 8, capacity=SIM_THREADS, warp_buffers=warp_buffers)  # 32 entries, 4 k
    assert plan.warp_buffers == warp_buffers


@pytest.mark.parametrize("dtype, vocab, warp_buffers", [("f32", 600, False), ("bf16", 1100, True), ("bf16", 1100, False)])
def test_several_full_iterations_then_a_partial_one(dtype, vocab, warp_buffers):
    """Rows longer than two block iterations (32 threads x 4 words), so the prefetched words of
    each iteration (both rings of the per-warp kernel), the partial last one and buffer overflows
    in later iterations are all used."""
    rng = np.random.default_rng(vocab)
    ramp = np.linspace(-6.0, 6.0, vocab, dtype=np.float32)  # ascending: overflows every iteration
    logits = np.stack([ramp, _gaussian(rng, 1, vocab)[0]])
    if dtype == "bf16":
        logits = float32_to_bf16(logits)
    plan = _check(logits, 8, capacity=SIM_THREADS, n_chunks=1, warp_buffers=warp_buffers)
    per_word = 4 if dtype == "bf16" else 2
    assert vocab > 2 * SIM_THREADS * WORDS_PER_THREAD * per_word  # >= 2 full iterations
    assert plan.n_chunks == 1


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_two_warps_and_a_moving_exp_reference(dtype):
    """64 threads: each warp reads its own contiguous run of words per iteration. A steep ramp
    (80 nats) moves every thread's exp reference several times (REFERENCE_HEADROOM = 8 nats),
    and a wide Gaussian row mixes moved and unmoved references in the block's log-sum-exp."""
    vocab = 2600  # bf16: 2 full iterations of 64 x 16 elements + a partial one; f32: 5 + partial
    rng = np.random.default_rng(64)
    logits = np.stack([np.linspace(-40.0, 40.0, vocab, dtype=np.float32), _gaussian(rng, 1, vocab, std=8.0)[0]])
    if dtype == "bf16":
        logits = float32_to_bf16(logits)
    plan = _check(logits, 12, threads=64, n_chunks=1)
    assert plan.threads == 64 and plan.n_chunks == 1


# --- segment mode: unfiltered stream, then only the flagged segments through the buffer ---------

def _segment_rows(case: str, rng: np.random.Generator, rows: int, vocab: int) -> np.ndarray:
    """[rows, vocab] float32 logits of one input family."""
    if case == "gaussian":
        return _gaussian(rng, rows, vocab)
    if case == "levels":  # three values: every segment maximum ties, ties by lower id everywhere
        return np.array([1.5, 1.0, -0.25], np.float32)[rng.integers(0, 3, size=(rows, vocab))]
    if case == "constant":  # every segment flagged, every element a candidate: compactions and retries
        return np.full((rows, vocab), -0.5, np.float32)
    ramp = np.linspace(-6.0, 6.0, vocab, dtype=np.float32)
    if case == "ascending":
        return np.tile(ramp, (rows, 1))
    if case == "descending":
        return np.tile(ramp[::-1], (rows, 1))
    assert case == "spikes"  # a few large values in otherwise flat rows
    x = _gaussian(rng, rows, vocab, std=0.1)
    x[:, rng.integers(0, vocab, size=6)] = np.float32(30.0)
    return x


@pytest.mark.parametrize("case", ["gaussian", "levels", "constant", "ascending", "descending", "spikes"])
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_segment_mode_matches_reference(case, dtype):
    """Segment mode over several full iterations and a partial one: the k'-th largest segment
    maximum bounds the k'-th largest logit, so re-reading only the flagged segments loses nothing,
    ties (bf16 rounding, equal levels, constant rows) included."""
    vocab = 1100  # bf16: 2 full iterations of 32 x 16 elements + a partial one; f32: 4 + partial
    logits = _segment_rows(case, np.random.default_rng(vocab), 3, vocab)
    if dtype == "bf16":
        logits = float32_to_bf16(logits)
    plan = _check(logits, 5, n_chunks=1, segments=True, capacity=SIM_THREADS)
    assert plan.segments and plan.segment_slots >= 2


@pytest.mark.parametrize("k", [0, 1, 3, 40, 1000])
@pytest.mark.parametrize("threads, n_chunks", [(32, 1), (64, 1), (32, 3), (32, 16)])
def test_segment_mode_edge_k_warps_and_chunks(k, threads, n_chunks):
    """k = 0, 1, more than the segments (every segment flagged) and k = V; two warps (segments
    interleaved by warp); several chunks (each chunk's segments, then the merge). At 16 chunks a
    chunk holds ~64 elements: its candidates are ranked, with ranks >= k dropped (k 40) and
    fewer candidates than k (k 1000), whose slots the chunk fills with EMPTY for the merge. The
    workspace starts full of the largest composite, so a slot left unwritten would be merged."""
    logits = float32_to_bf16(_gaussian(np.random.default_rng(k + threads), 2, 1000, std=2.5))
    plan = plan_topk(2, 1000, k, np.uint16, threads=threads, n_chunks=n_chunks, segments=True)
    assert plan.segments and plan.n_chunks == n_chunks
    plan.cand.copy_to_device(np.full(plan.cand.shape, np.uint64(0xFFFFFFFFFFFFFFFE)))  # stale, not EMPTY
    values = np.full((plan.rows, plan.k_out), np.nan, np.float32)
    ids = np.full((plan.rows, plan.k_out), -7, np.int32)
    run_topk(plan, logits, values, ids)
    _assert_matches(values, ids, *_expected(logits, k))


def _candidates_at_threshold(logits: np.ndarray, k: int, seg_elems: int) -> np.ndarray:
    """Per row, the elements >= T (T = the k-th largest maximum of consecutive runs of
    ``seg_elems``): what segment mode re-reads into its buffer when nothing overflows."""
    x = bf16_to_float32(logits) if logits.dtype == np.uint16 else logits
    n_seg = -(-x.shape[1] // seg_elems)
    pad = np.full((x.shape[0], n_seg * seg_elems - x.shape[1]), -np.inf, np.float32)
    seg_max = np.concatenate([x, pad], axis=1).reshape(x.shape[0], n_seg, seg_elems).max(axis=2)
    t = np.sort(seg_max, axis=1)[:, ::-1][:, k - 1]
    return (x >= t[:, None]).sum(axis=1)


@pytest.mark.parametrize("threads, list_entries", [(32, None), (64, None), (128, None), (128, 4)])
def test_segment_mode_deals_flagged_segments_and_finishes_both_ways(threads, list_entries, monkeypatch):
    """Many segments per warp (at 32 threads 41 iterations: two ballot windows of the list's
    appends; a partial last iteration), the flagged segments listed and dealt over 1, 2 and 4
    warps whoever streamed them, and both finishes: a few candidates ranked in place, more than
    RANKED_FINISH_PER_THREAD a thread sorted. With a list of 4 entries (the simulator reads the
    constant at run time; a mutation that skips the overflow path fails this case) every row
    overflows it and takes the barrier-per-round re-read instead."""
    if list_entries is not None:
        monkeypatch.setattr(topk_module, "FLAG_LIST_ENTRIES", list_entries)
    seg_elems = 4 * 4 * 32  # packed bf16: 4 words of 4 elements a lane, 32 lanes
    n_full = 40  # full segments, then a partial one
    rng = np.random.default_rng(threads)
    logits = _gaussian(rng, 2, n_full * seg_elems + 100, std=1.0)
    for seg in rng.choice(n_full, size=36, replace=False):  # 36 segments hold 8 copies of one value
        logits[1, seg * seg_elems + rng.choice(seg_elems, size=8, replace=False)] = np.float32(50.0)
    logits = float32_to_bf16(logits)
    cases = [(logits[:1], 8), (logits[1:], 20)]  # row 1: the 288 fifties are all candidates
    n_cand = np.concatenate([_candidates_at_threshold(x, k, seg_elems) for x, k in cases])
    assert n_cand[0] <= topk_module.RANKED_FINISH_PER_THREAD * threads < n_cand[1] <= 512  # both finishes
    for x, k in cases:
        plan = _check(x, k, threads=threads, n_chunks=1, segments=True, capacity=512)
        assert plan.segments and plan.segment_slots >= n_full + 1


def test_segment_mode_on_misaligned_logits_uses_the_scalar_words():
    """Unaligned bf16 logits take the one-element-per-load segment kernel (more, shorter segments)."""
    logits = float32_to_bf16(_gaussian(np.random.default_rng(6), 2, 700))
    storage = np.zeros(logits.size + 1, np.uint16)
    shifted = storage[1:].reshape(logits.shape)
    shifted[...] = logits
    assert shifted.__array_interface__["data"][0] % 8 != 0
    values, ids, plan = _run(shifted, 4, segments=True)
    assert plan.segments
    _assert_matches(values, ids, *_expected(logits, 4))


def test_segment_mode_default_and_validation():
    """Default: on where k' is small against a chunk's segments (Kimi K2's 960 x 163840 rows at
    k 32: 320 segments a row), off for large k' and with per-warp buffers; bad values name 'segments'."""
    assert plan_topk(960, KIMI_VOCAB, 32, np.uint16).segments
    assert plan_topk(960, KIMI_VOCAB, 8, np.float32).segments
    assert not plan_topk(960, KIMI_VOCAB, 512, np.uint16).segments
    assert not plan_topk(960, KIMI_VOCAB, 32, np.uint16, warp_buffers=True).segments
    assert not plan_topk(4, 64, 8, np.float32).segments  # 1 segment per chunk: nothing to skip
    with pytest.raises(TypeError, match="segments"):
        plan_topk(4, 64, 8, np.float32, segments="yes")
    with pytest.raises(ValueError, match="segments"):
        plan_topk(4, 64, 8, np.uint16, segments=True, warp_buffers=True)
    with pytest.raises(ValueError, match="segments"):
        plan_topk(2, 2**24, 8, np.float32, n_chunks=1, segments=True)  # too many segment maxima


def test_signed_zeros_subnormals_and_large_values():
    """-0.0 ties with +0.0 (lower id first), subnormals keep their order, large logits are exact."""
    row = np.array([-0.0, 0.0, 1e-40, -1e-40, 1e30, -1e30, -0.0, 0.0, 2.5, -2.5], np.float32)
    _check(np.stack([row, row[::-1], -row]), 10)


def test_workspace_reuse_and_device_arrays():
    """One plan, several runs (as a graph replay would), device-array inputs and outputs."""
    rng = np.random.default_rng(3)
    plan = plan_topk(2, 200, 6, np.uint16, threads=SIM_THREADS, n_chunks=2)
    d_values = cuda.device_array((2, 6), np.float32)
    d_ids = cuda.device_array((2, 6), np.int32)
    for _ in range(2):
        logits = float32_to_bf16(_gaussian(rng, 2, 200))
        run_topk(plan, cuda.to_device(logits), d_values, d_ids)
        _assert_matches(d_values.copy_to_host(), d_ids.copy_to_host(), *_expected(logits, 6))


def test_misaligned_logits_use_the_scalar_path():
    """A row base that is not 8-byte aligned cannot be read as uint64 words; results are unchanged."""
    logits = float32_to_bf16(_gaussian(np.random.default_rng(5), 2, 64))
    storage = np.zeros(logits.size + 1, np.uint16)
    shifted = storage[1:].reshape(logits.shape)  # 2-byte offset
    shifted[...] = logits
    assert shifted.__array_interface__["data"][0] % 8 != 0
    values, ids, _ = _run(shifted, 5)
    _assert_matches(values, ids, *_expected(logits, 5))


# --- non-finite logits -----------------------------------------------------------------------------

@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # simulator NumPy: inf - inf
@pytest.mark.parametrize("bad, n_chunks", [(np.nan, 2), (np.inf, 1), (-np.inf, 1)])
def test_non_finite_device_logits_flag_their_row(bad, n_chunks):
    """Device logits are checked in-kernel: the flag names the row, the other rows stay exact."""
    logits = _gaussian(np.random.default_rng(9), 3, 48)
    logits[1, 17] = bad
    plan = plan_topk(3, 48, 4, np.float32, threads=SIM_THREADS, n_chunks=n_chunks)
    values = np.zeros((3, 4), np.float32)
    ids = np.zeros((3, 4), np.int32)
    with pytest.raises(ValueError, match=r"^logits\b"):
        run_topk(plan, cuda.to_device(logits), values, ids)
    run_topk(plan, cuda.to_device(logits), values, ids, check=False)  # graph-capture mode: no sync, no raise
    with pytest.raises(ValueError, match=r"logits.*\[1\]"):
        check_topk_errors(plan)
    good = [0, 2]  # the other rows are still exact
    ref_values, ref_ids = topk_log_probs(logits[good], 4)
    _assert_matches(values[good], ids[good], ref_values, ref_ids)
    logits[1, 17] = 0.0
    run_topk(plan, cuda.to_device(logits), values, ids)  # flags are rewritten on every run: no raise
    _assert_matches(values, ids, *_expected(logits, 4))  # the cleared row (and the others) are exact


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # simulator NumPy: inf - inf
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("col", [0, 1, 2, 1027])
@pytest.mark.parametrize("segments", [False, True])
def test_non_finite_bf16_device_logits_in_full_iterations(bad, col, segments):
    """bf16 full iterations take the max and min of packed pairs (max/min.bf16x2): a NaN or
    infinity in either half of a word, in any word of the iteration, still flags its row."""
    vocab = 2048  # 4 full iterations of 32 threads x 4 words x 4 bf16
    logits = _gaussian(np.random.default_rng(col), 2, vocab)
    logits[1, col] = bad
    plan = plan_topk(2, vocab, 4, np.uint16, threads=SIM_THREADS, n_chunks=1, segments=segments)
    values = np.zeros((2, 4), np.float32)
    ids = np.zeros((2, 4), np.int32)
    with pytest.raises(ValueError, match=r"logits.*\[1\]"):
        run_topk(plan, cuda.to_device(float32_to_bf16(logits)), values, ids)
    ref_values, ref_ids = _expected(float32_to_bf16(logits[:1]), 4)
    _assert_matches(values[:1], ids[:1], ref_values, ref_ids)


@pytest.mark.parametrize("dtype", [np.float32, np.uint16])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_host_logits_raise_before_writing(dtype, bad):
    """Host logits are checked before any launch: the outputs keep their poison values."""
    logits = _gaussian(np.random.default_rng(11), 3, 48)
    logits[2, 5] = bad
    if dtype == np.uint16:
        logits = float32_to_bf16(logits)
    plan = plan_topk(3, 48, 4, dtype, threads=SIM_THREADS, n_chunks=2)
    values = np.full((3, 4), 5.0, np.float32)
    ids = np.full((3, 4), -7, np.int32)
    with pytest.raises(ValueError, match=r"^logits\b.*\[2\]"):
        run_topk(plan, logits, values, ids, check=False)  # the host check does not depend on `check`
    np.testing.assert_array_equal(values, np.full((3, 4), 5.0, np.float32))
    np.testing.assert_array_equal(ids, np.full((3, 4), -7, np.int32))


# --- validation: errors name the argument and nothing is written ---------------------------------

@pytest.mark.parametrize(
    "kwargs, exc, name",
    [
        (dict(rows=0), ValueError, "rows"),
        (dict(rows=2.0), TypeError, "rows"),
        (dict(vocab=0), ValueError, "vocab"),
        (dict(k=-1), ValueError, "k"),
        (dict(k=True), TypeError, "k"),
        (dict(k=MAX_K + 1, vocab=4096), ValueError, "k"),
        (dict(dtype=np.float64), TypeError, "dtype"),
        (dict(threads=48), ValueError, "threads"),
        (dict(threads=1024), ValueError, "threads"),
        (dict(capacity=16), ValueError, "capacity"),
        (dict(capacity=96), ValueError, "capacity"),
        (dict(n_chunks=0), ValueError, "n_chunks"),
        (dict(warp_buffers=1), TypeError, "warp_buffers"),
        (dict(k=WARP_MAX_K + 1, vocab=4096, dtype=np.uint16, warp_buffers=True), ValueError, "warp_buffers"),
        (dict(warp_buffers=True), ValueError, "warp_buffers"),  # float32: block buffer only
    ],
)
def test_plan_rejects_bad_arguments(kwargs, exc, name):
    args = dict(rows=2, vocab=64, k=4, dtype=np.float32, threads=SIM_THREADS)
    args.update(kwargs)
    with pytest.raises(exc, match=rf"^{name}\b"):
        plan_topk(args.pop("rows"), args.pop("vocab"), args.pop("k"), args.pop("dtype"), **args)


def test_k_above_vocab_is_not_limited_by_max_k():
    assert plan_topk(1, 10, 5000, np.float32, threads=SIM_THREADS).k_out == 10


@pytest.mark.parametrize(
    "which, bad, exc",
    [
        ("logits", np.zeros((2, 64), np.float64), TypeError),
        ("logits", np.zeros((2, 64), np.uint16), TypeError),  # plan is float32
        ("logits", np.zeros((2, 65), np.float32), ValueError),
        ("logits", np.zeros((64, 2), np.float32).T, ValueError),  # not C-contiguous
        ("logits", [[0.0] * 64] * 2, TypeError),
        ("out_values", np.zeros((2, 4), np.float64), TypeError),
        ("out_values", np.zeros((2, 5), np.float32), ValueError),
        ("out_ids", np.zeros((2, 4), np.int64), TypeError),
        ("out_ids", np.zeros((3, 4), np.int32), ValueError),
    ],
)
def test_run_rejects_bad_arguments_before_writing(which, bad, exc):
    plan = plan_topk(2, 64, 4, np.float32, threads=SIM_THREADS)
    args = dict(
        logits=_gaussian(np.random.default_rng(0), 2, 64),
        out_values=np.full((2, 4), 5.0, np.float32),
        out_ids=np.full((2, 4), 5, np.int32),
    )
    untouched = {key: np.array(value, copy=True) for key, value in args.items()}
    args[which] = bad
    with pytest.raises(exc, match=rf"^{which}\b"):
        run_topk(plan, **args)
    for key in ("out_values", "out_ids"):
        if key != which:
            np.testing.assert_array_equal(args[key], untouched[key])


def test_run_rejects_a_non_plan():
    with pytest.raises(TypeError, match=r"^plan\b"):
        run_topk(object(), np.zeros((1, 4), np.float32), np.zeros((1, 1), np.float32), np.zeros((1, 1), np.int32))


# --- plan layout (host only) ---------------------------------------------------------------------

def test_plan_layout_for_kimi_shapes():
    """Many rows: one chunk (no merge); few rows: chunks fill the GPU; chunks tile V exactly."""
    warp = plan_topk(1024, KIMI_VOCAB, 32, np.uint16, warp_buffers=True)
    # per-warp buffers on request: 4 k' entries for each of the 8 warps.
    assert warp.n_chunks == 1 and warp.warp_buffers and warp.capacity == 8 * 4 * 32
    block = plan_topk(1024, KIMI_VOCAB, 32, np.uint16)  # the default: one block buffer, segment mode
    wave = topk_module.BLOCKS_PER_SM * topk_module._sm_count()  # blocks of 256 threads in one wave
    # more rows than one wave of 256-thread blocks holds (H200: 528): 128 threads, capacity max(threads, 4 k')
    assert block.n_chunks == 1 and not block.warp_buffers and block.segments
    assert block.threads == (128 if 1024 > wave else 256) and block.capacity == max(block.threads, 128)
    assert plan_topk(1024, KIMI_VOCAB, 32, np.uint16, threads=256).threads == 256  # asked for: kept
    assert plan_topk(wave, KIMI_VOCAB, 32, np.uint16).threads == 256  # they fit one wave
    assert plan_topk(wave + 1, KIMI_VOCAB, 32, np.uint16).threads == 128
    assert plan_topk(1024, KIMI_VOCAB, 32, np.uint16, segments=False).threads == 256  # block mode
    assert not plan_topk(1024, KIMI_VOCAB, WARP_MAX_K + 1, np.uint16).warp_buffers
    assert not plan_topk(1024, KIMI_VOCAB, 32, np.float32).warp_buffers
    small = plan_topk(16, KIMI_VOCAB, 32, np.uint16)
    assert small.n_chunks > 1
    for plan in (warp, block, small):
        assert plan.chunk_elems % 4 == 0
        assert (plan.n_chunks - 1) * plan.chunk_elems < KIMI_VOCAB <= plan.n_chunks * plan.chunk_elems
        assert plan.cand.shape == (plan.rows, plan.n_chunks, plan.k_out)
        assert plan.shared_bytes <= 32 * 1024
    assert plan_topk(4, KIMI_VOCAB, MAX_K, np.float32).capacity == 4096


def test_kernels_are_registered_with_signatures():
    names = {spec.name for spec in registry.all_kernels()}
    expected = {f"topk_chunk_{d}_{p}" for d in ("bf16", "f32") for p in ("packed", "scalar")}
    expected |= {"topk_merge", "topk_warp_bf16_packed"}
    assert expected <= names
    for name in expected:
        assert len(registry.get(name).signatures) == 1


# --- GPU: real shapes ------------------------------------------------------------------------------

_GPU_LOGITS: dict = {}


def _gpu_logits(rows: int, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """(kernel input, its float32 value) for the real vocabulary; bf16 N(0, 2.5^2) is tie-heavy."""
    key = (rows, dtype)
    if key not in _GPU_LOGITS:
        x = _gaussian(np.random.default_rng(rows), rows, KIMI_VOCAB, std=2.5)
        _GPU_LOGITS.clear()  # keep host memory bounded: one shape at a time
        if dtype == "bf16":
            bits = float32_to_bf16(x)
            _GPU_LOGITS[key] = (bits, bf16_to_float32(bits))
        else:
            _GPU_LOGITS[key] = (x, x)
    return _GPU_LOGITS[key]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bf16", "f32"])
@pytest.mark.parametrize(
    "rows, k", [(16, 8), (16, 1024), (128, 32), (128, 256), (1024, 32), (1024, 1024)]
)
def test_gpu_real_shapes(rows, k, dtype):
    """The default plan at Kimi K2's vocabulary (segment mode at 1024 rows, k 32)."""
    logits, as_float = _gpu_logits(rows, dtype)
    plan = plan_topk(rows, KIMI_VOCAB, k, logits.dtype)
    assert plan.segments or not (rows == 1024 and k == 32)
    d_logits = cuda.to_device(logits)
    d_values = cuda.device_array((rows, k), np.float32)
    d_ids = cuda.device_array((rows, k), np.int32)
    run_topk(plan, d_logits, d_values, d_ids)
    values, ids = d_values.copy_to_host(), d_ids.copy_to_host()
    ref_values, ref_ids = topk_log_probs(as_float, k)
    _assert_matches(values, ids, ref_values, ref_ids)
    # The fast oracle agrees with the reference itself on a few rows.
    sample = [0, rows - 1]
    _assert_matches(values[sample], ids[sample], *topk_log_probs(as_float[sample], k))


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["warp", "block", "segments"])
@pytest.mark.parametrize("n_chunks", [1, 7])
def test_gpu_adversarial_rows(n_chunks, mode):
    """Ascending, constant and two-level rows at the real vocabulary, with and without a merge:
    per-warp and block candidate buffers, and segment mode (7 chunks: every segment flagged)."""
    ramp = np.linspace(-30.0, 30.0, KIMI_VOCAB, dtype=np.float32)
    two_level = np.where(np.arange(KIMI_VOCAB) % 3 == 0, 2.0, 1.0).astype(np.float32)
    logits = float32_to_bf16(np.stack([ramp, np.zeros_like(ramp), two_level, ramp[::-1]]))
    plan = plan_topk(4, KIMI_VOCAB, 64, np.uint16, n_chunks=n_chunks, warp_buffers=mode == "warp",
                     segments=mode == "segments")
    values = np.zeros((4, 64), np.float32)
    ids = np.zeros((4, 64), np.int32)
    run_topk(plan, cuda.to_device(logits), values, ids)
    _assert_matches(values, ids, *topk_log_probs(bf16_to_float32(logits), 64))


@pytest.mark.gpu
def test_gpu_non_finite_detection_and_streams():
    logits, _ = _gpu_logits(16, "bf16")
    logits = logits.copy()
    logits[5, 99999] = float32_to_bf16(np.array([np.nan], np.float32))[0]
    plan = plan_topk(16, KIMI_VOCAB, 32, np.uint16)
    stream = cuda.stream()
    d_values = cuda.device_array((16, 32), np.float32)
    d_ids = cuda.device_array((16, 32), np.int32)
    with pytest.raises(ValueError, match=r"logits.*\[5\]"):
        run_topk(plan, cuda.to_device(logits, stream=stream), d_values, d_ids, stream)


@cuda.jit
def _select_kernel(comps, ks, low_bits, out):
    """One block: out[j] = the ks[j]-th largest order key of comps (segment mode's threshold)."""
    hist = cuda.shared.array(topk_module.RADIX_BINS, np.int32)
    select = cuda.shared.array(2, np.uint32)
    for j in range(ks.shape[0]):
        key = topk_module._select_kth_key(comps, comps.shape[0], ks[j], hist, select, cuda.threadIdx.x,
                                          cuda.blockDim.x, low_bits)
        if cuda.threadIdx.x == 0:
            out[j] = key
        cuda.syncthreads()  # the result is stored before the next selection resets its state


def _bf16_order_keys(values: np.ndarray) -> np.ndarray:
    """topk's order keys of bf16-rounded float32 values (NumPy; -0.0 as +0.0)."""
    bits = (float32_to_bf16(values.astype(np.float32)).astype(np.uint32) << np.uint32(16))
    bits = np.where(bits == 0x80000000, np.uint32(0), bits)
    return np.where(bits & np.uint32(0x80000000), ~bits, bits | np.uint32(0x80000000)).astype(np.uint32)


@pytest.mark.parametrize("case", ["distinct", "ties", "one_value", "top_byte_differs", "bf16", "bf16_ties"])
def test_radix_select_finds_the_kth_largest_key(case):
    """The segment threshold is exactly the k-th largest of the keys (composite >> 32), ties
    included: a larger one would drop top-k' elements, a smaller one re-reads more than it must.
    bf16 keys take the two-pass select (low_bits 16): their low half follows from the sign."""
    rng = np.random.default_rng(len(case))
    n = 77
    bf16_values = {"bf16": lambda: rng.normal(0, 3, n), "bf16_ties": lambda: rng.integers(-2, 3, n) * 0.5}
    if case in bf16_values:
        keys, low_bits = _bf16_order_keys(bf16_values[case]()).astype(np.uint64), 16
    else:
        keys = {"distinct": rng.choice(2**32 - 1, n, replace=False),
                "ties": rng.integers(0, 6, n) * 0x01010101 + 0x80000000,
                "one_value": np.full(n, 0xBF800000),
                "top_byte_differs": rng.integers(0, 256, n) << 24}[case].astype(np.uint64)
        low_bits = 0
    comps = (keys << np.uint64(32)) | np.arange(n, dtype=np.uint64)  # ids in the low word never matter
    ks = np.array([1, 2, 5, n // 2, n - 1, n], np.int32)
    out = np.zeros(len(ks), np.uint32)
    _select_kernel[1, 64](comps, ks, low_bits, out)
    expected = np.sort(keys)[::-1][ks - 1].astype(np.uint32)
    np.testing.assert_array_equal(out, expected)
