"""Warp intrinsics (sim/warp.py under the simulator, the hardware on a GPU) against NumPy.

Every launch-shape test is a NumPy-checked behaviour that must also hold on a real GPU; the
tests of loud failures (divergence, unsupported masks, undefined reads, bad operand types)
are simulator-only.
"""
import math
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from numba import cuda

from sim import warp as sim_warp

SIMULATED = bool(cuda.config.ENABLE_CUDASIM)
sim_only = pytest.mark.skipif(not SIMULATED, reason="simulator-only failure mode (undefined on a GPU)")

WARP = 32
FULL = 0xFFFFFFFF
MAX_THREADS = 128  # the largest block used below (shared scratch size)

# (grid, block): full warps, 2-D / 3-D blocks, partial last warps, two blocks.
SHAPES = [(1, 32), (1, 64), (1, 96), (1, (16, 4)), (1, 48), (1, (8, 2, 3)), (2, 64)]
SHAPE_IDS = ["32", "64", "96", "16x4", "48", "8x2x3", "2x64"]


@cuda.jit(device=True)
def _linear_ids():
    """(global linear id, linear id in the block): x fastest, then y, z."""
    tid = cuda.threadIdx.x + cuda.blockDim.x * (cuda.threadIdx.y + cuda.blockDim.y * cuda.threadIdx.z)
    per_block = cuda.blockDim.x * cuda.blockDim.y * cuda.blockDim.z
    return cuda.blockIdx.x * per_block + tid, tid


@cuda.jit
def shuffle_kernel(values, masks, src_lanes, delta, lane_mask, with_down, out):
    """out[0..3, g] = shfl_sync / shfl_up_sync / shfl_xor_sync / shfl_down_sync of values[g]."""
    g, _ = _linear_ids()
    mask = masks[g]
    v = values[g]
    out[0, g] = cuda.shfl_sync(mask, v, src_lanes[g])
    out[1, g] = cuda.shfl_up_sync(mask, v, delta)
    out[2, g] = cuda.shfl_xor_sync(mask, v, lane_mask)
    if with_down:  # uniform over the launch: partial warps would read missing lanes
        out[3, g] = cuda.shfl_down_sync(mask, v, delta)


@cuda.jit
def vote_kernel(preds, masks, ballots, anys, alls, active, lanes, neighbours):
    """Votes over each row of preds [3, n]; activemask, laneid; syncwarp-ordered shared reads."""
    scratch = cuda.shared.array(MAX_THREADS, dtype=np.int32)
    g, tid = _linear_ids()
    mask = masks[g]
    for r in range(preds.shape[0]):
        ballots[r, g] = cuda.ballot_sync(mask, preds[r, g])
        anys[r, g] = cuda.any_sync(mask, preds[r, g])
        alls[r, g] = cuda.all_sync(mask, preds[r, g])
    active[g] = cuda.activemask()
    lane = cuda.laneid
    lanes[g] = lane
    scratch[tid] = g * 3 + 1
    cuda.syncwarp(mask)  # the warp's writes to scratch are visible after this
    n_lanes = cuda.popc(mask)
    neighbours[g] = scratch[tid - lane + (lane + 1) % n_lanes]


def _layout(grid, block):
    """Per global thread: (warp base global id, lane, lanes in its warp); and the total."""
    per_block = math.prod(block if isinstance(block, tuple) else (block,))
    base, lane, n_lanes = [], [], []
    for b in range(grid):
        for t in range(per_block):
            w = t // WARP
            base.append(b * per_block + w * WARP)
            lane.append(t % WARP)
            n_lanes.append(min(WARP, per_block - w * WARP))
    return np.array(base), np.array(lane), np.array(n_lanes), grid * per_block


def _masks(n_lanes):
    return np.where(n_lanes == WARP, FULL, (1 << n_lanes.astype(np.uint64)) - 1).astype(np.uint32)


def _random_values(rng, n, dtype):
    if dtype == np.int32:
        return rng.integers(np.iinfo(np.int32).min, np.iinfo(np.int32).max, n, dtype=np.int32, endpoint=True)
    return rng.standard_normal(n).astype(dtype)


@pytest.mark.parametrize("dtype", [np.int32, np.float32, np.float64], ids=["i32", "f32", "f64"])
@pytest.mark.parametrize("grid,block", SHAPES, ids=SHAPE_IDS)
def test_shuffles_match_numpy(grid, block, dtype):
    rng = np.random.default_rng(1000 + SHAPES.index((grid, block)) * 10 + [np.int32, np.float32, np.float64].index(dtype))
    base, lane, n_lanes, n = _layout(grid, block)
    partial = bool((n_lanes < WARP).any())
    smallest = int(n_lanes.min())
    values = _random_values(rng, n, dtype)
    # Sources that exist in every warp: per-lane for shfl_sync (plus a multiple of 32, which
    # PTX ignores); xor masks below the smallest warp; shfl_up never reads past the caller.
    src_lanes = ((rng.integers(0, smallest, n) + WARP * rng.integers(0, 3, n))).astype(np.int32)
    delta = int(rng.integers(1, WARP))
    lane_mask = int(rng.integers(1, smallest))
    out = np.zeros((4, n), dtype)

    shuffle_kernel[grid, block](values, _masks(n_lanes), src_lanes, delta, lane_mask, int(not partial), out)

    np.testing.assert_array_equal(out[0], values[base + (src_lanes & 31)])
    up = np.where(lane >= delta, base + lane - delta, base + lane)
    np.testing.assert_array_equal(out[1], values[up])
    np.testing.assert_array_equal(out[2], values[base + (lane ^ lane_mask)])
    if not partial:
        down = np.where(lane + delta < WARP, base + lane + delta, base + lane)
        np.testing.assert_array_equal(out[3], values[down])


@pytest.mark.parametrize("grid,block", SHAPES, ids=SHAPE_IDS)
def test_votes_activemask_laneid_syncwarp(grid, block):
    rng = np.random.default_rng(2000 + SHAPES.index((grid, block)))
    base, lane, n_lanes, n = _layout(grid, block)
    masks = _masks(n_lanes)
    preds = np.zeros((3, n), np.int32)
    preds[0] = rng.integers(-2, 3, n) * rng.integers(0, 2, n)  # mixed, any nonzero int is true
    preds[1] = rng.integers(1, 9, n)  # all true
    preds[2, rng.integers(0, n)] = -7  # one true lane in the whole launch
    ballots = np.zeros((3, n), np.uint32)
    anys = np.zeros((3, n), np.int32)
    alls = np.zeros((3, n), np.int32)
    active = np.zeros(n, np.uint32)
    lanes = np.zeros(n, np.int32)
    neighbours = np.zeros(n, np.int32)

    vote_kernel[grid, block](preds, masks, ballots, anys, alls, active, lanes, neighbours)

    for r in range(3):
        bits = (preds[r] != 0).astype(np.uint64) << lane.astype(np.uint64)
        expected = np.array([bits[base == b].sum() for b in base], np.uint64).astype(np.uint32)
        np.testing.assert_array_equal(ballots[r], expected)
        np.testing.assert_array_equal(anys[r], (expected != 0).astype(np.int32))
        np.testing.assert_array_equal(alls[r], (expected == masks).astype(np.int32))
    assert alls[1].all() and anys[1].all()
    np.testing.assert_array_equal(active, masks)
    np.testing.assert_array_equal(lanes, lane)
    np.testing.assert_array_equal(neighbours, (base + (lane + 1) % n_lanes) * 3 + 1)


# --- simulator-only: loud failures -----------------------------------------------------------

@cuda.jit
def lane0_skips_kernel(x):
    g, _ = _linear_ids()
    if cuda.laneid != 0:  # divergent: lane 0 never reaches the shuffle
        x[g] = cuda.shfl_xor_sync(FULL, x[g], 1)


@cuda.jit
def mixed_intrinsics_kernel(x):
    g, _ = _linear_ids()
    if cuda.laneid < 16:  # divergent: two different intrinsics at the same meeting
        x[g] = cuda.shfl_xor_sync(FULL, x[g], 1)
    else:
        x[g] = cuda.ballot_sync(FULL, x[g] > 0)


@cuda.jit
def mask_kernel(x, mask):
    g, _ = _linear_ids()
    x[g] = cuda.shfl_sync(mask, x[g], 0)


@cuda.jit
def down_kernel(x, mask):
    g, _ = _linear_ids()
    x[g] = cuda.shfl_down_sync(mask, x[g], 1)


@cuda.jit
def float_delta_kernel(x):
    g, _ = _linear_ids()
    x[g] = cuda.shfl_down_sync(FULL, x[g], 1.0)


def _check_still_works():
    """A correct launch after a failed one (fresh per-block state)."""
    base, lane, n_lanes, n = _layout(2, 64)
    values = np.arange(n, dtype=np.int32) * 5
    out = np.zeros((4, n), np.int32)
    shuffle_kernel[2, 64](values, _masks(n_lanes), np.full(n, 3, np.int32), 2, 4, 1, out)
    np.testing.assert_array_equal(out[2], values[base + (lane ^ 4)])


@sim_only
def test_missing_lane_raises_after_timeout_then_recovers(monkeypatch):
    monkeypatch.setattr(sim_warp, "WARP_TIMEOUT_S", 0.5)
    start = time.monotonic()
    with pytest.raises(sim_warp.WarpDivergenceError, match="shfl_xor_sync.*did not arrive"):
        lane0_skips_kernel[1, 32](np.arange(32, dtype=np.int32))
    assert time.monotonic() - start < 10
    _check_still_works()


@sim_only
def test_different_intrinsics_raise_naming_both(monkeypatch):
    monkeypatch.setattr(sim_warp, "WARP_TIMEOUT_S", 5.0)  # detected at the meeting, no timeout
    start = time.monotonic()
    with pytest.raises(sim_warp.WarpDivergenceError, match=r"ballot_sync|shfl_xor_sync") as info:
        mixed_intrinsics_kernel[1, 64](np.arange(64, dtype=np.int32) - 20)
    assert "ballot_sync" in str(info.value) and "shfl_xor_sync" in str(info.value)
    assert time.monotonic() - start < 4
    _check_still_works()


@sim_only
@pytest.mark.parametrize("mask", [0x0000FFFF, 0x7FFFFFFF, 0])
def test_partial_mask_is_not_implemented(mask):
    with pytest.raises(NotImplementedError, match="shfl_sync.*mask"):
        mask_kernel[1, 32](np.zeros(32, np.float32), mask)


@sim_only
def test_full_mask_accepted_on_a_partial_warp():
    # 48 threads: warp 1 has 16 lanes; 0xFFFFFFFF means "all its lanes", like 0x0000FFFF.
    x = np.arange(48, dtype=np.int64)
    mask_kernel[1, 48](x, FULL)
    np.testing.assert_array_equal(x, np.repeat([0, 32], [32, 16]))


@sim_only
def test_reading_a_missing_lane_of_a_partial_warp_raises():
    with pytest.raises(ValueError, match="shfl_down_sync.*does not exist"):
        down_kernel[1, 48](np.zeros(48, np.float32), FULL)


@sim_only
def test_operand_and_value_types_checked():
    with pytest.raises(TypeError, match="shfl_down_sync.*integer"):
        float_delta_kernel[1, 32](np.zeros(32, np.float32))
    with pytest.raises(TypeError, match="shfl_sync.*value"):
        mask_kernel[1, 32](np.zeros(32, np.uint32), FULL)  # numba shuffles i4/i8/f4/f8 only


@sim_only
def test_install_is_idempotent():
    sim_warp.install()
    sim_warp.install()
    _check_still_works()


def test_install_refuses_without_simulator():
    code = ("import os; os.environ['NUMBA_ENABLE_CUDASIM'] = '0'\n"
            "from sim import warp\n"
            "try:\n    warp.install()\nexcept RuntimeError as e:\n    print('refused:', e)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            cwd=Path(__file__).resolve().parents[1])
    assert "refused:" in result.stdout and "simulator is not active" in result.stdout, result.stderr
