"""Warp-level building blocks: all-reduce, argmax with the project's tie rule, inclusive scan.

All 32 lanes of a warp take part (full mask, no shared memory, no block barrier) and every
lane gets the result. Reductions are xor butterflies: at offsets 16, 8, 4, 2, 1 each lane
combines its value with lane ``lane ^ offset``'s. The two lanes of a pair combine the same two
operands with a commutative operation, so all lanes end with the same bits, also for float
sums (whose order is therefore fixed, and reproduced exactly by the tests).

Tie rule (ARCHITECTURE "Top-k order"): the argmax is the largest value, equal values resolved
by the lower index. Values may be +-inf; NaN breaks the order and is rejected by the host
wrappers. Indices are int32 (an int64 index doubles the shuffles).

Device functions: ``warp_sum_f32``, ``warp_max_f32``, ``warp_min_i32``, ``warp_argmax_f32``,
``warp_argmax_f64``, ``warp_inclusive_scan_i32``. Kernels (one warp per row, rows of any
length, grid-stride over rows) with host wrappers: ``warp_reduce_rows`` (float32 sum / max /
argmax), ``warp_argmax_rows_f64``, ``warp_scan_rows`` (int32 inclusive scan and minimum).
Under the simulator the intrinsics come from :mod:`sim.warp`.
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, float64, int32

from sim.launch import launch

from .registry import register

__all__ = [
    "warp_sum_f32", "warp_max_f32", "warp_min_i32", "warp_argmax_f32", "warp_argmax_f64",
    "warp_inclusive_scan_i32", "warp_reduce_kernel", "warp_argmax_f64_kernel",
    "warp_scan_kernel", "warp_reduce_rows", "warp_argmax_rows_f64", "warp_scan_rows",
]

WARP_SIZE = 32
FULL_MASK = 0xFFFFFFFF
FIRST_BUTTERFLY_OFFSET = WARP_SIZE // 2
WARPS_PER_BLOCK = 2  # one row per warp; 64 threads keeps simulated launches cheap
THREADS_PER_BLOCK = WARPS_PER_BLOCK * WARP_SIZE
MAX_BLOCKS = 65535  # default grid cap; larger batches are covered by the grid-stride loop


# --- device functions ------------------------------------------------------------------------

@cuda.jit(device=True)
def warp_sum_f32(v):
    """Sum of float32 ``v`` over the warp, on every lane (butterfly order, see module doc)."""
    offset = FIRST_BUTTERFLY_OFFSET
    while offset > 0:
        v += cuda.shfl_xor_sync(FULL_MASK, v, offset)  # float32 + float32 stays float32
        offset //= 2
    return v


@cuda.jit(device=True)
def warp_max_f32(v):
    """Maximum of float32 ``v`` over the warp, on every lane."""
    offset = FIRST_BUTTERFLY_OFFSET
    while offset > 0:
        other = cuda.shfl_xor_sync(FULL_MASK, v, offset)
        if other > v:
            v = other
        offset //= 2
    return v


@cuda.jit(device=True)
def warp_min_i32(v):
    """Minimum of int32 ``v`` over the warp, on every lane."""
    offset = FIRST_BUTTERFLY_OFFSET
    while offset > 0:
        other = cuda.shfl_xor_sync(FULL_MASK, v, offset)
        if other < v:
            v = other
        offset //= 2
    return v


@cuda.jit(device=True)
def _better(value, index, other_value, other_index):
    """The larger of two (value, index) candidates; equal values go to the lower index."""
    if other_value > value or (other_value == value and other_index < index):
        return other_value, other_index
    return value, index


@cuda.jit(device=True)
def _warp_argmax(value, index):
    """(max value, its lowest index) over the warp, on every lane; numba specialises by type."""
    offset = FIRST_BUTTERFLY_OFFSET
    while offset > 0:
        other_value = cuda.shfl_xor_sync(FULL_MASK, value, offset)
        other_index = cuda.shfl_xor_sync(FULL_MASK, index, offset)
        value, index = _better(value, index, other_value, other_index)
        offset //= 2
    return value, index


@cuda.jit(device=True)
def warp_argmax_f32(value, index):
    """Warp argmax of a float32 ``value`` with int32 ``index`` -> (float32, int32), every lane."""
    return _warp_argmax(value, index)


@cuda.jit(device=True)
def warp_argmax_f64(value, index):
    """Warp argmax of a float64 ``value`` (two 32-bit shuffles each) with int32 ``index``."""
    return _warp_argmax(value, index)


@cuda.jit(device=True)
def warp_inclusive_scan_i32(v):
    """Inclusive prefix sum of int32 ``v`` over lanes 0..laneid (wraps mod 2**32)."""
    lane = cuda.laneid
    offset = 1
    while offset < WARP_SIZE:
        other = cuda.shfl_up_sync(FULL_MASK, v, offset)  # own value where lane < offset
        if lane >= offset:
            v = int32(v + other)  # int32 + int32 is int64 in numba: keep 32-bit shuffles
        offset *= 2
    return v


@cuda.jit(device=True)
def _lane_argmax(x, row, lane):
    """(value, int32 index) of the first maximum in the lane's slice x[row, lane::32].

    A lane with no element takes element 0: a duplicate of a real candidate, it cannot
    change the warp's result, and it needs no typed sentinel.
    """
    n_cols = x.shape[1]
    first = lane if lane < n_cols else 0
    best = x[row, first]
    best_index = int32(first)
    for j in range(lane + WARP_SIZE, n_cols, WARP_SIZE):
        if x[row, j] > best:  # strict: the earlier (lower) index keeps ties
            best = x[row, j]
            best_index = int32(j)
    return best, best_index


# --- kernels ---------------------------------------------------------------------------------

@cuda.jit
def warp_reduce_kernel(x, out_sum, out_max, out_argmax_val, out_argmax_idx):
    """One warp per row of x [R, N] float32 -> sum, max, argmax value / index, each [R].

    Each lane first reduces its slice x[row, lane::32] in order, then the warp reduces.
    """
    lane = cuda.threadIdx.x % WARP_SIZE
    warps_per_block = cuda.blockDim.x // WARP_SIZE
    row = cuda.blockIdx.x * warps_per_block + cuda.threadIdx.x // WARP_SIZE
    while row < x.shape[0]:  # row is per warp, so the whole warp stays converged
        partial = float32(0.0)
        for j in range(lane, x.shape[1], WARP_SIZE):
            partial += x[row, j]
        total = warp_sum_f32(partial)  # [] float32, every lane
        lane_best, lane_index = _lane_argmax(x, row, lane)
        best, best_index = warp_argmax_f32(lane_best, lane_index)
        largest = warp_max_f32(best)  # lane maxima -> row maximum
        if lane == 0:
            out_sum[row] = total
            out_max[row] = largest
            out_argmax_val[row] = best
            out_argmax_idx[row] = best_index
        row += cuda.gridDim.x * warps_per_block


@cuda.jit
def warp_argmax_f64_kernel(x, out_val, out_idx):
    """One warp per row of x [R, N] float64 -> argmax value [R] float64, index [R] int32."""
    lane = cuda.threadIdx.x % WARP_SIZE
    warps_per_block = cuda.blockDim.x // WARP_SIZE
    row = cuda.blockIdx.x * warps_per_block + cuda.threadIdx.x // WARP_SIZE
    while row < x.shape[0]:  # row is per warp, so the whole warp stays converged
        lane_best, lane_index = _lane_argmax(x, row, lane)
        best, best_index = warp_argmax_f64(lane_best, lane_index)
        if lane == 0:
            out_val[row] = best
            out_idx[row] = best_index
        row += cuda.gridDim.x * warps_per_block


@cuda.jit
def warp_scan_kernel(x, out_scan, out_min):
    """One warp per row of x [R, N] int32 -> inclusive prefix sum [R, N], minimum [R].

    The row is scanned in chunks of 32; lane 31's inclusive sum carries into the next chunk.
    Sums wrap mod 2**32, as int32 arithmetic does on the GPU.
    """
    lane = cuda.threadIdx.x % WARP_SIZE
    warps_per_block = cuda.blockDim.x // WARP_SIZE
    row = cuda.blockIdx.x * warps_per_block + cuda.threadIdx.x // WARP_SIZE
    n_cols = x.shape[1]
    while row < x.shape[0]:  # row is per warp, so the whole warp stays converged
        carry = int32(0)
        lowest = x[row, 0]  # a real element: a lane past the end must not lower the minimum
        for base in range(0, n_cols, WARP_SIZE):
            j = base + lane
            v = x[row, j] if j < n_cols else int32(0)  # zero pads the last chunk
            total = int32(warp_inclusive_scan_i32(v) + carry)
            if j < n_cols:
                out_scan[row, j] = total
                if v < lowest:
                    lowest = v
            carry = cuda.shfl_sync(FULL_MASK, total, WARP_SIZE - 1)
        smallest = warp_min_i32(lowest)
        if lane == 0:
            out_min[row] = smallest
        row += cuda.gridDim.x * warps_per_block


register("warp_reduce_f32", warp_reduce_kernel,
         ((float32[:, ::1], float32[::1], float32[::1], float32[::1], int32[::1]),),
         "row sum, max and argmax (ties -> lower index) of float32 rows, one warp per row",
         block_threads=THREADS_PER_BLOCK)
register("warp_argmax_f64", warp_argmax_f64_kernel,
         ((float64[:, ::1], float64[::1], int32[::1]),),
         "row argmax (ties -> lower index) of float64 rows, one warp per row",
         block_threads=THREADS_PER_BLOCK)
register("warp_scan_i32", warp_scan_kernel,
         ((int32[:, ::1], int32[:, ::1], int32[::1]),),
         "row inclusive prefix sum and minimum of int32 rows, one warp per row",
         block_threads=THREADS_PER_BLOCK)


# --- host wrappers ---------------------------------------------------------------------------

def _check_rows(x: object, dtype: type) -> None:
    """Validate ``x``: a C-contiguous 2-D ndarray of ``dtype`` with >= 1 column, no NaN."""
    if not isinstance(x, np.ndarray):
        raise TypeError(f"x must be a numpy.ndarray, got {type(x).__name__}")
    if x.dtype != dtype:
        raise TypeError(f"x must have dtype {np.dtype(dtype).name}, got {x.dtype}")
    if x.ndim != 2:
        raise ValueError(f"x must be 2-D [rows, cols], got shape {x.shape}")
    if x.shape[1] < 1:
        raise ValueError(f"x must have at least one column, got shape {x.shape}")
    if not x.flags.c_contiguous:
        raise ValueError("x must be C-contiguous (use np.ascontiguousarray)")
    if np.issubdtype(x.dtype, np.floating) and np.isnan(x).any():
        raise ValueError("x must not contain NaN (it has no place in the max / argmax order)")


def _grid(n_rows: int, blocks: int | None) -> int:
    """Blocks to launch: ``blocks`` if given, else one warp per row up to MAX_BLOCKS."""
    if blocks is None:
        return min(math.ceil(n_rows / WARPS_PER_BLOCK), MAX_BLOCKS)
    if isinstance(blocks, bool) or not isinstance(blocks, (int, np.integer)):
        raise TypeError(f"blocks must be an int or None, got {type(blocks).__name__}")
    if blocks < 1:
        raise ValueError(f"blocks must be >= 1, got {blocks}")
    return int(blocks)


def warp_reduce_rows(x: np.ndarray, *, blocks: int | None = None
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Row sum, max and argmax of ``x`` [R, N] float32 (N >= 1, +-inf allowed, no NaN).

    Args:
        blocks: grid size (default: one warp per row); fewer blocks loop over the rows.

    Returns:
        (sum [R] float32, max [R] float32, argmax value [R] float32, argmax index [R] int32);
        the argmax index is the lowest index holding the maximum.
    """
    _check_rows(x, np.float32)
    grid = _grid(x.shape[0], blocks)
    n_rows = x.shape[0]
    if n_rows == 0:
        return (np.empty(0, np.float32), np.empty(0, np.float32), np.empty(0, np.float32),
                np.empty(0, np.int32))
    d_x = cuda.to_device(x)
    d_sum = cuda.device_array(n_rows, np.float32)
    d_max = cuda.device_array(n_rows, np.float32)
    d_val = cuda.device_array(n_rows, np.float32)
    d_idx = cuda.device_array(n_rows, np.int32)
    launch(warp_reduce_kernel, grid, THREADS_PER_BLOCK, 0, 0, d_x, d_sum, d_max, d_val, d_idx)
    return d_sum.copy_to_host(), d_max.copy_to_host(), d_val.copy_to_host(), d_idx.copy_to_host()


def warp_argmax_rows_f64(x: np.ndarray, *, blocks: int | None = None
                         ) -> tuple[np.ndarray, np.ndarray]:
    """Row argmax of ``x`` [R, N] float64 (N >= 1, +-inf allowed, no NaN).

    Returns:
        (max value [R] float64, lowest index of the maximum [R] int32).
    """
    _check_rows(x, np.float64)
    grid = _grid(x.shape[0], blocks)
    n_rows = x.shape[0]
    if n_rows == 0:
        return np.empty(0, np.float64), np.empty(0, np.int32)
    d_x = cuda.to_device(x)
    d_val = cuda.device_array(n_rows, np.float64)
    d_idx = cuda.device_array(n_rows, np.int32)
    launch(warp_argmax_f64_kernel, grid, THREADS_PER_BLOCK, 0, 0, d_x, d_val, d_idx)
    return d_val.copy_to_host(), d_idx.copy_to_host()


def warp_scan_rows(x: np.ndarray, *, blocks: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Row inclusive prefix sum and minimum of ``x`` [R, N] int32 (N >= 1).

    Returns:
        (scan [R, N] int32, wrapping mod 2**32 like ``np.cumsum(x, 1, dtype=np.int32)``;
        minimum [R] int32).
    """
    _check_rows(x, np.int32)
    grid = _grid(x.shape[0], blocks)
    n_rows = x.shape[0]
    if n_rows == 0:
        return np.empty(x.shape, np.int32), np.empty(0, np.int32)
    d_x = cuda.to_device(x)
    d_scan = cuda.device_array(x.shape, np.int32)
    d_min = cuda.device_array(n_rows, np.int32)
    launch(warp_scan_kernel, grid, THREADS_PER_BLOCK, 0, 0, d_x, d_scan, d_min)
    return d_scan.copy_to_host(), d_min.copy_to_host()
