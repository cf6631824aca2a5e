"""Tensor-core 3xTF32 products (ddtree_numba.kernels.linear_tc) against NumPy float64.

Tolerance: linear's, |out - ref| <= 1e-5 * (|input| @ |w|.T) (+ 1e-6 |residual|): the three TF32
products leave < 2**-19 of each product (the lo * lo term and the low parts truncated). Batch
invariance is bit-exact: a row keeps its bits alone, among 7 or 33 rows, whatever the row groups,
the weights' path (registers or the cp.async ring), the pre-split and whether its 1 / rms was
computed in the block or by the pre-pass. Under the simulator the ``mma`` is the model of
sim.warp (float64 sum of the exact products, one rounding), on the GPU the hardware's.
"""
import dataclasses

import numpy as np
import pytest
from numba import cuda

from ddtree_numba.bench.linear import prologue_input
from ddtree_numba.kernels import linear_tc as tc
from tests.linear_checks import assert_within_linear_bound as _assert_close, dev as _dev

RNG = np.random.default_rng(20261204)
SIMULATED = bool(cuda.config.ENABLE_CUDASIM)


def _rand(*shape, rng=RNG):
    return rng.standard_normal(shape).astype(np.float32)


def _run(x, w, prologue="none", nw=None, residual=None, **kwargs):
    out = _dev(np.full((x.shape[0], w.shape[0]), np.nan, np.float32))
    extra = {"swiglu": True} if prologue == "swiglu" else {"norm_weight": _dev(nw)} if prologue == "rmsnorm" else {}
    tc.linear_tc(_dev(x), _dev(w), out, residual=None if residual is None else _dev(residual),
                 **extra, **kwargs)
    return out.copy_to_host()


@pytest.fixture
def layout(monkeypatch):
    """Set layout knobs (module constants) with the built kernels and launch plans cleared."""
    def set_(**values):
        for name, value in values.items():
            monkeypatch.setattr(tc, name, value)
        tc.clear_plans()
    yield set_
    tc.clear_plans()


# --- the two instructions ---------------------------------------------------------------------------

@pytest.mark.skipif(not SIMULATED, reason="the NumPy model of the mask (the GPU's is an and)")
def test_tf32_trunc_clears_the_low_13_bits_and_the_split_keeps_2_to_the_minus_20():
    one = np.float32(1.0)
    ulp = np.float32(2.0 ** -10)                     # TF32 keeps 10 mantissa bits
    assert tc.tf32_trunc(one + ulp * np.float32(0.99)) == one      # toward zero, not to nearest
    assert tc.tf32_trunc(-(one + ulp * np.float32(1.5))) == -(one + ulp)
    assert tc.tf32_trunc(one + ulp) == one + ulp
    values = _rand(2000) * np.float32(1e3)
    bits = np.array([tc.tf32_trunc(v) for v in values], np.float32).view(np.uint32)
    assert np.all(bits & 0x1FFF == 0)
    assert np.all(np.abs(bits.view(np.float32)) <= np.abs(values))
    assert np.isinf(tc.tf32_trunc(np.float32(np.inf))) and np.isnan(tc.tf32_trunc(np.float32(np.nan)))
    for v in values:                                 # hi + lo within 2^-20 of v, lo exact TF32
        hi = tc.tf32_trunc(v)
        lo = tc.tf32_trunc(np.float32(v - hi))
        assert abs(float(v) - float(hi) - float(lo)) < 2.0 ** -20 * abs(float(v))
        assert np.float32(v - hi) == np.float64(v) - np.float64(hi)   # the rest is exact in float32


@pytest.mark.skipif(not SIMULATED, reason="the simulator's mma model")
def test_simulated_mma_is_the_fragment_layout_product():
    """D = A B + C through PTX's m16n8k8 fragment layout, A and B read as TF32."""
    a = _rand(16, 8)
    b = _rand(8, 8)
    c = _rand(16, 8)
    d = np.zeros((16, 8), np.float32)

    @cuda.jit
    def kernel(a, b, c, d):
        lane = cuda.threadIdx.x
        g, t = lane >> 2, lane & 3
        d0, d1, d2, d3 = tc.mma_tf32(a[g, t], a[g + 8, t], a[g, t + 4], a[g + 8, t + 4], b[t, g], b[t + 4, g],
                                     c[g, 2 * t], c[g, 2 * t + 1], c[g + 8, 2 * t], c[g + 8, 2 * t + 1])
        d[g, 2 * t] = d0
        d[g, 2 * t + 1] = d1
        d[g + 8, 2 * t] = d2
        d[g + 8, 2 * t + 1] = d3

    out = _dev(d)
    kernel[1, 32](_dev(a), _dev(b), _dev(c), out)
    keep = lambda m: (m.view(np.uint32) & np.uint32(0xFFFFE000)).view(np.float32).astype(np.float64)  # noqa: E731
    np.testing.assert_array_equal(out.copy_to_host(), (keep(a) @ keep(b) + c).astype(np.float32))


@pytest.mark.skipif(not SIMULATED, reason="the simulator's mma model (one lane computes, the others read)")
def test_simulated_mma_gives_each_warp_and_call_its_own_product():
    """The model computes a warp call's fragments once and the lanes read them: four warps (two
    blocks of two) each make three calls, back to back and across a syncwarp (both mailboxes),
    and every call returns its own product."""
    calls, warps = 3, 4
    a = _rand(calls, warps, 16, 8)
    b = _rand(calls, warps, 8, 8)
    c = _rand(calls, warps, 16, 8)
    d = np.zeros((calls, warps, 16, 8), np.float32)

    @cuda.jit
    def kernel(a, b, c, d):
        lane = cuda.threadIdx.x & 31
        w = cuda.blockIdx.x * 2 + (cuda.threadIdx.x >> 5)
        g, t = lane >> 2, lane & 3
        for i in range(3):
            if i == 2:
                cuda.syncwarp()              # the third call in the other mailbox
            d0, d1, d2, d3 = tc.mma_tf32(a[i, w, g, t], a[i, w, g + 8, t], a[i, w, g, t + 4], a[i, w, g + 8, t + 4],
                                         b[i, w, t, g], b[i, w, t + 4, g], c[i, w, g, 2 * t], c[i, w, g, 2 * t + 1],
                                         c[i, w, g + 8, 2 * t], c[i, w, g + 8, 2 * t + 1])
            d[i, w, g, 2 * t] = d0
            d[i, w, g, 2 * t + 1] = d1
            d[i, w, g + 8, 2 * t] = d2
            d[i, w, g + 8, 2 * t + 1] = d3

    out = _dev(d)
    kernel[2, 64](_dev(a), _dev(b), _dev(c), out)
    keep = lambda m: (m.view(np.uint32) & np.uint32(0xFFFFE000)).view(np.float32).astype(np.float64)  # noqa: E731
    want = np.zeros_like(d)
    for i in range(calls):
        for w in range(warps):
            total = np.zeros((16, 8))
            for k in range(8):               # the model's k order
                total += keep(a[i, w])[:, k:k + 1] * keep(b[i, w])[k:k + 1, :]
            want[i, w] = (total + c[i, w]).astype(np.float32)
    np.testing.assert_array_equal(out.copy_to_host(), want)


# --- the product ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("m_rows,n_cols,k_dim,prologue", [
    (1, 40, 64, "none"),          # one segment, one partial column block
    (3, 70, 200, "rmsnorm"),      # 4 segments (the segment sum), K % 32 != 0
    (9, 33, 96, "swiglu"),        # 2 m-tiles, 2 segments
])
def test_linear_tc_matches_float64(m_rows, n_cols, k_dim, prologue):
    kx = 2 * k_dim if prologue == "swiglu" else k_dim
    x, w, nw = _rand(m_rows, kx), _rand(n_cols, k_dim), _rand(k_dim)
    _assert_close(_run(x, w, prologue, nw), prologue_input(x, prologue, nw), w)


def test_residual_aliasing_out_and_separate():
    x, w, res = _rand(2, 64), _rand(36, 64), _rand(2, 36)
    assert tc.segments(36, 64)[0] == 1
    _assert_close(_run(x, w, residual=res), prologue_input(x, "none", None), w, res.astype(np.float64))
    x2, w2 = _rand(2, 160), _rand(20, 160)           # S > 1: the residual in the segment sum
    assert tc.segments(20, 160)[0] > 1
    out = _dev(res[:, :20].copy())
    tc.linear_tc(_dev(x2), _dev(w2), out, residual=out)
    _assert_close(out.copy_to_host(), prologue_input(x2, "none", None), w2, res[:, :20].astype(np.float64))


@pytest.mark.parametrize("prologue", ["none", "rmsnorm"])
def test_row_is_bit_identical_alone_and_among_many(layout, prologue):
    """Row 8 alone, among 9 (pre-pass rms from 9 rows, 2 m-tiles) and among 17 in three row groups
    of one m-tile (MAX_MTILES 1): the same bits."""
    x, w, nw = _rand(17, 96), _rand(24, 96), _rand(96)
    alone = _run(x[8:9], w, prologue, nw)[0]
    np.testing.assert_array_equal(_run(x[:9], w, prologue, nw)[8], alone)
    layout(MAX_MTILES=1)
    np.testing.assert_array_equal(_run(x, w, prologue, nw)[8], alone)


def test_layout_knobs_are_not_numerics(layout):
    """The cp.async ring or registers, pre-split or not, more m-tiles a row group: the same bits."""
    x, w, nw = _rand(9, 72), _rand(20, 72), _rand(72)
    base = _run(x, w, "rmsnorm", nw)
    layout(ASYNC_RING=not tc.ASYNC_RING)
    np.testing.assert_array_equal(_run(x, w, "rmsnorm", nw), base)
    layout(PRESPLIT_MIN_MTILES=99)
    np.testing.assert_array_equal(_run(x, w, "rmsnorm", nw), base)
    layout(MAX_MTILES=1)
    np.testing.assert_array_equal(_run(x, w, "rmsnorm", nw), base)


def test_blocks_looping_over_many_items_keep_the_bits(layout, monkeypatch):
    """A grid of one SM's blocks runs the (row group, segment, column block) items in turn: the
    staged rows, each block's own rms and the ring slots reused across items give the same bits as
    one item a block (9 rows: 2 row groups of 1 m-tile; 2 segments)."""
    x, w, nw = _rand(9, 128), _rand(40, 128), _rand(128)
    layout(MAX_MTILES=1, PRE_RMS_MIN_ROWS=99)
    items = tc.segments(40, 128)[0] * 2
    assert items == 4 and tc._setup("rmsnorm", False, 9, 40, 128)[1][0] == items   # one block an item
    base = _run(x, w, "rmsnorm", nw)
    one_sm = dataclasses.replace(tc.active_profile(), sm_count=1)
    monkeypatch.setattr(tc, "active_profile", lambda: one_sm)
    for ring in (False, True):
        layout(ASYNC_RING=ring)
        assert tc._setup("rmsnorm", False, 9, 40, 128)[1][0] == 2                  # two items a block
        np.testing.assert_array_equal(_run(x, w, "rmsnorm", nw), base)


@pytest.mark.skipif(not SIMULATED, reason="the simulator's mma model")
def test_simulated_mma_refuses_float64_operands():
    @cuda.jit
    def kernel(out):
        d = tc.mma_tf32(1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0)
        out[cuda.threadIdx.x] = d[0]

    with pytest.raises(TypeError, match="float32"):
        kernel[1, 32](np.zeros(32, np.float32))


def test_segments_and_mtiles_are_functions_of_the_shape():
    """S(N, K) and the segment length depend on the weight's shape only; m-tiles: fewest row
    groups, then fewest padded tiles."""
    for n_cols, k_dim in ((2048, 8192), (12288, 768), (32768, 2048), (1344, 2048), (2048, 256), (40, 64)):
        n_segs, seg_k = tc.segments(n_cols, k_dim)
        assert seg_k % tc.STEP_K == 0 and seg_k >= min(tc.MIN_SEG_K, k_dim)
        assert (n_segs - 1) * seg_k < k_dim <= n_segs * seg_k
    assert tc.partials_shape(33, 2048, 8192) == (tc.segments(2048, 8192)[0], 33, 2048)
    assert tc.MAX_MTILES == 5
    assert [tc.mtiles(m) for m in (1, 8, 9, 33, 40)] == [1, 1, 2, 5, 5]
    assert tc.mtiles(41) == 3                                      # 6 tiles: two groups of 3, not 5 + 1


def _good():
    return _dev(_rand(2, 8)), _dev(_rand(4, 8)), _dev(np.zeros((2, 4), np.float32))


@pytest.mark.parametrize("case,exc,name", [
    (lambda x, w, o: tc.linear_tc(x, _dev(_rand(4, 8).astype(np.float64)), o), TypeError, "w"),
    (lambda x, w, o: tc.linear_tc(x, _dev(_rand(4, 6)), o), ValueError, "x"),
    (lambda x, w, o: tc.linear_tc(_dev(_rand(2, 6)), _dev(_rand(4, 6)), o), ValueError, "w must have K a multiple of 4"),
    (lambda x, w, o: tc.linear_tc(_dev(_rand(2, 9))[:, 1:], w, o), ValueError, "x"),
    (lambda x, w, o: tc.linear_tc(x, w, _dev(np.zeros((2, 3), np.float32))), ValueError, "out"),
    (lambda x, w, o: tc.linear_tc(x, w, o, swiglu=True), ValueError, "x"),
    (lambda x, w, o: tc.linear_tc(x, w, o, norm_weight=_dev(_rand(8)), swiglu=True), ValueError, "norm_weight"),
    (lambda x, w, o: tc.linear_tc(x, w, o, residual=_dev(_rand(3, 4))), ValueError, "residual"),
    (lambda x, w, o: tc.linear_tc(x, w, o, norm_weight=_dev(_rand(8)), eps=float("nan")), ValueError, "eps"),
    (lambda x, w, o: tc.linear_tc(_dev(_rand(2, 160)), _dev(_rand(4, 160)), o,
                                  partials=_dev(np.zeros((1, 2, 4), np.float32))), ValueError, "partials"),
    (lambda x, w, o: tc.linear_tc(_dev(_rand(2, 160)), _dev(_rand(4, 160)), o,   # the right shape, rows 8 apart
                                  partials=_dev(np.zeros((tc.segments(4, 160)[0], 2, 8), np.float32))[:, :, :4]),
     ValueError, "partials must be C-contiguous"),
    (lambda x, w, o: tc.linear_tc(_dev(_rand(9, 8)), w, _dev(np.zeros((9, 4), np.float32)),
                                  norm_weight=_dev(_rand(8)), inv_rms=_dev(np.zeros(8, np.float32))),
     ValueError, "inv_rms"),
])
def test_bad_input_names_the_argument_and_writes_nothing(case, exc, name):
    x, w, out = _good()
    with pytest.raises(exc, match=rf"^{name}\b"):
        case(x, w, out)
    assert np.all(out.copy_to_host() == 0.0)


def test_kernels_are_registered():
    from ddtree_numba.kernels import registry

    names = {k.name for k in registry.all_kernels()}
    assert {f"linear_tc_{p}_mt{mt}" for p in tc.PROLOGUES for mt in (1, tc.MAX_MTILES)} <= names
    assert {f"linear_tc_{p}_mt{mt}_plain" for p in tc.PROLOGUES for mt in (1, tc.MAX_MTILES)} <= names  # no residual
    assert {f"linear_tc_rmsnorm_mt{mt}_ring" for mt in (1, tc.MAX_MTILES)} <= names
    assert {"linear_tc_inv_rms", "linear_tc_segment_sum", "linear_tc_segment_sum_residual"} <= names


# --- GPU: small's shapes ----------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("n_cols,k_dim,prologue", [(32768, 2048, "rmsnorm"), (11264, 2048, "rmsnorm"),
                                                    (12288, 768, "rmsnorm"), (2048, 5632, "swiglu"),
                                                    (2048, 8192, "none"), (1344, 2048, "rmsnorm"),
                                                    (2048, 256, "swiglu"), (512, 2048, "rmsnorm")])
def test_gpu_small_preset_shapes(layout, n_cols, k_dim, prologue):
    """On the tensor cores: every element written and finite, rows 0 and M - 1 within the bound, row
    0's bits the same alone as in 7 and 33 rows and rows 0-6 the same in 7 as in 33, for each layout
    (the default; the other weight path; two row groups of 3 m-tiles), each from the defaults."""
    rng = np.random.default_rng(n_cols + k_dim)
    w = _rand(n_cols, k_dim, rng=rng)
    kx = 2 * k_dim if prologue == "swiglu" else k_dim
    x = _rand(33, kx, rng=rng)
    nw = _rand(k_dim, rng=rng)
    alone = _run(x[:1], w, prologue, nw)[0]
    defaults = {"ASYNC_RING": tc.ASYNC_RING, "MAX_MTILES": tc.MAX_MTILES}
    for variant in ({}, {"ASYNC_RING": not tc.ASYNC_RING}, {"MAX_MTILES": 3}):
        layout(**{**defaults, **variant})
        got = {m_rows: _run(x[:m_rows], w, prologue, nw) for m_rows in (7, 33)}
        for m_rows, rows in got.items():
            assert np.isfinite(rows).all()
            np.testing.assert_array_equal(rows[0], alone)
            check = [0, m_rows - 1]
            _assert_close(rows[check], prologue_input(x[check], prologue, nw), w)
        np.testing.assert_array_equal(got[33][:7], got[7])


def test_set_async_ring_returns_the_previous_and_clears_the_plans(layout):
    """set_async_ring (what the benches' ring variants call): the previous setting back, the
    launch plans rebuilt with the new one, bad values refused by name."""
    layout(ASYNC_RING=False)                                 # (restored after the test)
    assert tc.set_async_ring((1,)) is False and tc.uses_ring(1) and not tc.uses_ring(2)
    assert tc._setup("none", False, 1, 32768, 2048)[2] == tc.ring_bytes(1)   # a plan with the ring
    assert tc.set_async_ring(False) == (1,) and tc._setup("none", False, 1, 32768, 2048)[2] == 0
    for bad in ((0,), (6,), (True,), [1], 1, "yes"):
        with pytest.raises(ValueError, match="ring must be"):
            tc.set_async_ring(bad)


def test_ring_by_m_tiles_and_a_grid_that_fits_shared_memory(layout):
    """ASYNC_RING as a tuple takes the ring for those m-tile counts only; a launch whose ring
    slots leave room for fewer blocks an SM than its register bound gets a grid of that many
    (a persistent grid never holds blocks that cannot be resident)."""
    layout(ASYNC_RING=(1,))
    assert tc.uses_ring(1) and not tc.uses_ring(5)
    kernel, grid, smem = tc._setup("none", False, 1, 32768, 2048)[:3]
    assert smem == tc.ring_bytes(1) > 0 and tc._setup("none", False, 33, 32768, 2048)[2] == 0
    sms = tc.active_profile().sm_count
    assert grid[0] == sms * tc.resident_blocks(1)            # the ring's slots fit the register bound
    layout(RING_STAGES=(16, 3, 3, 3, 3))                     # a ring of 16 slots: one block an SM
    kernel, grid, smem = tc._setup("none", False, 1, 32768, 2048)[:3]
    assert smem == 16 * tc.WARPS * tc.WARP * 32 * 4 and grid[0] == sms
