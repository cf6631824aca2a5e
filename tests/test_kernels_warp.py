"""ddtree_numba.kernels.warp: the warp device functions and row kernels against NumPy.

Float sums are checked bit-exactly against a NumPy model of the kernel's order (lane-serial,
then the xor butterfly); everything else is exact by nature.
"""
import numpy as np
import pytest
from numba import cuda

from ddtree_numba.kernels import registry
from ddtree_numba.kernels.warp import (
    WARP_SIZE,
    warp_argmax_f32,
    warp_argmax_f64,
    warp_argmax_rows_f64,
    warp_argmax_f64_kernel,
    warp_inclusive_scan_i32,
    warp_max_f32,
    warp_min_i32,
    warp_reduce_kernel,
    warp_reduce_rows,
    warp_scan_kernel,
    warp_scan_rows,
    warp_sum_f32,
)

LANES = np.arange(WARP_SIZE)
INF = np.float32(np.inf)


# --- NumPy models ----------------------------------------------------------------------------

def butterfly_sum_f32(lanes: np.ndarray) -> np.ndarray:
    """[..., 32] float32 lane values -> [...] float32 in warp_sum_f32's order."""
    offset = WARP_SIZE // 2
    while offset:
        lanes = lanes + lanes[..., LANES ^ offset]
        offset //= 2
    return lanes[..., 0]


def row_sum_f32(x: np.ndarray) -> np.ndarray:
    """[R, N] float32 -> [R] float32 in warp_reduce_kernel's order (lane-serial, then butterfly)."""
    lanes = np.zeros((x.shape[0], WARP_SIZE), np.float32)
    for j in range(x.shape[1]):
        lanes[:, j % WARP_SIZE] += x[:, j]
    return butterfly_sum_f32(lanes)


def first_argmax(x: np.ndarray) -> np.ndarray:
    """Lowest index of the row maximum (np.argmax returns the first occurrence)."""
    return np.argmax(x, axis=1).astype(np.int32)


# --- the device functions, every lane's result -----------------------------------------------

@cuda.jit
def all_lanes_kernel(xf, xd, idx, xi, out_sum, out_max, out_min, out_f32, out_f64, out_scan):
    """Each thread applies every device function to its element and writes its own result."""
    t = cuda.grid(1)
    out_sum[t] = warp_sum_f32(xf[t])
    out_max[t] = warp_max_f32(xf[t])
    out_min[t] = warp_min_i32(xi[t])
    value, index = warp_argmax_f32(xf[t], idx[t])
    out_f32[0, t] = value
    out_f32[1, t] = index
    value64, index64 = warp_argmax_f64(xd[t], idx[t])
    out_f64[0, t] = value64
    out_f64[1, t] = index64
    out_scan[t] = warp_inclusive_scan_i32(xi[t])


def _run_all_lanes(xf, xd, idx, xi):
    n = xf.size
    outs = (np.zeros(n, np.float32), np.zeros(n, np.float32), np.zeros(n, np.int32),
            np.zeros((2, n), np.float32), np.zeros((2, n), np.float64), np.zeros(n, np.int32))
    all_lanes_kernel[1, n](xf, xd, idx, xi, *outs)
    return outs


def _warps(a):
    return a.reshape(-1, WARP_SIZE)


@pytest.mark.parametrize("case", ["random", "ties", "infs"])
def test_device_functions_give_every_lane_the_result(case):
    rng = np.random.default_rng({"random": 1, "ties": 2, "infs": 3}[case])
    n = 2 * WARP_SIZE
    if case == "random":
        xf = rng.standard_normal(n).astype(np.float32)
        xd = rng.standard_normal(n)
    elif case == "ties":  # many equal maxima in each warp
        xf = rng.integers(-2, 2, n).astype(np.float32)
        xd = rng.integers(-2, 2, n).astype(np.float64)
    else:  # warp 0: all -inf; warp 1: several +inf among negatives
        xf = np.full(n, -INF)
        xf[WARP_SIZE:] = -rng.random(WARP_SIZE).astype(np.float32)
        xf[rng.choice(np.arange(WARP_SIZE, n), 3, replace=False)] = INF
        xd = xf.astype(np.float64)
    idx = rng.permutation(1000)[:n].astype(np.int32)  # indices are arbitrary, not lane numbers
    xi = rng.integers(-1000, 1000, n).astype(np.int32)

    out_sum, out_max, out_min, out_f32, out_f64, out_scan = _run_all_lanes(xf, xd, idx, xi)

    def per_lane(per_warp):
        return np.repeat(per_warp, WARP_SIZE)

    np.testing.assert_array_equal(out_sum, per_lane(butterfly_sum_f32(_warps(xf))))
    np.testing.assert_array_equal(out_max, per_lane(_warps(xf).max(1)))
    np.testing.assert_array_equal(out_min, per_lane(_warps(xi).min(1)))
    for values, out in ((xf, out_f32), (xd, out_f64)):
        v, i = _warps(values), _warps(idx)
        best = v.max(1, keepdims=True)
        lowest = np.where(v == best, i, np.iinfo(np.int32).max).min(1)  # ties -> lower index
        np.testing.assert_array_equal(out[0], per_lane(best[:, 0]))
        np.testing.assert_array_equal(out[1], per_lane(lowest))
    np.testing.assert_array_equal(out_scan, np.cumsum(_warps(xi), 1, dtype=np.int32).ravel())


def test_argmax_f64_keeps_float64_precision():
    # Values equal in float32 but distinct in float64: the winner must be the float64 maximum.
    n = WARP_SIZE
    xd = 1.0 + np.arange(n)[::-1] * 1e-12  # lane 0 largest
    xd[17] = 1.0 + 40e-12
    idx = np.arange(n, dtype=np.int32)
    out = _run_all_lanes(np.zeros(n, np.float32), xd, idx, np.zeros(n, np.int32))[4]
    np.testing.assert_array_equal(out[1], np.full(n, 17))
    np.testing.assert_array_equal(out[0], np.full(n, xd[17]))


# --- row kernels -------------------------------------------------------------------------------

ROW_KINDS = ["random", "ties", "negative", "infs"]


def _rows(kind: str, shape: tuple[int, int], rng) -> np.ndarray:
    if kind == "random":
        return rng.standard_normal(shape).astype(np.float32)
    if kind == "ties":  # few distinct values: the maximum repeats in most rows
        return rng.integers(-3, 2, shape).astype(np.float32)
    if kind == "negative":
        return -rng.random(shape).astype(np.float32) - 1.0
    x = rng.standard_normal(shape).astype(np.float32)  # "infs": -inf rows, +inf repeats
    x[0] = -INF
    if shape[0] > 1:
        x[1, rng.choice(shape[1], min(3, shape[1]), replace=False)] = INF
    return x


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # inf - inf in the sums of "infs" rows
@pytest.mark.parametrize("kind", ROW_KINDS)
@pytest.mark.parametrize("shape", [(1, 1), (2, 31), (3, 32), (2, 33), (4, 100)])
def test_warp_reduce_rows(shape, kind):
    rng = np.random.default_rng([*shape, ROW_KINDS.index(kind)])
    x = _rows(kind, shape, rng)
    total, largest, best, best_index = warp_reduce_rows(x)
    np.testing.assert_array_equal(total, row_sum_f32(x))
    np.testing.assert_allclose(total, x.astype(np.float64).sum(1), rtol=1e-5, atol=1e-5 * shape[1])
    np.testing.assert_array_equal(largest, x.max(1))
    np.testing.assert_array_equal(best, x.max(1))
    np.testing.assert_array_equal(best_index, first_argmax(x))
    assert (total.dtype, largest.dtype, best.dtype, best_index.dtype) == (
        np.float32, np.float32, np.float32, np.int32)


def test_grid_stride_covers_more_rows_than_warps():
    rng = np.random.default_rng(7)
    x = rng.integers(-5, 5, (5, 40)).astype(np.float32)  # 5 rows, 1 block of 2 warps
    total, largest, best, best_index = warp_reduce_rows(x, blocks=1)
    np.testing.assert_array_equal(total, row_sum_f32(x))
    np.testing.assert_array_equal(largest, x.max(1))
    np.testing.assert_array_equal(best, x.max(1))
    np.testing.assert_array_equal(best_index, first_argmax(x))
    value, index = warp_argmax_rows_f64(x.astype(np.float64), blocks=1)
    np.testing.assert_array_equal(value, x.max(1))
    np.testing.assert_array_equal(index, first_argmax(x))
    xi = x.astype(np.int32)
    scan, lowest = warp_scan_rows(xi, blocks=1)
    np.testing.assert_array_equal(scan, np.cumsum(xi, 1, dtype=np.int32))
    np.testing.assert_array_equal(lowest, xi.min(1))


@pytest.mark.parametrize("shape", [(1, 1), (2, 33), (3, 70)])
def test_warp_argmax_rows_f64(shape):
    rng = np.random.default_rng(shape[1])
    x = rng.integers(-2, 2, shape).astype(np.float64) + 1e-13 * rng.integers(0, 2, shape)
    x[0, -1] = -np.inf
    value, index = warp_argmax_rows_f64(x)
    np.testing.assert_array_equal(value, x.max(1))
    np.testing.assert_array_equal(index, first_argmax(x))
    all_neg_inf = np.full((2, 40), -np.inf)
    np.testing.assert_array_equal(warp_argmax_rows_f64(all_neg_inf)[1], [0, 0])


@pytest.mark.parametrize("shape", [(1, 1), (2, 31), (3, 32), (2, 33), (2, 100)])
def test_warp_scan_rows(shape):
    rng = np.random.default_rng(100 + shape[1])
    x = rng.integers(-1000, 1000, shape).astype(np.int32)
    scan, lowest = warp_scan_rows(x)
    np.testing.assert_array_equal(scan, np.cumsum(x, 1, dtype=np.int32))
    np.testing.assert_array_equal(lowest, x.min(1))
    assert scan.dtype == np.int32 and lowest.dtype == np.int32


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the simulator's int32 overflow warning
def test_warp_scan_rows_wraps_like_int32():
    x = np.full((1, 40), 2**30, np.int32)
    x[0, ::3] = -(2**31)
    scan, lowest = warp_scan_rows(x)
    np.testing.assert_array_equal(scan, np.cumsum(x, 1, dtype=np.int32))
    assert lowest[0] == -(2**31)


def test_empty_batch_returns_empty_without_launch():
    for result in (warp_reduce_rows(np.zeros((0, 8), np.float32)),
                   warp_argmax_rows_f64(np.zeros((0, 8))),
                   warp_scan_rows(np.zeros((0, 8), np.int32))):
        assert all(r.shape[0] == 0 for r in result)


# --- validation --------------------------------------------------------------------------------

WRAPPERS = [(warp_reduce_rows, np.float32), (warp_argmax_rows_f64, np.float64), (warp_scan_rows, np.int32)]


@pytest.mark.parametrize("wrapper,dtype", WRAPPERS, ids=["reduce", "argmax_f64", "scan"])
def test_bad_input_raises_naming_the_argument(wrapper, dtype):
    good = np.zeros((2, 8), dtype)
    with pytest.raises(TypeError, match="^x must be a numpy.ndarray"):
        wrapper(good.tolist())
    with pytest.raises(TypeError, match="^x must have dtype"):
        wrapper(good.astype(np.float16))
    with pytest.raises(ValueError, match="^x must be 2-D"):
        wrapper(good[0])
    with pytest.raises(ValueError, match="^x must have at least one column"):
        wrapper(np.zeros((2, 0), dtype))
    with pytest.raises(ValueError, match="^x must be C-contiguous"):
        wrapper(np.zeros((8, 2), dtype).T)
    with pytest.raises(TypeError, match="^blocks must be an int"):
        wrapper(good, blocks=1.0)
    with pytest.raises(ValueError, match="^blocks must be >= 1"):
        wrapper(good, blocks=0)
    if dtype != np.int32:
        nan_row = good.copy()
        nan_row[1, 3] = np.nan
        with pytest.raises(ValueError, match="^x must not contain NaN"):
            wrapper(nan_row)


def test_kernels_are_registered_with_their_signatures():
    for name, kernel, n_args in (("warp_reduce_f32", warp_reduce_kernel, 5),
                                 ("warp_argmax_f64", warp_argmax_f64_kernel, 3),
                                 ("warp_scan_i32", warp_scan_kernel, 3)):
        spec = registry.get(name)
        assert spec.kernel is kernel
        assert [len(sig) for sig in spec.signatures] == [n_args]
