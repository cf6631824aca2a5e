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


def product_inputs(m, n, k, prologue, residual, kind, rng):
    """x [M, Kx] (Kx = 2K for SwiGLU's gate | up), w [N, K], RMSNorm weight [K], residual [M, N] or
    None: "random" normals, "ties" a few small integers (many equal products, exact partial sums),
    "zeros" signed zeros among normals."""
    kx = 2 * k if prologue == "swiglu" else k
    if kind == "ties":
        x = rng.integers(-2, 3, (m, kx)).astype(np.float32)
        w = rng.integers(-2, 3, (n, k)).astype(np.float32)
    else:
        x = rng.standard_normal((m, kx)).astype(np.float32)
        w = rng.standard_normal((n, k)).astype(np.float32)
        if kind == "zeros":
            x[:, ::3] = -0.0
            w[::2, 1::2] = -0.0
    norm = (1.0 + 0.1 * rng.standard_normal(k)).astype(np.float32)
    res = rng.standard_normal((m, n)).astype(np.float32) if residual else None
    return x, w, norm, res


def prologue_kwargs(prologue, norm, res):
    """linear()'s keyword arguments for a prologue ("none", "rmsnorm", "swiglu") and residual (device copies)."""
    kw = {}
    if prologue == "rmsnorm":
        kw = dict(norm_weight=dev(norm), eps=1e-6)
    elif prologue == "swiglu":
        kw = dict(swiglu=True)
    if res is not None:
        kw["residual"] = dev(res)
    return kw
