"""bench.linear: the float64 check of its prologues against what linear() computes (the timing
itself needs a GPU: queue-ahead CUDA events)."""
import numpy as np
import pytest
from numba import cuda

from ddtree_numba.bench import linear as bench
from ddtree_numba.kernels import linear as lin
from reference.model import rms_norm, silu


@pytest.mark.parametrize("prologue", ["none", "rmsnorm", "swiglu"])
def test_prologue_input_is_what_linear_multiplies(prologue):
    """linear(x, w, prologue) = prologue_input(x) @ w.T within float32 accumulation (the bench's
    --check, per prologue), and the bench's x width: 2K for swiglu."""
    rng = np.random.default_rng(3)
    m_rows, n_cols, k_dim = 3, 5, 300
    x = rng.standard_normal((m_rows, 2 * k_dim if prologue == "swiglu" else k_dim)).astype(np.float32)
    w = rng.standard_normal((n_cols, k_dim)).astype(np.float32)
    nw = (1.0 + 0.1 * rng.standard_normal(k_dim)).astype(np.float32)
    kwargs = {"swiglu": True} if prologue == "swiglu" else \
        {"norm_weight": cuda.to_device(nw), "eps": bench.EPS} if prologue == "rmsnorm" else {}
    out = cuda.to_device(np.full((m_rows, n_cols), np.nan, np.float32))
    lin.linear(cuda.to_device(x), cuda.to_device(w), out, **kwargs)
    inp = bench.prologue_input(x, prologue, nw)
    x64 = x.astype(np.float64)
    if prologue == "rmsnorm":
        want = rms_norm(x64, nw.astype(np.float64), bench.EPS)
    elif prologue == "swiglu":
        want = silu(x64[:, :k_dim]) * x64[:, k_dim:]
    else:
        want = x64
    np.testing.assert_array_equal(inp, want)
    bench._check_rows(out.copy_to_host(), inp, w)   # raises past its 1e-5 bound


def test_prologue_input_refuses_an_unknown_prologue():
    with pytest.raises(ValueError, match="prologue"):
        bench.prologue_input(np.zeros((1, 4), np.float32), "gelu", np.ones(4, np.float32))


def test_impl_option_names_both_products(capsys):
    """--impl takes the CUDA-core and the tensor-core product (weights through registers or its
    ring) and refuses anything else (argparse, before any GPU work)."""
    from ddtree_numba.bench import linear as bench_linear

    assert bench_linear.IMPLS == ("cuda-core", "tensor-core", "tensor-core-ring")
    with pytest.raises(SystemExit):
        bench_linear.main(["--impl", "wgmma"])
    assert "invalid choice" in capsys.readouterr().err
