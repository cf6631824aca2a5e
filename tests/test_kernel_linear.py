"""Batch-invariant FP32 products (ddtree_numba.kernels.linear) against NumPy float64.

Tolerance: |out - ref| <= 1e-5 * (|input| @ |w|.T) elementwise (+ |residual| * 1e-6), ref in
float64; FP32 fma chains over K <= 2100 land far inside it. Batch invariance is bit-exact: a row's
output is the same whether computed alone, among 7 or 33 rows, or through expert_linear /
head_linear. Under the simulator the reduction order itself is checked bit for bit against a
NumPy emulation (the simulator's fma is a*b + c in float32).
"""
import contextlib

import numpy as np
import pytest
from numba import cuda

from ddtree_numba.kernels import linear as lin
from tests.linear_checks import assert_within_linear_bound as _assert_close, dev as _dev


RNG = np.random.default_rng(20261130)
SIMULATED = bool(cuda.config.ENABLE_CUDASIM)


def _rand(*shape, rng=RNG):
    return rng.standard_normal(shape).astype(np.float32)


def _rms(x, weight, eps):
    x64 = x.astype(np.float64)
    return x64 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + eps) * weight


def _silu_mul(x, k):
    g = x[:, :k].astype(np.float64)
    return g / (1.0 + np.exp(-g)) * x[:, k:].astype(np.float64)


def _run_linear(x, w, **kwargs):
    out = cuda.to_device(np.full((x.shape[0], w.shape[0]), np.nan, np.float32))
    lin.linear(_dev(x), _dev(w), out, **kwargs)
    return out.copy_to_host()


# --- the order of the reduction, emulated --------------------------------------------------------

def _emulate(inp, w):
    """The documented order in float32 with the simulator's fma (a*b + c, two roundings)."""
    m_rows, k_dim = inp.shape
    split = lin.k_split(k_dim)
    steps = -(-k_dim // lin.STEP)
    seg_steps = -(-steps // split)
    out = np.zeros((m_rows, w.shape[0]), np.float32)
    for s in range(split):
        partial = np.zeros((32, m_rows, w.shape[0]), np.float32)  # [lane, M, N]
        for j in range(s * seg_steps, min((s + 1) * seg_steps, steps)):
            for e in range(4):
                k = j * lin.STEP + 4 * np.arange(32) + e  # [32]
                ok = k < k_dim
                kk = np.where(ok, k, 0)
                prod = inp[:, kk].T[:, :, None] * w[:, kk].T[:, None, :]  # [32, M, N] float32
                partial = np.where(ok[:, None, None], prod + partial, partial)
        offset = 16
        while offset:
            partial = partial[:offset] + partial[offset:2 * offset]
            offset //= 2
        out = partial[0] if s == 0 else out + partial[0]
    return out


@pytest.mark.skipif(not SIMULATED, reason="the GPU fma rounds once; the emulation models the simulator")
@pytest.mark.parametrize("m_rows,n_cols,k_dim", [(3, 5, 300), (2, 4, 2100), (1, 3, 126), (9, 11, 300)])
def test_reduction_order_is_the_documented_one(m_rows, n_cols, k_dim):
    """(9, 11, 300): two 8-row tiles of the 8 x 8 register tile (the simulator plans for the
    H200), N not a multiple of C."""
    x, w = _rand(m_rows, k_dim), _rand(n_cols, k_dim)
    np.testing.assert_array_equal(_run_linear(x, w), _emulate(x, w))


def _emulate_rmsnorm(x, nw, eps):
    """The RMSNorm prologue's staged rows in float32 (simulator fma, a*b + c): lane l sums
    x[k]^2 for k = l, l + 32, ... ascending, the xor butterfly adds the 32 partials,
    inv = 1 / sqrt(total / K + eps), and each staged value is x * inv * weight."""
    m_rows, k_dim = x.shape
    one = np.float32(1.0)
    out = np.empty_like(x)
    for m in range(m_rows):
        partial = np.zeros(32, np.float32)
        for k in range(k_dim):
            partial[k % 32] = x[m, k] * x[m, k] + partial[k % 32]
        offset = 16
        while offset:
            partial = partial[:offset] + partial[offset:2 * offset]
            offset //= 2
        inv = one / np.sqrt(partial[0] / np.float32(k_dim) + np.float32(eps))
        out[m] = x[m] * inv * nw
    return out


@pytest.mark.skipif(not SIMULATED, reason="the GPU fma rounds once; the emulation models the simulator")
@pytest.mark.parametrize("m_rows,k_dim,strided", [(1, 2048, False), (3, 1500, False), (9, 33, False),
                                                   (2, 1030, True), (1, 1024, False), (2, 1000, False),
                                                   (1, 768, True), (1, 20, False)])
def test_rmsnorm_prologue_order_is_the_documented_one(m_rows, k_dim, strided):
    """The rms sum (32 loads a lane batched ahead of its fma chain, zeros past K) keeps the
    lane-strided order: K 2048 (two whole batches a lane), 1024 (one), 1500 / 1030 / 1000 / 768
    (a partial last batch; 1000: some lanes' batch holds 31 elements, others 32), 33 and 20 (lanes
    with one element or none; 9 rows: two tiles); x a column slice of a wider buffer (w_q's a_q
    view) where ``strided``."""
    x, w, nw = _rand(m_rows, k_dim), _rand(5, k_dim), _rand(k_dim)
    d_x = _dev(x)
    if strided:
        wide = np.zeros((m_rows, k_dim + 7), np.float32)
        wide[:, 3:3 + k_dim] = x
        d_x = _dev(wide)[:, 3:3 + k_dim]
    out = _dev(np.zeros((m_rows, 5), np.float32))
    lin.linear(d_x, _dev(w), out, norm_weight=_dev(nw), eps=1e-6)
    np.testing.assert_array_equal(out.copy_to_host(), _emulate(_emulate_rmsnorm(x, nw, 1e-6), w))


def _shuffle_linear(x, w, kind_prologue="none", columns=None, mt=None, phase_steps=None,
                    shuffles=True, pipelined=None, ring_stages=0):
    """linear() through the GPU build's reduction (the transposed shuffle butterfly; the tree
    with ``shuffles=False``), launched directly under the simulator: grid (row tiles, 1 column
    block looping over all); ``columns``, ``mt``, ``phase_steps``: the tile's C, row tile and
    staged steps per phase (default the plan's); ``pipelined``: the weight ring or not;
    ``ring_stages``: the async weight ring's slots (its shared memory added after the rows)."""
    m_rows, n_cols, k_dim = x.shape[0], w.shape[0], w.shape[1]
    plan = lin.plan_linear(m_rows, n_cols, k_dim)
    mt = mt or plan.mt
    phase_steps = phase_steps or plan.phase_steps
    columns = columns or plan.columns
    kernel = lin.get_kernel("linear", kind_prologue, False, mt, columns=columns,
                            shuffles=shuffles, pipelined=pipelined, ring_stages=ring_stages)
    out = cuda.to_device(np.full((m_rows, n_cols), np.nan, np.float32))
    geometry = plan.geometry(n_cols, k_dim)[:4] + (phase_steps, plan.vec_steps)
    ring_bytes = 4 * (plan.threads // lin.WARP) * ring_stages * columns * lin.STEP
    kernel[(-(-m_rows // mt), 1, 1), plan.threads, 0, 4 * mt * plan.k_split * phase_steps * lin.STEP + ring_bytes](
        _dev(x), _dev(w.ravel()), out, out, _dev(np.ones(k_dim, np.float32)), np.float32(1e-6), *geometry)
    return out.copy_to_host()


@pytest.mark.skipif(not SIMULATED, reason="the tree reduction exists only under the simulator")
@pytest.mark.parametrize("m_rows,n_cols,k_dim", [(9, 11, 300), (1, 5, 260), (3, 6, 2100), (2, 3, 40)])
def test_shuffle_butterfly_gives_the_tree_bits(m_rows, n_cols, k_dim):
    """The GPU's transposed butterfly (MT x C partials traded across lanes: 64 with the 8 x 8
    tile, 4 with one row) sums the same pairs as the shared-memory tree: the same bits, every
    element stored once (poisoned output). (3, 6, 2100): two K segments, the combine path."""
    rng = np.random.default_rng(m_rows * 1000 + k_dim)
    x, w = _rand(m_rows, k_dim, rng=rng), _rand(n_cols, k_dim, rng=rng)
    np.testing.assert_array_equal(_shuffle_linear(x, w), _run_linear(x, w))


@pytest.fixture
def odd_tiles():
    """linear.ODD_TILES on for the test (set_odd_tiles clears the plan caches both ways)."""
    previous = lin.set_odd_tiles(True)
    yield
    lin.set_odd_tiles(previous)


@pytest.mark.skipif(not SIMULATED, reason="the tree reduction exists only under the simulator")
@pytest.mark.parametrize("m_rows,n_cols,k_dim,phase_steps", [(33, 9, 300, None), (12, 5, 2100, 2),
                                                             (33, 4, 700, 1)])
def test_odd_row_tile_gives_the_plan_bits(m_rows, n_cols, k_dim, phase_steps):
    """The 11-row tile (linear.ODD_ROW_TILES): its 44 partials a lane through the transposed
    butterfly padded to 64, and through the tree, give the bits of linear() with 8-row tiles only
    (ODD_TILES off for the reference), every element stored (poisoned output). (12, 5, 2100):
    two K segments, the combine; (33, 4, 700) staged in phases of one step."""
    rng = np.random.default_rng(m_rows * 1000 + k_dim)
    x, w = _rand(m_rows, k_dim, rng=rng), _rand(n_cols, k_dim, rng=rng)
    previous = lin.set_odd_tiles(False)
    try:
        want = _run_linear(x, w)
    finally:
        lin.set_odd_tiles(previous)
    for shuffles in (True, False):
        got = _shuffle_linear(x, w, mt=11, columns=lin.COLUMNS, shuffles=shuffles, phase_steps=phase_steps)
        np.testing.assert_array_equal(got, want)


def test_odd_row_tiles_pick_and_keep_the_order(odd_tiles):
    """With ODD_TILES on, 33 rows (a B 32 tree) take 3 x 11 tiles instead of 5 x 8 where they fit,
    expert and argmax launches keep the powers of two, and the rows keep their bits (the emulated
    order under the simulator; a row alone = in 33 rows; head_linear = linear per group)."""
    assert [lin.row_tile(r, 300, "linear") for r in (1, 8, 9, 33, 1056)] == [1, 8, 11, 11, 8]
    assert lin.row_tile(33, 300, "head") == 11 and lin.row_tile(33, 300, "expert") == 8
    assert lin.row_tile(33, 300) == 8     # launches name their kind (linear, head_linear, the plans)
    assert lin.plan_linear(33, 5, 300).mt == 11 and lin.plan_linear(33, 5, 300, kind="head").mt == 11
    assert lin.plan_linear(33, 5, 300, kind="expert").mt == 8 and lin.plan_linear(33, 5, 300, kind="argmax").mt == 8
    for kind, prologue, columns in (("expert", "none", 4), ("argmax", "none", 4), ("linear", "none", 8)):
        with pytest.raises(ValueError, match="no linear kernel"):
            lin.get_kernel(kind, prologue, False, 11, columns=columns)
    x, w = _rand(33, 300), _rand(6, 300)
    got = _run_linear(x, w)
    np.testing.assert_array_equal(got[:1], _run_linear(x[:1], w))
    if SIMULATED:
        np.testing.assert_array_equal(got, _emulate(x, w))
    xg, wg = _rand(33, 2, 300), _rand(2, 6, 300)
    out = cuda.to_device(np.full((33, 2, 6), np.nan, np.float32))
    lin.head_linear(_dev(xg), _dev(wg), out)
    for g in range(2):
        np.testing.assert_array_equal(out.copy_to_host()[:, g], _run_linear(xg[:, g], wg[g]))


def _odd_kernel(kind, prologue, residual, blocks):
    """The 11-row kernel _setup picks for ``blocks`` an SM (get_kernel's cache key as _setup
    passes it, ring off)."""
    return lin.get_kernel(kind, prologue, residual, 11, columns=lin.COLUMNS, pipelined=lin.ring_for(11),
                          vector_x=lin.VECTOR_X_LOADS, vector_stage=lin.VECTOR_STAGING, ring_stages=0,
                          min_blocks=blocks, unroll=lin._unroll(11, lin.COLUMNS))


def test_odd_tile_blocks_are_layout_and_fit_the_sm(odd_tiles):
    """ODD_TILE_BLOCKS (the 11-row tiles' launch bounds and grids, 1 or 2 blocks an SM): only odd
    tiles whose two blocks' staged rows fit an SM's shared memory take 2 (K 2304 fits, 2432 not;
    a ring's slots can cost the second block, and then the plan drops the ring); the launch takes
    the kernel built for the plan's blocks; the setter and get_kernel refuse other values; the
    rows keep their bits with it on (under the simulator launch bounds are no option and grids
    are fixed, so the bits check the plumbing; the GPU test below, the compiled tile)."""
    def odd(k_dim, ring_bytes=0):   # an 11-row plan staging K once (col_blocks, split: not read)
        return lin.LinearPlan(11, lin.COLUMNS, 1, -(-k_dim // 128), -(-k_dim // 128), k_dim // 128, 256, 1,
                              4 * 11 * 128 * -(-k_dim // 128) + ring_bytes)
    eight = lin.LinearPlan(8, lin.COLUMNS, 1, 6, 6, 6, 256, 1, 4 * 8 * 768)
    plans = (odd(768), odd(2304), odd(2432), odd(2048, 2 * 32 * 1024), eight)
    assert [lin.blocks_per_sm(p) for p in plans] == [1, 1, 1, 1, 1]
    previous = lin.set_odd_tile_blocks(2)
    try:
        assert previous == 1 and lin.ODD_TILE_BLOCKS == 2
        assert [lin.blocks_per_sm(p) for p in plans] == [2, 2, 1, 1, 1]
        for bad in (0, 3, True, 2.0):
            with pytest.raises(ValueError, match="blocks"):
                lin.set_odd_tile_blocks(bad)
            with pytest.raises(ValueError, match="min_blocks"):
                lin.get_kernel("linear", "none", False, 11, min_blocks=bad)
        kernel = lin._setup("linear", "none", False, 11, 7, 300, True, 3)[0]
        assert kernel is _odd_kernel("linear", "none", False, 2)
        x, w = _rand(33, 300), _rand(7, 300)
        got = _run_linear(x, w)
    finally:
        lin.set_odd_tile_blocks(previous)
    assert lin.ODD_TILE_BLOCKS == 1
    np.testing.assert_array_equal(got, _run_linear(x, w))
    np.testing.assert_array_equal(got[:1], _run_linear(x[:1], w))


def test_odd_tile_unroll_keeps_the_bits(odd_tiles):
    """ODD_TILE_UNROLL 3 / 4 (the 11-row tiles' register ring deeper, its rounds unrolled in Python):
    the bits of the default 2 (computed once for both) for linear (RMSNorm; K 300: no full round,
    the tail's guarded steps and a partial step; K 640: a full round at U 3, then the tail; K 896: a
    full round at U 4) and head_linear (K 640), every element written (the simulator's 40 KiB stages
    11 rows up to K 896, so no test here runs two rounds: the GPU test below does); the
    launch takes the kernel built for the setting; the setter refuses other values."""
    rng = np.random.default_rng(3)
    cases = []
    for k_dim in (300, 640, 896):
        x, w, norm = _rand(33, k_dim, rng=rng), _rand(7, k_dim, rng=rng), _rand(k_dim, rng=rng)
        cases.append(lambda x=x, w=w, norm=norm: _run_linear(x, w, norm_weight=_dev(norm), eps=1e-6))
    xg, wg = _rand(33, 2, 640, rng=rng), _rand(2, 6, 640, rng=rng)
    cases.append(lambda: _head(xg, wg, serial=False))
    want = [run() for run in cases]
    assert lin.plan_linear(33, 7, 640).mt == 11 and lin.plan_linear(33, 7, 896).mt == 11
    assert lin.plan_linear(33, 6, 640, kind="head").mt == 11
    for unroll in (3, 4):
        previous = lin.set_odd_tile_unroll(unroll)
        try:
            assert previous == 2 and lin._unroll(11, lin.COLUMNS) == unroll and lin._unroll(8, lin.COLUMNS) == 2
            got = [run() for run in cases]
            kernel = lin._setup("linear", "none", False, 11, 7, 300, True, 3)[0]
            assert kernel is _odd_kernel("linear", "none", False, 1)   # built with unroll = ODD_TILE_UNROLL
            for bad in (1, 5, True, 3.0):
                with pytest.raises(ValueError, match="unroll"):
                    lin.set_odd_tile_unroll(bad)
                with pytest.raises(ValueError, match="unroll"):
                    lin.get_kernel("linear", "none", False, 11, unroll=bad)
        finally:
            lin.set_odd_tile_unroll(previous)
        assert lin.ODD_TILE_UNROLL == 2
        for a, b in zip(got, want):
            assert not np.isnan(a).any(), unroll
            np.testing.assert_array_equal(a, b, err_msg=f"unroll {unroll}")


def _odd_tile_case(n_cols, k_dim, prologue, kind, rng):
    """A 33-row product of random inputs as a call (linear with the prologue, or head_linear over 4
    groups), skipping where the GPU stages no 11-row tile at this K."""
    if kind == "head":
        x, w = _rand(33, 4, k_dim, rng=rng), _rand(4, n_cols, k_dim, rng=rng)
        run = lambda: _head(x, w, serial=False)   # noqa: E731
    else:
        x, w = _rand(33, k_dim, rng=rng), _rand(n_cols, k_dim, rng=rng)
        norm = (_rand(k_dim, rng=rng), 1e-6) if prologue == "rmsnorm" else None
        kwargs = {"norm_weight": _dev(norm[0]), "eps": norm[1]} if norm else {}
        run = lambda: _run_linear(x, w, **kwargs)   # noqa: E731
    if lin.plan_linear(33, n_cols, k_dim, kind=kind).mt != 11:
        pytest.skip("this GPU's opt-in shared memory stages no 11-row tile at this K")
    return run


@pytest.mark.gpu
@pytest.mark.parametrize("n_cols,k_dim,prologue,kind", [(12288, 768, "none", "linear"),
                                                        (1344, 2048, "rmsnorm", "linear"),
                                                        (2048, 2048, "none", "head")])
def test_gpu_odd_tiles_at_two_blocks_an_sm_keep_the_bits(odd_tiles, n_cols, k_dim, prologue, kind):
    """`small`'s 33-row w_q, w_a (RMSNorm) and a head-split product (wo's segments, 4 groups)
    with the 11-row tiles compiled for 2 blocks an SM (128 registers, spills) equal the default
    tiles bit for bit, every element written."""
    rng = np.random.default_rng(n_cols + k_dim)
    run = _odd_tile_case(n_cols, k_dim, prologue, kind, rng)
    want = run()
    previous = lin.set_odd_tile_blocks(2)
    try:
        plan = lin.plan_linear(33, n_cols, k_dim, kind=kind)
        assert lin.blocks_per_sm(plan) == 2 and plan.ring_stages == 0
        got = run()
        # the launch compiled the 2-block tile (a numba dispatcher holds its compiled overloads)
        assert _odd_kernel(kind, prologue, False, 2).overloads
    finally:
        lin.set_odd_tile_blocks(previous)
    assert not np.isnan(got).any()
    np.testing.assert_array_equal(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("unroll", [3, 4])
@pytest.mark.parametrize("n_cols,k_dim,prologue,kind", [(12288, 768, "none", "linear"),
                                                        (1344, 2048, "rmsnorm", "linear"),
                                                        (2048, 2048, "none", "head")])
def test_gpu_odd_tile_unroll_keeps_the_bits(odd_tiles, unroll, n_cols, k_dim, prologue, kind):
    """`small`'s 33-row w_q, w_a (RMSNorm) and a head-split product (wo's segments, 4 groups) with
    the 11-row tiles' ring at 3 / 4 slots (ODD_TILE_UNROLL: several rounds at K 2048) equal the
    default's bits, every element written."""
    rng = np.random.default_rng(n_cols + k_dim + unroll)
    run = _odd_tile_case(n_cols, k_dim, prologue, kind, rng)
    want = run()
    previous = lin.set_odd_tile_unroll(unroll)
    try:
        got = run()
    finally:
        lin.set_odd_tile_unroll(previous)
    assert not np.isnan(got).any()
    np.testing.assert_array_equal(got, want)


# --- accuracy -------------------------------------------------------------------------------------

@pytest.mark.parametrize("m_rows,n_cols,k_dim", [(1, 9, 64), (3, 17, 300), (5, 8, 130), (17, 5, 131),
                                                 (2, 3, 7), (4, 6, 2100)])
def test_linear_matches_float64(m_rows, n_cols, k_dim):
    x, w = _rand(m_rows, k_dim), _rand(n_cols, k_dim)
    _assert_close(_run_linear(x, w), x, w)


def test_rmsnorm_prologue_and_residual_aliasing_out():
    x, w, nw = _rand(6, 200), _rand(7, 200), _rand(200)
    res = _rand(6, 7)
    out = _dev(res)
    lin.linear(_dev(x), _dev(w), out, norm_weight=_dev(nw), eps=1e-5, residual=out)
    _assert_close(out.copy_to_host(), _rms(x, nw, 1e-5), w, residual=res.astype(np.float64))


def test_swiglu_prologue_and_separate_residual():
    x, w, res = _rand(3, 2 * 150), _rand(5, 150), _rand(3, 5)
    out = _run_linear(x, w, swiglu=True, residual=_dev(res))
    _assert_close(out, _silu_mul(x, 150), w, residual=res.astype(np.float64))


def test_views_column_slice_in_and_out():
    """x a column slice of a wider buffer (row stride != K), out a column slice too."""
    big = _rand(4, 100)
    w = _rand(6, 64)
    out_big = np.full((4, 10), -7.0, np.float32)
    d_big, d_out = _dev(big), _dev(out_big)
    lin.linear(d_big[:, 20:84], _dev(w), d_out[:, 2:8])
    got = d_out.copy_to_host()
    _assert_close(got[:, 2:8], big[:, 20:84], w)
    assert np.all(got[:, :2] == -7.0) and np.all(got[:, 8:] == -7.0)


def test_unaligned_weight_rows_use_the_same_order():
    """K % 4 != 0 rules out 16-byte loads (scalar path); K % 4 == 0 with a misaligned base too:
    both must give the aligned path's bits."""
    x, w = _rand(2, 260), _rand(3, 260)
    ref = _run_linear(x, w)
    buf = cuda.to_device(np.concatenate([np.zeros(1, np.float32), w.ravel()]))
    shifted = buf[1:].reshape(3, 260)  # base 4 bytes past an aligned address
    assert lin.plan_linear(2, 3, 260, w=shifted).vec_steps == 0
    out = cuda.to_device(np.zeros((2, 3), np.float32))
    lin.linear(_dev(x), shifted, out)
    np.testing.assert_array_equal(out.copy_to_host(), ref)


# --- batch invariance ------------------------------------------------------------------------------

@pytest.mark.parametrize("k_dim,prologue", [(300, "none"), (1500, "rmsnorm"), (2100, "swiglu")])
def test_row_is_bit_identical_alone_in_7_and_in_33(k_dim, prologue):
    """Row tiles 1, 8 and 8 (5 tiles); K = 1500 and 2100 stage in 2 phases at MT 8, 2100 has 2
    K segments."""
    rng = np.random.default_rng(k_dim)
    kx = 2 * k_dim if prologue == "swiglu" else k_dim
    row = _rand(1, kx, rng=rng)
    w = _rand(5, k_dim, rng=rng)
    kwargs = {"swiglu": True} if prologue == "swiglu" else {}
    if prologue == "rmsnorm":
        kwargs = {"norm_weight": _dev(_rand(k_dim, rng=rng)), "eps": 1e-6}
    alone = _run_linear(row, w, **kwargs)[0]
    for batch, where in ((7, 3), (33, 20)):
        x = _rand(batch, kx, rng=rng) * rng.uniform(0.1, 10.0)
        x[where] = row[0]
        got = _run_linear(x, w, **kwargs)
        np.testing.assert_array_equal(got[where], alone)


def _head(x, w, *, serial, phases=None, leaf_split=None):
    """head_linear of a view x [M, G, K] (of wider rows), through the thread-serial kernel (its
    leaves in ``phases`` staged phases and ``leaf_split`` subsets, default the plan's) or the warp
    layout."""
    saved = lin.SERIAL_HEADS, lin.SERIAL_PHASES, lin.SERIAL_LEAF_SPLITS
    lin.SERIAL_HEADS = serial
    if phases is not None:
        lin.SERIAL_PHASES = (phases,)
    if leaf_split is not None:
        lin.SERIAL_LEAF_SPLITS = (leaf_split,)
    lin.serial_plan.cache_clear()
    try:
        plan = lin.serial_plan(x.shape[0], w.shape[0], w.shape[1], w.shape[2])
        assert (plan is not None) == serial and (phases is None or plan.phases == phases)
        assert leaf_split is None or plan.leaf_split == leaf_split
        wide = np.concatenate([x, _rand(*x.shape[:2], 4)], axis=2)   # [M, G, K + 4]: a strided view
        out = cuda.to_device(np.full((x.shape[0], w.shape[0], w.shape[1]), np.nan, np.float32))
        lin.head_linear(_dev(wide)[:, :, :x.shape[2]], _dev(w), out, w_kn=_dev(w.transpose(0, 2, 1)))
        return out.copy_to_host()
    finally:
        lin.SERIAL_HEADS, lin.SERIAL_PHASES, lin.SERIAL_LEAF_SPLITS = saved
        lin.serial_plan.cache_clear()


@pytest.mark.filterwarnings("ignore:overflow encountered")
@pytest.mark.parametrize("m_rows, groups, n_cols, k_dim, phases, leaf_split", [
    (8, 2, 132, 128, 1, 4),   # 2-row threads, a ragged last slab of columns; 4 subtrees of 8 leaves
    (9, 1, 36, 48, 2, 2),     # 3-row threads, K < 128: lanes past K hold +0.0 chains; 2 subtrees
    (12, 1, 64, 512, 4, 1),   # W_UV's K: four steps a lane (the GPU test runs 33 rows), one thread's tree
    (12, 1, 64, 512, 8, 4),   # the same, 8 phases of one leaf per subset
    (13, 1, 8, 260, 32, 1),   # a short last step, N < 32, one leaf a phase
    (40, 1, 12, 256, 8, 2),   # 2-row threads, three row blocks (grid y), the last one part empty
])
def test_serial_head_linear_is_the_warp_layout_bit_for_bit(m_rows, groups, n_cols, k_dim, phases, leaf_split):
    """The thread-serial kernel (leaves in bit-reversed lane order, a five-level binary counter,
    staged in 1 to 32 phases, run whole by one thread or as 2 / 4 subtrees that meet in the
    butterfly's order) gives the warp layout's bits, and the documented order's (the emulation)
    under the simulator."""
    rng = np.random.default_rng(m_rows * 1000 + k_dim)
    x, w = _rand(m_rows, groups, k_dim, rng=rng), _rand(groups, n_cols, k_dim, rng=rng)
    x[1, :, : k_dim // 2] = 0.0          # zero chains and exact cancellations
    w[:, 0] = -w[:, 1]
    x[-1, 0, 5] = np.float32(3e38)       # an overflow to inf in one chain
    got = _head(x, w, serial=True, phases=phases, leaf_split=leaf_split)
    np.testing.assert_array_equal(got, _head(x, w, serial=False))
    if SIMULATED:
        for g in range(groups):
            np.testing.assert_array_equal(got[:, g], _emulate(x[:, g], w[g]))


@pytest.mark.gpu
@pytest.mark.parametrize("m_rows", [8, 33, 132])
def test_gpu_serial_head_linear_is_the_warp_layout_bit_for_bit(m_rows):
    """The absorbs of `small`'s verify (64 heads: W_UK K 128 -> 512, W_UV K 512 -> 128) at a
    B 7 / B 32 tree and four B 32 trees: the thread-serial kernel (the plan's phases, 4 and 32)
    equals the warp layout."""
    rng = np.random.default_rng(m_rows)
    for n_cols, k_dim in ((512, 128), (128, 512)):
        x, w = _rand(m_rows, 64, k_dim, rng=rng), _rand(64, n_cols, k_dim, rng=rng)
        want = _head(x, w, serial=False)
        for phases in (None, 4, 32):
            got = _head(x, w, serial=True, phases=phases)
            assert not np.isnan(got).any()
            np.testing.assert_array_equal(got, want)
        for g in (0, 63):
            _assert_close(want[:, g], x[:, g], w[g])


def test_serial_plan(monkeypatch, request):
    """Rows per thread waste the fewest rows, a block holds every row up to its row-warp cap (then
    grid y), a leaf subset's warps stay within SERIAL_MAX_WARPS and the block's within
    serial_split_warps (the most subsets that fit), phases are the fewest whose staging fits;
    below SERIAL_MIN_ROWS, with K of several segments, K or N not a multiple of 4 (or SERIAL_HEADS
    off, the simulator's default) the warp layout runs."""
    request.addfinalizer(lin.serial_plan.cache_clear)   # no plan made with the switch on outlives the test
    lin.serial_plan.cache_clear()
    assert lin.SERIAL_HEADS == (not SIMULATED)                # the GPU default
    assert [lin.serial_split_warps(mt) for mt in (1, 2, 3, 4)] == [12, 12, 12, 8]
    monkeypatch.setattr(lin, "SERIAL_HEADS", False)
    assert lin.serial_plan(33, 64, 512, 128) is None
    monkeypatch.setattr(lin, "SERIAL_HEADS", True)
    lin.serial_plan.cache_clear()
    assert lin.serial_plan(lin.SERIAL_MIN_ROWS - 1, 64, 512, 128) is None
    assert lin.serial_plan(33, 64, 512, 4096) is None           # k_split 2
    assert lin.serial_plan(33, 64, 512, 126) is None and lin.serial_plan(33, 64, 510, 128) is None
    budget = lin._serial_budget()
    for rows, n_cols, k_dim, want_mt in ((33, 512, 128, 3), (33, 128, 512, 3), (132, 512, 128, 3), (8, 512, 128, 2),
                                         (10, 512, 128, 3), (16, 512, 128, 4)):
        plan = lin.serial_plan(rows, 64, n_cols, k_dim)
        assert plan.mt == want_mt and plan.steps == k_dim // 128 and plan.grid[2] == 64
        assert plan.col_warps * plan.row_warps <= lin.SERIAL_MAX_WARPS
        cap = lin.serial_split_warps(plan.mt)
        assert plan.threads == plan.leaf_split * plan.col_warps * plan.row_warps * 32 <= max(cap, lin.SERIAL_MAX_WARPS) * 32
        # the most subsets (the subtrees' meeting room in the staging buffer never binds at these shapes)
        assert plan.leaf_split * plan.phases <= 32 and (plan.leaf_split == 4 or 2 * plan.threads > 32 * cap
                                                         or 2 * plan.leaf_split * plan.phases > 32)
        assert plan.grid[1] * plan.block_rows >= rows > plan.grid[1] * plan.block_rows - plan.block_rows
        slab = plan.col_warps * lin.SERIAL_WARP_COLS
        assert plan.grid[0] * slab >= n_cols > (plan.grid[0] - 1) * slab
        w_floats, x_floats, _ = lin._serial_floats(plan.mt, plan.steps, plan.phases, plan.col_warps, plan.row_warps)
        assert plan.shared_bytes == 4 * (w_floats + x_floats) <= budget
        if plan.phases > 1:   # the fewest phases: half as many would not fit
            assert 4 * sum(lin._serial_floats(plan.mt, plan.steps, plan.phases // 2, plan.col_warps,
                                              plan.row_warps)[:2]) > budget
    if not SIMULATED:   # the H200: a 33-row verify's absorbs, every row in one block
        uk, uv = lin.serial_plan(33, 64, 512, 128), lin.serial_plan(33, 64, 128, 512)
        assert (uk.grid, uk.threads, uk.phases, uk.leaf_split) == ((8, 1, 64), 384, 1, 2)
        assert (uv.grid, uv.threads, uv.phases, uv.leaf_split) == ((4, 1, 64), 384, 2, 4)


def test_head_linear_matches_linear_per_group():
    m_rows, groups, n_cols, k_dim = 3, 4, 5, 48
    q = _rand(m_rows, groups, k_dim + 8)  # a view q[:, :, :K] of wider rows (nope | rope)
    w = _rand(groups, n_cols, k_dim)
    out = cuda.to_device(np.full((m_rows, groups, n_cols), np.nan, np.float32))
    lin.head_linear(_dev(q)[:, :, :k_dim], _dev(w), out)
    got = out.copy_to_host()
    for g in range(groups):
        _assert_close(got[:, g], q[:, g, :k_dim], w[g])
        np.testing.assert_array_equal(got[:, g], _run_linear(q[:, g, :k_dim], w[g]))


# --- expert_linear ---------------------------------------------------------------------------------

def _routing(rng, m_rows, experts, top_k, empty=()):
    """CSR of a random top-k routing: entries of expert e in ascending row order."""
    allowed = np.array([e for e in range(experts) if e not in empty])
    chosen = [np.sort(rng.choice(allowed, top_k, replace=False)) for _ in range(m_rows)]
    offsets, index, pairs = [0], [], []
    for e in range(experts):
        rows = [m for m in range(m_rows) if e in chosen[m]]
        index += rows
        pairs += [(m, e) for m in rows]
        offsets.append(len(index))
    return np.array(offsets, np.int32), np.array(index, np.int32), pairs


@pytest.mark.parametrize("swiglu", [False, True])
def test_expert_linear_matches_linear_bit_for_bit(swiglu):
    rng = np.random.default_rng(7 + swiglu)
    m_rows, experts, top_k, n_cols, k_dim = 5, 6, 2, 7, 136
    x = _rand(m_rows, 2 * k_dim if swiglu else k_dim, rng=rng)
    w = _rand(experts, n_cols, k_dim, rng=rng)
    offsets, index, pairs = _routing(rng, m_rows, experts, top_k, empty=(1, 4))
    capacity = m_rows * top_k + 3  # entries past offsets[E] stay untouched
    out = cuda.to_device(np.full((capacity, n_cols), -3.0, np.float32))
    row_index = np.zeros(capacity, np.int32)
    row_index[:len(index)] = index
    lin.expert_linear(_dev(x), _dev(w), out, _dev(offsets), _dev(row_index), swiglu=swiglu)
    got = out.copy_to_host()
    inp = _silu_mul(x, k_dim) if swiglu else x.astype(np.float64)
    for j, (m, e) in enumerate(pairs):
        _assert_close(got[j:j + 1], inp[m:m + 1], w[e])
        np.testing.assert_array_equal(got[j], _run_linear(x[m:m + 1], w[e], swiglu=swiglu)[0])
    assert np.all(got[len(pairs):] == -3.0)


def test_expert_linear_max_rows_is_layout_and_checked():
    """max_rows (the most entries an expert holds) picks the row tile only: the same bits for a
    routing of one entry an expert at max_rows 1 and at the default (the entries' tile), and a
    bad value is refused before any launch, naming it."""
    rng = np.random.default_rng(5)
    experts, n_cols, k_dim, entries = 6, 9, 72, 5
    x = _rand(entries, 2 * k_dim, rng=rng)
    w = _rand(experts, n_cols, k_dim, rng=rng)
    offsets = np.array([0, 1, 2, 2, 3, 4, 5], np.int32)   # one entry an expert (expert 2 empty)
    index = np.arange(entries, dtype=np.int32)
    assert lin.row_tile(entries, k_dim, "expert") > 1 == lin.row_tile(1, k_dim, "expert")
    got = []
    for max_rows in (None, 1):
        out = cuda.to_device(np.full((entries, n_cols), np.nan, np.float32))
        lin.expert_linear(_dev(x), _dev(w), out, _dev(offsets), _dev(index), swiglu=True, max_rows=max_rows)
        got.append(out.copy_to_host())
    np.testing.assert_array_equal(got[0], got[1])
    assert np.isfinite(got[0]).all()
    out = cuda.to_device(np.full((entries, n_cols), 7.0, np.float32))
    for bad, exc in ((0, ValueError), (1.5, TypeError), (True, TypeError)):
        with pytest.raises(exc, match="max_rows"):
            lin.expert_linear(_dev(x), _dev(w), out, _dev(offsets), _dev(index), swiglu=True, max_rows=bad)
    assert np.all(out.copy_to_host() == 7.0)


def test_expert_linear_is_invariant_to_the_routing():
    """Row 0 through expert 2: the same bits whatever the other rows and their experts."""
    rng = np.random.default_rng(11)
    experts, n_cols, k_dim = 5, 6, 70
    w = _rand(experts, n_cols, k_dim, rng=rng)
    row = _rand(1, k_dim, rng=rng)
    results = []
    for m_rows in (1, 6, 20):
        x = _rand(m_rows, k_dim, rng=rng)
        x[0] = row[0]
        offsets, index, pairs = _routing(rng, m_rows, experts, 2)
        if (0, 2) not in pairs:  # force row 0 -> expert 2 by routing it there alone
            offsets, index, pairs = (np.array([0, 0, 0, 1, 1, 1], np.int32), np.array([0], np.int32),
                                     [(0, 2)])
        out = cuda.to_device(np.zeros((max(len(pairs), 1), n_cols), np.float32))
        lin.expert_linear(_dev(x), _dev(w), out, _dev(offsets), _dev(index))
        results.append(out.copy_to_host()[pairs.index((0, 2))])
    for got in results[1:]:
        np.testing.assert_array_equal(got, results[0])


def test_expert_slots_is_the_least_bound_of_the_tiles():
    """expert_slots(J, E, MT) is the most MT-row tiles any routing of at most J entries over E
    experts needs (brute force over every count vector), so every tile gets a slot and, at one-row
    tiles, every slot a tile (an AR step's gate | up: J slots, not 2 J)."""
    import itertools

    for experts in range(1, 5):
        for entries in range(9):
            for mt in (1, 2, 4, 8, 11):
                most = max(sum(-(-c // mt) for c in counts)
                           for counts in itertools.product(range(entries + 1), repeat=experts)
                           if sum(counts) <= entries)
                assert lin.expert_slots(entries, experts, mt) == most
    assert lin.expert_slots(4, 16, 1) == 4 and lin.expert_slots(132, 16, 8) == 30   # small: AR, 33 rows


def test_expert_busy_tiles_is_a_uniform_routings_mean():
    """expert_busy_tiles (what expert_linear's grid y is chosen for): exact at one-row tiles, never
    over expert_slots, and within 8 % of the mean tiles of uniform top-k routings of M rows
    (each row k distinct experts at random), an AR step's (one entry an expert) included; small's
    33 rows folded with the shared expert: 29 of 35 slots, its AR step's down projection 5 of 5."""
    rng = np.random.default_rng(3)
    assert lin.expert_busy_tiles(5, 17, 1) == 5 and lin.expert_busy_tiles(4, 16, 1) == 4
    for rows, experts, top_k, mt in ((33, 16, 4, 8), (16, 8, 2, 8), (10, 16, 4, 4), (64, 16, 4, 8), (9, 8, 2, 2),
                                     (1, 16, 4, 4), (1, 16, 4, 8), (2, 16, 4, 8), (4, 16, 4, 4), (1, 384, 8, 8)):
        entries = rows * top_k
        tiles = [sum(-(-c // mt) for c in np.bincount(
            np.concatenate([rng.choice(experts, top_k, replace=False) for _ in range(rows)]), minlength=experts))
            for _ in range(200)]
        busy = lin.expert_busy_tiles(entries, experts, mt)
        assert busy <= lin.expert_slots(entries, experts, mt)
        assert abs(busy - np.mean(tiles)) <= 0.08 * np.mean(tiles), (rows, experts, top_k, mt, busy, np.mean(tiles))
    assert lin.expert_busy_tiles(165, 17, 8) == 29 and lin.expert_slots(165, 17, 8) == 35
    assert lin.expert_busy_tiles(5, 17, 8) == 5 == lin.expert_slots(5, 17, 8)


def test_expert_linear_bad_device_row_index_gives_nan_row():
    x, w = _rand(2, 40), _rand(2, 3, 40)
    out = cuda.to_device(np.zeros((2, 3), np.float32))
    lin.expert_linear(_dev(x), _dev(w), out, _dev(np.array([0, 1, 2], np.int32)),
                      _dev(np.array([1, 9], np.int32)))  # device values: not checked on the host
    got = out.copy_to_host()
    assert np.all(np.isfinite(got[0])) and np.all(np.isnan(got[1]))


# --- bad input -------------------------------------------------------------------------------------

def _good():
    return _dev(_rand(2, 8)), _dev(_rand(3, 8)), cuda.to_device(np.zeros((2, 3), np.float32))


@pytest.mark.parametrize("case,exc,name", [
    (lambda x, w, o: lin.linear(x.copy_to_host().astype(np.float64), w, o), TypeError, "x"),
    (lambda x, w, o: lin.linear(x, _dev(_rand(3, 9)), o), ValueError, "x"),
    (lambda x, w, o: lin.linear(x, w, cuda.to_device(np.zeros((2, 4), np.float32))), ValueError, "out"),
    (lambda x, w, o: lin.linear(_dev(_rand(2, 16))[:, ::2], w, o), ValueError, "x"),
    (lambda x, w, o: lin.linear(x, _dev(_rand(8, 3)).T, o), ValueError, "w"),
    (lambda x, w, o: lin.linear(x, w, o, norm_weight=_dev(_rand(7))), ValueError, "norm_weight"),
    (lambda x, w, o: lin.linear(x, w, o, swiglu=True), ValueError, "x"),
    (lambda x, w, o: lin.linear(x, w, o, swiglu=1), TypeError, "swiglu"),
    (lambda x, w, o: lin.linear(x, w, o, residual=_dev(_rand(3, 3))), ValueError, "residual"),
    (lambda x, w, o: lin.linear(x, w, o, norm_weight=_dev(_rand(8)), eps=-1.0), ValueError, "eps"),
    (lambda x, w, o: lin.linear(x, w, o, norm_weight=_dev(_rand(8)), swiglu=True), ValueError, "norm_weight"),
    (lambda x, w, o: lin.linear([[1.0]], w, o), TypeError, "x"),
    (lambda x, w, o: lin.head_linear(_dev(_rand(2, 3, 8)), _dev(_rand(2, 4, 8)), o), ValueError, "x"),
    (lambda x, w, o: lin.head_linear(_dev(_rand(2, 2, 8)), _dev(_rand(2, 4, 8)), o), ValueError, "out"),
    (lambda x, w, o: lin.head_linear(_dev(_rand(2, 2, 8)), _dev(_rand(2, 4, 8)), _dev(np.zeros((2, 2, 4), np.float32)),
                                     w_kn=_dev(_rand(2, 4, 8))), ValueError, "w_kn"),
    (lambda x, w, o: lin.expert_linear(x, _dev(_rand(2, 3, 8)), o, _dev(np.array([0, 1, 2], np.int64)),
                                       _dev(np.zeros(2, np.int32))), TypeError, "row_offsets"),
    (lambda x, w, o: lin.expert_linear(x, _dev(_rand(2, 3, 8)), o, np.array([0, 2, 1], np.int32),
                                       np.zeros(2, np.int32)), ValueError, "row_offsets"),
    (lambda x, w, o: lin.expert_linear(x, _dev(_rand(2, 3, 8)), o, np.array([0, 1, 2], np.int32),
                                       np.array([0, 5], np.int32)), ValueError, "row_index"),
    (lambda x, w, o: lin.expert_linear(x, _dev(_rand(2, 3, 8)), o, np.array([0, 1, 2], np.int32),
                                       np.zeros(3, np.int32)), ValueError, "row_index"),
])
def test_bad_input_names_the_argument_and_writes_nothing(case, exc, name):
    x, w, out = _good()
    with pytest.raises(exc, match=name):
        case(x, w, out)
    assert np.all(out.copy_to_host() == 0.0)


def test_columns_and_cached_plans():
    """The 8-row tile is 8 x 8 on sm_90 only (it spills on sm_120), argmax keeps 4 columns;
    plans are cached per shape."""
    assert [lin.columns("linear", mt, "sm_90") for mt in lin.ROW_TILES] == [4, 4, 4, 8]
    assert [lin.columns("linear", mt, "sm_120") for mt in lin.ROW_TILES] == [4, 4, 4, 4]
    assert lin.columns("argmax", 8, "sm_90") == 4 and lin.columns("expert", 8, "sm_90") == 8
    assert lin.plan_linear(1056, 32768, 1024) is lin.plan_linear(1056, 32768, 1024)
    assert lin.plan_linear(1056, 32768, 1024).columns == lin.columns("linear", 8)
    assert lin.plan_linear(1056, 32768, 1024, kind="argmax").columns == 4
    with pytest.raises(ValueError, match="columns"):
        lin.get_kernel("argmax", "none", False, 8, columns=8)


@pytest.mark.parametrize("kind", ["linear", "head", "expert"])
def test_wide_tiles_are_registered_for_sm_90_only(kind):
    from ddtree_numba.kernels import registry

    wide = [k for k in registry.all_kernels() if k.name.endswith("_wide") and k.name.startswith(
        "linear_" if kind == "linear" else f"{kind}_linear")]
    assert wide and all(k.archs == ("sm_90",) for k in wide)
    assert all(k.archs is None for k in registry.all_kernels() if not k.name.endswith("_wide"))


@pytest.mark.skipif(not SIMULATED, reason="the tree reduction exists only under the simulator")
@pytest.mark.parametrize("columns", [4, 8])
@pytest.mark.parametrize("shuffles", [True, False])
def test_row_tile_width_is_layout_not_numerics(columns, shuffles):
    """8 x 4 (sm_120) and 8 x 8 (sm_90) tiles give linear's bits; K 2100: the combine path too,
    and the rows staged in 3 phases (what an 8-row tile does when its rows overflow the budget;
    the plan would take 4-row tiles here)."""
    x, w = _rand(9, 2100), _rand(11, 2100)
    assert lin.plan_linear(9, 11, 2100).mt == 4
    np.testing.assert_array_equal(
        _shuffle_linear(x, w, columns=columns, mt=8, phase_steps=4, shuffles=shuffles),
        _run_linear(x, w))


def _with_options(monkeypatch, options, call):
    """(call(), the kernels it launched) with every kernel the wrappers launch built with the
    get_kernel keyword ``options`` (their own plans, grids and prologues; the launch cache cleared
    around it)."""
    real, built = lin.get_kernel, []

    def forced(*args, **kwargs):
        built.append(real(*args, **{**kwargs, **options}))
        return built[-1]
    monkeypatch.setattr(lin, "get_kernel", forced)
    lin._setup.cache_clear()
    try:
        return call(), built
    finally:
        monkeypatch.setattr(lin, "get_kernel", real)
        lin._setup.cache_clear()


def _with_ring(monkeypatch, pipelined, call):
    """_with_options: the register weight ring ``pipelined`` or not (the async ring off, which
    would replace both; its plan's shared bytes, a superset, stay)."""
    return _with_options(monkeypatch, {"pipelined": pipelined, "ring_stages": 0}, call)


@contextlib.contextmanager
def _counting(monkeypatch, name):
    """A list that gets one entry per call of ``lin.<name>`` inside the block (under the
    simulator, where the kernels call the module's Python function; empty on a GPU)."""
    calls = []
    real = getattr(lin, name)
    if SIMULATED:
        def counted(*args):
            calls.append(1)
            return real(*args)
        monkeypatch.setattr(lin, name, counted)
    try:
        yield calls
    finally:
        monkeypatch.setattr(lin, name, real)


@contextlib.contextmanager
def _async_ring(stages):
    """The async weight ring's plans at ``stages`` slots for every row tile (0: off) inside the
    block, the module's setting restored after it."""
    previous = lin.set_async_ring(stages, 1)
    try:
        yield
    finally:
        lin.set_async_ring(*previous)


def _with_async_ring(monkeypatch, stages, call):
    """(call(), the kernels it launched, copy_async16 calls under the simulator) with
    :func:`_async_ring` at ``stages`` slots."""
    with _async_ring(stages), _counting(monkeypatch, "copy_async16") as copies:
        out, kernels = _with_options(monkeypatch, {}, call)
    return out, kernels, len(copies)


def _ring_case(kind, prologue, m_rows, n_cols, k_dim, rng):
    """A call of the wrapper of ``kind`` on fresh random inputs, its output poisoned with NaN."""
    kx = 2 * k_dim if prologue == "swiglu" else k_dim
    if kind == "head":
        x, w = _dev(_rand(m_rows, 2, k_dim, rng=rng)), _dev(_rand(2, n_cols, k_dim, rng=rng))

        def call():
            out = cuda.to_device(np.full((m_rows, 2, n_cols), np.nan, np.float32))
            return lin.head_linear(x, w, out).copy_to_host()
        return call
    if kind == "expert":
        experts = 3
        x, w = _dev(_rand(m_rows, kx, rng=rng)), _dev(_rand(experts, n_cols, k_dim, rng=rng))
        offsets, index, _ = _routing(rng, m_rows, experts, 2)

        def call():
            out = cuda.to_device(np.full((2 * m_rows, n_cols), np.nan, np.float32))
            return lin.expert_linear(x, w, out, _dev(offsets), _dev(index),
                                     swiglu=prologue == "swiglu").copy_to_host()
        return call
    x, w = _dev(_rand(m_rows, kx, rng=rng)), _dev(_rand(n_cols, k_dim, rng=rng))
    res = _rand(m_rows, n_cols, rng=rng)
    kwargs = {"swiglu": prologue == "swiglu"}
    if prologue == "rmsnorm":
        kwargs = {"norm_weight": _dev(_rand(k_dim, rng=rng)), "eps": 1e-6}

    def call():
        out = cuda.to_device(np.full((m_rows, n_cols), np.nan, np.float32))
        return lin.linear(x, w, out, residual=_dev(res), **kwargs).copy_to_host()
    return call


@pytest.mark.parametrize("kind,prologue,m_rows,n_cols,k_dim", [
    ("linear", "none", 1, 5, 2100),     # 1 x 4 tile, U 4: segments of 9 and 7 vector steps, the
                                         # ring's loop then its last 5 and 3 steps (clamped loads)
    ("linear", "rmsnorm", 5, 11, 1000),  # 8 x 8 tile, U 2: 7 vector steps (3 turns + 1), tail 104
    ("linear", "swiglu", 33, 6, 300),    # 5 tiles of 8 x 8: 2 vector steps, no full turn
    ("head", "none", 5, 7, 650),         # 8 x 8: 5 vector steps (2 turns + 1)
    ("expert", "swiglu", 5, 6, 520)])    # 8 x 8: 4 vector steps (1 turn + 2)
def test_weight_ring_is_layout_not_numerics(monkeypatch, kind, prologue, m_rows, n_cols, k_dim):
    """The pipelined weight loop (loads of the next steps before the current step's FMAs) gives
    the bits of the load-then-FMA loop; every element written (NaN-poisoned outputs). N is not a
    multiple of C, K has a tail past its 16-byte steps."""
    call = _ring_case(kind, prologue, m_rows, n_cols, k_dim, np.random.default_rng(k_dim + m_rows))
    ring, ring_kernels = _with_ring(monkeypatch, True, call)
    plain, plain_kernels = _with_ring(monkeypatch, False, call)
    assert ring_kernels and plain_kernels and not set(ring_kernels) & set(plain_kernels)
    assert not np.isnan(ring).any()
    np.testing.assert_array_equal(ring, plain)


def _with_vectors(monkeypatch, on, call):
    """_with_options: the 16-byte x reads and staging ``on`` or off (vector_x / vector_stage)."""
    return _with_options(monkeypatch, {"vector_x": on, "vector_stage": on}, call)


def _offset_case(m_rows, n_cols, k_dim, offset, rng, norm_offset=0):
    """linear() with the RMSNorm prologue on x a column slice starting ``offset`` floats into a
    wider buffer (rows off 16 bytes unless offset % 4 == 0), its weight a slice starting
    ``norm_offset`` floats into a longer vector."""
    wide, norm = _rand(m_rows, k_dim + 8, rng=rng), _rand(k_dim + 8, rng=rng)
    x, w = _dev(wide)[:, offset:offset + k_dim], _dev(_rand(n_cols, k_dim, rng=rng))
    nw = _dev(norm)[norm_offset:norm_offset + k_dim]

    def call():
        out = cuda.to_device(np.full((m_rows, n_cols), np.nan, np.float32))
        return lin.linear(x, w, out, norm_weight=nw, eps=1e-6).copy_to_host()
    return call


def _argmax_case(m_rows, n_cols, k_dim, rng):
    """linear_argmax() with the RMSNorm prologue: its parts' values and ids, side by side."""
    x, w = _dev(_rand(m_rows, k_dim, rng=rng)), _dev(_rand(n_cols, k_dim, rng=rng))
    nw = _dev(_rand(k_dim, rng=rng))
    parts = lin.argmax_parts(n_cols)

    def call():
        val = cuda.to_device(np.full((m_rows, parts), np.nan, np.float32))
        idx = cuda.to_device(np.full((m_rows, parts), -7, np.int32))
        lin.linear_argmax(x, w, val, idx, norm_weight=nw, eps=1e-6)
        return np.concatenate([val.copy_to_host(), idx.copy_to_host().astype(np.float32)], axis=1)
    return call


# (kind, prologue, M, N, K, x offset, norm offset, whether the quad staging runs under the
# simulator, which plans for the H200 with a 40 KiB staging budget)
VECTOR_CASES = [
    ("linear", "rmsnorm", 33, 11, 640, None, 0, True),    # 11 x 4 tiles: quads, (x * inv) * w
    ("linear", "rmsnorm", 33, 11, 1000, None, 0, True),   # 11 rows overflow the budget: 8 x 8 tiles
    ("linear", "swiglu", 5, 6, 300, None, 0, True),       # gate and up quads, silu(gate) * up
    ("linear", "none", 1, 5, 2100, None, 0, True),        # two K segments: quads end at a segment's end
    ("linear", "none", 1, 3, 12000, None, 0, True),       # 8 segments staged in 2 phases
    ("head", "none", 33, 7, 648, None, 0, True),          # 11-row head tiles
    ("head", "none", 5, 7, 648, None, 0, False),          # the head kind's 8 x 8 tile: x reads only
    ("expert", "swiglu", 9, 6, 520, None, 0, True),       # gathered rows, an expert's second tile
    ("argmax", "rmsnorm", 9, 40, 512, None, 0, True),     # the lm_head's ranked parts
    ("linear", "none", 3, 5, 1001, None, 0, False),       # K % 4 != 0: the scalar staging
    ("linear", "rmsnorm", 4, 9, 640, 1, 0, False),        # rows off 16 bytes: the scalar staging
    ("linear", "rmsnorm", 4, 9, 640, 4, 0, True),         # a column slice on 16 bytes: quads
    ("linear", "rmsnorm", 4, 9, 640, 4, 1, False)]        # the RMSNorm weight off 16 bytes


# (kind, prologue, M, N, K, the ring's slots, those the simulator's plan gives: its 32 KiB ring
# budget over a 40 KiB staging budget, and the ring only where a block loops over 2 or more
# column blocks with its rows staged once; the simulator's grid has one column block, so: N over
# one block's C columns)
ASYNC_RING_CASES = [
    ("linear", "none", 1, 5, 2100, 4, 4),      # two K segments of 9 and 7 vector steps, tail 52
    ("linear", "none", 1, 5, 2100, 2, 2),      # 2 slots: one step in flight
    ("linear", "rmsnorm", 33, 11, 640, 3, 3),  # 11 x 4 tiles, 5 steps, (x * inv) * w staged
    ("linear", "swiglu", 5, 20, 300, 4, 4),    # the 8 x 8 tile: 2 vector steps, fewer than the slots
    ("linear", "swiglu", 5, 6, 300, 4, 0),     # one column block: no ring
    ("linear", "none", 1, 6, 12000, 4, 0),     # rows staged in phases: no ring
    ("head", "none", 33, 7, 648, 4, 3),        # 11-row head tiles, 5 steps and a tail: 3 slots left
    ("expert", "swiglu", 9, 20, 520, 3, 3),    # gathered rows, an expert's second tile
    ("argmax", "rmsnorm", 9, 40, 512, 4, 4),   # the lm_head's ranked parts, 2 passes each
    ("linear", "none", 3, 5, 1001, 4, 0)]      # K % 4 != 0: no vector steps, no ring


@pytest.mark.parametrize("kind,prologue,m_rows,n_cols,k_dim,stages,planned", ASYNC_RING_CASES)
def test_async_weight_ring_is_layout_not_numerics(monkeypatch, kind, prologue, m_rows, n_cols, k_dim,
                                                  stages, planned):
    """The weights streamed through the async ring (cp.async into D slots a warp, D - 1 steps
    ahead) give the bits of the register loads; every element written (NaN-poisoned outputs).
    The plan gives the slots expected, and under the simulator (where a copy lands only at the
    wait that covers it, so a wrong wait count reads stale slots) the copies are counted: one
    16-byte copy a lane, column and vector step of every row tile and column group."""
    rng = np.random.default_rng(k_dim + m_rows + stages)
    call = (_argmax_case(m_rows, n_cols, k_dim, rng) if kind == "argmax"
            else _ring_case(kind, prologue, m_rows, n_cols, k_dim, rng))
    rows = m_rows if kind != "expert" else 2 * m_rows
    with _async_ring(stages):
        plan = lin.plan_linear(rows, n_cols, k_dim, kind=kind)
    assert plan.ring_stages == planned
    if k_dim == 12000:
        assert not plan.one_phase
    ring, ring_kernels, copies = _with_async_ring(monkeypatch, stages, call)
    plain, plain_kernels, plain_copies = _with_async_ring(monkeypatch, 0, call)
    assert ring_kernels and plain_kernels and (planned == 0) == (set(ring_kernels) == set(plain_kernels))
    assert not np.isnan(ring).any()
    np.testing.assert_array_equal(ring, plain)
    if SIMULATED:
        assert plain_copies == 0 and (copies > 0) == (planned > 0)
        if planned and kind != "expert":     # (an expert's tiles follow its random routing)
            tiles = -(-m_rows // plan.mt) * (2 if kind == "head" else 1)
            groups = -(-n_cols // plan.columns)
            assert copies == tiles * groups * lin.WARP * plan.columns * plan.vec_steps


@pytest.mark.skipif(not SIMULATED, reason="a hand-made launch of the simulator's one column block")
@pytest.mark.parametrize("stages", [2, 3])
def test_async_weight_ring_in_phases_is_layout_not_numerics(stages):
    """The ring with rows staged in phases (its plan never takes it; the kernel runs it unprimed,
    each phase's first copies issued at the phase's start): 8-row tiles in 3 phases of 4 steps
    over two K segments, the same bits as linear()."""
    x, w = _rand(9, 2100), _rand(11, 2100)
    np.testing.assert_array_equal(
        _shuffle_linear(x, w, columns=4, mt=8, phase_steps=4, ring_stages=stages), _run_linear(x, w))


@pytest.mark.parametrize("stages", [1, 9, -2, True, 2.0])
def test_set_async_ring_refuses_bad_stages(stages):
    with pytest.raises(ValueError, match="stages"):
        lin.set_async_ring(stages)
    with pytest.raises(ValueError, match="min_row_tile"):
        lin.set_async_ring(0, 0)


@pytest.mark.parametrize("kind,prologue,m_rows,n_cols,k_dim,offset,norm_offset,staged_in_quads", VECTOR_CASES)
def test_vector_x_reads_and_staging_are_layout_not_numerics(monkeypatch, kind, prologue, m_rows, n_cols,
                                                            k_dim, offset, norm_offset, staged_in_quads):
    """The staged rows read with one 16-byte shared load a lane and step, and staged in 16-byte
    quads where K and the rows' alignment allow (else the scalar staging), give the bits of four
    scalar reads and a float a load; every element written (NaN-poisoned outputs). Under the
    simulator the quad staging's row loads are counted: they run exactly where expected."""
    rng = np.random.default_rng(k_dim + m_rows)
    if kind == "argmax":
        call = _argmax_case(m_rows, n_cols, k_dim, rng)
    elif offset is None:
        call = _ring_case(kind, prologue, m_rows, n_cols, k_dim, rng)
    else:
        call = _offset_case(m_rows, n_cols, k_dim, offset, rng, norm_offset)
    if k_dim == 12000:
        assert not lin.plan_linear(m_rows, n_cols, k_dim).one_phase
    with _counting(monkeypatch, "load_x4") as loads:
        quads, quad_kernels = _with_vectors(monkeypatch, True, call)
        quad_loads = len(loads)
        scalar, scalar_kernels = _with_vectors(monkeypatch, False, call)
    assert quad_kernels and scalar_kernels and not set(quad_kernels) & set(scalar_kernels)
    assert not np.isnan(quads).any()
    np.testing.assert_array_equal(quads, scalar)
    if SIMULATED:
        assert (quad_loads > 0) == staged_in_quads and len(loads) == quad_loads


def _alignment_probe():
    """rows_aligned16 in a kernel over 1-, 2- and 3-D arrays and views."""
    @cuda.jit
    def probe(a, b, c, d, e, f, g, h, i, out):
        out[0] = lin.rows_aligned16(a)
        out[1] = lin.rows_aligned16(b)
        out[2] = lin.rows_aligned16(c)
        out[3] = lin.rows_aligned16(d)
        out[4] = lin.rows_aligned16(e)
        out[5] = lin.rows_aligned16(f)
        out[6] = lin.rows_aligned16(g)
        out[7] = lin.rows_aligned16(h)
        out[8] = lin.rows_aligned16(i)

    base = _dev(np.zeros((4, 24), np.float32))
    flat = _dev(np.zeros(24, np.float32))
    heads = _dev(np.zeros((2, 3, 8), np.float32))
    out = cuda.to_device(np.zeros(9, np.int32))
    probe[1, 1](base, base[:, 4:20], base[:, 1:17], _dev(np.zeros((4, 6), np.float32)), base[:, ::2],
                flat[4:], flat[1:], heads[:, :, 4:], _dev(np.zeros((2, 3, 6), np.float32)), out)
    assert out.copy_to_host().tolist() == [1, 1, 0, 0, 0, 1, 0, 1, 0]


def test_rows_aligned16_reads_pointer_and_strides():
    """The staging's alignment test: rows on 16 bytes (pointer and outer strides) with a unit
    inner stride only; 1-D weights, [M, K] rows, [M, G, K] heads."""
    _alignment_probe()


@pytest.mark.gpu
def test_gpu_rows_aligned16_reads_pointer_and_strides():
    """The same on the GPU, where the intrinsic reads the array's pointer and strides in LLVM IR."""
    _alignment_probe()


@pytest.mark.skipif(not SIMULATED, reason="the tree reduction exists only under the simulator")
def test_weight_ring_in_phases_is_layout_not_numerics():
    """Rows staged in phases of 3 steps (the ring restarts per phase: 3 vector steps of a 1-row
    tile, U 4, never a full ring turn, then 2 and a tail), through the shuffle butterfly."""
    rng = np.random.default_rng(1100)
    x, w = _rand(2, 1100, rng=rng), _rand(5, 1100, rng=rng)
    assert lin.get_kernel("linear", "none", False, 1, pipelined=True) is not \
        lin.get_kernel("linear", "none", False, 1, pipelined=False)
    ring, plain = (_shuffle_linear(x, w, mt=1, phase_steps=3, pipelined=p) for p in (True, False))
    np.testing.assert_array_equal(ring, plain)
    np.testing.assert_array_equal(ring, _run_linear(x, w))


def test_row_tile_shrinks_to_stage_once(monkeypatch):
    """MT is halved while its rows overflow the staging budget and a smaller tile fits in one
    phase; with the H200's opt-in budget 33 rows take 8-row tiles up to K 5632 and 4-row tiles
    at K 8192 (wo) where the launch does not opt into the 11-row tiles (expert and argmax kinds;
    linear and head launches take 11-row tiles where they fit: test_odd_row_tiles_pick_and_keep_the_order);
    the simulator keeps the 40 KiB default."""
    assert lin.xs_budget() == lin.XS_BUDGET_BYTES if SIMULATED else lin.xs_budget() > lin.XS_BUDGET_BYTES
    h200 = 227 * 1024 - lin.STATIC_RESERVE_BYTES
    monkeypatch.setattr(lin, "xs_budget", lambda: h200)
    lin.row_tile.cache_clear()
    try:
        assert [lin.row_tile(33, k) for k in (128, 768, 2048, 5632, 8192)] == [8, 8, 8, 8, 4]
        assert [lin.row_tile(r, 8192) for r in (1, 2, 3, 5, 1056)] == [1, 2, 4, 4, 4]
        assert lin.row_tile(33, 10**6) == 8   # nothing fits in one phase: the largest, in phases
        assert lin.row_tile(33) == 8
    finally:
        monkeypatch.undo()
        lin.row_tile.cache_clear()
    if SIMULATED:
        assert [lin.row_tile(33, k) for k in (1024, 1280, 1281, 2048, 5000)] == [8, 8, 4, 4, 2]


def test_plan_is_a_function_of_k_for_the_order():
    assert [lin.k_split(k) for k in (1, 128, 2048, 2049, 4096, 8192, 18432, 100000)] == \
        [1, 1, 1, 2, 2, 4, 8, 8]
    for rows in (1, 7, 33, 1056):
        p = lin.plan_linear(rows, 100, 5000)
        assert (p.k_split, p.seg_steps) == (4, 10)
        assert p.shared_bytes <= lin.XS_BUDGET_BYTES


@pytest.mark.parametrize("kind,prologue,residual", [("argmax", "swiglu", False), ("argmax", "none", True),
                                                     ("head", "rmsnorm", False), ("expert", "none", True),
                                                     ("dense", "none", False)])
def test_get_kernel_refuses_specialisations_that_do_not_exist(kind, prologue, residual):
    with pytest.raises(ValueError, match="no linear kernel"):
        lin.get_kernel(kind, prologue, residual, 1)


def test_every_kind_is_registered_at_its_extreme_row_tiles():
    from ddtree_numba.kernels import registry

    names = {s.name for s in registry.all_kernels()}
    assert lin.CHECKED_ROW_TILES == (min(lin.ROW_TILES), max(lin.ROW_TILES))
    for mt in lin.CHECKED_ROW_TILES:
        assert f"head_linear_mt{mt}" in names
        for p in lin.PROLOGUES:
            assert {f"linear_{p}_mt{mt}", f"linear_{p}_residual_mt{mt}"} <= names
        assert {f"expert_linear_none_mt{mt}", f"expert_linear_swiglu_mt{mt}"} <= names
        assert {f"linear_argmax_none_mt{mt}", f"linear_argmax_rmsnorm_mt{mt}"} <= names
    for mt in lin.ODD_ROW_TILES:   # the linear kind's widest prologue and the head kind
        assert {f"linear_rmsnorm_residual_mt{mt}", f"head_linear_mt{mt}"} <= names


# --- split K: per-segment products, the same bits ---------------------------------------------------

def _split_k(x, w, residual=None, alias=False):
    """linear_split_k on x [M, K], w [N, K] (re-laid by split_k_weight); ``alias``: out is the
    residual buffer."""
    g = lin.split_k_segments(w.shape[1])
    m_rows, n_cols = x.shape[0], w.shape[0]
    parts = cuda.to_device(np.full((m_rows, g, n_cols), np.nan, np.float32))
    if alias:
        out = _dev(residual)
        res = out
    else:
        out = cuda.to_device(np.full((m_rows, n_cols), np.nan, np.float32))
        res = None if residual is None else _dev(residual)
    lin.linear_split_k(_dev(x.reshape(m_rows, g, -1)), lin.split_k_weight(w), parts, out, residual=res)
    return out.copy_to_host()


@pytest.mark.parametrize("m_rows,n_cols,k_dim,residual", [
    *[(m, n, 2304, r) for m, n in ((1, 5), (9, 11)) for r in (None, "separate", "alias")],
    (33, 6, 4096, "alias"),   # five row tiles (the residual paths do not depend on K or M: CI time)
])
def test_split_k_is_linear_bit_for_bit(m_rows, n_cols, k_dim, residual):
    """K = 2 full segments (2304 = 2 x 9 steps, 4096 = 2 x 16): the head kernel's segment sums
    added in order are linear()'s output, with and without the residual (also when out is the
    residual, as the engine's wo)."""
    x, w = _rand(m_rows, k_dim), _rand(n_cols, k_dim)
    res = None if residual is None else _rand(m_rows, n_cols)
    want = _run_linear(x, w) if res is None else _run_linear(x, w, residual=_dev(res))
    np.testing.assert_array_equal(_split_k(x, w, res, alias=residual == "alias"), want)


@pytest.mark.parametrize("m_rows", [1, 9])
def test_split_k_after_swiglu_rows_is_the_swiglu_linear(m_rows):
    """The dense down_proj's split path: swiglu_rows (the prologue as its own pass) then the split
    product equals linear(..., swiglu=True) bit for bit, residual aliasing out."""
    k_dim = 2304
    h, w, res = _rand(m_rows, 2 * k_dim), _rand(7, k_dim), _rand(m_rows, 7)
    act = cuda.to_device(np.full((m_rows, k_dim), np.nan, np.float32))
    lin.swiglu_rows(_dev(h), act)
    np.testing.assert_allclose(act.copy_to_host(), _silu_mul(h, k_dim), rtol=1e-6, atol=1e-7)
    got = _split_k(act.copy_to_host(), w, res, alias=True)
    np.testing.assert_array_equal(got, _run_linear(h, w, swiglu=True, residual=_dev(res)))
    with pytest.raises(ValueError, match="out"):
        lin.swiglu_rows(_dev(h), cuda.device_array((m_rows, k_dim + 1), np.float32))


def test_split_k_segments_only_where_the_order_is_kept():
    assert lin.split_k_segments(8192) == 4 and lin.split_k_segments(2304) == 2
    assert lin.split_k_segments(5632) == 4          # 44 steps = 4 x 11
    assert lin.split_k_segments(2048) == 0          # one segment: nothing to split
    assert lin.split_k_segments(2100) == 0          # the last segment is short
    assert not lin.split_k_pays(1, 8192)            # one row stages at any K
    assert lin.split_k_pays(33, 5632)               # more than one 8-row tile
    if not SIMULATED:                               # the H200's budget: 4-row tiles at K 8192,
        assert lin.split_k_pays(33, 8192)           # and 8 rows of K 5632 stage at once
        assert not lin.split_k_pays(8, 5632)


@pytest.mark.parametrize("case,exc,name", [
    ("w_split", ValueError, "w_split"), ("x", ValueError, "x"), ("parts", ValueError, "parts"),
    ("out", ValueError, "out"), ("dtype", TypeError, "x")])
def test_split_k_bad_input_names_the_argument(case, exc, name):
    x, w = _rand(3, 2, 1152), _rand(5, 2304)
    w_split = lin.split_k_weight(w)
    args = {"x": _dev(x), "w_split": w_split, "parts": cuda.device_array((3, 2, 5), np.float32),
            "out": cuda.device_array((3, 5), np.float32)}
    if case == "w_split":
        args["w_split"] = _dev(_rand(3, 5, 768))
    elif case == "x":
        args["x"] = _dev(_rand(3, 2, 1000))
    elif case == "parts":
        args["parts"] = cuda.device_array((3, 3, 5), np.float32)
    elif case == "out":
        args["out"] = cuda.device_array((3, 4), np.float32)
    else:
        args["x"] = _dev(x.astype(np.float64))
    with pytest.raises(exc, match=name):
        lin.linear_split_k(args.pop("x"), args.pop("w_split"), args.pop("parts"), args.pop("out"))
    with pytest.raises(ValueError, match="w"):
        lin.split_k_weight(_rand(5, 2100))


# --- GPU: small-preset shapes ----------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("n_cols,k_dim,prologue", [(32768, 2048, "rmsnorm"), (11264, 2048, "none"),
                                                    (12288, 768, "none"), (2048, 5632, "swiglu"),
                                                    (2048, 8192, "none"), (1344, 2048, "rmsnorm"),
                                                    (2048, 256, "swiglu"), (512, 2048, "none")])
def test_gpu_small_preset_shapes(n_cols, k_dim, prologue):
    """Every row count stages its rows once (opt-in shared memory above 48 KiB: 8 x 2048 and
    8 x 5632 rows; 4-row tiles at K 8192), every element is written, and each row keeps its
    bits alone and in 4, 16, 33 and 1056 rows (also w_a, N 1344, and the shared expert's w2, K
    256: two weight steps, one short load round at one row; its w13, N 512: H200, 5 x 8 blocks at
    33 rows)."""
    rng = np.random.default_rng(n_cols + k_dim)
    w = _rand(n_cols, k_dim, rng=rng)
    d_w = _dev(w)
    kx = 2 * k_dim if prologue == "swiglu" else k_dim
    x_all = _rand(1056, kx, rng=rng)
    nw = _rand(k_dim, rng=rng)
    kwargs = {"swiglu": prologue == "swiglu"}
    if prologue == "rmsnorm":
        kwargs = {"norm_weight": _dev(nw), "eps": 1e-6}
    alone = {}
    for m_rows in (1, 4, 16, 33, 1056):
        out = cuda.to_device(np.full((m_rows, n_cols), np.nan, np.float32))
        lin.linear(_dev(x_all[:m_rows]), d_w, out, **kwargs)
        got = out.copy_to_host()
        assert lin.plan_linear(m_rows, n_cols, k_dim).one_phase
        assert not np.isnan(got).any()
        if m_rows == 1:
            alone = got[0]
        else:
            np.testing.assert_array_equal(got[0], alone)
        check = [0, m_rows - 1]
        inp = x_all[check]
        inp = (_silu_mul(inp, k_dim) if prologue == "swiglu" else
               _rms(inp, nw, 1e-6) if prologue == "rmsnorm" else inp)
        _assert_close(got[check], inp, w)


@pytest.mark.gpu
@pytest.mark.parametrize("m_rows", [9, 33])
def test_gpu_split_k_dense_w2_is_linear_bit_for_bit(m_rows):
    """The dense down_proj of `small` (2048 x 5632, SwiGLU prologue): swiglu_rows then the split
    product equals linear(..., swiglu=True), residual aliasing out."""
    rng = np.random.default_rng(m_rows + 1)
    h, w, res = _rand(m_rows, 2 * 5632, rng=rng), _rand(2048, 5632, rng=rng), _rand(m_rows, 2048, rng=rng)
    assert lin.split_k_pays(m_rows, 5632)
    act = cuda.device_array((m_rows, 5632), np.float32)
    lin.swiglu_rows(_dev(h), act)
    got = _split_k(act.copy_to_host(), w, res, alias=True)
    assert not np.isnan(got).any()
    np.testing.assert_array_equal(got, _run_linear(h, w, swiglu=True, residual=_dev(res)))


@pytest.mark.gpu
@pytest.mark.parametrize("m_rows", [33, 264])
def test_gpu_split_k_wo_is_linear_bit_for_bit(m_rows):
    """wo of `small` (2048 x 8192) at a B 32 tree and 8 of them: the split product (8-row tiles
    of 4 segments) equals linear() (4-row tiles), residual aliasing out, every element written."""
    rng = np.random.default_rng(m_rows)
    x, w, res = _rand(m_rows, 8192, rng=rng), _rand(2048, 8192, rng=rng), _rand(m_rows, 2048, rng=rng)
    assert lin.split_k_pays(m_rows, 8192)
    got = _split_k(x, w, res, alias=True)
    assert not np.isnan(got).any()
    np.testing.assert_array_equal(got, _run_linear(x, w, residual=_dev(res)))


@pytest.mark.gpu
@pytest.mark.parametrize("kind,prologue,m_rows,n_cols,k_dim", [
    ("linear", "rmsnorm", 33, 1344, 2048),   # w_a: 11-row tiles, quads with x * inv * w
    ("linear", "none", 1, 12288, 768),       # w_q at an AR step
    ("linear", "swiglu", 33, 2048, 256),     # the shared expert's w2
    ("expert", "swiglu", 33, 2048, 256),     # the routed experts' down projection (8 x 8 tile)
    ("head", "none", 33, 512, 128)])         # 11-row head tiles
def test_gpu_vector_x_reads_and_staging_are_layout_not_numerics(monkeypatch, kind, prologue, m_rows, n_cols,
                                                                k_dim):
    """On the GPU (where the 16-byte shared loads and stores are real): small's shapes give the
    same bits with the quads on and off, every element written."""
    call = _ring_case(kind, prologue, m_rows, n_cols, k_dim, np.random.default_rng(n_cols + k_dim))
    quads, _ = _with_vectors(monkeypatch, True, call)
    scalar, _ = _with_vectors(monkeypatch, False, call)
    assert not np.isnan(quads).any()
    np.testing.assert_array_equal(quads, scalar)


@pytest.mark.gpu
@pytest.mark.parametrize("kind,prologue,m_rows,n_cols,k_dim", [
    ("linear", "none", 33, 12288, 768),      # w_q: 11-row tiles, 4 slots, ~9 column blocks a block
    ("linear", "none", 1, 12288, 768),       # w_q at an AR step (the ring's 1-row tile, off by default)
    ("linear", "rmsnorm", 33, 11264, 2048),  # the dense gate | up
    ("linear", "swiglu", 33, 2048, 256),     # the shared expert's w2
    ("expert", "swiglu", 33, 2048, 256),     # the routed experts' down projection (8 x 8 tile, 3 slots)
    ("argmax", "rmsnorm", 33, 32768, 2048)])  # the lm_head's ranked parts
def test_gpu_async_weight_ring_is_layout_not_numerics(monkeypatch, kind, prologue, m_rows, n_cols, k_dim):
    """On the GPU (real cp.async copies and waits): small's shapes that the ring's plan takes give
    the same bits with the async weight ring (4 slots, every row tile) and without it, every
    element written."""
    rng = np.random.default_rng(n_cols + k_dim + m_rows)
    call = (_argmax_case(m_rows, n_cols, k_dim, rng) if kind == "argmax"
            else _ring_case(kind, prologue, m_rows, n_cols, k_dim, rng))
    with _async_ring(4):
        assert kind == "expert" or lin.plan_linear(m_rows, n_cols, k_dim, kind=kind).ring_stages > 0
    ring, ring_kernels, _ = _with_async_ring(monkeypatch, 4, call)
    plain, plain_kernels, _ = _with_async_ring(monkeypatch, 0, call)
    assert set(ring_kernels) != set(plain_kernels)   # the ring ran (the expert case included)
    assert not np.isnan(ring).any()
    np.testing.assert_array_equal(ring, plain)


@pytest.mark.gpu
def test_gpu_expert_and_head_shapes():
    rng = np.random.default_rng(3)
    experts, n_cols, k_dim, top_k, m_rows = 16, 512, 2048, 4, 1056
    w = _rand(experts, n_cols, k_dim, rng=rng)
    x = _rand(m_rows, k_dim, rng=rng)
    offsets, index, pairs = _routing(rng, m_rows, experts, top_k)
    out = cuda.to_device(np.full((m_rows * top_k, n_cols), np.nan, np.float32))
    lin.expert_linear(_dev(x), _dev(w), out, _dev(offsets), _dev(index))
    got = out.copy_to_host()
    for j in rng.choice(len(pairs), 16, replace=False):
        m, e = pairs[j]
        _assert_close(got[j:j + 1], x[m:m + 1], w[e])
        np.testing.assert_array_equal(got[j], _run_linear(x[m:m + 1], w[e])[0])
    q = _rand(33, 64, 192, rng=rng)
    wk = _rand(64, 512, 128, rng=rng)
    out = cuda.to_device(np.full((33, 64, 512), np.nan, np.float32))
    lin.head_linear(_dev(q)[:, :, :128], _dev(wk), out)
    got = out.copy_to_host()
    for g in (0, 63):
        _assert_close(got[:, g], q[:, g, :128], wk[g])
