"""Checks shared by the tests of kernels.linear and kernels.linear_tc (not a test module)."""
import numpy as np
from numba import cuda


def dev(a):
    """A device copy of ``a`` (C-contiguous)."""
    return cuda.to_device(np.ascontiguousarray(a))


def assert_within_linear_bound(out, inp, w, residual=None):
    """out vs float64 inp @ w.T (+ residual) within 1e-5 of sum |inp| |w| (+ 1e-6 |residual|),
    every element finite."""
    ref = inp.astype(np.float64) @ w.astype(np.float64).T
    bound = 1e-5 * (np.abs(inp.astype(np.float64)) @ np.abs(w.astype(np.float64)).T) + 1e-30
    if residual is not None:
        ref = ref + residual
        bound = bound + 1e-6 * np.abs(residual)
    assert np.all(np.isfinite(out))
    err = np.abs(out - ref)
    assert np.all(err <= bound), f"max err {err.max()} vs bound {bound[np.argmax(err - bound)]}"
